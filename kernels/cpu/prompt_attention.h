// Causal attention of a prompt chunk for store_and_attend_step (ragged_attention.cpp): bfloat16
// queries, keys and values, heads of 64 values, on AMX tiles (prompt_attention_amx.cpp) or, on
// CPUs with AVX-512 BF16 but no tiles, in AVX-512 (prompt_attention_avx512.cpp). No torch here:
// the operators call them on raw pointers.
//
// attend(): token i of a chunk of q_len tokens, the last q_len of context_len positions
// (position context_len - q_len + i), attends to positions 0 .. its own:
//   query   bfloat16 bits, token i's num_heads heads of 64 at query + i * query_stride
//   keys    bfloat16 bits, position p's num_kv_heads heads of 64 at keys + slot[p] * row_stride
//   values  alike (the same slots and stride)
//   out     bfloat16 bits, token i's heads at out + i * out_stride
// Query head h reads KV head h / (num_heads / num_kv_heads). A token's result depends only on
// its own query and the keys and values it sees: not on the chunk's other tokens, nor on where
// the chunk starts (keys in blocks of 32 positions from position 0, each token's online softmax
// taking them in order). Runs in at::parallel_for's threads.
#pragma once

#include <cstdint>

namespace splitfuse_prompt_amx {

// AMX-BF16 tiles lent by the OS (int4_amx.h's amx_ready: SPLITFUSE_CPU_ISA unset), head_dim 64
bool ready(int64_t head_dim);
void attend(const uint16_t* query, int64_t query_stride, const uint16_t* keys,
            const uint16_t* values, const int64_t* slot, int64_t row_stride, int64_t q_len,
            int64_t context_len, int64_t num_heads, int64_t num_kv_heads, float scale,
            uint16_t* out, int64_t out_stride);

}  // namespace splitfuse_prompt_amx

namespace splitfuse_prompt_avx512 {

// AVX-512 BF16 (VDPBF16PS), SPLITFUSE_CPU_ISA unset or avx512_bf16, head_dim 64
bool ready(int64_t head_dim);
void attend(const uint16_t* query, int64_t query_stride, const uint16_t* keys,
            const uint16_t* values, const int64_t* slot, int64_t row_stride, int64_t q_len,
            int64_t context_len, int64_t num_heads, int64_t num_kv_heads, float scale,
            uint16_t* out, int64_t out_stride);

}  // namespace splitfuse_prompt_avx512

namespace splitfuse_prompt {

// the tiles where the CPU lends them, else AVX-512 BF16, else neither (SDPA)
inline const char* kernel(int64_t head_dim) {
  if (splitfuse_prompt_amx::ready(head_dim)) return "amx";
  if (splitfuse_prompt_avx512::ready(head_dim)) return "avx512_bf16";
  return "";
}

inline bool ready(int64_t head_dim) { return kernel(head_dim)[0] != '\0'; }

inline void attend(const uint16_t* query, int64_t query_stride, const uint16_t* keys,
                   const uint16_t* values, const int64_t* slot, int64_t row_stride,
                   int64_t q_len, int64_t context_len, int64_t num_heads, int64_t num_kv_heads,
                   float scale, uint16_t* out, int64_t out_stride) {
  const auto run = splitfuse_prompt_amx::ready(64) ? splitfuse_prompt_amx::attend
                                                   : splitfuse_prompt_avx512::attend;
  run(query, query_stride, keys, values, slot, row_stride, q_len, context_len, num_heads,
      num_kv_heads, scale, out, out_stride);
}

}  // namespace splitfuse_prompt
