// What every CPU kernel file shares: torch's headers, the dtype dispatch macros, the CPU check,
// and the cache-line prefetch that attention and the int8 linears use.
//
// Tandem's CPU kernels are the fused twins of kernels/tandem_kernels/reference.py for CPU tensors, built once per
// machine by kernels/tandem_kernels/cpu.py (g++ -O3 -march=native, cached) into one library and registered as
// torch.ops.tandem_cpu.* (registration.cpp). One file per op family:
//     simd.h                   vector load / store / convert helpers, the polynomial exp
//     attention.cpp            paged attention, the KV-cache write, the whole attention block
//       attention_portable.h     its 8-lane kernel (any target)
//       attention_avx512*.h      its AVX-512 kernel and tiles
//     elementwise.cpp          RMS norms, rotary embedding, SiLU-and-mul, greedy argmax
//     int8_linear.cpp          int8 weights with float activations, and w8a8 (portable)
//       int8_args.h              their argument checks
//     int8_bf16.cpp            int8 weights with bf16 activations on AVX-512 BF16, on a packed weight
//     w8a8_packed.cpp          w8a8 on a packed weight (AVX-512 VNNI, AVX2 or plain loops)
//     int4_linear.cpp          4-bit weights in 32-wide groups (GGUF Q4_0 / Q4_1), float or bf16 activations
//       int4_args.h, int4_vec.h  their argument checks, the nibble unpacking
//     gguf_linear.cpp          the grouped int8 layout (GGUF Q5_K / Q6_K / Q8_0), float or bf16 activations
//     int4_q8.cpp              4-bit weights against int8 activations (AVX-512 VNNI, AVX2 or plain loops)
//     int8g_q8.cpp             the grouped int8 layout's 6-bit codes against int8 activations (same three)
//       q8_rows.h                what both share: the activations' 8-bit quantization, the tile loop, the stores
//     amx_linear.cpp           bf16 linears on AMX tiles
//     bf16_linear.cpp          bf16 linears with AVX-512 BF16 dot products, on a packed weight (no AMX)
//     penalties.cpp            repetition / frequency / presence penalties from token tables
//     ops.h                    every op's C++ signature; registration.cpp: their schemas
// Each .cpp compiles on its own (in parallel) and all link into one library.
//
// The headers' helpers sit in an unnamed namespace: each translation unit has its own copy, as
// when the kernels were one file, so GCC inlines and clones the hot loops as it did then (with
// external linkage it kept some tuned tiles out of line).
//
// Every op works on float, bfloat16 and half tensors and accumulates in float. Parallel loops use
// ATen's thread pool (at::parallel_for), so they share torch's OpenMP team: a second team on a
// couple of cores slows both down.
//
// Compiled with -ffp-contract=off: the elementwise ops round after each multiply and add exactly
// as the torch reference does (no fused multiply-add), so in fp32 rotary and norms give the
// reference's bits. Attention and SiLU use a polynomial exp (~1 ulp) that vectorizes; neither is
// bit-equal to torch's, and attention's dot products use fused multiply-adds (vfma) where the CPU
// has them.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace tandem {
namespace {

using at::Tensor;

template <typename T>
inline float to_f(T x) { return static_cast<float>(x); }

#define TANDEM_DISPATCH(dtype, NAME, ...)                                           \
  [&] {                                                                             \
    switch (dtype) {                                                                \
      case at::kFloat: { using scalar_t = float; return __VA_ARGS__(); }            \
      case at::kBFloat16: { using scalar_t = c10::BFloat16; return __VA_ARGS__(); } \
      case at::kHalf: { using scalar_t = c10::Half; return __VA_ARGS__(); }         \
      default: TORCH_CHECK(false, NAME, ": unsupported dtype ", dtype);             \
    }                                                                               \
  }()

// TANDEM_DISPATCH, and cache_t: the KV caches' element type, scalar_t itself or fp8 (e4m3fn).
#define TANDEM_DISPATCH_CACHE(dtype, cache_dtype, NAME, ...)                                         \
  TANDEM_DISPATCH(dtype, NAME, [&] {                                                                \
    if ((cache_dtype) == at::kFloat8_e4m3fn) { using cache_t = c10::Float8_e4m3fn; return __VA_ARGS__(); } \
    TORCH_CHECK((cache_dtype) == c10::CppTypeToScalarType<scalar_t>::value, NAME,                     \
                ": the caches must have the activations' dtype or float8_e4m3fn");                 \
    using cache_t = scalar_t;                                                                       \
    return __VA_ARGS__();                                                                           \
  })

inline void check_cpu(const Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
}

// Asks for run[0:n]'s cache lines ahead of use: attention's next block, the int8 linears' next weight rows.
template <typename T>
inline void prefetch_run(const T* run, int64_t n) {
  const char* p = reinterpret_cast<const char*>(run);
  for (int64_t off = 0; off < n * static_cast<int64_t>(sizeof(T)); off += 64) __builtin_prefetch(p + off);
}

}  // namespace
}  // namespace tandem
