// int4_amx.h: the 4-bit product on AMX tiles.
//
// With VNNI a product of many rows is bound by its arithmetic: each run of 32 values of a row
// takes 8 VPDPBUSD per 16 columns and then ~5 float operations to scale its int32 sums (the
// weight group's scale and min, the row's own int8 scale), and those cannot leave the inner loop
// because every run has its own scales. Here the weight's values themselves are made once per
// call (scale q + min, rounded to bfloat16: 2^-9 of a value at most, where the integer route
// rounds x to int8, up to 1/254 of its run's largest value), so the float sums run over all of
// K inside the tiles: one TDPBF16PS multiplies 16 rows by 32 values of 16 columns (8,192
// multiply-adds), and the dequantizing (~45 instructions per 128 values) is shared by all the
// call's rows. Tried against it: the values q as they are (exact in bfloat16, made by byte
// lookups) with each group's sums leaving the tiles to take its scale and min: every group then
// waits on its tile's store, as fast as VNNI at 16-32 rows and no faster at 512.
//
// A column block's panel: K / 2 rows of 64 bytes, row p holding for each of the 16 columns the
// pair (w[2p], w[2p + 1]) as bfloat16 (TDPBF16PS's second operand), so K / 32 tiles of 1 KB one
// after the other. From PackedInt4's step s (64 bytes, 4 per column: values 8s..8s+3 in the low
// nibbles, 8s+4..8s+7 in the high ones) come panel rows 4s..4s+3. Two blocks' panels multiply 32
// rows at a time (four tiles of sums), as oneDNN's AMX kernels block theirs.

#include "int4_amx.h"

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <type_traits>
#include <utility>

namespace {

constexpr int kCols = 16;

// Linux: a process asks for the AMX tile data state before its first tile instruction
constexpr int kArchReqXcompPerm = 0x1023;
constexpr int kXfeatureXtiledata = 18;

bool ask_for_amx() {
  __builtin_cpu_init();
  // SPLITFUSE_CPU_ISA=avx512_vnni (or any narrower set) leaves the tiles out
  const char* asked = std::getenv("SPLITFUSE_CPU_ISA");
  if (asked != nullptr && asked[0] != '\0') return false;
  unsigned eax, ebx, ecx, edx;
  // CPUID leaf 7: EDX bit 22 AMX-BF16, bit 24 AMX-TILE; AVX-512 BF16 in leaf 7 subleaf 1
  __asm__ volatile("cpuid" : "=a"(eax), "=b"(ebx), "=c"(ecx), "=d"(edx) : "a"(7), "c"(0));
  const bool tiles = (edx >> 22 & 1) && (edx >> 24 & 1);
  __asm__ volatile("cpuid" : "=a"(eax), "=b"(ebx), "=c"(ecx), "=d"(edx) : "a"(7), "c"(1));
  const bool bf16 = eax >> 5 & 1;
  if (!tiles || !bf16 || !__builtin_cpu_supports("avx512bw")) return false;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

}  // namespace

bool splitfuse_int4::amx_ready() {
  static const bool ready = ask_for_amx();
  return ready;
}

uint16_t* splitfuse_int4::amx_panel_scratch(int64_t K) {
  thread_local std::unique_ptr<uint16_t, decltype(&std::free)> buffer{nullptr, &std::free};
  thread_local int64_t held = 0;
  const int64_t needed = 2 * K * 16;
  if (held < needed) {
    buffer.reset(static_cast<uint16_t*>(std::aligned_alloc(64, needed * sizeof(uint16_t))));
    held = buffer == nullptr ? 0 : needed;
  }
  return buffer.get();
}

void splitfuse_int4::amx_release() {
  if (amx_ready()) __asm__ volatile("tilerelease" ::);
}

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,f16c,amx-tile,amx-bf16")
#include "bf16_avx512.h"

namespace {

// the tiles' configuration as LDTILECFG reads it (palette 1): each tile's rows and bytes a row
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

}  // namespace

void splitfuse_int4::configure_full_tiles() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.bytes_per_row[t] = 64;
    config.rows[t] = 16;
  }
  // (LDTILECFG by hand: the intrinsic tells the compiler it reads 8 bytes of the 64, and then
  // the stores of the rows and their bytes are dropped as dead)
  __asm__ volatile("ldtilecfg %0" ::"m"(config));
}

namespace {

inline __m512 load_halves(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// pairs (a[c], b[c]) of bfloat16 (rounded to nearest even) in the 32-bit lanes c
inline __m512i pairs(__m512 a, __m512 b) {
  const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                         24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1,
                                         16, 0);
  return _mm512_permutexvar_epi16(order, (__m512i)_mm512_cvtne2ps_pbh(b, a));
}

// the 4 bytes of each lane of v as floats, times d plus m, as two panel rows: bytes (0, 1) and
// (2, 3)
inline void byte_rows(__m512i v, __m512 d, __m512 m, uint16_t* row0, uint16_t* row1) {
  const __m512i byte = _mm512_set1_epi32(0xFF);
  const __m512 f0 = _mm512_cvtepi32_ps(_mm512_and_si512(v, byte));
  const __m512 f1 = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(v, 8), byte));
  const __m512 f2 = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(v, 16), byte));
  const __m512 f3 = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 24));
  _mm512_store_si512(row0, pairs(_mm512_fmadd_ps(f0, d, m), _mm512_fmadd_ps(f1, d, m)));
  _mm512_store_si512(row1, pairs(_mm512_fmadd_ps(f2, d, m), _mm512_fmadd_ps(f3, d, m)));
}

// a 4-bit block's panel of values (scale q + min, rounded to bfloat16): K / 8 steps of 64
// bytes, each four panel rows
void int4_panel(const uint8_t* block, const uint16_t* scales, const uint16_t* mins, int64_t K,
                int64_t group_size, uint16_t* panel) {
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  const int64_t steps_per_group = group_size / 8;
  for (int64_t g = 0; g < K / group_size; ++g) {
    const __m512 d = load_halves(scales + g * kCols), m = load_halves(mins + g * kCols);
    for (int64_t s = g * steps_per_group; s < (g + 1) * steps_per_group; ++s) {
      const __m512i v = _mm512_loadu_si512(block + s * 64);
      uint16_t* rows = panel + s * 4 * 32;
      byte_rows(_mm512_and_si512(v, nibble), d, m, rows, rows + 32);
      byte_rows(_mm512_and_si512(_mm512_srli_epi16(v, 4), nibble), d, m, rows + 64, rows + 96);
    }
  }
}

// the 16 x 16 sums in tile_out as bfloat16 (bf16_avx512.h's rounding) into out's rows
// [0, rows) (N apart) and columns [0, cols)
inline void store_bf16_sums(const float* tile_out, int64_t rows, int64_t cols, int64_t N,
                            uint16_t* out) {
  const __mmask16 mask = cols >= 16 ? __mmask16(0xffff) : __mmask16((1u << cols) - 1);
  for (int64_t r = 0; r < rows; ++r)
    splitfuse_bf16::store_bf16(
        out + r * N, splitfuse_bf16::round_bf16(_mm512_load_ps(tile_out + r * kCols)), mask);
}

// tile T's 16 x 16 sums into out's rows [row, row + rows) and columns [col, col + cols) (a tile
// instruction takes its tile's number as a literal): float32 as they are, bfloat16 rounded
#define SF_STORE_SUMS(T, row, rows, col, cols)                                   \
  do {                                                                           \
    if constexpr (std::is_same_v<Out, float>) {                                  \
      if ((rows) == 16 && (cols) == kCols) {                                     \
        _tile_stored(T, out + (row) * N + (col), N * sizeof(float));             \
      } else {                                                                   \
        _tile_stored(T, tile_out, kCols * sizeof(float));                        \
        for (int64_t r = 0; r < (rows); ++r)                                     \
          std::memcpy(out + ((row) + r) * N + (col), tile_out + r * kCols,       \
                      (cols) * sizeof(float));                                   \
      }                                                                          \
    } else {                                                                     \
      _tile_stored(T, tile_out, kCols * sizeof(float));                          \
      store_bf16_sums(tile_out, rows, cols, N, out + (row) * N + (col));         \
    }                                                                            \
  } while (0)

// One strip of 32 rows of x (16 where `two` is false) times the panels p0 and p1 (`pair` false:
// p0 alone) on the tiles: tiles 0-3 the sums of (rows 0-15, p0), (0-15, p1), (16-31, p0),
// (16-31, p1); 4-5 x's rows, 6-7 the panels. meanwhile() runs after each step of K (32 values),
// while the tiles multiply.
// SF_LOAD_PANEL: tile T = a panel whose rows are `panel_stride` bytes apart: 64 for the panels
// made here, which every 32 rows of x read again; 256 for a quarter of a bfloat16 weight's
// block read in place (amx_blocked_rows), which 32 rows of x read once before the next
// quarters: that load carries the non-temporal hint (TILELOADDT1), so that the weight's stream
// does not push the rows of x out of the L1 cache (the default model's 4 products of a layer,
// 512 rows on 2 cores of an Intel Xeon: 1.53 -> 1.42-1.44 ms; 256 rows 0.88-0.90 -> 0.76-0.77).
// (a macro: a tile instruction takes its tile's number as a literal)
#define SF_LOAD_PANEL(T, panel, panel_stride)     \
  do {                                           \
    if ((panel_stride) == 64)                    \
      _tile_loadd(T, panel, 64);                 \
    else                                         \
      _tile_stream_loadd(T, panel, panel_stride); \
  } while (0)

// A panel's rows are `panel_stride` bytes apart (SF_LOAD_PANEL).
template <typename Meanwhile>
inline void multiply_strip(const uint16_t* x, int64_t K, const uint16_t* p0, const uint16_t* p1,
                           bool pair, bool two, const Meanwhile& meanwhile,
                           int64_t panel_stride = 64) {
  const int64_t stride = K * sizeof(uint16_t), step = panel_stride / 4;  // values a step of K
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t k = 0; k < K; k += 32) {
    _tile_loadd(4, x + k, stride);
    SF_LOAD_PANEL(6, p0 + k * step, panel_stride);
    _tile_dpbf16ps(0, 4, 6);
    if (pair) {
      SF_LOAD_PANEL(7, p1 + k * step, panel_stride);
      _tile_dpbf16ps(1, 4, 7);
    }
    if (two) {
      _tile_loadd(5, x + 16 * K + k, stride);
      _tile_dpbf16ps(2, 5, 6);
      if (pair) _tile_dpbf16ps(3, 5, 7);
    }
    meanwhile();
  }
}

// out's columns [col, col + 32) (those below N; `pair` false: [col, col + 16)) = x times the
// panels p0 and p1 (the next block's), 32 rows at a time (multiply_strip)
template <typename Out>
void multiply_panels(const uint16_t* x16, int64_t M, int64_t K, int64_t N, const uint16_t* p0,
                     const uint16_t* p1, bool pair, int64_t col, float* tile_out, Out* out) {
  const int64_t cols0 = std::min<int64_t>(kCols, N - col);
  const int64_t cols1 = pair ? std::min<int64_t>(kCols, N - col - kCols) : 0;
  for (int64_t r0 = 0; r0 < M; r0 += 32) {
    const bool two = r0 + 16 < M;
    multiply_strip(x16 + r0 * K, K, p0, p1, pair, two, [] {});
    const int64_t rows0 = std::min<int64_t>(16, M - r0), rows1 = std::min<int64_t>(16, M - r0 - 16);
    SF_STORE_SUMS(0, r0, rows0, col, cols0);
    if (pair) SF_STORE_SUMS(1, r0, rows0, col + kCols, cols1);
    if (two) {
      SF_STORE_SUMS(2, r0 + 16, rows1, col, cols0);
      if (pair) SF_STORE_SUMS(3, r0 + 16, rows1, col + kCols, cols1);
    }
  }
}

#undef SF_STORE_SUMS

// Units [begin, end) of a product, each two panels of 16 columns (panels(u): a pair of
// pointers, rows panel_stride bytes apart, SF_LOAD_PANEL): each 32 rows of x (36 KB at K = 576,
// kept in the L1 cache) multiply the range's units in turn (a blocked weight's from the L2
// cache: a range of some 128 KB), and each turn's sums go to row(u, r, sums of p0, sums of p1)
// for its rows r while the tiles multiply the next turn: the vector work of a row's rounding or
// activation then runs beside the tiles' products instead of after them. sums: 2 * 4 * 256
// floats, 64-byte aligned.
template <typename Panels, typename Row>
void turns_on_tiles(const uint16_t* x16, int64_t M, int64_t K, int64_t begin, int64_t end,
                    int64_t panel_stride, float* sums, const Panels& panels, const Row& row) {
  // a turn's sums in sums[turn % 2] (4 tiles: rows 0-15 of p0, 0-15 of p1, 16-31 of p0, 16-31
  // of p1), handed on a few rows at each step of K of the next turn
  const int64_t steps = K / 32, per_step = (32 + steps - 1) / steps;
  int64_t pending = 0, pending_end = 0, pending_unit = 0;  // the rows not yet handed on
  const float* pending_sums = sums;
  const auto hand_on = [&](int64_t count) {
    for (; count > 0 && pending < pending_end; --count, ++pending) {
      const int64_t r = pending & 31;
      const float* tiles = pending_sums + (r >> 4) * 2 * 256 + (r & 15) * kCols;
      row(pending_unit, pending, tiles, tiles + 256);
    }
  };
  int64_t turn = 0;
  for (int64_t r0 = 0; r0 < M; r0 += 32) {
    const bool two = r0 + 16 < M;
    for (int64_t u = begin; u < end; ++u, ++turn) {
      const auto [p0, p1] = panels(u);
      multiply_strip(x16 + r0 * K, K, p0, p1, true, two, [&] { hand_on(per_step); },
                     panel_stride);
      hand_on(pending_end - pending);
      float* strip = sums + (turn & 1) * 4 * 256;
      _tile_stored(0, strip, kCols * sizeof(float));
      _tile_stored(1, strip + 256, kCols * sizeof(float));
      if (two) {
        _tile_stored(2, strip + 512, kCols * sizeof(float));
        _tile_stored(3, strip + 768, kCols * sizeof(float));
      }
      pending = r0;
      pending_end = std::min(M, r0 + 32);
      pending_unit = u;
      pending_sums = strip;
    }
  }
  hand_on(pending_end - pending);
}

}  // namespace

void splitfuse_int4::amx_int4_gate_up_rows(const uint16_t* x16, int64_t M, int64_t K,
                                           Int4Block gate, Int4Block up, int64_t group_size,
                                           uint16_t* panels, float* sums,
                                           void (*each_row)(void*, int64_t, const float*,
                                                            const float*),
                                           void* context) {
  configure_full_tiles();
  uint16_t* p0 = panels;
  uint16_t* p1 = panels + K * kCols;
  int4_panel(gate.packed, gate.scales, gate.mins, K, group_size, p0);
  int4_panel(up.packed, up.scales, up.mins, K, group_size, p1);
  turns_on_tiles(
      x16, M, K, 0, 1, 64, sums, [&](int64_t) { return std::pair{p0, p1}; },
      [&](int64_t, int64_t r, const float* gate_sums, const float* up_sums) {
        each_row(context, r, gate_sums, up_sums);
      });
}

namespace {

template <typename Out>
void columns_on_tiles(const uint16_t* x16, int64_t M, int64_t K, int64_t N,
                      const uint8_t* packed, const uint16_t* scales, const uint16_t* mins,
                      int64_t group_size, int64_t block_begin, int64_t block_end,
                      uint16_t* panels, float* tile_out, Out* out) {
  // every tile 16 rows of 64 bytes: 0-3 sums, 4-5 rows of x, 6-7 panels (multiply_panels)
  splitfuse_int4::configure_full_tiles();
  const int64_t groups = K / group_size;
  uint16_t* p0 = panels;
  uint16_t* p1 = panels + K * kCols;
  for (int64_t b = block_begin; b < block_end; b += 2) {
    const bool pair = b + 1 < block_end;
    int4_panel(packed + b * K * 8, scales + b * groups * kCols, mins + b * groups * kCols, K,
               group_size, p0);
    if (pair)
      int4_panel(packed + (b + 1) * K * 8, scales + (b + 1) * groups * kCols,
                 mins + (b + 1) * groups * kCols, K, group_size, p1);
    multiply_panels(x16, M, K, N, p0, p1, pair, b * kCols, tile_out, out);
  }
}

}  // namespace

void splitfuse_int4::amx_int4_columns(const uint16_t* x16, int64_t M, int64_t K, int64_t N,
                                      const uint8_t* packed, const uint16_t* scales,
                                      const uint16_t* mins, int64_t group_size,
                                      int64_t block_begin, int64_t block_end, uint16_t* panels,
                                      float* tile_out, float* out) {
  columns_on_tiles(x16, M, K, N, packed, scales, mins, group_size, block_begin, block_end, panels,
                   tile_out, out);
}

void splitfuse_int4::amx_int4_columns_bf16(const uint16_t* x16, int64_t M, int64_t K, int64_t N,
                                           const uint8_t* packed, const uint16_t* scales,
                                           const uint16_t* mins, int64_t group_size,
                                           int64_t block_begin, int64_t block_end,
                                           uint16_t* panels, float* tile_out, uint16_t* out) {
  columns_on_tiles(x16, M, K, N, packed, scales, mins, group_size, block_begin, block_end, panels,
                   tile_out, out);
}

// bfloat16 weights in oneDNN's blocked layout [N / 64, K / 2, 64, 2] (blocked_linear.cpp): a
// 64-column block's quarter j, columns 16j .. 16j + 15, is a panel as TDPBF16PS reads it with
// rows 256 bytes apart (pair row p at block + p * 128 + j * 32 values), so the tiles read the
// packed weight in place, without a copy.

namespace {

// quarter q of a blocked weight: block q / 4, its columns 16 (q % 4) .. on
inline const uint16_t* quarter(const uint16_t* blocked, int64_t K, int64_t q) {
  return blocked + (q / 4) * K * 64 + (q % 4) * 32;
}

}  // namespace

void splitfuse_int4::amx_blocked_rows(const uint16_t* x16, int64_t M, int64_t K, int64_t N,
                                      const uint16_t* blocked, const uint16_t* bias,
                                      int64_t pair_begin, int64_t pair_end, float* sums,
                                      uint16_t* out) {
  // the bias of 16 columns from c as float32 (bfloat16 -> float32: a shift of the bits)
  const auto widen = [&](int64_t c) {
    return bias == nullptr ? _mm512_setzero_ps()
                           : _mm512_castsi512_ps(_mm512_slli_epi32(
                                 _mm512_cvtepu16_epi32(_mm256_loadu_si256(
                                     reinterpret_cast<const __m256i*>(bias + c))),
                                 16));
  };
  int64_t bias_pair = -1;
  __m512 bias0 = _mm512_setzero_ps(), bias1 = bias0;
  configure_full_tiles();
  turns_on_tiles(
      x16, M, K, pair_begin, pair_end, 256, sums,
      [&](int64_t pair) {
        return std::pair{quarter(blocked, K, 2 * pair), quarter(blocked, K, 2 * pair + 1)};
      },
      [&](int64_t pair, int64_t r, const float* lo, const float* hi) {
        if (pair != bias_pair) {
          bias_pair = pair;
          bias0 = widen(pair * 32);
          bias1 = widen(pair * 32 + kCols);
        }
        uint16_t* at = out + r * N + pair * 32;
        splitfuse_bf16::store_bf16(
            at, splitfuse_bf16::round_bf16(_mm512_add_ps(_mm512_load_ps(lo), bias0)), 0xffff);
        splitfuse_bf16::store_bf16(
            at + kCols, splitfuse_bf16::round_bf16(_mm512_add_ps(_mm512_load_ps(hi), bias1)),
            0xffff);
      });
}

void splitfuse_int4::amx_blocked_gate_up_rows(const uint16_t* x16, int64_t M, int64_t K,
                                              const uint16_t* blocked, int64_t intermediate,
                                              int64_t begin, int64_t end, float* sums,
                                              void (*each_row)(void*, int64_t, int64_t,
                                                               const float*, const float*),
                                              void* context) {
  const int64_t up = intermediate / kCols;  // the up's first quarter
  configure_full_tiles();
  turns_on_tiles(
      x16, M, K, begin, end, 256, sums,
      [&](int64_t q) { return std::pair{quarter(blocked, K, q), quarter(blocked, K, up + q)}; },
      [&](int64_t q, int64_t r, const float* gate, const float* up_sums) {
        each_row(context, r, q * kCols, gate, up_sums);
      });
}

#pragma GCC pop_options
