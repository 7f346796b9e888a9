// isa_peak: how many multiply-adds a second this build's dot-product instructions retire on this
// CPU, every thread of torch's pool issuing them at once on independent accumulators, with no memory
// traffic (operands in registers). It is the compute ceiling the matmul kernels work under
// (bench/ceiling.py prints it), not a rate any kernel can reach: a kernel also loads, converts and
// scales. The int8 and bf16 kinds time 512-bit instructions: on CPUs that retire two of them a
// cycle (Intel's with a second 512-bit FMA unit) that is twice what 256-bit code can reach; on AMD's
// Zen 4, which splits a 512-bit instruction in two, the same.
//
// kind, and the instruction timed (a multiply-add is one product added into a sum):
//   "int8": vpdpbusd on 512-bit registers where the build has AVX-512 VNNI (64 u8 x s8 products an
//           instruction), else AVX2's vpmaddubsw + vpmaddwd + vpaddd (32 products: the int8 kernels'
//           own sequence there);
//   "bf16": vdpbf16ps on 512-bit registers (32 bf16 products), only where the build has AVX-512 BF16;
//   "fp32": vfmadd231ps on 512-bit registers with AVX-512, else 256-bit ones with FMA.
// A kind the build lacks is an error that names it. Returns G multiply-adds a second.
//
// Registered here (TORCH_LIBRARY_FRAGMENT) rather than in registration.cpp: the op is this file's.

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <chrono>
#include <string>

#include "common.h"
#include "simd.h"

namespace tandem {
namespace {

#if defined(__AVX2__)  // every timed instruction is AVX2's or AVX-512's
constexpr int kChains = 12;  // independent accumulators: more than any core's latency x throughput needs

// Runs `iterations` rounds on every thread of the pool at once; returns the wall seconds it took.
// Each chain starts from its own value (init(i)), so that no two chains are one computation the
// compiler could share; round(acc) issues one instruction into each of the kChains accumulators.
template <typename Acc, typename Init, typename Round>
double run_chains(int64_t iterations, const Init& init, const Round& round) {
  const int threads = at::get_num_threads();
  const auto start = std::chrono::steady_clock::now();
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      Acc acc[kChains];
      for (int i = 0; i < kChains; ++i) acc[i] = init(i);
      for (int64_t it = 0; it < iterations; ++it) round(acc);
      for (int i = 0; i < kChains; ++i) asm volatile("" : : "x"(acc[i]));  // keep every chain's result
    }
  });
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// G multiply-adds a second: iterations doubled until a run lasts at least `seconds`.
template <typename Acc, typename Init, typename Round>
double rate(double seconds, int products, const Init& init, const Round& round) {
  int64_t iterations = 1 << 12;
  double elapsed = run_chains<Acc>(iterations, init, round);
  while (elapsed < seconds) {
    iterations *= 2;
    elapsed = run_chains<Acc>(iterations, init, round);
  }
  const double ops = static_cast<double>(iterations) * kChains * at::get_num_threads() * products;
  return ops / elapsed / 1e9;
}
#endif

double int8_peak(double seconds) {
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
  return rate<__m512i>(seconds, 64, [](int i) { return _mm512_set1_epi32(i); }, [](__m512i* acc) {
    __m512i a = _mm512_set1_epi8(1), b = _mm512_set1_epi8(2);
    asm volatile("" : "+v"(a), "+v"(b));  // operands the compiler cannot see through, every round
    for (int i = 0; i < kChains; ++i) acc[i] = _mm512_dpbusd_epi32(acc[i], a, b);
  });
#elif defined(__AVX2__)
  return rate<__m256i>(seconds, 32, [](int i) { return _mm256_set1_epi32(i); }, [](__m256i* acc) {
    __m256i a = _mm256_set1_epi8(1), ones = _mm256_set1_epi16(1);
    asm volatile("" : "+x"(a), "+x"(ones));
    for (int i = 0; i < kChains; ++i)  // the products of a and the chain's own bytes: nothing to share
      acc[i] = _mm256_add_epi32(acc[i], _mm256_madd_epi16(_mm256_maddubs_epi16(a, acc[i]), ones));
  });
#else
  (void)seconds;
  TORCH_CHECK(false, "isa_peak: this build has no int8 dot product (neither AVX-512 VNNI nor AVX2)");
  return 0.0;
#endif
}

double bf16_peak(double seconds) {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  return rate<__m512>(seconds, 32, [](int i) { return _mm512_set1_ps(static_cast<float>(i)); }, [](__m512* acc) {
    __m512i ones = _mm512_set1_epi16(0x3f80), twos = _mm512_set1_epi16(0x4000);  // bf16 1.0 and 2.0
    asm volatile("" : "+v"(ones), "+v"(twos));  // integer vectors: clang 17 cannot place bf16 ones in asm
    const __m512bh a = (__m512bh)ones, b = (__m512bh)twos;
    for (int i = 0; i < kChains; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
  });
#else
  (void)seconds;
  TORCH_CHECK(false, "isa_peak: this build has no bf16 dot product (AVX-512 BF16)");
  return 0.0;
#endif
}

double fp32_peak(double seconds) {
#if defined(__AVX512F__)
  return rate<__m512>(seconds, 16, [](int i) { return _mm512_set1_ps(static_cast<float>(i)); }, [](__m512* acc) {
    __m512 a = _mm512_set1_ps(1.0f), b = _mm512_set1_ps(1e-7f);
    asm volatile("" : "+v"(a), "+v"(b));
    for (int i = 0; i < kChains; ++i) acc[i] = _mm512_fmadd_ps(a, b, acc[i]);
  });
#elif defined(__AVX2__) && defined(__FMA__)
  return rate<__m256>(seconds, 8, [](int i) { return _mm256_set1_ps(static_cast<float>(i)); }, [](__m256* acc) {
    __m256 a = _mm256_set1_ps(1.0f), b = _mm256_set1_ps(1e-7f);
    asm volatile("" : "+x"(a), "+x"(b));
    for (int i = 0; i < kChains; ++i) acc[i] = _mm256_fmadd_ps(a, b, acc[i]);
  });
#else
  (void)seconds;
  TORCH_CHECK(false, "isa_peak: this build has no fp32 fma (neither AVX-512 nor AVX2 with FMA)");
  return 0.0;
#endif
}

}  // namespace

double isa_peak(const std::string& kind, double seconds) {
  TORCH_CHECK(seconds > 0.0 && seconds <= 10.0, "isa_peak: seconds must be in (0, 10], got ", seconds);
  if (kind == "int8") return int8_peak(seconds);
  if (kind == "bf16") return bf16_peak(seconds);
  if (kind == "fp32") return fp32_peak(seconds);
  TORCH_CHECK(false, "isa_peak: kind must be int8, bf16 or fp32, got '", kind, "'");
  return 0.0;
}

}  // namespace tandem

TORCH_LIBRARY_FRAGMENT(tandem_cpu, m) {
  m.def("isa_peak(str kind, float seconds) -> float",
        [](std::string kind, double seconds) { return tandem::isa_peak(kind, seconds); });
}
