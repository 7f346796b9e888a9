// The int8 linears: int8_linear (int8 weights, per-channel scales, float activations) and
// w8a8_linear (the activations quantized on the fly per row and 32-wide block, int8 x int8 dot
// products). Every output's sum runs over K in an order that depends on K only, never on the
// batch, so a request's results do not depend on the requests it shares a step with.
//
// Where the compiler targets AVX-512 VNNI, w8a8 takes the vpdpbusd tiles; elsewhere AVX2's maddubs
// (or plain C++). Both agree with the reference; their float sums run in different orders.

#include "ops.h"
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

}  // namespace

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

}  // namespace

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

}  // namespace tandem
