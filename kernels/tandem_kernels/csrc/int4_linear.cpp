// int4_linear: 4-bit weights in 32-wide groups along K, float32 or bf16 activations.
//
// The weight layout holds GGUF's Q4_0 and Q4_1 blocks exactly (tandem_kernels.reference.int4_*):
//     qweight [N, K / 2] uint8   group g of row n is bytes [16 g, 16 g + 16): byte i holds element
//                                32 g + i in its low nibble and 32 g + 16 + i in its high one
//                                (GGUF's own order inside a block)
//     scales  [N, K / 32, 2] fp16 (d, m) per row and group
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
// With AVX-512 the products are fused multiply-adds; elsewhere (e.g. AVX2) the same loops in GCC's
// 16-lane vectors multiply and add apart: the two builds agree with the reference, not bit for bit.

#include "ops.h"
#include "simd.h"

namespace tandem {
namespace {

constexpr int64_t kGroup = 32;        // weights per (d, m) pair along K
constexpr int64_t kGroupBytes = 16;   // two nibbles a byte
constexpr int64_t kRegisterRows = 4;  // up to this many rows: dequantize in registers
constexpr int64_t kPanelRows = 16;    // weight rows dequantized together for more rows of x
constexpr int64_t kTileCols = 4;      // weight rows per tile
constexpr int64_t kPrefetchTiles = 1; // tiles of packed rows asked for ahead (decode)

using vu8x16 = uint8_t __attribute__((vector_size(16)));

// 16 floats: an AVX-512 register where the target has one (intrinsics: GCC keeps __m512
// accumulators in registers, where with its generic vectors it stored each after every update),
// else GCC's 16-lane vectors (two AVX2 registers), multiplied and added apart.
#if defined(__AVX512F__)
using v16 = __m512;
inline v16 zero16() { return _mm512_setzero_ps(); }
inline v16 fma16(v16 a, v16 b, v16 c) { return _mm512_fmadd_ps(a, b, c); }
inline v16 load_x16(const float* p) { return _mm512_loadu_ps(p); }
inline v16 load_x16(const c10::BFloat16* p) {  // bf16 -> float is exact: the bits, 16 places up
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
inline void store_x16(float* p, v16 v) { _mm512_storeu_ps(p, v); }
inline float hsum16(v16 v) { return _mm512_reduce_add_ps(v); }
#else
using v16 = vf16;
inline v16 zero16() { return vf16{}; }
inline v16 fma16(v16 a, v16 b, v16 c) { return a * b + c; }
template <typename T>
inline v16 load_x16(const T* p) { return load16f(p); }
inline void store_x16(float* p, v16 v) { store16(p, v); }
inline float hsum16(v16 v) {
  float s[16];
  std::memcpy(s, &v, sizeof s);
  float t[8];
  for (int i = 0; i < 8; ++i) t[i] = s[i] + s[i + 8];
  return ((t[0] + t[4]) + (t[2] + t[6])) + ((t[1] + t[5]) + (t[3] + t[7]));
}
#endif

inline float half_bits_to_float(uint16_t bits) {
#if defined(__F16C__)
  return _cvtsh_ss(bits);
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

// One group's 32 weights as floats: lo = elements [0, 16), hi = [16, 32).
inline void dequant_group(const uint8_t* q, const uint16_t* dm, v16& lo, v16& hi) {
#if defined(__AVX512F__)
  const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
  uint32_t pair;
  std::memcpy(&pair, dm, sizeof pair);
  const __m128 dm4 = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(pair)));  // d, m, 0, 0
  const __m512 d = _mm512_broadcastss_ps(dm4), m = _mm512_broadcastss_ps(_mm_movehdup_ps(dm4));
  lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(bytes, _mm512_set1_epi32(15))), d, m);
  hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4)), d, m);
#else
  vu8x16 bytes;
  std::memcpy(&bytes, q, sizeof bytes);
  const vi16 wide = __builtin_convertvector(bytes, vi16);
  const float df = half_bits_to_float(dm[0]), mf = half_bits_to_float(dm[1]);
  const vf16 d = vf16{} + df, m = vf16{} + mf;
  lo = __builtin_convertvector(wide & 15, vf16) * d + m;
  hi = __builtin_convertvector(wide >> 4, vf16) * d + m;
#endif
}

// v's floats rounded to bf16 (to nearest even; the weights are finite), as floats.
inline v16 round_bf16(v16 v) {
#if defined(__AVX512F__)
  const __m512i u = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i up = _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  return _mm512_castsi512_ps(_mm512_and_si512(up, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
#else
  return round16<c10::BFloat16>(v);
#endif
}

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

// The weights, packed: row n's group g dequantized in registers.
struct PackedWeights {
  const uint8_t* q;    // [N, K / 2]
  const uint16_t* dm;  // [N, G, 2] fp16 bits
  int64_t groups;
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

// A panel of rows already dequantized: row n (counted from the panel's first, n_first) at w[n * K].
struct FloatPanel {
  const float* w;
  int64_t n_first, k_size;
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
      if constexpr (std::is_same_v<T, c10::BFloat16>) {  // bf16 x: the weights in bf16 too (exact products)
        lo[j] = round_bf16(lo[j]);
        hi[j] = round_bf16(hi[j]);
      }
    }
    for (int i = 0; i < MT; ++i) {
      const T* xr = x + (m0 + i) * x_stride + g * kGroup;
      const v16 xlo = load_x16(xr), xhi = load_x16(xr + 16);
      for (int j = 0; j < NT; ++j) acc[i][j] = fma16(hi[j], xhi, fma16(lo[j], xlo, acc[i][j]));
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

// Weight rows [n0, n1) against rows [m0, m0 + mt): tiles of kTileCols, then single rows.
template <typename T, typename W>
inline void int4_columns(T* out, int64_t n_size, const T* x, int64_t x_stride, const W& w, int64_t groups,
                         const float* bias, int64_t m0, int64_t mt, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + kTileCols <= n1; n += kTileCols)
    int4_rows<kTileCols>(out, n_size, x, x_stride, w, groups, bias, m0, mt, n);
  for (; n < n1; ++n) int4_rows<1>(out, n_size, x, x_stride, w, groups, bias, m0, mt, n);
}

template <typename T>
void int4_linear_impl(T* out, const T* x, int64_t x_stride, int64_t m_size, int64_t k_size,
                      const PackedWeights& w, int64_t n_size, const float* bias) {
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
          store_x16(buf.data() + (n - n0) * k_size + g * kGroup, lo);
          store_x16(buf.data() + (n - n0) * k_size + g * kGroup + 16, hi);
        }
      const FloatPanel panel{buf.data(), n0, k_size};
      for (int64_t m0 = 0; m0 < m_size; m0 += kRegisterRows)
        int4_columns(out, n_size, x, x_stride, panel, groups, bias, m0, std::min(kRegisterRows, m_size - m0), n0, n1);
    }
  });
}

}  // namespace

// out [M, N] (x's dtype) = x [M, K] (float32 or bf16, rows contiguous) @ dequant(qweight, scales)^T
// + bias [N] (any float dtype, or none); qweight [N, K / 2] uint8 and scales [N, K / 32, 2] fp16 as above.
Tensor int4_linear(const Tensor& x, const Tensor& qweight, const Tensor& scales, const c10::optional<Tensor>& bias) {
  check_cpu(x, "x");
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
              x.stride(1) == 1, "int4_linear: x must be float32 or bfloat16 [M, K] with contiguous rows");
  const int64_t m_size = x.size(0), k_size = x.size(1);
  TORCH_CHECK(k_size % kGroup == 0, "int4_linear: K (", k_size, ") must be a multiple of 32");
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kByte && qweight.is_contiguous() &&
              qweight.size(1) * 2 == k_size, "int4_linear: qweight must be contiguous uint8 [N, K / 2]");
  const int64_t n_size = qweight.size(0);
  TORCH_CHECK(scales.dim() == 3 && scales.scalar_type() == at::kHalf && scales.is_contiguous() &&
              scales.size(0) == n_size && scales.size(1) == k_size / kGroup && scales.size(2) == 2,
              "int4_linear: scales must be contiguous float16 [N, K / 32, 2]");
  Tensor bias_f;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == n_size, "int4_linear: bias must have N elements");
    bias_f = bias->to(at::kFloat).contiguous();
  }
  const float* b = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  Tensor out = at::empty({m_size, n_size}, x.options());
  if (m_size == 0 || n_size == 0) return out;
  const PackedWeights w{qweight.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>()),
                        k_size / kGroup};
  if (x.scalar_type() == at::kFloat)
    int4_linear_impl(out.data_ptr<float>(), x.data_ptr<float>(), x.stride(0), m_size, k_size, w, n_size, b);
  else
    int4_linear_impl(out.data_ptr<c10::BFloat16>(), x.data_ptr<c10::BFloat16>(), x.stride(0), m_size, k_size, w,
                     n_size, b);
  return out;
}

}  // namespace tandem
