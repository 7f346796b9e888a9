// exp and SiLU of 16 floats in an AVX-512 register, shared by attention's softmax
// (attention_avx512_tiles.h), silu_and_mul (elementwise.cpp) and the gated AMX linear's epilogue
// (amx_linear.cpp), so they compute the same bits.
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

// Cephes' single-precision polynomial (~1 ulp for x in [-87, 88]), with fused multiply-adds, and
// vscalefps applying 2^n (so no clamping: far below the range gives 0, far above inf).
inline __m512 exp16(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  for (const float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

// silu(x) = x / (1 + exp(-x)), unrounded (-x: the sign bit flipped).
inline __m512 silu16(__m512 x) {
  const __m512 minus_x = _mm512_castsi512_ps(
      _mm512_xor_si512(_mm512_castps_si512(x), _mm512_set1_epi32(static_cast<int>(0x80000000u))));
  return _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(minus_x)));
}
#endif
