// The argmax of a range of float32 values as torch.argmax takes it (the first of equal maxima;
// NaN counts as the largest, so the first NaN wins), shared by splitfuse_cpu::greedy_argmax
// (greedy_argmax.cpp) and the decode stack's LM head (decode_stack.cpp), whose threads each take
// the argmax of the columns they computed and join them in column order (join_ranges).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include <immintrin.h>

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

// The first pass over x[begin, end): the largest value of each chunk of kArgmaxChunk into
// chunk_top (a chunk holding a NaN may note any value), the largest of them returned; *has_nan
// set where x holds a NaN. Written in GCC's vector extensions, 16 values a vector, for AVX-512
// and the baseline (on AVX2 GCC split the 16 lanes through the stack: ~1.3 ns a value, ~3.5% of
// a 32-token decode step on an AVX2-only AMD EPYC), in AVX2 intrinsics below.
constexpr int64_t kArgmaxChunk = 1024;

__attribute__((target_clones("avx512f", "default"))) float chunk_tops_vector(
    const float* x, int64_t begin, int64_t end, float* chunk_top, bool* has_nan) {
  typedef float v16 __attribute__((vector_size(64)));
  typedef int32_t vi16 __attribute__((vector_size(64)));
  constexpr int64_t kLanes = 16;
  const int64_t num_chunks = (end - begin + kArgmaxChunk - 1) / kArgmaxChunk;
  float best = -INFINITY;
  for (int64_t c = 0; c < num_chunks; ++c) {
    const int64_t from = begin + c * kArgmaxChunk, to = std::min(end, from + kArgmaxChunk);
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
        *has_nan |= nans[l] != 0;
        top_value = top[l] > top_value ? top[l] : top_value;
      }
    }
    for (; i < to; ++i) {
      *has_nan |= std::isnan(x[i]);
      top_value = x[i] > top_value ? x[i] : top_value;
    }
    chunk_top[c] = top_value;
    best = top_value > best ? top_value : best;
  }
  return best;
}

// chunk_tops_vector on AVX2, 8 values a vector in two chains (a chunk's NaNs found by an
// unordered compare; without NaN its top is the same maximum)
__attribute__((target("avx2"))) float chunk_tops_avx2(const float* x, int64_t begin, int64_t end,
                                                      float* chunk_top, bool* has_nan) {
  const int64_t num_chunks = (end - begin + kArgmaxChunk - 1) / kArgmaxChunk;
  float best = -INFINITY;
  __m256 nans = _mm256_setzero_ps();
  for (int64_t c = 0; c < num_chunks; ++c) {
    const int64_t from = begin + c * kArgmaxChunk, to = std::min(end, from + kArgmaxChunk);
    __m256 top0 = _mm256_set1_ps(-INFINITY), top1 = top0;
    int64_t i = from;
    for (; i + 16 <= to; i += 16) {
      const __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + i + 8);
      nans = _mm256_or_ps(nans, _mm256_cmp_ps(a, b, _CMP_UNORD_Q));
      top0 = _mm256_max_ps(a, top0);
      top1 = _mm256_max_ps(b, top1);
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, _mm256_max_ps(top0, top1));
    float top_value = -INFINITY;
    for (int l = 0; l < 8; ++l) top_value = lanes[l] > top_value ? lanes[l] : top_value;
    for (; i < to; ++i) {
      *has_nan |= std::isnan(x[i]);
      top_value = x[i] > top_value ? x[i] : top_value;
    }
    chunk_top[c] = top_value;
    best = top_value > best ? top_value : best;
  }
  *has_nan |= _mm256_movemask_ps(nans) != 0;
  return best;
}

// The argmax of x[begin, end) (end - begin at most kArgmaxMaxValues): each chunk's largest
// value (and whether a NaN is there) in one pass, the widest vectors the CPU runs; then the
// first chunk that holds the largest is searched for its index (or the range for its first NaN).
inline RangeArgmax range_argmax(const float* x, int64_t begin, int64_t end) {
  static const bool avx2 = !__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx2");
  float chunk_top[kArgmaxMaxValues / kArgmaxChunk];
  bool has_nan = false;
  const float best = avx2 ? chunk_tops_avx2(x, begin, end, chunk_top, &has_nan)
                          : chunk_tops_vector(x, begin, end, chunk_top, &has_nan);
  if (has_nan) {
    for (int64_t j = begin; j < end; ++j)
      if (std::isnan(x[j])) return {j, x[j], true};
  }
  const int64_t num_chunks = (end - begin + kArgmaxChunk - 1) / kArgmaxChunk;
  for (int64_t c = 0; c < num_chunks; ++c) {
    if (chunk_top[c] != best) continue;
    for (int64_t j = begin + c * kArgmaxChunk; j < std::min(end, begin + (c + 1) * kArgmaxChunk);
         ++j)
      if (x[j] == best) return {j, best, false};
  }
  return {begin, x[begin], false};  // (a range of -inf: its first value)
}

}  // namespace
