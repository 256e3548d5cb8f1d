// What fixed_order_attention.cpp shares with the other attention operator of kernels/cpu/
// (ragged_attention.cpp): the layer's caches taken from the whole cache, the store of a step's
// K/V into their slots, and the fixed-order attention itself. `op` names the calling operator in
// the messages of the checks.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <utility>

namespace splitfuse_fixed_order {

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
// fixed_order_attention's checks accept (query and caches float32, bfloat16 or float16).
at::Tensor attend(const at::Tensor& query, const at::Tensor& key_cache,
                  const at::Tensor& value_cache, const at::Tensor& block_tables,
                  const at::Tensor& token_rows, const at::Tensor& token_lens, double scale);

}  // namespace splitfuse_fixed_order
