// gguf_int8g_linear: GGUF weights in the grouped int8 layout (tandem_kernels.gguf_reference), float32
// or bf16 activations.
//
//     codes  [N, K] int8             one integer code per weight (Q4_0..Q8_0, Q4_K, Q5_K, Q6_K)
//     scales [N, K / 16, 2] float32  (s, m) per row and 16-wide group
//     w[n, k] = s * q + m in fp32 (s * q is exact for every GGUF code, so one rounding)
//
// Each thread takes panels of kPanelRows weight rows, dequantizes them once into a float buffer
// (rounded to bf16 when x is bf16: the model with dequantized weights in the serving dtype, every
// product exact), then runs every row of x over them: a prompt pays the dequantization once per
// call, not once per row. Each output is the dot product in 16 fp32 lanes over K, the lanes summed
// in a fixed tree, plus the bias, rounded once to x's dtype. The order depends on K only, never on
// M, so a row's result does not depend on the batch it runs in.
//
// Registered here (TORCH_LIBRARY_FRAGMENT) rather than in registration.cpp: the op is this file's.

#include <torch/library.h>

#include <vector>

#include "common.h"
#include "ops.h"

namespace tandem {
namespace {

constexpr int64_t kGroup = 16;
constexpr int64_t kPanelRows = 8;

inline float dot16(const float* __restrict x, const float* __restrict w, int64_t k_size) {
  float acc[16] = {0};
  for (int64_t k = 0; k < k_size; k += 16) {
    for (int j = 0; j < 16; ++j) acc[j] += x[k + j] * w[k + j];
  }
  for (int width = 8; width >= 1; width /= 2) {
    for (int j = 0; j < width; ++j) acc[j] += acc[j + width];
  }
  return acc[0];
}

inline void dequantize_row(const int8_t* __restrict q, const float* __restrict s, int64_t k_size, bool round_bf16,
                           float* __restrict out) {
  for (int64_t g = 0; g < k_size / kGroup; ++g) {
    const float scale = s[2 * g], min = s[2 * g + 1];
    for (int j = 0; j < kGroup; ++j) out[g * kGroup + j] = static_cast<float>(q[g * kGroup + j]) * scale + min;
  }
  if (round_bf16) {
    for (int64_t k = 0; k < k_size; ++k) out[k] = static_cast<float>(c10::BFloat16(out[k]));
  }
}

Tensor gguf_int8g_linear(const Tensor& x, const Tensor& codes, const Tensor& scales, const c10::optional<Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "gguf_int8g_linear: x must be [M, K] float32 or bfloat16");
  const int64_t m_size = x.size(0), k_size = x.size(1), n_size = codes.size(0);
  TORCH_CHECK(k_size % kGroup == 0, "gguf_int8g_linear: K (", k_size, ") must be a multiple of 16");
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kChar && codes.is_contiguous() && codes.size(1) == k_size,
              "gguf_int8g_linear: codes must be contiguous [N, K] int8");
  TORCH_CHECK(scales.dim() == 3 && scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  scales.size(0) == n_size && scales.size(1) == k_size / kGroup && scales.size(2) == 2,
              "gguf_int8g_linear: scales must be contiguous [N, K / 16, 2] float32");
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == n_size, "gguf_int8g_linear: bias must have N elements");
  }
  const bool round_bf16 = x.scalar_type() == at::kBFloat16;
  const Tensor xf = x.to(at::kFloat).contiguous();  // [M, K]
  Tensor out = at::empty({m_size, n_size}, x.options().dtype(at::kFloat));
  const float* xp = xf.data_ptr<float>();
  const int8_t* qp = codes.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, (n_size + kPanelRows - 1) / kPanelRows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> panel(kPanelRows * k_size);
    for (int64_t p = begin; p < end; ++p) {
      const int64_t n0 = p * kPanelRows, rows = std::min(kPanelRows, n_size - n0);
      for (int64_t r = 0; r < rows; ++r) {
        dequantize_row(qp + (n0 + r) * k_size, sp + (n0 + r) * (k_size / kGroup) * 2, k_size, round_bf16,
                       panel.data() + r * k_size);
      }
      for (int64_t m = 0; m < m_size; ++m) {
        for (int64_t r = 0; r < rows; ++r) {
          op[m * n_size + n0 + r] = dot16(xp + m * k_size, panel.data() + r * k_size, k_size);
        }
      }
    }
  });
  if (bias.has_value()) out.add_(bias->to(at::kFloat).view({1, n_size}));
  return out.to(x.scalar_type());
}

}  // namespace
}  // namespace tandem

TORCH_LIBRARY_FRAGMENT(tandem_cpu, m) {
  m.def("gguf_int8g_linear(Tensor x, Tensor codes, Tensor scales, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(tandem_cpu, CPU, m) {
  m.impl("gguf_int8g_linear", &tandem::gguf_int8g_linear);
}
