// GGUF weights kept packed (tandem_kernels.gguf_reference), float32 or bf16 activations, in the
// grouped int8 layout (any mix of Q4_0..Q8_0, Q4_K, Q5_K, Q6_K):
//     codes  [N, K] int8             one integer code per weight
//     scales [N, K / 16, 2] float32  (s, m) per row and 16-wide group
// w[n, k] = s * q + m in fp32 (s * q is exact for every GGUF code, so one rounding). (The int4f
// layout, 4-bit codes with fp32 scales, is int4_linear.cpp's with float scales.)
//
// Up to kRegisterRows rows of x (decode), each thread dequantizes 16 weights at a time and adds
// their products to every row's sums. More rows: each thread takes panels of kPanelRows weight rows,
// dequantizes them once into a float buffer, 16 weights at a time as the decode path does (rounded
// to bf16 when x is bf16: the model with dequantized weights in the serving dtype, every product
// exact), then runs every row of x over them in tiles of up to 4 x 4 sums (2 x 2 on AVX2): a prompt
// pays the dequantization once per call, not once per row. Each output is the dot product in 16 fp32
// lanes over K, the lanes summed in a fixed tree, plus the bias, rounded once to x's dtype. The
// order depends on K only, never on M, so a row's result does not depend on the batch it runs in.
// With AVX2 or AVX-512 both paths run in intrinsics with the products fused (int4_vec.h's 16-lane
// vectors); elsewhere in plain loops, multiplied and added apart.
//
// Registered here (TORCH_LIBRARY_FRAGMENT) rather than in registration.cpp: the op is this file's.

#include <torch/library.h>

#include <cstring>
#include <type_traits>
#include <vector>

#include "common.h"
#include "int4_vec.h"
#include "ops.h"

namespace tandem {
namespace {

constexpr int64_t kGroup = 16;
constexpr int64_t kPanelRows = 8;     // weight rows dequantized together for more rows of x
constexpr int64_t kRegisterRows = 4;  // up to this many rows of x: dequantize 16 weights at a time

// The 16 lanes summed in a fixed tree (every path: a row's result never depends on M).
inline float reduce16(float* acc) {
  for (int width = 8; width >= 1; width /= 2) {
    for (int j = 0; j < width; ++j) acc[j] += acc[j + width];
  }
  return acc[0];
}

#if defined(__AVX512F__) || defined(TANDEM_INT4_AVX2)
// In intrinsics (int4_vec.h's v16: lane j holds element j of 16), products fused; both paths below
// sum in the same order, so a row's result still does not depend on M.
#define TANDEM_INT8G_VECTOR 1

inline float reduce_v16(v16 acc) {
  float lanes[16];
  store_x16(lanes, acc);
  return reduce16(lanes);
}

// MT rows of x against NT dequantized weight rows (the panel path's unit): each of the MT x NT
// sums kept in registers, lane j over K's elements j mod 16 in order, then reduce16 (the decode
// path's order, so the same bits).
template <int MT, int NT>
inline void dot16_tile(const float* __restrict x, const float* __restrict w, int64_t k_size,
                       float* __restrict out, int64_t out_stride) {
  v16 acc[MT][NT];
  for (int i = 0; i < MT; ++i) {
    for (int j = 0; j < NT; ++j) acc[i][j] = zero16();
  }
  for (int64_t k = 0; k < k_size; k += 16) {
    v16 wv[NT];
    for (int j = 0; j < NT; ++j) wv[j] = load_x16(w + j * k_size + k);
    for (int i = 0; i < MT; ++i) {
      const v16 xv = load_x16(x + i * k_size + k);
      for (int j = 0; j < NT; ++j) acc[i][j] = fma16(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MT; ++i) {
    for (int j = 0; j < NT; ++j) out[i * out_stride + j] = reduce_v16(acc[i][j]);
  }
}

// The panel path's tiles: up to kTileRows rows of x against up to kTileCols weight rows, every sum in
// a register. AVX-512's 32 registers hold 4 x 4 sums (8 loads per 16 fmas); AVX2's 16 hold 2 x 2 (a
// v16 is two registers there). The shape changes no sum's order: each is dot16_tile's, lane by lane.
#if defined(__AVX512F__)
constexpr int64_t kTileRows = 4, kTileCols = 4;
#else
constexpr int64_t kTileRows = 2, kTileCols = 2;
#endif

// dot16_tile<mt, nt> for mt <= kTileRows, nt <= kTileCols, chosen at run time.
template <int MT = 1, int NT = 1>
inline void dot16_tile_upto(int64_t mt, int64_t nt, const float* x, const float* w, int64_t k_size, float* out,
                            int64_t out_stride) {
  if constexpr (MT < kTileRows) {
    if (mt > MT) return dot16_tile_upto<MT + 1, NT>(mt, nt, x, w, k_size, out, out_stride);
  }
  if constexpr (NT < kTileCols) {
    if (nt > NT) return dot16_tile_upto<MT, NT + 1>(mt, nt, x, w, k_size, out, out_stride);
  }
  dot16_tile<MT, NT>(x, w, k_size, out, out_stride);
}

// 16 codes -> s * q + m, the scalar ``dequantize``'s values (s * q is exact: one rounding either way)
inline v16 dequant16(const int8_t* q, float s, float m) {
  const __m128i codes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
#if defined(__AVX512F__)
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(codes)), _mm512_set1_ps(s), _mm512_set1_ps(m));
#else
  const __m256 vs = _mm256_set1_ps(s), vm = _mm256_set1_ps(m);
  return {_mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(codes)), vs, vm),
          _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(codes, 8))), vs, vm)};
#endif
}

// Decode: weight rows [begin, end) against M rows of x [M, K], 16 weights at a time in registers.
template <int M>
void int8g_rows(const float* __restrict xp, const int8_t* codes, const float* scales, int64_t k_size,
                int64_t n_size, bool to_bf16, int64_t begin, int64_t end, float* __restrict out) {
  for (int64_t n = begin; n < end; ++n) {
    const int8_t* q = codes + n * k_size;
    const float* s = scales + n * (k_size / kGroup) * 2;
    v16 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = zero16();
    for (int64_t k = 0; k < k_size; k += 16, s += 2) {
      v16 w = dequant16(q + k, s[0], s[1]);
      if (to_bf16) w = round_bf16(w);
      for (int m = 0; m < M; ++m) acc[m] = fma16(load_x16(xp + m * k_size + k), w, acc[m]);
    }
    for (int m = 0; m < M; ++m) out[m * n_size + n] = reduce_v16(acc[m]);
  }
}
#else
inline float dot16(const float* __restrict x, const float* __restrict w, int64_t k_size) {
  float acc[16] = {0};
  for (int64_t k = 0; k < k_size; k += 16) {
    for (int j = 0; j < 16; ++j) acc[j] += x[k + j] * w[k + j];
  }
  return reduce16(acc);
}
#endif

// Round to the nearest bf16, ties to even (finite values: GGUF weights are), in bit operations the
// compiler vectorizes: c10::BFloat16's rounding, without its NaN branch.
inline void round_to_bf16(float* __restrict w, int64_t count) {
  for (int64_t k = 0; k < count; ++k) {
    uint32_t bits;
    std::memcpy(&bits, &w[k], 4);
    bits = (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;
    std::memcpy(&w[k], &bits, 4);
  }
}

// One weight row of the int8g layout -> K floats.
struct Int8gRows {
  const int8_t* codes;
  const float* scales;
  int64_t k_size;
  void dequantize(int64_t n, float* __restrict out) const {
    const int8_t* q = codes + n * k_size;
    const float* s = scales + n * (k_size / kGroup) * 2;
    for (int64_t g = 0; g < k_size / kGroup; ++g) {
      const float scale = s[2 * g], min = s[2 * g + 1];
      for (int j = 0; j < kGroup; ++j) out[g * kGroup + j] = static_cast<float>(q[g * kGroup + j]) * scale + min;
    }
  }
#if defined(TANDEM_INT8G_VECTOR)
  // ``dequantize`` (then rounded to bf16 where asked) 16 weights at a time: the same values.
  void dequantize_vector(int64_t n, bool to_bf16, float* __restrict out) const {
    const int8_t* q = codes + n * k_size;
    const float* s = scales + n * (k_size / kGroup) * 2;
    for (int64_t k = 0; k < k_size; k += kGroup, s += 2) {
      const v16 w = dequant16(q + k, s[0], s[1]);
      store_x16(out + k, to_bf16 ? round_bf16(w) : w);
    }
  }
#endif
  // weights [k, k + 16) of row n, k a multiple of 16: the same values as ``dequantize``
  void dequantize16(int64_t n, int64_t k, float* __restrict out) const {
    const int8_t* q = codes + n * k_size + k;
    const float* s = scales + (n * (k_size / kGroup) + k / kGroup) * 2;
    for (int j = 0; j < 16; ++j) out[j] = static_cast<float>(q[j]) * s[0] + s[1];
  }
};

void check_x(const Tensor& x, const char* op, int64_t group) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              op, ": x must be [M, K] float32 or bfloat16");
  TORCH_CHECK(x.size(1) % group == 0, op, ": K (", x.size(1), ") must be a multiple of ", group);
}

// x [M, K] @ rows' weights [N, K]^T + bias -> [M, N] in x's dtype (see the top of the file).
template <typename Rows>
Tensor grouped_linear(const Tensor& x, const Rows& weights, int64_t n_size, const c10::optional<Tensor>& bias,
                      const char* op) {
  const int64_t m_size = x.size(0), k_size = x.size(1);
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == n_size, op, ": bias must have N elements");
  }
  const bool round_bf16 = x.scalar_type() == at::kBFloat16;
  const Tensor xf = x.to(at::kFloat).contiguous();  // [M, K]
  Tensor out = at::empty({m_size, n_size}, x.options().dtype(at::kFloat));
  const float* xp = xf.data_ptr<float>();
  float* op_out = out.data_ptr<float>();
  if (m_size <= kRegisterRows) {  // decode: 16 weights at a time, straight into the sums
#if defined(TANDEM_INT8G_VECTOR)
    at::parallel_for(0, n_size, kPanelRows, [&](int64_t begin, int64_t end) {
      const auto rows = [&](auto m) {
        int8g_rows<decltype(m)::value>(xp, weights.codes, weights.scales, k_size, n_size, round_bf16, begin, end,
                                       op_out);
      };
      switch (m_size) {
        case 1: rows(std::integral_constant<int, 1>{}); break;
        case 2: rows(std::integral_constant<int, 2>{}); break;
        case 3: rows(std::integral_constant<int, 3>{}); break;
        default: rows(std::integral_constant<int, 4>{}); break;
      }
    });
#else
    at::parallel_for(0, n_size, kPanelRows, [&](int64_t begin, int64_t end) {
      for (int64_t n = begin; n < end; ++n) {
        float acc[kRegisterRows][16] = {};
        float w[16];
        for (int64_t k = 0; k < k_size; k += 16) {
          weights.dequantize16(n, k, w);
          if (round_bf16) round_to_bf16(w, 16);
          for (int64_t m = 0; m < m_size; ++m) {
            for (int j = 0; j < 16; ++j) acc[m][j] += xp[m * k_size + k + j] * w[j];
          }
        }
        for (int64_t m = 0; m < m_size; ++m) op_out[m * n_size + n] = reduce16(acc[m]);
      }
    });
#endif
  } else at::parallel_for(0, (n_size + kPanelRows - 1) / kPanelRows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> panel(kPanelRows * k_size);  // [kPanelRows, K] dequantized rows, in cache
    for (int64_t p = begin; p < end; ++p) {
      const int64_t n0 = p * kPanelRows, rows = std::min(kPanelRows, n_size - n0);
      for (int64_t r = 0; r < rows; ++r) {
#if defined(TANDEM_INT8G_VECTOR)
        weights.dequantize_vector(n0 + r, round_bf16, panel.data() + r * k_size);
#else
        weights.dequantize(n0 + r, panel.data() + r * k_size);
        if (round_bf16) round_to_bf16(panel.data() + r * k_size, k_size);
#endif
      }
#if defined(TANDEM_INT8G_VECTOR)
      for (int64_t m = 0; m < m_size; m += kTileRows) {  // tiles: every sum in a register, loads shared
        for (int64_t r = 0; r < rows; r += kTileCols) {
          dot16_tile_upto(std::min(kTileRows, m_size - m), std::min(kTileCols, rows - r), xp + m * k_size,
                          panel.data() + r * k_size, k_size, op_out + m * n_size + n0 + r, n_size);
        }
      }
#else
      for (int64_t m = 0; m < m_size; ++m) {
        for (int64_t r = 0; r < rows; ++r) {
          op_out[m * n_size + n0 + r] = dot16(xp + m * k_size, panel.data() + r * k_size, k_size);
        }
      }
#endif
    }
  });
  if (bias.has_value()) out.add_(bias->to(at::kFloat).view({1, n_size}));
  return out.to(x.scalar_type());
}

Tensor gguf_int8g_linear(const Tensor& x, const Tensor& codes, const Tensor& scales, const c10::optional<Tensor>& bias) {
  check_x(x, "gguf_int8g_linear", kGroup);
  const int64_t k_size = x.size(1), n_size = codes.size(0);
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kChar && codes.is_contiguous() && codes.size(1) == k_size,
              "gguf_int8g_linear: codes must be contiguous [N, K] int8");
  TORCH_CHECK(scales.dim() == 3 && scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  scales.size(0) == n_size && scales.size(1) == k_size / kGroup && scales.size(2) == 2,
              "gguf_int8g_linear: scales must be contiguous [N, K / 16, 2] float32");
  return grouped_linear(x, Int8gRows{codes.data_ptr<int8_t>(), scales.data_ptr<float>(), k_size}, n_size, bias,
                        "gguf_int8g_linear");
}

}  // namespace
}  // namespace tandem

TORCH_LIBRARY_FRAGMENT(tandem_cpu, m) {
  m.def("gguf_int8g_linear(Tensor x, Tensor codes, Tensor scales, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(tandem_cpu, CPU, m) {
  m.impl("gguf_int8g_linear", &tandem::gguf_int8g_linear);
}
