// splitfuse_cpu::fixed_order_attention: causal attention of a step's query tokens over the paged
// KV cache, each query's result the same bits whatever else the step holds (how many tokens and
// rows, which chunk a token arrived in, which tokens share its thread): deterministic mode's CPU
// attention, and the default mode's for decode tokens (it reads a context in place where SDPA
// needs it gathered). Token t attends to positions 0 .. token_lens[t] - 1 of row token_rows[t]
// of the block tables, reading K/V in place; threads share items, each computed whole by one
// thread: (token, KV head) in a step of few tokens, a token's every KV head in a larger one (its
// context's blocks then read front to back: 32 decode tokens at context 256, amid a step's
// weights, ~1.2 -> ~0.6 ms a layer). float32 arithmetic; the result [num_tokens, num_heads,
// head_dim] in the query's dtype (rounded to nearest even, as torch's conversions). The order of
// every sum is in fixed_order_attention_body.h.
//
// A step of few tokens loads its contexts into the caches before the arithmetic
// (touch_items).
//
// The attention, the store and the layer's caches are shared with ragged_attention.cpp
// (splitfuse_cpu::store_and_attend_step) through fixed_order_attention.h.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include "fixed_order_attention.h"
#include "float16_bits.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

namespace {

struct Bf16 {
  uint16_t bits;
};
struct Fp16 {
  uint16_t bits;
};
struct Fp8 {  // float8 e4m3fn: a cache's dtype only
  uint8_t bits;
};

using splitfuse_fixed_order::FixedOrderArgs;

inline float to_float(float v) { return v; }
inline float to_float(Bf16 v) { return bfloat16_to_float(v.bits); }
inline float to_float(Fp16 v) { return half_to_float(v.bits); }
inline float to_float(Fp8 v) { return float8_e4m3fn_to_float(v.bits); }

template <typename T>
inline T from_float(float v);
template <>
inline float from_float<float>(float v) {
  return v;
}
template <>
inline Bf16 from_float<Bf16>(float v) {
  return Bf16{c10::BFloat16(v).x};
}
template <>
inline Fp16 from_float<Fp16>(float v) {
  return Fp16{c10::Half(v).x};
}

constexpr int kLanes = 16;
constexpr int64_t kBlock = 16;  // positions whose values are widened at once
typedef float v16 __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));
typedef uint32_t __attribute__((may_alias)) uint32_alias;

}  // namespace

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma")
namespace splitfuse_attention_avx512 {
static inline v16 fma16(v16 a, v16 b, v16 c) {
  return (v16)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
}
// 32 float16 values as 16 words: the even dims (low halves) and the odd ones (high halves)
// narrowed to 16 halves each and widened to float32 (VCVTPH2PS: exact, subnormals included)
static inline void split_pairs(const Fp16* in, v16& even, v16& odd) {
  const __m512i words = _mm512_loadu_si512(in);
  even = (v16)_mm512_cvtph_ps(_mm512_cvtepi32_epi16(words));
  odd = (v16)_mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(words, 16)));
}
// 32 float8 e4m3fn values / 256, exact: read as 16 words (the even dims' bytes low, the odd
// ones' high), each byte moved to the top of a word (the even ones by a shift), shifted down one
// place with its sign, and masked to sign, exponent and mantissa: float16 bits
// (float8_e4m3fn_to_half_256th), widened by VCVTPH2PS
static inline void split_pairs_256th(const Fp8* in, v16& even, v16& odd) {
  const __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in));
  const __m256i keep = _mm256_set1_epi16(static_cast<int16_t>(0xBF80));
  const __m256i even_halves =
      _mm256_and_si256(_mm256_srai_epi16(_mm256_slli_epi16(words, 8), 1), keep);
  const __m256i odd_halves = _mm256_and_si256(_mm256_srai_epi16(words, 1), keep);
  even = (v16)_mm512_cvtph_ps(even_halves);
  odd = (v16)_mm512_cvtph_ps(odd_halves);
}
// the values themselves: times 256, exact
static inline void split_pairs(const Fp8* in, v16& even, v16& odd) {
  split_pairs_256th(in, even, odd);
  even = even * 256.0f;
  odd = odd * 256.0f;
}
#define SF_F16C 1
#include "fixed_order_attention_body.h"
#undef SF_F16C
}  // namespace splitfuse_attention_avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace splitfuse_attention_avx2 {
#define SF_ATTENTION_AVX2 1
#define SF_F16C 1
#include "fixed_order_attention_avx2.h"
#include "fixed_order_attention_body.h"
#undef SF_F16C
#undef SF_ATTENTION_AVX2
}  // namespace splitfuse_attention_avx2
#pragma GCC pop_options

namespace splitfuse_attention_base {
#define SF_F16C 0
static inline v16 fma16(v16 a, v16 b, v16 c) {
  for (int l = 0; l < kLanes; ++l) c[l] = std::fma(a[l], b[l], c[l]);
  return c;
}
#include "fixed_order_attention_body.h"
#undef SF_F16C
}  // namespace splitfuse_attention_base

namespace {

using RunFn = void (*)(const FixedOrderArgs&, int64_t, int64_t, int64_t);

// The widest body the CPU runs (they give the same bits); SPLITFUSE_CPU_ISA=avx2 or sse2 asks
// for a narrower one, as for the quantized product.
RunFn pick_run_fn() {
  __builtin_cpu_init();
  const char* asked = std::getenv("SPLITFUSE_CPU_ISA");
  const std::string limit = asked == nullptr ? "" : asked;
  if (limit == "sse2") return splitfuse_attention_base::fixed_order_run;
  if (limit != "avx2" && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
    return splitfuse_attention_avx512::fixed_order_run;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c"))
    return splitfuse_attention_avx2::fixed_order_run;
  return splitfuse_attention_base::fixed_order_run;
}

const RunFn run_fn = pick_run_fn();

int kind_of(const at::Tensor& t, const char* name) {
  const int kind = splitfuse_fixed_order::dtype_kind(t.scalar_type());
  TORCH_CHECK(kind >= 0, "fixed_order_attention: ", name,
              " must be float32, bfloat16 or float16, got ", t.scalar_type());
  return kind;
}

int cache_kind_of(const at::Tensor& t) {
  const int kind = splitfuse_fixed_order::cache_kind(t.scalar_type());
  TORCH_CHECK(kind >= 0, "fixed_order_attention: the caches must be float32, bfloat16, float16 "
              "or float8_e4m3fn, got ", t.scalar_type());
  return kind;
}

void check_inputs(const at::Tensor& query, const at::Tensor& key_cache,
                  const at::Tensor& value_cache, const at::Tensor& block_tables,
                  const at::Tensor& token_rows, const at::Tensor& token_lens) {
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1 && query.stride(1) == query.size(2),
              "fixed_order_attention: query must be [num_tokens, num_heads, head_dim] with "
              "contiguous heads");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.is_contiguous() && value_cache.is_contiguous() &&
                  key_cache.sizes() == value_cache.sizes() &&
                  key_cache.scalar_type() == value_cache.scalar_type(),
              "fixed_order_attention: the caches must be contiguous [num_blocks, block_size, "
              "num_kv_heads, head_dim] tensors of one shape and dtype");
  const int64_t num_tokens = query.size(0), num_heads = query.size(1);
  const int64_t num_blocks = key_cache.size(0), block_size = key_cache.size(1);
  const int64_t num_kv_heads = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == query.size(2) && num_kv_heads > 0 &&
                  num_heads % num_kv_heads == 0,
              "fixed_order_attention: the caches' heads do not match the query's");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.is_contiguous() &&
                  block_tables.scalar_type() == at::kInt && token_rows.is_contiguous() &&
                  token_rows.scalar_type() == at::kInt && token_lens.is_contiguous() &&
                  token_lens.scalar_type() == at::kInt && token_rows.dim() == 1 &&
                  token_lens.dim() == 1 && token_rows.size(0) == num_tokens &&
                  token_lens.size(0) == num_tokens,
              "fixed_order_attention: block_tables must be contiguous int32 [num_rows, "
              "max_blocks], token_rows and token_lens int32 [num_tokens]");
  TORCH_CHECK(query.device().is_cpu() && key_cache.device().is_cpu() &&
                  block_tables.device().is_cpu(),
              "fixed_order_attention: CPU tensors only");
  const int64_t num_rows = block_tables.size(0), table_stride = block_tables.size(1);
  const int32_t* rows = token_rows.data_ptr<int32_t>();
  const int32_t* lens = token_lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  for (int64_t t = 0; t < num_tokens; ++t) {  // every read inside the tables and the cache
    TORCH_CHECK(rows[t] >= 0 && rows[t] < num_rows && lens[t] >= 1 &&
                    lens[t] <= table_stride * block_size,
                "fixed_order_attention: token ", t, " reads row ", rows[t], " for ", lens[t],
                " positions");
    const int32_t* table = tables + static_cast<int64_t>(rows[t]) * table_stride;
    for (int64_t b = 0; b < (lens[t] + block_size - 1) / block_size; ++b)
      TORCH_CHECK(table[b] >= 0 && table[b] < num_blocks, "fixed_order_attention: token ", t,
                  " reads block ", table[b], " of ", num_blocks);
  }
}

}  // namespace

namespace splitfuse_fixed_order {

int dtype_kind(at::ScalarType type) {
  switch (type) {
    case at::kFloat:
      return 0;
    case at::kBFloat16:
      return 1;
    case at::kHalf:
      return 2;
    default:
      return -1;
  }
}

int cache_kind(at::ScalarType type) {
  return type == at::kFloat8_e4m3fn ? 3 : dtype_kind(type);
}

int64_t cache_element_size(int kinds) {
  constexpr int64_t sizes[kCacheKinds] = {4, 2, 2, 1};
  return sizes[kinds % kCacheKinds];
}

// The attention itself, on checked inputs.
at::Tensor attend(const at::Tensor& query, const at::Tensor& key_cache,
                  const at::Tensor& value_cache, const at::Tensor& block_tables,
                  const at::Tensor& token_rows, const at::Tensor& token_lens, double scale) {
  const int64_t num_tokens = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t num_kv_heads = key_cache.size(2);
  at::Tensor out = at::empty({num_tokens, num_heads, head_dim}, query.options());
  if (num_tokens == 0) return out;
  // a token's every KV head in one item where there are enough tokens to share out (each block
  // of its context is then read front to back, its slots' heads contiguous); a KV head per item
  // where there are few, so that threads share them
  const int64_t kv_per_item =
      num_tokens >= kWholeTokenItems * at::get_num_threads() ? num_kv_heads : 1;
  FixedOrderArgs args{query.data_ptr(),
                      key_cache.data_ptr(),
                      value_cache.data_ptr(),
                      block_tables.data_ptr<int32_t>(),
                      token_rows.data_ptr<int32_t>(),
                      token_lens.data_ptr<int32_t>(),
                      out.data_ptr(),
                      num_tokens,
                      query.stride(0),
                      block_tables.size(1),
                      num_kv_heads * head_dim,
                      key_cache.size(1),
                      num_heads,
                      num_kv_heads,
                      head_dim,
                      kv_per_item,
                      static_cast<float>(scale),
                      kind_of(query, "query") * kCacheKinds + cache_kind_of(key_cache)};
  if (num_tokens <= kTouchTokens)
    at::parallel_for(0, num_tokens * args.table_stride, 1, [&](int64_t begin, int64_t end) {
      touch_items(args, begin, end, 0);
    });
  const int64_t num_items = num_tokens * (num_kv_heads / kv_per_item);
  at::parallel_for(0, num_items, 1,
                   [&](int64_t begin, int64_t end) { run_fn(args, begin, end, -1); });
  return out;
}

// A decode step finds its contexts in memory, not in the caches (the weights' stream has pushed
// them out since the step before), and the arithmetic's loads, a block of positions at a time
// between the sums, leave few misses in flight. So a step of few tokens first loads one byte of
// every cache line its contexts span (every KV head's rows of each position: the slots of a
// block are contiguous), loads that do not wait on one another, and the arithmetic then finds
// them cached. One token at context 256, one layer, amid the weights' stream: 54 -> 38 us.
// (Software prefetches of the same lines, even a layer ahead, changed nothing there.) Only reads:
// no number changes.
void touch_items(const FixedOrderArgs& args, int64_t begin, int64_t end, int64_t left_out) {
  const int64_t elem = cache_element_size(args.kinds);
  const int64_t slot_bytes = args.slot_stride * elem, block_bytes = args.block_size * slot_bytes;
  const auto* keys = static_cast<const volatile char*>(args.key_cache);
  const auto* values = static_cast<const volatile char*>(args.value_cache);
  for (int64_t item = begin; item < end; ++item) {
    const int64_t token = item / args.table_stride, b = item % args.table_stride;
    const int64_t used =
        std::min<int64_t>(args.block_size, args.token_lens[token] - left_out - b * args.block_size);
    if (used <= 0) continue;
    const int64_t row = args.token_rows[token];
    const int64_t offset = args.block_tables[row * args.table_stride + b] * block_bytes;
    for (int64_t byte = 0; byte < used * slot_bytes; byte += 64) {
      (void)keys[offset + byte];
      (void)values[offset + byte];
    }
  }
}

void attend_items(const FixedOrderArgs& args, int64_t begin, int64_t end, int64_t next) {
  run_fn(args, begin, end, next);
}

std::pair<int64_t, int64_t> item_of(const FixedOrderArgs& args, int64_t k) {
  const auto item = splitfuse_attention_base::item_at(args, k);  // every body numbers alike
  return {item.token, item.kv0};
}

void ask_for_item(const FixedOrderArgs& args, int64_t k, int64_t part, int64_t parts) {
  // (prefetches: any body's Ahead asks alike)
  const int64_t elem = cache_element_size(args.kinds);
  auto ahead = splitfuse_attention_base::ahead_for(args, k, parts, elem);
  ahead.next = std::min(part * ahead.per_call, 2 * ahead.length);
  ahead.issue();
}

std::pair<at::Tensor, at::Tensor> layer_caches(const char* op, const at::Tensor& kv_cache,
                                               int64_t layer) {
  TORCH_CHECK(kv_cache.dim() == 6 && kv_cache.size(1) == 2 && kv_cache.is_contiguous(), op,
              ": kv_cache must be a contiguous "
              "[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim] tensor");
  TORCH_CHECK(layer >= 0 && layer < kv_cache.size(0), op, ": layer ", layer, " of a cache of ",
              kv_cache.size(0), " layers");
  const at::Tensor layer_cache = kv_cache.select(0, layer);
  return {layer_cache.select(0, 0), layer_cache.select(0, 1)};
}

void check_store(const char* op, const at::Tensor& key, const at::Tensor& value,
                 const at::Tensor& key_cache, const at::Tensor& slots, int64_t num_tokens) {
  for (const at::Tensor* t : {&key, &value})
    TORCH_CHECK(t->dim() == 3 && t->size(0) == num_tokens && t->size(1) == key_cache.size(2) &&
                    t->size(2) == key_cache.size(3) && t->stride(2) == 1 &&
                    t->stride(1) == t->size(2) && t->scalar_type() == key_cache.scalar_type() &&
                    t->device().is_cpu(),
                op, ": key and value must be [num_tokens, num_kv_heads, head_dim] "
                "in the caches' dtype, with contiguous heads");
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == num_tokens && slots.is_contiguous() &&
                  slots.scalar_type() == at::kLong && slots.device().is_cpu(),
              op, ": slots must be int64 [num_tokens]");
  const int64_t num_slots = key_cache.size(0) * key_cache.size(1);
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < num_tokens; ++t)
    TORCH_CHECK(slot[t] >= -1 && slot[t] < num_slots, op, ": token ", t, " stores into slot ",
                slot[t], " of ", num_slots);
}

void store_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
              at::Tensor& value_cache, const at::Tensor& slots) {
  const int64_t num_tokens = slots.size(0);
  const int64_t row_size = key_cache.size(2) * key_cache.size(3);  // one slot's elements
  const int64_t bytes = row_size * key_cache.element_size();
  auto* key_base = static_cast<char*>(key_cache.data_ptr());
  auto* value_base = static_cast<char*>(value_cache.data_ptr());
  const auto* key_in = static_cast<const char*>(key.data_ptr());
  const auto* value_in = static_cast<const char*>(value.data_ptr());
  const int64_t key_stride = key.stride(0) * key.element_size();
  const int64_t value_stride = value.stride(0) * value.element_size();
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < num_tokens; ++t) {
    if (slot[t] < 0) continue;
    std::memcpy(key_base + slot[t] * bytes, key_in + t * key_stride, bytes);
    std::memcpy(value_base + slot[t] * bytes, value_in + t * value_stride, bytes);
  }
}

}  // namespace splitfuse_fixed_order

namespace {

using splitfuse_fixed_order::attend;

at::Tensor fixed_order_attention(const at::Tensor& query, const at::Tensor& key_cache,
                                 const at::Tensor& value_cache, const at::Tensor& block_tables,
                                 const at::Tensor& token_rows, const at::Tensor& token_lens,
                                 double scale) {
  check_inputs(query, key_cache, value_cache, block_tables, token_rows, token_lens);
  return attend(query, key_cache, value_cache, block_tables, token_rows, token_lens, scale);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(splitfuse_cpu, m) {
  m.def("fixed_order_attention(Tensor query, Tensor key_cache, Tensor value_cache, "
        "Tensor block_tables, Tensor token_rows, Tensor token_lens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(splitfuse_cpu, CPU, m) {
  m.impl("fixed_order_attention", fixed_order_attention);
}
