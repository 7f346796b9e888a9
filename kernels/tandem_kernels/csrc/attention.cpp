// Attention's ops: paged_attention (every token's heads against its request's cached K and V),
// write_kv_cache (new K and V into their slots, fp8 or the model's dtype), and attention_block
// (rotary, the cache write and attention on a fused QKV, in one op call).
//
// Where the compiler targets AVX-512 (-march=native on such a CPU), attention takes the AVX-512
// kernel (attention_avx512.h: BF16 dot products where present), elsewhere the 8-lane one
// (attention_portable.h). Both agree with the reference; their float sums run in different orders.
// The caches hold the model's dtype, or fp8 (e4m3fn, --kv-cache-dtype fp8): values clamped to
// +-448 and rounded to nearest even as written (torch's conversion), widened exactly as read.

#include "attention_avx512.h"
#include "attention_portable.h"
#include "ops.h"

namespace tandem {

// out, query: [num_tokens, num_heads, head_dim] (rows may be strided, heads contiguous);
// k_cache, v_cache: [num_blocks, num_kv_heads, block_size, head_dim] contiguous, query's dtype or fp8;
// block_tables: [num_reqs, max_blocks] int32; seq_lens: [num_reqs] int32 (tokens in the cache
// after this step); query_start_loc: [num_reqs + 1] int32. Request r's query rows are the
// newest tokens of its sequence and attend causally to its cached tokens.
Tensor paged_attention(const Tensor& query, const Tensor& k_cache, const Tensor& v_cache,
                       const Tensor& block_tables, const Tensor& seq_lens,
                       const Tensor& query_start_loc, double scale) {
  for (const Tensor* t : {&query, &k_cache, &v_cache, &block_tables, &seq_lens, &query_start_loc})
    check_cpu(*t, "paged_attention");
  TORCH_CHECK(query.dim() == 3, "query: [num_tokens, heads, dim]");
  Tensor out = at::empty(query.sizes(), query.options());
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
              k_cache.sizes() == v_cache.sizes(), "caches: contiguous [blocks, kv_heads, block_size, dim]");
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type(), "K and V caches must share a dtype");
  TORCH_CHECK(query.stride(2) == 1 && query.stride(1) == query.size(2),
              "query: each token's heads must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.is_contiguous() &&
              seq_lens.scalar_type() == at::kInt && query_start_loc.scalar_type() == at::kInt &&
              seq_lens.is_contiguous() && query_start_loc.is_contiguous(),
              "block_tables, seq_lens, query_start_loc: contiguous int32");
  const int64_t num_tokens = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t num_kv_heads = k_cache.size(1), block_size = k_cache.size(2);
  const int64_t num_reqs = seq_lens.size(0), max_blocks = block_tables.size(1);
  TORCH_CHECK(k_cache.size(3) == head_dim && num_heads % num_kv_heads == 0, "head shapes disagree");
  TORCH_CHECK(query_start_loc.size(0) == num_reqs + 1 && block_tables.size(0) >= num_reqs,
              "one seq_len and one block table per request");
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  TORCH_CHECK(qsl[0] == 0 && qsl[num_reqs] == num_tokens, "query_start_loc must cover the tokens");
  // token -> request, checked once (the work items below trust it).
  std::vector<int32_t> req_of(num_tokens);
  for (int64_t r = 0; r < num_reqs; ++r) {
    const int64_t q_len = qsl[r + 1] - qsl[r];
    TORCH_CHECK(q_len >= 0 && q_len <= lens[r] && lens[r] <= max_blocks * block_size,
                "request ", r, ": bad query length or seq_len");
    for (int64_t i = qsl[r]; i < qsl[r + 1]; ++i) req_of[i] = static_cast<int32_t>(r);
  }
  const int64_t group = num_heads / num_kv_heads;
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t num_blocks = k_cache.size(0);
  for (int64_t r = 0; r < num_reqs; ++r)
    for (int64_t b = 0; b < (lens[r] + block_size - 1) / block_size; ++b)
      TORCH_CHECK(tables[r * max_blocks + b] >= 0 && tables[r * max_blocks + b] < num_blocks,
                  "block table of request ", r, " holds an invalid block ID");
  const bool wide = kHaveAttendAvx512 && head_dim % 16 == 0;  // the AVX-512 kernel
  TANDEM_DISPATCH_CACHE(query.scalar_type(), k_cache.scalar_type(), "paged_attention", [&] {
    const scalar_t* q = query.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    const cache_t* kc = static_cast<const cache_t*>(k_cache.data_ptr());
    const cache_t* vc = static_cast<const cache_t*>(v_cache.data_ptr());
    const int64_t q_stride = query.stride(0), o_stride = out.stride(0);
    auto keys_seen = [&](int64_t tok) {  // keys query row tok attends to
      const int64_t r = req_of[tok];
      return lens[r] - (qsl[r + 1] - qsl[r]) + (tok - qsl[r]) + 1;
    };
    if (wide) {
      // Work items: a token's KV heads together when there are tokens enough to share out (then each
      // block's K is read in one pass: measured ~8 % faster batch-32 attention), else one KV head each.
      const int64_t per_item = num_tokens >= 4 * at::get_num_threads() ? num_kv_heads : 1;
      const int64_t items_per_token = num_kv_heads / per_item;
      at::parallel_for(0, num_tokens * items_per_token, 1, [&](int64_t begin, int64_t end) {
        std::vector<float> scratch;
        for (int64_t item = begin; item < end; ++item) {
          const int64_t tok = item / items_per_token, kvh0 = item % items_per_token * per_item;
          const int32_t* next_table = nullptr;  // the next item's K blocks, prefetched meanwhile
          int64_t next_blocks = 0;
          if (item + 1 < end) {
            const int64_t next_tok = (item + 1) / items_per_token;
            next_table = tables + req_of[next_tok] * max_blocks;
            next_blocks = (keys_seen(next_tok) + block_size - 1) / block_size;
          }
          attend_one_avx512(o + tok * o_stride, q + tok * q_stride, kc, vc, tables + req_of[tok] * max_blocks,
                            keys_seen(tok), kvh0, kvh0 + per_item, group, head_dim, block_size, num_kv_heads,
                            static_cast<float>(scale), next_table, next_blocks,
                            (item + 1) % items_per_token * per_item, scratch);
        }
      });
      return;
    }
    at::parallel_for(0, num_tokens * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scratch;
      for (int64_t item = begin; item < end; ++item) {
        const int64_t tok = item / num_kv_heads, kvh = item % num_kv_heads;
        attend_one(o + tok * o_stride, q + tok * q_stride, kc, vc, tables + req_of[tok] * max_blocks,
                   keys_seen(tok), kvh, group, head_dim, block_size, num_kv_heads, static_cast<float>(scale),
                   scratch);
      }
    });
  });
  return out;
}

// ---- KV cache ---------------------------------------------------------------------

constexpr float kFp8Max = 448.0f;  // e4m3fn's largest finite value

// key, value: [num_tokens, num_kv_heads, head_dim] (rows may be strided); slot_mapping:
// [num_tokens] int64, slot = block * block_size + row -> cache[block, :, row, :].
void write_kv_cache(const Tensor& key, const Tensor& value, Tensor k_cache, Tensor v_cache,
                    const Tensor& slot_mapping) {
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes(), "key/value: [num_tokens, kv_heads, dim]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
              v_cache.sizes() == k_cache.sizes() && k_cache.size(1) == key.size(1) &&
              k_cache.size(3) == key.size(2), "caches: contiguous [blocks, kv_heads, block_size, dim]");
  TORCH_CHECK(value.scalar_type() == key.scalar_type() && v_cache.scalar_type() == k_cache.scalar_type(),
              "key and value, and the two caches, must share a dtype");
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1, "key/value: each head's dims must be contiguous");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
              slot_mapping.size(0) == key.size(0), "slot_mapping: [num_tokens] int64");
  const int64_t num_tokens = key.size(0), heads = key.size(1), dim = key.size(2);
  const int64_t block_size = k_cache.size(2), num_slots = k_cache.size(0) * block_size;
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t i = 0; i < num_tokens; ++i)
    TORCH_CHECK(slots[i] >= 0 && slots[i] < num_slots, "slot ", slots[i], " is outside the cache");
  TANDEM_DISPATCH_CACHE(key.scalar_type(), k_cache.scalar_type(), "write_kv_cache", [&] {
    const scalar_t* k = key.data_ptr<scalar_t>();
    const scalar_t* v = value.data_ptr<scalar_t>();
    cache_t* kc = static_cast<cache_t*>(k_cache.data_ptr());
    cache_t* vc = static_cast<cache_t*>(v_cache.data_ptr());
    auto put = [&](const scalar_t* src, cache_t* dst) {
      if constexpr (std::is_same_v<cache_t, scalar_t>) {
        std::copy_n(src, dim, dst);
      } else {  // fp8: torch's conversion (nearest even) of the value clamped to +-448 (NaN stays NaN)
        for (int64_t c = 0; c < dim; ++c) dst[c] = cache_t(std::clamp(to_f(src[c]), -kFp8Max, kFp8Max));
      }
    };
    for (int64_t i = 0; i < num_tokens; ++i) {
      const int64_t block = slots[i] / block_size, row = slots[i] % block_size;
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t dst = ((block * heads + h) * block_size + row) * dim;
        put(k + i * key.stride(0) + h * key.stride(1), kc + dst);
        put(v + i * value.stride(0) + h * value.stride(1), vc + dst);
      }
    }
  });
}

// ---- a layer's whole attention, one call ------------------------------------------------

// qkv: [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim] = q | k | v, the fused projection's
// output (rows contiguous). In place: rotary on q and k (when cos_sin_cache is given), then k and
// v written to the cache slots; returns attention over the cache, [num_tokens, num_heads * head_dim].
// The same as rotary_embedding, write_kv_cache and paged_attention in a row, in one op call.
Tensor attention_block(Tensor qkv, const c10::optional<Tensor>& positions, const c10::optional<Tensor>& cos_sin_cache,
                       bool is_neox, Tensor k_cache, Tensor v_cache, const Tensor& slot_mapping,
                       const Tensor& block_tables, const Tensor& seq_lens, const Tensor& query_start_loc,
                       int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double scale) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 &&
              qkv.size(1) == (num_heads + 2 * num_kv_heads) * head_dim,
              "attention_block: qkv must be [num_tokens, (heads + 2 * kv_heads) * head_dim], rows contiguous");
  const int64_t num_tokens = qkv.size(0), q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  Tensor q = qkv.narrow(1, 0, q_size), k = qkv.narrow(1, q_size, kv_size), v = qkv.narrow(1, q_size + kv_size, kv_size);
  if (cos_sin_cache.has_value() && cos_sin_cache->defined()) {
    TORCH_CHECK(positions.has_value() && positions->defined(), "attention_block: rotary needs positions");
    rotary_embedding(*positions, q, k, *cos_sin_cache, head_dim, is_neox);
  }
  write_kv_cache(k.view({num_tokens, num_kv_heads, head_dim}), v.view({num_tokens, num_kv_heads, head_dim}),
                 k_cache, v_cache, slot_mapping);
  return paged_attention(q.view({num_tokens, num_heads, head_dim}), k_cache, v_cache, block_tables, seq_lens,
                         query_start_loc, scale)
      .view({num_tokens, q_size});
}

}  // namespace tandem
