// int4_q8_linear: int4_linear's weights (the int4 and int4f layouts, int4_linear.cpp) against
// activations quantized to 8 bits per 32 values, with integer dot products. This is how llama.cpp
// runs its 4-bit GGUF types, most like its Q4_0 x Q8_0 (here the activations' scales are fp32, and
// one per 32 values for Q4_K too, where llama.cpp's Q8_K has one per 256). Faster than int4_linear on
// AVX2 (no weight is ever converted to a float), but the activations are rounded: the results are
// not the dequantized model's.
//
// x [M, K] float32 or bf16 is quantized row by row, group by group (tandem_kernels.gguf_reference.
// quantize_q8_groups, the contract): a = max |x| over the group's 32 values, s = a / 127,
// q = round_half_even(x * (127 / a)) in [-127, 127] (all zero where a = 0; a group holding a NaN
// gets s = NaN, so its row's outputs are NaN, as the exact kernel's), computed in fp32. Then
//     out[m, n] = sum_g (d[n, g] * s[m, g]) * dot[m, n, g]  +  sum_g mw[n, g] * (s[m, g] * xs[m, g])
// with dot = sum_i qw[n, 32 g + i] * q[m, 32 g + i] (qw the 4-bit code, 0..15) and xs = sum_i q,
// both exact integers. The products and sums are fp32: the first sum in 8 lanes over the groups,
// the lanes summed in a fixed tree; the second in one accumulator, group by group, added after it;
// then the bias, rounded once to x's dtype. The order depends on K only: a row's result does not
// depend on M.
//
// With AVX2, 32 products of a 4-bit code (unsigned) and an 8-bit activation (signed) are one
// vpmaddubsw (a pair sums to at most 2 x 15 x 127: no saturation); other targets run the same
// arithmetic in plain scalar loops (the same integer sums, so the builds agree to the rounding of the
// fp32 sums; measured only on AVX2).
//
// Registered here (TORCH_LIBRARY_FRAGMENT) rather than in registration.cpp: the op is this file's.

#include <torch/library.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "common.h"
#include "int4_args.h"
#include "int4_vec.h"
#include "ops.h"

namespace tandem {
namespace {

constexpr int64_t kGroup = 32;       // weights per (d, m) pair and activations per scale, along K
constexpr int64_t kGroupBytes = 16;  // two nibbles a byte
constexpr int64_t kRowsAtOnce = 4;   // rows of x a weight group is unpacked for
constexpr int64_t kTileCols = 2;     // weight rows per unit of work
constexpr int64_t kPrefetchTiles = 8;  // tiles of weight rows asked for ahead

// x's rows, quantized: q [M, K] int8, s [M, G] float (the group's scale) and xs [M, G] int32.
struct QuantizedRows {
  std::vector<int8_t> q;
  std::vector<float> s;       // [M, G, 2]: (s, s * xs) per group, the two factors the sum needs
  std::vector<int32_t> xs;
  int64_t k_size = 0, groups = 0;
};

template <typename T>
inline float as_float(T v) { return static_cast<float>(v); }

// One group of 32 values: the reference's arithmetic (fp32, round half to even).
template <typename T>
inline void quantize_group(const T* x, int8_t* q, float* s, int32_t* xs) {
  float a = 0.0f;
  bool nan = false;
  for (int64_t i = 0; i < kGroup; ++i) {
    const float v = as_float(x[i]);
    nan |= v != v;
    a = std::max(a, std::fabs(v));
  }
  if (nan || !(a > 0.0f)) {  // all zero; or a NaN, passed on to the row's outputs through s
    std::memset(q, 0, kGroup);
    *s = nan ? std::numeric_limits<float>::quiet_NaN() : 0.0f;
    *xs = 0;
    return;
  }
  const float inv = 127.0f / a;
  int32_t sum = 0;
  for (int64_t i = 0; i < kGroup; ++i) {
    float r = std::nearbyint(as_float(x[i]) * inv);  // the default rounding: to nearest even
    r = std::min(127.0f, std::max(-127.0f, r));
    q[i] = static_cast<int8_t>(r);
    sum += q[i];
  }
  *s = a / 127.0f;
  *xs = sum;
}

template <typename T>
QuantizedRows quantize_rows(const T* x, int64_t x_stride, int64_t m_size, int64_t k_size) {
  QuantizedRows r;
  r.k_size = k_size;
  r.groups = k_size / kGroup;
  r.q.resize(m_size * k_size);
  r.s.resize(m_size * r.groups * 2);
  r.xs.resize(m_size * r.groups);
  at::parallel_for(0, m_size * r.groups, 256, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t m = t / r.groups, g = t % r.groups;
      quantize_group(x + m * x_stride + g * kGroup, r.q.data() + m * k_size + g * kGroup, r.s.data() + 2 * t,
                     r.xs.data() + t);
      r.s[2 * t + 1] = r.s[2 * t] * static_cast<float>(r.xs[t]);
    }
  });
  return r;
}

// The weights: row n's group g, its 16 code bytes and its (d, m) (fp16 bits or floats).
template <typename S>
struct Weights {
  const uint8_t* q;  // [N, K / 2]
  const S* dm;       // [N, G, 2]
  int64_t groups;
  const uint8_t* codes(int64_t n, int64_t g) const { return q + (n * groups + g) * kGroupBytes; }
  float d(int64_t n, int64_t g) const { return scale_value(dm[(n * groups + g) * 2]); }
  float m(int64_t n, int64_t g) const { return scale_value(dm[(n * groups + g) * 2 + 1]); }
};

// The 8 lanes' sum in a fixed tree: ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)).
inline float reduce8(const float* l) {
  return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
}

#if defined(__AVX2__) && defined(__FMA__)
inline float hsum8(__m256 v) {
  float l[8];
  _mm256_storeu_ps(l, v);
  return reduce8(l);
}

// out[m0 + i, n0 + j] for i < MT, j < NT.
template <int MT, int NT, typename T, typename S>
__attribute__((noinline)) void q8_tile(T* out, int64_t n_size, const QuantizedRows& x, const Weights<S>& w,
                                       const float* bias, int64_t m0, int64_t n0) {
  const __m256i low = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
  __m256 acc[MT][NT];
  float macc[MT][NT];
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NT; ++j) {
      acc[i][j] = _mm256_setzero_ps();
      macc[i][j] = 0.0f;
    }
  const int64_t groups = x.groups;
  const int8_t* xq_rows = x.q.data() + m0 * x.k_size;
  const float* xs_rows = x.s.data() + m0 * groups * 2;
  for (int64_t g = 0; g < groups; ++g) {
    __m256i wq[NT];
    __m256 d[NT];
    float mw[NT];
    for (int j = 0; j < NT; ++j) {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.codes(n0 + j, g)));
      // bytes 0..15: elements 0..15 (low nibbles); 16..31: elements 16..31 (high nibbles)
      wq[j] = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(bytes, 4), bytes), low);
      d[j] = _mm256_set1_ps(w.d(n0 + j, g));
      mw[j] = w.m(n0 + j, g);
    }
    for (int i = 0; i < MT; ++i) {
      const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq_rows + i * x.k_size + g * kGroup));
      const float* sc = xs_rows + (i * groups + g) * 2;  // (s, s * xs)
      const __m256 s = _mm256_set1_ps(sc[0]);
      for (int j = 0; j < NT; ++j) {
        const __m256i pairs = _mm256_maddubs_epi16(wq[j], xq);  // 16 sums of 2 products, |.| <= 3810
        const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones));  // 8 sums of 4, exact
        acc[i][j] = _mm256_fmadd_ps(dot, _mm256_mul_ps(d[j], s), acc[i][j]);
        macc[i][j] += mw[j] * sc[1];
      }
    }
  }
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NT; ++j) {
      const float v = hsum8(acc[i][j]) + macc[i][j] + (bias ? bias[n0 + j] : 0.0f);
      out[(m0 + i) * n_size + n0 + j] = static_cast<T>(v);
    }
}
#else
// The same arithmetic in plain loops: lane l of a group's 8 holds elements 4 l .. 4 l + 3.
template <int MT, int NT, typename T, typename S>
void q8_tile(T* out, int64_t n_size, const QuantizedRows& x, const Weights<S>& w, const float* bias, int64_t m0,
             int64_t n0) {
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NT; ++j) {
      float lanes[8] = {};
      float macc = 0.0f;
      const int64_t row = m0 + i;
      for (int64_t g = 0; g < x.groups; ++g) {
        const uint8_t* bytes = w.codes(n0 + j, g);
        const int8_t* xq = x.q.data() + row * x.k_size + g * kGroup;
        const float* sc = x.s.data() + (row * x.groups + g) * 2;  // (s, s * xs)
        const float scale = w.d(n0 + j, g) * sc[0];
        for (int l = 0; l < 8; ++l) {
          int32_t dot = 0;
          for (int e = 4 * l; e < 4 * l + 4; ++e) {
            const int code = e < 16 ? (bytes[e] & 15) : (bytes[e - 16] >> 4);
            dot += code * xq[e];
          }
          lanes[l] = std::fma(static_cast<float>(dot), scale, lanes[l]);
        }
        macc += w.m(n0 + j, g) * sc[1];
      }
      out[row * n_size + n0 + j] = static_cast<T>(reduce8(lanes) + macc + (bias ? bias[n0 + j] : 0.0f));
    }
}
#endif

template <int NT, typename T, typename S>
inline void q8_rows(T* out, int64_t n_size, const QuantizedRows& x, const Weights<S>& w, const float* bias,
                    int64_t m0, int64_t mt, int64_t n0) {
  switch (mt) {
    case 4: q8_tile<4, NT>(out, n_size, x, w, bias, m0, n0); break;
    case 3: q8_tile<3, NT>(out, n_size, x, w, bias, m0, n0); break;
    case 2: q8_tile<2, NT>(out, n_size, x, w, bias, m0, n0); break;
    default: q8_tile<1, NT>(out, n_size, x, w, bias, m0, n0); break;
  }
}

template <typename T, typename S>
void int4_q8_impl(T* out, const T* x, int64_t x_stride, int64_t m_size, int64_t k_size, const Weights<S>& w,
                  int64_t n_size, const float* bias) {
  const QuantizedRows xq = quantize_rows(x, x_stride, m_size, k_size);
  const int64_t row_bytes = w.groups * kGroupBytes;
  // Each unit: kTileCols weight rows against every row of x, kRowsAtOnce rows at a time (the
  // weight rows stay in cache while the rows of x pass over them).
  at::parallel_for(0, (n_size + kTileCols - 1) / kTileCols, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * kTileCols, n1 = std::min(n_size, n0 + kTileCols);
      const int64_t ahead = n1 + (kPrefetchTiles - 1) * kTileCols;
      for (int64_t n = ahead; n < std::min(n_size, ahead + kTileCols); ++n) {  // a later tile's rows
        prefetch_run(w.q + n * row_bytes, row_bytes);
        prefetch_run(w.dm + n * w.groups * 2, w.groups * 2);
      }
      for (int64_t m0 = 0; m0 < m_size; m0 += kRowsAtOnce) {
        const int64_t mt = std::min(kRowsAtOnce, m_size - m0);
        int64_t n = n0;
        if (mt <= 2)  // 16 ymm registers: two weight rows for up to two rows of x
          for (; n + 2 <= n1; n += 2) q8_rows<2>(out, n_size, xq, w, bias, m0, mt, n);
        for (; n < n1; ++n) q8_rows<1>(out, n_size, xq, w, bias, m0, mt, n);
      }
    }
  });
}

}  // namespace

// out [M, N] (x's dtype) = the header's sum for x [M, K] (float32 or bf16, rows contiguous), qweight
// [N, K / 2] uint8 and scales [N, K / 32, 2] fp16 or float32 (int4_linear's layouts), + bias [N].
Tensor int4_q8_linear(const Tensor& x, const Tensor& qweight, const Tensor& scales, const c10::optional<Tensor>& bias) {
  return run_int4_linear<Weights>("int4_q8_linear", x, qweight, scales, bias,
                                  [](const auto&... args) { int4_q8_impl(args...); });
}

}  // namespace tandem

TORCH_LIBRARY_FRAGMENT(tandem_cpu, m) {
  m.def("int4_q8_linear(Tensor x, Tensor qweight, Tensor scales, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(tandem_cpu, CPU, m) {
  m.impl("int4_q8_linear", &tandem::int4_q8_linear);
}
