"""Paged ragged attention in PyTorch: the CPU serving path and the Triton kernel's reference.

Decode rows (one query token) are computed together: their contexts are gathered through the block
tables into one padded batch, grouped by length when padding to the longest would waste much, and
attended with one ``scaled_dot_product_attention`` call per group under a length mask. Prompt
chunks (several query tokens) are computed one row each, causally, with the diagonal shifted by
the row's cached prefix.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.checks import KernelInputError, check_paged_attention

__all__ = ["paged_attention"]

# Split decode rows into length groups only when that avoids gathering this many padding positions.
MIN_SAVED_POSITIONS = 2048


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
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if context_lens.shape[0] == 0:
        return out
    if int(query_start[0]) != 0 or int(query_start[-1]) != query.shape[0]:
        raise KernelInputError(f"query_start must run from 0 to num_tokens {query.shape[0]}")
    query_lens = query_start[1:] - query_start[:-1]  # [num_rows]
    decode_rows = (query_lens == 1).nonzero().squeeze(1)  # [num_decode_rows]
    num_decode = decode_rows.numel()
    capacity = block_tables.shape[1] * key_cache.shape[1]
    no_prompts = num_decode == context_lens.shape[0]
    prompt_rows = [] if no_prompts else _prompt_rows(query_start, context_lens, capacity)
    if num_decode:
        rows: torch.Tensor | slice = decode_rows
        tokens: torch.Tensor | slice = query_start[decode_rows]
        if int(decode_rows[-1]) == num_decode - 1:  # decodes lead the batch: rows = tokens = 0..n-1
            rows = tokens = slice(0, num_decode)  # views instead of gathers
        _attend_decode_rows(
            query, key_cache, value_cache, tokens, context_lens[rows], block_tables[rows], scale,
            out,
        )  # fmt: skip
    for row, start, end, ctx_len in prompt_rows:
        _attend_prompt_row(
            query[start:end], key_cache, value_cache, ctx_len, block_tables[row], scale,
            out[start:end],
        )  # fmt: skip
    return out


def _prompt_rows(
    query_start: torch.Tensor, context_lens: torch.Tensor, capacity: int
) -> list[tuple[int, int, int, int]]:
    """(row, first token, end token, context_len) of each row of several tokens, checked."""
    starts, ctx_lens = query_start.tolist(), context_lens.tolist()
    rows = []
    for row, ctx_len in enumerate(ctx_lens):
        start, end = starts[row], starts[row + 1]
        if end < start:
            raise KernelInputError(f"query_start decreases at row {row}: {start} -> {end}")
        if end - start > 1:
            if not end - start <= ctx_len <= capacity:
                raise KernelInputError(
                    f"row {row} of {end - start} query tokens has context_len {ctx_len} "
                    f"(must be in [{end - start}, {capacity}])"
                )
            rows.append((row, start, end, ctx_len))
    return rows


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
    """All decode rows, in as few length groups as keep the padding small."""
    num_decode = ctx_lens.shape[0]
    block_size = key_cache.shape[1]
    min_ctx, max_ctx = (int(length) for length in ctx_lens.aminmax())
    if min_ctx < 1 or max_ctx > block_tables.shape[1] * block_size:
        raise KernelInputError(
            f"decode context_lens must be in [1, {block_tables.shape[1] * block_size}], "
            f"got [{min_ctx}, {max_ctx}]"
        )
    num_blocks = (ctx_lens + block_size - 1) // block_size  # [num_decode]
    num_padding_blocks = num_decode * -(-max_ctx // block_size) - int(num_blocks.sum())
    if num_padding_blocks * block_size < MIN_SAVED_POSITIONS:
        _attend_decode_group(
            query, key_cache, value_cache, tokens, ctx_lens, block_tables, max_ctx, scale, out
        )
        return
    if isinstance(tokens, slice):
        tokens = torch.arange(tokens.start, tokens.stop, device=ctx_lens.device)
    for rows in length_groups(num_blocks.tolist()):
        index = torch.tensor(rows, device=ctx_lens.device)
        group_ctx_lens = ctx_lens[index]
        _attend_decode_group(
            query, key_cache, value_cache, tokens[index], group_ctx_lens, block_tables[index],
            int(group_ctx_lens.max()), scale, out,
        )  # fmt: skip


def length_groups(num_blocks: list[int]) -> list[list[int]]:
    """Row indices grouped by power-of-two block counts, so that padding a group to its longest
    row at most doubles it: [1, 2, 3, 9, 16, 4] blocks -> [[0], [1], [2, 5], [3, 4]]."""
    groups: dict[int, list[int]] = {}
    for row, count in enumerate(num_blocks):
        groups.setdefault((count - 1).bit_length(), []).append(row)
    return [groups[key] for key in sorted(groups)]


def _attend_decode_group(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    tokens: torch.Tensor | slice,  # [num_rows] each row's token index in query
    ctx_lens: torch.Tensor,  # [num_rows]
    block_tables: torch.Tensor,  # [num_rows, max_blocks_per_row]
    max_ctx: int,
    scale: float,
    out: torch.Tensor,
) -> None:
    """Decode rows at once: gather their contexts padded to the longest, mask the padding."""
    num_rows = ctx_lens.shape[0]
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    num_heads = query.shape[1]
    num_ctx_blocks = -(-max_ctx // block_size)
    padded_len = num_ctx_blocks * block_size
    block_ids = block_tables[:, :num_ctx_blocks].reshape(-1)  # [num_rows * num_ctx_blocks]
    keys = _gather_blocks(key_cache, block_ids)  # [num_rows * padded_len, num_kv_heads, head_dim]
    values = _gather_blocks(value_cache, block_ids)
    # [num_rows, padded_len]: True where the position is inside the row's context
    mask = torch.arange(padded_len, device=ctx_lens.device) < ctx_lens[:, None]
    # Padding slots may hold anything (an unwritten cache is uninitialized memory, maybe NaN) and
    # NaN survives an additive mask: zero them.
    padding = (~mask).view(-1).nonzero().squeeze(1)
    if padding.numel():
        keys.index_fill_(0, padding, 0)
        values.index_fill_(0, padding, 0)
    # [num_rows, num_kv_heads, padded_len, head_dim]
    keys = keys.view(num_rows, padded_len, num_kv_heads, head_dim).transpose(1, 2)
    values = values.view(num_rows, padded_len, num_kv_heads, head_dim).transpose(1, 2)
    group = num_heads // num_kv_heads
    queries = query[tokens].view(num_rows, num_kv_heads, group, head_dim)
    attended = F.scaled_dot_product_attention(
        queries, keys, values, attn_mask=mask[:, None, None, :], scale=scale
    )  # [num_rows, num_kv_heads, group, head_dim]
    out[tokens] = attended.reshape(num_rows, num_heads, head_dim)


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
