"""Rotary embedding in Triton (Llama rotate_half layout), in place on Q and K, a program per token.

With half = head_dim // 2, x1 = x[..., :half], x2 = x[..., half:] of every head:
x1' = x1 * cos - x2 * sin, x2' = x2 * cos + x1 * sin, in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(x_ptr, stride_head, num_heads, cos, sin, HEADS_PADDED: tl.constexpr,
                  HALF: tl.constexpr, HALF_PADDED: tl.constexpr):  # fmt: skip
    offs_h = tl.arange(0, HEADS_PADDED)
    offs_d = tl.arange(0, HALF_PADDED)
    mask = (offs_h[:, None] < num_heads) & (offs_d[None, :] < HALF)
    first = x_ptr + offs_h[:, None] * stride_head + offs_d[None, :]  # [HEADS, HALF] pointers
    x1 = tl.load(first, mask=mask, other=0.0)
    x2 = tl.load(first + HALF, mask=mask, other=0.0)
    x1_f32, x2_f32 = x1.to(tl.float32), x2.to(tl.float32)
    tl.store(first, (x1_f32 * cos[None, :] - x2_f32 * sin[None, :]).to(x1.dtype), mask=mask)
    tl.store(first + HALF, (x2_f32 * cos[None, :] + x1_f32 * sin[None, :]).to(x1.dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr,  # [num_tokens] int64
    query_ptr,  # [num_tokens, num_heads, head_dim]
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    cos_sin_ptr,  # [max_position, head_dim] float32, contiguous
    max_position,
    num_heads,
    num_kv_heads,
    stride_q_token,
    stride_q_head,
    stride_k_token,
    stride_k_head,
    HALF: tl.constexpr,
    HALF_PADDED: tl.constexpr,
    HEADS_PADDED: tl.constexpr,
    KV_HEADS_PADDED: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token)
    if (position < 0) | (position >= max_position):  # out of the table: left unrotated
        return
    offs_d = tl.arange(0, HALF_PADDED)
    d_mask = offs_d < HALF
    cos = tl.load(cos_sin_ptr + position * (2 * HALF) + offs_d, mask=d_mask, other=0.0)
    sin = tl.load(cos_sin_ptr + position * (2 * HALF) + HALF + offs_d, mask=d_mask, other=0.0)
    _rotate_heads(query_ptr + token * stride_q_token, stride_q_head, num_heads, cos, sin,
                  HEADS_PADDED, HALF, HALF_PADDED)  # fmt: skip
    _rotate_heads(key_ptr + token * stride_k_token, stride_k_head, num_kv_heads, cos, sin,
                  KV_HEADS_PADDED, HALF, HALF_PADDED)  # fmt: skip


def launch_rotary_embedding(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor
) -> None:
    """Run the kernel on checked inputs (unit stride in head_dim, contiguous table)."""
    num_tokens, num_heads, head_dim = query.shape
    if num_tokens == 0:
        return
    half = head_dim // 2
    _rotary_kernel[(num_tokens,)](
        positions, query, key, cos_sin_cache, cos_sin_cache.shape[0], num_heads, key.shape[1],
        query.stride(0), query.stride(1), key.stride(0), key.stride(1),
        HALF=half, HALF_PADDED=triton.next_power_of_2(half),
        # at least 1: tl.arange needs a non-empty range; masks skip the padding (an empty group)
        HEADS_PADDED=max(1, triton.next_power_of_2(num_heads)),
        KV_HEADS_PADDED=max(1, triton.next_power_of_2(key.shape[1])),
    )  # fmt: skip
