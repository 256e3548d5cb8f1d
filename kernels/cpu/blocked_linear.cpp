// splitfuse_cpu::blocked_linear: x [M, K] bfloat16 times a bfloat16 weight held in oneDNN's
// blocked layout for AVX-512 BF16, out [M, N] bfloat16 (float32 sums, rounded once): the products
// of decode steps (up to 64 rows; engine/packed_linear.py), and with AMX tiles those of every
// step (more than 4 rows on the tiles: amx_blocked_rows of int4_amx.h, which read the same
// buffer in place).
//
// The weight is [N / 64, K / 2, 64, 2]: blocks of 64 output columns, each a run of K / 2 pairs of
// inputs for those 64 columns. It is the buffer that oneDNN packed at load time
// (engine/packed_linear.py checks the layout against the weight before giving it here), so the
// product reads the one copy of the weights there is. oneDNN's own kernels for one to a few rows
// read that buffer at ~55% of the machine's read bandwidth (121 products of the default model,
// 2 threads); this one streams each block once, front to back, and reaches ~80%:
//   per pair of inputs k, k+1: four 64-byte loads hold the 64 columns' weights, and VDPBF16PS
//   multiplies them with x[m, k:k+2] broadcast to every lane, for each row m
// so a column's sum needs no reduction across lanes, and the block's bytes are one sequential
// stream. Threads share the blocks.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include "blocked_linear.h"
#include "int4_amx.h"
#include "int4_linear.h"

#include <algorithm>
#include <cstdint>

namespace {

constexpr int64_t kBlock = 64;  // output columns per block: four vectors of 16 float32 sums
using splitfuse_blocked::kTilePanelBytes;
using splitfuse_blocked::kTileRows;

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,avx512bf16")

// Bytes ahead of its reads at which a product of one or two rows asks for the weight: the
// hardware prefetcher alone restarts on every product's (and thread's) range, and a software
// prefetch into the L2 cache (locality 2, not the L1: its few outstanding misses limit the
// stream on an AMD EPYC) keeps the stream going across blocks. The default model's 121
// products (bfloat16, 2 threads), alternated in one process: one row 10.0 -> 9.0 ms and
// 9.3 -> 8.4 ms, two rows 9.0 -> 8.6 ms; four rows and more, whose arithmetic paces the
// stream, 3-9% slower with it, so they go without.
constexpr int64_t kPrefetchBytes = 4096;

// out[m, 0:64] = x[m, :] . block + bias for ROWS rows. Each column of a row has one float32 sum,
// added pair after pair from k = 0 up whatever ROWS is, so a row's result does not depend on the
// other rows of the call (deterministic mode runs this kernel for every row count). PREFETCH:
// read the weight kPrefetchBytes ahead.
template <int ROWS, bool PREFETCH>
void block_rows(const uint16_t* x, int64_t ldx, const uint16_t* block, int64_t K,
                const uint16_t* bias, uint16_t* out, int64_t ldo) {
  __m512 acc[ROWS][4];
  for (int r = 0; r < ROWS; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 2) {
    const uint16_t* w = block + k * kBlock;
    // the 4 cache lines of a pair, kPrefetchBytes ahead (a prefetch past the weight's end
    // never faults)
    if constexpr (PREFETCH) {
      const char* ahead = reinterpret_cast<const char*>(w) + kPrefetchBytes;
      for (int j = 0; j < 4; ++j) __builtin_prefetch(ahead + 64 * j, 0, 2);
    }
    __m512bh wv[4];
    for (int j = 0; j < 4; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(w + 32 * j);
    for (int r = 0; r < ROWS; ++r) {
      int32_t pair;
      __builtin_memcpy(&pair, x + r * ldx + k, sizeof pair);
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xv, wv[j]);
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    for (int j = 0; j < 4; ++j) {
      __m512 sum = acc[r][j];
      if (bias != nullptr) {  // bfloat16 -> float32 is a shift of the bits
        const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bias + 16 * j));
        const __m512i widened = _mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16);
        sum = _mm512_add_ps(sum, _mm512_castsi512_ps(widened));
      }
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * ldo + 16 * j),
                          (__m256i)_mm512_cvtneps_pbh(sum));
    }
  }
}

// Every row of x against one block: the rows in tiles of 6 (24 sums in registers), the block
// read again for each tile after the first (from the L2 cache: 64 * K * 2 bytes).
void block_all_rows(const uint16_t* x, int64_t M, int64_t K, const uint16_t* block,
                    const uint16_t* bias, uint16_t* out, int64_t ldo) {
  if (M <= 2) {  // few rows: the stream of weights is what a product waits on
    if (M == 2) block_rows<2, true>(x, K, block, K, bias, out, ldo);
    if (M == 1) block_rows<1, true>(x, K, block, K, bias, out, ldo);
    return;
  }
  int64_t r = 0;
  for (; r + 6 <= M; r += 6)
    block_rows<6, false>(x + r * K, K, block, K, bias, out + r * ldo, ldo);
  switch (M - r) {
    case 5: block_rows<5, false>(x + r * K, K, block, K, bias, out + r * ldo, ldo); break;
    case 4: block_rows<4, false>(x + r * K, K, block, K, bias, out + r * ldo, ldo); break;
    case 3: block_rows<3, false>(x + r * K, K, block, K, bias, out + r * ldo, ldo); break;
    case 2: block_rows<2, false>(x + r * K, K, block, K, bias, out + r * ldo, ldo); break;
    case 1: block_rows<1, false>(x + r * K, K, block, K, bias, out + r * ldo, ldo); break;
    default: break;
  }
}

#pragma GCC pop_options

// Python asks whether the kernel runs here through the instruction set quant_linear.cpp picked
// (kernels/cpu_ops.py, has_blocked_linear); this guards direct calls.
const bool has_avx512_bf16 = [] {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512bf16");
}();

at::Tensor blocked_linear(const at::Tensor& x, const at::Tensor& weight,
                          const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(has_avx512_bf16, "blocked_linear: this CPU has no AVX-512 BF16");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16 &&
                  x.device().is_cpu(),
              "blocked_linear: x must be a contiguous bfloat16 [M, K] CPU tensor");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(weight.dim() == 4 && weight.is_contiguous() &&
                  weight.scalar_type() == at::kBFloat16 && weight.device().is_cpu() &&
                  weight.size(1) * 2 == K && weight.size(2) == kBlock && weight.size(3) == 2,
              "blocked_linear: weight must be a contiguous bfloat16 [N / 64, K / 2, 64, 2] CPU "
              "tensor with K = ", K);
  const int64_t N = weight.size(0) * kBlock;
  const uint16_t* bias_ptr = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->is_contiguous() &&
                    bias->scalar_type() == at::kBFloat16,
                "blocked_linear: bias must be a contiguous bfloat16 [N] tensor");
    bias_ptr = reinterpret_cast<const uint16_t*>(bias->data_ptr<at::BFloat16>());
  }
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  const auto* x_ptr = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const auto* w_ptr = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
  auto* out_ptr = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  if (splitfuse_blocked::on_tiles(M, K)) {
    const at::Tensor rows = splitfuse_int4::tile_rows(x);
    const auto* x16 = reinterpret_cast<const uint16_t*>(rows.data_ptr<at::BFloat16>());
    // units of some kTilePanelBytes of the weight, taken as each thread gets to them
    // (share_units: one of two cores that runs slower leaves its last units to the other)
    const int64_t pairs = N / 32, per_unit = splitfuse_blocked::tile_unit_pairs(K);
    splitfuse_int4::share_units((pairs + per_unit - 1) / per_unit, [&](const auto& next) {
      alignas(64) float sums[2 * 4 * 256];
      for (int64_t unit = next(); unit >= 0; unit = next())
        splitfuse_int4::amx_blocked_rows(x16, M, K, N, w_ptr, bias_ptr, unit * per_unit,
                                         std::min(pairs, (unit + 1) * per_unit), sums, out_ptr);
      splitfuse_int4::amx_release();
    });
    return out;
  }
  at::parallel_for(0, N / kBlock, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      block_all_rows(x_ptr, M, K, w_ptr + b * kBlock * K,
                     bias_ptr == nullptr ? nullptr : bias_ptr + b * kBlock, out_ptr + b * kBlock,
                     N);
  });
  return out;
}

}  // namespace

bool splitfuse_blocked::runs_here() { return has_avx512_bf16; }

bool splitfuse_blocked::on_tiles(int64_t M, int64_t K) {
  return M >= kTileRows && K % 32 == 0 && splitfuse_int4::amx_ready();
}

int64_t splitfuse_blocked::tile_unit_pairs(int64_t K) {
  return std::max<int64_t>(1, kTilePanelBytes / (K * 64));
}

void splitfuse_blocked::block_product(const uint16_t* x, int64_t M, int64_t K,
                                      const uint16_t* block, uint16_t* out, int64_t ldo) {
  block_all_rows(x, M, K, block, nullptr, out, ldo);
}

TORCH_LIBRARY_FRAGMENT(splitfuse_cpu, m) {
  m.def("blocked_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(splitfuse_cpu, CPU, m) { m.impl("blocked_linear", blocked_linear); }
