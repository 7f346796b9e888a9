// Every op of torch.ops.tandem_cpu: its schema, and the C++ function (ops.h) that runs it on CPU
// tensors. kernels/tandem_kernels/cpu.py loads the library this file is linked into and calls the ops by name.

#include <torch/library.h>

#include "ops.h"

using namespace tandem;

TORCH_LIBRARY(tandem_cpu, m) {
  m.def("paged_attention(Tensor query, Tensor k_cache, Tensor v_cache, "
        "Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, float scale) -> Tensor");
  m.def("write_kv_cache(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor slot_mapping) -> ()");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("fused_add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("rotary_embedding(Tensor positions, Tensor(a!) query, Tensor(b!) key, Tensor cos_sin_cache, "
        "int head_dim, bool is_neox) -> ()");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.def("int8_linear(Tensor x, Tensor weight, Tensor scale, Tensor? bias) -> Tensor");
  m.def("w8a8_linear(Tensor x, Tensor weight, Tensor scale, Tensor? bias) -> Tensor");
  m.def("int8_bf16_available() -> bool", &int8_bf16_available);  // no tensors: one kernel for every key
  m.def("int8_pack_weight_bf16(Tensor weight) -> Tensor");
  m.def("int8_linear_packed(Tensor x, Tensor packed, Tensor scale, Tensor? bias) -> Tensor");
  m.def("w8a8_vnni_available() -> bool", &w8a8_vnni_available);  // no tensors: one kernel for every key
  m.def("w8a8_pack_weight(Tensor weight) -> Tensor");
  m.def("w8a8_linear_packed(Tensor x, Tensor packed, Tensor scale, Tensor? bias) -> Tensor");
  m.def("int4_linear(Tensor x, Tensor qweight, Tensor scales, Tensor? bias) -> Tensor");
  m.def("attention_block(Tensor(a!) qkv, Tensor? positions, Tensor? cos_sin_cache, bool is_neox, "
        "Tensor(b!) k_cache, Tensor(c!) v_cache, Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, "
        "Tensor query_start_loc, int num_heads, int num_kv_heads, int head_dim, float scale) -> Tensor");
  m.def("apply_penalties(Tensor(a!) logits, Tensor rows, Tensor prompt_seen, Tensor output_counts, "
        "Tensor slots, Tensor repetition, Tensor frequency, Tensor presence) -> ()");
  m.def("penalized_argmax(Tensor logits, Tensor rows, Tensor prompt_seen, Tensor(a!) output_counts, "
        "Tensor slots, Tensor repetition, Tensor frequency, Tensor presence, bool count) -> Tensor");
  m.def("amx_available() -> bool", &amx_available);  // no tensors: one kernel for every key
  m.def("amx_pack_weight(Tensor w) -> Tensor");
  m.def("amx_linear(Tensor x, Tensor packed, int n, Tensor? bias) -> Tensor");
  m.def("amx_gated_linear(Tensor x, Tensor packed, int d) -> Tensor");
  m.def("bf16_dot_available() -> bool", &bf16_dot_available);  // no tensors: one kernel for every key
  m.def("bf16_pack_weight(Tensor weight) -> Tensor");
  m.def("bf16_dot_linear(Tensor x, Tensor packed, int n, Tensor? bias) -> Tensor");
  m.def("bf16_dot_gated_linear(Tensor x, Tensor packed, int d) -> Tensor");
}

TORCH_LIBRARY_IMPL(tandem_cpu, CPU, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("write_kv_cache", &write_kv_cache);
  m.impl("rms_norm", &rms_norm);
  m.impl("fused_add_rms_norm", &fused_add_rms_norm);
  m.impl("rotary_embedding", &rotary_embedding);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("argmax_rows", &argmax_rows);
  m.impl("attention_block", &attention_block);
  m.impl("int8_linear", &int8_linear);
  m.impl("w8a8_linear", &w8a8_linear);
  m.impl("apply_penalties", &apply_penalties);
  m.impl("penalized_argmax", &penalized_argmax);
  m.impl("int8_pack_weight_bf16", &int8_pack_weight_bf16);
  m.impl("int8_linear_packed", &int8_linear_packed);
  m.impl("w8a8_pack_weight", &w8a8_pack_weight);
  m.impl("w8a8_linear_packed", &w8a8_linear_packed);
  m.impl("int4_linear", &int4_linear);
  m.impl("amx_pack_weight", &amx_pack_weight);
  m.impl("amx_linear", &amx_linear);
  m.impl("amx_gated_linear", &amx_gated_linear);
  m.impl("bf16_pack_weight", &bf16_pack_weight);
  m.impl("bf16_dot_linear", &bf16_dot_linear);
  m.impl("bf16_dot_gated_linear", &bf16_dot_gated_linear);
}
