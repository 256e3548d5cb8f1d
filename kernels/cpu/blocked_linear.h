// What blocked_linear.cpp shares with the other operators of kernels/cpu/ (decode_stack.cpp):
// the product of a few bfloat16 rows with one block of a weight in oneDNN's blocked layout, to
// call on raw pointers from a parallel region of the caller's own.
#pragma once

#include <cstdint>

namespace splitfuse_blocked {

constexpr int64_t kBlockCols = 64;  // output columns per block

// Whether the CPU runs the kernel (AVX-512 BF16).
bool runs_here();

// out[m, 0:64] (rows ldo apart, bfloat16 bits) = x [M, K] (bfloat16 bits, rows contiguous) times
// one block [K / 2, 64, 2] of the weight: float32 sums, rounded once, as blocked_linear gives
// them whatever the other blocks and rows of its call. Only where runs_here().
void block_product(const uint16_t* x, int64_t M, int64_t K, const uint16_t* block,
                   uint16_t* out, int64_t ldo);

}  // namespace splitfuse_blocked
