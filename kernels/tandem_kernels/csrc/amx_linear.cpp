// bf16 linear layers on AMX tiles (Intel Sapphire Rapids and later); registered in registration.cpp.
//
//     y [M, N] = x [M, K] @ w [N, K]^T (+ bias [N]),  bf16 in and out, products exact, sums fp32
//     y [M, d] = silu(x @ gate^T) * (x @ up^T)        amx_gated_linear: an MLP's gate | up with its
//                                                     SiLU in the epilogue (no [M, 2d] round trip)
//
// A decode step's matmuls stream every weight once from memory: at batch 32 oneDNN's AMX kernel
// read them at ~14 GB/s here, this one at ~20 (the step's 268 MB: 19.5 -> 13.4 ms, bench/README).
// What differs: the weight is packed once so that each thread's share is one sequential stream
// of tiles, prefetched ahead, and each 32-column panel is multiplied by every 32-row chunk of x
// while it is in cache.
//
// Packed weight [N/32, K/32, 2, 16, 32] bf16 (N and K padded to 32 with zeros): for 32 output
// columns (nb) and 32 input dims (kc), two tiles in AMX's B layout, one per 16 columns (t):
//     row p, words 2n + e  =  w[32 nb + 16 t + n][32 kc + 2 p + e]
// Tiles: C 0-3 (the 32 x 32 fp32 result: rows 0-15 / 16-31 by columns 0-15 / 16-31), A 4-5 (x's
// two 16-row halves, 32 dims), B 6-7. x is padded with zero rows to a multiple of 32.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>

#include <algorithm>

#include "avx512_math.h"
#include "ops.h"
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define TANDEM_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace tandem {
namespace {

constexpr int64_t kBlock = 32;        // output columns per panel, input dims per chunk, x rows per chunk
constexpr int64_t kTileWords = 512;   // one 16 x 32 bf16 tile
constexpr int64_t kPanelGroup = 8;    // panels multiplied by each x chunk in turn (8 x 2 KB x K/32: in L2)
constexpr int64_t kPrefetchBytes = 4096;  // how far ahead of its tiles a thread prefetches the weight

#if TANDEM_AMX
// Linux hands a process the tile registers only once it asks (arch_prctl); asked once.
bool amx_granted() {
  static const bool granted = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return granted;
}

// All 8 tiles as 16 rows x 64 bytes while alive; released after, so no tile state outlives a call
// (oneDNN configures its own at each of its calls).
struct Tiles {
  Tiles() {
    alignas(64) uint8_t cfg[64] = {};
    cfg[0] = 1;  // palette 1
    for (int t = 0; t < 8; ++t) {
      cfg[16 + 2 * t] = 64;  // bytes per row
      cfg[48 + t] = 16;      // rows
    }
    _tile_loadconfig(cfg);
  }
  ~Tiles() { _tile_release(); }
  Tiles(const Tiles&) = delete;
  Tiles& operator=(const Tiles&) = delete;
};

// y rows [m0, m0 + rows) x panel nb's valid columns from C (c [32, 32] fp32), plus bias, to bf16.
void store_panel(c10::BFloat16* y, const float* c, const c10::BFloat16* bias, int64_t m0, int64_t rows,
                 int64_t nb, int64_t n_size) {
  const int64_t n0 = nb * kBlock, cols = std::min(kBlock, n_size - n0);
  alignas(64) float b[kBlock] = {};
  if (bias)
    for (int64_t j = 0; j < cols; ++j) b[j] = static_cast<float>(bias[n0 + j]);
  const __m512 b_lo = _mm512_load_ps(b), b_hi = _mm512_load_ps(b + 16);
  for (int64_t r = 0; r < rows; ++r) {
    c10::BFloat16* dst = y + (m0 + r) * n_size + n0;
    const __m512 lo = _mm512_add_ps(_mm512_load_ps(c + r * kBlock), b_lo);
    const __m512 hi = _mm512_add_ps(_mm512_load_ps(c + r * kBlock + 16), b_hi);
    const __m512i words = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);  // nearest even
    _mm512_mask_storeu_epi16(dst, static_cast<__mmask32>(cols == kBlock ? ~0u : (1u << cols) - 1), words);
  }
}

// c [32, 32] fp32 = x rows [m0, m0 + 32) (a: rows of k_pad bf16) @ panel nb of the packed weight w
// (chunks of 32 input dims); prefetch: the panel comes from memory, so its tiles are prefetched
// kPrefetchBytes ahead. Needs the Tiles configuration.
inline void multiply_panel(float* c, const c10::BFloat16* a, int64_t k_pad, int64_t m0, const c10::BFloat16* w,
                           int64_t nb, int64_t chunks, bool prefetch) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t kc = 0; kc < chunks; ++kc) {
    const c10::BFloat16* bt = w + (nb * chunks + kc) * 2 * kTileWords;
    if (prefetch) {
      const char* ahead = reinterpret_cast<const char*>(bt) + kPrefetchBytes;
      for (int64_t line = 0; line < 2 * kTileWords * 2; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
    }
    _tile_loadd(6, bt, 64);
    _tile_loadd(7, bt + kTileWords, 64);
    _tile_loadd(4, a + m0 * k_pad + kc * kBlock, k_pad * 2);
    _tile_loadd(5, a + (m0 + 16) * k_pad + kc * kBlock, k_pad * 2);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, c, kBlock * 4);
  _tile_stored(1, c + 16, kBlock * 4);
  _tile_stored(2, c + 16 * kBlock, kBlock * 4);
  _tile_stored(3, c + 16 * kBlock + 16, kBlock * 4);
}
#endif

}  // namespace

Tensor amx_pack_weight(const Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16, "amx_pack_weight: w must be [N, K] bf16");
  const Tensor src = w.contiguous();
  const int64_t n_size = src.size(0), k_size = src.size(1);
  const int64_t panels = (n_size + kBlock - 1) / kBlock, chunks = (k_size + kBlock - 1) / kBlock;
  Tensor out = at::zeros({panels, chunks, 2, 16, kBlock}, src.options());
  const c10::BFloat16* s = src.data_ptr<c10::BFloat16>();
  c10::BFloat16* d = out.data_ptr<c10::BFloat16>();
  at::parallel_for(0, panels, 1, [&](int64_t nb0, int64_t nb1) {
    for (int64_t nb = nb0; nb < nb1; ++nb)
      for (int64_t kc = 0; kc < chunks; ++kc)
        for (int64_t t = 0; t < 2; ++t) {
          c10::BFloat16* tile = d + ((nb * chunks + kc) * 2 + t) * kTileWords;
          for (int64_t n = 0; n < 16; ++n) {
            const int64_t row = nb * kBlock + t * 16 + n;
            if (row >= n_size) break;
            for (int64_t k = 0; k < kBlock && kc * kBlock + k < k_size; ++k)
              tile[(k / 2) * kBlock + 2 * n + k % 2] = s[row * k_size + kc * kBlock + k];
          }
        }
  });
  return out;
}

bool amx_available() {
#if TANDEM_AMX
  return amx_granted();
#else
  return false;
#endif
}

namespace {

// x as the tiles read it: [M rounded up to 32, K rounded up to 32], zero-padded where needed.
Tensor padded_rows(const Tensor& x, int64_t k_pad) {
  const int64_t m_size = x.size(0), k_size = x.size(1), m_pad = (m_size + kBlock - 1) / kBlock * kBlock;
  if (m_pad == m_size && k_pad == k_size && x.is_contiguous()) return x;
  Tensor xp = at::zeros({m_pad, k_pad}, x.options());  // tiles read whole 32 x 32 chunks
  xp.narrow(0, 0, m_size).narrow(1, 0, k_size).copy_(x);
  return xp;
}

void check_operands(const char* op, const Tensor& x, const Tensor& packed) {
  TORCH_CHECK(amx_available(), op, ": this CPU or build has no AMX (see amx_available)");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, op, ": x must be [M, K] bf16");
  TORCH_CHECK(packed.dim() == 5 && packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() &&
                  packed.size(2) == 2 && packed.size(3) == 16 && packed.size(4) == kBlock,
              op, ": packed must come from amx_pack_weight");
  const int64_t k_size = x.size(1), chunks = packed.size(1);
  TORCH_CHECK(k_size <= chunks * kBlock && k_size > (chunks - 1) * kBlock, op, ": x has ", k_size,
              " columns, the packed weight ", chunks * kBlock, " (padded)");
}

#if TANDEM_AMX
// The one loop of both ops: x (a: [m_pad, k_pad] bf16) times every panel of the packed weight w,
// units of U adjacent panels at a time (the gated op's gate and up panel: U = 2). Each thread
// takes one run of units; each group of its units is multiplied by every 32-row chunk of x in
// turn (the group's weight from memory, prefetched, on the first chunk; from L2 after), and
// store(c, m0, unit) receives the unit's results, c [U][32 x 32] fp32 of x rows [m0, m0 + 32).
template <int U, typename Store>
void multiply_units(const c10::BFloat16* a, int64_t m_pad, int64_t k_pad, const c10::BFloat16* w, int64_t units,
                    int64_t chunks, const Store& store) {
  at::parallel_for(0, units, 1, [&](int64_t u0, int64_t u1) {
    Tiles tiles;
    alignas(64) float c[U][kBlock * kBlock];
    for (int64_t g0 = u0; g0 < u1; g0 += kPanelGroup / U) {
      const int64_t g1 = std::min(u1, g0 + kPanelGroup / U);
      for (int64_t m0 = 0; m0 < m_pad; m0 += kBlock)
        for (int64_t unit = g0; unit < g1; ++unit) {
          for (int p = 0; p < U; ++p) multiply_panel(c[p], a, k_pad, m0, w, unit * U + p, chunks, m0 == 0);
          store(c, m0, unit);
        }
    }
  });
}

// 16 floats rounded to bf16 (nearest even), as floats.
inline __m512 round_bf16(__m512 v) { return _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(v)); }
#endif

}  // namespace

Tensor amx_linear(const Tensor& x, const Tensor& packed, int64_t n_size, const c10::optional<Tensor>& bias) {
  check_operands("amx_linear", x, packed);
  const int64_t m_size = x.size(0), panels = packed.size(0), chunks = packed.size(1);
  TORCH_CHECK(n_size <= panels * kBlock && n_size > (panels - 1) * kBlock, "amx_linear: n does not fit the packed weight");
  const c10::BFloat16* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n_size && bias->scalar_type() == at::kBFloat16 &&
                    bias->is_contiguous(), "amx_linear: bias must be [N] bf16, contiguous");
    b = bias->data_ptr<c10::BFloat16>();
  }
  Tensor y = at::empty({m_size, n_size}, x.options());
#if TANDEM_AMX
  if (m_size == 0) return y;
  const Tensor xp = padded_rows(x, chunks * kBlock);
  c10::BFloat16* out = y.data_ptr<c10::BFloat16>();
  multiply_units<1>(xp.data_ptr<c10::BFloat16>(), xp.size(0), xp.size(1), packed.data_ptr<c10::BFloat16>(), panels,
                    chunks, [&](const float (*c)[kBlock * kBlock], int64_t m0, int64_t nb) {
                      store_panel(out, c[0], b, m0, std::min(kBlock, m_size - m0), nb, n_size);
                    });
#endif
  return y;
}

// y [M, d] = silu(x @ gate^T) * (x @ up^T) for the packed [2d, K] weight whose 32-row panels
// alternate, gate rows [32 p, 32 p + 32) then up's (kernels.cpu.amx_gated_order); d a multiple of 32. The
// same bits as silu_and_mul(amx_linear(x, gate | up)): both products, then silu(gate), rounded
// to bf16 before the multiply, whose result is rounded again; silu16 is silu_and_mul's.
Tensor amx_gated_linear(const Tensor& x, const Tensor& packed, int64_t d) {
  check_operands("amx_gated_linear", x, packed);
  const int64_t m_size = x.size(0), panels = packed.size(0), chunks = packed.size(1);
  TORCH_CHECK(d > 0 && d % kBlock == 0 && panels * kBlock == 2 * d,
              "amx_gated_linear: the packed weight must hold 2 x d rows, d a multiple of 32");
  Tensor y = at::empty({m_size, d}, x.options());
#if TANDEM_AMX
  if (m_size == 0) return y;
  const Tensor xp = padded_rows(x, chunks * kBlock);
  c10::BFloat16* out = y.data_ptr<c10::BFloat16>();
  multiply_units<2>(xp.data_ptr<c10::BFloat16>(), xp.size(0), xp.size(1), packed.data_ptr<c10::BFloat16>(),
                    panels / 2, chunks, [&](const float (*c)[kBlock * kBlock], int64_t m0, int64_t p) {
                      for (int64_t r = 0; r < std::min(kBlock, m_size - m0); ++r) {
                        __m512 h[2];
                        for (int half = 0; half < 2; ++half) {
                          const __m512 g = round_bf16(_mm512_load_ps(c[0] + r * kBlock + 16 * half));
                          const __m512 u = round_bf16(_mm512_load_ps(c[1] + r * kBlock + 16 * half));
                          h[half] = _mm512_mul_ps(round_bf16(silu16(g)), u);
                        }
                        _mm512_storeu_si512(out + (m0 + r) * d + p * kBlock, (__m512i)_mm512_cvtne2ps_pbh(h[1], h[0]));
                      }
                    });
#endif
  return y;
}

}  // namespace tandem
