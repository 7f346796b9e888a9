// int4_linear's 16-lane vectors: 16 floats (lane j of a group's half holds element j), their loads
// and stores, the fixed-tree lane sum, one 32-weight group's dequantization and the bf16 rounding,
// for three targets:
//     AVX-512   one __m512 (products fused: fma16)
//     AVX2      two __m256 halves, lanes 0..7 and 8..15, in intrinsics (GCC keeps them in
//               registers, where its 16-lane generic vectors went through memory); products fused
//     other     GCC's 16-lane generic vectors, multiplied and added apart
// fma16_exact(a, b, c) is for products known exact (bf16 x bf16): fused where FMA exists, which
// then gives the same bits as apart.
#pragma once

#include "simd.h"

namespace tandem {
namespace {

using vu8x16 = uint8_t __attribute__((vector_size(16)));

#if defined(__AVX512F__)
using v16 = __m512;
inline v16 zero16() { return _mm512_setzero_ps(); }
inline v16 fma16(v16 a, v16 b, v16 c) { return _mm512_fmadd_ps(a, b, c); }
inline v16 fma16_exact(v16 a, v16 b, v16 c) { return _mm512_fmadd_ps(a, b, c); }
inline v16 load_x16(const float* p) { return _mm512_loadu_ps(p); }
inline v16 load_x16(const c10::BFloat16* p) {  // bf16 -> float is exact: the bits, 16 places up
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
inline void store_x16(float* p, v16 v) { _mm512_storeu_ps(p, v); }
inline float hsum16(v16 v) { return _mm512_reduce_add_ps(v); }
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define TANDEM_INT4_AVX2 1
struct v16 {
  __m256 a, b;  // lanes [0, 8), [8, 16)
};
inline v16 zero16() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline v16 fma16(v16 a, v16 b, v16 c) { return {_mm256_fmadd_ps(a.a, b.a, c.a), _mm256_fmadd_ps(a.b, b.b, c.b)}; }
inline v16 fma16_exact(v16 a, v16 b, v16 c) { return fma16(a, b, c); }
inline v16 load_x16(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline __m256 bf16x8_to_float(const c10::BFloat16* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
inline v16 load_x16(const c10::BFloat16* p) { return {bf16x8_to_float(p), bf16x8_to_float(p + 8)}; }
inline void store_x16(float* p, v16 v) {
  _mm256_storeu_ps(p, v.a);
  _mm256_storeu_ps(p + 8, v.b);
}
inline float hsum16(v16 v) {  // the generic build's tree: ((t0 + t4) + (t2 + t6)) + ((t1 + t5) + (t3 + t7))
  const __m256 t = _mm256_add_ps(v.a, v.b);                                          // t[i] = s[i] + s[i + 8]
  const __m128 u = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));  // t[i] + t[i + 4]
  const __m128 w = _mm_add_ps(u, _mm_movehl_ps(u, u));                                // u0 + u2, u1 + u3
  return _mm_cvtss_f32(_mm_add_ss(w, _mm_movehdup_ps(w)));
}
#else
using v16 = vf16;
inline v16 zero16() { return vf16{}; }
inline v16 fma16(v16 a, v16 b, v16 c) { return a * b + c; }
inline v16 fma16_exact(v16 a, v16 b, v16 c) { return a * b + c; }
template <typename T>
inline v16 load_x16(const T* p) { return load16f(p); }
inline void store_x16(float* p, v16 v) { store16(p, v); }
inline float hsum16(v16 v) {
  float s[16];
  std::memcpy(s, &v, sizeof s);
  float t[8];
  for (int i = 0; i < 8; ++i) t[i] = s[i] + s[i + 8];
  return ((t[0] + t[4]) + (t[2] + t[6])) + ((t[1] + t[5]) + (t[3] + t[7]));
}
#endif

inline float half_bits_to_float(uint16_t bits) {
#if defined(__F16C__)
  return _cvtsh_ss(bits);
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

// A group's (d, m) from fp16 bits (int4) or floats (int4f): as two floats, or with F16C as the
// low lanes of a vector (d, m, 0, 0), one conversion for both.
inline float scale_value(uint16_t bits) { return half_bits_to_float(bits); }
inline float scale_value(float v) { return v; }
#if defined(__F16C__)
inline __m128 scale_pair(const uint16_t* dm) {
  uint32_t pair;
  std::memcpy(&pair, dm, sizeof pair);
  return _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(pair)));
}
inline __m128 scale_pair(const float* dm) {  // _mm_loadl_epi64 reads through a may-alias type
  return _mm_castsi128_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(dm)));
}
#endif

// One group's 32 weights as floats: lo = elements [0, 16), hi = [16, 32); dm its (d, m), fp16 bits
// or floats. d * q is exact for every d the loaders make (fp16 d: 11 + 4 significant bits; int4f's
// Q4_K d * sc, 17 + 4; AWQ / GPTQ's fp16 scales), so fused or not, each weight is the one rounding
// of d * q + m.
template <typename S>
inline void dequant_group(const uint8_t* q, const S* dm, v16& lo, v16& hi) {
#if defined(__AVX512F__)
  const __m128 dm4 = scale_pair(dm);
  const __m512 d = _mm512_broadcastss_ps(dm4), m = _mm512_broadcastss_ps(_mm_movehdup_ps(dm4));
  const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
  lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(bytes, _mm512_set1_epi32(15))), d, m);
  hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4)), d, m);
#elif defined(TANDEM_INT4_AVX2)
  const __m128 dm4 = scale_pair(dm);
  const __m256 d = _mm256_broadcastss_ps(dm4), m = _mm256_broadcastss_ps(_mm_movehdup_ps(dm4));
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  const __m256i b0 = _mm256_cvtepu8_epi32(bytes), b1 = _mm256_cvtepu8_epi32(_mm_unpackhi_epi64(bytes, bytes));
  const __m256i low = _mm256_set1_epi32(15);
  lo.a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(b0, low)), d, m);
  lo.b = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(b1, low)), d, m);
  hi.a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4)), d, m);
  hi.b = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4)), d, m);
#else
  vu8x16 bytes;
  std::memcpy(&bytes, q, sizeof bytes);
  const vi16 wide = __builtin_convertvector(bytes, vi16);
  const vf16 d = vf16{} + scale_value(dm[0]), m = vf16{} + scale_value(dm[1]);
  lo = __builtin_convertvector(wide & 15, vf16) * d + m;
  hi = __builtin_convertvector(wide >> 4, vf16) * d + m;
#endif
}

#if defined(TANDEM_INT4_AVX2)
// 8 floats rounded to bf16 as round16 does (to nearest even; NaN -> the quiet NaN 0x7FC00000).
inline __m256 round_bf16x8(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i up = _mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF)));
  const __m256 r = _mm256_castsi256_ps(_mm256_and_si256(up, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
  return _mm256_blendv_ps(r, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)), _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
}
#endif

// v's floats rounded to bf16 (to nearest even; the weights are finite), as floats.
inline v16 round_bf16(v16 v) {
#if defined(__AVX512F__)
  const __m512i u = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i up = _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  return _mm512_castsi512_ps(_mm512_and_si512(up, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
#elif defined(TANDEM_INT4_AVX2)
  return {round_bf16x8(v.a), round_bf16x8(v.b)};
#else
  return round16<c10::BFloat16>(v);
#endif
}

}  // namespace
}  // namespace tandem
