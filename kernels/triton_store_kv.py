"""KV store by slot mapping in Triton: one program per token writes its K and V heads."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim], contiguous
    value_cache_ptr,
    slot_mapping_ptr,  # [num_tokens] int64, -1 = skip
    num_slots,
    stride_key_token,
    stride_key_head,
    stride_value_token,
    stride_value_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PADDED: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token)
    if (slot < 0) | (slot >= num_slots):  # padding; out-of-range slots are never written
        return
    offs_h = tl.arange(0, HEADS_PADDED)
    offs_d = tl.arange(0, HEAD_DIM_PADDED)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    key_offsets = token * stride_key_token + offs_h[:, None] * stride_key_head + offs_d[None, :]
    value_offsets = (
        token * stride_value_token + offs_h[:, None] * stride_value_head + offs_d[None, :]
    )
    cache_offsets = slot * (NUM_KV_HEADS * HEAD_DIM) + offs_h[:, None] * HEAD_DIM + offs_d[None, :]
    key = tl.load(key_ptr + key_offsets, mask=mask)
    value = tl.load(value_ptr + value_offsets, mask=mask)
    tl.store(key_cache_ptr + cache_offsets, key, mask=mask)
    tl.store(value_cache_ptr + cache_offsets, value, mask=mask)


def launch_store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Run the kernel on checked inputs (contiguous caches, unit stride in head_dim)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping,
        key_cache.shape[0] * key_cache.shape[1],
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        HEADS_PADDED=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM_PADDED=triton.next_power_of_2(head_dim),
    )  # fmt: skip
