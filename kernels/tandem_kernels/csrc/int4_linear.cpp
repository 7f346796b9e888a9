// int4_linear: 4-bit weights in 32-wide groups along K, float32 or bf16 activations.
//
// The weight layout holds GGUF's Q4_0 and Q4_1 blocks exactly (tandem_kernels.reference.int4_*):
//     qweight [N, K / 2] uint8   group g of row n is bytes [16 g, 16 g + 16): byte i holds element
//                                32 g + i in its low nibble and 32 g + 16 + i in its high one
//                                (GGUF's own order inside a block)
//     scales  [N, K / 32, 2] (d, m) per row and group: fp16 (int4), or float32 (int4f: Q4_K's d * sc,
//                                which fp16 cannot hold; gguf_reference.int4f_dequantize)
//     w[n, 32 g + i] = d * q + m, in fp32: d * q is exact (11 + 4 significant bits), so the value is
//     the one rounding of d * q + m, fused or not: Q4_1's d * q + m, and Q4_0's d * (q - 8) with m = -8 d.
//
// Every output is sum_k x[m, k] * w[n, k] in fp32, 16 lanes at a time over K, the lanes summed in a
// fixed tree, plus the bias, rounded once to x's dtype. With bf16 x the weights are rounded to bf16
// first (the model with dequantized weights in the serving dtype), so every product is exact;
// where the CPU has AVX512_BF16, vdpbf16ps sums them (twice the products an instruction of fp32 FMAs). The order depends on K only, never on M: at
// most kRegisterRows rows dequantize each weight group in registers; more rows dequantize a panel
// of kPanelRows weight rows once into a float buffer (in cache) and run the same products over all
// of them, so a prompt does not pay the dequantization M times, and its rows get decode's bits.
//
// With AVX-512 and AVX2 (int4_vec.h) the products are fused multiply-adds; other targets (GCC's
// 16-lane vectors) multiply and add float x's apart. bf16 x's products are exact, fused or not, so
// the builds agree with each other (and the reference) to rounding, not bit for bit.

#include "ops.h"
#include "int4_args.h"
#include "int4_vec.h"

namespace tandem {
namespace {

constexpr int64_t kGroup = 32;        // weights per (d, m) pair along K
constexpr int64_t kGroupBytes = 16;   // two nibbles a byte
constexpr int64_t kRegisterRows = 4;  // up to this many rows: dequantize in registers
constexpr int64_t kPanelRows = 16;    // weight rows dequantized together for more rows of x
constexpr int64_t kTileCols = 4;      // weight rows per tile (decode's unit of work)
#if defined(TANDEM_INT4_AVX2)
// 16 ymm registers: tiles of at most 8 accumulators (MT x NT x 2 halves): 2 weight rows for up to
// 2 rows of x, else 1; and x's rows two at a time over a panel, so its tiles are 2 x 2.
constexpr bool kNarrowTiles = true;
constexpr int64_t kPanelTileRows = 2;
#else
constexpr bool kNarrowTiles = false;
constexpr int64_t kPanelTileRows = kRegisterRows;
#endif
constexpr int64_t kPrefetchTiles = 1; // tiles of packed rows asked for ahead (decode)

#if defined(__AVX512BF16__)
// bf16 activations take vdpbf16ps: each lane adds the exact products of a pair of neighbouring
// elements to its fp32 sum, 32 products an instruction (fp32 FMAs: 16).
constexpr bool kBf16Dot = true;
using vbh = __m512bh;
inline vbh to_bf16_pairs(v16 lo, v16 hi) { return _mm512_cvtne2ps_pbh(hi, lo); }  // elements 0..31 in order
inline vbh load_bf16_pairs(const void* p) { return reinterpret_cast<vbh>(_mm512_loadu_si512(p)); }
#else
constexpr bool kBf16Dot = false;
#endif

// The weights, packed: row n's group g dequantized in registers. S: uint16_t (fp16 bits) or float.
template <typename S>
struct PackedWeights {
  const uint8_t* q;  // [N, K / 2]
  const S* dm;       // [N, G, 2]
  int64_t groups;
  static constexpr bool kRoundInTile = true;  // bf16 x: the tile rounds the weights
  void group(int64_t n, int64_t g, v16& lo, v16& hi) const {
    dequant_group(q + (n * groups + g) * kGroupBytes, dm + (n * groups + g) * 2, lo, hi);
  }
#if defined(__AVX512BF16__)
  vbh group_bf16(int64_t n, int64_t g) const {
    v16 lo, hi;
    group(n, g, lo, hi);
    return to_bf16_pairs(lo, hi);
  }
#endif
};

// A panel of rows already dequantized (and with bf16 x, rounded to bf16 once, on the way in): row n
// (counted from the panel's first, n_first) at w[n * K].
struct FloatPanel {
  const float* w;
  int64_t n_first, k_size;
  static constexpr bool kRoundInTile = false;
  void group(int64_t n, int64_t g, v16& lo, v16& hi) const {
    lo = load_x16(w + (n - n_first) * k_size + g * kGroup);
    hi = load_x16(w + (n - n_first) * k_size + g * kGroup + 16);
  }
};

#if defined(__AVX512BF16__)
// A panel dequantized and rounded to bf16, for the dot-product tiles.
struct Bf16Panel {
  const c10::BFloat16* w;
  int64_t n_first, k_size;
  vbh group_bf16(int64_t n, int64_t g) const { return load_bf16_pairs(w + (n - n_first) * k_size + g * kGroup); }
};

// int4_tile's contract for bf16 x with vdpbf16ps: each output is the fp32 sum of the exact
// products x * bf16(w), in an order that depends on K only.
template <int MT, int NT, typename W>
__attribute__((noinline)) void int4_tile_dot(c10::BFloat16* out, int64_t n_size, const c10::BFloat16* x, int64_t x_stride,
                                             const W& w, int64_t groups, const float* bias, int64_t m0, int64_t n0) {
  __m512 acc[MT][NT];
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NT; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    vbh wv[NT];
    for (int j = 0; j < NT; ++j) wv[j] = w.group_bf16(n0 + j, g);
    for (int i = 0; i < MT; ++i) {
      const vbh xv = load_bf16_pairs(x + (m0 + i) * x_stride + g * kGroup);
      for (int j = 0; j < NT; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], wv[j], xv);
    }
  }
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NT; ++j)
      out[(m0 + i) * n_size + n0 + j] =
          static_cast<c10::BFloat16>(_mm512_reduce_add_ps(acc[i][j]) + (bias ? bias[n0 + j] : 0.0f));
}
#endif

template <typename T>
inline T round_out(float v) {
  if constexpr (std::is_same_v<T, float>) return v;
  else return static_cast<T>(v);  // c10's round to nearest even
}

// out[m, n] for m in [m0, m0 + MT), n in [n0, n0 + NT). Not inlined: inside the panel loop GCC
// stored every accumulator after each update (a store per 2 multiply-adds, 1.6x slower).
template <int MT, int NT, typename T, typename W>
__attribute__((noinline)) void int4_tile(T* out, int64_t n_size, const T* x, int64_t x_stride, const W& w, int64_t groups,
                      const float* bias, int64_t m0, int64_t n0) {
  v16 acc[MT][NT];
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NT; ++j) acc[i][j] = zero16();
  for (int64_t g = 0; g < groups; ++g) {
    v16 lo[NT], hi[NT];
    for (int j = 0; j < NT; ++j) {
      w.group(n0 + j, g, lo[j], hi[j]);
      if constexpr (std::is_same_v<T, c10::BFloat16> && W::kRoundInTile) {  // bf16 x: bf16 weights
        lo[j] = round_bf16(lo[j]);
        hi[j] = round_bf16(hi[j]);
      }
    }
    for (int i = 0; i < MT; ++i) {
      const T* xr = x + (m0 + i) * x_stride + g * kGroup;
      const v16 xlo = load_x16(xr), xhi = load_x16(xr + 16);
      for (int j = 0; j < NT; ++j) {
        if constexpr (std::is_same_v<T, c10::BFloat16>)  // bf16 x bf16 products are exact
          acc[i][j] = fma16_exact(hi[j], xhi, fma16_exact(lo[j], xlo, acc[i][j]));
        else
          acc[i][j] = fma16(hi[j], xhi, fma16(lo[j], xlo, acc[i][j]));
      }
    }
  }
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NT; ++j)
      out[(m0 + i) * n_size + n0 + j] = round_out<T>(hsum16(acc[i][j]) + (bias ? bias[n0 + j] : 0.0f));
}

// Rows [m0, m0 + mt) (mt <= 4) against weight rows [n0, n0 + NT).
template <int NT, typename T, typename W>
inline void int4_rows(T* out, int64_t n_size, const T* x, int64_t x_stride, const W& w, int64_t groups,
                      const float* bias, int64_t m0, int64_t mt, int64_t n0) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    switch (mt) {
      case 4: int4_tile_dot<4, NT>(out, n_size, x, x_stride, w, groups, bias, m0, n0); break;
      case 3: int4_tile_dot<3, NT>(out, n_size, x, x_stride, w, groups, bias, m0, n0); break;
      case 2: int4_tile_dot<2, NT>(out, n_size, x, x_stride, w, groups, bias, m0, n0); break;
      default: int4_tile_dot<1, NT>(out, n_size, x, x_stride, w, groups, bias, m0, n0); break;
    }
  } else  // the generic tiles
#endif
  {
    switch (mt) {
      case 4: int4_tile<4, NT>(out, n_size, x, x_stride, w, groups, bias, m0, n0); break;
      case 3: int4_tile<3, NT>(out, n_size, x, x_stride, w, groups, bias, m0, n0); break;
      case 2: int4_tile<2, NT>(out, n_size, x, x_stride, w, groups, bias, m0, n0); break;
      default: int4_tile<1, NT>(out, n_size, x, x_stride, w, groups, bias, m0, n0); break;
    }
  }
}

// Weight rows [n0, n1) against rows [m0, m0 + mt): tiles (kTileCols wide; narrower on AVX2), then single rows.
template <typename T, typename W>
inline void int4_columns(T* out, int64_t n_size, const T* x, int64_t x_stride, const W& w, int64_t groups,
                         const float* bias, int64_t m0, int64_t mt, int64_t n0, int64_t n1) {
  int64_t n = n0;
  if constexpr (!kNarrowTiles) {
    for (; n + kTileCols <= n1; n += kTileCols)
      int4_rows<kTileCols>(out, n_size, x, x_stride, w, groups, bias, m0, mt, n);
  } else if (mt <= 2) {
    for (; n + 2 <= n1; n += 2) int4_rows<2>(out, n_size, x, x_stride, w, groups, bias, m0, mt, n);
  }
  for (; n < n1; ++n) int4_rows<1>(out, n_size, x, x_stride, w, groups, bias, m0, mt, n);
}

template <typename T, typename S>
void int4_linear_impl(T* out, const T* x, int64_t x_stride, int64_t m_size, int64_t k_size,
                      const PackedWeights<S>& w, int64_t n_size, const float* bias) {
  const int64_t groups = k_size / kGroup;
  if (m_size <= kRegisterRows) {  // decode: every weight group dequantized once, in registers
    const int64_t row_bytes = groups * kGroupBytes;
    at::parallel_for(0, (n_size + kTileCols - 1) / kTileCols, 4, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const int64_t n0 = t * kTileCols, n1 = std::min(n_size, n0 + kTileCols);
        const int64_t ahead = n1 + (kPrefetchTiles - 1) * kTileCols;
        for (int64_t n = ahead; n < std::min(n_size, ahead + kTileCols); ++n) {
          prefetch_run(w.q + n * row_bytes, row_bytes);
          prefetch_run(w.dm + n * groups * 2, groups * 2);
        }
        int4_columns(out, n_size, x, x_stride, w, groups, bias, 0, m_size, n0, n1);
      }
    });
    return;
  }
  // More rows: each thread dequantizes a panel of weight rows into its buffer, then runs every
  // row of x against it, 4 rows at a time (each row's 4 x 16 products share its loads).
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {  // the panel in bf16, for the dot-product tiles
    at::parallel_for(0, (n_size + kPanelRows - 1) / kPanelRows, 1, [&](int64_t begin, int64_t end) {
      std::vector<c10::BFloat16> buf(kPanelRows * k_size);
      for (int64_t p = begin; p < end; ++p) {
        const int64_t n0 = p * kPanelRows, n1 = std::min(n_size, n0 + kPanelRows);
        for (int64_t n = n0; n < n1; ++n)
          for (int64_t g = 0; g < groups; ++g)
            _mm512_storeu_si512(buf.data() + (n - n0) * k_size + g * kGroup,
                                reinterpret_cast<__m512i>(w.group_bf16(n, g)));
        const Bf16Panel panel{buf.data(), n0, k_size};
        for (int64_t m0 = 0; m0 < m_size; m0 += kRegisterRows)
          int4_columns(out, n_size, x, x_stride, panel, groups, bias, m0, std::min(kRegisterRows, m_size - m0), n0, n1);
      }
    });
  } else  // the float panel
#endif
  at::parallel_for(0, (n_size + kPanelRows - 1) / kPanelRows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(kPanelRows * k_size);
    for (int64_t p = begin; p < end; ++p) {
      const int64_t n0 = p * kPanelRows, n1 = std::min(n_size, n0 + kPanelRows);
      for (int64_t n = n0; n < n1; ++n)
        for (int64_t g = 0; g < groups; ++g) {
          v16 lo, hi;
          w.group(n, g, lo, hi);
          if constexpr (std::is_same_v<T, c10::BFloat16>) {  // rounded once here, not in every tile
            lo = round_bf16(lo);
            hi = round_bf16(hi);
          }
          store_x16(buf.data() + (n - n0) * k_size + g * kGroup, lo);
          store_x16(buf.data() + (n - n0) * k_size + g * kGroup + 16, hi);
        }
      const FloatPanel panel{buf.data(), n0, k_size};
      for (int64_t m0 = 0; m0 < m_size; m0 += kPanelTileRows)
        int4_columns(out, n_size, x, x_stride, panel, groups, bias, m0, std::min(kPanelTileRows, m_size - m0), n0, n1);
    }
  });
}

}  // namespace

// out [M, N] (x's dtype) = x [M, K] (float32 or bf16, rows contiguous) @ dequant(qweight, scales)^T
// + bias [N] (any float dtype, or none); qweight [N, K / 2] uint8 and scales [N, K / 32, 2] fp16 or
// float32 as above.
Tensor int4_linear(const Tensor& x, const Tensor& qweight, const Tensor& scales, const c10::optional<Tensor>& bias) {
  return run_int4_linear<PackedWeights>("int4_linear", x, qweight, scales, bias,
                                        [](const auto&... args) { int4_linear_impl(args...); });
}

}  // namespace tandem
