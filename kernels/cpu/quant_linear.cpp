// splitfuse_cpu::quant_linear: x [M, K] (float32 or bfloat16) times an 8-bit weight-only quantized
// [N, K] weight (symmetric, float16 scales per group), out [M, N] float32: the LM head and the
// int8 layers. Threads share the output columns; the weight's bytes are read once per call,
// which is what bounds a decode step. (4-bit weights: int4_linear.cpp.)
//   one row:   the weight is dequantized in registers and multiplied at once (gemv_8bit)
//   more rows: a tile of weight rows is dequantized into a per-thread buffer in the L1 cache and
//              multiplied with every row of x (float32), or, for bfloat16 x on CPUs with
//              AVX-512 BF16, rounded to bfloat16 and multiplied with VDPBF16PS
// The body is compiled for AVX-512, AVX2 and SSE2, and the widest one the CPU runs is picked once.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include "float16_bits.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")
namespace splitfuse_avx512 {
#define SF_LANES 16
#define SF_ROW_TILE 4
typedef float vfloat __attribute__((vector_size(64)));
typedef int32_t vint __attribute__((vector_size(64)));
static inline float lane_sum(vfloat v) { return _mm512_reduce_add_ps((__m512)v); }
static inline void halves_to_floats(const uint16_t* in, int64_t n, float* out) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(
        out + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + i))));
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(
        out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i))));
  for (; i < n; ++i) out[i] = _cvtsh_ss(in[i]);
}
static inline vint load_s8(const int8_t* p) {
  return (vint)_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
#include "quant_linear_body.h"
#undef SF_LANES
#undef SF_ROW_TILE
}  // namespace splitfuse_avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace splitfuse_avx2 {
#define SF_LANES 8
#define SF_ROW_TILE 2
typedef float vfloat __attribute__((vector_size(32)));
typedef int32_t vint __attribute__((vector_size(32)));
static inline float lane_sum(vfloat v) {
  __m128 half = _mm_add_ps(_mm256_castps256_ps128((__m256)v), _mm256_extractf128_ps((__m256)v, 1));
  half = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(half, _mm_movehdup_ps(half)));
}
static inline void halves_to_floats(const uint16_t* in, int64_t n, float* out) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(
        out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i))));
  for (; i < n; ++i) out[i] = _cvtsh_ss(in[i]);
}
static inline vint load_s8(const int8_t* p) {
  return (vint)_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
#include "quant_linear_body.h"
#undef SF_LANES
#undef SF_ROW_TILE
}  // namespace splitfuse_avx2
#pragma GCC pop_options

// Rows of bfloat16 x on CPUs with AVX-512 BF16: the weight tile is dequantized and rounded to
// bfloat16 (the numbers a bfloat16 copy of the float weights holds) and multiplied with
// VDPBF16PS, two products per lane per instruction, float32 sums.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c,avx512bf16")
namespace splitfuse_avx512_bf16 {

static void floats_to_bf16(const float* in, int64_t n, uint16_t* out) {
  for (int64_t i = 0; i < n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(in + i)));
}

// The lane sums of four vectors at once, as [sum(a[0]), .., sum(a[3])]: pairs of vectors are
// interleaved and added, twice, then the four 128-bit quarters (9 instructions, not 4 x 8).
static inline __m128 sum_lanes_of_4(const __m512* a) {
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a[0], a[1]), _mm512_unpackhi_ps(a[0], a[1]));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(a[2], a[3]), _mm512_unpackhi_ps(a[2], a[3]));
  // per 128-bit quarter: [a, b, a, b] + [c, d, c, d] interleaved by pairs -> [a, b, c, d]
  const __m512 abcd = _mm512_add_ps(
      _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))),
      _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))));
  const __m512 halves = _mm512_add_ps(abcd, _mm512_shuffle_f32x4(abcd, abcd, 0x4E));
  const __m512 quarters = _mm512_add_ps(halves, _mm512_shuffle_f32x4(halves, halves, 0xB1));
  return _mm512_castps512_ps128(quarters);
}

template <int ROWS, int COLS>
static void micro_kernel(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t K, float* out,
                         int64_t ldo) {
  __m512 acc[ROWS][COLS];
  for (int r = 0; r < ROWS; ++r)
    for (int c = 0; c < COLS; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    __m512bh wv[COLS];
    for (int c = 0; c < COLS; ++c) wv[c] = (__m512bh)_mm512_loadu_si512(w + c * K + k);
    for (int r = 0; r < ROWS; ++r) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + r * ldx + k);
      for (int c = 0; c < COLS; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xv, wv[c]);
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    if constexpr (COLS == 4) {
      _mm_storeu_ps(out + r * ldo, sum_lanes_of_4(acc[r]));
    } else {
      for (int c = 0; c < COLS; ++c) out[r * ldo + c] = _mm512_reduce_add_ps(acc[r][c]);
    }
  }
}

template <int COLS>
static void all_rows(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, float* out,
                     int64_t ldo) {
  int64_t r = 0;
  for (; r + 4 <= M; r += 4) micro_kernel<4, COLS>(x + r * K, K, w, K, out + r * ldo, ldo);
  switch (M - r) {
    case 3: micro_kernel<3, COLS>(x + r * K, K, w, K, out + r * ldo, ldo); break;
    case 2: micro_kernel<2, COLS>(x + r * K, K, w, K, out + r * ldo, ldo); break;
    case 1: micro_kernel<1, COLS>(x + r * K, K, w, K, out + r * ldo, ldo); break;
    default: break;
  }
}

// As quant_linear_columns, x in bfloat16. The columns go in chunks of kChunk: a chunk's weight
// rows are dequantized once into `weights` (kChunk * K bfloat16s, in the L2 cache), then
// multiplied with blocks of x rows small enough for the L1 cache, so that neither the weight
// nor x is read from further away once per output tile. `buffer` holds K + K / group_size
// floats.
constexpr int64_t kChunk = 256;

static void quant_linear_columns(const uint16_t* x, int64_t M, int64_t K, int64_t N,
                                 const int8_t* qweight, const uint16_t* scales,
                                 int64_t group_size, int64_t col_begin, int64_t col_end,
                                 float* buffer, uint16_t* weights, float* out) {
  const int64_t num_groups = K / group_size;
  float* row_scales = buffer + K;
  const int64_t block_rows = std::max<int64_t>(4, (24 * 1024 / (2 * K)) / 4 * 4);
  for (int64_t chunk = col_begin; chunk < col_end; chunk += kChunk) {
    const int64_t chunk_end = std::min(chunk + kChunk, col_end);
    for (int64_t row = chunk; row < chunk_end; ++row) {
      splitfuse_avx512::halves_to_floats(scales + row * num_groups, num_groups, row_scales);
      splitfuse_avx512::dequantize_row_8bit(qweight + row * K, row_scales, K, group_size, buffer);
      floats_to_bf16(buffer, K, weights + (row - chunk) * K);
    }
    for (int64_t r0 = 0; r0 < M; r0 += block_rows) {
      const int64_t rows = std::min(block_rows, M - r0);
      for (int64_t n = chunk; n < chunk_end; n += 4) {
        const uint16_t* w = weights + (n - chunk) * K;
        float* o = out + r0 * N + n;
        switch (std::min<int64_t>(4, chunk_end - n)) {
          case 4: all_rows<4>(x + r0 * K, rows, K, w, o, N); break;
          case 3: all_rows<3>(x + r0 * K, rows, K, w, o, N); break;
          case 2: all_rows<2>(x + r0 * K, rows, K, w, o, N); break;
          default: all_rows<1>(x + r0 * K, rows, K, w, o, N); break;
        }
      }
    }
  }
}

}  // namespace splitfuse_avx512_bf16
#pragma GCC pop_options

namespace splitfuse_sse2 {
#define SF_LANES 4
#define SF_ROW_TILE 2
typedef float vfloat __attribute__((vector_size(16)));
typedef int32_t vint __attribute__((vector_size(16)));
static inline float lane_sum(vfloat v) { return (v[0] + v[2]) + (v[1] + v[3]); }
static inline void halves_to_floats(const uint16_t* in, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = half_to_float(in[i]);
}
static inline vint load_s8(const int8_t* p) { return (vint){p[0], p[1], p[2], p[3]}; }
#include "quant_linear_body.h"
#undef SF_LANES
#undef SF_ROW_TILE
}  // namespace splitfuse_sse2

namespace {

using ColumnsFn = void (*)(const float*, int64_t, int64_t, int64_t, const int8_t*,
                           const uint16_t*, int64_t, int64_t, int64_t, float*, float*);

// The widest body the CPU runs; SPLITFUSE_CPU_ISA=avx2 or sse2 asks for a narrower one (tests
// run every body on one machine).
ColumnsFn pick_columns_fn() {
  __builtin_cpu_init();
  const char* asked = std::getenv("SPLITFUSE_CPU_ISA");
  const std::string limit = asked == nullptr ? "" : asked;
  if (limit == "sse2") return splitfuse_sse2::quant_linear_columns;
  if (limit != "avx2" && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
    return splitfuse_avx512::quant_linear_columns;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c"))
    return splitfuse_avx2::quant_linear_columns;
  return splitfuse_sse2::quant_linear_columns;
}

const ColumnsFn columns_fn = pick_columns_fn();
// bfloat16 rows multiply in bfloat16 where the CPU has AVX-512 BF16 and the AVX-512 body runs
const bool bf16_dot = columns_fn == splitfuse_avx512::quant_linear_columns &&
                      __builtin_cpu_supports("avx512bf16");

std::string instruction_set() {
  if (bf16_dot) return "avx512_bf16";
  if (columns_fn == splitfuse_avx512::quant_linear_columns) return "avx512";
  if (columns_fn == splitfuse_avx2::quant_linear_columns) return "avx2";
  return "sse2";
}

// Output columns [col_begin, col_end) of out [M, N] (col_begin a multiple of 4, the tiles):
// x_bf16, the bits of bfloat16 rows that multiply as bfloat16 (VDPBF16PS), or else x_float,
// x's values as float32.
void quant_linear_range(const float* x_float, const uint16_t* x_bf16, int64_t M, int64_t K,
                        int64_t N, const int8_t* qweight, const uint16_t* scales,
                        int64_t group_size, int64_t col_begin, int64_t col_end, float* out) {
  if (col_begin >= col_end) return;
  const int64_t num_groups = K / group_size;
  if (x_bf16 != nullptr) {  // bfloat16 rows: VDPBF16PS
    std::vector<float> buffer(K + num_groups);
    // uninitialized: every element is written before it is read (a zeroed vector cleared up to
    // 768 KB a call, ~2% of a 32-row step's products)
    // (new T[n], not C++20's make_unique_for_overwrite: torch before 2.13 builds as C++17)
    const std::unique_ptr<uint16_t[]> weights(new uint16_t[splitfuse_avx512_bf16::kChunk * K]);
    splitfuse_avx512_bf16::quant_linear_columns(x_bf16, M, K, N, qweight, scales, group_size,
                                                col_begin, col_end, buffer.data(), weights.get(),
                                                out);
    return;
  }
  std::vector<float> buffer(4 * (K + num_groups));
  columns_fn(x_float, M, K, N, qweight, scales, group_size, col_begin, col_end, buffer.data(),
             out);
}

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                        int64_t group_size) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "quant_linear: x must be a contiguous float32 or bfloat16 [M, K] tensor");
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0);
  TORCH_CHECK(group_size > 0 && group_size % 32 == 0 && K % group_size == 0,
              "quant_linear: group_size ", group_size, " must be a multiple of 32 dividing K=", K);
  TORCH_CHECK(qweight.dim() == 2 && qweight.is_contiguous() && qweight.size(1) == K &&
                  qweight.scalar_type() == at::kChar,
              "quant_linear: qweight must be contiguous int8 [N, K] (8-bit weights)");
  const int64_t num_groups = K / group_size;
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() && scales.dim() == 2 &&
                  scales.size(0) == N && scales.size(1) == num_groups,
              "quant_linear: scales must be contiguous float16 [N, K/group_size]");
  TORCH_CHECK(x.device().is_cpu() && qweight.device().is_cpu(), "quant_linear: CPU tensors only");

  at::Tensor out = at::empty({M, N}, x.options().dtype(at::kFloat));
  if (M == 0 || N == 0) return out;
  // float32 sums of exact products: x widened to float32 (exact from bfloat16), or, for more
  // than one bfloat16 row where the CPU has AVX-512 BF16, its bits multiplied with VDPBF16PS
  const bool as_bf16 = x.scalar_type() == at::kBFloat16 && M > 1 && bf16_dot;
  const uint16_t* x_bf16 =
      as_bf16 ? reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()) : nullptr;
  const at::Tensor x_float = as_bf16 ? at::Tensor() : x.to(at::kFloat).contiguous();
  const float* x_float_ptr = x_float.defined() ? x_float.data_ptr<float>() : nullptr;
  const int8_t* q_ptr = qweight.data_ptr<int8_t>();
  const auto* s_ptr = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  float* out_ptr = out.data_ptr<float>();
  // Threads share the output columns in whole tiles of 4 (a tile's rows are dequantized once).
  const int64_t num_tiles = (N + 3) / 4;
  const int64_t grain = std::max<int64_t>(1, 4096 / std::max<int64_t>(K, 1));
  at::parallel_for(0, num_tiles, grain, [&](int64_t begin, int64_t end) {
    quant_linear_range(x_float_ptr, x_bf16, M, K, N, q_ptr, s_ptr, group_size, begin * 4,
                       std::min(end * 4, N), out_ptr);
  });
  return out;
}

}  // namespace


TORCH_LIBRARY(splitfuse_cpu, m) {
  m.def("quant_linear(Tensor x, Tensor qweight, Tensor scales, int group_size) -> Tensor");
  m.def("instruction_set() -> str", [] { return instruction_set(); });
}

TORCH_LIBRARY_IMPL(splitfuse_cpu, CPU, m) { m.impl("quant_linear", quant_linear); }
