// The 4-bit product of int4_linear.cpp on AMX tiles (CPUs with AMX-BF16), for the rows of a
// step's prompt tokens (int4_linear.cpp says which): a column block's weights are dequantized
// to bfloat16 once per call, into a panel laid out as TDPBF16PS reads its second operand, and
// every 16 rows of x (bfloat16) multiply that panel in float32 sums. No torch here: the operator calls it on raw pointers (int4_amx.cpp).
#pragma once

#include <cstdint>

namespace splitfuse_int4 {

// True where the CPU has AMX-BF16, the kernel asks the OS for the tiles' state and gets it, and
// SPLITFUSE_CPU_ISA is not set (avx512_vnni, or a narrower set, leaves the tiles out); decided
// once.
bool amx_ready();

// Column blocks [block_begin, block_end) (16 columns each) of out [M, N] float32 = x times the
// 4-bit weight packed as for int4_linear (PackedInt4): the weight's values (scale q + min) are
// rounded to bfloat16, two column blocks at a time, and multiply x's rows in AMX tiles with
// float32 sums over all of K.
//   x16     bfloat16 bits [round_up(M, 16), K]: the rows past M are read, never used
//   panels  scratch of 2 * K * 16 uint16, 64-byte aligned; tile_out: 256 floats, 64-byte aligned
// A row's result does not depend on the other rows, on M nor on the block range. Only on a
// thread that may use the tiles (amx_ready()); it configures them itself.
void amx_int4_columns(const uint16_t* x16, int64_t M, int64_t K, int64_t N,
                      const uint8_t* packed, const uint16_t* scales, const uint16_t* mins,
                      int64_t group_size, int64_t block_begin, int64_t block_end,
                      uint16_t* panels, float* tile_out, float* out);

// Configures the calling thread's 8 tiles as 16 rows of 64 bytes each (palette 1).
void configure_full_tiles();

// The calling thread's scratch for amx_int4_columns' panels (2 * K * 16 uint16, 64-byte
// aligned), kept from call to call; nullptr where it cannot be allocated.
uint16_t* amx_panel_scratch(int64_t K);

// Gives the tiles' state back (after a thread's last amx_*_columns of a call).
void amx_release();

}  // namespace splitfuse_int4
