// What fixed_order_attention.cpp shares with the other operators of kernels/cpu/
// (ragged_attention.cpp, decode_stack.cpp): the layer's caches taken from the whole cache, the
// store of a step's K/V into their slots, and the fixed-order attention itself (whole, or by
// work items for a caller's own parallel region). `op` names the calling operator in
// the messages of the checks.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <utility>

namespace splitfuse_fixed_order {

// The fixed-order kernel's arguments (fixed_order_attention_body.h), raw pointers.
struct FixedOrderArgs {
  const void* query;  // [num_tokens, num_heads, head_dim], rows query_stride apart
  const void* key_cache;  // [num_blocks, block_size, num_kv_heads, head_dim]
  const void* value_cache;
  const int32_t* block_tables;  // [num_rows, table_stride]
  const int32_t* token_rows;  // [num_tokens]
  const int32_t* token_lens;  // [num_tokens]
  void* out;  // [num_tokens, num_heads, head_dim], the query's dtype
  int64_t num_tokens, query_stride, table_stride, slot_stride, block_size;
  int64_t num_heads, num_kv_heads, head_dim;
  int64_t kv_per_item;  // KV heads of a token per work item: 1 or num_kv_heads
  float scale;
  int kinds;  // query kind * kCacheKinds + cache kind (dtype_kind, cache_kind)
};

// How many dtypes a cache may hold (cache_kind): float32, bfloat16, float16, float8 e4m3fn.
constexpr int kCacheKinds = 4;

// A query's dtype's kind as FixedOrderArgs::kinds numbers it: 0 float32, 1 bfloat16, 2
// float16; -1 for any other.
int dtype_kind(at::ScalarType type);

// A cache's dtype's kind: dtype_kind's, and 3 for float8 e4m3fn (read widened in registers,
// exact, as float16 is); -1 for any other.
int cache_kind(at::ScalarType type);

// The size in bytes of a cache element of FixedOrderArgs::kinds `kinds`.
int64_t cache_element_size(int kinds);

// Steps of at most kTouchTokens tokens read their contexts once ahead of the arithmetic
// (touch_items); steps of at least kWholeTokenItems tokens a thread give each work item a
// token's every KV head (kv_per_item = num_kv_heads), fewer one KV head.
constexpr int64_t kTouchTokens = 8;
constexpr int64_t kWholeTokenItems = 4;

// The key and value caches [num_blocks, block_size, num_kv_heads, head_dim] of layer `layer` of
// a contiguous kv_cache [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]: views.
std::pair<at::Tensor, at::Tensor> layer_caches(const char* op, const at::Tensor& kv_cache,
                                               int64_t layer);

// Checks that key and value are [num_tokens, num_kv_heads, head_dim] with contiguous heads in the
// caches' dtype, and slots int64 [num_tokens] with each slot in [-1, num_slots).
void check_store(const char* op, const at::Tensor& key, const at::Tensor& value,
                 const at::Tensor& key_cache, const at::Tensor& slots, int64_t num_tokens);

// Writes token t's K/V into slot slots[t] of the caches (slot -1: not stored), on inputs that
// check_store accepted.
void store_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
              at::Tensor& value_cache, const at::Tensor& slots);

// Token t of `query` [num_tokens, num_heads, head_dim] (heads contiguous) attends to positions
// 0 .. token_lens[t] - 1 of row token_rows[t] of the block tables, reading the caches in place:
// [num_tokens, num_heads, head_dim] in the query's dtype, contiguous. On inputs that
// fixed_order_attention's checks accept (query float32, bfloat16 or float16; caches those or
// float8 e4m3fn).
at::Tensor attend(const at::Tensor& query, const at::Tensor& key_cache,
                  const at::Tensor& value_cache, const at::Tensor& block_tables,
                  const at::Tensor& token_rows, const at::Tensor& token_lens, double scale);

// For a caller that runs its own parallel region (decode_stack.cpp): work items [begin, end)
// of the fixed-order kernel on `args` (items as fixed_order_attention_body.h's item_at numbers
// them: (token, group of kv_per_item KV heads)), on inputs its checks accept. Each item asks
// for its successor's context while it computes (items of a token's every KV head): the last
// one for item `next`'s, where it is not -1 (the item the caller runs after these).
void attend_items(const FixedOrderArgs& args, int64_t begin, int64_t end, int64_t next = -1);

// Loads one byte of every cache line of the contexts of (token, block of its table) items
// [begin, end) (item = token * table_stride + block), every KV head's rows, leaving out the last
// `left_out` positions of each token's context; contiguous caches. Only reads.
void touch_items(const FixedOrderArgs& args, int64_t begin, int64_t end, int64_t left_out);

// (token, first KV head) of work item k of `args`: item k attends with query heads
// kv0 * G .. (kv0 + kv_per_item) * G - 1 of that token (G query heads a KV head).
std::pair<int64_t, int64_t> item_of(const FixedOrderArgs& args, int64_t k);

// Asks for share `part` of `parts` of work item k's context (every KV head's key rows, then their
// value rows) into the L2 cache: software prefetches, which nothing waits on. Only reads.
void ask_for_item(const FixedOrderArgs& args, int64_t k, int64_t part, int64_t parts);

}  // namespace splitfuse_fixed_order
