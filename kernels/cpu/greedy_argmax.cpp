// splitfuse_cpu::greedy_argmax: per row of logits [M, N] float32, the index of its largest value
// exactly as torch.argmax gives it (the first of equal maxima; NaN counts as the largest, so the
// first NaN wins), [M] int64: greedy sampling's token.
//
// A row is read once, 16 values at a time, for the largest value of each chunk of 1,024 (NaNs
// noted aside); then the first chunk that holds the row's largest is searched for its index (or
// the row for its first NaN). torch's CPU argmax takes ~1 ns a value (~40
// us for one row of 49,152); chunked torch reductions came to ~20 us but took ~8 operator calls,
// which after a decode step has streamed the weights through the caches cost ~120 us. This is
// one call of a few microseconds.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace {

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t vi16 __attribute__((vector_size(64)));
constexpr int64_t kLanes = 16;
constexpr int64_t kChunk = 1024;      // values per chunk whose largest value is kept
constexpr int64_t kMaxChunks = 1024;  // rows of up to 1M values

inline v16 load16(const float* p) {
  v16 v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}

// Compiled for AVX-512, AVX2 and the baseline, the widest the CPU runs picked at load.
__attribute__((target_clones("avx512f", "avx2", "default"))) int64_t row_argmax(const float* x,
                                                                                int64_t n) {
  // each chunk's largest value, and whether a NaN is there (a lane that met one may hold
  // anything); then the first chunk holding the row's largest, then the first index in it
  float chunk_top[kMaxChunks];
  const int64_t num_chunks = (n + kChunk - 1) / kChunk;
  float best = -INFINITY;
  bool has_nan = false;
  for (int64_t c = 0; c < num_chunks; ++c) {
    const int64_t begin = c * kChunk, end = std::min(n, begin + kChunk);
    float top_value = -INFINITY;
    int64_t i = begin;
    if (end - begin >= kLanes) {
      v16 top = load16(x + i);
      vi16 nans = top != top;
      for (i += kLanes; i + kLanes <= end; i += kLanes) {
        const v16 v = load16(x + i);
        nans |= v != v;
        top = v > top ? v : top;
      }
      for (int l = 0; l < kLanes; ++l) {
        has_nan |= nans[l] != 0;
        top_value = top[l] > top_value ? top[l] : top_value;
      }
    }
    for (; i < end; ++i) {
      has_nan |= std::isnan(x[i]);
      top_value = x[i] > top_value ? x[i] : top_value;
    }
    chunk_top[c] = top_value;
    best = top_value > best ? top_value : best;
  }
  if (has_nan) {
    for (int64_t j = 0; j < n; ++j)
      if (std::isnan(x[j])) return j;
  }
  for (int64_t c = 0; c < num_chunks; ++c) {
    if (chunk_top[c] != best) continue;
    for (int64_t j = c * kChunk; j < std::min(n, (c + 1) * kChunk); ++j)
      if (x[j] == best) return j;
  }
  return 0;  // (a row of -inf: chunk 0 holds it at index 0)
}

at::Tensor greedy_argmax(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous() &&
                  logits.device().is_cpu() && logits.size(1) > 0,
              "greedy_argmax: logits must be a contiguous float32 CPU tensor [M, N], N > 0");
  TORCH_CHECK(logits.size(1) <= kMaxChunks * kChunk, "greedy_argmax: rows of more than ",
              kMaxChunks * kChunk, " values");
  const int64_t M = logits.size(0), N = logits.size(1);
  at::Tensor out = at::empty({M}, logits.options().dtype(at::kLong));
  const float* x = logits.data_ptr<float>();
  int64_t* indices = out.data_ptr<int64_t>();
  // a few rows on the calling thread (one row: a few microseconds, less than a fork)
  at::parallel_for(0, M, std::max<int64_t>(1, 262144 / N), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) indices[r] = row_argmax(x + r * N, N);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(splitfuse_cpu, m) { m.def("greedy_argmax(Tensor logits) -> Tensor"); }

TORCH_LIBRARY_IMPL(splitfuse_cpu, CPU, m) { m.impl("greedy_argmax", greedy_argmax); }
