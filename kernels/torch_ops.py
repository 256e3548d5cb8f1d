"""The PyTorch implementation of each op: the CPU runtime path and the Triton kernels' reference.

The paged KV cache, per layer (one tensor for K, one for V):

    key_cache [num_blocks, block_size, num_kv_heads, head_dim]
    slot = block_id * block_size + offset          (block_size 4: block 2, offset 1 -> slot 9)

A row's context is read through its block table, physical block ids in logical order:
block_table [7, 2], block_size 4, context_len 6 -> positions 0..3 in block 7, 4..5 in block 2.
The attention op lives in kernels.torch_attention.

Each public op checks its arguments on every call. The model's per-step path (``plan_step``, then
the ``*_planned`` ops in every layer) does the checks and the index work that depend on the batch
alone once per step, and leaves each layer a few operators per op.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.checks import (
    KernelInputError,
    check_rms_norm,
    check_rotary_embedding,
    check_store_kv,
)
from kernels.torch_attention import (
    AttentionPlan,
    paged_attention,
    paged_attention_planned,
    plan_paged_attention,
)

__all__ = [
    "StepPlan",
    "add_rms_norm",
    "paged_attention",
    "paged_attention_planned",
    "plan_step",
    "rms_norm",
    "rotary_embedding",
    "rotary_embedding_planned",
    "store_kv",
    "store_kv_planned",
]


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


# -- the per-step path ---------------------------------------------------------------------------


@dataclass(frozen=True)
class StepPlan:
    """A step's checked metadata in the form every layer uses (see ``plan_step``)."""

    cos: torch.Tensor  # [num_tokens, 1, head_dim] float32: cos of each token's angles, twice
    sin: torch.Tensor  # [num_tokens, 1, head_dim] float32: -sin then sin
    store_slots: torch.Tensor  # [num_stored] int64 cache slots of the tokens that are stored
    store_tokens: torch.Tensor | None  # [num_stored] their token indices; None: every token
    attention: AttentionPlan


def plan_step(
    positions: torch.Tensor,  # [num_tokens] int64
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1: not stored
    query_start: torch.Tensor,  # [num_rows + 1] int32
    context_lens: torch.Tensor,  # [num_rows] int32
    block_tables: torch.Tensor,  # [num_rows, max_blocks_per_row] int32
    cos_sin_cache: torch.Tensor,  # [max_position, head_dim] float32
    *,
    block_size: int,
    num_kv_heads: int,
    num_slots: int,
) -> StepPlan:
    """Checks a step's metadata (positions inside the rotary table, slots inside the cache, the
    attention rows; raises KernelInputError) and gathers what every layer reuses."""
    num_tokens = positions.shape[0]
    if positions.dtype != torch.int64 or positions.dim() != 1:
        raise KernelInputError("positions must be a 1-D torch.int64 tensor")
    if slot_mapping.dtype != torch.int64 or tuple(slot_mapping.shape) != (num_tokens,):
        raise KernelInputError(f"slot_mapping must be torch.int64 [{num_tokens}]")
    if cos_sin_cache.dtype != torch.float32 or cos_sin_cache.dim() != 2:
        raise KernelInputError("cos_sin_cache must be float32 [max_position, head_dim]")
    store_slots, store_tokens = slot_mapping, None
    if num_tokens:
        min_position, max_position = (int(p) for p in positions.aminmax())
        if min_position < 0 or max_position >= cos_sin_cache.shape[0]:
            raise KernelInputError(f"positions must be in [0, {cos_sin_cache.shape[0]})")
        min_slot, max_slot = (int(slot) for slot in slot_mapping.aminmax())
        if min_slot < -1 or max_slot >= num_slots:
            raise KernelInputError(f"slot_mapping must hold -1 or slots in [0, {num_slots})")
        if min_slot == -1:  # padding tokens
            store_tokens = (slot_mapping >= 0).nonzero().squeeze(1)
            store_slots = slot_mapping[store_tokens]
    half = cos_sin_cache.shape[1] // 2
    cos_sin = cos_sin_cache.index_select(0, positions)[:, None, :]  # [num_tokens, 1, head_dim]
    cos, sin = cos_sin[..., :half], cos_sin[..., half:]
    attention = plan_paged_attention(
        query_start,
        context_lens,
        block_tables,
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        num_tokens=num_tokens,
    )
    return StepPlan(
        cos=torch.cat((cos, cos), dim=-1),
        sin=torch.cat((-sin, sin), dim=-1),
        store_slots=store_slots,
        store_tokens=store_tokens,
        attention=attention,
    )


def rotary_embedding_planned(heads: torch.Tensor, plan: StepPlan) -> None:
    """``rotary_embedding`` in place on ``heads`` [num_tokens, num_heads, head_dim] (query and key
    heads side by side in a fused qkv tensor): x * cos + rotate_half(x) * sin, in float32."""
    if heads.shape[0] != plan.cos.shape[0] or heads.shape[2] != plan.cos.shape[2]:
        raise KernelInputError(f"heads {tuple(heads.shape)} do not match the step's plan")
    x = heads.float()
    # roll by half: [x1, x2] -> [x2, x1]; times [-sin, sin] gives rotate_half(x) * sin
    rotated = x * plan.cos
    rotated += torch.roll(x, heads.shape[2] // 2, -1) * plan.sin
    heads.copy_(rotated)


def store_kv_planned(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    plan: StepPlan,
) -> None:
    """``store_kv`` with the slots checked (and the -1 tokens dropped) once by ``plan_step``."""
    if key.shape[0] != plan.attention.num_tokens or value.shape != key.shape:
        raise KernelInputError(f"key/value {tuple(key.shape)} do not match the step's plan")
    if plan.store_tokens is not None:
        key, value = key[plan.store_tokens], value[plan.store_tokens]
    slot_shape = (-1, *key_cache.shape[2:])  # [num_slots, num_kv_heads, head_dim] views
    key_cache.view(slot_shape).index_copy_(0, plan.store_slots, key)
    value_cache.view(slot_shape).index_copy_(0, plan.store_slots, value)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``rms_norm`` with the residual, without the per-call checks: for the model's own tensors.
    Returns ``(norm(s) * weight, s)``, ``s = x + residual`` (``s = x`` when residual is None)."""
    if residual is not None and residual.shape != x.shape:
        raise KernelInputError(f"residual {tuple(residual.shape)} != x {tuple(x.shape)}")
    summed = x if residual is None else x + residual
    normed = F.rms_norm(summed.float(), (x.shape[-1],), eps=eps)
    return normed.to(x.dtype) * weight, summed
