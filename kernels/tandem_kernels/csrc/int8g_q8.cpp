// int8g_q8_linear: the grouped int8 layout's weights (GGUF Q5_K / Q6_K parts, whose codes fit 6 bits)
// against activations quantized to 8 bits per 32 values (q8_rows.h), with integer dot products: the
// int8-activation twin of gguf_linear.cpp's int8g kernel, as int4_q8.cpp is int4_linear.cpp's.
//
// The weights come as panels (tandem_kernels.gguf_reference.pack_int8g_q8 builds them from codes
// [N, K] int8 in [-32, 31] and scales [N, K / 16, 2] (s, m), the weight being s * code + m):
//     codes  [P, K / 4, 32] uint8, P = ceil(N / 8): chunk c of panel p, bytes 4 j .. 4 j + 3 hold
//            column 8 p + j's codes of K indices 4 c .. 4 c + 3, each plus 32 (0..63);
//     scales [P, K / 16, 2, 8] fp16 or fp32: per panel and 16-group, the 8 columns' s, then their
//            m' = m - 32 s (so that s * (code + 32) + m' is the weight); columns past N are zero.
// out[m, n] is one fp32 accumulator over the 16-groups h in order (g = h / 2, the activations' group):
//     acc = fma(float(dot), s * sx, acc);  acc = fma(m', sx * xs, acc)
// with dot = sum_i (code + 32) * q and xs = sum_i q over the group's 16 values (exact integers) and sx
// the activations' scale, then + bias, rounded once to x's dtype. The order depends on K only.
//
// With AVX2 a chunk's 8 x 4 products of one row are one vpmaddubsw (a pair sums to at most
// 2 x 63 x 127; two chunks' sums stay below 2^15 and add in 16 bits) and one vpmaddwd per two chunks
// widens them. With AVX-512 VNNI one 512-bit vpdpbusd adds a chunk's products of two adjacent panels
// straight into int32 sums, 8 rows at a time (q8_rows.h's Q8Lanes<2>; an odd last panel runs in a
// 256-bit tile). Other targets run the same arithmetic in plain loops. The builds and the tile widths
// agree exactly: the same integer dots, the same fma chain per column.
//
// Registered here (TORCH_LIBRARY_FRAGMENT) rather than in registration.cpp: the op is this file's.

#include <ATen/ops/aminmax.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <tuple>

#include "common.h"
#include "int4_vec.h"
#include "ops.h"
#include "q8_rows.h"

namespace tandem {
namespace {

constexpr int64_t kGroup = 16;       // weights per (s, m') pair, along K
constexpr int64_t kCols = kQ8PanelCols;
constexpr int64_t kChunkBytes = 32;  // a panel's 4 K values for each of its 8 columns
constexpr int64_t kChunksPerGroup = kGroup / 4;

template <typename S>
struct Panels {
  const uint8_t* codes;  // [P, K / 4, 32]
  const S* sm;           // [P, K / 16, 2, 8]
  int64_t groups;        // K / 16
  const uint8_t* chunk(int64_t p, int64_t c) const { return codes + (p * groups * kChunksPerGroup + c) * kChunkBytes; }
  const S* scales(int64_t p, int64_t h) const { return sm + (p * groups + h) * 2 * kCols; }
  int64_t code_stride() const { return groups * kChunksPerGroup * kChunkBytes; }  // to the next panel's
  int64_t scale_stride() const { return groups * 2 * kCols; }
};

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// dot[i]: row m0 + i's exact integer dots with the 8 NP columns of panels p .. p + NP - 1 over 16-group h.
template <int MT, int NP, typename S>
__attribute__((always_inline)) inline void group_dots(typename Q8Lanes<NP>::I* dot, const QuantizedRows& x,
                                                      const Panels<S>& w, int64_t m0, int64_t p, int64_t h) {
  using L = Q8Lanes<NP>;
#if defined(TANDEM_Q8_VNNI)
  // vpdpbusd adds a chunk's products straight into int32 sums; each row keeps two sums (even and odd
  // chunks), so MT rows make 2 MT independent chains.
  typename L::I odd[MT];
  for (int i = 0; i < MT; ++i) dot[i] = odd[i] = L::zero();
#else
  static_assert(NP == 1, "AVX2 tiles hold one panel");
  const __m256i ones = _mm256_set1_epi16(1);
#endif
  for (int64_t half = 0; half < 2; ++half) {  // chunks 2 half, 2 half + 1: 8 K values
    const uint8_t* c = w.chunk(p, h * kChunksPerGroup + 2 * half);
    const typename L::I c0 = L::load_bytes(c, w.code_stride());
    const typename L::I c1 = L::load_bytes(c + kChunkBytes, w.code_stride());
    for (int i = 0; i < MT; ++i) {
      const int8_t* xq = x.q.data() + (m0 + i) * x.k_size + h * kGroup + 8 * half;
#if defined(TANDEM_Q8_VNNI)
      dot[i] = L::dpbusd(dot[i], c0, L::broadcast(xq));
      odd[i] = L::dpbusd(odd[i], c1, L::broadcast(xq + 4));
#else
      const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(c0, broadcast4(xq)),
                                             _mm256_maddubs_epi16(c1, broadcast4(xq + 4)));
      const __m256i sums = _mm256_madd_epi16(pairs, ones);
      dot[i] = half == 0 ? sums : _mm256_add_epi32(dot[i], sums);
#endif
    }
  }
#if defined(TANDEM_Q8_VNNI)
  for (int i = 0; i < MT; ++i) dot[i] = L::add(dot[i], odd[i]);
#endif
}

// Rows m0 .. m0 + MT - 1 against panels p .. p + NP - 1.
template <int MT, int NP, typename T, typename S>
__attribute__((noinline)) void panel_tile(T* out, int64_t n_size, const QuantizedRows& x, const Panels<S>& w,
                                          const float* bias, int64_t m0, int64_t p) {
  using L = Q8Lanes<NP>;
  typename L::F acc[MT];
  for (int i = 0; i < MT; ++i) acc[i] = L::zero_f();
  for (int64_t h = 0; h < w.groups; ++h) {
    typename L::I dot[MT];
    group_dots<MT, NP>(dot, x, w, m0, p, h);
    const S* sm = w.scales(p, h);
    add_group_terms<MT, L>(acc, dot, L::load_scales(sm, w.scale_stride()), L::load_scales(sm + kCols, w.scale_stride()),
                           x.s.data() + (m0 * w.groups + h) * 2, w.groups * 2);
  }
  store_panel_tile<MT, NP>(out, n_size, m0, p * kCols, acc, bias);
}
#else
// The same arithmetic in plain loops (tiles of one panel).
template <int MT, int NP, typename T, typename S>
void panel_tile(T* out, int64_t n_size, const QuantizedRows& x, const Panels<S>& w, const float* bias, int64_t m0,
                int64_t p) {
  static_assert(NP == 1, "plain-loop tiles hold one panel");
  for (int i = 0; i < MT; ++i) {
    const int64_t row = m0 + i;
    float acc[kCols] = {};
    for (int64_t h = 0; h < w.groups; ++h) {
      const float* sc = x.s.data() + (row * w.groups + h) * 2;  // (sx, sx * xs)
      const S* sm = w.scales(p, h);
      for (int64_t j = 0; j < kCols; ++j) {
        int32_t dot = 0;
        for (int64_t c = 0; c < kChunksPerGroup; ++c) {
          const uint8_t* codes = w.chunk(p, h * kChunksPerGroup + c) + 4 * j;
          const int8_t* xq = x.q.data() + row * x.k_size + h * kGroup + 4 * c;
          for (int b = 0; b < 4; ++b) dot += codes[b] * xq[b];
        }
        acc[j] = std::fma(static_cast<float>(dot), scale_value(sm[j]) * sc[0], acc[j]);
        acc[j] = std::fma(scale_value(sm[kCols + j]), sc[1], acc[j]);
      }
    }
    store_panel_row(out, n_size, row, p * kCols, acc, bias);
  }
}
#endif

template <typename T, typename S>
void int8g_q8_impl(T* out, const T* x, int64_t x_stride, int64_t m_size, int64_t k_size, const Panels<S>& w,
                   int64_t n_size, const float* bias) {
  const QuantizedRows xq = quantize_rows(x, x_stride, m_size, k_size, kGroup);
  for_each_panel_tile(m_size, k_size, (n_size + kCols - 1) / kCols, [&](auto rows, auto np, int64_t m0, int64_t p) {
    panel_tile<decltype(rows)::value, decltype(np)::value>(out, n_size, xq, w, bias, m0, p);
  });
}

}  // namespace

// out [M, N] (x's dtype) = the header's sum for x [M, K] (float32 or bf16, rows contiguous), the panels
// codes [ceil(N / 8), K / 4, 32] uint8 and scales [ceil(N / 8), K / 16, 2, 8] fp16 or float32, + bias [N].
Tensor int8g_q8_linear(const Tensor& x, const Tensor& codes, const Tensor& scales, int64_t n_size,
                       const c10::optional<Tensor>& bias) {
  const char* op = "int8g_q8_linear";
  check_cpu(x, "x");
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
              x.stride(1) == 1, op, ": x must be float32 or bfloat16 [M, K] with contiguous rows");
  const int64_t m_size = x.size(0), k_size = x.size(1), panels = (n_size + kCols - 1) / kCols;
  TORCH_CHECK(k_size % kQ8Group == 0, op, ": K (", k_size, ") must be a multiple of 32");
  TORCH_CHECK(n_size >= 0 && codes.dim() == 3 && codes.scalar_type() == at::kByte && codes.is_contiguous() &&
              codes.size(0) == panels && codes.size(1) * 4 == k_size && codes.size(2) == kChunkBytes,
              op, ": codes must be contiguous uint8 [ceil(N / 8), K / 4, 32]");
  TORCH_CHECK(scales.dim() == 4 && (scales.scalar_type() == at::kHalf || scales.scalar_type() == at::kFloat) &&
              scales.is_contiguous() && scales.size(0) == panels && scales.size(1) == k_size / kGroup &&
              scales.size(2) == 2 && scales.size(3) == kCols,
              op, ": scales must be contiguous float16 or float32 [ceil(N / 8), K / 16, 2, 8]");
  at::Tensor bias_f;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == n_size, op, ": bias must have N elements");
    bias_f = bias->to(at::kFloat).contiguous();
  }
  const float* b = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  at::Tensor out = at::empty({m_size, n_size}, x.options());
  if (m_size == 0 || n_size == 0) return out;
  auto run = [&](const auto& w) {
    if (x.scalar_type() == at::kFloat)
      int8g_q8_impl(out.data_ptr<float>(), x.data_ptr<float>(), x.stride(0), m_size, k_size, w, n_size, b);
    else
      int8g_q8_impl(out.data_ptr<c10::BFloat16>(), x.data_ptr<c10::BFloat16>(), x.stride(0), m_size, k_size, w,
                    n_size, b);
  };
  const int64_t groups = k_size / kGroup;
  if (scales.scalar_type() == at::kHalf)
    run(Panels<uint16_t>{codes.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>()),
                         groups});
  else
    run(Panels<float>{codes.data_ptr<uint8_t>(), scales.data_ptr<float>(), groups});
  return out;
}

// The panels of the int8g layout, codes [N, K] int8 in [-32, 31] and scales [N, K / 16, 2] float32:
// gguf_reference.pack_int8g_q8's (the contract), in one parallel pass.
std::tuple<Tensor, Tensor> int8g_q8_pack(const Tensor& codes, const Tensor& scales) {
  const char* op = "int8g_q8_pack";
  TORCH_CHECK(codes.device().is_cpu() && codes.dim() == 2 && codes.scalar_type() == at::kChar &&
              codes.is_contiguous() && codes.size(1) % kQ8Group == 0, op, ": codes must be contiguous int8 [N, K]");
  const int64_t n_size = codes.size(0), k_size = codes.size(1), groups = k_size / kGroup;
  TORCH_CHECK(scales.device().is_cpu() && scales.dim() == 3 && scales.is_contiguous() &&
              scales.scalar_type() == at::kFloat && scales.size(0) == n_size && scales.size(1) == groups &&
              scales.size(2) == 2, op, ": scales must be contiguous float32 [N, K / 16, 2]");
  if (codes.numel()) {
    const auto [low, high] = at::aminmax(codes);
    TORCH_CHECK(low.item<int8_t>() >= -32 && high.item<int8_t>() <= 31, op,
                ": the codes must lie in [-32, 31] (Q8_0's 8-bit codes do not fit)");
  }
  const int64_t panels = (n_size + kCols - 1) / kCols;
  Tensor packed = at::zeros({panels, k_size / 4, kChunkBytes}, codes.options().dtype(at::kByte));
  Tensor sm = at::zeros({panels, groups, 2, kCols}, scales.options());
  const int8_t* c = codes.data_ptr<int8_t>();
  const float* s = scales.data_ptr<float>();
  uint8_t* out = packed.data_ptr<uint8_t>();
  float* out_sm = sm.data_ptr<float>();
  at::parallel_for(0, panels, 16, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t j = 0; j < kCols && p * kCols + j < n_size; ++j) {
        const int64_t row = p * kCols + j;
        const int8_t* codes_row = c + row * k_size;
        uint8_t* column = out + p * (k_size / 4) * kChunkBytes + 4 * j;
        for (int64_t chunk = 0; chunk < k_size / 4; ++chunk) {
          uint8_t shifted[4];
          for (int64_t b = 0; b < 4; ++b) shifted[b] = static_cast<uint8_t>(codes_row[4 * chunk + b] + 32);
          std::memcpy(column + chunk * kChunkBytes, shifted, 4);
        }
        for (int64_t h = 0; h < groups; ++h) {
          const float scale = s[(row * groups + h) * 2], m = s[(row * groups + h) * 2 + 1];
          out_sm[((p * groups + h) * 2) * kCols + j] = scale;
          out_sm[((p * groups + h) * 2 + 1) * kCols + j] = m - 32.0f * scale;  // 32 s is exact: one rounding, fused or not
        }
      }
  });
  return {packed, sm};
}

}  // namespace tandem

TORCH_LIBRARY_FRAGMENT(tandem_cpu, m) {
  m.def("int8g_q8_linear(Tensor x, Tensor codes, Tensor scales, int n, Tensor? bias) -> Tensor");
  m.def("int8g_q8_pack(Tensor codes, Tensor scales) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(tandem_cpu, CPU, m) {
  m.impl("int8g_q8_linear", &tandem::int8g_q8_linear);
  m.impl("int8g_q8_pack", &tandem::int8g_q8_pack);
}
