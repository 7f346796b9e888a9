// Weight-only int8 with bf16 activations on AVX-512 BF16, on a weight packed once at load time
// (int8_pack_weight_bf16): int8_linear's math (tandem_kernels.reference.int8_linear) with bf16
// dot products (vdpbf16ps: exact products, float sums) instead of float multiply-adds.
//
// The packed weight: panels of 16 output columns (N padded with zero rows to a multiple of 16),
// each [ceil(K / 2) pairs][16 columns][2 bytes], K padded with a zero:
//
//     panel p:  [k 0,1 of col 0][k 0,1 of col 1] ... [k 0,1 of col 15]   (32 bytes a pair)
//               [k 2,3 of col 0] ...
//
// A thread converts two panels at a time to bf16 (int8 values are exact in bf16) into a buffer
// that stays in cache while every row of x passes it: the conversions cost once per panel and
// call, not once per row. One vdpbf16ps multiplies a pair of a row's activations (broadcast)
// with a pair of weights in each of 16 columns, so each lane is one output column, its sum
// running over K's pairs in order whatever M is and whichever tile computes it (batch-invariant).

#include "int8_args.h"
#include "ops.h"
#include "simd.h"

namespace tandem {
namespace {

constexpr int64_t kCols = 16;          // output columns per panel: one register of float lanes
constexpr int64_t kPairBytes = 2 * kCols;

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512F__)

// 16 results of a row, rounded to bf16 as c10 rounds, the first `cols` stored.
inline void store_bf16_row(c10::BFloat16* out, __m512 v, int64_t cols) {
  vf16 f;
  std::memcpy(&f, &v, sizeof f);
  c10::BFloat16 tmp[16];
  store16(tmp, round16<c10::BFloat16>(f));
  std::memcpy(out, tmp, std::min<int64_t>(cols, 16) * sizeof(c10::BFloat16));
}

// The bf16 bits of x[k], x[k + 1] as one int32 (x[k + 1] = 0 past the row's end).
inline int32_t x_pair(const uint16_t* row, int64_t k, int64_t k_size) {
  uint32_t pair = row[k];
  if (k + 1 < k_size) pair |= static_cast<uint32_t>(row[k + 1]) << 16;
  return static_cast<int32_t>(pair);
}

// out[m0 .. m0 + MT, panels p0 .. p0 + NT] from the panels converted into w (NT x [pairs][32] bf16).
template <int MT, int NT>
inline void tile(c10::BFloat16* out, int64_t n_size, const uint16_t* x, int64_t x_stride, int64_t k_size,
                 int64_t m0, const uint16_t* w, int64_t pairs, int64_t p0, const float* w_scale, const float* bias) {
  __m512 sum[MT][NT];
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NT; ++j) sum[i][j] = _mm512_setzero_ps();
  const uint16_t* row[MT];
  for (int i = 0; i < MT; ++i) row[i] = x + (m0 + i) * x_stride;
  // Pairs of x read as one int32 each; an odd K's last pair apart (x ends mid-pair).
  for (int64_t kp = 0; kp < pairs; ++kp) {
    __m512bh wv[NT];
    for (int j = 0; j < NT; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(w + (j * pairs + kp) * kPairBytes);
    for (int i = 0; i < MT; ++i) {
      int32_t pair;
      if (2 * kp + 1 < k_size) {
        std::memcpy(&pair, row[i] + 2 * kp, sizeof pair);
      } else {
        pair = x_pair(row[i], 2 * kp, k_size);
      }
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
      for (int j = 0; j < NT; ++j) sum[i][j] = _mm512_dpbf16_ps(sum[i][j], xv, wv[j]);
    }
  }
  for (int j = 0; j < NT; ++j) {
    const int64_t n0 = (p0 + j) * kCols;
    const __m512 ws = _mm512_loadu_ps(w_scale + n0);
    for (int i = 0; i < MT; ++i) {
      __m512 v = _mm512_mul_ps(sum[i][j], ws);
      if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + n0));
      store_bf16_row(out + (m0 + i) * n_size + n0, v, n_size - n0);
    }
  }
}

template <int NT>
inline void rows(c10::BFloat16* out, int64_t n_size, const uint16_t* x, int64_t x_stride, int64_t m_size,
                 int64_t k_size, const uint16_t* w, int64_t pairs, int64_t p0, const float* w_scale,
                 const float* bias) {
  int64_t m = 0;
  for (; m + 6 <= m_size; m += 6) tile<6, NT>(out, n_size, x, x_stride, k_size, m, w, pairs, p0, w_scale, bias);
  switch (m_size - m) {
    case 5: tile<5, NT>(out, n_size, x, x_stride, k_size, m, w, pairs, p0, w_scale, bias); break;
    case 4: tile<4, NT>(out, n_size, x, x_stride, k_size, m, w, pairs, p0, w_scale, bias); break;
    case 3: tile<3, NT>(out, n_size, x, x_stride, k_size, m, w, pairs, p0, w_scale, bias); break;
    case 2: tile<2, NT>(out, n_size, x, x_stride, k_size, m, w, pairs, p0, w_scale, bias); break;
    case 1: tile<1, NT>(out, n_size, x, x_stride, k_size, m, w, pairs, p0, w_scale, bias); break;
    default: break;
  }
}

// Panels [p0, p0 + count) of the packed int8 weight as bf16, into buf ([count][pairs][32]).
inline void convert_panels(const int8_t* packed, int64_t pairs, int64_t p0, int64_t count, uint16_t* buf) {
  const int64_t n = count * pairs * kPairBytes;
  const int8_t* src = packed + p0 * pairs * kPairBytes;
  for (int64_t i = 0; i < n; i += 32) {
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16))));
    _mm512_storeu_si512(buf + i, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));  // exact: |w| <= 128
  }
}

void int8_bf16_packed(c10::BFloat16* out, const uint16_t* x, int64_t x_stride, int64_t m_size, int64_t k_size,
                      const int8_t* packed, int64_t n_size, const float* w_scale, const float* bias) {
  // Two panels a thread's step: 6 x 2 tiles hold 12 accumulators; the pair's bf16 buffer
  // (2 x 32 x K bytes) stays in L1/L2 while every row passes it.
  constexpr int64_t kNT = 2;
  const int64_t panels = (n_size + kCols - 1) / kCols, pairs = (k_size + 1) / 2;
  at::parallel_for(0, (panels + kNT - 1) / kNT, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint16_t> buf(kNT * pairs * kPairBytes);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t p0 = t * kNT, count = std::min(kNT, panels - p0);
      convert_panels(packed, pairs, p0, count, buf.data());
      if (count == kNT) {
        rows<kNT>(out, n_size, x, x_stride, m_size, k_size, buf.data(), pairs, p0, w_scale, bias);
      } else {
        rows<1>(out, n_size, x, x_stride, m_size, k_size, buf.data(), pairs, p0, w_scale, bias);
      }
    }
  });
}

constexpr bool kHaveBf16Dot = true;
#else
constexpr bool kHaveBf16Dot = false;
#endif

}  // namespace

bool int8_bf16_available() { return kHaveBf16Dot; }

// weight [N, K] int8 -> int8 [ceil(N / 16), ceil(K / 2) * 32]: the layout above.
Tensor int8_pack_weight_bf16(const Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kChar, "int8_pack_weight_bf16: weight must be int8 [N, K]");
  const Tensor w = weight.contiguous();
  const int64_t n_size = w.size(0), k_size = w.size(1);
  const int64_t panels = (n_size + kCols - 1) / kCols, pairs = (k_size + 1) / 2;
  Tensor packed = at::empty({panels, pairs * kPairBytes}, w.options());
  const int8_t* src = w.data_ptr<int8_t>();
  int8_t* dst = packed.data_ptr<int8_t>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t kp = 0; kp < pairs; ++kp)
        for (int64_t c = 0; c < kCols; ++c)
          for (int64_t t = 0; t < 2; ++t) {
            const int64_t n = p * kCols + c, k = 2 * kp + t;
            dst[(p * pairs + kp) * kPairBytes + c * 2 + t] = n < n_size && k < k_size ? src[n * k_size + k] : 0;
          }
  });
  return packed;
}

// out [M, N] bf16 = int8_linear(x, weight, scale, bias) for x bf16, weight packed by int8_pack_weight_bf16.
Tensor int8_linear_packed(const Tensor& x, const Tensor& packed, const Tensor& scale,
                          const c10::optional<Tensor>& bias) {
  TORCH_CHECK(kHaveBf16Dot, "int8_linear_packed: this CPU or build has no AVX-512 BF16 (see int8_bf16_available)");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1,
              "int8_linear_packed: x must be bfloat16 [M, K] with contiguous rows");
  const int64_t n_size = scale.numel(), k_size = x.size(1);
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous(), "int8_linear_packed: scale must be float32 [N]");
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kChar && packed.is_contiguous() &&
              packed.size(0) == (n_size + kCols - 1) / kCols && packed.size(1) == (k_size + 1) / 2 * kPairBytes,
              "int8_linear_packed: packed must be int8_pack_weight_bf16 of an int8 [N, K] weight, N = scale's "
              "size, K = x's columns");
  const int64_t padded = packed.size(0) * kCols;
  std::vector<float> w_scale(padded, 0.0f);
  std::copy(scale.data_ptr<float>(), scale.data_ptr<float>() + n_size, w_scale.begin());
  const std::vector<float> b = int8_linear_bias("int8_linear_packed", bias, n_size, padded);
  Tensor out = at::empty({x.size(0), n_size}, x.options());
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512F__)
  int8_bf16_packed(out.data_ptr<c10::BFloat16>(), reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>()),
                   x.stride(0), x.size(0), k_size, packed.data_ptr<int8_t>(), n_size, w_scale.data(),
                   b.empty() ? nullptr : b.data());
#endif
  return out;
}

}  // namespace tandem
