// The 4-bit product of int4_linear.cpp on AMX tiles (CPUs with AMX-BF16), for the rows of a
// step's prompt tokens (int4_linear.cpp says which): a column block's weights are dequantized
// to bfloat16 once per call, into a panel laid out as TDPBF16PS reads its second operand, and
// every 16 rows of x (bfloat16) multiply that panel in float32 sums. The same tiles multiply
// bfloat16 weights in oneDNN's blocked layout in place (blocked_linear.cpp, blocked_silu_mul of
// decode_stack.cpp). No torch here: the operators call it on raw pointers (int4_amx.cpp).
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

// amx_int4_columns with out [M, N] bfloat16 bits: each float32 sum rounded to nearest even, as
// torch rounds the float32 result (int4_linear asked for x's dtype: no float32 result to write,
// read back and round in another pass).
void amx_int4_columns_bf16(const uint16_t* x16, int64_t M, int64_t K, int64_t N,
                           const uint8_t* packed, const uint16_t* scales, const uint16_t* mins,
                           int64_t group_size, int64_t block_begin, int64_t block_end,
                           uint16_t* panels, float* tile_out, uint16_t* out);

// SwiGLU's two products of one column block on the tiles: gate block `gate` and up block `up`
// (16 columns each, packed as amx_int4_columns reads them) times x16's rows, as
// amx_int4_columns computes each (the same bits), 32 rows at a time. Row r's 16 gate sums and
// 16 up sums (float32) go to each_row(context, r, gate, up), for every r in [0, M) in order,
// while the tiles multiply the next rows: the vector work of a row's activation then runs
// beside the tiles' products instead of after them (int4_silu_mul, 512 rows x 576 -> 2 x 1536:
// 1.31-1.57 -> 0.99-1.02 ms on 2 cores). panels: as for amx_int4_columns; sums: 2 * 4 * 256
// floats, 64-byte aligned. Same conditions as amx_int4_columns. (Writing int4_linear's rows so,
// a memcpy each, was slower than its tiles' own stores: 0.35 -> 0.41 ms for 960 columns.)
struct Int4Block {
  const uint8_t* packed;   // K * 8 bytes
  const uint16_t* scales;  // [K / group_size, 16] float16
  const uint16_t* mins;
};
void amx_int4_gate_up_rows(const uint16_t* x16, int64_t M, int64_t K, Int4Block gate,
                           Int4Block up, int64_t group_size, uint16_t* panels, float* sums,
                           void (*each_row)(void* context, int64_t row, const float* gate,
                                            const float* up),
                           void* context);

// Columns [32 pair_begin, 32 pair_end) (halves of the layout's blocks) of out [M, N] bfloat16
// bits = x16 times a bfloat16 weight in oneDNN's blocked layout [N / 64, K / 2, 64, 2]
// (blocked_linear.cpp) plus bias (bfloat16 [N] or nullptr): float32 sums over all of K on the
// tiles, the bias added, rounded once to nearest even. Each 32 rows of x (36 KB at K = 576,
// kept in the L1 cache) multiply the range's halves in turn (from the L2 cache: a range of
// some 128 KB), each turn's rounding while the tiles multiply the next. x16: bfloat16 bits
// [round_up(M, 16), K], K a multiple of 32 (the rows past M are read, never used); sums:
// 2 * 4 * 256 floats of scratch, 64-byte aligned. A row's result does not depend on the other
// rows, on M nor on the column range. Only on a thread that may use the tiles (amx_ready());
// it configures them itself.
void amx_blocked_rows(const uint16_t* x16, int64_t M, int64_t K, int64_t N,
                      const uint16_t* blocked, const uint16_t* bias, int64_t pair_begin,
                      int64_t pair_end, float* sums, uint16_t* out);

// SwiGLU's two products of a bfloat16 gate-and-up weight [2I, K] in oneDNN's blocked layout
// (as amx_blocked_rows reads it, in place; the gate's I columns first, I a multiple of 16):
// for each quarter q in [begin, end) of the gate (columns 16q .. 16q + 15) and its up quarter
// (columns I + 16q ..), row r's 16 gate and 16 up float32 sums over all of K go to
// each_row(context, r, 16q, gate, up), for every r in [0, M), while the tiles multiply the next
// rows or quarters. x16, sums and the conditions as for amx_blocked_rows.
void amx_blocked_gate_up_rows(const uint16_t* x16, int64_t M, int64_t K, const uint16_t* blocked,
                              int64_t intermediate, int64_t begin, int64_t end, float* sums,
                              void (*each_row)(void* context, int64_t row, int64_t col,
                                               const float* gate, const float* up),
                              void* context);

// Configures the calling thread's 8 tiles as 16 rows of 64 bytes each (palette 1).
void configure_full_tiles();

// The calling thread's scratch for amx_int4_columns' panels (2 * K * 16 uint16, 64-byte
// aligned), kept from call to call; nullptr where it cannot be allocated.
uint16_t* amx_panel_scratch(int64_t K);

// Gives the tiles' state back (after a thread's last amx_*_columns of a call).
void amx_release();

}  // namespace splitfuse_int4
