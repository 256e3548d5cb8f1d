// What blocked_linear.cpp shares with the other operators of kernels/cpu/ (decode_stack.cpp):
// the product of a few bfloat16 rows with one block of a weight in oneDNN's blocked layout, to
// call on raw pointers from a parallel region of the caller's own.
#pragma once

#include <cstdint>

namespace splitfuse_blocked {

constexpr int64_t kBlockCols = 64;  // output columns per block
// rows from which a product runs on AMX tiles where the CPU has them (amx_blocked_rows of
// int4_amx.h): fewer rows are bound by reading the weight, which VDPBF16PS keeps up with
constexpr int64_t kTileRows = 5;
// bytes of the weight that a unit of a tile product's work multiplies each 32 rows of x by
// (amx_blocked_rows). The default model's 4 products of a layer at 512 rows, 2 threads of an
// Intel Xeon with AMX: 64 KB 1.61 ms, 128 KB 1.33-1.42 ms, 192 KB 1.42-1.46 ms, 512 KB 1.66+ ms.
constexpr int64_t kTilePanelBytes = 128 << 10;

// Whether the CPU runs the kernel (AVX-512 BF16).
bool runs_here();

// Whether a product of M rows over K inputs runs on AMX tiles here (kTileRows rows or more, K a
// multiple of 32, tiles lent), and how many 32-column pairs of quarters of the weight (K * 64
// bytes each) make a unit of its work (some kTilePanelBytes)
bool on_tiles(int64_t M, int64_t K);
int64_t tile_unit_pairs(int64_t K);

// out[m, 0:64] (rows ldo apart, bfloat16 bits) = x [M, K] (bfloat16 bits, rows contiguous) times
// one block [K / 2, 64, 2] of the weight: float32 sums, rounded once, as blocked_linear gives
// them whatever the other blocks and rows of its call. Only where runs_here().
void block_product(const uint16_t* x, int64_t M, int64_t K, const uint16_t* block,
                   uint16_t* out, int64_t ldo);

}  // namespace splitfuse_blocked
