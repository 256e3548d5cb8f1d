"""The PyTorch implementation of each op: the CPU runtime path and the Triton kernels' reference.

The paged KV cache, per layer (one tensor for K, one for V):

    key_cache [num_blocks, block_size, num_kv_heads, head_dim]
    slot = block_id * block_size + offset          (block_size 4: block 2, offset 1 -> slot 9)

A row's context is read through its block table, physical block ids in logical order:
block_table [7, 2], block_size 4, context_len 6 -> positions 0..3 in block 7, 4..5 in block 2.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.checks import (
    KernelInputError,
    check_paged_attention,
    check_rms_norm,
    check_rotary_embedding,
    check_store_kv,
)

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
    valid = slot_mapping >= 0  # [num_tokens]
    if bool(valid.all()):
        slots = slot_mapping
    else:
        slots = slot_mapping[valid]
        key, value = key[valid], value[valid]
    if slots.numel() and int(slots.max()) >= num_slots:
        raise KernelInputError(f"slot_mapping holds a slot >= the cache's {num_slots} slots")
    # [num_slots, num_kv_heads, head_dim] views of the caches
    key_cache.view(num_slots, *key_cache.shape[2:]).index_copy_(0, slots, key)
    value_cache.view(num_slots, *value_cache.shape[2:]).index_copy_(0, slots, value)


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    query_start: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_query_len: int,
    max_context_len: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of a ragged batch (prompt chunks and decodes) over the paged KV cache.

    Row r owns query tokens ``query_start[r] .. query_start[r + 1] - 1``; its i-th of q_len tokens
    sits at position ``context_lens[r] - q_len + i`` and attends to positions 0 .. that position,
    whose K/V are already in the cache. Single-token rows (decodes) are computed together in one
    batched call; rows of several tokens (prompt chunks) one call each.
    """
    check_paged_attention(
        query,
        key_cache,
        value_cache,
        query_start,
        context_lens,
        block_tables,
        max_query_len,
        max_context_len,
        out,
    )
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if context_lens.shape[0] == 0:
        return out
    query_lens = query_start[1:] - query_start[:-1]  # [num_rows]
    decode_rows = (query_lens == 1).nonzero().squeeze(1)  # [num_decode_rows]
    num_decode = decode_rows.numel()
    if num_decode:
        rows: torch.Tensor | slice = decode_rows
        tokens: torch.Tensor | slice = query_start[decode_rows]
        if int(decode_rows[-1]) == num_decode - 1:  # decodes lead the batch: rows = tokens = 0..n-1
            rows = tokens = slice(0, num_decode)  # views instead of gathers
        _attend_decode_rows(
            query, key_cache, value_cache, tokens, context_lens[rows], block_tables[rows], scale,
            out,
        )  # fmt: skip
    if max_query_len > 1 or decode_rows.numel() < context_lens.shape[0]:
        starts, ctx_lens = query_start.tolist(), context_lens.tolist()
        for row, ctx_len in enumerate(ctx_lens):
            start, end = starts[row], starts[row + 1]
            if end - start > 1:
                _attend_prompt_row(
                    query[start:end], key_cache, value_cache, ctx_len, block_tables[row], scale,
                    out[start:end],
                )  # fmt: skip
            elif end < start:
                raise KernelInputError(f"query_start decreases at row {row}: {start} -> {end}")
    return out


def _gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """[num_blocks, block_size, kv, d] cache, [n] ids -> [n * block_size, kv, d] copy."""
    return cache.index_select(0, block_ids).flatten(0, 1)


def _attend_decode_rows(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    tokens: torch.Tensor | slice,  # [num_decode] each row's token index in query
    ctx_lens: torch.Tensor,  # [num_decode]
    block_tables: torch.Tensor,  # [num_decode, max_blocks_per_row]
    scale: float,
    out: torch.Tensor,
) -> None:
    """All decode rows at once: gather their contexts padded to the longest, mask the padding."""
    num_decode = ctx_lens.shape[0]
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    num_heads = query.shape[1]
    min_ctx, max_ctx = ctx_lens.aminmax()
    min_ctx, max_ctx = int(min_ctx), int(max_ctx)
    if min_ctx < 1 or max_ctx > block_tables.shape[1] * block_size:
        raise KernelInputError(
            f"decode context_lens must be in [1, {block_tables.shape[1] * block_size}], "
            f"got [{min_ctx}, {max_ctx}]"
        )
    num_ctx_blocks = -(-max_ctx // block_size)
    padded_len = num_ctx_blocks * block_size
    block_ids = block_tables[:, :num_ctx_blocks].reshape(-1)  # [num_decode * num_ctx_blocks]
    keys = _gather_blocks(key_cache, block_ids)  # [num_decode * padded_len, num_kv_heads, head_dim]
    values = _gather_blocks(value_cache, block_ids)
    # [num_decode, padded_len]: True where the position is inside the row's context
    mask = torch.arange(padded_len, device=ctx_lens.device) < ctx_lens[:, None]
    # Padding slots may hold anything (an unwritten cache is uninitialized memory, maybe NaN) and
    # NaN survives an additive mask: zero them.
    padding = (~mask).view(-1).nonzero().squeeze(1)
    if padding.numel():
        keys.index_fill_(0, padding, 0)
        values.index_fill_(0, padding, 0)
    # [num_decode, num_kv_heads, padded_len, head_dim]
    keys = keys.view(num_decode, padded_len, num_kv_heads, head_dim).transpose(1, 2)
    values = values.view(num_decode, padded_len, num_kv_heads, head_dim).transpose(1, 2)
    group = num_heads // num_kv_heads
    queries = query[tokens].view(num_decode, num_kv_heads, group, head_dim)
    attended = F.scaled_dot_product_attention(
        queries, keys, values, attn_mask=mask[:, None, None, :], scale=scale
    )  # [num_decode, num_kv_heads, group, head_dim]
    out[tokens] = attended.reshape(num_decode, num_heads, head_dim)


def _attend_prompt_row(
    query: torch.Tensor,  # [q_len, num_heads, head_dim]
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    ctx_len: int,
    block_table: torch.Tensor,  # [max_blocks_per_row]
    scale: float,
    out: torch.Tensor,  # [q_len, num_heads, head_dim]
) -> None:
    """One prompt chunk: query i (position ctx_len - q_len + i) sees positions 0 .. its own."""
    q_len = query.shape[0]
    block_size = key_cache.shape[1]
    if not q_len <= ctx_len <= block_table.shape[0] * block_size:
        raise KernelInputError(
            f"a row of {q_len} query tokens has context_len {ctx_len} "
            f"(must be in [{q_len}, {block_table.shape[0] * block_size}])"
        )
    block_ids = block_table[: -(-ctx_len // block_size)]
    keys = _gather_blocks(key_cache, block_ids)[:ctx_len].transpose(0, 1)  # [kv, ctx_len, d]
    values = _gather_blocks(value_cache, block_ids)[:ctx_len].transpose(0, 1)
    mask = None
    if ctx_len > q_len:  # a cached prefix: the causal diagonal is shifted by ctx_len - q_len
        positions = torch.arange(ctx_len, device=query.device)
        mask = positions[None, :] <= positions[ctx_len - q_len :, None]  # [q_len, ctx_len]
    attended = F.scaled_dot_product_attention(
        query.transpose(0, 1),
        keys,
        values,
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=query.shape[1] != keys.shape[0],
    )  # [num_heads, q_len, head_dim]
    out.copy_(attended.transpose(0, 1))


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
    hidden = summed.float()
    normed = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
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
    for x in (query, key):
        x1, x2 = x[..., :half].float(), x[..., half:].float()
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        x.copy_(rotated)
