// Every op's C++ signature, for registration.cpp (which gives each its schema) and for the op
// families that call one another (attention_block runs rotary_embedding). Contracts are at each
// definition: attention.cpp, elementwise.cpp, int8_linear.cpp, int8_bf16.cpp, w8a8_packed.cpp,
// int4_linear.cpp, amx_linear.cpp, bf16_linear.cpp, penalties.cpp.
#pragma once

#include <ATen/core/Tensor.h>

namespace tandem {

using at::Tensor;

// attention.cpp
Tensor paged_attention(const Tensor& query, const Tensor& k_cache, const Tensor& v_cache,
                       const Tensor& block_tables, const Tensor& seq_lens,
                       const Tensor& query_start_loc, double scale);
void write_kv_cache(const Tensor& key, const Tensor& value, Tensor k_cache, Tensor v_cache,
                    const Tensor& slot_mapping);
Tensor attention_block(Tensor qkv, const c10::optional<Tensor>& positions, const c10::optional<Tensor>& cos_sin_cache,
                       bool is_neox, Tensor k_cache, Tensor v_cache, const Tensor& slot_mapping,
                       const Tensor& block_tables, const Tensor& seq_lens, const Tensor& query_start_loc,
                       int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double scale);

// elementwise.cpp
Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps);
void fused_add_rms_norm(Tensor x, Tensor residual, const Tensor& weight, double eps);
void rotary_embedding(const Tensor& positions, Tensor query, Tensor key, const Tensor& cos_sin_cache,
                      int64_t head_dim, bool is_neox);
Tensor silu_and_mul(const Tensor& x);
Tensor argmax_rows(const Tensor& x);

// int8_linear.cpp
Tensor int8_linear(const Tensor& x, const Tensor& weight, const Tensor& scale,
                   const c10::optional<Tensor>& bias);
Tensor w8a8_linear(const Tensor& x, const Tensor& weight, const Tensor& scale,
                   const c10::optional<Tensor>& bias);

// penalties.cpp
void apply_penalties(Tensor logits, const Tensor& rows, const Tensor& prompt_seen, const Tensor& output_counts,
                     const Tensor& slots, const Tensor& repetition, const Tensor& frequency,
                     const Tensor& presence);
Tensor penalized_argmax(const Tensor& logits, const Tensor& rows, const Tensor& prompt_seen, Tensor output_counts,
                        const Tensor& slots, const Tensor& repetition, const Tensor& frequency,
                        const Tensor& presence, bool count);
// int8_bf16.cpp
bool int8_bf16_available();
Tensor int8_pack_weight_bf16(const Tensor& weight);
Tensor int8_linear_packed(const Tensor& x, const Tensor& packed, const Tensor& scale,
                          const c10::optional<Tensor>& bias);

// w8a8_packed.cpp
bool w8a8_vnni_available();
Tensor w8a8_pack_weight(const Tensor& weight);
Tensor w8a8_linear_packed(const Tensor& x, const Tensor& packed, const Tensor& scale,
                          const c10::optional<Tensor>& bias);
// int4_linear.cpp
Tensor int4_linear(const Tensor& x, const Tensor& qweight, const Tensor& scales, const c10::optional<Tensor>& bias);

// amx_linear.cpp
bool amx_available();
Tensor amx_pack_weight(const Tensor& w);
Tensor amx_linear(const Tensor& x, const Tensor& packed, int64_t n_size, const c10::optional<Tensor>& bias);
Tensor amx_gated_linear(const Tensor& x, const Tensor& packed, int64_t d);

// bf16_linear.cpp
bool bf16_dot_available();
Tensor bf16_pack_weight(const Tensor& weight);
Tensor bf16_dot_linear(const Tensor& x, const Tensor& packed, int64_t n_size, const c10::optional<Tensor>& bias);
Tensor bf16_dot_gated_linear(const Tensor& x, const Tensor& packed, int64_t d);

}  // namespace tandem
