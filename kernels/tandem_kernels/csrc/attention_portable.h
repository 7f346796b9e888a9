// Paged attention's portable kernel (attend_one): 8-lane vectors, on any target; AVX2 adds
// transposing 8-row dot products. attention.cpp takes it where the AVX-512 kernel does not apply.
//
// KV-cache layout (one tensor per layer for K, one for V), head-major inside a block:
//     cache[num_blocks, num_kv_heads, block_size, head_dim]
//     token p of a request -> block block_table[p / block_size], row p % block_size
// so one (block, KV head) is one contiguous block_size * head_dim run that attention streams.
#pragma once

#include "simd.h"

namespace tandem {
namespace {

// out[g * out_stride] = q[g] . k for N query heads at once (N independent accumulators).
template <int N>
inline void dots_tile(float* out, int64_t out_stride, const float* q, const float* k, int64_t d) {
  vf acc[N];
  for (int j = 0; j < N; ++j) acc[j] = vsplat(0.0f);
  int64_t i = 0;
  for (; i + kLanes <= d; i += kLanes) {
    const vf kv = vload(k + i);
    for (int j = 0; j < N; ++j) acc[j] = vfma(vload(q + j * d + i), kv, acc[j]);
  }
  for (int j = 0; j < N; ++j) {
    float s = hsum(acc[j]);
    for (int64_t r = i; r < d; ++r) s += q[j * d + r] * k[r];
    out[j * out_stride] = s;
  }
}

#if defined(__AVX2__)
// out[r] = q . k[r] for 8 consecutive key rows k [8, d] (d a multiple of kLanes): one accumulator
// per row, then one transposing reduction of the 8 (instead of 8 horizontal sums).
inline void dots8(float* out, const float* q, const float* k, int64_t d) {
  __m256 a[8];
  for (int r = 0; r < 8; ++r) a[r] = _mm256_setzero_ps();
  for (int64_t i = 0; i < d; i += kLanes) {
    const __m256 qv = _mm256_loadu_ps(q + i);
    for (int r = 0; r < 8; ++r) a[r] = vfma(qv, _mm256_loadu_ps(k + r * d + i), a[r]);
  }
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31)));
}

// out[j * out_stride + r] = q[j] . k[r] for 3 query heads q [3, d] and 4 key rows k [4, d] (d a
// multiple of kLanes): each key vector is loaded once for the 3 heads that share it (measured:
// ~6% faster batch-32 attention than dots8 per head).
inline void dots_4rows_3heads(float* out, int64_t out_stride, const float* q, const float* k, int64_t d) {
  __m256 a[3][4];
  for (int j = 0; j < 3; ++j)
    for (int r = 0; r < 4; ++r) a[j][r] = _mm256_setzero_ps();
  for (int64_t i = 0; i < d; i += kLanes) {
    const __m256 q0 = _mm256_loadu_ps(q + i), q1 = _mm256_loadu_ps(q + d + i), q2 = _mm256_loadu_ps(q + 2 * d + i);
    for (int r = 0; r < 4; ++r) {
      const __m256 kv = _mm256_loadu_ps(k + r * d + i);
      a[0][r] = vfma(q0, kv, a[0][r]);
      a[1][r] = vfma(q1, kv, a[1][r]);
      a[2][r] = vfma(q2, kv, a[2][r]);
    }
  }
  for (int j = 0; j < 3; ++j) {
    const __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(a[j][0], a[j][1]), _mm256_hadd_ps(a[j][2], a[j][3]));
    _mm_storeu_ps(out + j * out_stride, _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1)));
  }
}
constexpr bool kHaveDots8 = true;
#else
inline void dots8(float*, const float*, const float*, int64_t) {}
inline void dots_4rows_3heads(float*, int64_t, const float*, const float*, int64_t) {}
constexpr bool kHaveDots8 = false;
#endif

// Scores of one key row against the `group` query heads q [group, d].
inline void dots(float* out, int64_t out_stride, const float* q, const float* k, int64_t group, int64_t d) {
  int64_t g = 0;
  for (; g + 4 <= group; g += 4) dots_tile<4>(out + g * out_stride, out_stride, q + g * d, k, d);
  switch (group - g) {
    case 3: dots_tile<3>(out + g * out_stride, out_stride, q + g * d, k, d); break;
    case 2: dots_tile<2>(out + g * out_stride, out_stride, q + g * d, k, d); break;
    case 1: dots_tile<1>(out + g * out_stride, out_stride, q + g * d, k, d); break;
    default: break;
  }
}

// x[i] = exp(x[i] - shift); returns the sum.
inline float exp_shifted_inplace(float* x, int64_t n, float shift) {
  vf sum = vsplat(0.0f);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const vf e = vexp(vload(x + i) - vsplat(shift));
    vstore(x + i, e);
    sum += e;
  }
  float s = hsum(sum);
  for (; i < n; ++i) {
    x[i] = exp_scalar(x[i] - shift);
    s += x[i];
  }
  return s;
}
constexpr int64_t kMaxGroupTile = 8;  // query heads whose V accumulators live in registers

// Attention prefetches the next cache block while it computes on one, a few rows at a time between
// the dot products: one burst of the whole block's lines stalls the core until most have arrived,
// so memory and compute did not overlap (measured: batch-32 attention ~8% faster spread).

// acc[j] (head_dim floats, j < NG) += sum over the block's n keys of scores[j * len + t0 + i] * v[i];
// prefetches row i of `next` (rows of next_row_bytes; may be null) as it reads row i.
// NG is a template argument so the accumulators stay in registers (a runtime count spilled them
// to the stack: 2x slower attention at batch 32).
template <int NG>
inline void accumulate_v_tile(float* acc, const float* scores, int64_t len, int64_t t0, const float* v,
                              int64_t n, int64_t head_dim, const char* next, int64_t next_row_bytes) {
  // CH chunks of kLanes columns at once: NG * CH independent accumulators hide the add latency.
  constexpr int CH = NG <= 1 ? 8 : NG <= 3 ? 4 : NG <= 6 ? 2 : 1;
  if (next && head_dim < CH * kLanes) prefetch_run(next, n * next_row_bytes);  // no pass below to spread it over
  int64_t c = 0;
  for (; c + CH * kLanes <= head_dim; c += CH * kLanes) {
    vf a[NG][CH];
    for (int j = 0; j < NG; ++j)
      for (int h = 0; h < CH; ++h) a[j][h] = vload(acc + j * head_dim + c + h * kLanes);
    for (int64_t i = 0; i < n; ++i) {
      if (next && c == 0) prefetch_run(next + i * next_row_bytes, next_row_bytes);
      vf vv[CH];
      for (int h = 0; h < CH; ++h) vv[h] = vload(v + i * head_dim + c + h * kLanes);
      for (int j = 0; j < NG; ++j) {
        const vf sc = vsplat(scores[j * len + t0 + i]);
        for (int h = 0; h < CH; ++h) a[j][h] = vfma(sc, vv[h], a[j][h]);
      }
    }
    for (int j = 0; j < NG; ++j)
      for (int h = 0; h < CH; ++h) vstore(acc + j * head_dim + c + h * kLanes, a[j][h]);
  }
  for (; c + kLanes <= head_dim; c += kLanes) {
    vf a[NG];
    for (int j = 0; j < NG; ++j) a[j] = vload(acc + j * head_dim + c);
    for (int64_t i = 0; i < n; ++i) {
      const vf vv = vload(v + i * head_dim + c);
      for (int j = 0; j < NG; ++j) a[j] = vfma(vsplat(scores[j * len + t0 + i]), vv, a[j]);
    }
    for (int j = 0; j < NG; ++j) vstore(acc + j * head_dim + c, a[j]);
  }
  for (; c < head_dim; ++c)
    for (int64_t i = 0; i < n; ++i)
      for (int j = 0; j < NG; ++j) acc[j * head_dim + c] += scores[j * len + t0 + i] * v[i * head_dim + c];
}

inline void accumulate_v(float* acc, const float* scores, int64_t len, int64_t t0, const float* v, int64_t n,
                         int64_t head_dim, int64_t ng, const char* next, int64_t next_row_bytes) {
  switch (ng) {
    case 1: return accumulate_v_tile<1>(acc, scores, len, t0, v, n, head_dim, next, next_row_bytes);
    case 2: return accumulate_v_tile<2>(acc, scores, len, t0, v, n, head_dim, next, next_row_bytes);
    case 3: return accumulate_v_tile<3>(acc, scores, len, t0, v, n, head_dim, next, next_row_bytes);
    case 4: return accumulate_v_tile<4>(acc, scores, len, t0, v, n, head_dim, next, next_row_bytes);
    case 5: return accumulate_v_tile<5>(acc, scores, len, t0, v, n, head_dim, next, next_row_bytes);
    case 6: return accumulate_v_tile<6>(acc, scores, len, t0, v, n, head_dim, next, next_row_bytes);
    case 7: return accumulate_v_tile<7>(acc, scores, len, t0, v, n, head_dim, next, next_row_bytes);
    default: return accumulate_v_tile<8>(acc, scores, len, t0, v, n, head_dim, next, next_row_bytes);
  }
}

// One work item: one query token and one KV head, i.e. the `group` query heads that share it.
// Scores for keys 0..len-1 are computed row by row straight from the cache blocks (no gather),
// softmaxed, then V is accumulated. The next block is prefetched while one is read.
template <typename T, typename C>
void attend_one(T* out, const T* query, const C* k_cache, const C* v_cache, const int32_t* table,
                int64_t len, int64_t kvh, int64_t group, int64_t head_dim, int64_t block_size,
                int64_t num_kv_heads, float scale, std::vector<float>& scratch) {
  const int64_t run = block_size * head_dim;  // one (block, KV head)
  const int64_t block_stride = num_kv_heads * run;
  scratch.resize(group * len + group * head_dim + block_size * head_dim + 2 * kLanes);
  float* scores = scratch.data();                 // [group, len]
  float* q = scores + group * len;                // [group, head_dim], pre-scaled
  float* rows = q + group * head_dim;             // [block_size, head_dim]: a block as float
  auto block_at = [&](const C* cache, int64_t b) { return cache + table[b] * block_stride + kvh * run; };
  const int64_t num_blocks = (len + block_size - 1) / block_size;

  for (int64_t g = 0; g < group; ++g) {
    const T* src = query + (kvh * group + g) * head_dim;
    for (int64_t d = 0; d < head_dim; ++d) q[g * head_dim + d] = to_f(src[d]) * scale;
  }
  for (int64_t b = 0; b < num_blocks; ++b) {
    const C* next = b + 1 < num_blocks ? block_at(k_cache, b + 1) : nullptr;
    const bool rows_of_8 = kHaveDots8 && head_dim % kLanes == 0;
    if (next && !rows_of_8) prefetch_run(next, run);
    const int64_t t0 = b * block_size, n = std::min(block_size, len - t0);
    const float* k = row_as_float(block_at(k_cache, b), rows, n * head_dim);
    int64_t i = 0;
    if (rows_of_8)
      for (; i + 8 <= n; i += 8) {
        if (next) prefetch_run(next + i * head_dim, 8 * head_dim);  // the same rows of the next block
        int64_t g = 0;
        for (; g + 3 <= group; g += 3)
          for (int64_t r = i; r < i + 8; r += 4)
            dots_4rows_3heads(scores + g * len + t0 + r, len, q + g * head_dim, k + r * head_dim, head_dim);
        for (; g < group; ++g) dots8(scores + g * len + t0 + i, q + g * head_dim, k + i * head_dim, head_dim);
      }
    for (; i < n; ++i) dots(scores + t0 + i, len, q, k + i * head_dim, group, head_dim);
  }
  for (int64_t g = 0; g < group; ++g) {
    float* s = scores + g * len;
    const float inv_sum = 1.0f / exp_shifted_inplace(s, len, *std::max_element(s, s + len));
    for (int64_t t = 0; t < len; ++t) s[t] *= inv_sum;
  }
  // V: blocks outer; head_dim in chunks of kLanes with each tile of query heads' accumulators
  // in registers, written out (in place of q, no longer needed) once all blocks are summed.
  float* acc = q;
  std::fill(acc, acc + group * head_dim, 0.0f);
  for (int64_t b = 0; b < num_blocks; ++b) {
    const char* next = b + 1 < num_blocks ? reinterpret_cast<const char*>(block_at(v_cache, b + 1)) : nullptr;
    const int64_t t0 = b * block_size, n = std::min(block_size, len - t0);
    const float* v = row_as_float(block_at(v_cache, b), rows, n * head_dim);
    for (int64_t g0 = 0; g0 < group; g0 += kMaxGroupTile)  // the first tile prefetches the next block
      accumulate_v(acc + g0 * head_dim, scores + g0 * len, len, t0, v, n, head_dim,
                   std::min(kMaxGroupTile, group - g0), g0 == 0 ? next : nullptr,
                   head_dim * static_cast<int64_t>(sizeof(C)));
  }
  for (int64_t g = 0; g < group; ++g) {
    T* dst = out + (kvh * group + g) * head_dim;
    for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<T>(acc[g * head_dim + d]);
  }
}

}  // namespace
}  // namespace tandem
