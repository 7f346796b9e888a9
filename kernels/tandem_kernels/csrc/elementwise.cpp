// The row-wise ops: rms_norm and fused_add_rms_norm (HF's rounding order), rotary_embedding (NeoX
// and GPT-J pairing, in place), silu_and_mul (an MLP's gate | up), argmax_rows (greedy sampling).
//
// Norms, SiLU and argmax work on float and bf16 rows 16 lanes at a time (simd.h; SiLU and argmax 8
// at a time without AVX-512), half rows one value at a time; with -ffp-contract=off norms and
// rotary give the fp32 reference's bits.

#include "ops.h"
#include "argmax.h"
#include "simd.h"

namespace tandem {

// ---- norms ------------------------------------------------------------------------

namespace {

// HF's order: normalize in fp32, cast to the dtype, then scale by the weight (in the dtype).
template <typename T>
inline void rms_norm_row(T* out, const T* x, const T* weight, int64_t n, float eps) {
  if constexpr (kWideRows<T> && !kWideNative) {
    // The 16-lane path below in two 8-lane halves (lanes 0..7, 8..15), summed in the same order:
    // without AVX-512 GCC keeps a 16-lane accumulator in memory, ~3x slower.
    vf lo{}, hi{};
    int64_t i = 0;
    for (; i + kLanesWide <= n; i += kLanesWide) {
      const vf a = load8f(x + i), b = load8f(x + i + kLanes);
      lo += a * a;
      hi += b * b;
    }
    float ss = 0.0f;
    for (int j = 0; j < kLanes; ++j) ss += lo[j];
    for (int j = 0; j < kLanes; ++j) ss += hi[j];
    for (; i < n; ++i) ss += to_f(x[i]) * to_f(x[i]);
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
    int64_t k = 0;
    for (; k + kLanes <= n; k += kLanes)
      store8(out + k, round8<T>(load8f(weight + k) * round8<T>(load8f(x + k) * inv)));
    for (; k < n; ++k) out[k] = static_cast<T>(to_f(weight[k]) * to_f(static_cast<T>(to_f(x[k]) * inv)));
    return;
  }
  if constexpr (kWideRows<T>) {
    vf16 acc{};
    int64_t i = 0;
    for (; i + kLanesWide <= n; i += kLanesWide) {
      const vf16 v = load16f(x + i);
      acc += v * v;
    }
    float ss = 0.0f;
    for (int j = 0; j < kLanesWide; ++j) ss += acc[j];
    for (; i < n; ++i) ss += to_f(x[i]) * to_f(x[i]);
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
    int64_t k = 0;
    for (; k + kLanesWide <= n; k += kLanesWide)
      store16(out + k, round16<T>(load16f(weight + k) * round16<T>(load16f(x + k) * inv)));
    for (; k < n; ++k) out[k] = static_cast<T>(to_f(weight[k]) * to_f(static_cast<T>(to_f(x[k]) * inv)));
    return;
  }
  float lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) {
      const float v = to_f(x[i + j]);
      lane[j] += v * v;
    }
  float ss = ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
  for (; i < n; ++i) ss += to_f(x[i]) * to_f(x[i]);
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
  for (int64_t k = 0; k < n; ++k)
    out[k] = static_cast<T>(to_f(weight[k]) * to_f(static_cast<T>(to_f(x[k]) * inv)));
}

void check_rows(const Tensor& t, const Tensor& weight, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1 && t.size(1) == weight.size(0), name,
              ": [num_tokens, hidden] with contiguous rows, hidden = weight's size");
  TORCH_CHECK(t.scalar_type() == weight.scalar_type() && weight.is_contiguous(), name,
              ": weight must be contiguous, of the input's dtype");
}

// residual[0:n] += x[0:n], rounded to T.
template <typename T>
inline void add_row(T* residual, const T* x, int64_t n) {
  int64_t k = 0;
  if constexpr (kWideRows<T> && !kWideNative)
    for (; k + kLanes <= n; k += kLanes)
      store8(residual + k, round8<T>(load8f(x + k) + load8f(residual + k)));
  else if constexpr (kWideRows<T>)
    for (; k + kLanesWide <= n; k += kLanesWide)
      store16(residual + k, round16<T>(load16f(x + k) + load16f(residual + k)));
  for (; k < n; ++k) residual[k] = static_cast<T>(to_f(x[k]) + to_f(residual[k]));
}

}  // namespace

// rms_norm(x) * weight; x: [num_tokens, hidden] -> a new [num_tokens, hidden].
Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps) {
  check_rows(x, weight, "rms_norm");
  Tensor out = at::empty(x.sizes(), x.options());
  TANDEM_DISPATCH(x.scalar_type(), "rms_norm", [&] {
    const int64_t n = x.size(1);
    at::parallel_for(0, x.size(0), 16, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i)
        rms_norm_row(out.data_ptr<scalar_t>() + i * out.stride(0), x.data_ptr<scalar_t>() + i * x.stride(0),
                     weight.data_ptr<scalar_t>(), n, static_cast<float>(eps));
    });
  });
  return out;
}

// In place: residual = x + residual; x = rms_norm(residual) * weight.
void fused_add_rms_norm(Tensor x, Tensor residual, const Tensor& weight, double eps) {
  check_rows(x, weight, "fused_add_rms_norm");
  check_rows(residual, weight, "fused_add_rms_norm");
  TORCH_CHECK(x.size(0) == residual.size(0), "fused_add_rms_norm: x and residual differ in rows");
  TANDEM_DISPATCH(x.scalar_type(), "fused_add_rms_norm", [&] {
    const int64_t n = x.size(1);
    at::parallel_for(0, x.size(0), 16, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        scalar_t* xr = x.data_ptr<scalar_t>() + i * x.stride(0);
        scalar_t* rr = residual.data_ptr<scalar_t>() + i * residual.stride(0);
        add_row(rr, xr, n);
        rms_norm_row(xr, rr, weight.data_ptr<scalar_t>(), n, static_cast<float>(eps));
      }
    });
  });
}

// ---- rotary embedding ---------------------------------------------------------------

namespace {

// In place on query [num_tokens, num_heads * head_dim] and key [num_tokens, num_kv_heads *
// head_dim] (rows may be strided: views into the fused QKV output). cos_sin_cache:
// [max_positions, rotary_dim] fp32 = cos | sin. NeoX pairs dim i with i + rotary_dim / 2,
// GPT-J pairs 2i with 2i + 1.
template <typename T>
inline void rotate_head(T* x, const float* cos, const float* sin, int64_t half, bool is_neox) {
  for (int64_t i = 0; i < half; ++i) {
    const int64_t a = is_neox ? i : 2 * i, b = is_neox ? i + half : 2 * i + 1;
    const float x1 = to_f(x[a]), x2 = to_f(x[b]);
    const float c = cos[i], s = sin[i];
    const float p = x1 * c, q = x2 * s, r = x2 * c, t = x1 * s;  // rounded apart, as the reference
    x[a] = static_cast<T>(p - q);
    x[b] = static_cast<T>(r + t);
  }
}

}  // namespace

void rotary_embedding(const Tensor& positions, Tensor query, Tensor key, const Tensor& cos_sin_cache,
                      int64_t head_dim, bool is_neox) {
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous(), "positions: int64");
  TORCH_CHECK(cos_sin_cache.scalar_type() == at::kFloat && cos_sin_cache.is_contiguous() &&
              cos_sin_cache.dim() == 2, "cos_sin_cache: contiguous fp32 [max_positions, rotary_dim]");
  TORCH_CHECK(query.dim() == 2 && key.dim() == 2 && query.stride(1) == 1 && key.stride(1) == 1 &&
              query.size(0) == positions.size(0) && key.size(0) == positions.size(0) &&
              query.size(1) % head_dim == 0 && key.size(1) % head_dim == 0,
              "query/key: [num_tokens, heads * head_dim] with contiguous rows");
  TORCH_CHECK(query.scalar_type() == key.scalar_type(), "query and key must share a dtype");
  const int64_t rot = cos_sin_cache.size(1), half = rot / 2;
  TORCH_CHECK(rot % 2 == 0 && rot <= head_dim, "rotary_dim must be even and <= head_dim");
  const int64_t num_tokens = positions.size(0), max_pos = cos_sin_cache.size(0);
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t i = 0; i < num_tokens; ++i)
    TORCH_CHECK(pos[i] >= 0 && pos[i] < max_pos, "position ", pos[i], " is outside the rotary table");
  const int64_t q_heads = query.size(1) / head_dim, k_heads = key.size(1) / head_dim;
  TANDEM_DISPATCH(query.scalar_type(), "rotary_embedding", [&] {
    at::parallel_for(0, num_tokens, 16, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const float* cos = cos_sin_cache.data_ptr<float>() + pos[i] * rot;
        const float* sin = cos + half;
        scalar_t* q = query.data_ptr<scalar_t>() + i * query.stride(0);
        scalar_t* k = key.data_ptr<scalar_t>() + i * key.stride(0);
        for (int64_t h = 0; h < q_heads; ++h) rotate_head(q + h * head_dim, cos, sin, half, is_neox);
        for (int64_t h = 0; h < k_heads; ++h) rotate_head(k + h * head_dim, cos, sin, half, is_neox);
      }
    });
  });
}
// ---- activations ----------------------------------------------------------------------

namespace {

// silu of 16 lanes, unrounded: silu16 (exp with fused multiply-adds and vscalefps) where the
// target has AVX-512, else the generic polynomial (-ffp-contract=off keeps it unfused).
inline vf16 silu_wide(vf16 x) {
#if defined(__AVX512F__)
  return silu16(x);
#else
  return x / (1.0f + vexp16(-x));
#endif
}

// x: [num_tokens, 2 * d] = gate | up -> out [num_tokens, d] = silu(gate) * up, silu rounded to
// the dtype first (as F.silu(gate) * up).
template <typename T>
void silu_and_mul_row(T* out, const T* gate, const T* up, int64_t d, float* buf) {
  if constexpr (kWideRows<T> && kWideNative) {  // else the 8-lane path below: the same bits
    int64_t k = 0;
    for (; k + kLanesWide <= d; k += kLanesWide) {
      const vf16 g = load16f(gate + k);
      store16(out + k, round16<T>(round16<T>(silu_wide(g)) * load16f(up + k)));
    }
    for (; k < d; ++k) {
      const float g = to_f(gate[k]);
      out[k] = static_cast<T>(to_f(static_cast<T>(g / (1.0f + exp_scalar(-g)))) * to_f(up[k]));
    }
    return;
  }
  load_row(buf, gate, d);
  int64_t k = 0;
  for (; k + kLanes <= d; k += kLanes) {
    const vf v = vload(buf + k);
    vstore(buf + k, v / (vsplat(1.0f) + vexp(-v)));
  }
  for (; k < d; ++k) buf[k] = buf[k] / (1.0f + exp_scalar(-buf[k]));
  for (k = 0; k < d; ++k) out[k] = static_cast<T>(to_f(static_cast<T>(buf[k])) * to_f(up[k]));
}

}  // namespace

Tensor silu_and_mul(const Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0 && x.stride(1) == 1,
              "silu_and_mul: x must be [num_tokens, 2 * d] with contiguous rows");
  Tensor out = at::empty({x.size(0), x.size(1) / 2}, x.options());
  TANDEM_DISPATCH(x.scalar_type(), "silu_and_mul", [&] {
    const int64_t d = out.size(1);
    at::parallel_for(0, x.size(0), 4, [&](int64_t begin, int64_t end) {
      std::vector<float> buf(d);
      for (int64_t i = begin; i < end; ++i) {
        const scalar_t* g = x.data_ptr<scalar_t>() + i * x.stride(0);
        silu_and_mul_row(out.data_ptr<scalar_t>() + i * d, g, g + d, d, buf.data());
      }
    });
  });
  return out;
}

// ---- greedy sampling --------------------------------------------------------------------

// x [M, N] -> [M] int64: each row's argmax (the first maximum), as x.max(dim=-1).indices.
Tensor argmax_rows(const Tensor& x) {
  check_cpu(x, "argmax_rows");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) > 0,
              "argmax_rows: x must be [rows, n > 0] with contiguous rows");
  Tensor out = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  TANDEM_DISPATCH(x.scalar_type(), "argmax_rows", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    int64_t* op = out.data_ptr<int64_t>();
    at::parallel_for(0, x.size(0), 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) op[i] = argmax_row(xp + i * x.stride(0), x.size(1));
    });
  });
  return out;
}

}  // namespace tandem
