// The AVX-512 attention kernel's building blocks (attention_avx512.h puts them together): 16-lane
// cache-row loads (float, bf16, half, fp8), the softmax's exp and max, QK tiles (fused
// multiply-adds, or vdpbf16ps on bf16 and fp8 keys) and PV tiles (fp32, or bf16 pairs).
// Compiled only where the target has AVX-512 (AVX512-BF16 and VBMI for their tiles).
#pragma once

#include "simd.h"

#if defined(__AVX512F__)
namespace tandem {
namespace {

// 16 values of a cache row as floats, in an AVX-512 register.
inline __m512 load16(const float* p) { return load16f(p); }
inline __m512 load16(const c10::BFloat16* p) { return load16f(p); }
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
// fp8 values / 2^8, exactly: e4m3fn s.eeee.mmm is the half s.0eeee.mmm0000000 times 2^8 (exponent
// bias 7 against 15; subnormals alike): sign-extend to 16 bits, shift left 7, clear bit 14. The
// callers fold the 2^8 into the softmax scale and the final normalization (kLoadUnit).
inline __m512 load16(const c10::Float8_e4m3fn* p) {
  const __m256i x = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm512_cvtph_ps(_mm256_and_si256(_mm256_slli_epi16(x, 7), _mm256_set1_epi16(static_cast<int16_t>(0xBFFF))));
}
template <typename C>
constexpr float kLoadUnit = std::is_same_v<C, c10::Float8_e4m3fn> ? 256.0f : 1.0f;  // value = load16 * this

// exp16 (avx512_math.h): exp(x) for 16 lanes, the polynomial of vexp_t with fused multiply-adds.

// x[i] = exp(x[i] - shift) for x[i] <= shift; returns the sum.
inline float exp_shifted16(float* x, int64_t n, float shift) {
  const __m512 sh = _mm512_set1_ps(shift);
  __m512 sum = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + kLanesWide <= n; i += kLanesWide) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(x + i), sh));
    _mm512_storeu_ps(x + i, e);
    sum = _mm512_add_ps(sum, e);
  }
  if (i < n) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, x + i), sh));
    _mm512_mask_storeu_ps(x + i, tail, e);
    sum = _mm512_mask_add_ps(sum, tail, sum, e);
  }
  return _mm512_reduce_add_ps(sum);
}

// [sum of a0's lanes, ..., sum of a3's lanes]. By value: an accumulator array whose address is
// taken stays in memory, and GCC then stores it at every multiply-add of the loop that fills it.
inline __m128 lane_sums4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  const __m512 x01 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
  const __m512 x23 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
  const __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(x01), _mm512_castps_pd(x23));
  const __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(x01), _mm512_castps_pd(x23));
  const __m512 y = _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));  // per 128-bit lane: a0..a3
  const __m256 z = _mm256_add_ps(_mm512_castps512_ps256(y),
                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(y), 1)));
  return _mm_add_ps(_mm256_castps256_ps128(z), _mm256_extractf128_ps(z, 1));
}

// scores[j * len + r] = scale * (sum of a[j][r]'s lanes), for R = 4 rows or fewer.
template <int NG, int R>
__attribute__((always_inline)) inline void store_scores(float* scores, int64_t len, __m512 (&a)[NG][R], float scale) {
  for (int j = 0; j < NG; ++j) {
    if constexpr (R == 4) {
      _mm_storeu_ps(scores + j * len, _mm_mul_ps(lane_sums4(a[j][0], a[j][1], a[j][2], a[j][3]), _mm_set1_ps(scale)));
    } else {
      for (int r = 0; r < R; ++r) scores[j * len + r] = _mm512_reduce_add_ps(a[j][r]) * scale;
    }
  }
}

// QK tiles: scores[j * len + r] = scale * q[g + j] . k[r] for NG query heads and R key rows k [R, d].
// FmaQk: the heads as floats (q [group, d]), key rows converted 16 at a time, fused multiply-adds.
template <typename T>
struct FmaQk {
  const float* q;
  int64_t d;
  float scale;
  template <int NG, int R>
  __attribute__((always_inline)) void tile(float* scores, int64_t len, int64_t g, const T* k) const {
    __m512 a[NG][R];
    for (int j = 0; j < NG; ++j)
      for (int r = 0; r < R; ++r) a[j][r] = _mm512_setzero_ps();
    for (int64_t c = 0; c < d; c += kLanesWide) {
      __m512 kv[R];
      for (int r = 0; r < R; ++r) kv[r] = load16(k + r * d + c);
      for (int j = 0; j < NG; ++j) {
        const __m512 qv = _mm512_loadu_ps(q + (g + j) * d + c);
        for (int r = 0; r < R; ++r) a[j][r] = _mm512_fmadd_ps(qv, kv[r], a[j][r]);
      }
    }
    store_scores<NG, R>(scores, len, a, scale);
  }
};

#if defined(__AVX512BF16__)
// Bf16Qk: bf16 heads and keys as they are (d a multiple of 32), 32 pairs per vdpbf16ps: the
// products are exact in fp32 and summed in fp32, so no conversion instructions at all.
struct Bf16Qk {
  const c10::BFloat16* q;
  int64_t d;
  float scale;
  template <int NG, int R>
  __attribute__((always_inline)) void tile(float* scores, int64_t len, int64_t g, const c10::BFloat16* k) const {
    __m512 a[NG][R];
    for (int j = 0; j < NG; ++j)
      for (int r = 0; r < R; ++r) a[j][r] = _mm512_setzero_ps();
    for (int64_t c = 0; c < d; c += 32) {
      __m512bh kv[R];
      for (int r = 0; r < R; ++r) kv[r] = (__m512bh)_mm512_loadu_si512(k + r * d + c);
      for (int j = 0; j < NG; ++j) {
        const __m512bh qv = (__m512bh)_mm512_loadu_si512(q + (g + j) * d + c);
        for (int r = 0; r < R; ++r) a[j][r] = _mm512_dpbf16_ps(a[j][r], qv, kv[r]);
      }
    }
    store_scores<NG, R>(scores, len, a, scale);
  }
};
#endif

// scores rows [0, n) of every head (scores [group, len], this block's columns) from the block's key
// rows k [n, d]: 4 rows at a time, heads 4 at a time. Prefetches the same rows of pf_a and pf_b.
template <typename Qk, typename T>
inline void qk_rows16(const Qk& qk, float* scores, int64_t len, const T* k, int64_t n, int64_t group, int64_t d,
                      const char* pf_a, const char* pf_b, int64_t pf_row_bytes) {
  for (int64_t i = 0; i < n; i += 4) {
    const int64_t rows = std::min<int64_t>(4, n - i);
    if (pf_a) prefetch_run(pf_a + i * pf_row_bytes, rows * pf_row_bytes);
    if (pf_b) prefetch_run(pf_b + i * pf_row_bytes, rows * pf_row_bytes);
    for (int64_t g = 0; g < group; g += 4) {
      float* s = scores + g * len + i;
      const T* kr = k + i * d;
      const int64_t ng = std::min<int64_t>(4, group - g);
      if (rows == 4) {
        switch (ng) {
          case 1: qk.template tile<1, 4>(s, len, g, kr); break;
          case 2: qk.template tile<2, 4>(s, len, g, kr); break;
          case 3: qk.template tile<3, 4>(s, len, g, kr); break;
          default: qk.template tile<4, 4>(s, len, g, kr); break;
        }
      } else {
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t j = 0; j < ng; ++j) qk.template tile<1, 1>(s + j * len + r, len, g + j, kr + r * d);
      }
    }
  }
}

// acc[j][c0 .. c0 + 16 CH) += sum over keys t < len of p[j * len + t] * v[t] for NG heads, V read
// block by block through the table.
template <int NG, int CH, typename T>
__attribute__((always_inline)) inline void pv_tile16(float* acc, const float* p, int64_t len, const T* v_cache,
                                                     const int32_t* table, int64_t block_stride, int64_t head_off,
                                                     int64_t block_size, int64_t d, int64_t c0) {
  __m512 a[NG][CH];
  for (int j = 0; j < NG; ++j)
    for (int h = 0; h < CH; ++h) a[j][h] = _mm512_setzero_ps();
  for (int64_t t0 = 0; t0 < len; t0 += block_size) {
    const T* v = v_cache + table[t0 / block_size] * block_stride + head_off + c0;
    const int64_t n = std::min(block_size, len - t0);
    for (int64_t i = 0; i < n; ++i) {
      __m512 vv[CH];
      for (int h = 0; h < CH; ++h) vv[h] = load16(v + i * d + h * kLanesWide);
      for (int j = 0; j < NG; ++j) {
        const __m512 pj = _mm512_set1_ps(p[j * len + t0 + i]);
        for (int h = 0; h < CH; ++h) a[j][h] = _mm512_fmadd_ps(pj, vv[h], a[j][h]);
      }
    }
  }
  for (int j = 0; j < NG; ++j)
    for (int h = 0; h < CH; ++h) _mm512_storeu_ps(acc + j * d + c0 + h * kLanesWide, a[j][h]);
}

template <int CH, typename T>
inline void pv_heads16(float* acc, const float* p, int64_t len, const T* v_cache, const int32_t* table,
                       int64_t block_stride, int64_t head_off, int64_t block_size, int64_t d, int64_t c0,
                       int64_t ng) {
  switch (ng) {
    case 1: return pv_tile16<1, CH>(acc, p, len, v_cache, table, block_stride, head_off, block_size, d, c0);
    case 2: return pv_tile16<2, CH>(acc, p, len, v_cache, table, block_stride, head_off, block_size, d, c0);
    case 3: return pv_tile16<3, CH>(acc, p, len, v_cache, table, block_stride, head_off, block_size, d, c0);
    default: return pv_tile16<4, CH>(acc, p, len, v_cache, table, block_stride, head_off, block_size, d, c0);
  }
}

#if defined(__AVX512BF16__)
// PV as bf16 pairs: value rows t and t + 1 interleaved column by column (vpunpck{l,h}wd), times the
// pair (p_t, p_t+1) rounded to bf16 (as torch's CPU flash attention rounds its probabilities
// before multiplying V), with vdpbf16ps: half the instructions of widening V and multiplying in
// fp32. The unpacks permute the columns within 128-bit lanes; a Rows policy undoes that once, at
// the end. Rows: the cache's element type C, kCols columns per pass in kVecs pair vectors;
// pairs(row, next_row or null, x) fills x; store(dst, sums) writes the kCols sums in column order.

// bf16 caches, 32 CH columns: the lo pairs hold columns 0-3 of every 8, the hi pairs 4-7.
template <int CH>
struct Bf16Rows {
  using C = c10::BFloat16;
  static constexpr int kVecs = 2 * CH, kCols = 32 * CH;
  __attribute__((always_inline)) void pairs(const C* row, const C* next_row, __m512bh (&x)[kVecs]) const {
    for (int h = 0; h < CH; ++h) {
      const __m512i a = _mm512_loadu_si512(row + h * 32);
      const __m512i b = next_row ? _mm512_loadu_si512(next_row + h * 32) : _mm512_setzero_si512();
      x[2 * h] = (__m512bh)_mm512_unpacklo_epi16(a, b);
      x[2 * h + 1] = (__m512bh)_mm512_unpackhi_epi16(a, b);
    }
  }
  __attribute__((always_inline)) void store(float* dst, const __m512 (&a)[kVecs]) const {
    const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int h = 0; h < CH; ++h) {
      _mm512_storeu_ps(dst + 32 * h, _mm512_permutex2var_ps(a[2 * h], first, a[2 * h + 1]));
      _mm512_storeu_ps(dst + 32 * h + 16, _mm512_permutex2var_ps(a[2 * h], second, a[2 * h + 1]));
    }
  }
};

#if defined(__AVX512VBMI__)
// e4m3fn -> bf16, 64 bytes at a time and exactly (every e4m3 value, subnormals included, is a
// normal bf16): the byte's low 7 bits look up the bf16's high and low bytes in 128-entry tables
// (vpermi2b reads only those 7 bits), the sign is or-ed back into the high byte. The words come
// out in vpunpck{l,h}bw's order: first = bytes 0-7 of each 16, second = bytes 8-15.
struct Fp8ToBf16 {
  __m512i hi_a, hi_b, lo_a, lo_b;  // high / low bytes of codes 0-63 (a) and 64-127 (b)
  Fp8ToBf16() {
    alignas(64) uint8_t hi[128], lo[128];
    for (int code = 0; code < 128; ++code) {
      const uint16_t bits = c10::BFloat16(fp8_value(code)).x;  // exact: 3 mantissa bits
      hi[code] = static_cast<uint8_t>(bits >> 8);
      lo[code] = static_cast<uint8_t>(bits & 0xFF);
    }
    hi_a = _mm512_load_si512(hi), hi_b = _mm512_load_si512(hi + 64);
    lo_a = _mm512_load_si512(lo), lo_b = _mm512_load_si512(lo + 64);
  }
  __attribute__((always_inline)) void convert(const c10::Float8_e4m3fn* p, __m512i& first, __m512i& second) const {
    const __m512i x = _mm512_loadu_si512(p);
    const __m512i hi = _mm512_or_si512(_mm512_permutex2var_epi8(hi_a, x, hi_b),
                                       _mm512_and_si512(x, _mm512_set1_epi8(static_cast<char>(0x80))));
    const __m512i lo = _mm512_permutex2var_epi8(lo_a, x, lo_b);
    first = _mm512_unpacklo_epi8(lo, hi);
    second = _mm512_unpackhi_epi8(lo, hi);
  }
};

inline const Fp8ToBf16& fp8_to_bf16() {
  static const Fp8ToBf16 converter;
  return converter;
}

// fp8 caches, 64 columns: pair vectors (first lo, first hi, second lo, second hi) hold, in 128-bit
// lane L, columns 16 L + 0-3, 4-7, 8-11 and 12-15: a 4 x 4 transpose of 128-bit lanes restores them.
struct Fp8Rows {
  using C = c10::Float8_e4m3fn;
  static constexpr int kVecs = 4, kCols = 64;
  const Fp8ToBf16& cvt = fp8_to_bf16();
  __attribute__((always_inline)) void pairs(const C* row, const C* next_row, __m512bh (&x)[kVecs]) const {
    __m512i f0, s0, f1 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
    cvt.convert(row, f0, s0);
    if (next_row) cvt.convert(next_row, f1, s1);
    x[0] = (__m512bh)_mm512_unpacklo_epi16(f0, f1);
    x[1] = (__m512bh)_mm512_unpackhi_epi16(f0, f1);
    x[2] = (__m512bh)_mm512_unpacklo_epi16(s0, s1);
    x[3] = (__m512bh)_mm512_unpackhi_epi16(s0, s1);
  }
  __attribute__((always_inline)) void store(float* dst, const __m512 (&a)[kVecs]) const {
    const __m512 t01 = _mm512_shuffle_f32x4(a[0], a[1], 0x44), t23 = _mm512_shuffle_f32x4(a[2], a[3], 0x44);
    const __m512 u01 = _mm512_shuffle_f32x4(a[0], a[1], 0xEE), u23 = _mm512_shuffle_f32x4(a[2], a[3], 0xEE);
    _mm512_storeu_ps(dst, _mm512_shuffle_f32x4(t01, t23, 0x88));
    _mm512_storeu_ps(dst + 16, _mm512_shuffle_f32x4(t01, t23, 0xDD));
    _mm512_storeu_ps(dst + 32, _mm512_shuffle_f32x4(u01, u23, 0x88));
    _mm512_storeu_ps(dst + 48, _mm512_shuffle_f32x4(u01, u23, 0xDD));
  }
};

// Fp8BF16Qk: bf16 heads against fp8 keys widened to bf16 (d a multiple of 64), vdpbf16ps. The
// heads are stored permuted as the keys come out of Fp8ToBf16 (qp: [group, d]; fp8_qk_heads).
struct Fp8Bf16Qk {
  const c10::BFloat16* qp;
  int64_t d;
  float scale;
  const Fp8ToBf16& cvt = fp8_to_bf16();
  template <int NG, int R>
  __attribute__((always_inline)) void tile(float* scores, int64_t len, int64_t g, const c10::Float8_e4m3fn* k) const {
    __m512 a[NG][R];
    for (int j = 0; j < NG; ++j)
      for (int r = 0; r < R; ++r) a[j][r] = _mm512_setzero_ps();
    for (int64_t c = 0; c < d; c += 64) {
      __m512i first[R], second[R];
      for (int r = 0; r < R; ++r) cvt.convert(k + r * d + c, first[r], second[r]);
      for (int j = 0; j < NG; ++j) {
        const __m512bh q0 = (__m512bh)_mm512_loadu_si512(qp + (g + j) * d + c);
        const __m512bh q1 = (__m512bh)_mm512_loadu_si512(qp + (g + j) * d + c + 32);
        for (int r = 0; r < R; ++r)
          a[j][r] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(a[j][r], q0, (__m512bh)first[r]), q1, (__m512bh)second[r]);
      }
    }
    store_scores<NG, R>(scores, len, a, scale);
  }
};

// qp [group, d] = the heads with each 64 columns in Fp8ToBf16's order (bytes 0-7 of each 16, then 8-15).
inline void fp8_qk_heads(c10::BFloat16* qp, const c10::BFloat16* heads, int64_t group, int64_t d) {
  for (int64_t i = 0; i < group * d; i += 64) {
    const __m512i q0 = _mm512_loadu_si512(heads + i), q1 = _mm512_loadu_si512(heads + i + 32);
    _mm512_storeu_si512(qp + i, _mm512_shuffle_i64x2(q0, q1, 0x88));
    _mm512_storeu_si512(qp + i + 32, _mm512_shuffle_i64x2(q0, q1, 0xDD));
  }
}
#endif

// acc[j][c0 .. c0 + kCols) = sum over keys t < len of p[t] * v[t] for NG heads; pairs [NG][pair_stride]
// holds each head's (p_2k, p_2k+1) as bf16 pairs (p_len = 0 when len is odd); block_size is even.
template <int NG, typename Rows>
__attribute__((always_inline)) inline void pv_pairs_tile(const Rows& rows, float* acc, const uint32_t* pairs,
                                                         int64_t pair_stride, int64_t len,
                                                         const typename Rows::C* v_cache, const int32_t* table,
                                                         int64_t block_stride, int64_t head_off, int64_t block_size,
                                                         int64_t d, int64_t c0) {
  constexpr int V = Rows::kVecs;
  __m512 a[NG][V];
  for (int j = 0; j < NG; ++j)
    for (int h = 0; h < V; ++h) a[j][h] = _mm512_setzero_ps();
  auto step = [&](const typename Rows::C* row, const typename Rows::C* next_row, int64_t pair) {
    __m512bh x[V];
    rows.pairs(row, next_row, x);
    for (int j = 0; j < NG; ++j) {
      const __m512bh pj = (__m512bh)_mm512_set1_epi32(static_cast<int>(pairs[j * pair_stride + pair]));
      for (int h = 0; h < V; ++h) a[j][h] = _mm512_dpbf16_ps(a[j][h], x[h], pj);
    }
  };
  for (int64_t t0 = 0; t0 < len; t0 += block_size) {
    const typename Rows::C* v = v_cache + table[t0 / block_size] * block_stride + head_off + c0;
    const int64_t n = std::min(block_size, len - t0);
    int64_t i = 0;
    for (; i + 2 <= n; i += 2) step(v + i * d, v + (i + 1) * d, (t0 + i) / 2);
    if (i < n) step(v + i * d, nullptr, (t0 + i) / 2);  // the last key, paired with p_len = 0
  }
  for (int j = 0; j < NG; ++j) rows.store(acc + j * d + c0, a[j]);
}

template <typename Rows>
inline void pv_pairs_heads(const Rows& rows, float* acc, const uint32_t* pairs, int64_t pair_stride, int64_t len,
                           const typename Rows::C* v_cache, const int32_t* table, int64_t block_stride,
                           int64_t head_off, int64_t block_size, int64_t d, int64_t c0, int64_t ng) {
  switch (ng) {
    case 1: return pv_pairs_tile<1>(rows, acc, pairs, pair_stride, len, v_cache, table, block_stride, head_off, block_size, d, c0);
    case 2: return pv_pairs_tile<2>(rows, acc, pairs, pair_stride, len, v_cache, table, block_stride, head_off, block_size, d, c0);
    case 3: return pv_pairs_tile<3>(rows, acc, pairs, pair_stride, len, v_cache, table, block_stride, head_off, block_size, d, c0);
    default: return pv_pairs_tile<4>(rows, acc, pairs, pair_stride, len, v_cache, table, block_stride, head_off, block_size, d, c0);
  }
}

// p [n] floats -> bf16 (nearest even), n rounded up to even with a 0.
inline void to_bf16_pairs(uint16_t* dst, const float* p, int64_t n) {
  int64_t i = 0;
  for (; i + kLanesWide <= n; i += kLanesWide)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(p + i)));
  for (; i < n; ++i) dst[i] = c10::BFloat16(p[i]).x;
  if (n % 2) dst[n] = 0;
}
#endif

inline float max_of(const float* x, int64_t n) {
  __m512 m = _mm512_set1_ps(-INFINITY);
  int64_t i = 0;
  for (; i + kLanesWide <= n; i += kLanesWide) m = _mm512_max_ps(m, _mm512_loadu_ps(x + i));
  float best = _mm512_reduce_max_ps(m);
  for (; i < n; ++i) best = std::max(best, x[i]);
  return best;
}

}  // namespace
}  // namespace tandem
#endif
