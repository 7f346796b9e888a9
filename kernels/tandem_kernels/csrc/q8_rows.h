// Activations quantized to 8 bits per 32 values, the form both integer-dot kernels (int4_q8.cpp,
// int8g_q8.cpp) read; the contract is tandem_kernels.gguf_reference.quantize_q8_groups: per 32-wide
// group, a = max |x|, s = a / 127, q = round_half_even(x * (127 / a)) in [-127, 127], in fp32 (all zero
// where a = 0; a group holding a NaN gets s = NaN, so its row's outputs are NaN).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "common.h"

namespace tandem {
namespace {

constexpr int64_t kQ8Group = 32;  // activations per scale

// x's rows, quantized: q [M, K] int8 and, per run of sum_width values (32, or 16 to match a weight
// layout's groups), s [M, K / sum_width, 2] = (s of the 32-group holding the run, s * the run's sum of
// q): the two factors a group's terms need.
struct QuantizedRows {
  std::vector<int8_t> q;
  std::vector<float> s;
  int64_t k_size = 0, groups = 0;  // groups: runs per row, K / sum_width
};

template <typename T>
inline float as_float(T v) { return static_cast<float>(v); }

// One group of 32 values: the reference's arithmetic (fp32, round half to even). Returns s.
template <typename T>
inline float quantize_group(const T* x, int8_t* q) {
  float a = 0.0f;
  bool nan = false;
  for (int64_t i = 0; i < kQ8Group; ++i) {
    const float v = as_float(x[i]);
    nan |= v != v;
    a = std::max(a, std::fabs(v));
  }
  if (nan || !(a > 0.0f)) {  // all zero; or a NaN, passed on to the row's outputs through s
    std::memset(q, 0, kQ8Group);
    return nan ? std::numeric_limits<float>::quiet_NaN() : 0.0f;
  }
  const float inv = 127.0f / a;
  for (int64_t i = 0; i < kQ8Group; ++i) {
    const float r = std::nearbyint(as_float(x[i]) * inv);  // the default rounding: to nearest even
    q[i] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, r)));
  }
  return a / 127.0f;
}

template <typename T>
QuantizedRows quantize_rows(const T* x, int64_t x_stride, int64_t m_size, int64_t k_size, int64_t sum_width) {
  QuantizedRows r;
  r.k_size = k_size;
  r.groups = k_size / sum_width;
  r.q.resize(m_size * k_size);
  r.s.resize(m_size * r.groups * 2);
  const int64_t groups32 = k_size / kQ8Group, runs = kQ8Group / sum_width;
  at::parallel_for(0, m_size * groups32, 256, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t m = t / groups32, g = t % groups32;
      int8_t* q = r.q.data() + m * k_size + g * kQ8Group;
      const float s = quantize_group(x + m * x_stride + g * kQ8Group, q);
      for (int64_t run = 0; run < runs; ++run) {
        int32_t sum = 0;
        for (int64_t i = run * sum_width; i < (run + 1) * sum_width; ++i) sum += q[i];
        float* out = r.s.data() + (m * r.groups + g * runs + run) * 2;
        out[0] = s;
        out[1] = s * static_cast<float>(sum);
      }
    }
  });
  return r;
}

}  // namespace
}  // namespace tandem
