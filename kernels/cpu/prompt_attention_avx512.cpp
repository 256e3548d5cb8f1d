// prompt_attention_avx512.cpp: a prompt chunk's causal attention in AVX-512 BF16, for CPUs with
// VDPBF16PS but no AMX tiles (AMD's Zen 4 and Zen 5).
//
// There torch's CPU flash kernel, with the masks of query chunks, took ~4 ms a layer for a
// 512-token chunk of the default model (9 heads of 64 over 3 KV heads; ~150 MFLOP, ~40 GFLOP/s),
// over a third of a prefill step. Here each KV head's context is first laid out in blocks of 32
// positions as VDPBF16PS reads them: the keys as pairs of values (2d, 2d + 1) of the block's 32
// positions (two registers per pair), the values as pairs of positions (2j, 2j + 1) of each of
// the 64 values (four registers per pair). Then every 8 query rows of a head take the key blocks
// in order:
//   - the scores S = Q K^T, each row's 32 in two registers of float32 sums, the row's pair of
//     query values broadcast from its own memory (32 VDPBF16PS a row and block);
//   - each row's online softmax: its largest score over the keys it sees, the weights
//     exp(score * scale - max) (splitfuse_exp::exp_weight), its running sum kept in 16 lanes and
//     summed once at the end, the weights rounded to bfloat16 in pairs of positions;
//   - O += P V, the row's 64 float32 outputs in four registers, rescaled by exp(old max - new
//     max), each pair of weights broadcast against the block's four value registers of that pair.
// A row's operations are the same whatever rows share its 8: a block wholly past a row's
// position is skipped for that row, and every other step runs per row in a fixed order. So a
// token's result depends only on its own query and the keys and values it sees, never on where
// its chunk begins or which tokens share its step.

#include "prompt_attention.h"

#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <new>
#include <string>
#include <type_traits>

namespace {

constexpr int64_t kDim = 64;                // a head's values
constexpr int64_t kKeys = 32;               // positions a key block
constexpr int64_t kRows = 8;                // query rows a work item
constexpr int64_t kBlockWords = 2 * kKeys * kDim / 2;  // a block's keys and values, in pairs

bool ask_for_bf16() {
  __builtin_cpu_init();
  // SPLITFUSE_CPU_ISA=avx512_bf16 picks this kernel even where AMX tiles are lent (the tiles'
  // own check leaves them out then); any other value leaves it out (SDPA)
  const char* asked = std::getenv("SPLITFUSE_CPU_ISA");
  if (asked != nullptr && asked[0] != '\0' && std::string(asked) != "avx512_bf16") return false;
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512bf16");
}

inline uint32_t pair_of(uint16_t low, uint16_t high) {
  return static_cast<uint32_t>(low) | static_cast<uint32_t>(high) << 16;
}

// Block kb of KV head kv, positions past the context zeros, into `block` (kBlockWords pairs):
//   keys   [32 value pairs][32 positions]: (k[2d], k[2d + 1]) of each position
//   values [16 position pairs][64 values]: (v_2j[d], v_2j+1[d]) of each value
void pack_block(const uint16_t* keys, const uint16_t* values, const int64_t* slot,
                int64_t row_stride, int64_t kv, int64_t kb, int64_t context_len,
                uint32_t* block) {
  uint32_t* key_pairs = block;
  uint32_t* value_pairs = block + kKeys * kDim / 2;
  const uint16_t zeros[kDim] = {};
  const uint16_t* k[kKeys];
  const uint16_t* v[kKeys];
  for (int64_t p = 0; p < kKeys; ++p) {
    const int64_t position = kb * kKeys + p;
    const bool inside = position < context_len;
    k[p] = inside ? keys + slot[position] * row_stride + kv * kDim : zeros;
    v[p] = inside ? values + slot[position] * row_stride + kv * kDim : zeros;
  }
  for (int64_t d = 0; d < kDim / 2; ++d)
    for (int64_t p = 0; p < kKeys; ++p)
      key_pairs[d * kKeys + p] = pair_of(k[p][2 * d], k[p][2 * d + 1]);
  for (int64_t j = 0; j < kKeys / 2; ++j)
    for (int64_t d = 0; d < kDim; ++d)
      value_pairs[j * kDim + d] = pair_of(v[2 * j][d], v[2 * j + 1][d]);
}

}  // namespace

bool splitfuse_prompt_avx512::ready(int64_t head_dim) {
  static const bool bf16 = ask_for_bf16();
  return head_dim == kDim && bf16;
}

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")
#include "exp_weight_avx512.h"

namespace {

using splitfuse_exp::exp_weight;

inline __m512 dot_pairs(__m512 sums, uint32_t pair, __m512i pairs) {
  return _mm512_dpbf16_ps(sums, (__m512bh)_mm512_set1_epi32(static_cast<int>(pair)),
                          (__m512bh)pairs);
}

// the lanes of a block's positions 0-15 and 16-31 that a row seeing the first `seen` (1 .. 32)
// of them sees
inline __mmask16 seen_low(int64_t seen) {
  return seen >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << seen) - 1);
}
inline __mmask16 seen_high(int64_t seen) {
  if (seen <= 16) return 0;
  return seen >= 32 ? __mmask16(0xFFFF) : __mmask16((1u << (seen - 16)) - 1);
}

// O += P V for `count` rows (1 .. 4) of a block: out[r] the rows' running outputs (4 registers
// each, already rescaled), weights[r] their 16 pairs of weights. One row's sums are the same
// instructions in the same order whatever `count` is.
template <int count>
inline void weigh_values(__m512 (*out)[4], const uint32_t (*weights)[16],
                         const uint32_t* value_pairs) {
#pragma GCC unroll 4
  for (int64_t j = 0; j < kKeys / 2; ++j) {
    const uint32_t* v = value_pairs + j * kDim;
    const __m512i v0 = _mm512_load_si512(v), v1 = _mm512_load_si512(v + 16);
    const __m512i v2 = _mm512_load_si512(v + 32), v3 = _mm512_load_si512(v + 48);
#pragma GCC unroll 4
    for (int r = 0; r < count; ++r) {
      out[r][0] = dot_pairs(out[r][0], weights[r][j], v0);
      out[r][1] = dot_pairs(out[r][1], weights[r][j], v1);
      out[r][2] = dot_pairs(out[r][2], weights[r][j], v2);
      out[r][3] = dot_pairs(out[r][3], weights[r][j], v3);
    }
  }
}

// Query rows i0 .. i0 + 7 (those below q_len) of head h over the packed context of its KV head.
void attend_rows(const uint16_t* query, int64_t query_stride, const uint32_t* head_blocks,
                 int64_t q_len, int64_t context_len, int64_t h, int64_t i0, float scale,
                 uint16_t* out, int64_t out_stride) {
  const int64_t rows = std::min(kRows, q_len - i0), first = context_len - q_len + i0;
  const float inf = std::numeric_limits<float>::infinity();
  const uint32_t* q[kRows];  // a row's 32 pairs of query values (the last row's past q_len:
                             // its scores are made, never used)
  for (int64_t r = 0; r < kRows; ++r)
    q[r] = reinterpret_cast<const uint32_t*>(query + (i0 + std::min(r, rows - 1)) * query_stride +
                                             h * kDim);
  alignas(64) float acc[kRows][kDim] = {};  // the rows' running O
  alignas(64) uint32_t weights[kRows][16];  // a block's weights in pairs of positions
  float row_max[kRows], alpha[kRows];
  __m512 row_sum[kRows];
  for (int64_t r = 0; r < kRows; ++r) {
    row_max[r] = -inf;
    row_sum[r] = _mm512_setzero_ps();
  }
  const __m512 scales = _mm512_set1_ps(scale);
  const int64_t blocks = (first + rows - 1) / kKeys + 1;
  for (int64_t kb = 0; kb < blocks; ++kb) {
    const uint32_t* key_pairs = head_blocks + kb * kBlockWords;
    const uint32_t* value_pairs = key_pairs + kKeys * kDim / 2;
    // S: each row's scores of the block's 32 positions
    __m512 low[kRows], high[kRows];
#pragma GCC unroll 8
    for (int64_t r = 0; r < kRows; ++r) low[r] = high[r] = _mm512_setzero_ps();
#pragma GCC unroll 2
    for (int64_t d = 0; d < kDim / 2; ++d) {
      const __m512i k0 = _mm512_load_si512(key_pairs + d * kKeys);
      const __m512i k1 = _mm512_load_si512(key_pairs + d * kKeys + 16);
#pragma GCC unroll 8
      for (int64_t r = 0; r < kRows; ++r) {
        low[r] = dot_pairs(low[r], q[r][d], k0);
        high[r] = dot_pairs(high[r], q[r][d], k1);
      }
    }
    // each row's online softmax over the positions it sees: rows lo .. rows - 1 see some of
    // the block (a row sees more than the rows before it)
    int64_t lo = 0;
    while (lo < rows && first + lo < kb * kKeys) ++lo;
    for (int64_t r = lo; r < rows; ++r) {
      const int64_t seen = std::min<int64_t>(first + r - kb * kKeys + 1, kKeys);
      const __mmask16 m0 = seen_low(seen), m1 = seen_high(seen);
      const __m512 s0 = _mm512_mask_mov_ps(_mm512_set1_ps(-inf), m0, low[r]);
      const __m512 s1 = _mm512_mask_mov_ps(_mm512_set1_ps(-inf), m1, high[r]);
      const float raw_max = _mm512_reduce_max_ps(_mm512_max_ps(s0, s1));
      const float new_max = std::max(row_max[r], raw_max * scale);
      const __m512 minus_max = _mm512_set1_ps(-new_max);
      // (the first block: nothing to rescale)
      alpha[r] = row_max[r] == -inf
                     ? 0.0f
                     : _mm512_cvtss_f32(exp_weight(_mm512_set1_ps(row_max[r] - new_max)));
      row_max[r] = new_max;
      const __m512 p0 =
          _mm512_maskz_mov_ps(m0, exp_weight(_mm512_fmadd_ps(s0, scales, minus_max)));
      const __m512 p1 =
          _mm512_maskz_mov_ps(m1, exp_weight(_mm512_fmadd_ps(s1, scales, minus_max)));
      row_sum[r] = _mm512_fmadd_ps(row_sum[r], _mm512_set1_ps(alpha[r]), _mm512_add_ps(p0, p1));
      _mm512_store_si512(weights[r], (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
    }
    // O = O * alpha + P V, four rows at a time, then the rest one by one
    int64_t r0 = lo;
    const auto weigh = [&](auto count) {
      constexpr int n = decltype(count)::value;
      __m512 o[n][4];
      for (int r = 0; r < n; ++r)
        for (int c = 0; c < 4; ++c)
          o[r][c] = _mm512_mul_ps(_mm512_load_ps(acc[r0 + r] + 16 * c),
                                  _mm512_set1_ps(alpha[r0 + r]));
      weigh_values<n>(o, weights + r0, value_pairs);
      for (int r = 0; r < n; ++r)
        for (int c = 0; c < 4; ++c) _mm512_store_ps(acc[r0 + r] + 16 * c, o[r][c]);
      r0 += n;
    };
    while (r0 + 4 <= rows) weigh(std::integral_constant<int, 4>());
    while (r0 < rows) weigh(std::integral_constant<int, 1>());
  }
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 inverse = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(row_sum[r]));
    uint16_t* o = out + (i0 + r) * out_stride + h * kDim;
    for (int c = 0; c < 4; ++c)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 16 * c),
                          (__m256i)_mm512_cvtneps_pbh(
                              _mm512_mul_ps(_mm512_load_ps(acc[r] + 16 * c), inverse)));
  }
}

}  // namespace

void splitfuse_prompt_avx512::attend(const uint16_t* query, int64_t query_stride,
                                     const uint16_t* keys, const uint16_t* values,
                                     const int64_t* slot, int64_t row_stride, int64_t q_len,
                                     int64_t context_len, int64_t num_heads,
                                     int64_t num_kv_heads, float scale, uint16_t* out,
                                     int64_t out_stride) {
  if (q_len <= 0) return;
  const int64_t blocks = (context_len + kKeys - 1) / kKeys;
  const int64_t head_words = blocks * kBlockWords;  // a KV head's packed context
  // 64-byte aligned: the kernel loads whole registers of pairs
  std::unique_ptr<uint32_t, decltype(&std::free)> packed(
      static_cast<uint32_t*>(std::aligned_alloc(64, num_kv_heads * head_words * 4)), &std::free);
  if (!packed) throw std::bad_alloc();
  at::parallel_for(0, num_kv_heads * blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t kv = item / blocks, kb = item % blocks;
      pack_block(keys, values, slot, row_stride, kv, kb, context_len,
                 packed.get() + kv * head_words + kb * kBlockWords);
    }
  });
  // work items (head, 8 query rows), the rows with the most keys first, taken in turn
  const int64_t row_tiles = (q_len + kRows - 1) / kRows, items = num_heads * row_tiles;
  const int64_t group = num_heads / num_kv_heads;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    for (int64_t k = next.fetch_add(1); k < items; k = next.fetch_add(1)) {
      const int64_t tile = row_tiles - 1 - k / num_heads, h = k % num_heads;
      attend_rows(query, query_stride, packed.get() + (h / group) * head_words, q_len,
                  context_len, h, tile * kRows, scale, out, out_stride);
    }
  });
}

#pragma GCC pop_options
