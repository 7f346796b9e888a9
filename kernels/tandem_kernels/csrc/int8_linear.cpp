// The int8 linears on the plain [N, K] weight: int8_linear (int8 weights, per-channel scales, float
// activations) and w8a8_linear (the activations quantized on the fly per row and 32-wide block,
// int8 x int8 dot products). x is float32 or bf16 (converted to float as it is read, exactly) and
// the result has x's dtype (the float sum rounded once). Every output's sum runs over K in an
// order that depends on K only, never on the batch, so a request's results do not depend on the
// requests it shares a step with.
//
// w8a8 here is AVX2's maddubs (or plain C++) on the plain weight; the engine runs w8a8_packed.cpp's
// kernels on a packed weight instead. Both agree with the reference; their float sums run in
// different orders.

#include "ops.h"
#include "int8_args.h"
#include "simd.h"

namespace tandem {

// ---- weight-only int8 linear -----------------------------------------------------------

namespace {

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
// O: the output's type (float, or bf16: the float result rounded to nearest even).
template <int NT, int MT, typename W, typename O>
inline void int8_tile(O* out, int64_t out_stride, const float* x, int64_t x_stride, const W* w,
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
      out[(m0 + i) * out_stride + n0 + j] = O(sum * scale[n0 + j] + (bias ? bias[n0 + j] : 0.0f));
    }
}

// Columns [n0, n0 + NT) for every row of x, three rows at a time. With more than a few rows the
// tile's weight rows are converted to float once, into buf ([NT, k_size], in cache), rather than
// once per three rows: the same products in the same order, so the same results.
template <int NT, typename O>
inline void int8_columns(O* out, const float* x, int64_t x_stride, const int8_t* w, const float* scale,
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

// x's rows as float32 [M, K] with contiguous rows: x itself, or bf16 converted (exactly) into buf.
const float* float_rows(const Tensor& x, std::vector<float>& buf) {
  if (x.scalar_type() == at::kFloat) return x.data_ptr<float>();
  const int64_t m_size = x.size(0), k_size = x.size(1);
  buf.resize(m_size * k_size);
  const c10::BFloat16* xp = x.data_ptr<c10::BFloat16>();
  at::parallel_for(0, m_size, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) load_row(buf.data() + m * k_size, xp + m * x.stride(0), k_size);
  });
  return buf.data();
}

template <typename O>
void int8_linear_into(O* op, const Tensor& x, const Tensor& weight, const Tensor& scale, const float* b) {
  const int64_t m_size = x.size(0), k_size = x.size(1), n_size = weight.size(0);
  std::vector<float> x_buf;
  const float* xp = float_rows(x, x_buf);
  const int8_t* wp = weight.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  const int64_t x_stride = x.scalar_type() == at::kFloat ? x.stride(0) : k_size;
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
}

}  // namespace

// out [M, N] (x's dtype) = x [M, K] @ (weight [N, K] int8 * scale [N])^T + bias [N]: weight-only
// int8 with float activations. Every output's sum runs over k in the same order whatever M is,
// so a request's results do not depend on the batch it shares a step with.
Tensor int8_linear(const Tensor& x, const Tensor& weight, const Tensor& scale,
                   const c10::optional<Tensor>& bias) {
  check_int8_linear_args("int8_linear", x, weight, scale);
  const std::vector<float> b = int8_linear_bias("int8_linear", bias, weight.size(0));
  const float* bp = b.empty() ? nullptr : b.data();
  Tensor out = at::empty({x.size(0), weight.size(0)}, x.options());
  if (x.scalar_type() == at::kFloat) {
    int8_linear_into(out.data_ptr<float>(), x, weight, scale, bp);
  } else {
    int8_linear_into(out.data_ptr<c10::BFloat16>(), x, weight, scale, bp);
  }
  return out;
}

// ---- int8 weights x int8 activations (w8a8) -------------------------------------------

namespace {

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
template <int NT, int MT, typename O>
inline void w8a8_tile(O* out, int64_t n_size, const int8_t* xq, const float* xs, int64_t kb,
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
      out[(m0 + i) * n_size + n0 + j] = O(sum * scale[n0 + j] + (bias ? bias[n0 + j] : 0.0f));
    }
}

template <int NT, typename O>
inline void w8a8_columns(O* out, int64_t n_size, const int8_t* xq, const float* xs, int64_t kb,
                         const int8_t* w, const float* scale, const float* bias, int64_t m_size,
                         int64_t k_size, int64_t n0) {
  int64_t m0 = 0;
  for (; m0 + 4 <= m_size; m0 += 4) w8a8_tile<NT, 4, O>(out, n_size, xq, xs, kb, w, scale, bias, k_size, n0, m0);
  for (; m0 < m_size; ++m0) w8a8_tile<NT, 1, O>(out, n_size, xq, xs, kb, w, scale, bias, k_size, n0, m0);
}

template <typename O>
void w8a8_linear_into(O* op, const Tensor& x, const Tensor& weight, const Tensor& scale, const float* b) {
  const int64_t m_size = x.size(0), k_size = x.size(1), n_size = weight.size(0);
  const int64_t kb = (k_size + kQBlock - 1) / kQBlock;
  std::vector<int8_t> xq(m_size * k_size);
  std::vector<float> xs(m_size * kb);
  std::vector<float> x_buf;
  const float* xp = float_rows(x, x_buf);
  const int64_t x_stride = x.scalar_type() == at::kFloat ? x.stride(0) : k_size;
  at::parallel_for(0, m_size, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m)
      quantize_row(xp + m * x_stride, k_size, xq.data() + m * k_size, xs.data() + m * kb);
  });
  const int8_t* wp = weight.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
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
}

}  // namespace

// out [M, N] (x's dtype) = dequant(quantize_blocks(x)) @ (weight [N, K] int8 * scale [N])^T + bias [N].
Tensor w8a8_linear(const Tensor& x, const Tensor& weight, const Tensor& scale,
                   const c10::optional<Tensor>& bias) {
  check_int8_linear_args("w8a8_linear", x, weight, scale);
  const std::vector<float> b = int8_linear_bias("w8a8_linear", bias, weight.size(0));
  const float* bp = b.empty() ? nullptr : b.data();
  Tensor out = at::empty({x.size(0), weight.size(0)}, x.options());
  if (x.scalar_type() == at::kFloat) {
    w8a8_linear_into(out.data_ptr<float>(), x, weight, scale, bp);
  } else {
    w8a8_linear_into(out.data_ptr<c10::BFloat16>(), x, weight, scale, bp);
  }
  return out;
}

}  // namespace tandem
