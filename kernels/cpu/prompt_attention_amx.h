// Causal attention of a prompt chunk on AMX tiles (CPUs with AMX-BF16), for
// store_and_attend_step (ragged_attention.cpp): bfloat16 queries, keys and values, heads of 64
// values. No torch here: the operator calls it on raw pointers (prompt_attention_amx.cpp).
#pragma once

#include <cstdint>

namespace splitfuse_prompt_amx {

// Whether attend() runs here for heads of head_dim values: AMX-BF16 tiles lent by the OS
// (int4_amx.h's amx_ready: SPLITFUSE_CPU_ISA unset) and head_dim 64.
bool ready(int64_t head_dim);

// Token i of a chunk of q_len tokens, the last q_len of context_len positions (position
// context_len - q_len + i), attends to positions 0 .. its own:
//   query   bfloat16 bits, token i's num_heads heads of 64 at query + i * query_stride
//   keys    bfloat16 bits, position p's num_kv_heads heads of 64 at keys + slot[p] * row_stride
//   values  alike (the same slots and stride)
//   out     bfloat16 bits, token i's heads at out + i * out_stride
// Query head h reads KV head h / (num_heads / num_kv_heads). A token's result depends only on
// its own query and the keys and values it sees: not on the chunk's other tokens, nor on where
// the chunk starts (keys in blocks of 32 positions from position 0, each token's online softmax
// taking them in order; blocks past a token's own position change none of its bits). Runs in
// at::parallel_for's threads, each configuring its tiles.
void attend(const uint16_t* query, int64_t query_stride, const uint16_t* keys,
            const uint16_t* values, const int64_t* slot, int64_t row_stride, int64_t q_len,
            int64_t context_len, int64_t num_heads, int64_t num_kv_heads, float scale,
            uint16_t* out, int64_t out_stride);

}  // namespace splitfuse_prompt_amx
