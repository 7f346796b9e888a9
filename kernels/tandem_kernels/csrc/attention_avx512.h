// Paged attention's AVX-512 kernel (attend_one_avx512), or, on other targets, a stub that
// attention.cpp never calls (kHaveAttendAvx512 false).
//
// It does attend_one's work (attention_portable.h) for one query token and one or all of its KV
// heads, 16 lanes wide, reading the cache's rows where they are (no float copy of a block). QK: 4
// key rows at a time against up to 4 query heads (each key vector loaded once for the heads that
// share it), one transposing reduction per 4 rows; bf16 caches multiply bf16 pairs directly
// (vdpbf16ps), others convert 16 values at a time and use fused multiply-adds. V: the accumulators
// of up to 4 heads x CH 16-wide column chunks stay in registers over all of the item's blocks.
// While it reads block b of K it prefetches block b of V (needed next) and block b of the next
// item's K: without the prefetches the loads wait on memory (batch-32 attention of the default
// model 14 ms instead of 6).
#pragma once

#include "attention_avx512_tiles.h"

namespace tandem {
namespace {

#if defined(__AVX512F__)
// attend_one's contract for KV heads [kvh0, kvh1) of one query token (the `group` query heads of
// each), head_dim a multiple of 16. QK goes block by block, each block's heads in turn, so a block's
// K is read in address order; then softmax and V head by head. next_table / next_blocks / next_kvh0:
// the work item after this one (null / 0: none; the same number of KV heads), whose K blocks are
// prefetched while this one runs.
template <typename T, typename C>
void attend_one_avx512(T* out, const T* query, const C* k_cache, const C* v_cache, const int32_t* table,
                       int64_t len, int64_t kvh0, int64_t kvh1, int64_t group, int64_t d, int64_t block_size,
                       int64_t num_kv_heads, float scale, const int32_t* next_table, int64_t next_blocks,
                       int64_t next_kvh0, std::vector<float>& scratch) {
  const int64_t run = block_size * d;  // one (block, KV head)
  const int64_t block_stride = num_kv_heads * run;
  const int64_t heads = (kvh1 - kvh0) * group;  // query heads of this item
  auto k_run = [&](const int32_t* tab, int64_t b, int64_t head) { return k_cache + tab[b] * block_stride + head * run; };
  const int64_t pair_stride = (len + 1) / 2;  // bf16 pairs of probabilities per head
  scratch.resize(heads * len + 2 * heads * d + heads + heads * pair_stride);
  float* scores = scratch.data();    // [heads, len]: scores, then exp(score - max)
  float* q = scores + heads * len;   // [heads, d]: the heads as floats (FmaQk)
  float* acc = q + heads * d;        // [heads, d]: sum over keys of exp(score - max) * v
  float* sums = acc + heads * d;     // [heads]: sum over keys of exp(score - max)
  uint32_t* pairs = reinterpret_cast<uint32_t*>(sums + heads);  // [heads, pair_stride]: (pv_pairs_tile)
  const T* queries = query + kvh0 * group * d;  // [heads, d]
  const int64_t num_blocks = (len + block_size - 1) / block_size;
  const int64_t row_bytes = d * static_cast<int64_t>(sizeof(C));
  // make_qk(h): the QK tiles of the item's h-th KV head.
  auto qk_blocks = [&](const auto& make_qk) {
    for (int64_t b = 0; b < num_blocks; ++b) {
      const int64_t t0 = b * block_size, n = std::min(block_size, len - t0);
      for (int64_t h = 0; h < kvh1 - kvh0; ++h) {
        const C* v_now = v_cache + table[b] * block_stride + (kvh0 + h) * run;
        const C* k_next = b < next_blocks ? k_run(next_table, b, next_kvh0 + h) : nullptr;
        qk_rows16(make_qk(h), scores + h * group * len + t0, len, k_run(table, b, kvh0 + h), n, group, d,
                  reinterpret_cast<const char*>(v_now), reinterpret_cast<const char*>(k_next), row_bytes);
      }
    }
  };
  bool done = false;
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16> && std::is_same_v<C, c10::BFloat16>)
    if (d % 32 == 0) {
      qk_blocks([&](int64_t h) { return Bf16Qk{queries + h * group * d, d, scale}; });
      done = true;
    }
#if defined(__AVX512VBMI__)
  if constexpr (std::is_same_v<T, c10::BFloat16> && std::is_same_v<C, c10::Float8_e4m3fn>)
    if (d % 64 == 0) {
      c10::BFloat16* qp = reinterpret_cast<c10::BFloat16*>(q);  // [heads, d] bf16 in q's room
      fp8_qk_heads(qp, queries, heads, d);
      qk_blocks([&](int64_t h) { return Fp8Bf16Qk{qp + h * group * d, d, scale}; });
      done = true;
    }
#endif
#endif
  if (!done) {
    for (int64_t i = 0; i < heads * d; ++i) q[i] = to_f(queries[i]);
    qk_blocks([&](int64_t h) { return FmaQk<C>{q + h * group * d, d, scale * kLoadUnit<C>}; });
  }
  for (int64_t b = num_blocks; b < next_blocks; ++b)
    for (int64_t h = 0; h < kvh1 - kvh0; ++h) prefetch_run(k_run(next_table, b, next_kvh0 + h), run);
  for (int64_t g = 0; g < heads; ++g) {  // softmax, normalized at the end
    float* s = scores + g * len;
    sums[g] = exp_shifted16(s, len, max_of(s, len));
  }
  // pv(head_off, g, ng) for every 4 query heads [g, g + ng) of the item: V at head_off inside a block
  // (their KV head's run) into them.
  auto for_each_head_tile = [&](const auto& pv) {
    for (int64_t h = 0; h < kvh1 - kvh0; ++h)
      for (int64_t g = h * group; g < (h + 1) * group; g += 4)
        pv((kvh0 + h) * run, g, std::min<int64_t>(4, (h + 1) * group - g));
  };
  bool chunks_done = false;  // V summed by the bf16-pair path (which widens V exactly)
  float v_unit = kLoadUnit<C>;  // acc's unit: load16's
  const int64_t chunks = d / kLanesWide;
#if defined(__AVX512BF16__)
  auto pv_pairs = [&](const auto& rows) {  // every column in passes of rows.kCols (d a multiple of it)
    for (int64_t g = 0; g < heads; ++g)
      to_bf16_pairs(reinterpret_cast<uint16_t*>(pairs + g * pair_stride), scores + g * len, len);
    for_each_head_tile([&](int64_t head_off, int64_t g, int64_t ng) {
      for (int64_t c = 0; c < d; c += rows.kCols)
        pv_pairs_heads(rows, acc + g * d, pairs + g * pair_stride, pair_stride, len, v_cache, table, block_stride,
                       head_off, block_size, d, c, ng);
    });
    chunks_done = true;
    v_unit = 1.0f;
  };
  if (std::is_same_v<T, c10::BFloat16> && block_size % 2 == 0) {  // probabilities in bf16: bf16 models only
    if constexpr (std::is_same_v<C, c10::BFloat16>) {
      if (d % 64 == 0) pv_pairs(Bf16Rows<2>{});
      else if (d % 32 == 0) pv_pairs(Bf16Rows<1>{});
    }
#if defined(__AVX512VBMI__)
    if constexpr (std::is_same_v<C, c10::Float8_e4m3fn>)
      if (d % 64 == 0) pv_pairs(Fp8Rows{});
#endif
  }
#endif
  if (!chunks_done)
    for_each_head_tile([&](int64_t head_off, int64_t g, int64_t ng) {
      int64_t c = 0;
      for (; c + 4 <= chunks; c += 4)
        pv_heads16<4>(acc + g * d, scores + g * len, len, v_cache, table, block_stride, head_off, block_size, d,
                      c * kLanesWide, ng);
      for (; c < chunks; ++c)
        pv_heads16<1>(acc + g * d, scores + g * len, len, v_cache, table, block_stride, head_off, block_size, d,
                      c * kLanesWide, ng);
    });
  for (int64_t g = 0; g < heads; ++g) {
    const float inv_sum = v_unit / sums[g];
    T* dst = out + kvh0 * group * d + g * d;
    for (int64_t c = 0; c < d; ++c) dst[c] = static_cast<T>(acc[g * d + c] * inv_sum);
  }
}
constexpr bool kHaveAttendAvx512 = true;
#else
template <typename T, typename C>
void attend_one_avx512(T*, const T*, const C*, const C*, const int32_t*, int64_t, int64_t, int64_t, int64_t,
                       int64_t, int64_t, int64_t, float, const int32_t*, int64_t, int64_t, std::vector<float>&) {}
constexpr bool kHaveAttendAvx512 = false;
#endif

}  // namespace
}  // namespace tandem
