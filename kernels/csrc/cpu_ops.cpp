// Tandem's CPU kernels: the fused twins of kernels/reference.py for CPU tensors.
//
// Built once per machine by kernels/cpu.py (g++ -O3 -march=native, cached) and
// registered as torch.ops.tandem_cpu.*. Every op works on float, bfloat16 and
// half tensors and accumulates in float. Parallel loops use ATen's thread pool
// (at::parallel_for), so they share torch's OpenMP team: a second team on a
// couple of cores slows both down.
//
// KV-cache layout (one tensor per layer for K, one for V), head-major inside a block:
//     cache[num_blocks, num_kv_heads, block_size, head_dim]
//     token p of a request -> block block_table[p / block_size], row p % block_size
// so one (block, KV head) is one contiguous block_size * head_dim run that attention streams.
// The caches hold the model's dtype, or fp8 (e4m3fn, --kv-cache-dtype fp8): values clamped to
// +-448 and rounded to nearest even as written (torch's conversion), widened exactly as read.
//
// Compiled with -ffp-contract=off: the elementwise ops round after each
// multiply and add exactly as the torch reference does (no fused multiply-add),
// so in fp32 rotary and norms give the reference's bits. Attention and SiLU use a
// polynomial exp (~1 ulp) that vectorizes; neither is bit-equal to torch's, and attention's
// dot products use fused multiply-adds (vfma) where the CPU has them.
//
// Where the compiler targets AVX-512 (-march=native on such a CPU), attention and the w8a8 linear
// take AVX-512 paths (BF16 and VNNI dot products where present); elsewhere 8-lane AVX2 ones. Both
// agree with the reference; their float sums run in different orders. The elementwise row ops
// (norms, SiLU, argmax) use 16-lane vector extensions on every target.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#if defined(__AVX2__)
#include <immintrin.h>
#endif
#include <vector>

#include "avx512_math.h"

namespace {

using at::Tensor;

template <typename T>
inline float to_f(T x) { return static_cast<float>(x); }

#define TANDEM_DISPATCH(dtype, NAME, ...)                                           \
  [&] {                                                                             \
    switch (dtype) {                                                                \
      case at::kFloat: { using scalar_t = float; return __VA_ARGS__(); }            \
      case at::kBFloat16: { using scalar_t = c10::BFloat16; return __VA_ARGS__(); } \
      case at::kHalf: { using scalar_t = c10::Half; return __VA_ARGS__(); }         \
      default: TORCH_CHECK(false, NAME, ": unsupported dtype ", dtype);             \
    }                                                                               \
  }()

// TANDEM_DISPATCH, and cache_t: the KV caches' element type, scalar_t itself or fp8 (e4m3fn).
#define TANDEM_DISPATCH_CACHE(dtype, cache_dtype, NAME, ...)                                         \
  TANDEM_DISPATCH(dtype, NAME, [&] {                                                                \
    if ((cache_dtype) == at::kFloat8_e4m3fn) { using cache_t = c10::Float8_e4m3fn; return __VA_ARGS__(); } \
    TORCH_CHECK((cache_dtype) == c10::CppTypeToScalarType<scalar_t>::value, NAME,                     \
                ": the caches must have the activations' dtype or float8_e4m3fn");                 \
    using cache_t = scalar_t;                                                                       \
    return __VA_ARGS__();                                                                           \
  })

void check_cpu(const Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
}

// ---- SIMD helpers ---------------------------------------------------------------------
// GCC/Clang vector extensions: 8 floats, compiled to whatever the target has (AVX2, 2 x SSE,
// NEON). Explicit, because the auto-vectorizer leaves the reductions below scalar.

using vf = float __attribute__((vector_size(32)));
using vi = int32_t __attribute__((vector_size(32)));
constexpr int64_t kLanes = 8;

inline vf vload(const float* p) { vf v; std::memcpy(&v, p, sizeof v); return v; }
inline void vstore(float* p, vf v) { std::memcpy(p, &v, sizeof v); }
inline vf vsplat(float x) { return vf{x, x, x, x, x, x, x, x}; }
inline float hsum(vf v) {
  return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
}

// exp(x) to ~1 ulp for x in [-87, 88] (Cephes' single-precision polynomial), lane-wise, for any
// width of float vector V (VI: its int32 twin).
template <typename V, typename VI>
inline V vexp_t(V x) {
  x = x < 88.0f ? x : V{} + 88.0f;
  x = x > -87.0f ? x : V{} - 87.0f;
  // n = round(x / ln 2) as floor(t + 0.5), computed by truncation of a positive shifted value
  const V t = x * 1.44269504088896341f + 128.5f;
  const VI n = __builtin_convertvector(t, VI) - 128;
  const V nf = __builtin_convertvector(n, V);
  const V r = (x - nf * 0.693359375f) - nf * -2.12194440e-4f;
  V p = V{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  VI bits = (n + 127) << 23;
  V scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}
inline vf vexp(vf x) { return vexp_t<vf, vi>(x); }

// 16 lanes, for the row-wise elementwise ops: one AVX-512 register where the target has it, two
// 8-lane halves elsewhere; lane for lane the same arithmetic as vf.
using vf16 = float __attribute__((vector_size(64)));
using vi16 = int32_t __attribute__((vector_size(64)));
using vu16 = uint32_t __attribute__((vector_size(64)));
using vh16 = uint16_t __attribute__((vector_size(32)));
constexpr int64_t kLanesWide = 16;

inline vf16 vexp16(vf16 x) { return vexp_t<vf16, vi16>(x); }

// 16 values of a float or bf16 row as floats (bf16 -> float is exact).
inline vf16 load16f(const float* p) { vf16 v; std::memcpy(&v, p, sizeof v); return v; }
inline vf16 load16f(const c10::BFloat16* p) {
  vh16 h;
  std::memcpy(&h, p, sizeof h);
  const vu16 u = __builtin_convertvector(h, vu16) << 16;
  vf16 v;
  std::memcpy(&v, &u, sizeof v);
  return v;
}

// v rounded to T's precision, as floats: c10's float -> bf16 rounding (to nearest even, NaN kept).
template <typename T>
inline vf16 round16(vf16 v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    static_assert(std::is_same_v<T, c10::BFloat16>, "16-lane rows are float or bf16");
    vu16 u;
    std::memcpy(&u, &v, sizeof u);
    u = ((u + (((u >> 16) & 1u) + 0x7FFFu)) >> 16) << 16;
    u = v != v ? vu16{} + 0x7FC00000u : u;
    std::memcpy(&v, &u, sizeof v);
    return v;
  }
}

// Stores 16 floats already rounded to T's precision (round16).
inline void store16(float* p, vf16 v) { std::memcpy(p, &v, sizeof v); }
inline void store16(c10::BFloat16* p, vf16 v) {
  vu16 u;
  std::memcpy(&u, &v, sizeof u);
  const vh16 h = __builtin_convertvector(u >> 16, vh16);
  std::memcpy(p, &h, sizeof h);
}

template <typename T>
constexpr bool kWideRows = std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>;

// a * b + c: fused where the CPU has FMA (attention only; the elementwise ops round apart).
inline vf vfma(vf a, vf b, vf c) {
#if defined(__AVX2__) && defined(__FMA__)
  return _mm256_fmadd_ps(a, b, c);
#else
  return a * b + c;
#endif
}

inline float exp_scalar(float x) {
  vf v = vexp(vsplat(x));
  return v[0];
}

// dst[0:n] = src[0:n] as float.
template <typename T>
inline void load_row(float* dst, const T* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = to_f(src[i]);
}

template <>
inline void load_row<c10::BFloat16>(float* dst, const c10::BFloat16* src, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t word = static_cast<uint32_t>(bits[i]) << 16;
    std::memcpy(dst + i, &word, sizeof word);
  }
}

// The value of the e4m3fn byte with these bits (c10's conversion): what the fp8 tables hold.
inline float fp8_value(int bits) {
  return static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(bits), c10::Float8_e4m3fn::from_bits()));
}

// Every e4m3fn byte's value (NaN bytes included): the generic path's fp8 -> float conversion.
struct Fp8Table {
  float value[256];
  Fp8Table() {
    for (int b = 0; b < 256; ++b) value[b] = fp8_value(b);
  }
};

template <>
inline void load_row<c10::Float8_e4m3fn>(float* dst, const c10::Float8_e4m3fn* src, int64_t n) {
  static const Fp8Table table;
  for (int64_t i = 0; i < n; ++i) dst[i] = table.value[src[i].x];
}

// A cached K or V row as floats: the cache itself for float, else converted into buf.
template <typename T>
inline const float* row_as_float(const T* row, float* buf, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    return row;
  } else {
    load_row(buf, row, n);
    return buf;
  }
}

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

// ---- attention --------------------------------------------------------------------

template <typename T>
inline void prefetch_run(const T* run, int64_t n) {
  const char* p = reinterpret_cast<const char*>(run);
  for (int64_t off = 0; off < n * static_cast<int64_t>(sizeof(T)); off += 64) __builtin_prefetch(p + off);
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

#if defined(__AVX512F__)
// ---- attention with AVX-512 ----------------------------------------------------------
// attend_one's work for one query token and one or all of its KV heads, 16 lanes wide, reading the
// cache's rows where they are (no float copy of a block). QK: 4 key rows at a time against up to
// 4 query heads (each key vector loaded once for the heads that share it), one transposing
// reduction per 4 rows; bf16 caches multiply bf16 pairs directly (vdpbf16ps), others convert 16
// values at a time and use fused multiply-adds. V: the accumulators of up to 4 heads x CH 16-wide
// column chunks stay in registers over all of the item's blocks. While it reads block b of K it
// prefetches block b of V (needed next) and block b of the next item's K: without the prefetches
// the loads wait on memory (batch-32 attention of the default model 14 ms instead of 6).

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

// attend_one's contract for KV heads [kvh0, kvh1) of one query token (the `group` query heads of
// each), head_dim a multiple of 16. QK goes block by block, each block's heads in turn, so a block's
// K is read in address order; then softmax and V head by head. next_table / next_blocks / next_kvh0:
// the work item after this one (null / 0: none; the same number of KV heads), whose K blocks are
// prefetched while this one runs.
template <typename T, typename C>
void attend_one_avx512(T* out, const T* query, const C* k_cache, const C* v_cache, const int32_t* table,
                       int64_t len, int64_t kvh0, int64_t kvh1, int64_t group, int64_t d, int64_t block_size,
                       int64_t num_kv_heads, float scale, const int32_t* next_table, int64_t next_blocks,
                       int64_t next_kvh0, std::vector<float>& scratch) {
  const int64_t run = block_size * d;  // one (block, KV head)
  const int64_t block_stride = num_kv_heads * run;
  const int64_t heads = (kvh1 - kvh0) * group;  // query heads of this item
  auto k_run = [&](const int32_t* tab, int64_t b, int64_t head) { return k_cache + tab[b] * block_stride + head * run; };
  const int64_t pair_stride = (len + 1) / 2;  // bf16 pairs of probabilities per head
  scratch.resize(heads * len + 2 * heads * d + heads + heads * pair_stride);
  float* scores = scratch.data();    // [heads, len]: scores, then exp(score - max)
  float* q = scores + heads * len;   // [heads, d]: the heads as floats (FmaQk)
  float* acc = q + heads * d;        // [heads, d]: sum over keys of exp(score - max) * v
  float* sums = acc + heads * d;     // [heads]: sum over keys of exp(score - max)
  uint32_t* pairs = reinterpret_cast<uint32_t*>(sums + heads);  // [heads, pair_stride]: (pv_pairs_tile)
  const T* queries = query + kvh0 * group * d;  // [heads, d]
  const int64_t num_blocks = (len + block_size - 1) / block_size;
  const int64_t row_bytes = d * static_cast<int64_t>(sizeof(C));
  // make_qk(h): the QK tiles of the item's h-th KV head.
  auto qk_blocks = [&](const auto& make_qk) {
    for (int64_t b = 0; b < num_blocks; ++b) {
      const int64_t t0 = b * block_size, n = std::min(block_size, len - t0);
      for (int64_t h = 0; h < kvh1 - kvh0; ++h) {
        const C* v_now = v_cache + table[b] * block_stride + (kvh0 + h) * run;
        const C* k_next = b < next_blocks ? k_run(next_table, b, next_kvh0 + h) : nullptr;
        qk_rows16(make_qk(h), scores + h * group * len + t0, len, k_run(table, b, kvh0 + h), n, group, d,
                  reinterpret_cast<const char*>(v_now), reinterpret_cast<const char*>(k_next), row_bytes);
      }
    }
  };
  bool done = false;
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16> && std::is_same_v<C, c10::BFloat16>)
    if (d % 32 == 0) {
      qk_blocks([&](int64_t h) { return Bf16Qk{queries + h * group * d, d, scale}; });
      done = true;
    }
#if defined(__AVX512VBMI__)
  if constexpr (std::is_same_v<T, c10::BFloat16> && std::is_same_v<C, c10::Float8_e4m3fn>)
    if (d % 64 == 0) {
      c10::BFloat16* qp = reinterpret_cast<c10::BFloat16*>(q);  // [heads, d] bf16 in q's room
      fp8_qk_heads(qp, queries, heads, d);
      qk_blocks([&](int64_t h) { return Fp8Bf16Qk{qp + h * group * d, d, scale}; });
      done = true;
    }
#endif
#endif
  if (!done) {
    for (int64_t i = 0; i < heads * d; ++i) q[i] = to_f(queries[i]);
    qk_blocks([&](int64_t h) { return FmaQk<C>{q + h * group * d, d, scale * kLoadUnit<C>}; });
  }
  for (int64_t b = num_blocks; b < next_blocks; ++b)
    for (int64_t h = 0; h < kvh1 - kvh0; ++h) prefetch_run(k_run(next_table, b, next_kvh0 + h), run);
  for (int64_t g = 0; g < heads; ++g) {  // softmax, normalized at the end
    float* s = scores + g * len;
    sums[g] = exp_shifted16(s, len, max_of(s, len));
  }
  // pv(head_off, g, ng) for every 4 query heads [g, g + ng) of the item: V at head_off inside a block
  // (their KV head's run) into them.
  auto for_each_head_tile = [&](const auto& pv) {
    for (int64_t h = 0; h < kvh1 - kvh0; ++h)
      for (int64_t g = h * group; g < (h + 1) * group; g += 4)
        pv((kvh0 + h) * run, g, std::min<int64_t>(4, (h + 1) * group - g));
  };
  bool chunks_done = false;  // V summed by the bf16-pair path (which widens V exactly)
  float v_unit = kLoadUnit<C>;  // acc's unit: load16's
  const int64_t chunks = d / kLanesWide;
#if defined(__AVX512BF16__)
  auto pv_pairs = [&](const auto& rows) {  // every column in passes of rows.kCols (d a multiple of it)
    for (int64_t g = 0; g < heads; ++g)
      to_bf16_pairs(reinterpret_cast<uint16_t*>(pairs + g * pair_stride), scores + g * len, len);
    for_each_head_tile([&](int64_t head_off, int64_t g, int64_t ng) {
      for (int64_t c = 0; c < d; c += rows.kCols)
        pv_pairs_heads(rows, acc + g * d, pairs + g * pair_stride, pair_stride, len, v_cache, table, block_stride,
                       head_off, block_size, d, c, ng);
    });
    chunks_done = true;
    v_unit = 1.0f;
  };
  if (std::is_same_v<T, c10::BFloat16> && block_size % 2 == 0) {  // probabilities in bf16: bf16 models only
    if constexpr (std::is_same_v<C, c10::BFloat16>) {
      if (d % 64 == 0) pv_pairs(Bf16Rows<2>{});
      else if (d % 32 == 0) pv_pairs(Bf16Rows<1>{});
    }
#if defined(__AVX512VBMI__)
    if constexpr (std::is_same_v<C, c10::Float8_e4m3fn>)
      if (d % 64 == 0) pv_pairs(Fp8Rows{});
#endif
  }
#endif
  if (!chunks_done)
    for_each_head_tile([&](int64_t head_off, int64_t g, int64_t ng) {
      int64_t c = 0;
      for (; c + 4 <= chunks; c += 4)
        pv_heads16<4>(acc + g * d, scores + g * len, len, v_cache, table, block_stride, head_off, block_size, d,
                      c * kLanesWide, ng);
      for (; c < chunks; ++c)
        pv_heads16<1>(acc + g * d, scores + g * len, len, v_cache, table, block_stride, head_off, block_size, d,
                      c * kLanesWide, ng);
    });
  for (int64_t g = 0; g < heads; ++g) {
    const float inv_sum = v_unit / sums[g];
    T* dst = out + kvh0 * group * d + g * d;
    for (int64_t c = 0; c < d; ++c) dst[c] = static_cast<T>(acc[g * d + c] * inv_sum);
  }
}
constexpr bool kHaveAttendAvx512 = true;
#else
template <typename T, typename C>
void attend_one_avx512(T*, const T*, const C*, const C*, const int32_t*, int64_t, int64_t, int64_t, int64_t,
                       int64_t, int64_t, int64_t, float, const int32_t*, int64_t, int64_t, std::vector<float>&) {}
constexpr bool kHaveAttendAvx512 = false;
#endif

// out, query: [num_tokens, num_heads, head_dim] (rows may be strided, heads contiguous);
// k_cache, v_cache: [num_blocks, num_kv_heads, block_size, head_dim] contiguous, query's dtype or fp8;
// block_tables: [num_reqs, max_blocks] int32; seq_lens: [num_reqs] int32 (tokens in the cache
// after this step); query_start_loc: [num_reqs + 1] int32. Request r's query rows are the
// newest tokens of its sequence and attend causally to its cached tokens.
Tensor paged_attention(const Tensor& query, const Tensor& k_cache, const Tensor& v_cache,
                       const Tensor& block_tables, const Tensor& seq_lens,
                       const Tensor& query_start_loc, double scale) {
  for (const Tensor* t : {&query, &k_cache, &v_cache, &block_tables, &seq_lens, &query_start_loc})
    check_cpu(*t, "paged_attention");
  TORCH_CHECK(query.dim() == 3, "query: [num_tokens, heads, dim]");
  Tensor out = at::empty(query.sizes(), query.options());
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
              k_cache.sizes() == v_cache.sizes(), "caches: contiguous [blocks, kv_heads, block_size, dim]");
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type(), "K and V caches must share a dtype");
  TORCH_CHECK(query.stride(2) == 1 && query.stride(1) == query.size(2),
              "query: each token's heads must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.is_contiguous() &&
              seq_lens.scalar_type() == at::kInt && query_start_loc.scalar_type() == at::kInt &&
              seq_lens.is_contiguous() && query_start_loc.is_contiguous(),
              "block_tables, seq_lens, query_start_loc: contiguous int32");
  const int64_t num_tokens = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t num_kv_heads = k_cache.size(1), block_size = k_cache.size(2);
  const int64_t num_reqs = seq_lens.size(0), max_blocks = block_tables.size(1);
  TORCH_CHECK(k_cache.size(3) == head_dim && num_heads % num_kv_heads == 0, "head shapes disagree");
  TORCH_CHECK(query_start_loc.size(0) == num_reqs + 1 && block_tables.size(0) >= num_reqs,
              "one seq_len and one block table per request");
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  TORCH_CHECK(qsl[0] == 0 && qsl[num_reqs] == num_tokens, "query_start_loc must cover the tokens");
  // token -> request, checked once (the work items below trust it).
  std::vector<int32_t> req_of(num_tokens);
  for (int64_t r = 0; r < num_reqs; ++r) {
    const int64_t q_len = qsl[r + 1] - qsl[r];
    TORCH_CHECK(q_len >= 0 && q_len <= lens[r] && lens[r] <= max_blocks * block_size,
                "request ", r, ": bad query length or seq_len");
    for (int64_t i = qsl[r]; i < qsl[r + 1]; ++i) req_of[i] = static_cast<int32_t>(r);
  }
  const int64_t group = num_heads / num_kv_heads;
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t num_blocks = k_cache.size(0);
  for (int64_t r = 0; r < num_reqs; ++r)
    for (int64_t b = 0; b < (lens[r] + block_size - 1) / block_size; ++b)
      TORCH_CHECK(tables[r * max_blocks + b] >= 0 && tables[r * max_blocks + b] < num_blocks,
                  "block table of request ", r, " holds an invalid block ID");
  const bool wide = kHaveAttendAvx512 && head_dim % 16 == 0;  // the AVX-512 kernel
  TANDEM_DISPATCH_CACHE(query.scalar_type(), k_cache.scalar_type(), "paged_attention", [&] {
    const scalar_t* q = query.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    const cache_t* kc = static_cast<const cache_t*>(k_cache.data_ptr());
    const cache_t* vc = static_cast<const cache_t*>(v_cache.data_ptr());
    const int64_t q_stride = query.stride(0), o_stride = out.stride(0);
    auto keys_seen = [&](int64_t tok) {  // keys query row tok attends to
      const int64_t r = req_of[tok];
      return lens[r] - (qsl[r + 1] - qsl[r]) + (tok - qsl[r]) + 1;
    };
    if (wide) {
      // Work items: a token's KV heads together when there are tokens enough to share out (then each
      // block's K is read in one pass: measured ~8 % faster batch-32 attention), else one KV head each.
      const int64_t per_item = num_tokens >= 4 * at::get_num_threads() ? num_kv_heads : 1;
      const int64_t items_per_token = num_kv_heads / per_item;
      at::parallel_for(0, num_tokens * items_per_token, 1, [&](int64_t begin, int64_t end) {
        std::vector<float> scratch;
        for (int64_t item = begin; item < end; ++item) {
          const int64_t tok = item / items_per_token, kvh0 = item % items_per_token * per_item;
          const int32_t* next_table = nullptr;  // the next item's K blocks, prefetched meanwhile
          int64_t next_blocks = 0;
          if (item + 1 < end) {
            const int64_t next_tok = (item + 1) / items_per_token;
            next_table = tables + req_of[next_tok] * max_blocks;
            next_blocks = (keys_seen(next_tok) + block_size - 1) / block_size;
          }
          attend_one_avx512(o + tok * o_stride, q + tok * q_stride, kc, vc, tables + req_of[tok] * max_blocks,
                            keys_seen(tok), kvh0, kvh0 + per_item, group, head_dim, block_size, num_kv_heads,
                            static_cast<float>(scale), next_table, next_blocks,
                            (item + 1) % items_per_token * per_item, scratch);
        }
      });
      return;
    }
    at::parallel_for(0, num_tokens * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scratch;
      for (int64_t item = begin; item < end; ++item) {
        const int64_t tok = item / num_kv_heads, kvh = item % num_kv_heads;
        attend_one(o + tok * o_stride, q + tok * q_stride, kc, vc, tables + req_of[tok] * max_blocks,
                   keys_seen(tok), kvh, group, head_dim, block_size, num_kv_heads, static_cast<float>(scale),
                   scratch);
      }
    });
  });
  return out;
}

// ---- KV cache ---------------------------------------------------------------------

constexpr float kFp8Max = 448.0f;  // e4m3fn's largest finite value

// key, value: [num_tokens, num_kv_heads, head_dim] (rows may be strided); slot_mapping:
// [num_tokens] int64, slot = block * block_size + row -> cache[block, :, row, :].
void write_kv_cache(const Tensor& key, const Tensor& value, Tensor k_cache, Tensor v_cache,
                    const Tensor& slot_mapping) {
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes(), "key/value: [num_tokens, kv_heads, dim]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
              v_cache.sizes() == k_cache.sizes() && k_cache.size(1) == key.size(1) &&
              k_cache.size(3) == key.size(2), "caches: contiguous [blocks, kv_heads, block_size, dim]");
  TORCH_CHECK(value.scalar_type() == key.scalar_type() && v_cache.scalar_type() == k_cache.scalar_type(),
              "key and value, and the two caches, must share a dtype");
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1, "key/value: each head's dims must be contiguous");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
              slot_mapping.size(0) == key.size(0), "slot_mapping: [num_tokens] int64");
  const int64_t num_tokens = key.size(0), heads = key.size(1), dim = key.size(2);
  const int64_t block_size = k_cache.size(2), num_slots = k_cache.size(0) * block_size;
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t i = 0; i < num_tokens; ++i)
    TORCH_CHECK(slots[i] >= 0 && slots[i] < num_slots, "slot ", slots[i], " is outside the cache");
  TANDEM_DISPATCH_CACHE(key.scalar_type(), k_cache.scalar_type(), "write_kv_cache", [&] {
    const scalar_t* k = key.data_ptr<scalar_t>();
    const scalar_t* v = value.data_ptr<scalar_t>();
    cache_t* kc = static_cast<cache_t*>(k_cache.data_ptr());
    cache_t* vc = static_cast<cache_t*>(v_cache.data_ptr());
    auto put = [&](const scalar_t* src, cache_t* dst) {
      if constexpr (std::is_same_v<cache_t, scalar_t>) {
        std::copy_n(src, dim, dst);
      } else {  // fp8: torch's conversion (nearest even) of the value clamped to +-448 (NaN stays NaN)
        for (int64_t c = 0; c < dim; ++c) dst[c] = cache_t(std::clamp(to_f(src[c]), -kFp8Max, kFp8Max));
      }
    };
    for (int64_t i = 0; i < num_tokens; ++i) {
      const int64_t block = slots[i] / block_size, row = slots[i] % block_size;
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t dst = ((block * heads + h) * block_size + row) * dim;
        put(k + i * key.stride(0) + h * key.stride(1), kc + dst);
        put(v + i * value.stride(0) + h * value.stride(1), vc + dst);
      }
    }
  });
}

// ---- norms ------------------------------------------------------------------------

// HF's order: normalize in fp32, cast to the dtype, then scale by the weight (in the dtype).
template <typename T>
inline void rms_norm_row(T* out, const T* x, const T* weight, int64_t n, float eps) {
  if constexpr (kWideRows<T>) {
    vf16 acc{};
    int64_t i = 0;
    for (; i + kLanesWide <= n; i += kLanesWide) {
      const vf16 v = load16f(x + i);
      acc += v * v;
    }
    float ss = 0.0f;
    for (int j = 0; j < kLanesWide; ++j) ss += acc[j];
    for (; i < n; ++i) ss += to_f(x[i]) * to_f(x[i]);
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
    int64_t k = 0;
    for (; k + kLanesWide <= n; k += kLanesWide)
      store16(out + k, round16<T>(load16f(weight + k) * round16<T>(load16f(x + k) * inv)));
    for (; k < n; ++k) out[k] = static_cast<T>(to_f(weight[k]) * to_f(static_cast<T>(to_f(x[k]) * inv)));
    return;
  }
  float lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) {
      const float v = to_f(x[i + j]);
      lane[j] += v * v;
    }
  float ss = ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
  for (; i < n; ++i) ss += to_f(x[i]) * to_f(x[i]);
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
  for (int64_t k = 0; k < n; ++k)
    out[k] = static_cast<T>(to_f(weight[k]) * to_f(static_cast<T>(to_f(x[k]) * inv)));
}

void check_rows(const Tensor& t, const Tensor& weight, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1 && t.size(1) == weight.size(0), name,
              ": [num_tokens, hidden] with contiguous rows, hidden = weight's size");
  TORCH_CHECK(t.scalar_type() == weight.scalar_type() && weight.is_contiguous(), name,
              ": weight must be contiguous, of the input's dtype");
}

// rms_norm(x) * weight; x: [num_tokens, hidden] -> a new [num_tokens, hidden].
Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps) {
  check_rows(x, weight, "rms_norm");
  Tensor out = at::empty(x.sizes(), x.options());
  TANDEM_DISPATCH(x.scalar_type(), "rms_norm", [&] {
    const int64_t n = x.size(1);
    at::parallel_for(0, x.size(0), 16, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i)
        rms_norm_row(out.data_ptr<scalar_t>() + i * out.stride(0), x.data_ptr<scalar_t>() + i * x.stride(0),
                     weight.data_ptr<scalar_t>(), n, static_cast<float>(eps));
    });
  });
  return out;
}

// residual[0:n] += x[0:n], rounded to T.
template <typename T>
inline void add_row(T* residual, const T* x, int64_t n) {
  int64_t k = 0;
  if constexpr (kWideRows<T>)
    for (; k + kLanesWide <= n; k += kLanesWide)
      store16(residual + k, round16<T>(load16f(x + k) + load16f(residual + k)));
  for (; k < n; ++k) residual[k] = static_cast<T>(to_f(x[k]) + to_f(residual[k]));
}

// In place: residual = x + residual; x = rms_norm(residual) * weight.
void fused_add_rms_norm(Tensor x, Tensor residual, const Tensor& weight, double eps) {
  check_rows(x, weight, "fused_add_rms_norm");
  check_rows(residual, weight, "fused_add_rms_norm");
  TORCH_CHECK(x.size(0) == residual.size(0), "fused_add_rms_norm: x and residual differ in rows");
  TANDEM_DISPATCH(x.scalar_type(), "fused_add_rms_norm", [&] {
    const int64_t n = x.size(1);
    at::parallel_for(0, x.size(0), 16, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        scalar_t* xr = x.data_ptr<scalar_t>() + i * x.stride(0);
        scalar_t* rr = residual.data_ptr<scalar_t>() + i * residual.stride(0);
        add_row(rr, xr, n);
        rms_norm_row(xr, rr, weight.data_ptr<scalar_t>(), n, static_cast<float>(eps));
      }
    });
  });
}

// ---- rotary embedding ---------------------------------------------------------------

// In place on query [num_tokens, num_heads * head_dim] and key [num_tokens, num_kv_heads *
// head_dim] (rows may be strided: views into the fused QKV output). cos_sin_cache:
// [max_positions, rotary_dim] fp32 = cos | sin. NeoX pairs dim i with i + rotary_dim / 2,
// GPT-J pairs 2i with 2i + 1.
template <typename T>
inline void rotate_head(T* x, const float* cos, const float* sin, int64_t half, bool is_neox) {
  for (int64_t i = 0; i < half; ++i) {
    const int64_t a = is_neox ? i : 2 * i, b = is_neox ? i + half : 2 * i + 1;
    const float x1 = to_f(x[a]), x2 = to_f(x[b]);
    const float c = cos[i], s = sin[i];
    const float p = x1 * c, q = x2 * s, r = x2 * c, t = x1 * s;  // rounded apart, as the reference
    x[a] = static_cast<T>(p - q);
    x[b] = static_cast<T>(r + t);
  }
}

void rotary_embedding(const Tensor& positions, Tensor query, Tensor key, const Tensor& cos_sin_cache,
                      int64_t head_dim, bool is_neox) {
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous(), "positions: int64");
  TORCH_CHECK(cos_sin_cache.scalar_type() == at::kFloat && cos_sin_cache.is_contiguous() &&
              cos_sin_cache.dim() == 2, "cos_sin_cache: contiguous fp32 [max_positions, rotary_dim]");
  TORCH_CHECK(query.dim() == 2 && key.dim() == 2 && query.stride(1) == 1 && key.stride(1) == 1 &&
              query.size(0) == positions.size(0) && key.size(0) == positions.size(0) &&
              query.size(1) % head_dim == 0 && key.size(1) % head_dim == 0,
              "query/key: [num_tokens, heads * head_dim] with contiguous rows");
  TORCH_CHECK(query.scalar_type() == key.scalar_type(), "query and key must share a dtype");
  const int64_t rot = cos_sin_cache.size(1), half = rot / 2;
  TORCH_CHECK(rot % 2 == 0 && rot <= head_dim, "rotary_dim must be even and <= head_dim");
  const int64_t num_tokens = positions.size(0), max_pos = cos_sin_cache.size(0);
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t i = 0; i < num_tokens; ++i)
    TORCH_CHECK(pos[i] >= 0 && pos[i] < max_pos, "position ", pos[i], " is outside the rotary table");
  const int64_t q_heads = query.size(1) / head_dim, k_heads = key.size(1) / head_dim;
  TANDEM_DISPATCH(query.scalar_type(), "rotary_embedding", [&] {
    at::parallel_for(0, num_tokens, 16, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const float* cos = cos_sin_cache.data_ptr<float>() + pos[i] * rot;
        const float* sin = cos + half;
        scalar_t* q = query.data_ptr<scalar_t>() + i * query.stride(0);
        scalar_t* k = key.data_ptr<scalar_t>() + i * key.stride(0);
        for (int64_t h = 0; h < q_heads; ++h) rotate_head(q + h * head_dim, cos, sin, half, is_neox);
        for (int64_t h = 0; h < k_heads; ++h) rotate_head(k + h * head_dim, cos, sin, half, is_neox);
      }
    });
  });
}

// ---- a layer's whole attention, one call ------------------------------------------------

// qkv: [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim] = q | k | v, the fused projection's
// output (rows contiguous). In place: rotary on q and k (when cos_sin_cache is given), then k and
// v written to the cache slots; returns attention over the cache, [num_tokens, num_heads * head_dim].
// The same as rotary_embedding, write_kv_cache and paged_attention in a row, in one op call.
Tensor attention_block(Tensor qkv, const c10::optional<Tensor>& positions, const c10::optional<Tensor>& cos_sin_cache,
                       bool is_neox, Tensor k_cache, Tensor v_cache, const Tensor& slot_mapping,
                       const Tensor& block_tables, const Tensor& seq_lens, const Tensor& query_start_loc,
                       int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double scale) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 &&
              qkv.size(1) == (num_heads + 2 * num_kv_heads) * head_dim,
              "attention_block: qkv must be [num_tokens, (heads + 2 * kv_heads) * head_dim], rows contiguous");
  const int64_t num_tokens = qkv.size(0), q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  Tensor q = qkv.narrow(1, 0, q_size), k = qkv.narrow(1, q_size, kv_size), v = qkv.narrow(1, q_size + kv_size, kv_size);
  if (cos_sin_cache.has_value() && cos_sin_cache->defined()) {
    TORCH_CHECK(positions.has_value() && positions->defined(), "attention_block: rotary needs positions");
    rotary_embedding(*positions, q, k, *cos_sin_cache, head_dim, is_neox);
  }
  write_kv_cache(k.view({num_tokens, num_kv_heads, head_dim}), v.view({num_tokens, num_kv_heads, head_dim}),
                 k_cache, v_cache, slot_mapping);
  return paged_attention(q.view({num_tokens, num_heads, head_dim}), k_cache, v_cache, block_tables, seq_lens,
                         query_start_loc, scale)
      .view({num_tokens, q_size});
}

// ---- activations ----------------------------------------------------------------------

// silu of 16 lanes, unrounded: silu16 (exp with fused multiply-adds and vscalefps) where the
// target has AVX-512, else the generic polynomial (-ffp-contract=off keeps it unfused).
inline vf16 silu_wide(vf16 x) {
#if defined(__AVX512F__)
  return silu16(x);
#else
  return x / (1.0f + vexp16(-x));
#endif
}

// x: [num_tokens, 2 * d] = gate | up -> out [num_tokens, d] = silu(gate) * up, silu rounded to
// the dtype first (as F.silu(gate) * up).
template <typename T>
void silu_and_mul_row(T* out, const T* gate, const T* up, int64_t d, float* buf) {
  if constexpr (kWideRows<T>) {
    int64_t k = 0;
    for (; k + kLanesWide <= d; k += kLanesWide) {
      const vf16 g = load16f(gate + k);
      store16(out + k, round16<T>(round16<T>(silu_wide(g)) * load16f(up + k)));
    }
    for (; k < d; ++k) {
      const float g = to_f(gate[k]);
      out[k] = static_cast<T>(to_f(static_cast<T>(g / (1.0f + exp_scalar(-g)))) * to_f(up[k]));
    }
    return;
  }
  load_row(buf, gate, d);
  int64_t k = 0;
  for (; k + kLanes <= d; k += kLanes) {
    const vf v = vload(buf + k);
    vstore(buf + k, v / (vsplat(1.0f) + vexp(-v)));
  }
  for (; k < d; ++k) buf[k] = buf[k] / (1.0f + exp_scalar(-buf[k]));
  for (k = 0; k < d; ++k) out[k] = static_cast<T>(to_f(static_cast<T>(buf[k])) * to_f(up[k]));
}

Tensor silu_and_mul(const Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0 && x.stride(1) == 1,
              "silu_and_mul: x must be [num_tokens, 2 * d] with contiguous rows");
  Tensor out = at::empty({x.size(0), x.size(1) / 2}, x.options());
  TANDEM_DISPATCH(x.scalar_type(), "silu_and_mul", [&] {
    const int64_t d = out.size(1);
    at::parallel_for(0, x.size(0), 4, [&](int64_t begin, int64_t end) {
      std::vector<float> buf(d);
      for (int64_t i = begin; i < end; ++i) {
        const scalar_t* g = x.data_ptr<scalar_t>() + i * x.stride(0);
        silu_and_mul_row(out.data_ptr<scalar_t>() + i * d, g, g + d, d, buf.data());
      }
    });
  });
  return out;
}

// ---- greedy sampling --------------------------------------------------------------------

// The index of the first maximum of x [n] (torch.max's: a NaN counts as the maximum).
template <typename T>
int64_t argmax_row(const T* x, int64_t n) {
  float best = -INFINITY;
  int64_t at = 0, k = 0;
  bool nan = false;
  if constexpr (kWideRows<T>) {
    vf16 top = vf16{} - INFINITY;
    vi16 top_at{}, lane{};
    for (int j = 0; j < kLanesWide; ++j) lane[j] = j;
    vi16 nans{};
    for (; k + kLanesWide <= n; k += kLanesWide, lane += kLanesWide) {
      const vf16 v = load16f(x + k);
      const vi16 higher = v > top;  // strict: each lane keeps its first maximum
      top = higher ? v : top;
      top_at = higher ? lane : top_at;
      nans |= v != v;
    }
    for (int j = 0; j < kLanesWide; ++j) {
      nan = nan || nans[j];
      if (top[j] > best || (top[j] == best && top_at[j] < at)) best = top[j], at = top_at[j];
    }
  }
  for (; k < n; ++k) {
    const float v = to_f(x[k]);
    nan = nan || v != v;
    if (v > best) best = v, at = k;
  }
  if (nan)
    for (k = 0; k < n; ++k)
      if (to_f(x[k]) != to_f(x[k])) return k;
  return at;
}

// x [M, N] -> [M] int64: each row's argmax (the first maximum), as x.max(dim=-1).indices.
Tensor argmax_rows(const Tensor& x) {
  check_cpu(x, "argmax_rows");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) > 0,
              "argmax_rows: x must be [rows, n > 0] with contiguous rows");
  Tensor out = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  TANDEM_DISPATCH(x.scalar_type(), "argmax_rows", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    int64_t* op = out.data_ptr<int64_t>();
    at::parallel_for(0, x.size(0), 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) op[i] = argmax_row(xp + i * x.stride(0), x.size(1));
    });
  });
  return out;
}

// ---- weight-only int8 linear -----------------------------------------------------------

// 8 int8 weights as floats (exact).
inline vf load_int8(const int8_t* p) {
#if defined(__AVX2__)
  const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  vf v;
  std::memcpy(&v, &f, sizeof v);
  return v;
#else
  vf v;
  for (int i = 0; i < kLanes; ++i) v[i] = static_cast<float>(p[i]);
  return v;
#endif
}

// out[m, n] for m in [m0, m0 + MT), n in [n0, n0 + NT): sum_k x[m, k] * w[n, k], times scale[n],
// plus bias[n]. Each int8 weight vector is converted once and used for MT rows of x. The first
// row tile prefetches the weight rows kPrefetchRows ahead (measured: +30% bandwidth at batch 1).
constexpr int64_t kPrefetchRows = 4;

inline vf load_weight(const int8_t* p) { return load_int8(p); }
inline vf load_weight(const float* p) { return vload(p); }

// W is the int8 weight itself, or (many rows of x) this tile's rows already converted to float.
template <int NT, int MT, typename W>
inline void int8_tile(float* out, int64_t out_stride, const float* x, int64_t x_stride, const W* w,
                      const float* scale, const float* bias, int64_t n_size, int64_t k_size, int64_t n0,
                      int64_t m0) {
  if (std::is_same_v<W, int8_t> && m0 == 0)
    for (int64_t j = 0; j < NT && n0 + j + kPrefetchRows < n_size; ++j)
      prefetch_run(w + (n0 + j + kPrefetchRows) * k_size, k_size);
  vf acc[MT][NT];
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NT; ++j) acc[i][j] = vsplat(0.0f);
  int64_t k = 0;
  for (; k + kLanes <= k_size; k += kLanes) {
    vf wv[NT];
    for (int j = 0; j < NT; ++j) wv[j] = load_weight(w + (n0 + j) * k_size + k);
    for (int i = 0; i < MT; ++i) {
      const vf xv = vload(x + (m0 + i) * x_stride + k);
      for (int j = 0; j < NT; ++j) acc[i][j] += wv[j] * xv;
    }
  }
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NT; ++j) {
      float sum = hsum(acc[i][j]);
      for (int64_t r = k; r < k_size; ++r)
        sum += x[(m0 + i) * x_stride + r] * static_cast<float>(w[(n0 + j) * k_size + r]);
      out[(m0 + i) * out_stride + n0 + j] = sum * scale[n0 + j] + (bias ? bias[n0 + j] : 0.0f);
    }
}

// Columns [n0, n0 + NT) for every row of x, three rows at a time. With more than a few rows the
// tile's weight rows are converted to float once, into buf ([NT, k_size], in cache), rather than
// once per three rows: the same products in the same order, so the same results.
template <int NT>
inline void int8_columns(float* out, const float* x, int64_t x_stride, const int8_t* w, const float* scale,
                         const float* bias, int64_t m_size, int64_t n_size, int64_t k_size, int64_t n0,
                         std::vector<float>& buf) {
  auto rows = [&](auto* weights, int64_t n_first) {
    int64_t m0 = 0;
    for (; m0 + 3 <= m_size; m0 += 3)
      int8_tile<NT, 3>(out, n_size, x, x_stride, weights, scale, bias, n_size, k_size, n_first, m0);
    if (m_size - m0 == 2)
      int8_tile<NT, 2>(out, n_size, x, x_stride, weights, scale, bias, n_size, k_size, n_first, m0);
    else if (m_size - m0 == 1)
      int8_tile<NT, 1>(out, n_size, x, x_stride, weights, scale, bias, n_size, k_size, n_first, m0);
  };
  if (m_size <= 6) {
    rows(w, n0);
    return;
  }
  buf.resize(NT * k_size);
  for (int64_t i = 0; i < NT * k_size; ++i) buf[i] = static_cast<float>(w[n0 * k_size + i]);
  // Index buf as rows n0.. of a matrix that starts n0 rows before it (out, scale, bias keep n).
  rows(buf.data() - n0 * k_size, n0);
}

// The int8 linears' arguments: x float32 [M, K] (rows contiguous), weight contiguous int8 [N, K],
// scale float32 [N], bias float32 [N] or none. Returns the bias data (nullptr without one).
const float* checked_int8_linear_bias(const char* op, const Tensor& x, const Tensor& weight, const Tensor& scale,
                                      const c10::optional<Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              op, ": x must be float32 [M, K] with contiguous rows");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kChar && weight.is_contiguous() &&
              weight.size(1) == x.size(1), op, ": weight must be contiguous int8 [N, K]");
  const int64_t n_size = weight.size(0);
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == n_size,
              op, ": scale must be float32 [N]");
  if (!bias.has_value() || !bias->defined()) return nullptr;
  TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n_size,
              op, ": bias must be float32 [N]");
  return bias->data_ptr<float>();
}

// out [M, N] = x [M, K] @ (weight [N, K] int8 * scale [N])^T + bias [N]: weight-only int8 with
// float activations. Every output's sum runs over k in the same order whatever M is, so a
// request's results do not depend on the batch it shares a step with.
Tensor int8_linear(const Tensor& x, const Tensor& weight, const Tensor& scale,
                   const c10::optional<Tensor>& bias) {
  const float* b = checked_int8_linear_bias("int8_linear", x, weight, scale, bias);
  const int64_t m_size = x.size(0), k_size = x.size(1), n_size = weight.size(0);
  Tensor out = at::empty({m_size, n_size}, x.options());
  const float* xp = x.data_ptr<float>();
  const int8_t* wp = weight.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t x_stride = x.stride(0);
  // Output columns per tile: 2 at batch 1 (more concurrent weight streams), else 4 (each
  // converted weight vector serves more rows of x).
  const int64_t tile = m_size == 1 ? 2 : 4;
  at::parallel_for(0, (n_size + tile - 1) / tile, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> buf;
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * tile;
      if (n0 + tile > n_size) {
        for (int64_t n = n0; n < n_size; ++n)
          int8_columns<1>(op, xp, x_stride, wp, sp, b, m_size, n_size, k_size, n, buf);
      } else if (tile == 2) {
        int8_columns<2>(op, xp, x_stride, wp, sp, b, m_size, n_size, k_size, n0, buf);
      } else {
        int8_columns<4>(op, xp, x_stride, wp, sp, b, m_size, n_size, k_size, n0, buf);
      }
    }
  });
  return out;
}


// ---- int8 weights x int8 activations (w8a8) -------------------------------------------
// Activations are quantized on the fly in blocks of kQBlock along K (one symmetric scale per
// row and block, round half to even), weights are the int8 per-channel weights above. A block's
// products are summed exactly in int32, per lane: lane i holds bytes 4i..4i+3 of the block, as
// AVX2's maddubs + madd leave them; each lane then accumulates float(lane) * x_scale in float,
// and the lanes are summed by hsum. The order depends on K only, never on M (batch-invariant).
constexpr int64_t kQBlock = 32;

// x [K] -> q [K] int8, scale [ceil(K / kQBlock)]: per block s = max|x| / 127, q = round(x / s).
inline void quantize_row(const float* x, int64_t k_size, int8_t* q, float* scale) {
  for (int64_t b0 = 0, b = 0; b0 < k_size; b0 += kQBlock, ++b) {
    const int64_t n = std::min(kQBlock, k_size - b0);
    float amax = 0.0f;
    for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(x[b0 + i]));
    const float s = amax / 127.0f;
    scale[b] = s;
    for (int64_t i = 0; i < n; ++i) q[b0 + i] = s > 0.0f ? static_cast<int8_t>(std::nearbyint(x[b0 + i] / s)) : 0;
  }
}

// The 8 int32 lane sums of one full block: lane i = sum over bytes 4i..4i+3 of w * x.
inline vi block_lanes(const int8_t* w, const int8_t* x) {
#if defined(__AVX2__)
  const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  // |w| (unsigned) times x with w's sign: products fit int16 pairs (2 * 127 * 127 < 2^15).
  const __m256i pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(xv, wv));
  const __m256i lanes = _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
  vi v;
  std::memcpy(&v, &lanes, sizeof v);
  return v;
#else
  vi v;
  for (int i = 0; i < 8; ++i) {
    int32_t sum = 0;
    for (int j = 4 * i; j < 4 * i + 4; ++j) sum += static_cast<int32_t>(w[j]) * x[j];
    v[i] = sum;
  }
  return v;
#endif
}

// out[m, n0 + j] for MT rows from m0 and NT weight rows from n0.
template <int NT, int MT>
inline void w8a8_tile(float* out, int64_t n_size, const int8_t* xq, const float* xs, int64_t kb,
                      const int8_t* w, const float* scale, const float* bias, int64_t k_size, int64_t n0,
                      int64_t m0) {
  if (m0 == 0)
    for (int64_t j = 0; j < NT && n0 + j + kPrefetchRows < n_size; ++j)
      prefetch_run(w + (n0 + j + kPrefetchRows) * k_size, k_size);
  vf acc[MT][NT];
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NT; ++j) acc[i][j] = vsplat(0.0f);
  const int64_t full = k_size / kQBlock;
  for (int64_t b = 0; b < full; ++b) {
    for (int i = 0; i < MT; ++i) {
      const vf s = vsplat(xs[(m0 + i) * kb + b]);
      const int8_t* x = xq + (m0 + i) * k_size + b * kQBlock;
      for (int j = 0; j < NT; ++j)
        acc[i][j] += __builtin_convertvector(block_lanes(w + (n0 + j) * k_size + b * kQBlock, x), vf) * s;
    }
  }
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NT; ++j) {
      float sum = hsum(acc[i][j]);
      if (full < kb) {  // a last, partial block
        int32_t tail = 0;
        for (int64_t r = full * kQBlock; r < k_size; ++r)
          tail += static_cast<int32_t>(w[(n0 + j) * k_size + r]) * xq[(m0 + i) * k_size + r];
        sum += static_cast<float>(tail) * xs[(m0 + i) * kb + full];
      }
      out[(m0 + i) * n_size + n0 + j] = sum * scale[n0 + j] + (bias ? bias[n0 + j] : 0.0f);
    }
}

template <int NT>
inline void w8a8_columns(float* out, int64_t n_size, const int8_t* xq, const float* xs, int64_t kb,
                         const int8_t* w, const float* scale, const float* bias, int64_t m_size,
                         int64_t k_size, int64_t n0) {
  int64_t m0 = 0;
  for (; m0 + 4 <= m_size; m0 += 4) w8a8_tile<NT, 4>(out, n_size, xq, xs, kb, w, scale, bias, k_size, n0, m0);
  for (; m0 < m_size; ++m0) w8a8_tile<NT, 1>(out, n_size, xq, xs, kb, w, scale, bias, k_size, n0, m0);
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// ---- w8a8 with AVX-512 VNNI ------------------------------------------------------------
// vpdpbusd multiplies unsigned by signed bytes and adds each group of 4 products into an int32
// lane. The weights are made unsigned as they are loaded by flipping their sign bit (w + 128); the
// 128 * x each product then gains depends on the activations only, so each lane's sum starts at
// -128 * (its 4 activation bytes' sum) (one more vpdpbusd per row and chunk): the sums stay exact.
// A 64-byte chunk holds two 32-wide blocks, lanes 0-7 the first and 8-15 the second; each lane is
// converted to float, times its block's activation scale, and accumulated in float over the
// chunks. The order depends on K only, never on M (batch-invariant), but is not the AVX2 kernel's:
// the two builds agree with the reference, not bit for bit with each other.

constexpr int64_t kChunk = 64;

// Activations quantized for the VNNI tiles: per row, the bytes in 64-byte chunks (the last one
// zero-padded) and the blocks' scales (2 per chunk). Small enough that a batch's rows stay in L1
// while the weight tiles stream past them.
struct VnniActivations {
  int64_t chunks = 0;        // ceil(K / 64)
  std::vector<int8_t> q;     // [M, chunks * 64]
  std::vector<float> scale;  // [M, chunks * 2]
};

// One row by quantize_row's rule (the same division and round-half-even, so the same bytes).
inline void vnni_quantize_row(const float* x, int64_t k_size, int64_t chunks, int8_t* q, float* scale) {
  std::fill(q, q + chunks * kChunk, 0);
  for (int64_t b = 0; b < 2 * chunks; ++b) {
    const int64_t k0 = b * kQBlock;
    const int64_t n = std::max<int64_t>(0, std::min(kQBlock, k_size - k0));
    const __mmask16 lo = static_cast<__mmask16>(n >= 16 ? 0xFFFF : (1u << n) - 1);
    const __mmask16 hi = static_cast<__mmask16>(n >= 32 ? 0xFFFF : n > 16 ? (1u << (n - 16)) - 1 : 0);
    const __m512 x0 = _mm512_maskz_loadu_ps(lo, x + k0), x1 = _mm512_maskz_loadu_ps(hi, x + k0 + 16);
    const float s = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1))) / 127.0f;
    scale[b] = s;
    if (s > 0.0f) {
      const __m512 sv = _mm512_set1_ps(s);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k0), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_div_ps(x0, sv))));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k0 + 16),
                       _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_div_ps(x1, sv))));
    }
  }
}

// out[m, n0 + j] for MT rows from m0 and NT weight rows from n0. kMasked: K is not a multiple of
// 64, so every weight load is masked to the row (GCC then keeps the accumulators in memory as
// well as in registers: a store per multiply-add, so the common shapes take the unmasked loop).
template <int MT, int NT, bool kMasked>
inline void vnni_tile(float* out, int64_t n_size, const VnniActivations& x, int64_t m0, const int8_t* w,
                      int64_t k_size, const float* w_scale, const float* bias, int64_t n0) {
  if (m0 == 0)
    for (int64_t j = 0; j < NT && n0 + j + kPrefetchRows < n_size; ++j)
      prefetch_run(w + (n0 + j + kPrefetchRows) * k_size, k_size);
  const int64_t chunks = x.chunks;
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));  // also 128 as an unsigned byte
  const __m512i halves = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  __m512 acc[MT][NT];
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NT; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t c = 0; c < chunks; ++c) {
    __m512i wv[NT];
    for (int j = 0; j < NT; ++j) {
      const int8_t* wp = w + (n0 + j) * k_size + c * kChunk;
      if constexpr (kMasked) {  // bytes past K load as 0 and flip to 128, times x = 0
        const int64_t left = k_size - c * kChunk;
        const __mmask64 mask = left >= kChunk ? ~__mmask64{0} : (__mmask64{1} << left) - 1;
        wv[j] = _mm512_xor_si512(_mm512_maskz_loadu_epi8(mask, wp), flip);
      } else {
        wv[j] = _mm512_xor_si512(_mm512_loadu_si512(wp), flip);
      }
    }
    for (int i = 0; i < MT; ++i) {
      const int64_t row = (m0 + i) * chunks + c;
      const __m512i xv = _mm512_loadu_si512(x.q.data() + row * kChunk);
      const __m512i start = _mm512_sub_epi32(_mm512_setzero_si512(),
                                             _mm512_dpbusd_epi32(_mm512_setzero_si512(), flip, xv));
      const __m512 sv = _mm512_permutexvar_ps(halves, _mm512_castpd_ps(_mm512_castpd128_pd512(
                                                          _mm_load_sd(reinterpret_cast<const double*>(x.scale.data() + row * 2)))));
      for (int j = 0; j < NT; ++j)
        acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(start, wv[j], xv)), sv, acc[i][j]);
    }
  }
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NT; ++j)
      out[(m0 + i) * n_size + n0 + j] = _mm512_reduce_add_ps(acc[i][j]) * w_scale[n0 + j] + (bias ? bias[n0 + j] : 0.0f);
}

// Weight rows [n0, n0 + NT) against rows [m_begin, m_end) of x, 4 rows at a time.
template <int NT>
inline void vnni_columns(float* out, int64_t n_size, const VnniActivations& x, int64_t m_begin, int64_t m_end,
                         const int8_t* w, int64_t k_size, const float* w_scale, const float* bias, int64_t n0) {
  const bool masked = k_size % kChunk != 0;
  int64_t m = m_begin;
  for (; m + 4 <= m_end; m += 4)
    (masked ? vnni_tile<4, NT, true> : vnni_tile<4, NT, false>)(out, n_size, x, m, w, k_size, w_scale, bias, n0);
  for (; m < m_end; ++m)
    (masked ? vnni_tile<1, NT, true> : vnni_tile<1, NT, false>)(out, n_size, x, m, w, k_size, w_scale, bias, n0);
}

// w8a8_linear's contract with the VNNI tiles: 4 weight rows a tile, the thread's weight rows
// against 128 activation rows at a time (so the rows' quantized data stay in L2 for a prefill).
void w8a8_linear_vnni(float* out, const float* x, int64_t x_stride, int64_t m_size, int64_t k_size,
                      const int8_t* w, int64_t n_size, const float* w_scale, const float* bias) {
  VnniActivations xa;
  xa.chunks = (k_size + kChunk - 1) / kChunk;
  xa.q.resize(m_size * xa.chunks * kChunk);
  xa.scale.resize(m_size * xa.chunks * 2);
  at::parallel_for(0, m_size, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m)
      vnni_quantize_row(x + m * x_stride, k_size, xa.chunks, xa.q.data() + m * xa.chunks * kChunk,
                        xa.scale.data() + m * xa.chunks * 2);
  });
  constexpr int64_t kNT = 4, kRowBlock = 128;
  at::parallel_for(0, (n_size + kNT - 1) / kNT, 8, [&](int64_t begin, int64_t end) {
    for (int64_t m0 = 0; m0 < m_size; m0 += kRowBlock) {
      const int64_t m1 = std::min(m_size, m0 + kRowBlock);
      for (int64_t t = begin; t < end; ++t) {
        const int64_t n0 = t * kNT;
        if (n0 + kNT <= n_size) {
          vnni_columns<kNT>(out, n_size, xa, m0, m1, w, k_size, w_scale, bias, n0);
        } else {
          for (int64_t n = n0; n < n_size; ++n) vnni_columns<1>(out, n_size, xa, m0, m1, w, k_size, w_scale, bias, n);
        }
      }
    }
  });
}
constexpr bool kHaveVnni = true;
#else
void w8a8_linear_vnni(float*, const float*, int64_t, int64_t, int64_t, const int8_t*, int64_t, const float*,
                      const float*) {}
constexpr bool kHaveVnni = false;
#endif

// out [M, N] = dequant(quantize_blocks(x)) @ (weight [N, K] int8 * scale [N])^T + bias [N].
Tensor w8a8_linear(const Tensor& x, const Tensor& weight, const Tensor& scale,
                   const c10::optional<Tensor>& bias) {
  const float* b = checked_int8_linear_bias("w8a8_linear", x, weight, scale, bias);
  const int64_t m_size = x.size(0), k_size = x.size(1), n_size = weight.size(0);
  if (kHaveVnni) {
    Tensor out = at::empty({m_size, n_size}, x.options());
    w8a8_linear_vnni(out.data_ptr<float>(), x.data_ptr<float>(), x.stride(0), m_size, k_size,
                     weight.data_ptr<int8_t>(), n_size, scale.data_ptr<float>(), b);
    return out;
  }
  const int64_t kb = (k_size + kQBlock - 1) / kQBlock;
  std::vector<int8_t> xq(m_size * k_size);
  std::vector<float> xs(m_size * kb);
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, m_size, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m)
      quantize_row(xp + m * x.stride(0), k_size, xq.data() + m * k_size, xs.data() + m * kb);
  });
  Tensor out = at::empty({m_size, n_size}, x.options());
  const int8_t* wp = weight.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  float* op = out.data_ptr<float>();
  // One weight row per tile at batch 1 (measured best: a single stream per core reaches its
  // bandwidth), else 2 (each |w| serves up to 4 rows of x per block).
  const int64_t tile = m_size == 1 ? 1 : 2;
  at::parallel_for(0, (n_size + tile - 1) / tile, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * tile;
      if (tile == 1 || n0 + tile > n_size) {
        for (int64_t n = n0; n < std::min(n0 + tile, n_size); ++n)
          w8a8_columns<1>(op, n_size, xq.data(), xs.data(), kb, wp, sp, b, m_size, k_size, n);
      } else {
        w8a8_columns<2>(op, n_size, xq.data(), xs.data(), kb, wp, sp, b, m_size, k_size, n0);
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(tandem_cpu, m) {
  m.def("paged_attention(Tensor query, Tensor k_cache, Tensor v_cache, "
        "Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, float scale) -> Tensor");
  m.def("write_kv_cache(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor slot_mapping) -> ()");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("fused_add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("rotary_embedding(Tensor positions, Tensor(a!) query, Tensor(b!) key, Tensor cos_sin_cache, "
        "int head_dim, bool is_neox) -> ()");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.def("int8_linear(Tensor x, Tensor weight, Tensor scale, Tensor? bias) -> Tensor");
  m.def("w8a8_linear(Tensor x, Tensor weight, Tensor scale, Tensor? bias) -> Tensor");
  m.def("attention_block(Tensor(a!) qkv, Tensor? positions, Tensor? cos_sin_cache, bool is_neox, "
        "Tensor(b!) k_cache, Tensor(c!) v_cache, Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, "
        "Tensor query_start_loc, int num_heads, int num_kv_heads, int head_dim, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(tandem_cpu, CPU, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("write_kv_cache", &write_kv_cache);
  m.impl("rms_norm", &rms_norm);
  m.impl("fused_add_rms_norm", &fused_add_rms_norm);
  m.impl("rotary_embedding", &rotary_embedding);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("argmax_rows", &argmax_rows);
  m.impl("attention_block", &attention_block);
  m.impl("int8_linear", &int8_linear);
  m.impl("w8a8_linear", &w8a8_linear);
}
