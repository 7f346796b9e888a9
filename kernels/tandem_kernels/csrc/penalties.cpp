// apply_penalties: repetition, frequency and presence penalties on sampling rows, in place, in one
// pass over each row, from the runner's per-sequence token tables (backend/worker/penalty_history.py).
// penalized_argmax: the same penalties, then each row's greedy token, in one call that leaves the
// logits as they are and can count the tokens in the tables (a greedy step with penalties).
// The twins are kernels/tandem_kernels/reference.py's; with -ffp-contract=off every value is
// rounded as the twins round it, so the results are bit-equal.

#include <algorithm>
#include <vector>

#include "ops.h"
#include "argmax.h"
#include "common.h"
#include "simd.h"

namespace tandem {

namespace {

using vb8 = uint8_t __attribute__((vector_size(8)));

// seen[0:8] (bytes 0/1) widened to 8 int32 lanes: one vpmovzxbd with AVX2 (GCC's generic
// conversion extracts and inserts the bytes one by one, most of the row's time).
inline vi widen8(const uint8_t* seen) {
#if defined(__AVX2__)
  const __m256i wide = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(seen)));
  vi out;
  std::memcpy(&out, &wide, sizeof out);
  return out;
#else
  vb8 s8;
  std::memcpy(&s8, seen, sizeof s8);
  return __builtin_convertvector(s8, vi);
#endif
}

// One row, vocab tokens: out[v] = in[v] penalized from seen[v] (0/1) and count[v] (>= 0), as the
// header says (in may be out). Explicit 8-lane vectors: GCC keeps the plain loop scalar (under its
// default -ftrapping-math it will not turn the float compare and division into a select), ~10x
// slower on an AVX2 CPU. Lane for lane the scalar tail's arithmetic, so the two agree bit for bit.
template <bool kRepeat>
inline void penalize_row(float* out, const float* in, const uint8_t* seen, const int32_t* count, int64_t vocab,
                         float rep, float freq, float pres) {
  const vf rep_v = vsplat(rep), freq_v = vsplat(freq), pres_v = vsplat(pres), one = vsplat(1.0f), zero{};
  int64_t v = 0;
  for (; v + kLanes <= vocab; v += kLanes) {
    vi c;
    std::memcpy(&c, count + v, sizeof c);
    vf value = vload(in + v);
    if constexpr (kRepeat) {
      const vi hit = widen8(seen + v) | c;  // nonzero: in the prompt or the outputs
      const vf shrunk = value > zero ? value / rep_v : value * rep_v;
      value = hit != 0 ? shrunk : value;
    }
    const vf present = c > 0 ? one : zero;
    vstore(out + v, (value - freq_v * __builtin_convertvector(c, vf)) - pres_v * present);
  }
  for (; v < vocab; ++v) {
    const int32_t c = count[v];
    float value = in[v];
    if (kRepeat && (seen[v] != 0 || c > 0)) value = value > 0.0f ? value / rep : value * rep;
    out[v] = (value - freq * static_cast<float>(c)) - pres * (c > 0 ? 1.0f : 0.0f);
  }
}

// The tables and per-row arguments of both ops, against logits [R, V] (checked by the caller).
void check_tables(const Tensor& logits, const Tensor& rows, const Tensor& prompt_seen, const Tensor& output_counts,
                  const Tensor& slots, const Tensor& repetition, const Tensor& frequency, const Tensor& presence,
                  const char* name) {
  const int64_t vocab = logits.size(1), n = rows.numel();
  TORCH_CHECK(prompt_seen.scalar_type() == at::kBool && prompt_seen.is_contiguous() && prompt_seen.dim() == 2 &&
                  prompt_seen.size(1) == vocab,
              name, ": prompt_seen must be contiguous bool [slots, vocab]");
  TORCH_CHECK(output_counts.scalar_type() == at::kInt && output_counts.is_contiguous() &&
                  output_counts.sizes() == prompt_seen.sizes(),
              name, ": output_counts must be contiguous int32, prompt_seen's shape");
  for (const Tensor* t : {&rows, &slots})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->numel() == n,
                name, ": rows and slots must be contiguous int64 [n]");
  for (const Tensor* t : {&repetition, &frequency, &presence})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == n,
                name, ": repetition, frequency and presence must be contiguous float32 [n]");
  const int64_t* row_p = rows.data_ptr<int64_t>();
  const int64_t* slot_p = slots.data_ptr<int64_t>();
  for (int64_t j = 0; j < n; ++j) {
    TORCH_CHECK(row_p[j] >= 0 && row_p[j] < logits.size(0), name, ": a row is out of range");
    TORCH_CHECK(slot_p[j] >= 0 && slot_p[j] < prompt_seen.size(0), name, ": a slot is out of range");
  }
}

// out [vocab] float32 = in [vocab] with row j's penalties (in may be out).
inline void penalize(float* out, const float* in, int64_t j, const int64_t* slot_p, const bool* seen_p,
                     const int32_t* count_p, int64_t vocab, const float* rep_p, const float* freq_p,
                     const float* pres_p) {
  const uint8_t* seen = reinterpret_cast<const uint8_t*>(seen_p) + slot_p[j] * vocab;
  const int32_t* count = count_p + slot_p[j] * vocab;
  if (rep_p[j] != 1.0f)
    penalize_row<true>(out, in, seen, count, vocab, rep_p[j], freq_p[j], pres_p[j]);
  else
    penalize_row<false>(out, in, seen, count, vocab, rep_p[j], freq_p[j], pres_p[j]);
}

// A logits row as float32: a float row itself (read in place), any other copied to scratch [n] (exactly).
template <typename T>
inline const float* float_row(const T* x, float* scratch, int64_t n) {
  load_row(scratch, x, n);
  return scratch;
}
inline const float* float_row(const float* x, float*, int64_t) { return x; }

}  // namespace

// logits [R, V] float32 (rows contiguous), for j < n: logits[rows[j]] is penalized from table
// slot slots[j] of prompt_seen [S, V] bool and output_counts [S, V] int32 with repetition[j],
// frequency[j] and presence[j] (float32 [n] each). Per token v of the row, with c the count:
//   if (prompt_seen or c > 0) and repetition != 1:  x = x > 0 ? x / repetition : x * repetition
//   x = (x - frequency * c) - presence * (c > 0)
void apply_penalties(Tensor logits, const Tensor& rows, const Tensor& prompt_seen, const Tensor& output_counts,
                     const Tensor& slots, const Tensor& repetition, const Tensor& frequency,
                     const Tensor& presence) {
  check_cpu(logits, "apply_penalties");
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.dim() == 2 && logits.stride(1) == 1,
              "apply_penalties: logits must be float32 [rows, vocab] with contiguous rows");
  check_tables(logits, rows, prompt_seen, output_counts, slots, repetition, frequency, presence, "apply_penalties");
  const int64_t vocab = logits.size(1), n = rows.numel();
  const int64_t* row_p = rows.data_ptr<int64_t>();
  const int64_t* slot_p = slots.data_ptr<int64_t>();
  float* out = logits.data_ptr<float>();
  const int64_t out_stride = logits.stride(0);
  const bool* seen_p = prompt_seen.data_ptr<bool>();
  const int32_t* count_p = output_counts.data_ptr<int32_t>();
  const float* rep_p = repetition.data_ptr<float>();
  const float* freq_p = frequency.data_ptr<float>();
  const float* pres_p = presence.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(vocab, 1));
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j)
      penalize(out + row_p[j] * out_stride, out + row_p[j] * out_stride, j, slot_p, seen_p, count_p, vocab, rep_p,
               freq_p, pres_p);
  });
}

// logits [R, V] float32 or bf16 (rows contiguous; not modified) -> [R] int64: each row's first
// maximum (argmax_rows'), taken after apply_penalties' penalties on rows[j] from slot slots[j] (the
// other rows as they are): a penalized row is penalized into a float32 scratch row (bf16 rows first
// copied there, exactly), and its maximum taken there. With count, each rows[j]'s token is then added to
// output_counts[slots[j]] (as index_put_ with accumulate would: a slot serving two rows gets both).
Tensor penalized_argmax(const Tensor& logits, const Tensor& rows, const Tensor& prompt_seen, Tensor output_counts,
                        const Tensor& slots, const Tensor& repetition, const Tensor& frequency,
                        const Tensor& presence, bool count) {
  check_cpu(logits, "penalized_argmax");
  TORCH_CHECK((logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16) && logits.dim() == 2 &&
                  logits.stride(1) == 1 && logits.size(1) > 0,
              "penalized_argmax: logits must be float32 or bf16 [rows, vocab > 0] with contiguous rows");
  check_tables(logits, rows, prompt_seen, output_counts, slots, repetition, frequency, presence, "penalized_argmax");
  const int64_t num_rows = logits.size(0), vocab = logits.size(1), n = rows.numel();
  const int64_t* row_p = rows.data_ptr<int64_t>();
  const int64_t* slot_p = slots.data_ptr<int64_t>();
  std::vector<int64_t> penalty_of(num_rows, -1);  // logits row -> its j in rows (the last, if listed twice)
  for (int64_t j = 0; j < n; ++j) penalty_of[row_p[j]] = j;
  TORCH_CHECK(n == 0 || std::count_if(penalty_of.begin(), penalty_of.end(), [](int64_t j) { return j >= 0; }) == n,
              "penalized_argmax: a row is listed twice");
  Tensor tokens = at::empty({num_rows}, logits.options().dtype(at::kLong));
  int64_t* token_p = tokens.data_ptr<int64_t>();
  const bool* seen_p = prompt_seen.data_ptr<bool>();
  const int32_t* count_p = output_counts.data_ptr<int32_t>();
  const float* rep_p = repetition.data_ptr<float>();
  const float* freq_p = frequency.data_ptr<float>();
  const float* pres_p = presence.data_ptr<float>();
  TANDEM_DISPATCH(logits.scalar_type(), "penalized_argmax", [&] {
    const scalar_t* x = logits.data_ptr<scalar_t>();
    const int64_t stride = logits.stride(0);
    const int64_t grain = std::max<int64_t>(1, 32768 / vocab);
    at::parallel_for(0, num_rows, grain, [&](int64_t begin, int64_t end) {
      std::vector<float> scratch(vocab);  // [vocab] float32: one penalized row at a time
      for (int64_t i = begin; i < end; ++i) {
        const int64_t j = penalty_of[i];
        if (j < 0) {
          token_p[i] = argmax_row(x + i * stride, vocab);
          continue;
        }
        const float* row = float_row(x + i * stride, scratch.data(), vocab);
        penalize(scratch.data(), row, j, slot_p, seen_p, count_p, vocab, rep_p, freq_p, pres_p);
        token_p[i] = argmax_row(scratch.data(), vocab);
      }
    });
  });
  if (count) {  // after every row is penalized: no row sees another's token of this step
    int32_t* counts = output_counts.data_ptr<int32_t>();
    for (int64_t j = 0; j < n; ++j) counts[slot_p[j] * vocab + token_p[row_p[j]]] += 1;
  }
  return tokens;
}

}  // namespace tandem
