// int4_q8_linear: 4-bit weights against activations quantized to 8 bits per 32 values, with integer
// dot products, much as llama.cpp runs its 4-bit GGUF types (most like its Q4_0 x Q8_0; here the
// activations' scales are fp32, and one per 32 values for Q4_K too, where llama.cpp's Q8_K has one per
// 256). No weight is ever converted to a float, but the activations are rounded: the results are not
// the dequantized model's (int4_linear.cpp computes those).
//
// The weights come as panels (tandem_kernels.gguf_reference.pack_int4_q8 builds them from the int4 /
// int4f layouts and defines them): 8 output columns interleaved, so that one 32-byte load holds 8 K
// values of each, and the 8 fp32 lanes of a vector are 8 columns' sums:
//     codes  [P, K / 8, 32] uint8, P = ceil(N / 8): chunk c of panel p, bytes 4 j .. 4 j + 3 are column
//            8 p + j's; byte b holds the code (0..15) of K index 8 c + b in its low nibble and of
//            8 c + 4 + b in its high one;
//     scales [P, K / 32, 2, 8] fp16 or fp32: per panel and group, the 8 columns' d, then their m
//            (the weight is d * code + m); columns past N are zero codes and zero scales.
//
// x [M, K] float32 or bf16 is quantized row by row, group by group (gguf_reference.quantize_q8_groups,
// the contract): a = max |x| over the group's 32 values, s = a / 127, q = round_half_even(x * (127 / a))
// in [-127, 127] (all zero where a = 0; a group holding a NaN gets s = NaN, so its row's outputs are
// NaN, as the exact kernel's), computed in fp32. Then out[m, n] is one fp32 accumulator, over the
// groups in order:
//     acc = fma(float(dot), d * s, acc);  acc = fma(m, s * xs, acc)
// with dot = sum_i code[n, 32 g + i] * q[m, 32 g + i] and xs = sum_i q[m, 32 g + i] (exact integers),
// then + bias, rounded once to x's dtype. The order depends on K only: a row's result does not depend
// on M.
//
// With AVX2, a chunk's 8 x 4 products of one row are one vpmaddubsw against the row's 4 activations
// broadcast (a pair sums to at most 2 x 15 x 127; a group's 8 such sums stay below 2^15, so they add in
// 16 bits), and one vpmaddwd per group widens the 8 columns' dots. With AVX-512 VNNI, one 512-bit
// vpdpbusd adds two adjacent panels' products straight into int32 sums, 8 rows at a time (32 vector
// registers; q8_rows.h's Q8Lanes<2>; an odd last panel runs in a 256-bit tile): at 256-2048 rows,
// K = 2048, N = 8192 on a 2-core Zen 4 EPYC, 15-18 % faster than one panel per 256-bit tile. Other
// targets run the same arithmetic in plain loops. All give the same integer dots and the same fma
// chain per column, so the builds and tile widths agree exactly (checked on an AVX-512 VNNI CPU: the
// VNNI, AVX2 and plain-loop builds; tests/test_int4_q8.py: the tile widths).
//
// Registered here (TORCH_LIBRARY_FRAGMENT) rather than in registration.cpp: the op is this file's.

#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <cstring>
#include <tuple>

#include "common.h"
#include "int4_vec.h"
#include "ops.h"
#include "q8_rows.h"

namespace tandem {
namespace {

constexpr int64_t kGroup = kQ8Group;  // weights per (d, m) pair, along K
constexpr int64_t kCols = kQ8PanelCols;
constexpr int64_t kChunkBytes = 32;   // a panel's 8 K values for each of its 8 columns, two a byte
constexpr int64_t kChunksPerGroup = kGroup / 8;

// The panels: panel p's chunk c (32 code bytes) and its group g's scales (8 d, then 8 m); the next
// panel's are code_stride() bytes and scale_stride() scales on.
template <typename S>
struct Panels {
  const uint8_t* codes;  // [P, K / 8, 32]
  const S* dm;           // [P, G, 2, 8]
  int64_t groups;
  const uint8_t* chunk(int64_t p, int64_t c) const { return codes + (p * groups * kChunksPerGroup + c) * kChunkBytes; }
  const S* scales(int64_t p, int64_t g) const { return dm + (p * groups + g) * 2 * kCols; }
  int64_t code_stride() const { return groups * kChunksPerGroup * kChunkBytes; }
  int64_t scale_stride() const { return groups * 2 * kCols; }
};

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// dot[i]: row m0 + i's exact integer dots with the 8 NP columns of panels p .. p + NP - 1 over group g.
template <int MT, int NP, typename S>
__attribute__((always_inline)) inline void group_dots(typename Q8Lanes<NP>::I* dot, const QuantizedRows& x,
                                                      const Panels<S>& w, int64_t m0, int64_t p, int64_t g) {
  using L = Q8Lanes<NP>;
  const int8_t* xq0 = x.q.data() + m0 * x.k_size + g * kGroup;
#if defined(TANDEM_Q8_VNNI)
  // vpdpbusd adds a chunk's 4 products of each column straight into its int32 sum. Each row keeps two
  // sums (low and high nibbles), so MT rows make 2 MT independent chains.
  typename L::I sum_hi[MT];
  for (int i = 0; i < MT; ++i) dot[i] = sum_hi[i] = L::zero();
  for (int64_t c = 0; c < kChunksPerGroup; ++c) {
    const typename L::I bytes = L::load_bytes(w.chunk(p, g * kChunksPerGroup + c), w.code_stride());
    const typename L::I lo = L::low_nibbles(bytes), hi = L::high_nibbles(bytes);
    for (int i = 0; i < MT; ++i) {
      const int8_t* xq = xq0 + i * x.k_size + c * 8;
      dot[i] = L::dpbusd(dot[i], lo, L::broadcast(xq));
      sum_hi[i] = L::dpbusd(sum_hi[i], hi, L::broadcast(xq + 4));
    }
  }
  for (int i = 0; i < MT; ++i) dot[i] = L::add(dot[i], sum_hi[i]);
#else
  static_assert(NP == 1, "AVX2 tiles hold one panel");
  const __m256i ones = _mm256_set1_epi16(1);
  for (int i = 0; i < MT; ++i) dot[i] = _mm256_setzero_si256();  // 16-bit: two running sums per column
  // Not unrolled: unrolled, GCC computes every chunk's products before adding any and spills them.
#pragma GCC unroll 1
  for (int64_t c = 0; c < kChunksPerGroup; ++c) {
    const __m256i bytes = L::load_bytes(w.chunk(p, g * kChunksPerGroup + c), 0);
    const __m256i lo = L::low_nibbles(bytes), hi = L::high_nibbles(bytes);
    for (int i = 0; i < MT; ++i) {
      const int8_t* xq = xq0 + i * x.k_size + c * 8;
      dot[i] = _mm256_add_epi16(dot[i], _mm256_maddubs_epi16(lo, broadcast4(xq)));
      dot[i] = _mm256_add_epi16(dot[i], _mm256_maddubs_epi16(hi, broadcast4(xq + 4)));
    }
  }
  for (int i = 0; i < MT; ++i) dot[i] = _mm256_madd_epi16(dot[i], ones);  // widened to int32, exact
#endif
}

// Rows m0 .. m0 + MT - 1 against panels p .. p + NP - 1.
template <int MT, int NP, typename T, typename S>
__attribute__((noinline)) void panel_tile(T* out, int64_t n_size, const QuantizedRows& x, const Panels<S>& w,
                                          const float* bias, int64_t m0, int64_t p) {
  using L = Q8Lanes<NP>;
  typename L::F acc[MT];
  for (int i = 0; i < MT; ++i) acc[i] = L::zero_f();
  for (int64_t g = 0; g < x.groups; ++g) {
    typename L::I dot[MT];
    group_dots<MT, NP>(dot, x, w, m0, p, g);
    const S* dm = w.scales(p, g);
    add_group_terms<MT, L>(acc, dot, L::load_scales(dm, w.scale_stride()), L::load_scales(dm + kCols, w.scale_stride()),
                           x.s.data() + (m0 * x.groups + g) * 2, x.groups * 2);
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
    for (int64_t g = 0; g < x.groups; ++g) {
      const float* sc = x.s.data() + (row * x.groups + g) * 2;  // (s, s * xs)
      const S* dm = w.scales(p, g);
      for (int64_t j = 0; j < kCols; ++j) {
        int32_t dot = 0;
        for (int64_t c = 0; c < kChunksPerGroup; ++c) {
          const uint8_t* bytes = w.chunk(p, g * kChunksPerGroup + c) + 4 * j;
          const int8_t* xq = x.q.data() + row * x.k_size + g * kGroup + c * 8;
          for (int b = 0; b < 4; ++b) dot += (bytes[b] & 15) * xq[b] + (bytes[b] >> 4) * xq[4 + b];
        }
        acc[j] = std::fma(static_cast<float>(dot), scale_value(dm[j]) * sc[0], acc[j]);
        acc[j] = std::fma(scale_value(dm[kCols + j]), sc[1], acc[j]);
      }
    }
    store_panel_row(out, n_size, row, p * kCols, acc, bias);
  }
}
#endif

template <typename T, typename S>
void int4_q8_impl(T* out, const T* x, int64_t x_stride, int64_t m_size, int64_t k_size, const Panels<S>& w,
                  int64_t n_size, const float* bias) {
  const QuantizedRows xq = quantize_rows(x, x_stride, m_size, k_size, kGroup);
  for_each_panel_tile(m_size, k_size, (n_size + kCols - 1) / kCols, [&](auto rows, auto np, int64_t m0, int64_t p) {
    panel_tile<decltype(rows)::value, decltype(np)::value>(out, n_size, xq, w, bias, m0, p);
  });
}

}  // namespace

// out [M, N] (x's dtype) = the header's sum for x [M, K] (float32 or bf16, rows contiguous), the panels
// codes [ceil(N / 8), K / 8, 32] uint8 and scales [ceil(N / 8), K / 32, 2, 8] fp16 or float32, + bias [N].
Tensor int4_q8_linear(const Tensor& x, const Tensor& codes, const Tensor& scales, int64_t n_size,
                      const c10::optional<Tensor>& bias) {
  const char* op = "int4_q8_linear";
  check_cpu(x, "x");
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
              x.stride(1) == 1, op, ": x must be float32 or bfloat16 [M, K] with contiguous rows");
  const int64_t m_size = x.size(0), k_size = x.size(1), panels = (n_size + kCols - 1) / kCols;
  TORCH_CHECK(k_size % kGroup == 0, op, ": K (", k_size, ") must be a multiple of 32");
  TORCH_CHECK(n_size >= 0 && codes.dim() == 3 && codes.scalar_type() == at::kByte && codes.is_contiguous() &&
              codes.size(0) == panels && codes.size(1) * 8 == k_size && codes.size(2) == kChunkBytes,
              op, ": codes must be contiguous uint8 [ceil(N / 8), K / 8, 32]");
  TORCH_CHECK(scales.dim() == 4 && (scales.scalar_type() == at::kHalf || scales.scalar_type() == at::kFloat) &&
              scales.is_contiguous() && scales.size(0) == panels && scales.size(1) == k_size / kGroup &&
              scales.size(2) == 2 && scales.size(3) == kCols,
              op, ": scales must be contiguous float16 or float32 [ceil(N / 8), K / 32, 2, 8]");
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
      int4_q8_impl(out.data_ptr<float>(), x.data_ptr<float>(), x.stride(0), m_size, k_size, w, n_size, b);
    else
      int4_q8_impl(out.data_ptr<c10::BFloat16>(), x.data_ptr<c10::BFloat16>(), x.stride(0), m_size, k_size, w,
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

// The panels of the int4 / int4f layout, qweight [N, K / 2] uint8 and scales [N, K / 32, 2] fp16 or
// float32: gguf_reference.pack_int4_q8's (the contract), in one parallel pass.
std::tuple<Tensor, Tensor> int4_q8_pack(const Tensor& qweight, const Tensor& scales) {
  const char* op = "int4_q8_pack";
  TORCH_CHECK(qweight.device().is_cpu() && qweight.dim() == 2 && qweight.scalar_type() == at::kByte &&
              qweight.is_contiguous() && qweight.size(1) % 16 == 0, op, ": qweight must be contiguous uint8 [N, K / 2]");
  const int64_t n_size = qweight.size(0), k_size = qweight.size(1) * 2, groups = k_size / kGroup;
  TORCH_CHECK(scales.device().is_cpu() && scales.dim() == 3 && scales.is_contiguous() && scales.size(0) == n_size &&
              scales.size(1) == groups && scales.size(2) == 2 &&
              (scales.scalar_type() == at::kHalf || scales.scalar_type() == at::kFloat),
              op, ": scales must be contiguous float16 or float32 [N, K / 32, 2]");
  const int64_t panels = (n_size + kCols - 1) / kCols;
  Tensor codes = at::zeros({panels, k_size / 8, kChunkBytes}, qweight.options());
  Tensor dm = at::zeros({panels, groups, 2, kCols}, scales.options());
  auto pack = [&](const auto* sc, auto* out_dm) {
    const uint8_t* q = qweight.data_ptr<uint8_t>();
    uint8_t* out = codes.data_ptr<uint8_t>();
    at::parallel_for(0, panels, 16, [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p)
        for (int64_t j = 0; j < kCols && p * kCols + j < n_size; ++j) {
          const int64_t row = p * kCols + j;
          for (int64_t g = 0; g < groups; ++g) {
            // The group's 16 bytes as 4 words: bytes 8 c + b and 8 c + 4 + b (c = 0, 1; b < 4) hold K
            // 8 c + b and 8 c + 4 + b in their low nibbles, 16 more in their high ones. Every
            // operation below keeps to its byte, so the word order does not matter.
            uint32_t w[4];
            std::memcpy(w, q + row * (k_size / 2) + g * 16, sizeof w);
            constexpr uint32_t kLow = 0x0F0F0F0Fu, kHigh = 0xF0F0F0F0u;
            const uint32_t chunks[4] = {(w[0] & kLow) | ((w[1] & kLow) << 4), (w[2] & kLow) | ((w[3] & kLow) << 4),
                                        ((w[0] >> 4) & kLow) | (w[1] & kHigh), ((w[2] >> 4) & kLow) | (w[3] & kHigh)};
            uint8_t* chunk = out + (p * (k_size / 8) + g * kChunksPerGroup) * kChunkBytes + 4 * j;
            for (int64_t c = 0; c < kChunksPerGroup; ++c) std::memcpy(chunk + c * kChunkBytes, &chunks[c], 4);
            for (int64_t pair = 0; pair < 2; ++pair)
              out_dm[((p * groups + g) * 2 + pair) * kCols + j] = sc[(row * groups + g) * 2 + pair];
          }
        }
    });
  };
  if (scales.scalar_type() == at::kHalf)
    pack(reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>()), reinterpret_cast<uint16_t*>(dm.data_ptr<at::Half>()));
  else
    pack(scales.data_ptr<float>(), dm.data_ptr<float>());
  return {codes, dm};
}

}  // namespace tandem

TORCH_LIBRARY_FRAGMENT(tandem_cpu, m) {
  m.def("int4_q8_linear(Tensor x, Tensor codes, Tensor scales, int n, Tensor? bias) -> Tensor");
  m.def("int4_q8_pack(Tensor qweight, Tensor scales) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(tandem_cpu, CPU, m) {
  m.impl("int4_q8_linear", &tandem::int4_q8_linear);
  m.impl("int4_q8_pack", &tandem::int4_q8_pack);
}
