// prompt_attention_amx.cpp: a prompt chunk's causal attention on AMX tiles.
//
// torch's CPU flash kernel took ~23% of a 512-token prefill step of the int4 default model on
// an Intel Xeon with AMX (0.8-0.9 ms a layer for 512 x 512 causal, 9 heads of 64). Here each KV
// head's context is first laid out as the tiles read it, a block of 32 positions at a time
// (the keys' rows as they are, the values transposed); then every 16 query rows of a head take
// the key blocks in order, all in transposed form: the scores S^T = K Q^T (a tile's rows are
// keys, its 16 columns the query rows; float32 sums over the 64 values), so the online softmax
// runs down the columns in AVX-512 with no sums across lanes (each row's running max and sum,
// a short exp by VSCALEFPS, four fixed chains of sums; a block below the diagonal without its
// mask), then the weights, rounded to bfloat16 in
// pairs of keys, make the block's O^T = V^T P^T in four tiles, and the rows' float32 O^T takes
// it after its rescaling by exp(old max - new max). A block's keys multiply on the tiles while
// the vector units work on the block before. The causal mask is per position and a row's
// numbers never mix with another's, so a token's result does not depend on the rows it shares
// a tile with nor on where its chunk begins: a key block wholly past a row's position leaves its
// bits as they were (its weights 0, its rescaling exactly 1). One 512-token chunk, 9 heads over
// 3 KV heads, 2 cores: 0.50-0.52 ms against the flash kernel's 0.78-0.84.

#include "prompt_attention.h"

#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>

#include "int4_amx.h"

namespace {

constexpr int64_t kDim = 64;     // a head's values
constexpr int64_t kKeys = 32;    // positions a key block
constexpr int64_t kRows = 16;    // query rows a work item (a tile's columns)
constexpr int64_t kTile = 512;   // bfloat16 values of a 16 x 64-byte tile


// KV head kv's context in the tiles' layouts, a block of 32 positions at a time (positions past
// the context zeros):
//   keys   [blocks * 32, 64]: position p's 64 values (the first operand of K Q^T, 16 rows a
//          tile)
//   values [blocks, 4, 16, 32]: tile (block, dq), row m holds value dq * 16 + m of the block's
//          32 positions (the first operand of V^T P^T)
void pack_block(const uint16_t* keys, const uint16_t* values, const int64_t* slot,
                int64_t row_stride, int64_t kv, int64_t kb, int64_t context_len,
                uint16_t* key_out, uint16_t* value_out) {
  for (int64_t p = 0; p < kKeys; ++p) {
    const int64_t position = kb * kKeys + p;
    uint16_t* k = key_out + p * kDim;
    if (position >= context_len) {
      std::memset(k, 0, kDim * 2);
      for (int64_t d = 0; d < kDim; ++d) value_out[d * kKeys + p] = 0;
      continue;
    }
    std::memcpy(k, keys + slot[position] * row_stride + kv * kDim, kDim * 2);
    const uint16_t* v = values + slot[position] * row_stride + kv * kDim;
    for (int64_t d = 0; d < kDim; ++d) value_out[d * kKeys + p] = v[d];
  }
}

}  // namespace

bool splitfuse_prompt_amx::ready(int64_t head_dim) {
  return head_dim == kDim && splitfuse_int4::amx_ready();
}

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,amx-tile,amx-bf16")
#include "exp_weight_avx512.h"

namespace {

using splitfuse_exp::exp_weight;

// pairs (a[c], b[c]) of bfloat16 (rounded to nearest even) in the 32-bit lanes c
inline __m512i pairs(__m512 a, __m512 b) {
  const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                         24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1,
                                         16, 0);
  return _mm512_permutexvar_epi16(order, (__m512i)_mm512_cvtne2ps_pbh(b, a));
}

// Query rows i0 .. i0 + 15 (those below q_len) of head h over the packed context of its KV
// head, all in transposed form: a tile's rows are keys (or values), its 16 columns the rows'
// queries, so the online softmax works down the columns with no sums across lanes.
void attend_rows(const uint16_t* query, int64_t query_stride, const uint16_t* head_keys,
                 const uint16_t* head_values, int64_t q_len, int64_t context_len, int64_t h,
                 int64_t i0, float scale, uint16_t* out, int64_t out_stride) {
  alignas(64) uint32_t q_pairs[2 * 16 * 16];  // Q^T: tile dh, row k, column n: values 2k, 2k + 1
  alignas(64) uint32_t weights[16 * 16];      // P^T: row k, column n: weights of keys 2k, 2k + 1
  alignas(64) float block_out[kDim * kRows];  // the block's O^T [64 values][16 rows]
  alignas(64) float acc[kDim * kRows];        // the rows' running O^T
  const int64_t rows = std::min(kRows, q_len - i0), cached = context_len - q_len;
  for (int64_t n = 0; n < kRows; ++n) {
    const uint16_t* q = query + (i0 + n) * query_stride + h * kDim;
    for (int64_t k = 0; k < 32; ++k) {
      uint32_t pair = 0;
      if (n < rows) std::memcpy(&pair, q + 2 * k, sizeof pair);
      q_pairs[(k / 16) * 256 + (k % 16) * 16 + n] = pair;
    }
  }
  std::memset(acc, 0, sizeof acc);
  _tile_loadd(2, q_pairs, 64);
  _tile_loadd(3, q_pairs + 256, 64);
  const float inf = std::numeric_limits<float>::infinity();
  __m512 row_max = _mm512_set1_ps(-inf), row_sum = _mm512_setzero_ps();
  // each column's position (as floats: exact below 2^24)
  const __m512 position = _mm512_add_ps(
      _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
      _mm512_set1_ps(static_cast<float>(cached + i0)));
  const __m512 scales = _mm512_set1_ps(scale);
  const int64_t blocks = (cached + i0 + rows - 1) / kKeys + 1;
  // S^T of block kb into scores_of(kb): made a block ahead, so that the tiles multiply the next
  // block's keys while the vector units work on this one's weights
  alignas(64) float score_buffers[2][kKeys * kRows];
  const auto scores_of = [&](int64_t kb) { return score_buffers[kb & 1]; };
  const auto multiply_keys = [&](int64_t kb) {
    const uint16_t* k_rows = head_keys + kb * kKeys * kDim;
    _tile_zero(0);
    _tile_zero(1);
    _tile_loadd(4, k_rows, kDim * 2);
    _tile_loadd(5, k_rows + 32, kDim * 2);
    _tile_dpbf16ps(0, 4, 2);
    _tile_dpbf16ps(0, 5, 3);
    _tile_loadd(4, k_rows + 16 * kDim, kDim * 2);
    _tile_loadd(5, k_rows + 16 * kDim + 32, kDim * 2);
    _tile_dpbf16ps(1, 4, 2);
    _tile_dpbf16ps(1, 5, 3);
    _tile_stored(0, scores_of(kb), 64);
    _tile_stored(1, scores_of(kb) + 16 * kRows, 64);
  };
  multiply_keys(0);
  for (int64_t kb = 0; kb < blocks; ++kb) {
    if (kb + 1 < blocks) multiply_keys(kb + 1);
    const float* scores = scores_of(kb);
    // The rows' largest raw score (only the keys each sees), then their weights exp(score *
    // scale - largest * scale), the largest scaled as the rows' running max (rounding is
    // monotonic: it is the largest scaled score). A block every row sees whole (below the
    // diagonal) needs no mask; a masked block gives the keys a row sees the same bits.
    const bool whole = kb * kKeys + kKeys - 1 <= cached + i0;
    const auto seen_at = [&](int m) {
      return _mm512_cmp_ps_mask(_mm512_set1_ps(static_cast<float>(kb * kKeys + m)), position,
                                _CMP_LE_OQ);
    };
    __m512 larger[4] = {_mm512_set1_ps(-inf), _mm512_set1_ps(-inf), _mm512_set1_ps(-inf),
                        _mm512_set1_ps(-inf)};
    if (whole) {
#pragma GCC unroll 32
      for (int m = 0; m < kKeys; ++m)
        larger[m % 4] = _mm512_max_ps(larger[m % 4], _mm512_load_ps(scores + m * 16));
    } else {
#pragma GCC unroll 32
      for (int m = 0; m < kKeys; ++m)
        larger[m % 4] = _mm512_mask_max_ps(larger[m % 4], seen_at(m), larger[m % 4],
                                           _mm512_load_ps(scores + m * 16));
    }
    const __m512 raw_max =
        _mm512_max_ps(_mm512_max_ps(larger[0], larger[1]), _mm512_max_ps(larger[2], larger[3]));
    const __m512 new_max = _mm512_max_ps(row_max, _mm512_mul_ps(raw_max, scales));
    // (the first block: nothing to rescale; a block wholly past a row: exp(0) = 1 exactly)
    const __mmask16 started = _mm512_cmp_ps_mask(row_max, _mm512_set1_ps(-inf), _CMP_NEQ_OQ);
    const __m512 alpha =
        _mm512_maskz_mov_ps(started, exp_weight(_mm512_sub_ps(row_max, new_max)));
    const __m512 minus_max = _mm512_sub_ps(_mm512_setzero_ps(), new_max);
    const auto weight = [&](int m) {
      const __m512 p =
          exp_weight(_mm512_fmadd_ps(_mm512_load_ps(scores + m * 16), scales, minus_max));
      return whole ? p : _mm512_maskz_mov_ps(seen_at(m), p);
    };
    // the weights, their sums in four fixed chains, and P^T in pairs of keys
    __m512 sums[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                      _mm512_setzero_ps()};
#pragma GCC unroll 4
    for (int k = 0; k < 16; ++k) {
      const __m512 p0 = weight(2 * k), p1 = weight(2 * k + 1);
      sums[(2 * k) % 4] = _mm512_add_ps(sums[(2 * k) % 4], p0);
      sums[(2 * k + 1) % 4] = _mm512_add_ps(sums[(2 * k + 1) % 4], p1);
      _mm512_store_si512(weights + k * 16, pairs(p0, p1));
    }
    const __m512 block_sum =
        _mm512_add_ps(_mm512_add_ps(sums[0], sums[1]), _mm512_add_ps(sums[2], sums[3]));
    row_sum = _mm512_fmadd_ps(row_sum, alpha, block_sum);
    row_max = new_max;
    const uint16_t* v_tiles = head_values + kb * 4 * kTile;
    _tile_loadd(1, weights, 64);
    for (int64_t half = 0; half < 2; ++half) {
      _tile_loadd(4, v_tiles + (2 * half) * kTile, 64);
      _tile_loadd(5, v_tiles + (2 * half + 1) * kTile, 64);
      _tile_zero(6);
      _tile_zero(7);
      _tile_dpbf16ps(6, 4, 1);
      _tile_dpbf16ps(7, 5, 1);
      _tile_stored(6, block_out + half * 32 * kRows, 64);
      _tile_stored(7, block_out + (half * 32 + 16) * kRows, 64);
    }
    for (int64_t d = 0; d < kDim; ++d)
      _mm512_store_ps(acc + d * kRows, _mm512_fmadd_ps(_mm512_load_ps(acc + d * kRows), alpha,
                                                       _mm512_load_ps(block_out + d * kRows)));
  }
  const __m512 inverse = _mm512_div_ps(_mm512_set1_ps(1.0f), row_sum);
  alignas(64) uint16_t result[kDim * kRows];  // O^T as bfloat16
  for (int64_t d = 0; d < kDim; ++d)
    _mm256_store_si256(reinterpret_cast<__m256i*>(result + d * kRows),
                       (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(acc + d * kRows), inverse)));
  for (int64_t n = 0; n < rows; ++n) {
    uint16_t* o = out + (i0 + n) * out_stride + h * kDim;
    for (int64_t d = 0; d < kDim; ++d) o[d] = result[d * kRows + n];
  }
}

}  // namespace

void splitfuse_prompt_amx::attend(const uint16_t* query, int64_t query_stride,
                                  const uint16_t* keys, const uint16_t* values,
                                  const int64_t* slot, int64_t row_stride, int64_t q_len,
                                  int64_t context_len, int64_t num_heads, int64_t num_kv_heads,
                                  float scale, uint16_t* out, int64_t out_stride) {
  if (q_len <= 0) return;
  const int64_t blocks = (context_len + kKeys - 1) / kKeys;
  const int64_t head_values = blocks * kKeys * kDim;  // a KV head's keys (and its values)
  std::unique_ptr<uint16_t[]> packed(new uint16_t[2 * num_kv_heads * head_values]);
  uint16_t* packed_keys = packed.get();
  uint16_t* packed_values = packed_keys + num_kv_heads * head_values;
  at::parallel_for(0, num_kv_heads * blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t kv = item / blocks, kb = item % blocks;
      const int64_t at = kv * head_values + kb * kKeys * kDim;
      pack_block(keys, values, slot, row_stride, kv, kb, context_len, packed_keys + at,
                 packed_values + at);
    }
  });
  // work items (head, 16 query rows), the rows with the most keys first, taken in turn
  const int64_t row_tiles = (q_len + kRows - 1) / kRows, items = num_heads * row_tiles;
  const int64_t group = num_heads / num_kv_heads;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    // every tile 16 rows of 64 bytes: 0-1 a block's scores (keys 0-15, 16-31; then 1 the
    // block's weights), 2-3 the rows' queries (values 0-31, 32-63), 4-5 key or value tiles, 6-7
    // a block's outputs
    splitfuse_int4::configure_full_tiles();
    for (int64_t k = next.fetch_add(1); k < items; k = next.fetch_add(1)) {
      const int64_t tile = row_tiles - 1 - k / num_heads, h = k % num_heads;
      const int64_t at = (h / group) * head_values;
      attend_rows(query, query_stride, packed_keys + at, packed_values + at, q_len, context_len,
                  h, tile * kRows, scale, out, out_stride);
    }
    _tile_release();
  });
}

#pragma GCC pop_options
