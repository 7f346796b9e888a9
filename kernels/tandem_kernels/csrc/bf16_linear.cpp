// bf16 linear layers with AVX-512 BF16 dot products (vdpbf16ps) on CPUs without AMX (AMD Zen 4+,
// Intel Cooper Lake's successors run amx_linear.cpp instead); registered in registration.cpp.
//
//     y [M, N] = x [M, K] @ w [N, K]^T (+ bias [N]),  bf16 in and out, products exact, sums fp32,
//                                                     rounded once (F.linear's math in another order)
//     y [M, d] = silu(x @ gate^T) * (x @ up^T)        bf16_dot_gated_linear: an MLP's gate | up with
//                                                     its SiLU in the epilogue (silu_and_mul's bits)
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
#include "avx512_math.h"
#include "ops.h"
#include "simd.h"

#include <cstring>
#include <type_traits>

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
// The results of a tile, sum[i][v] (row m0 + i, block b's panel v), rounded once to bf16 (nearest
// even) into out [M, N], plus the bias.
struct PlainStore {
  c10::BFloat16* out;
  int64_t n_size;
  const float* bias;

  template <int MT, int NV>
  void store(const __m512 (&sum)[MT][NV], int64_t m0, int64_t b) const {
    for (int v = 0; v < NV; ++v) {
      const int64_t c0 = (b * kPanels + v) * kCols, cols = std::min<int64_t>(kCols, n_size - c0);
      const __mmask16 mask = static_cast<__mmask16>(cols >= kCols ? 0xFFFF : (1u << cols) - 1);
      const __m512 add = bias ? _mm512_maskz_loadu_ps(mask, bias + c0) : _mm512_setzero_ps();
      for (int i = 0; i < MT; ++i) {
        const __m256i h = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(sum[i][v], add));
        _mm256_mask_storeu_epi16(out + (m0 + i) * n_size + c0, mask, h);
      }
    }
  }
};

// A gate | up weight packed in amx_gated_order (32-row panels alternating): block b holds gate
// columns [32 b, 32 b + 32) in panels 0-1 and up's in 2-3. out [M, d] = silu_and_mul of the
// rounded products, its bits: silu(gate) rounded to bf16, times up, rounded again.
struct GatedStore {
  c10::BFloat16* out;
  int64_t d;

  static vf16 rounded(__m512 v) {  // as PlainStore rounds
    const __m512 r = _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(v));
    vf16 f;
    std::memcpy(&f, &r, sizeof f);
    return f;
  }

  template <int MT, int NV>
  void store(const __m512 (&sum)[MT][NV], int64_t m0, int64_t b) const {
    static_assert(NV == 4, "a gated block is 2 gate and 2 up panels");
    for (int i = 0; i < MT; ++i)
      for (int half = 0; half < 2; ++half) {
        const vf16 g = rounded(sum[i][half]), u = rounded(sum[i][2 + half]);
        store16(out + (m0 + i) * d + b * 2 * kCols + half * kCols, round16<c10::BFloat16>(round16<c10::BFloat16>(silu16(g)) * u));
      }
  }
};

// Rows [m0, m0 + MT) of x times block b (w: [pairs][NV][32]), handed to store.
// x's pairs are read as int32; an odd K's last pair is built apart (x ends mid-pair).
template <int MT, int NV, typename Store>
inline void tile(const Store& st, const uint16_t* x, int64_t x_stride, int64_t k_size, int64_t m0,
                 const uint16_t* w, int64_t pairs, int64_t b) {
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
  st.template store<MT, NV>(sum, m0, b);
}

// Every row of x times one block of NV panels: 4-row tiles, then the remaining rows.
template <int NV, typename Store>
inline void block_rows(const Store& st, const uint16_t* x, int64_t x_stride, int64_t m_size, int64_t k_size,
                       const uint16_t* w, int64_t pairs, int64_t b) {
  int64_t m = 0;
  for (; m + 4 <= m_size; m += 4) tile<4, NV>(st, x, x_stride, k_size, m, w, pairs, b);
  switch (m_size - m) {
    case 3: tile<3, NV>(st, x, x_stride, k_size, m, w, pairs, b); break;
    case 2: tile<2, NV>(st, x, x_stride, k_size, m, w, pairs, b); break;
    case 1: tile<1, NV>(st, x, x_stride, k_size, m, w, pairs, b); break;
    default: break;
  }
}

// x [M, K] times every block of the packed weight of `panels` panels, each thread a run of blocks.
template <typename Store>
void multiply_blocks(const Store& st, const uint16_t* x, int64_t x_stride, int64_t m_size, int64_t k_size,
                     const uint16_t* packed, int64_t panels) {
  const int64_t pairs = (k_size + 1) / 2, blocks = (panels + kPanels - 1) / kPanels;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t p0 = b * kPanels, nv = std::min(kPanels, panels - p0);
      const uint16_t* w = packed + p0 * pairs * kPairWords;
      if constexpr (std::is_same_v<Store, GatedStore>) {
        block_rows<4>(st, x, x_stride, m_size, k_size, w, pairs, b);  // the op checks nv == 4
      } else {
        switch (nv) {
          case 4: block_rows<4>(st, x, x_stride, m_size, k_size, w, pairs, b); break;
          case 3: block_rows<3>(st, x, x_stride, m_size, k_size, w, pairs, b); break;
          case 2: block_rows<2>(st, x, x_stride, m_size, k_size, w, pairs, b); break;
          default: block_rows<1>(st, x, x_stride, m_size, k_size, w, pairs, b); break;
        }
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
    multiply_blocks(PlainStore{out.data_ptr<c10::BFloat16>(), n_size, b.empty() ? nullptr : b.data()},
                    reinterpret_cast<const uint16_t*>(xc.data_ptr<c10::BFloat16>()), xc.stride(0), xc.size(0), k_size,
                    reinterpret_cast<const uint16_t*>(packed.data_ptr<c10::BFloat16>()), packed.size(0));
#endif
  return out;
}

// out [M, d] = silu(x @ gate^T) * (x @ up^T), bit for bit silu_and_mul(bf16_dot_linear(x, gate | up)),
// for packed = bf16_pack_weight(weight[amx_gated_order(d)]) of a [2d, K] gate | up weight, d % 32 == 0.
Tensor bf16_dot_gated_linear(const Tensor& x, const Tensor& packed, int64_t d) {
  TORCH_CHECK(kHaveBf16Dot, "bf16_dot_gated_linear: this CPU or build has no AVX-512 BF16 (see bf16_dot_available)");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "bf16_dot_gated_linear: x must be bfloat16 [M, K]");
  const Tensor xc = x.stride(1) == 1 ? x : x.contiguous();
  const int64_t k_size = xc.size(1);
  TORCH_CHECK(d > 0 && d % (2 * kCols) == 0 && packed.dim() == 2 && packed.scalar_type() == at::kBFloat16 &&
              packed.is_contiguous() && packed.size(0) * kCols == 2 * d &&
              packed.size(1) == (k_size + 1) / 2 * kPairWords,
              "bf16_dot_gated_linear: packed must be bf16_pack_weight of a [2d, K] gate | up weight, d a multiple "
              "of 32, K = x's columns");
  Tensor out = at::empty({xc.size(0), d}, xc.options());
#if TANDEM_BF16_DOT
  if (xc.size(0) > 0)
    multiply_blocks(GatedStore{out.data_ptr<c10::BFloat16>(), d},
                    reinterpret_cast<const uint16_t*>(xc.data_ptr<c10::BFloat16>()), xc.stride(0), xc.size(0), k_size,
                    reinterpret_cast<const uint16_t*>(packed.data_ptr<c10::BFloat16>()), packed.size(0));
#endif
  return out;
}

}  // namespace tandem
