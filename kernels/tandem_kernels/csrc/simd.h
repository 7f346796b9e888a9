// Vector helpers shared by the op families: GCC/Clang vector extensions of 8 and 16 floats, their
// loads, stores and roundings for float and bf16 rows, the polynomial exp, and the conversions of
// cache rows (bf16, half, fp8 e4m3fn) to float.
//
// The elementwise row ops (norms, SiLU, argmax) use the 16-lane vectors on every target (one
// AVX-512 register, or two 8-lane halves); attention and the int8 linears the 8-lane ones where
// they have no AVX-512 path.
#pragma once

#include "common.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "avx512_math.h"

namespace tandem {
namespace {

// GCC/Clang vector extensions: 8 floats, compiled to whatever the target has (AVX2, 2 x SSE,
// NEON). Explicit, because the auto-vectorizer leaves the reductions below scalar.

using vf = float __attribute__((vector_size(32)));
using vi = int32_t __attribute__((vector_size(32)));
constexpr int64_t kLanes = 8;

inline vf vload(const float* p) { vf v; std::memcpy(&v, p, sizeof v); return v; }
inline void vstore(float* p, vf v) { std::memcpy(p, &v, sizeof v); }
inline vf vsplat(float x) { return vf{x, x, x, x, x, x, x, x}; }
inline float hsum(vf v) {
  return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
}

// exp(x) to ~1 ulp for x in [-87, 88] (Cephes' single-precision polynomial), lane-wise, for any
// width of float vector V (VI: its int32 twin).
template <typename V, typename VI>
inline V vexp_t(V x) {
  x = x < 88.0f ? x : V{} + 88.0f;
  x = x > -87.0f ? x : V{} - 87.0f;
  // n = round(x / ln 2) as floor(t + 0.5), computed by truncation of a positive shifted value
  const V t = x * 1.44269504088896341f + 128.5f;
  const VI n = __builtin_convertvector(t, VI) - 128;
  const V nf = __builtin_convertvector(n, V);
  const V r = (x - nf * 0.693359375f) - nf * -2.12194440e-4f;
  V p = V{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  VI bits = (n + 127) << 23;
  V scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}
inline vf vexp(vf x) { return vexp_t<vf, vi>(x); }

// 16 lanes, for the row-wise elementwise ops: one AVX-512 register where the target has it, two
// 8-lane halves elsewhere; lane for lane the same arithmetic as vf.
using vf16 = float __attribute__((vector_size(64)));
using vi16 = int32_t __attribute__((vector_size(64)));
using vu16 = uint32_t __attribute__((vector_size(64)));
using vh16 = uint16_t __attribute__((vector_size(32)));
constexpr int64_t kLanesWide = 16;

// Whether a 16-lane vector is one register. Without AVX-512 GCC lowers the comparisons and
// selects of 16-lane vectors (not their arithmetic) lane by lane through memory: an argmax over
// 16-lane vectors ran ~50x slower than the same loop over two 8-lane halves on an AVX2 CPU. Loops
// that compare or select take 8-lane paths there (load8f), with the same per-lane arithmetic.
#if defined(__AVX512F__)
constexpr bool kWideNative = true;
#else
constexpr bool kWideNative = false;
#endif

inline vf16 vexp16(vf16 x) { return vexp_t<vf16, vi16>(x); }

// 16 values of a float or bf16 row as floats (bf16 -> float is exact).
inline vf16 load16f(const float* p) { vf16 v; std::memcpy(&v, p, sizeof v); return v; }
inline vf16 load16f(const c10::BFloat16* p) {
  vh16 h;
  std::memcpy(&h, p, sizeof h);
  const vu16 u = __builtin_convertvector(h, vu16) << 16;
  vf16 v;
  std::memcpy(&v, &u, sizeof v);
  return v;
}

// 8 values of a float or bf16 row as floats (bf16 -> float is exact).
using vh8 = uint16_t __attribute__((vector_size(16)));
using vu8 = uint32_t __attribute__((vector_size(32)));
inline vf load8f(const float* p) { return vload(p); }
inline vf load8f(const c10::BFloat16* p) {
  vh8 h;
  std::memcpy(&h, p, sizeof h);
  const vu8 u = __builtin_convertvector(h, vu8) << 16;
  vf v;
  std::memcpy(&v, &u, sizeof v);
  return v;
}

// v rounded to T's precision, as floats: c10's float -> bf16 rounding (to nearest even, NaN kept).
template <typename T>
inline vf16 round16(vf16 v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    static_assert(std::is_same_v<T, c10::BFloat16>, "16-lane rows are float or bf16");
    vu16 u;
    std::memcpy(&u, &v, sizeof u);
    u = ((u + (((u >> 16) & 1u) + 0x7FFFu)) >> 16) << 16;
    u = v != v ? vu16{} + 0x7FC00000u : u;
    std::memcpy(&v, &u, sizeof v);
    return v;
  }
}

// Stores 16 floats already rounded to T's precision (round16).
inline void store16(float* p, vf16 v) { std::memcpy(p, &v, sizeof v); }
inline void store16(c10::BFloat16* p, vf16 v) {
  vu16 u;
  std::memcpy(&u, &v, sizeof u);
  const vh16 h = __builtin_convertvector(u >> 16, vh16);
  std::memcpy(p, &h, sizeof h);
}

// The 8-lane twins of round16 and store16, for the paths taken without AVX-512 (kWideNative).
template <typename T>
inline vf round8(vf v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    static_assert(std::is_same_v<T, c10::BFloat16>, "8-lane rows are float or bf16");
    vu8 u;
    std::memcpy(&u, &v, sizeof u);
    u = ((u + (((u >> 16) & 1u) + 0x7FFFu)) >> 16) << 16;
    const vu8 nan = (vu8)(v != v);  // all ones where v is NaN
    u = (u & ~nan) | (nan & 0x7FC00000u);
    std::memcpy(&v, &u, sizeof v);
    return v;
  }
}
inline void store8(float* p, vf v) { vstore(p, v); }
inline void store8(c10::BFloat16* p, vf v) {
  vu8 u;
  std::memcpy(&u, &v, sizeof u);
  const vh8 h = __builtin_convertvector(u >> 16, vh8);
  std::memcpy(p, &h, sizeof h);
}

template <typename T>
constexpr bool kWideRows = std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>;

// a * b + c: fused where the CPU has FMA (attention only; the elementwise ops round apart).
inline vf vfma(vf a, vf b, vf c) {
#if defined(__AVX2__) && defined(__FMA__)
  return _mm256_fmadd_ps(a, b, c);
#else
  return a * b + c;
#endif
}

inline float exp_scalar(float x) {
  vf v = vexp(vsplat(x));
  return v[0];
}

// dst[0:n] = src[0:n] as float.
template <typename T>
inline void load_row(float* dst, const T* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = to_f(src[i]);
}

template <>
inline void load_row<c10::BFloat16>(float* dst, const c10::BFloat16* src, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t word = static_cast<uint32_t>(bits[i]) << 16;
    std::memcpy(dst + i, &word, sizeof word);
  }
}

// The value of the e4m3fn byte with these bits (c10's conversion): what the fp8 tables hold.
inline float fp8_value(int bits) {
  return static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(bits), c10::Float8_e4m3fn::from_bits()));
}

// Every e4m3fn byte's value (NaN bytes included): the generic path's fp8 -> float conversion.
struct Fp8Table {
  float value[256];
  Fp8Table() {
    for (int b = 0; b < 256; ++b) value[b] = fp8_value(b);
  }
};

template <>
inline void load_row<c10::Float8_e4m3fn>(float* dst, const c10::Float8_e4m3fn* src, int64_t n) {
  static const Fp8Table table;
  for (int64_t i = 0; i < n; ++i) dst[i] = table.value[src[i].x];
}

// A cached K or V row as floats: the cache itself for float, else converted into buf.
template <typename T>
inline const float* row_as_float(const T* row, float* buf, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    return row;
  } else {
    load_row(buf, row, n);
    return buf;
  }
}

}  // namespace
}  // namespace tandem
