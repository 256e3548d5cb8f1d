"""Paged ragged attention in PyTorch: the CPU serving path and the Triton kernel's reference.

Decode rows (one query token) are computed together: their contexts are gathered through the block
tables into one padded batch, grouped by length when padding to the longest would waste much, and
attended with one ``scaled_dot_product_attention`` call per group under a length mask. Prompt
chunks (several query tokens) are computed one row each, causally, with the diagonal shifted by
the row's cached prefix.

Everything that depends on the batch alone (the rows' kinds, the cache slot of every context
position, the masks, the length groups, the checks of the metadata's values) is worked out once
per step by ``plan_paged_attention``; ``paged_attention_planned`` then costs each layer a few
operators per group. ``paged_attention`` is the one-call form (plan, then run).

The caches are read as ``[num_slots * num_kv_heads, head_dim]``: a gather by (slot, head) index
lands K/V directly in the ``[rows, num_kv_heads, context, head_dim]`` layout attention wants.

    block_size 4, decode row with block_table [7, 2], context_len 6:
    slots [28, 29, 30, 31, 8, 9]            (block 7 offsets 0..3, block 2 offsets 0..1)
    padded to 8 in a group whose longest context is 8: [28, 29, 30, 31, 8, 9, 28, 28], mask 6 True
    2 KV heads: (slot, head) rows [56, 58, 60, 62, 16, 18, 56, 56, 57, 59, 61, 63, 17, 19, 57, 57]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.checks import KernelInputError, check_paged_attention

__all__ = ["AttentionPlan", "paged_attention", "paged_attention_planned", "plan_paged_attention"]

# Split decode rows into length groups only when that avoids gathering this many padding positions.
MIN_SAVED_POSITIONS = 2048


@dataclass(frozen=True)
class DecodeGroup:
    """Decode rows attended in one call, their contexts padded to the group's longest."""

    tokens: torch.Tensor | slice  # [num_rows] each row's token index in the query
    # [num_rows * num_kv_heads * padded_len] int64 (slot, head) rows; padding -> position 0's
    kv_rows: torch.Tensor
    mask: torch.Tensor | None  # [num_rows, 1, 1, padded_len] bool, None when nothing is padding
    num_rows: int
    padded_len: int


@dataclass(frozen=True)
class PromptRow:
    """One prompt chunk: query tokens start .. end - 1 over context positions 0 .. ctx_len - 1."""

    start: int
    end: int
    ctx_len: int
    kv_rows: torch.Tensor  # [num_kv_heads * ctx_len] int64 (slot, head) rows of the caches
    mask: torch.Tensor | None  # [q_len, ctx_len] bool when a cached prefix shifts the diagonal


@dataclass(frozen=True)
class AttentionPlan:
    """What a step's attention reads, checked and indexed once for every layer."""

    num_tokens: int
    block_size: int
    num_kv_heads: int
    decode_groups: tuple[DecodeGroup, ...]
    prompt_rows: tuple[PromptRow, ...]


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
    whose K/V are already in the cache. Single-token rows (decodes) are computed together (in
    length groups); rows of several tokens (prompt chunks) one call each. Row lengths are checked
    before anything is written.
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
    plan = plan_paged_attention(
        query_start,
        context_lens,
        block_tables,
        block_size=key_cache.shape[1],
        num_kv_heads=key_cache.shape[2],
        num_tokens=query.shape[0],
    )
    return paged_attention_planned(query, key_cache, value_cache, plan, scale, out)


def plan_paged_attention(
    query_start: torch.Tensor,  # [num_rows + 1] int32
    context_lens: torch.Tensor,  # [num_rows] int32
    block_tables: torch.Tensor,  # [num_rows, max_blocks_per_row] int32
    *,
    block_size: int,
    num_kv_heads: int,
    num_tokens: int,
) -> AttentionPlan:
    """Checks the metadata's values and computes every layer's gather indices and masks.

    Raises KernelInputError when query_start does not run from 0 to ``num_tokens`` by
    non-decreasing steps, or a row's context_len is outside [its query tokens, the capacity of
    its block table]. Reads the metadata once (one device sync per step, none per layer).
    """
    num_rows = context_lens.shape[0]
    capacity = block_tables.shape[1] * block_size
    if num_rows == 0:
        return AttentionPlan(num_tokens, block_size, num_kv_heads, (), ())
    starts, ctx_lens = query_start.tolist(), context_lens.tolist()
    if starts[0] != 0 or starts[-1] != num_tokens:
        raise KernelInputError(f"query_start must run from 0 to num_tokens {num_tokens}")
    decode_rows: list[int] = []
    prompt_rows: list[int] = []
    for row, ctx_len in enumerate(ctx_lens):
        start, end = starts[row], starts[row + 1]
        if end < start:
            raise KernelInputError(f"query_start decreases at row {row}: {start} -> {end}")
        q_len = end - start
        if q_len == 1:
            decode_rows.append(row)
        elif q_len > 1:
            if not q_len <= ctx_len <= capacity:
                raise KernelInputError(
                    f"row {row} of {q_len} query tokens has context_len {ctx_len} "
                    f"(must be in [{q_len}, {capacity}])"
                )
            prompt_rows.append(row)
    if decode_rows:
        decode_ctx = [ctx_lens[row] for row in decode_rows]
        if min(decode_ctx) < 1 or max(decode_ctx) > capacity:
            raise KernelInputError(
                f"decode context_lens must be in [1, {capacity}], "
                f"got [{min(decode_ctx)}, {max(decode_ctx)}]"
            )
    tables = block_tables.long()  # [num_rows, max_blocks_per_row]
    heads = torch.arange(num_kv_heads, device=tables.device)[:, None]  # [num_kv_heads, 1]
    groups = tuple(
        _plan_decode_group(rows, [starts[row] for row in rows], ctx_lens, tables, block_size, heads)
        for rows in _decode_groups(decode_rows, ctx_lens, block_size)
    )
    prompts = tuple(
        _plan_prompt_row(
            starts[row], starts[row + 1], ctx_lens[row], tables[row], block_size, heads
        )
        for row in prompt_rows
    )
    return AttentionPlan(num_tokens, block_size, num_kv_heads, groups, prompts)


def _decode_groups(decode_rows: list[int], ctx_lens: list[int], block_size: int) -> list[list[int]]:
    """The decode rows in one group, or in length groups when that avoids gathering at least
    MIN_SAVED_POSITIONS padding positions."""
    if not decode_rows:
        return []
    lengths = [ctx_lens[row] for row in decode_rows]
    if len(decode_rows) * max(lengths) - sum(lengths) < MIN_SAVED_POSITIONS:
        return [decode_rows]
    num_blocks = [-(-length // block_size) for length in lengths]
    return [[decode_rows[i] for i in group] for group in length_groups(num_blocks)]


def _plan_decode_group(
    rows: list[int],
    tokens: list[int],
    ctx_lens: list[int],
    tables: torch.Tensor,  # [num_rows, max_blocks_per_row] int64
    block_size: int,
    heads: torch.Tensor,  # [num_kv_heads, 1] int64
) -> DecodeGroup:
    device = tables.device
    lengths = torch.tensor([ctx_lens[row] for row in rows], device=device)  # [num_group_rows]
    padded_len = max(ctx_lens[row] for row in rows)
    positions = torch.arange(padded_len, device=device)  # [padded_len]
    inside = positions < lengths[:, None]  # [num_group_rows, padded_len]
    # Padding positions read the row's position 0: written, finite, masked out.
    positions = positions * inside
    row_index = torch.tensor(rows, device=device)
    block_ids = tables[row_index].gather(1, positions // block_size)
    slots = block_ids * block_size + positions % block_size  # [num_group_rows, padded_len]
    kv_rows = (slots[:, None, :] * heads.shape[0] + heads).reshape(-1)
    mask = None if all(ctx_lens[row] == padded_len for row in rows) else inside[:, None, None, :]
    token_index: torch.Tensor | slice = torch.tensor(tokens, device=device)
    if tokens == list(range(tokens[0], tokens[0] + len(tokens))):  # consecutive: a view
        token_index = slice(tokens[0], tokens[0] + len(tokens))
    return DecodeGroup(token_index, kv_rows, mask, len(rows), padded_len)


def _plan_prompt_row(
    start: int, end: int, ctx_len: int, table: torch.Tensor, block_size: int, heads: torch.Tensor
) -> PromptRow:
    positions = torch.arange(ctx_len, device=table.device)  # [ctx_len]
    slots = table[positions // block_size] * block_size + positions % block_size  # [ctx_len]
    kv_rows = (slots * heads.shape[0] + heads).reshape(-1)  # [num_kv_heads * ctx_len]
    mask = None
    q_len = end - start
    if ctx_len > q_len:  # a cached prefix: the causal diagonal is shifted by ctx_len - q_len
        mask = positions[None, :] <= positions[ctx_len - q_len :, None]  # [q_len, ctx_len]
    return PromptRow(start, end, ctx_len, kv_rows, mask)


def paged_attention_planned(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    plan: AttentionPlan,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``paged_attention`` with the metadata's work done by ``plan_paged_attention``. Checks only
    that the query and cache agree with the plan; the tensors' dtypes and layouts are the
    caller's (see ``check_paged_attention``)."""
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    if (query.shape[0], block_size, num_kv_heads) != (
        plan.num_tokens,
        plan.block_size,
        plan.num_kv_heads,
    ):
        raise KernelInputError(
            f"the plan is for {plan.num_tokens} tokens, block_size {plan.block_size} and "
            f"{plan.num_kv_heads} KV heads, got {query.shape[0]}, {block_size} and {num_kv_heads}"
        )
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    # [num_slots * num_kv_heads, head_dim] views of the caches: one row per (slot, head)
    key_rows, value_rows = key_cache.view(-1, head_dim), value_cache.view(-1, head_dim)
    for group in plan.decode_groups:
        _attend_decode_group(query, key_rows, value_rows, group, scale, out)
    for row in plan.prompt_rows:
        _attend_prompt_row(query, key_rows, value_rows, row, scale, out)
    return out


def length_groups(num_blocks: list[int]) -> list[list[int]]:
    """Row indices grouped by power-of-two block counts, so that padding a group to its longest
    row at most doubles it: [1, 2, 3, 9, 16, 4] blocks -> [[0], [1], [2, 5], [3, 4]]."""
    groups: dict[int, list[int]] = {}
    for row, count in enumerate(num_blocks):
        groups.setdefault((count - 1).bit_length(), []).append(row)
    return [groups[key] for key in sorted(groups)]


def _attend_decode_group(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_rows: torch.Tensor,  # [num_slots * num_kv_heads, head_dim]
    value_rows: torch.Tensor,
    group: DecodeGroup,
    scale: float,
    out: torch.Tensor,
) -> None:
    """Decode rows at once: gather their contexts padded to the longest, mask the padding."""
    num_rows, padded_len = group.num_rows, group.padded_len
    num_heads, head_dim = query.shape[1], query.shape[2]
    shape = (num_rows, -1, padded_len, head_dim)  # [num_rows, num_kv_heads, padded_len, head_dim]
    keys = key_rows.index_select(0, group.kv_rows).view(shape)
    values = value_rows.index_select(0, group.kv_rows).view(shape)
    # [num_rows, num_kv_heads, heads per KV head, head_dim]
    queries = query[group.tokens].view(num_rows, keys.shape[1], -1, head_dim)
    attended = F.scaled_dot_product_attention(
        queries, keys, values, attn_mask=group.mask, scale=scale
    )  # [num_rows, num_kv_heads, heads per KV head, head_dim]
    out[group.tokens] = attended.view(num_rows, num_heads, head_dim)


def _attend_prompt_row(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_rows: torch.Tensor,  # [num_slots * num_kv_heads, head_dim]
    value_rows: torch.Tensor,
    row: PromptRow,
    scale: float,
    out: torch.Tensor,
) -> None:
    """One prompt chunk: query i (position ctx_len - q_len + i) sees positions 0 .. its own."""
    queries = query[row.start : row.end].transpose(0, 1)  # [num_heads, q_len, head_dim]
    shape = (-1, row.ctx_len, query.shape[2])
    keys = key_rows.index_select(0, row.kv_rows).view(shape)  # [num_kv_heads, ctx_len, head_dim]
    values = value_rows.index_select(0, row.kv_rows).view(shape)
    attended = F.scaled_dot_product_attention(
        queries,
        keys,
        values,
        attn_mask=row.mask,
        is_causal=row.mask is None,
        scale=scale,
        enable_gqa=queries.shape[0] != keys.shape[0],
    )  # [num_heads, q_len, head_dim]
    out[row.start : row.end] = attended.transpose(0, 1)
