// The argmax of a range of float32 values as torch.argmax takes it (the first of equal maxima;
// NaN counts as the largest, so the first NaN wins), shared by splitfuse_cpu::greedy_argmax
// (greedy_argmax.cpp) and the decode stack's LM head (decode_stack.cpp), whose threads each take
// the argmax of the columns they computed and join them in column order (join_ranges).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace {

constexpr int64_t kArgmaxMaxValues = 1 << 20;  // the longest range range_argmax takes

// The argmax of x[begin, end) (end > begin): its index, the value there, whether it is a NaN
struct RangeArgmax {
  int64_t index;
  float value;
  bool nan;
};

// a the argmax of a range, b of the range right after it: the argmax of both
inline RangeArgmax join_ranges(const RangeArgmax& a, const RangeArgmax& b) {
  if (a.nan) return a;
  if (b.nan || b.value > a.value) return b;
  return a;
}

// x[begin, end) is read once, 16 values at a time, for the largest value of each chunk of 1,024
// (NaNs noted aside); then the first chunk that holds the largest is searched for its index (or
// the range for its first NaN). Compiled for AVX-512, AVX2 and the baseline, the widest the CPU
// runs picked at load.
__attribute__((target_clones("avx512f", "avx2", "default"))) RangeArgmax range_argmax(
    const float* x, int64_t begin, int64_t end) {
  typedef float v16 __attribute__((vector_size(64)));
  typedef int32_t vi16 __attribute__((vector_size(64)));
  constexpr int64_t kLanes = 16, kChunk = 1024;
  float chunk_top[kArgmaxMaxValues / kChunk];
  const int64_t num_chunks = (end - begin + kChunk - 1) / kChunk;
  float best = -INFINITY;
  bool has_nan = false;
  for (int64_t c = 0; c < num_chunks; ++c) {
    const int64_t from = begin + c * kChunk, to = std::min(end, from + kChunk);
    float top_value = -INFINITY;
    int64_t i = from;
    if (to - from >= kLanes) {
      v16 top;
      __builtin_memcpy(&top, x + i, sizeof top);
      vi16 nans = top != top;
      for (i += kLanes; i + kLanes <= to; i += kLanes) {
        v16 v;
        __builtin_memcpy(&v, x + i, sizeof v);
        nans |= v != v;
        top = v > top ? v : top;
      }
      for (int l = 0; l < kLanes; ++l) {
        has_nan |= nans[l] != 0;
        top_value = top[l] > top_value ? top[l] : top_value;
      }
    }
    for (; i < to; ++i) {
      has_nan |= std::isnan(x[i]);
      top_value = x[i] > top_value ? x[i] : top_value;
    }
    chunk_top[c] = top_value;
    best = top_value > best ? top_value : best;
  }
  if (has_nan) {
    for (int64_t j = begin; j < end; ++j)
      if (std::isnan(x[j])) return {j, x[j], true};
  }
  for (int64_t c = 0; c < num_chunks; ++c) {
    if (chunk_top[c] != best) continue;
    for (int64_t j = begin + c * kChunk; j < std::min(end, begin + (c + 1) * kChunk); ++j)
      if (x[j] == best) return {j, best, false};
  }
  return {begin, x[begin], false};  // (a range of -inf: its first value)
}

}  // namespace
