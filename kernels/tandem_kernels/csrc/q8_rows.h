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

#include "simd.h"  // common.h, and the vector intrinsics where the target has them

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

// One group of 32 values: the reference's arithmetic (fp32, round half to even). Returns s.
template <typename T>
inline float quantize_group(const T* x, int8_t* q) {
  float a = 0.0f;
  bool nan = false;
  for (int64_t i = 0; i < kQ8Group; ++i) {
    const float v = as_float(x[i]);
    nan |= v != v;
    a = std::max(a, std::fabs(v));
  }
  if (nan || !(a > 0.0f)) {  // all zero; or a NaN, passed on to the row's outputs through s
    std::memset(q, 0, kQ8Group);
    return nan ? std::numeric_limits<float>::quiet_NaN() : 0.0f;
  }
  const float inv = 127.0f / a;
  for (int64_t i = 0; i < kQ8Group; ++i) {
    const float r = std::nearbyint(as_float(x[i]) * inv);  // the default rounding: to nearest even
    q[i] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, r)));
  }
  return a / 127.0f;
}

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
      const float s = quantize_group(x + m * x_stride + g * kQ8Group, q);
      for (int64_t run = 0; run < runs; ++run) {
        int32_t sum = 0;
        for (int64_t i = run * sum_width; i < (run + 1) * sum_width; ++i) sum += q[i];
        float* out = r.s.data() + (m * r.groups + g * runs + run) * 2;
        out[0] = s;
        out[1] = s * static_cast<float>(sum);
      }
    }
  });
  return r;
}

// out[row, n0 + j] = acc[j] + bias[n0 + j], for the panel's columns below N.
template <typename T>
inline void store_panel_row(T* out, int64_t n_size, int64_t row, int64_t n0, const float* acc, const float* bias) {
  const int64_t cols = std::min(kQ8PanelCols, n_size - n0);
  for (int64_t j = 0; j < cols; ++j) out[row * n_size + n0 + j] = static_cast<T>(acc[j] + (bias ? bias[n0 + j] : 0.0f));
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
inline __m256 load8(const uint16_t* half_bits) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(half_bits)));
}
inline __m256 load8(const float* v) { return _mm256_loadu_ps(v); }

inline __m256i broadcast4(const int8_t* q) {  // 4 activations in every 32-bit lane
  int32_t v;
  std::memcpy(&v, q, sizeof v);
  return _mm256_set1_epi32(v);
}

// One weight group's terms for MT rows, in the kernels' order: acc = fma(float(dot), w_scale * s, acc),
// then acc = fma(w_min, s * xs, acc). dot: each row's 8 columns' exact integer dots; sc: the first
// row's (s, s * xs) for the group, each next row's sc_stride floats on.
template <int MT>
inline void add_group_terms(__m256* acc, const __m256i* dot, __m256 w_scale, __m256 w_min, const float* sc,
                            int64_t sc_stride) {
  for (int i = 0; i < MT; ++i, sc += sc_stride) {
    acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[i]), _mm256_mul_ps(w_scale, _mm256_set1_ps(sc[0])), acc[i]);
    acc[i] = _mm256_fmadd_ps(w_min, _mm256_set1_ps(sc[1]), acc[i]);
  }
}

template <int MT, typename T>
inline void store_panel_tile(T* out, int64_t n_size, int64_t m0, int64_t n0, const __m256* acc, const float* bias) {
  for (int i = 0; i < MT; ++i) {
    float lanes[kQ8PanelCols];
    _mm256_storeu_ps(lanes, acc[i]);
    store_panel_row(out, n_size, m0 + i, n0, lanes, bias);
  }
}
#endif

// Calls tile(std::integral_constant<int, MT>(), m0, p) for rows m0 .. m0 + MT - 1 (MT <= kQ8TileRows)
// against panel p, over all M rows and all panels: rows in blocks whose quantized bytes (K a row) stay
// in cache while every panel passes over them, a panel's bytes in cache while its block's rows pass.
// Threads take runs of panels. No software prefetch: each thread reads its panels in order, which the
// hardware prefetchers follow; prefetching the whole panel after next (10 KB at K = 2048) held one
// row's read of weights from memory to 18-25 GB/s on an AVX-512 Zen-class EPYC, 33-36 without it.
template <typename Tile>
void for_each_panel_tile(int64_t m_size, int64_t k_size, int64_t panels, const Tile& tile) {
  constexpr int64_t rows = kQ8TileRows;
  const int64_t block_rows = std::max<int64_t>(rows, kQ8BlockBytes / k_size / rows * rows);
  for (int64_t b0 = 0; b0 < m_size; b0 += block_rows) {
    const int64_t b1 = std::min(m_size, b0 + block_rows);
    at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p) {
        for (int64_t m0 = b0; m0 < b1; m0 += rows) {
          switch (std::min(rows, b1 - m0)) {
#if defined(TANDEM_Q8_VNNI)
            case 8: tile(std::integral_constant<int, 8>(), m0, p); break;
            case 7: tile(std::integral_constant<int, 7>(), m0, p); break;
            case 6: tile(std::integral_constant<int, 6>(), m0, p); break;
            case 5: tile(std::integral_constant<int, 5>(), m0, p); break;
#endif
            case 4: tile(std::integral_constant<int, 4>(), m0, p); break;
            case 3: tile(std::integral_constant<int, 3>(), m0, p); break;
            case 2: tile(std::integral_constant<int, 2>(), m0, p); break;
            default: tile(std::integral_constant<int, 1>(), m0, p); break;
          }
        }
      }
    });
  }
}

}  // namespace
}  // namespace tandem
