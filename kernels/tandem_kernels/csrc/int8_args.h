// The arguments every int8 linear (int8_linear.cpp, w8a8_packed.cpp) checks and converts alike.
#pragma once

#include "common.h"

#include <cstring>
#include <vector>

namespace tandem {
namespace {

// x float32 or bf16 [M, K] with contiguous rows, weight contiguous int8 [N, K], scale float32 [N].
inline void check_int8_linear_args(const char* op, const at::Tensor& x, const at::Tensor& weight,
                                   const at::Tensor& scale) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
              x.stride(1) == 1, op, ": x must be float32 or bfloat16 [M, K] with contiguous rows");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kChar && weight.is_contiguous() &&
              weight.size(1) == x.size(1), op, ": weight must be contiguous int8 [N, K]");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == weight.size(0),
              op, ": scale must be float32 [N]");
}

// bias (float32 or bf16 [N], or none) as float32, exactly, padded with zeros to `padded` entries
// (at least N); empty without a bias.
inline std::vector<float> int8_linear_bias(const char* op, const c10::optional<at::Tensor>& bias, int64_t n_size,
                                           int64_t padded = 0) {
  if (!bias.has_value() || !bias->defined()) return {};
  TORCH_CHECK((bias->scalar_type() == at::kFloat || bias->scalar_type() == at::kBFloat16) &&
              bias->is_contiguous() && bias->numel() == n_size, op, ": bias must be float32 or bfloat16 [N]");
  std::vector<float> out(std::max(n_size, padded), 0.0f);
  if (bias->scalar_type() == at::kFloat) {
    std::copy(bias->data_ptr<float>(), bias->data_ptr<float>() + n_size, out.begin());
  } else {
    const uint16_t* bits = reinterpret_cast<const uint16_t*>(bias->data_ptr<c10::BFloat16>());
    for (int64_t i = 0; i < n_size; ++i) {
      const uint32_t word = static_cast<uint32_t>(bits[i]) << 16;
      std::memcpy(out.data() + i, &word, sizeof word);
    }
  }
  return out;
}

}  // namespace
}  // namespace tandem
