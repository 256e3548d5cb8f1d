// What int4_linear.cpp shares with the other operators of kernels/cpu/ (decode_stack.cpp): the
// kernels of the 4-bit product (and of the packed 8-bit one) for the widest instruction set the
// CPU runs, to call on raw pointers from a parallel region of the caller's own, x's rows as
// the integer products and the AMX tiles read them, and how threads share a product's column
// blocks (Claims, share_units).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <utility>

namespace splitfuse_int4 {

struct Int4Kernels {
  const char* name;  // "avx512_vnni", "avx512", "avx2" or "sse2"
  // Rows [begin, end) of x [M, K] rounded to int8 in runs of 32: values q [M, K], per run the
  // scale d and the scaled sum s [M, K / 32] (engine/quantization.py, quantize_activations).
  void (*quantize_floats)(const float* x, int64_t K, int64_t begin, int64_t end, int8_t* q,
                          float* d, float* s);
  void (*quantize_bf16)(const uint16_t* x, int64_t K, int64_t begin, int64_t end, int8_t* q,
                        float* d, float* s);
  // Column blocks [block_begin, block_end) (16 columns each) of out [M, N] float32 = the
  // quantized rows times the packed weight; tile_out: 4 * 64 floats of scratch. A column's
  // result does not depend on the block range nor on M.
  void (*columns)(const int8_t* q, const float* d, const float* s, int64_t M, int64_t K,
                  int64_t N, const uint8_t* packed, const uint16_t* scales,
                  const uint16_t* mins, int64_t group_size, int64_t block_begin,
                  int64_t block_end, float* tile_out, float* out);
  // The same for an 8-bit weight packed for these dot products (PackedInt8: no mins).
  void (*columns8)(const int8_t* q, const float* d, const float* s, int64_t M, int64_t K,
                   int64_t N, const uint8_t* packed, const uint16_t* scales, int64_t group_size,
                   int64_t block_begin, int64_t block_end, float* tile_out, float* out);
};

// Picked once, at load (SPLITFUSE_CPU_ISA=avx512, avx2 or sse2 asks for a narrower body).
const Int4Kernels& int4_kernels();

// x [M, K] (float32 or bfloat16, contiguous) rounded to int8 in runs of 32 (int4_kernels()'s
// quantize_*): values q [M, K], then per run the scales d and the scaled sums s [M, K / 32], in
// one allocation (no tensors: three a call, 120 calls a step); the threads share the rows.
struct RoundedRows {
  std::unique_ptr<float[]> storage;
  int8_t* q;
  float* d;
  float* s;

  explicit RoundedRows(const at::Tensor& x);
};

// x [M, K] as the AMX tiles read it (amx_int4_columns): bfloat16 [round_up(M, 16), K], the
// rows past M zeros (float32 rounded to nearest even); x itself where it is that already.
at::Tensor tile_rows(const at::Tensor& x);

// [begin, end) of n items for thread `me` of `threads`: contiguous shares, as at::parallel_for
inline std::pair<int64_t, int64_t> share(int64_t n, int threads, int me) {
  const int64_t chunk = (n + threads - 1) / threads;
  return {std::min(n, me * chunk), std::min(n, (me + 1) * chunk)};
}

// Work of n units (a product's column blocks, attention's items) shared out between the
// threads of a region: each takes chunks from the front of its own contiguous share (share()'s),
// and once that is done, single units from the back of the other threads' shares. A thread that
// runs slower (its core busier, its caches colder) leaves its last units to the others instead
// of making them wait at the next meeting; with even threads each computes its own share, in
// order, as before. Which thread computes a unit changes nothing in it. A share's front and back
// are one atomic word, so a unit is taken once; the meetings order the units' results.
class Claims {
 public:
  struct alignas(64) Ends {  // a share's front | back << 32
    std::atomic<uint64_t> word{0};
  };
  explicit Claims(Ends* ends) : ends_(ends) {}  // [threads] Ends the caller keeps

  // the shares of n units between `threads` threads (before the region's threads take any)
  void reset(int64_t n, int threads) {
    for (int p = 0; p < threads; ++p) {
      const auto [begin, end] = share(n, threads, p);
      ends_[p].word.store(pack(begin, end), std::memory_order_relaxed);
    }
    threads_ = threads;
  }

  // Units [begin, end) for thread `me`: up to `chunk` from its share's front, or else one from
  // the back of another's; {0, 0} when none is left.
  std::pair<int64_t, int64_t> take(int me, int64_t chunk) {
    std::atomic<uint64_t>& own = ends_[me].word;
    for (uint64_t word = own.load(std::memory_order_relaxed);;) {
      const int64_t front = front_of(word), back = back_of(word);
      if (front >= back) break;
      const int64_t end = std::min(back, front + chunk);
      if (own.compare_exchange_weak(word, pack(end, back), std::memory_order_relaxed))
        return {front, end};
    }
    for (int i = 1; i < threads_; ++i) {
      std::atomic<uint64_t>& other = ends_[(me + i) % threads_].word;
      for (uint64_t word = other.load(std::memory_order_relaxed);;) {
        const int64_t front = front_of(word), back = back_of(word);
        if (front >= back) break;
        if (other.compare_exchange_weak(word, pack(front, back - 1), std::memory_order_relaxed))
          return {back - 1, back};
      }
    }
    return {0, 0};
  }

 private:
  static uint64_t pack(int64_t front, int64_t back) {
    return static_cast<uint64_t>(front) | static_cast<uint64_t>(back) << 32;
  }
  static int64_t front_of(uint64_t word) { return static_cast<int64_t>(word & 0xffffffffu); }
  static int64_t back_of(uint64_t word) { return static_cast<int64_t>(word >> 32); }
  Ends* ends_;
  int threads_ = 1;
};

// body(next) on each of at::parallel_for's threads, next() handing out the units [0, n): a
// thread's own contiguous share in order, then single units from the back of the others'
// (Claims), -1 once none is left. A thread slowed down (its core shared, its caches colder)
// leaves its last units to the others instead of keeping them waiting at the region's end, as
// even shares did (the threads of a 4-bit prefill step spent ~15% of their time waiting so).
// What a unit computes does not depend on the thread that takes it.
template <typename Body>
void share_units(int64_t n, const Body& body) {
  const int threads = static_cast<int>(std::min<int64_t>(n, at::get_num_threads()));
  if (threads <= 0) return;
  std::unique_ptr<Claims::Ends[]> ends(new Claims::Ends[threads]);
  Claims claims(ends.get());
  claims.reset(n, threads);
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t me = begin; me < end; ++me)
      body([&]() -> int64_t {
        const auto [first, last] = claims.take(static_cast<int>(me), 1);
        return first < last ? first : -1;
      });
  });
}

// The first row of a step's prompt tokens for the calling thread's products (int4_linear.cpp,
// set_int4_tile_from); INT64_MAX where none is set.
int64_t tile_rows_from();

}  // namespace splitfuse_int4
