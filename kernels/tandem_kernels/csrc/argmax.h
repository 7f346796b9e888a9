// argmax_row: the index of a row's first maximum (greedy sampling), shared by argmax_rows
// (elementwise.cpp) and penalized_argmax (penalties.cpp), so both pick the same token.
#pragma once

#include "simd.h"

namespace tandem {
namespace {

// The index of the first maximum of x [n] (torch.max's: a NaN counts as the maximum).
template <typename T>
int64_t argmax_row(const T* x, int64_t n) {
  float best = -INFINITY;
  int64_t at = 0, k = 0;
  bool nan = false;
  if constexpr (kWideRows<T> && kWideNative) {
    vf16 top = vf16{} - INFINITY;
    vi16 top_at{}, lane{};
    for (int j = 0; j < kLanesWide; ++j) lane[j] = j;
    vi16 nans{};
    for (; k + kLanesWide <= n; k += kLanesWide, lane += kLanesWide) {
      const vf16 v = load16f(x + k);
      const vi16 higher = v > top;  // strict: each lane keeps its first maximum
      top = higher ? v : top;
      top_at = higher ? lane : top_at;
      nans |= v != v;
    }
    for (int j = 0; j < kLanesWide; ++j) {
      nan = nan || nans[j];
      if (top[j] > best || (top[j] == best && top_at[j] < at)) best = top[j], at = top_at[j];
    }
  } else if constexpr (kWideRows<T>) {  // the same, as two 8-lane halves (kWideNative)
    vf top_lo = vsplat(-INFINITY), top_hi = top_lo;
    vi at_lo{}, at_hi{}, lane{}, nans{};
    for (int j = 0; j < kLanes; ++j) lane[j] = j;
    for (; k + 2 * kLanes <= n; k += 2 * kLanes, lane += int32_t{2 * kLanes}) {
      const vf lo = load8f(x + k), hi = load8f(x + k + kLanes);
      const vi higher_lo = lo > top_lo, higher_hi = hi > top_hi;
      top_lo = higher_lo ? lo : top_lo;
      at_lo = higher_lo ? lane : at_lo;
      top_hi = higher_hi ? hi : top_hi;
      at_hi = higher_hi ? lane + int32_t{kLanes} : at_hi;
      nans |= (lo != lo) | (hi != hi);
    }
    for (int j = 0; j < kLanes; ++j) {
      nan = nan || nans[j];
      if (top_lo[j] > best || (top_lo[j] == best && at_lo[j] < at)) best = top_lo[j], at = at_lo[j];
      if (top_hi[j] > best || (top_hi[j] == best && at_hi[j] < at)) best = top_hi[j], at = at_hi[j];
    }
  }
  for (; k < n; ++k) {
    const float v = to_f(x[k]);
    nan = nan || v != v;
    if (v > best) best = v, at = k;
  }
  if (nan)
    for (k = 0; k < n; ++k)
      if (to_f(x[k]) != to_f(x[k])) return k;
  return at;
}

}  // namespace
}  // namespace tandem
