// bf16 linear layers with AVX-512 BF16 dot products (vdpbf16ps) on CPUs without AMX (AMD Zen 4+,
// Intel Cooper Lake's successors run amx_linear.cpp instead); registered in registration.cpp.
//
//     y [M, N] = x [M, K] @ w [N, K]^T (+ bias [N]),  bf16 in and out, products exact, sums fp32,
//                                                     rounded once (F.linear's math in another order)
//
// A decode step's matmuls stream every weight once from memory. oneDNN's bf16 kernel read the
// default model's weights at ~14 GB/s at batch 1 on a Zen 4 core where a plain read runs at
// ~27: this one reads the weight packed once so that each thread's share is one sequential
// stream, and each block of 64 output columns is multiplied by every row of x while in cache.
//
// Packed weight [ceil(N / 16), ceil(K / 2) * 32] bf16 (N padded to 16 with zero rows, K to 2 with
// a zero): blocks of up to 4 panels of 16 output columns (the last block may hold fewer, nv);
// block b starts at panel 4b and interleaves its panels pair by pair:
//
//     block b, pair kp:  [k 2kp, 2kp+1 of col 0] ... [.. of col 15]  (panel 4b)   64 bytes
//                        [k 2kp, 2kp+1 of col 16] ...                 (panel 4b+1) ...
//
// One vdpbf16ps multiplies a pair of a row's activations (broadcast) with a pair of weights in
// each of 16 columns: each lane is one output column, its sum running over K's pairs in order
// whatever M is and whichever tile computes it (batch-invariant: a row's result does not depend
// on the rows batched with it).

#include "common.h"
#include "ops.h"

#include <cstring>

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512F__)
#define TANDEM_BF16_DOT 1
#include <immintrin.h>
#endif

namespace tandem {
namespace {

constexpr int64_t kCols = 16;       // output columns per panel: one register of float lanes
constexpr int64_t kPanels = 4;      // panels per block
constexpr int64_t kPairWords = 2 * kCols;

#if TANDEM_BF16_DOT
// out rows [m0, m0 + MT), block columns [n0, n0 + 16 NV) = x rows @ the block w ([pairs][NV][32]).
// x's pairs are read as int32 (k_size even); an odd K's last pair is built apart (x ends mid-pair).
template <int MT, int NV>
inline void tile(c10::BFloat16* out, int64_t n_size, const uint16_t* x, int64_t x_stride, int64_t k_size,
                 int64_t m0, const uint16_t* w, int64_t pairs, int64_t n0, const float* bias) {
  __m512 sum[MT][NV];
  for (int i = 0; i < MT; ++i)
    for (int v = 0; v < NV; ++v) sum[i][v] = _mm512_setzero_ps();
  const uint16_t* row[MT];
  for (int i = 0; i < MT; ++i) row[i] = x + (m0 + i) * x_stride;
  const int64_t whole = k_size / 2;
  for (int64_t kp = 0; kp < pairs; ++kp) {
    const uint16_t* wk = w + kp * NV * kPairWords;
    __m512bh wv[NV];
    for (int v = 0; v < NV; ++v) wv[v] = (__m512bh)_mm512_loadu_si512(wk + v * kPairWords);
    for (int i = 0; i < MT; ++i) {
      int32_t pair;
      if (kp < whole) {
        std::memcpy(&pair, row[i] + 2 * kp, sizeof pair);
      } else {
        pair = row[i][2 * kp];  // the odd K's last input, paired with zero
      }
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
      for (int v = 0; v < NV; ++v) sum[i][v] = _mm512_dpbf16_ps(sum[i][v], xv, wv[v]);
    }
  }
  for (int v = 0; v < NV; ++v) {
    const int64_t c0 = n0 + v * kCols, cols = std::min<int64_t>(kCols, n_size - c0);
    const __mmask16 mask = static_cast<__mmask16>(cols >= kCols ? 0xFFFF : (1u << cols) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + c0) : _mm512_setzero_ps();
    for (int i = 0; i < MT; ++i) {
      const __m256i h = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(sum[i][v], b));  // nearest even
      _mm256_mask_storeu_epi16(out + (m0 + i) * n_size + c0, mask, h);
    }
  }
}

// Every row of x times one block of NV panels: 4-row tiles, then the remaining rows.
template <int NV>
inline void block_rows(c10::BFloat16* out, int64_t n_size, const uint16_t* x, int64_t x_stride, int64_t m_size,
                       int64_t k_size, const uint16_t* w, int64_t pairs, int64_t n0, const float* bias) {
  int64_t m = 0;
  for (; m + 4 <= m_size; m += 4) tile<4, NV>(out, n_size, x, x_stride, k_size, m, w, pairs, n0, bias);
  switch (m_size - m) {
    case 3: tile<3, NV>(out, n_size, x, x_stride, k_size, m, w, pairs, n0, bias); break;
    case 2: tile<2, NV>(out, n_size, x, x_stride, k_size, m, w, pairs, n0, bias); break;
    case 1: tile<1, NV>(out, n_size, x, x_stride, k_size, m, w, pairs, n0, bias); break;
    default: break;
  }
}

void multiply_blocks(c10::BFloat16* out, const uint16_t* x, int64_t x_stride, int64_t m_size, int64_t k_size,
                     const uint16_t* packed, int64_t n_size, const float* bias) {
  const int64_t panels = (n_size + kCols - 1) / kCols, pairs = (k_size + 1) / 2;
  const int64_t blocks = (panels + kPanels - 1) / kPanels;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t p0 = b * kPanels, nv = std::min(kPanels, panels - p0);
      const uint16_t* w = packed + p0 * pairs * kPairWords;
      switch (nv) {
        case 4: block_rows<4>(out, n_size, x, x_stride, m_size, k_size, w, pairs, p0 * kCols, bias); break;
        case 3: block_rows<3>(out, n_size, x, x_stride, m_size, k_size, w, pairs, p0 * kCols, bias); break;
        case 2: block_rows<2>(out, n_size, x, x_stride, m_size, k_size, w, pairs, p0 * kCols, bias); break;
        default: block_rows<1>(out, n_size, x, x_stride, m_size, k_size, w, pairs, p0 * kCols, bias); break;
      }
    }
  });
}

constexpr bool kHaveBf16Dot = true;
#else
constexpr bool kHaveBf16Dot = false;
#endif

}  // namespace

bool bf16_dot_available() { return kHaveBf16Dot; }

// weight [N, K] bf16 -> bf16 [ceil(N / 16), ceil(K / 2) * 32]: the layout above.
Tensor bf16_pack_weight(const Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16,
              "bf16_pack_weight: weight must be bfloat16 [N, K]");
  const Tensor w = weight.contiguous();
  const int64_t n_size = w.size(0), k_size = w.size(1);
  const int64_t panels = (n_size + kCols - 1) / kCols, pairs = (k_size + 1) / 2;
  Tensor packed = at::empty({panels, pairs * kPairWords}, w.options());
  const uint16_t* src = reinterpret_cast<const uint16_t*>(w.data_ptr<c10::BFloat16>());
  uint16_t* dst = reinterpret_cast<uint16_t*>(packed.data_ptr<c10::BFloat16>());
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t p0 = p / kPanels * kPanels, v = p - p0, nv = std::min(kPanels, panels - p0);
      uint16_t* block = dst + p0 * pairs * kPairWords;
      for (int64_t kp = 0; kp < pairs; ++kp)
        for (int64_t c = 0; c < kCols; ++c)
          for (int64_t t = 0; t < 2; ++t) {
            const int64_t n = p * kCols + c, k = 2 * kp + t;
            block[(kp * nv + v) * kPairWords + 2 * c + t] = n < n_size && k < k_size ? src[n * k_size + k] : 0;
          }
    }
  });
  return packed;
}

// out [M, N] bf16 = x @ weight^T + bias for x bf16 [M, K], packed = bf16_pack_weight(weight).
Tensor bf16_dot_linear(const Tensor& x, const Tensor& packed, int64_t n_size, const c10::optional<Tensor>& bias) {
  TORCH_CHECK(kHaveBf16Dot, "bf16_dot_linear: this CPU or build has no AVX-512 BF16 (see bf16_dot_available)");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "bf16_dot_linear: x must be bfloat16 [M, K]");
  const Tensor xc = x.stride(1) == 1 ? x : x.contiguous();
  const int64_t k_size = xc.size(1);
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() &&
              n_size > 0 && packed.size(0) == (n_size + kCols - 1) / kCols &&
              packed.size(1) == (k_size + 1) / 2 * kPairWords,
              "bf16_dot_linear: packed must be bf16_pack_weight of a bf16 [N, K] weight, K = x's columns");
  std::vector<float> b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->numel() == n_size &&
                (bias->scalar_type() == at::kBFloat16 || bias->scalar_type() == at::kFloat),
                "bf16_dot_linear: bias must be bf16 or float32 [N]");
    const Tensor bf = bias->to(at::kFloat).contiguous();
    b.assign(bf.data_ptr<float>(), bf.data_ptr<float>() + n_size);
  }
  Tensor out = at::empty({xc.size(0), n_size}, xc.options());
#if TANDEM_BF16_DOT
  if (xc.size(0) > 0)
    multiply_blocks(out.data_ptr<c10::BFloat16>(), reinterpret_cast<const uint16_t*>(xc.data_ptr<c10::BFloat16>()),
                    xc.stride(0), xc.size(0), k_size, reinterpret_cast<const uint16_t*>(packed.data_ptr<c10::BFloat16>()),
                    n_size, b.empty() ? nullptr : b.data());
#endif
  return out;
}

}  // namespace tandem
