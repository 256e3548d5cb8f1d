// splitfuse_cpu::greedy_argmax: per row of logits [M, N] float32, the index of its largest value
// exactly as torch.argmax gives it (the first of equal maxima; NaN counts as the largest, so the
// first NaN wins), [M] int64: greedy sampling's token.
//
// A row is read once for the largest value of each chunk of 1,024, then the first chunk holding
// the row's largest is searched (range_argmax, greedy_argmax.h). torch's CPU argmax takes ~1 ns a
// value (~40 us for one row of 49,152); chunked torch reductions came to ~20 us but took ~8
// operator calls, which after a decode step has streamed the weights through the caches cost
// ~120 us. This is one call of a few microseconds.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "greedy_argmax.h"

namespace {

at::Tensor greedy_argmax(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous() &&
                  logits.device().is_cpu() && logits.size(1) > 0,
              "greedy_argmax: logits must be a contiguous float32 CPU tensor [M, N], N > 0");
  TORCH_CHECK(logits.size(1) <= kArgmaxMaxValues, "greedy_argmax: rows of more than ",
              kArgmaxMaxValues, " values");
  const int64_t M = logits.size(0), N = logits.size(1);
  at::Tensor out = at::empty({M}, logits.options().dtype(at::kLong));
  const float* x = logits.data_ptr<float>();
  int64_t* indices = out.data_ptr<int64_t>();
  // a few rows on the calling thread (one row: a few microseconds, less than a fork)
  at::parallel_for(0, M, std::max<int64_t>(1, 262144 / N), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) indices[r] = range_argmax(x + r * N, 0, N).index;
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(splitfuse_cpu, m) { m.def("greedy_argmax(Tensor logits) -> Tensor"); }

TORCH_LIBRARY_IMPL(splitfuse_cpu, CPU, m) { m.impl("greedy_argmax", greedy_argmax); }
