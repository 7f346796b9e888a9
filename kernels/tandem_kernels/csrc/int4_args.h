// The arguments both 4-bit linears (int4_linear.cpp, int4_q8.cpp) check and convert alike.
#pragma once

#include "common.h"

namespace tandem {
namespace {

// x float32 or bf16 [M, K] (rows contiguous, K a multiple of 32), qweight contiguous uint8 [N, K / 2],
// scales contiguous fp16 or float32 [N, K / 32, 2]; bias [N] of any float dtype, or none, as a
// float32 tensor (undefined without one).
inline at::Tensor check_int4_linear_args(const char* op, const at::Tensor& x, const at::Tensor& qweight,
                                         const at::Tensor& scales, const c10::optional<at::Tensor>& bias) {
  check_cpu(x, "x");
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
              x.stride(1) == 1, op, ": x must be float32 or bfloat16 [M, K] with contiguous rows");
  const int64_t k_size = x.size(1);
  TORCH_CHECK(k_size % 32 == 0, op, ": K (", k_size, ") must be a multiple of 32");
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kByte && qweight.is_contiguous() &&
              qweight.size(1) * 2 == k_size, op, ": qweight must be contiguous uint8 [N, K / 2]");
  const int64_t n_size = qweight.size(0);
  TORCH_CHECK(scales.dim() == 3 && (scales.scalar_type() == at::kHalf || scales.scalar_type() == at::kFloat) &&
              scales.is_contiguous() && scales.size(0) == n_size && scales.size(1) == k_size / 32 &&
              scales.size(2) == 2, op, ": scales must be contiguous float16 or float32 [N, K / 32, 2]");
  if (!bias.has_value() || !bias->defined()) return at::Tensor();
  TORCH_CHECK(bias->numel() == n_size, op, ": bias must have N elements");
  return bias->to(at::kFloat).contiguous();
}

}  // namespace
}  // namespace tandem
