// Activations quantized to 8 bits per 32 values, the form both integer-dot kernels (int4_q8.cpp,
// int8g_q8.cpp) read, and what else the two share: the tile loop over rows and panels, a group's
// float terms and the stores; the contract is tandem_kernels.gguf_reference.quantize_q8_groups: per 32-wide
// group, a = max |x|, s = a / 127, q = round_half_even(x * (127 / a)) in [-127, 127], in fp32 (all zero
// where a = 0; a group holding a NaN gets s = NaN, so its row's outputs are NaN).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "int4_vec.h"  // load_x16: 16 float or bf16 values as floats; simd.h, common.h, the intrinsics

namespace tandem {
namespace {

constexpr int64_t kQ8Group = 32;  // activations per scale
constexpr int64_t kQ8PanelCols = 8;  // output columns a weight panel interleaves: one vector of fp32 lanes
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define TANDEM_Q8_VNNI 1             // vpdpbusd: a chunk's products straight into int32 sums
constexpr int64_t kQ8TileRows = 8;   // 32 vector registers hold 8 rows' sums
#else
constexpr int64_t kQ8TileRows = 4;
#endif
constexpr int64_t kQ8BlockBytes = 1 << 17;  // the quantized rows of x one pass over the panels reads

// x's rows, quantized: q [M, K] int8 and, per run of sum_width values (32, or 16 to match a weight
// layout's groups), s [M, K / sum_width, 2] = (s of the 32-group holding the run, s * the run's sum of
// q): the two factors a group's terms need.
struct QuantizedRows {
  std::vector<int8_t> q;
  std::vector<float> s;
  int64_t k_size = 0, groups = 0;  // groups: runs per row, K / sum_width
};

template <typename T>
inline float as_float(T v) { return static_cast<float>(v); }

#if defined(TANDEM_INT4_AVX2)
inline int32_t hsum8_epi32(__m256i v) {
  const __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  const __m128i t = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1)));
}
#endif

// One group of 32 values: the reference's arithmetic (fp32, round half to even). Returns s; half_sums
// gets the sums of q over [0, 16) and [16, 32).
template <typename T>
inline float quantize_group(const T* x, int8_t* q, int32_t* half_sums) {
  half_sums[0] = half_sums[1] = 0;
#if defined(__AVX512F__)
  // Two 16-lane vectors, the same arithmetic: an exact max, the same product, rounded to nearest
  // even by the conversion, clamped (a NaN product, inf * 0, converts to INT_MIN and clamps to -127,
  // as the plain loop's max(-127, NaN) gives). The same for AVX2 below.
  const __m512 v0 = load_x16(x), v1 = load_x16(x + 16);
  const bool nan = (_mm512_cmp_ps_mask(v0, v0, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(v1, v1, _CMP_UNORD_Q)) != 0;
  const float a = nan ? 0.0f : _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
#elif defined(TANDEM_INT4_AVX2)
  // Four 8-lane vectors, the same arithmetic (the conversion rounds in the current mode, as nearbyint).
  const v16 first = load_x16(x), second = load_x16(x + 16);
  const __m256 v[4] = {first.a, first.b, second.a, second.b};
  int unordered = 0;
  __m256 top = _mm256_setzero_ps();
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  for (int j = 0; j < 4; ++j) {
    unordered |= _mm256_movemask_ps(_mm256_cmp_ps(v[j], v[j], _CMP_UNORD_Q));
    top = _mm256_max_ps(top, _mm256_and_ps(v[j], magnitude));
  }
  const bool nan = unordered != 0;
  float lanes[8];
  _mm256_storeu_ps(lanes, top);
  const float a = nan ? 0.0f : *std::max_element(lanes, lanes + 8);
#else
  float a = 0.0f;
  bool nan = false;
  for (int64_t i = 0; i < kQ8Group; ++i) {
    const float v = as_float(x[i]);
    nan |= v != v;
    a = std::max(a, std::fabs(v));
  }
#endif
  if (nan || !(a > 0.0f)) {  // all zero; or a NaN, passed on to the row's outputs through s
    std::memset(q, 0, kQ8Group);
    return nan ? std::numeric_limits<float>::quiet_NaN() : 0.0f;
  }
  const float inv = 127.0f / a;
#if defined(__AVX512F__)
  const __m512 scale = _mm512_set1_ps(inv);
  const __m512i low = _mm512_set1_epi32(-127), high = _mm512_set1_epi32(127);
  const __m512i q0 = _mm512_max_epi32(low, _mm512_min_epi32(high, _mm512_cvt_roundps_epi32(
      _mm512_mul_ps(v0, scale), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)));
  const __m512i q1 = _mm512_max_epi32(low, _mm512_min_epi32(high, _mm512_cvt_roundps_epi32(
      _mm512_mul_ps(v1, scale), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(q0));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(q1));
  half_sums[0] = _mm512_reduce_add_epi32(q0);
  half_sums[1] = _mm512_reduce_add_epi32(q1);
#elif defined(TANDEM_INT4_AVX2)
  const __m256 scale = _mm256_set1_ps(inv);
  const __m256i low = _mm256_set1_epi32(-127), high = _mm256_set1_epi32(127);
  __m256i qv[4];
  for (int j = 0; j < 4; ++j)
    qv[j] = _mm256_max_epi32(low, _mm256_min_epi32(high, _mm256_cvtps_epi32(_mm256_mul_ps(v[j], scale))));
  // Packed to bytes (no saturation: all within [-127, 127]); the packs interleave 128-bit lanes, the
  // permutation restores the order.
  const __m256i bytes = _mm256_permutevar8x32_epi32(
      _mm256_packs_epi16(_mm256_packs_epi32(qv[0], qv[1]), _mm256_packs_epi32(qv[2], qv[3])),
      _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), bytes);
  half_sums[0] = hsum8_epi32(_mm256_add_epi32(qv[0], qv[1]));
  half_sums[1] = hsum8_epi32(_mm256_add_epi32(qv[2], qv[3]));
#else
  for (int64_t i = 0; i < kQ8Group; ++i) {
    const float r = std::nearbyint(as_float(x[i]) * inv);  // the default rounding: to nearest even
    q[i] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, r)));
    half_sums[i / 16] += q[i];
  }
#endif
  return a / 127.0f;
}

// x's rows quantized; the sums in s are over runs of sum_width values, 16 or 32.
template <typename T>
QuantizedRows quantize_rows(const T* x, int64_t x_stride, int64_t m_size, int64_t k_size, int64_t sum_width) {
  QuantizedRows r;
  r.k_size = k_size;
  r.groups = k_size / sum_width;
  r.q.resize(m_size * k_size);
  r.s.resize(m_size * r.groups * 2);
  const int64_t groups32 = k_size / kQ8Group, runs = kQ8Group / sum_width;
  at::parallel_for(0, m_size * groups32, 256, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t m = t / groups32, g = t % groups32;
      int8_t* q = r.q.data() + m * k_size + g * kQ8Group;
      int32_t half_sums[2];
      const float s = quantize_group(x + m * x_stride + g * kQ8Group, q, half_sums);
      float* out = r.s.data() + (m * r.groups + g * runs) * 2;
      if (runs == 1) {
        out[0] = s;
        out[1] = s * static_cast<float>(half_sums[0] + half_sums[1]);
      } else {
        for (int64_t run = 0; run < 2; ++run) {
          out[2 * run] = s;
          out[2 * run + 1] = s * static_cast<float>(half_sums[run]);
        }
      }
    }
  });
  return r;
}

// out[row, n0 + j] = acc[j] + bias[n0 + j], for the tile's `width` columns below N.
template <typename T>
inline void store_panel_row(T* out, int64_t n_size, int64_t row, int64_t n0, const float* acc, const float* bias,
                            int64_t width = kQ8PanelCols) {
  const int64_t cols = std::min(width, n_size - n0);
  for (int64_t j = 0; j < cols; ++j) out[row * n_size + n0 + j] = static_cast<T>(acc[j] + (bias ? bias[n0 + j] : 0.0f));
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
inline int32_t four_bytes(const int8_t* q) {
  int32_t v;
  std::memcpy(&v, q, sizeof v);
  return v;
}
inline __m256i broadcast4(const int8_t* q) { return _mm256_set1_epi32(four_bytes(q)); }  // 4 activations a lane

// The vectors of a tile of NP adjacent panels (8 NP columns: lane l is the tile's column l, panel
// l / 8's column l % 8): one 256-bit vector for one panel, one 512-bit vector for two where the
// target has AVX-512 VNNI. A lane's arithmetic is the same in both, so a result does not depend on
// the tile it was computed in. Loads take the first panel's address and the distance to the next
// panel's same place (`stride`, in elements).
template <int NP>
struct Q8Lanes;

template <>
struct Q8Lanes<1> {
  using I = __m256i;
  using F = __m256;
  static I zero() { return _mm256_setzero_si256(); }
  static F zero_f() { return _mm256_setzero_ps(); }
  static I load_bytes(const uint8_t* p, int64_t) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static I broadcast(const int8_t* q) { return broadcast4(q); }
  static I low_nibbles(I v) { return _mm256_and_si256(v, _mm256_set1_epi8(15)); }
  static I high_nibbles(I v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(15)); }
  static F load_scales(const uint16_t* half_bits, int64_t) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(half_bits)));
  }
  static F load_scales(const float* v, int64_t) { return _mm256_loadu_ps(v); }
  static F splat(float v) { return _mm256_set1_ps(v); }
  static F to_float(I v) { return _mm256_cvtepi32_ps(v); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
#if defined(TANDEM_Q8_VNNI)
  static I dpbusd(I acc, I u8, I s8) { return _mm256_dpbusd_epi32(acc, u8, s8); }
  static I add(I a, I b) { return _mm256_add_epi32(a, b); }
#endif
};

#if defined(TANDEM_Q8_VNNI)
#define TANDEM_Q8_PANEL_PAIRS 1
template <>
struct Q8Lanes<2> {
  using I = __m512i;
  using F = __m512;
  static I zero() { return _mm512_setzero_si512(); }
  static F zero_f() { return _mm512_setzero_ps(); }
  static I load_bytes(const uint8_t* p, int64_t stride) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(Q8Lanes<1>::load_bytes(p, 0)), Q8Lanes<1>::load_bytes(p + stride, 0), 1);
  }
  static I broadcast(const int8_t* q) { return _mm512_set1_epi32(four_bytes(q)); }
  static I low_nibbles(I v) { return _mm512_and_si512(v, _mm512_set1_epi8(15)); }
  static I high_nibbles(I v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(15)); }
  static F load_scales(const uint16_t* half_bits, int64_t stride) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(half_bits));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(half_bits + stride));
    return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(a), b, 1));
  }
  static F load_scales(const float* v, int64_t stride) {
    return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(v)), _mm256_loadu_ps(v + stride), 1);
  }
  static F splat(float v) { return _mm512_set1_ps(v); }
  static F to_float(I v) { return _mm512_cvtepi32_ps(v); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
  static I dpbusd(I acc, I u8, I s8) { return _mm512_dpbusd_epi32(acc, u8, s8); }
  static I add(I a, I b) { return _mm512_add_epi32(a, b); }
};
constexpr int kQ8TilePanels = 2;
#else
constexpr int kQ8TilePanels = 1;
#endif

// One weight group's terms for MT rows, in the kernels' order: acc = fma(float(dot), w_scale * s, acc),
// then acc = fma(w_min, s * xs, acc). dot: each row's columns' exact integer dots; sc: the first
// row's (s, s * xs) for the group, each next row's sc_stride floats on.
template <int MT, typename L>
inline void add_group_terms(typename L::F* acc, const typename L::I* dot, typename L::F w_scale,
                            typename L::F w_min, const float* sc, int64_t sc_stride) {
  for (int i = 0; i < MT; ++i, sc += sc_stride) {
    acc[i] = L::fma(L::to_float(dot[i]), L::mul(w_scale, L::splat(sc[0])), acc[i]);
    acc[i] = L::fma(w_min, L::splat(sc[1]), acc[i]);
  }
}

template <int MT, int NP, typename T>
inline void store_panel_tile(T* out, int64_t n_size, int64_t m0, int64_t n0, const typename Q8Lanes<NP>::F* acc,
                             const float* bias) {
  for (int i = 0; i < MT; ++i) {
    float lanes[NP * kQ8PanelCols];
    Q8Lanes<NP>::store(lanes, acc[i]);
    store_panel_row(out, n_size, m0 + i, n0, lanes, bias, NP * kQ8PanelCols);
  }
}
#else
constexpr int kQ8TilePanels = 1;
#endif

// Calls tile(std::integral_constant<int, MT>(), m0) for rows b0 .. b1 - 1, MT <= kQ8TileRows at a time.
template <typename RowTile>
inline void for_each_row_tile(int64_t b0, int64_t b1, const RowTile& tile) {
  constexpr int64_t rows = kQ8TileRows;
  for (int64_t m0 = b0; m0 < b1; m0 += rows) {
    switch (std::min(rows, b1 - m0)) {
#if defined(TANDEM_Q8_VNNI)
      case 8: tile(std::integral_constant<int, 8>(), m0); break;
      case 7: tile(std::integral_constant<int, 7>(), m0); break;
      case 6: tile(std::integral_constant<int, 6>(), m0); break;
      case 5: tile(std::integral_constant<int, 5>(), m0); break;
#endif
      case 4: tile(std::integral_constant<int, 4>(), m0); break;
      case 3: tile(std::integral_constant<int, 3>(), m0); break;
      case 2: tile(std::integral_constant<int, 2>(), m0); break;
      default: tile(std::integral_constant<int, 1>(), m0); break;
    }
  }
}

// Calls tile(std::integral_constant<int, MT>(), std::integral_constant<int, NP>(), m0, p) for rows
// m0 .. m0 + MT - 1 (MT <= kQ8TileRows) against panels p .. p + NP - 1 (NP = kQ8TilePanels, or 1 for
// an odd last panel), over all M rows and all panels: rows in blocks whose quantized bytes (K a row)
// stay in cache while every panel passes over them, a tile's panels in cache while its block's rows
// pass. Threads take runs of tiles. No software prefetch: each thread reads its panels in order, which
// the hardware prefetchers follow; prefetching the whole panel after next (10 KB at K = 2048) held one
// row's read of weights from memory to 18-25 GB/s on an AVX-512 Zen-class EPYC, 33-36 without it.
template <typename Tile>
void for_each_panel_tile(int64_t m_size, int64_t k_size, int64_t panels, const Tile& tile) {
  constexpr int64_t rows = kQ8TileRows;
  constexpr int64_t np = kQ8TilePanels;
  const int64_t block_rows = std::max<int64_t>(rows, kQ8BlockBytes / k_size / rows * rows);
  const int64_t tiles = (panels + np - 1) / np;
  for (int64_t b0 = 0; b0 < m_size; b0 += block_rows) {
    const int64_t b1 = std::min(m_size, b0 + block_rows);
    at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const int64_t p = t * np;
        if (p + np <= panels)
          for_each_row_tile(b0, b1, [&](auto mt, int64_t m0) { tile(mt, std::integral_constant<int, np>(), m0, p); });
        else
          for_each_row_tile(b0, b1, [&](auto mt, int64_t m0) { tile(mt, std::integral_constant<int, 1>(), m0, p); });
      }
    });
  }
}

}  // namespace
}  // namespace tandem
