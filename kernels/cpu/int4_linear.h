// What int4_linear.cpp shares with the other operators of kernels/cpu/ (decode_stack.cpp): the
// kernels of the 4-bit product (and of the packed 8-bit one) for the widest instruction set the
// CPU runs, to call on raw pointers from a parallel region of the caller's own, and x's rows as
// the integer products and the AMX tiles read them.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>

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

// The first row of a step's prompt tokens for the calling thread's products (int4_linear.cpp,
// set_int4_tile_from); INT64_MAX where none is set.
int64_t tile_rows_from();

}  // namespace splitfuse_int4
