// What quant_linear.cpp shares with the other operators of kernels/cpu/ (decode_stack.cpp): the
// 8-bit product's work on a range of output columns, to call on raw pointers from a parallel
// region of the caller's own.
#pragma once

#include <cstdint>

namespace splitfuse_quant {

// Whether M bfloat16 rows multiply as bfloat16 (VDPBF16PS, CPUs with AVX-512 BF16) rather than
// widened to float32.
bool bf16_rows(int64_t M);

// Output columns [col_begin, col_end) of out [M, N] float32 = x [M, K] times the 8-bit weight
// [N, K] (float16 scales [N, K / group_size]), with the kernel, and so the bits, of the operator
// quant_linear on the same x: x_float holds x's values as float32 (may be null where bf16_rows);
// x_bf16, for bfloat16 x, their bits (null for float32 x). col_begin a multiple of 4 (the
// operator's tiles); inputs checked by the caller.
void quant_linear_range(const float* x_float, const uint16_t* x_bf16, int64_t M, int64_t K,
                        int64_t N, const int8_t* qweight, const uint16_t* scales,
                        int64_t group_size, int64_t col_begin, int64_t col_end, float* out);

}  // namespace splitfuse_quant
