"""The PyTorch implementation of each op: the CPU runtime path and the Triton kernels' reference.

The paged KV cache, per layer (one tensor for K, one for V):

    key_cache [num_blocks, block_size, num_kv_heads, head_dim]
    slot = block_id * block_size + offset          (block_size 4: block 2, offset 1 -> slot 9)

A row's context is read through its block table, physical block ids in logical order:
block_table [7, 2], block_size 4, context_len 6 -> positions 0..3 in block 7, 4..5 in block 2.
The attention op lives in kernels.torch_attention.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.checks import (
    KernelInputError,
    check_rms_norm,
    check_rotary_embedding,
    check_store_kv,
)
from kernels.torch_attention import paged_attention

__all__ = ["paged_attention", "rms_norm", "rotary_embedding", "store_kv"]


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write each token's K/V into its cache slot; tokens whose slot is -1 are skipped."""
    check_store_kv(key, value, key_cache, value_cache, slot_mapping)
    num_slots = key_cache.shape[0] * key_cache.shape[1]
    if slot_mapping.numel() == 0:
        return
    min_slot, max_slot = (int(slot) for slot in slot_mapping.aminmax())
    if min_slot < -1 or max_slot >= num_slots:
        raise KernelInputError(f"slot_mapping must hold -1 or slots in [0, {num_slots})")
    slots = slot_mapping
    if min_slot == -1:  # padding tokens
        valid = slot_mapping >= 0  # [num_tokens]
        slots, key, value = slot_mapping[valid], key[valid], value[valid]
    # [num_slots, num_kv_heads, head_dim] views of the caches
    key_cache.view(num_slots, *key_cache.shape[2:]).index_copy_(0, slots, key)
    value_cache.view(num_slots, *value_cache.shape[2:]).index_copy_(0, slots, value)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dimension, with an optional residual added first.

    ``x``: [num_tokens, hidden]. Normalized in float32, rounded to x.dtype, then scaled by weight
    (the Hugging Face Llama order). With ``residual``: ``s = x + residual`` (in x.dtype) and the
    result is ``(norm(s) * weight, s)``, ``s`` being the next layer's residual.
    """
    check_rms_norm(x, weight, eps, residual)
    summed = x if residual is None else x + residual
    normed = F.rms_norm(summed.float(), (x.shape[-1],), eps=eps)  # x * rsqrt(mean(x^2) + eps)
    result = normed.to(x.dtype) * weight.to(x.dtype)
    return result if residual is None else (result, summed)


def rotary_embedding(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor
) -> None:
    """Rotate query and key in place by their positions (Llama / GPT-NeoX rotate_half layout).

    With half = head_dim // 2, x1 = x[..., :half], x2 = x[..., half:]:
    x1' = x1 * cos - x2 * sin and x2' = x2 * cos + x1 * sin, computed in float32.
    """
    check_rotary_embedding(positions, query, key, cos_sin_cache)
    half = query.shape[-1] // 2
    # [num_tokens, 1, head_dim]; raises IndexError before any write for a position out of range
    cos_sin = cos_sin_cache.index_select(0, positions)[:, None, :]
    cos, sin = cos_sin[..., :half], cos_sin[..., half:]
    heads = _adjacent_heads(query, key)
    for x in (query, key) if heads is None else (heads,):
        x1, x2 = x[..., :half].float(), x[..., half:].float()
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        x.copy_(rotated)


def _adjacent_heads(query: torch.Tensor, key: torch.Tensor) -> torch.Tensor | None:
    """One [num_tokens, num_heads + num_kv_heads, head_dim] view of query and key when key's heads
    directly follow query's in one tensor (views of a fused qkv projection), else None."""
    num_tokens, num_heads, head_dim = query.shape
    if (
        key.untyped_storage().data_ptr() != query.untyped_storage().data_ptr()
        or key.stride() != query.stride()
        or key.storage_offset() != query.storage_offset() + num_heads * query.stride(1)
    ):
        return None
    return query.as_strided((num_tokens, num_heads + key.shape[1], head_dim), query.stride())
