// The arguments the 4-bit linear (int4_linear.cpp) checks and converts, and its
// dispatch on x's dtype and the scales' (fp16 bits or floats).
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

// out [M, N] in x's dtype, from impl(out, x, x_stride, M, K, W<S>{qweight, scales, K / 32}, N, bias)
// with T = float or c10::BFloat16 (x's) and S = uint16_t (fp16 bits) or float (the scales').
template <template <typename> class W, typename Impl>
at::Tensor run_int4_linear(const char* op, const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                           const c10::optional<at::Tensor>& bias, Impl impl) {
  const at::Tensor bias_f = check_int4_linear_args(op, x, qweight, scales, bias);
  const int64_t m_size = x.size(0), k_size = x.size(1), n_size = qweight.size(0);
  const float* b = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  at::Tensor out = at::empty({m_size, n_size}, x.options());
  if (m_size == 0 || n_size == 0) return out;
  auto with_weights = [&](const auto& w) {
    if (x.scalar_type() == at::kFloat)
      impl(out.data_ptr<float>(), x.data_ptr<float>(), x.stride(0), m_size, k_size, w, n_size, b);
    else
      impl(out.data_ptr<c10::BFloat16>(), x.data_ptr<c10::BFloat16>(), x.stride(0), m_size, k_size, w, n_size, b);
  };
  const int64_t groups = k_size / 32;
  if (scales.scalar_type() == at::kHalf)
    with_weights(W<uint16_t>{qweight.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>()),
                             groups});
  else
    with_weights(W<float>{qweight.data_ptr<uint8_t>(), scales.data_ptr<float>(), groups});
  return out;
}

}  // namespace
}  // namespace tandem
