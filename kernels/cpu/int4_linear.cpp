// splitfuse_cpu::int4_linear: x [M, K] (float32 or bfloat16) times a 4-bit weight packed for
// integer dot products (engine/quantization.py, PackedInt4), out [M, N] float32.
//
// x is quantized first, per row and run of 32 values, to int8 with one float scale (as
// llama.cpp's Q8 blocks do for its 4-bit dot products); then each run of 32 multiplies the
// weight's 4-bit values (0..15) in int32 sums, and the weight's group scale and min apply once
// per run:
//   out[m, n] = sum_runs  scale_w[n, g] * d_x[m, run] * (sum_k q_w[n, k] q_x[m, k])
//                       + min_w[n, g] * s_x[m, run]                    (s_x = d_x * sum_k q_x)
// The weight is exactly the quantized one; x carries int8 rounding (relative error at most
// 1/254 of its run's largest value). With VNNI, VPDPBUSD adds 4 byte products per lane: one
// instruction for 64 multiply-adds, against 32 for VDPBF16PS on bfloat16 and 16 for float32
// FMAs, and the 4-bit bytes are read as they lie (a mask and a shift).
//
// Packed weight [ceil(N / 16), K * 8] uint8: blocks of 16 output columns, each K / 8 steps of 64
// bytes (int4_linear_body.h); scales and mins [ceil(N / 16), K / group_size, 16] float16. Threads
// share the blocks; a block's bytes are one sequential stream.
//
// splitfuse_cpu::int8_linear: the same product for an 8-bit symmetric weight packed alike
// (engine/quantization.py, PackedInt8: [ceil(N / 16), K * 16] uint8, each value q as the byte
// q + 128; float16 scales, no mins): x rounded to int8 the same way, int32 sums of byte products
// (VPDPBUSD with VNNI). It serves the embedding and the LM head of a model whose products run
// int4_linear; int8 models keep 16/32-bit activations (quant_linear.cpp).
// The body is compiled for AVX-512 with VNNI, AVX-512, AVX2 and SSE2; the widest one the CPU
// runs is picked once (SPLITFUSE_CPU_ISA=avx512, avx2 or sse2 asks for a narrower one).
//
// Prompt tokens on AMX tiles. On CPUs with AMX-BF16 (int4_tiles()), the engine may say that
// the rows of a step from a given row on are its prompt tokens (set_int4_tile_from, a setting
// of the calling thread): int4_linear then multiplies those rows on AMX tiles instead
// (int4_amx.h), x rounded to bfloat16 times the weight's values rounded to bfloat16, float32
// sums over all of K, and the rows before it as above. A row's result depends only on its own
// values and on which of the two it is, never on the other rows: the engine makes a token's
// kind its own (a prompt token's rows always on the tiles, a generated token's never), so a
// request's tokens come out the same whatever shares its steps. 2-3x the integer products at
// the 512 rows of a prompt chunk (2 cores, the default model's weights), where the integer
// products scale every run of 32 sums on its own.
//
// Generated tokens' rows stay on VPDPBUSD, also where AMX-INT8 is at hand: TDPBSUD gives the
// same int32 sums of a run (x's int8 values times the weight's nibbles, which a packed step
// holds as two rows of the tile's B operand), and the same float32 scaling after it gives the
// same bits, but each run of 32 sums needs its own zeroed tile and a store before it can be
// scaled, and those chains of tile operations cost what the vector dot products cost: the
// default model's 120 layer products at 32 rows, tiles against VNNI in two pairs of runs, 10.7
// against 11.6 ms and 12.5 against 12.1 ms; a 32-stream engine step 23.4-24.0 against 24.5 ms.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include "float16_bits.h"
#include "int4_amx.h"
#include "int4_linear.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c,avx512vnni")
namespace int4_avx512_vnni {
#define SF_VNNI 1
#include "int4_linear_avx512.h"
#undef SF_VNNI
}  // namespace int4_avx512_vnni
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")
namespace int4_avx512 {
#define SF_VNNI 0
#include "int4_linear_avx512.h"
#undef SF_VNNI
}  // namespace int4_avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace int4_avx2 {
#include "int4_linear_avx2.h"
#define SF_ROWS_TILE avx2_rows::rows_tile
#define SF_LANES 8
#define SF_ROW_TILE 8
#define SF_COL_BLOCKS 1
#define SF_ONE_ROW_BLOCKS 2
#define SF_BYTE_DOT 0
typedef int32_t vint __attribute__((vector_size(32)));
typedef float vfloat __attribute__((vector_size(32)));
typedef uint8_t vbyte __attribute__((vector_size(32)));
typedef int16_t vpair __attribute__((vector_size(32)));
static inline vpair byte_pairs(vbyte w, int32_t x) {
  return (vpair)_mm256_maddubs_epi16((__m256i)w, _mm256_set1_epi32(x));
}
static inline vint pair_sums(vpair p) {
  return (vint)_mm256_madd_epi16((__m256i)p, _mm256_set1_epi16(1));
}
static inline vfloat load_halves(const uint16_t* p) {
  return (vfloat)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
static inline vint round_even(vfloat v) { return (vint)_mm256_cvtps_epi32((__m256)v); }
#include "int4_linear_body.h"
}  // namespace int4_avx2
#pragma GCC pop_options

namespace int4_sse2 {
#define SF_LANES 4
#define SF_ROW_TILE 2
#define SF_COL_BLOCKS 1
#define SF_ONE_ROW_BLOCKS 1
#define SF_BYTE_DOT 1
typedef int32_t vint __attribute__((vector_size(16)));
typedef float vfloat __attribute__((vector_size(16)));
typedef uint8_t vbyte __attribute__((vector_size(16)));
static inline vint dot4(vint acc, vbyte w, int32_t x) {
  int8_t xs[4];
  __builtin_memcpy(xs, &x, sizeof xs);
  for (int lane = 0; lane < 4; ++lane)
    for (int j = 0; j < 4; ++j) acc[lane] += w[4 * lane + j] * xs[j];
  return acc;
}
static inline vfloat load_halves(const uint16_t* p) {
  return (vfloat){half_to_float(p[0]), half_to_float(p[1]), half_to_float(p[2]),
                  half_to_float(p[3])};
}
static inline vint round_even(vfloat v) { return (vint)_mm_cvtps_epi32((__m128)v); }
#include "int4_linear_body.h"
}  // namespace int4_sse2

namespace {

using splitfuse_int4::Int4Kernels;
using splitfuse_int4::RoundedRows;

#define SF_KERNELS(ns, label)                                                                \
  Int4Kernels {                                                                              \
    label, ns::quantize_rows<float>, ns::quantize_rows<uint16_t>, ns::int4_columns,          \
        ns::int8_columns                                                                     \
  }

// The widest body the CPU runs; SPLITFUSE_CPU_ISA=avx512 (no VNNI), avx2 or sse2 asks for a
// narrower one (tests run every body on one machine).
Int4Kernels pick_kernels() {
  __builtin_cpu_init();
  const char* asked = std::getenv("SPLITFUSE_CPU_ISA");
  const std::string limit = asked == nullptr ? "" : asked;
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                    __builtin_cpu_supports("f16c");
  if (limit != "sse2" && limit != "avx2" && limit != "avx512" && avx512 &&
      __builtin_cpu_supports("avx512vnni"))
    return SF_KERNELS(int4_avx512_vnni, "avx512_vnni");
  if (limit != "sse2" && limit != "avx2" && avx512) return SF_KERNELS(int4_avx512, "avx512");
  if (limit != "sse2" && avx2) return SF_KERNELS(int4_avx2, "avx2");
  return SF_KERNELS(int4_sse2, "sse2");
}

const Int4Kernels kernels = pick_kernels();

}  // namespace

const Int4Kernels& splitfuse_int4::int4_kernels() { return kernels; }

// (uninitialized, as every element is written first: new T[n], not C++20's
// make_unique_for_overwrite, since torch before 2.13 builds as C++17)
splitfuse_int4::RoundedRows::RoundedRows(const at::Tensor& x) {
  const int64_t M = x.size(0), K = x.size(1), runs = K / 32;
  storage.reset(new float[M * K / 4 + 2 * M * runs]);
  q = reinterpret_cast<int8_t*>(storage.get());
  d = storage.get() + M * K / 4;
  s = d + M * runs;
  // a few rows are quantized on the calling thread (a decode step's one row: ~1 us)
  const int64_t row_grain = std::max<int64_t>(1, 16384 / K);
  if (x.scalar_type() == at::kFloat) {
    const float* x_ptr = x.data_ptr<float>();
    at::parallel_for(0, M, row_grain, [&](int64_t begin, int64_t end) {
      kernels.quantize_floats(x_ptr, K, begin, end, q, d, s);
    });
  } else {
    const auto* x_ptr = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
    at::parallel_for(0, M, row_grain, [&](int64_t begin, int64_t end) {
      kernels.quantize_bf16(x_ptr, K, begin, end, q, d, s);
    });
  }
}

at::Tensor splitfuse_int4::tile_rows(const at::Tensor& x) {
  const int64_t M = x.size(0), K = x.size(1), padded = (M + 15) / 16 * 16;
  if (x.scalar_type() == at::kBFloat16 && padded == M) return x;
  at::Tensor rows = at::zeros({padded, K}, x.options().dtype(at::kBFloat16));
  rows.narrow(0, 0, M).copy_(x);  // (float32 rounded to nearest even)
  return rows;
}

namespace {

// The checks both operators make of x, K and group_size.
void check_rows(const char* name, const at::Tensor& x, int64_t group_size) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              name, ": x must be a contiguous float32 or bfloat16 [M, K] tensor");
  const int64_t K = x.size(1);
  TORCH_CHECK(K > 0 && K % 32 == 0, name, ": K=", K, " must be a multiple of 32");
  TORCH_CHECK(group_size > 0 && group_size % 32 == 0 && K % group_size == 0, name,
              ": group_size ", group_size, " must be a multiple of 32 dividing K=", K);
  TORCH_CHECK(x.device().is_cpu(), name, ": CPU tensors only");
}

// packed: contiguous uint8 [ceil(N / 16), block_bytes], a row per block of 16 output columns
void check_packed(const char* name, const at::Tensor& packed, int64_t N, int64_t blocks,
                  int64_t block_bytes) {
  TORCH_CHECK(N > 0 && packed.dim() == 2 && packed.is_contiguous() &&
                  packed.scalar_type() == at::kByte && packed.size(0) == blocks &&
                  packed.size(1) == block_bytes && packed.device().is_cpu(),
              name, ": packed must be contiguous uint8 [ceil(N/16), ", block_bytes, "] = [",
              blocks, ", ", block_bytes, "]");
}

// scales (and mins) [ceil(N / 16), K / group_size, 16] float16
void check_block_scales(const char* name, const at::Tensor& t, int64_t blocks,
                        int64_t num_groups) {
  TORCH_CHECK(t.scalar_type() == at::kHalf && t.is_contiguous() && t.dim() == 3 &&
                  t.size(0) == blocks && t.size(1) == num_groups && t.size(2) == 16 &&
                  t.device().is_cpu(),
              name, ": scales and mins must be contiguous float16 [ceil(N/16), K/group_size, 16]");
}

// out_ptr's rows [0, M) of N float32 = x's rows rounded to int8 (RoundedRows) times a packed
// weight of `blocks` column blocks: columns(rows, block_begin, block_end, tile_out, out)
// multiplies a range of them, the threads sharing the blocks.
template <typename Columns>
void packed_product_into(const at::Tensor& x, float* out_ptr, int64_t blocks, Columns columns) {
  if (x.size(0) == 0) return;
  const RoundedRows rows(x);
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float tile_out[4 * 64];
    columns(rows, begin, end, tile_out, out_ptr);
  });
}

// packed_product_into a new [M, N] float32 tensor
template <typename Columns>
at::Tensor packed_product(const at::Tensor& x, int64_t N, int64_t blocks, Columns columns) {
  at::Tensor out = at::empty({x.size(0), N}, x.options().dtype(at::kFloat));
  packed_product_into(x, out.data_ptr<float>(), blocks, columns);
  return out;
}

// out_ptr's rows [0, M) of N float32 (or bfloat16 bits, rounded) = x's rows on AMX tiles: x as
// bfloat16 bits in rows padded to a multiple of 16 (the padding zeros), the threads taking
// pairs of column blocks in turn
template <typename Out>
void amx_int4_product(const at::Tensor& x, const uint8_t* w_ptr, const uint16_t* sc_ptr,
                      const uint16_t* mn_ptr, int64_t N, int64_t group_size, Out* out_ptr) {
  const int64_t M = x.size(0), K = x.size(1);
  const at::Tensor rows = splitfuse_int4::tile_rows(x);
  const auto* x16 = reinterpret_cast<const uint16_t*>(rows.data_ptr<at::BFloat16>());
  const int64_t blocks = (N + 15) / 16;
  splitfuse_int4::share_units((blocks + 1) / 2, [&](const auto& next) {
    alignas(64) float tile_out[16 * 16];
    uint16_t* panels = splitfuse_int4::amx_panel_scratch(K);
    TORCH_CHECK(panels != nullptr, "int4_linear: out of memory for ", 2 * K * 16, " values");
    for (int64_t pair = next(); pair >= 0; pair = next()) {
      const int64_t begin = 2 * pair, end = std::min(blocks, 2 * pair + 2);
      if constexpr (std::is_same_v<Out, float>)
        splitfuse_int4::amx_int4_columns(x16, M, K, N, w_ptr, sc_ptr, mn_ptr, group_size, begin,
                                         end, panels, tile_out, out_ptr);
      else
        splitfuse_int4::amx_int4_columns_bf16(x16, M, K, N, w_ptr, sc_ptr, mn_ptr, group_size,
                                              begin, end, panels, tile_out, out_ptr);
    }
    splitfuse_int4::amx_release();
  });
}

// the calling thread's first row of prompt tokens (set_int4_tile_from); kNoTileRows: none
constexpr int64_t kNoTileRows = INT64_MAX;
thread_local int64_t tile_from_row = kNoTileRows;

}  // namespace

int64_t splitfuse_int4::tile_rows_from() { return tile_from_row; }

namespace {

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                       const at::Tensor& mins, int64_t out_features, int64_t group_size,
                       bool round_to_x) {
  check_rows("int4_linear", x, group_size);
  const int64_t M = x.size(0), K = x.size(1), N = out_features;
  const int64_t blocks = (N + 15) / 16;
  check_packed("int4_linear", packed, N, blocks, K * 8);
  check_block_scales("int4_linear", scales, blocks, K / group_size);
  check_block_scales("int4_linear", mins, blocks, K / group_size);
  const uint8_t* w_ptr = packed.data_ptr<uint8_t>();
  const auto* sc_ptr = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  const auto* mn_ptr = reinterpret_cast<const uint16_t*>(mins.data_ptr<at::Half>());
  // rows [0, from) on the integer products, [from, M) on the tiles, into one result
  const int64_t from = splitfuse_int4::amx_ready() ? std::min(M, tile_from_row) : M;
  const auto integer_rows = [&](float* into) {
    packed_product_into(x.narrow(0, 0, from), into, blocks,
                        [&](const RoundedRows& rows, int64_t begin, int64_t end, float* tile_out,
                            float* result) {
                          kernels.columns(rows.q, rows.d, rows.s, from, K, N, w_ptr, sc_ptr,
                                          mn_ptr, group_size, begin, end, tile_out, result);
                        });
  };
  if (!round_to_x || x.scalar_type() == at::kFloat) {
    at::Tensor out = at::empty({M, N}, x.options().dtype(at::kFloat));
    float* out_ptr = out.data_ptr<float>();
    integer_rows(out_ptr);
    if (from < M)
      amx_int4_product(x.narrow(0, from, M - from), w_ptr, sc_ptr, mn_ptr, N, group_size,
                       out_ptr + from * N);
    return out;
  }
  // bfloat16 out: the integer rows' float32 results rounded as torch rounds them, the tile
  // rows' sums rounded as the tiles give them
  at::Tensor out = at::empty({M, N}, x.options());
  if (from > 0) {
    at::Tensor sums = at::empty({from, N}, x.options().dtype(at::kFloat));
    integer_rows(sums.data_ptr<float>());
    out.narrow(0, 0, from).copy_(sums);
  }
  if (from < M)
    amx_int4_product(x.narrow(0, from, M - from), w_ptr, sc_ptr, mn_ptr, N, group_size,
                     reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()) + from * N);
  return out;
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                       int64_t out_features, int64_t group_size) {
  check_rows("int8_linear", x, group_size);
  const int64_t M = x.size(0), K = x.size(1), N = out_features;
  const int64_t blocks = (N + 15) / 16;
  check_packed("int8_linear", packed, N, blocks, K * 16);
  check_block_scales("int8_linear", scales, blocks, K / group_size);
  const uint8_t* w_ptr = packed.data_ptr<uint8_t>();
  const auto* sc_ptr = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  return packed_product(x, N, blocks, [&](const RoundedRows& rows, int64_t begin, int64_t end,
                                          float* tile_out, float* out) {
    kernels.columns8(rows.q, rows.d, rows.s, M, K, N, w_ptr, sc_ptr, group_size, begin, end,
                     tile_out, out);
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(splitfuse_cpu, m) {
  // round_to_x: the result in x's dtype (bfloat16 sums rounded to nearest even), else float32
  m.def("int4_linear(Tensor x, Tensor packed, Tensor scales, Tensor mins, int out_features, "
        "int group_size, bool round_to_x=False) -> Tensor");
  m.def("int8_linear(Tensor x, Tensor packed, Tensor scales, int out_features, "
        "int group_size) -> Tensor");
  m.def("int4_instruction_set() -> str", [] { return std::string(kernels.name); });
  // whether int4_linear can multiply prompt rows on AMX tiles here (int4_amx.h)
  m.def("int4_tiles() -> bool", [] { return splitfuse_int4::amx_ready(); });
  // int4_linear calls of this thread take their rows from `row` on as prompt tokens (on AMX
  // tiles where int4_tiles()); a negative row: none. Returns the setting it replaces (-1: none).
  m.def("set_int4_tile_from(int row) -> int", [](int64_t row) {
    const int64_t before = tile_from_row == kNoTileRows ? -1 : tile_from_row;
    tile_from_row = row < 0 ? kNoTileRows : row;
    return before;
  });
}

TORCH_LIBRARY_IMPL(splitfuse_cpu, CPU, m) {
  m.impl("int4_linear", int4_linear);
  m.impl("int8_linear", int8_linear);
}
