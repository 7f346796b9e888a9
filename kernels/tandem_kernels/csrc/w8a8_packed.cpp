// w8a8 on a weight packed once at load time (w8a8_pack_weight): the same math as w8a8_linear
// (tandem_kernels.reference.w8a8_linear), laid out so that one vector lane is one output column, not
// a slice of K.
//
// The packed weight: panels of 16 output columns (N padded with zero rows to a multiple of 16),
// each [K / 32 blocks][8 groups of 4 k][16 columns][4 bytes], K padded with zeros to a multiple of
// 32, every byte stored as w + 128 (unsigned, as vpdpbusd's first operand wants):
//
//     panel p:  block 0: [k 0..3 of col 0..15][k 4..7 of col 0..15] ... [k 28..31 of col 0..15]
//               block 1: ...                                    (64 bytes a group, 512 a block)
//
// Three kernels read it, and all give the same bits: per output, the exact int32 sum of each 32-wide
// block's products, then over the blocks in order sum = fma(float(block sum), the row's block scale,
// sum), then sum * scale[n] (+ bias[n]), rounded once to x's dtype. Each output's sum runs over the
// blocks in order whatever M is and whichever tile computes it (batch-invariant); the order differs
// from the portable w8a8_linear's (int8_linear.cpp).
//
// - AVX-512 VNNI: one group is one 64-byte load; 4 activation bytes of a row are broadcast to every
//   lane, and one vpdpbusd adds 4 products to each of 16 columns' int32 sums. The 128 * x the
//   unsigned weights add is -128 * (the block's activation sum) per row and block, computed when x is
//   quantized and where each block's int32 sums start.
// - AVX2 (no VNNI): half a group (8 columns) is one 32-byte load, turned back into the signed
//   weights (xor 128); vpmaddubsw multiplies |w| by the broadcast activations given w's signs
//   (vpsignb), so each product pair fits 16 bits (2 * 127 * 128 < 2^15), and vpmaddwd widens the
//   pairs to the 8 columns' int32 sums.
// - Other targets: the same integer sums in plain loops.

#include <cstdint>

#include "int8_args.h"
#include "ops.h"
#include "simd.h"

namespace tandem {
namespace {

constexpr int64_t kBlock = 32;        // activation block along K (reference.ACTIVATION_BLOCK)
constexpr int64_t kCols = 16;         // output columns per panel: one register of int32 lanes
constexpr int64_t kGroups = kBlock / 4;
constexpr int64_t kBlockBytes = kBlock * kCols;  // one panel's bytes per block

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)

// The activations, quantized for the tiles: per row, K / 32 blocks of 32 bytes (zero-padded), each
// block's scale and the int32 its sums start at (-128 times the sum of its bytes).
struct Activations {
  int64_t blocks = 0;
  std::vector<int8_t> q;       // [M, blocks * 32]
  std::vector<float> scale;    // [M, blocks]
  std::vector<int32_t> start;  // [M, blocks]
};

// Up to 16 values of a float or bf16 row as floats, zeros past n (bf16 -> float is exact).
inline __m512 load_masked(const float* p, int64_t n) {
  return _mm512_maskz_loadu_ps(static_cast<__mmask16>(n >= 16 ? 0xFFFF : (1u << std::max<int64_t>(n, 0)) - 1), p);
}
inline __m512 load_masked(const c10::BFloat16* p, int64_t n) {
  const __mmask16 mask = static_cast<__mmask16>(n >= 16 ? 0xFFFF : (1u << std::max<int64_t>(n, 0)) - 1);
  const __m256i h = _mm256_maskz_loadu_epi16(mask, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// One row by the reference's rule: per block s = max|x| / 127, q = round_half_even(x / s) (0 where s = 0).
template <typename T>
inline void quantize_row(const T* x, int64_t k_size, int64_t blocks, int8_t* q, float* scale, int32_t* start) {
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t k0 = b * kBlock, n = k_size - k0;
    const __m512 x0 = load_masked(x + k0, n), x1 = load_masked(x + k0 + 16, n - 16);
    const float s = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1))) / 127.0f;
    scale[b] = s;
    __m512i q0 = _mm512_setzero_si512(), q1 = _mm512_setzero_si512();
    if (s > 0.0f) {
      const __m512 sv = _mm512_set1_ps(s);
      q0 = _mm512_cvtps_epi32(_mm512_div_ps(x0, sv));  // round half to even (the default mode)
      q1 = _mm512_cvtps_epi32(_mm512_div_ps(x1, sv));
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k0), _mm512_cvtsepi32_epi8(q0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k0 + 16), _mm512_cvtsepi32_epi8(q1));
    start[b] = -128 * _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
  }
}

template <typename T>
void quantize_rows(const T* x, int64_t x_stride, int64_t m_size, int64_t k_size, Activations& a) {
  a.blocks = (k_size + kBlock - 1) / kBlock;
  a.q.resize(m_size * a.blocks * kBlock);
  a.scale.resize(m_size * a.blocks);
  a.start.resize(m_size * a.blocks);
  at::parallel_for(0, m_size, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m)
      quantize_row(x + m * x_stride, k_size, a.blocks, a.q.data() + m * a.blocks * kBlock,
                   a.scale.data() + m * a.blocks, a.start.data() + m * a.blocks);
  });
}

// 16 results of a row into out (float, or bf16 rounded to nearest even as c10 rounds), the first `cols`.
inline void store_row(float* out, __m512 v, int64_t cols) {
  _mm512_mask_storeu_ps(out, static_cast<__mmask16>(cols >= 16 ? 0xFFFF : (1u << cols) - 1), v);
}
inline void store_row(c10::BFloat16* out, __m512 v, int64_t cols) {
  vf16 f;
  std::memcpy(&f, &v, sizeof f);
  c10::BFloat16 tmp[16];
  store16(tmp, round16<c10::BFloat16>(f));
  std::memcpy(out, tmp, std::min<int64_t>(cols, 16) * sizeof(c10::BFloat16));
}

// out[m0 .. m0 + MT, panels p0 .. p0 + NT]: the tile's int32 sums in MT x NT registers, its float
// sums in as many more.
template <int MT, int NT, typename O>
inline void tile(O* out, int64_t n_size, const Activations& a, int64_t m0, const uint8_t* w, int64_t p0,
                 const float* w_scale, const float* bias) {
  const int64_t blocks = a.blocks;
  const uint8_t* panel[NT];
  for (int j = 0; j < NT; ++j) panel[j] = w + (p0 + j) * blocks * kBlockBytes;
  __m512 sum[MT][NT];
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NT; ++j) sum[i][j] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m512i dot[MT][NT];
    const int8_t* xb[MT];
    for (int i = 0; i < MT; ++i) {
      const __m512i start = _mm512_set1_epi32(a.start[(m0 + i) * blocks + b]);
      for (int j = 0; j < NT; ++j) dot[i][j] = start;
      xb[i] = a.q.data() + ((m0 + i) * blocks + b) * kBlock;
    }
    for (int g = 0; g < kGroups; ++g) {
      __m512i wv[NT];
      for (int j = 0; j < NT; ++j) wv[j] = _mm512_loadu_si512(panel[j] + b * kBlockBytes + g * 64);
      for (int i = 0; i < MT; ++i) {
        int32_t four;
        std::memcpy(&four, xb[i] + 4 * g, sizeof four);
        const __m512i xv = _mm512_set1_epi32(four);
        for (int j = 0; j < NT; ++j) dot[i][j] = _mm512_dpbusd_epi32(dot[i][j], wv[j], xv);
      }
    }
    for (int i = 0; i < MT; ++i) {
      const __m512 s = _mm512_set1_ps(a.scale[(m0 + i) * blocks + b]);
      for (int j = 0; j < NT; ++j) sum[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[i][j]), s, sum[i][j]);
    }
  }
  for (int j = 0; j < NT; ++j) {
    const int64_t n0 = (p0 + j) * kCols;
    const __m512 ws = _mm512_loadu_ps(w_scale + n0);
    for (int i = 0; i < MT; ++i) {
      __m512 v = _mm512_mul_ps(sum[i][j], ws);
      if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + n0));
      store_row(out + (m0 + i) * n_size + n0, v, n_size - n0);
    }
  }
}

// Rows [m_begin, m_end) against panels [p0, p0 + NT): 4 rows a tile, then the rest.
template <int NT, typename O>
inline void rows(O* out, int64_t n_size, const Activations& a, int64_t m_begin, int64_t m_end, const uint8_t* w,
                 int64_t p0, const float* w_scale, const float* bias) {
  int64_t m = m_begin;
  for (; m + 4 <= m_end; m += 4) tile<4, NT>(out, n_size, a, m, w, p0, w_scale, bias);
  switch (m_end - m) {
    case 3: tile<3, NT>(out, n_size, a, m, w, p0, w_scale, bias); break;
    case 2: tile<2, NT>(out, n_size, a, m, w, p0, w_scale, bias); break;
    case 1: tile<1, NT>(out, n_size, a, m, w, p0, w_scale, bias); break;
    default: break;
  }
}

template <typename O>
void w8a8_packed(O* out, const Activations& a, int64_t m_size, const uint8_t* w, int64_t n_size,
                 const float* w_scale, const float* bias) {
  // Panels 2 at a time: 4 x 2 tiles hold 16 accumulators and 2 weight registers of 32. Each
  // thread takes whole panel pairs and runs them against 64 rows at a time, so a pair's weights
  // (2 x 16 x K bytes) stay in L1/L2 while the rows pass, and the rows' bytes (64 x K) in L2.
  constexpr int64_t kNT = 2, kRowBlock = 64;
  const int64_t panels = (n_size + kCols - 1) / kCols;
  at::parallel_for(0, (panels + kNT - 1) / kNT, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m0 = 0; m0 < m_size; m0 += kRowBlock) {
      const int64_t m1 = std::min(m_size, m0 + kRowBlock);
      for (int64_t t = begin; t < end; ++t) {
        const int64_t p0 = t * kNT;
        if (p0 + kNT <= panels) {
          rows<kNT>(out, n_size, a, m0, m1, w, p0, w_scale, bias);
        } else {
          for (int64_t p = p0; p < panels; ++p) rows<1>(out, n_size, a, m0, m1, w, p, w_scale, bias);
        }
      }
    }
  });
}

template <typename T>
Tensor run(const Tensor& x, const Tensor& packed, const Tensor& scale, const c10::optional<Tensor>& bias) {
  const int64_t m_size = x.size(0), k_size = x.size(1), n_size = scale.numel();
  const int64_t padded = packed.size(0) * kCols;
  Activations a;
  quantize_rows(x.data_ptr<T>(), x.stride(0), m_size, k_size, a);
  std::vector<float> w_scale(padded, 0.0f);
  std::copy(scale.data_ptr<float>(), scale.data_ptr<float>() + n_size, w_scale.begin());
  const std::vector<float> b = int8_linear_bias("w8a8_linear_packed", bias, n_size, padded);
  Tensor out = at::empty({m_size, n_size}, x.options());
  w8a8_packed(out.data_ptr<T>(), a, m_size, packed.data_ptr<uint8_t>(), n_size, w_scale.data(),
              b.empty() ? nullptr : b.data());
  return out;
}

constexpr bool kHaveVnni = true;
#else
constexpr bool kHaveVnni = false;

// One row by the reference's rule: per block s = max|x| / 127, q = round_half_even(x / s) (0 where
// s = 0), in fp32; q [blocks * 32] zero-padded past K.
template <typename T>
inline void quantize_row(const T* x, int64_t k_size, int64_t blocks, int8_t* q, float* scale) {
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t k0 = b * kBlock, n = std::min(kBlock, k_size - k0);
    float amax = 0.0f;
    for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(static_cast<float>(x[k0 + i])));
    const float s = amax / 127.0f;
    scale[b] = s;
    for (int64_t i = 0; i < kBlock; ++i)
      q[k0 + i] = i < n && s > 0.0f ? static_cast<int8_t>(std::nearbyint(static_cast<float>(x[k0 + i]) / s)) : 0;
  }
}

// x's rows quantized: q [M, blocks * 32], scale [M, blocks].
struct Activations {
  int64_t blocks = 0;
  std::vector<int8_t> q;
  std::vector<float> scale;
};

template <typename T>
void quantize_rows(const T* x, int64_t x_stride, int64_t m_size, int64_t k_size, Activations& a) {
  a.blocks = (k_size + kBlock - 1) / kBlock;
  a.q.resize(m_size * a.blocks * kBlock);
  a.scale.resize(m_size * a.blocks);
  at::parallel_for(0, m_size, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m)
      quantize_row(x + m * x_stride, k_size, a.blocks, a.q.data() + m * a.blocks * kBlock, a.scale.data() + m * a.blocks);
  });
}

constexpr int64_t kHalf = kCols / 2;  // the columns one AVX2 tile computes: half a panel

// out[row, n0 + j] = sum[j] * w_scale[n0 + j] (+ bias), for the columns below N.
template <typename O>
inline void store_columns(O* out, int64_t n_size, int64_t row, int64_t n0, const float* sum, const float* w_scale,
                          const float* bias) {
  for (int64_t j = 0; j < kHalf && n0 + j < n_size; ++j) {
    float v = sum[j] * w_scale[n0 + j];
    if (bias) v += bias[n0 + j];
    out[row * n_size + n0 + j] = static_cast<O>(v);
  }
}

// Rows m0 .. m0 + MT - 1 against halves h0 .. h0 + NH - 1 of panel p (half h: columns 8 h .. 8 h + 7).
#if defined(__AVX2__) && defined(__FMA__)
template <int MT, int NH, typename O>
__attribute__((noinline)) void half_tile(O* out, int64_t n_size, const Activations& a, int64_t m0, const uint8_t* w,
                                         int64_t p, int64_t h0, const float* w_scale, const float* bias) {
  const int64_t blocks = a.blocks;
  const uint8_t* panel = w + p * blocks * kBlockBytes + h0 * 32;
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80)), ones = _mm256_set1_epi16(1);
  __m256 sum[MT][NH];
  for (int i = 0; i < MT; ++i)
    for (int h = 0; h < NH; ++h) sum[i][h] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m256i dot[MT][NH];
    for (int i = 0; i < MT; ++i)
      for (int h = 0; h < NH; ++h) dot[i][h] = _mm256_setzero_si256();
    const int8_t* xb = a.q.data() + (m0 * blocks + b) * kBlock;
    if (NH == 2 || h0 == 0) {  // the panel's stream, 8 blocks (4 KB) ahead: at few rows the loads wait on it
      // As an integer: near the last panel's end the address lies past the buffer (a prefetch never
      // faults, but pointer arithmetic past an array's end is undefined).
      const uintptr_t ahead = reinterpret_cast<uintptr_t>(panel) + (b + 8) * kBlockBytes;
      for (int64_t line = 0; line < kBlockBytes; line += 64) __builtin_prefetch(reinterpret_cast<const void*>(ahead + line));
    }
#pragma GCC unroll 2
    for (int64_t g = 0; g < kGroups; ++g) {
      __m256i wv[NH], mag[NH];
      for (int h = 0; h < NH; ++h) {
        wv[h] = _mm256_xor_si256(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + b * kBlockBytes + g * 64 + h * 32)), flip);
        mag[h] = _mm256_abs_epi8(wv[h]);
      }
      for (int i = 0; i < MT; ++i) {
        int32_t four;
        std::memcpy(&four, xb + i * blocks * kBlock + 4 * g, sizeof four);
        const __m256i xv = _mm256_set1_epi32(four);
        for (int h = 0; h < NH; ++h) {
          const __m256i pairs = _mm256_maddubs_epi16(mag[h], _mm256_sign_epi8(xv, wv[h]));
          dot[i][h] = _mm256_add_epi32(dot[i][h], _mm256_madd_epi16(pairs, ones));
        }
      }
    }
    for (int i = 0; i < MT; ++i) {
      const __m256 s = _mm256_set1_ps(a.scale[(m0 + i) * blocks + b]);
      for (int h = 0; h < NH; ++h) sum[i][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[i][h]), s, sum[i][h]);
    }
  }
  for (int i = 0; i < MT; ++i)
    for (int h = 0; h < NH; ++h) {
      float lanes[kHalf];
      _mm256_storeu_ps(lanes, sum[i][h]);
      store_columns(out, n_size, m0 + i, p * kCols + (h0 + h) * kHalf, lanes, w_scale, bias);
    }
}
#else
template <int MT, int NH, typename O>
void half_tile(O* out, int64_t n_size, const Activations& a, int64_t m0, const uint8_t* w, int64_t p, int64_t h0,
               const float* w_scale, const float* bias) {
  const int64_t blocks = a.blocks;
  for (int64_t h = h0; h < h0 + NH; ++h) {
    const uint8_t* panel = w + p * blocks * kBlockBytes + h * 32;
    for (int i = 0; i < MT; ++i) {
      float sum[kHalf] = {};
      for (int64_t b = 0; b < blocks; ++b) {
        const int8_t* xb = a.q.data() + ((m0 + i) * blocks + b) * kBlock;
        const float s = a.scale[(m0 + i) * blocks + b];
        for (int64_t j = 0; j < kHalf; ++j) {
          int32_t dot = 0;
          for (int64_t g = 0; g < kGroups; ++g)
            for (int t = 0; t < 4; ++t)
              dot += (static_cast<int32_t>(panel[b * kBlockBytes + g * 64 + 4 * j + t]) - 128) * xb[4 * g + t];
          sum[j] = std::fma(static_cast<float>(dot), s, sum[j]);
        }
      }
      store_columns(out, n_size, m0 + i, p * kCols + h * kHalf, sum, w_scale, bias);
    }
  }
}
#endif

// Rows [m0, m1) against panel p: with 4 rows or more, each half in 4-row tiles (and a tail); with
// fewer, both halves at once, so the panel's 64-byte lines are read once, in order.
template <typename O>
void panel_rows(O* out, int64_t n_size, const Activations& a, int64_t m0, int64_t m1, const uint8_t* w, int64_t p,
                const float* w_scale, const float* bias) {
  const bool both = (p + 1) * kCols - kHalf < n_size;  // the second half holds a column below N
  if (m1 - m0 < 4) {
    switch ((m1 - m0) * 2 + both) {
      case 7: half_tile<3, 2>(out, n_size, a, m0, w, p, 0, w_scale, bias); break;
      case 6: half_tile<3, 1>(out, n_size, a, m0, w, p, 0, w_scale, bias); break;
      case 5: half_tile<2, 2>(out, n_size, a, m0, w, p, 0, w_scale, bias); break;
      case 4: half_tile<2, 1>(out, n_size, a, m0, w, p, 0, w_scale, bias); break;
      case 3: half_tile<1, 2>(out, n_size, a, m0, w, p, 0, w_scale, bias); break;
      case 2: half_tile<1, 1>(out, n_size, a, m0, w, p, 0, w_scale, bias); break;
      default: break;
    }
    return;
  }
  for (int64_t h = 0; h < 1 + both; ++h) {
    int64_t m = m0;
    for (; m + 4 <= m1; m += 4) half_tile<4, 1>(out, n_size, a, m, w, p, h, w_scale, bias);
    switch (m1 - m) {
      case 3: half_tile<3, 1>(out, n_size, a, m, w, p, h, w_scale, bias); break;
      case 2: half_tile<2, 1>(out, n_size, a, m, w, p, h, w_scale, bias); break;
      case 1: half_tile<1, 1>(out, n_size, a, m, w, p, h, w_scale, bias); break;
      default: break;
    }
  }
}

template <typename O>
void w8a8_panels(O* out, const Activations& a, int64_t m_size, const uint8_t* w, int64_t n_size,
                 const float* w_scale, const float* bias) {
  // Each thread takes whole panels and runs them against 64 rows at a time, so a panel's weights
  // (16 x K bytes) stay in L1 / L2 while the rows pass, and the rows' bytes (64 x K) in L2. The
  // tiles prefetch only their panel's stream, 4 KB ahead (half_tile): prefetching the next whole
  // panel (as large as L1) made one row 10-30% slower on a Zen 3.
  constexpr int64_t kRowBlock = 64;
  const int64_t panels = (n_size + kCols - 1) / kCols;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m0 = 0; m0 < m_size; m0 += kRowBlock) {
      const int64_t m1 = std::min(m_size, m0 + kRowBlock);
      for (int64_t p = begin; p < end; ++p) {
        panel_rows(out, n_size, a, m0, m1, w, p, w_scale, bias);
      }
    }
  });
}

template <typename T>
Tensor run(const Tensor& x, const Tensor& packed, const Tensor& scale, const c10::optional<Tensor>& bias) {
  const int64_t m_size = x.size(0), k_size = x.size(1), n_size = scale.numel();
  Activations a;
  quantize_rows(x.data_ptr<T>(), x.stride(0), m_size, k_size, a);
  const std::vector<float> b = int8_linear_bias("w8a8_linear_packed", bias, n_size);
  Tensor out = at::empty({m_size, n_size}, x.options());
  w8a8_panels(out.data_ptr<T>(), a, m_size, packed.data_ptr<uint8_t>(), n_size, scale.data_ptr<float>(),
              b.empty() ? nullptr : b.data());
  return out;
}
#endif

}  // namespace

bool w8a8_vnni_available() { return kHaveVnni; }

// weight [N, K] int8 -> uint8 [ceil(N / 16), ceil(K / 32) * 512]: the layout above (w + 128).
Tensor w8a8_pack_weight(const Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kChar, "w8a8_pack_weight: weight must be int8 [N, K]");
  const Tensor w = weight.contiguous();
  const int64_t n_size = w.size(0), k_size = w.size(1);
  const int64_t panels = (n_size + kCols - 1) / kCols, blocks = (k_size + kBlock - 1) / kBlock;
  Tensor packed = at::empty({panels, blocks * kBlockBytes}, w.options().dtype(at::kByte));
  const int8_t* src = w.data_ptr<int8_t>();
  uint8_t* dst = packed.data_ptr<uint8_t>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t b = 0; b < blocks; ++b)
        for (int64_t g = 0; g < kGroups; ++g)
          for (int64_t c = 0; c < kCols; ++c)
            for (int64_t t = 0; t < 4; ++t) {
              const int64_t n = p * kCols + c, k = b * kBlock + g * 4 + t;
              const int8_t v = n < n_size && k < k_size ? src[n * k_size + k] : 0;
              dst[((p * blocks + b) * kGroups + g) * 64 + c * 4 + t] = static_cast<uint8_t>(v + 128);
            }
  });
  return packed;
}

// out [M, N] (x's dtype) = w8a8_linear(x, weight, scale, bias) with weight packed by w8a8_pack_weight.
Tensor w8a8_linear_packed(const Tensor& x, const Tensor& packed, const Tensor& scale,
                          const c10::optional<Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
              x.stride(1) == 1, "w8a8_linear_packed: x must be float32 or bfloat16 [M, K] with contiguous rows");
  const int64_t n_size = scale.numel(), blocks = (x.size(1) + kBlock - 1) / kBlock;
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous(), "w8a8_linear_packed: scale must be float32 [N]");
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
              packed.size(0) == (n_size + kCols - 1) / kCols && packed.size(1) == blocks * kBlockBytes,
              "w8a8_linear_packed: packed must be w8a8_pack_weight of an int8 [N, K] weight, N = scale's size, "
              "K = x's columns");
  if (x.scalar_type() == at::kFloat) return run<float>(x, packed, scale, bias);
  return run<c10::BFloat16>(x, packed, scale, bias);
}

}  // namespace tandem
