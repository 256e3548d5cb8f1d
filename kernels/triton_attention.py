"""Paged ragged attention in Triton: one launch for a batch mixing prompt chunks and decodes.

Programs: (query tile, kv head, context split). A query tile holds BLOCK_Q consecutive tokens of one
row times the GROUP query heads that share the kv head, flattened into BLOCK_M = BLOCK_Q * GROUP
(padded) rows of one ``tl.dot``; GROUP 3, BLOCK_M 16 -> BLOCK_Q 5, tile row m is token m // 3 of
the tile and head kv_head * 3 + m % 3 (row 15 is padding).

Query tiles are numbered across the batch without a host-side table: row r's tiles start at
``query_start[r] // BLOCK_Q + r``, which over-counts by at most one tile per row, so the grid has
``num_tokens // BLOCK_Q + num_rows`` tiles; a program finds its row by binary search over that
start and returns at once if the row has fewer tiles.

query_start [0, 4, 5, 8], BLOCK_Q 2 -> tile starts [0, 3, 4] (rows of 4, 1, 3 tokens):
tiles 0-1 row 0, tile 3 row 1, tiles 4-5 row 2, tiles 2 and 6 empty; grid 8 // 2 + 3 = 7.

Each program walks the context in tiles of TILE_N positions, looking each position's physical
block up in the row's block table (any block size), with an online softmax in float32. With
NUM_SPLITS > 1 (flash-decoding), split s walks its share of the tiles and writes a normalized
partial output and its log-sum-exp; a second kernel merges the splits.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

# The interpreter's tl.dot gives wrong results on bfloat16 operands: dot in float32 there only.
INTERPRET = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")

TILE_N = 64  # context positions per step
MIN_TOKENS_PER_SPLIT = 256
MAX_SPLITS = 64
PROGRAMS_PER_MULTIPROCESSOR = 4  # what context splits aim for
LOG2_E = 1.4426950408889634


@triton.jit
def _find_row(query_start_ptr, num_rows: tl.int32, tile_id, BLOCK_Q: tl.constexpr):
    """The last row r with query_start[r] // BLOCK_Q + r <= tile_id."""
    low: tl.int32 = 0  # typed: both bounds are loop-carried
    high: tl.int32 = num_rows
    while low < high:
        mid = (low + high) // 2
        first_tile = tl.load(query_start_ptr + mid) // BLOCK_Q + mid
        if first_tile <= tile_id:
            low = mid + 1
        else:
            high = mid
    return low - 1


@triton.jit
def _paged_attention_kernel(
    query_ptr,  # [num_tokens, num_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,
    query_start_ptr,  # [num_rows + 1] int32
    context_lens_ptr,  # [num_rows] int32
    block_tables_ptr,  # [num_rows, max_blocks_per_row] int32
    out_ptr,  # [num_tokens, num_heads, head_dim], or with splits the partial outputs
    lse_ptr,  # [num_tokens, num_heads, NUM_SPLITS] float32 (splits only)
    num_rows: tl.int32,
    num_heads,
    scale_log2,  # softmax scale * log2(e)
    stride_q_token,
    stride_q_head,
    stride_cache_block,
    stride_cache_offset,
    stride_cache_head,
    stride_table_row,
    stride_out_token,
    stride_out_head,
    stride_out_split,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    TILE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for float32 (no TF32 rounding), else the default
):
    tile_id = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    row = _find_row(query_start_ptr, num_rows, tile_id, BLOCK_Q)
    row_start = tl.load(query_start_ptr + row)
    query_len = tl.load(query_start_ptr + row + 1) - row_start
    local_tile = tile_id - (row_start // BLOCK_Q + row)
    if local_tile * BLOCK_Q >= query_len:
        return
    context_len = tl.load(context_lens_ptr + row)

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PADDED)
    token_in_row = local_tile * BLOCK_Q + offs_m // GROUP  # [BLOCK_M]
    head = kv_head * GROUP + offs_m % GROUP
    row_valid = (offs_m < BLOCK_Q * GROUP) & (token_in_row < query_len)
    d_valid = offs_d < HEAD_DIM
    token = row_start + token_in_row
    q_position = context_len - query_len + token_in_row  # causal limit of each tile row

    q_offsets = token[:, None] * stride_q_token + head[:, None] * stride_q_head + offs_d[None, :]
    q = tl.load(query_ptr + q_offsets, mask=row_valid[:, None] & d_valid[None, :], other=0.0)
    if INTERPRET:
        q = q.to(tl.float32)

    # Positions this tile needs: 0 .. the last valid token's position.
    last_token = tl.minimum(local_tile * BLOCK_Q + BLOCK_Q, query_len) - 1
    kv_len = context_len - query_len + last_token + 1
    num_tiles = tl.cdiv(kv_len, TILE)
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    tile_begin = split * tiles_per_split
    tile_end = tl.minimum(tile_begin + tiles_per_split, num_tiles)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PADDED], tl.float32)
    offs_n = tl.arange(0, TILE)
    table_row = block_tables_ptr + row * stride_table_row
    for kv_tile in range(tile_begin, tile_end):
        position = kv_tile * TILE + offs_n  # [TILE]
        in_context = position < kv_len
        block = tl.load(table_row + position // BLOCK_SIZE, mask=in_context, other=0)
        slot = (
            block.to(tl.int64) * stride_cache_block
            + (position % BLOCK_SIZE) * stride_cache_offset
            + kv_head * stride_cache_head
        )
        kv_mask = in_context[:, None] & d_valid[None, :]
        k = tl.load(key_cache_ptr + slot[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(value_cache_ptr + slot[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if INTERPRET:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        # [BLOCK_M, TILE], in log2 units
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        visible = (
            row_valid[:, None] & in_context[None, :] & (position[None, :] <= q_position[:, None])
        )
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
        p = tl.exp2(scores - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    result = acc / l_safe[:, None]
    out_offsets = (
        token[:, None] * stride_out_token
        + head[:, None] * stride_out_head
        + split * stride_out_split
        + offs_d[None, :]
    )
    store_mask = row_valid[:, None] & d_valid[None, :]
    tl.store(out_ptr + out_offsets, result.to(out_ptr.dtype.element_ty), mask=store_mask)
    if NUM_SPLITS > 1:
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))  # base 2
        lse_offsets = (token * num_heads + head) * NUM_SPLITS + split
        tl.store(lse_ptr + lse_offsets, lse, mask=row_valid)


@triton.jit
def _merge_splits_kernel(
    partial_ptr,  # [num_tokens, num_heads, NUM_SPLITS, head_dim] float32
    lse_ptr,  # [num_tokens, num_heads, NUM_SPLITS] float32, base 2
    out_ptr,  # [num_tokens, num_heads, head_dim]
    num_heads,
    stride_out_token,
    stride_out_head,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, HEAD_DIM_PADDED)
    d_valid = offs_d < HEAD_DIM
    base = token * num_heads + head
    lse = tl.load(lse_ptr + base * NUM_SPLITS + offs_s)  # split 0 always holds position 0
    weights = tl.exp2(lse - tl.max(lse, 0))  # [NUM_SPLITS]; empty splits weigh 0
    partial_offsets = (base * NUM_SPLITS + offs_s[:, None]) * HEAD_DIM + offs_d[None, :]
    partial = tl.load(partial_ptr + partial_offsets, mask=d_valid[None, :], other=0.0)
    merged = tl.sum(partial * weights[:, None], 0) / tl.sum(weights, 0)
    out_offsets = token * stride_out_token + head * stride_out_head + offs_d
    tl.store(out_ptr + out_offsets, merged.to(out_ptr.dtype.element_ty), mask=d_valid)


@functools.lru_cache(maxsize=8)
def _num_multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the interpreter runs programs one after another: splitting gains nothing
    return torch.cuda.get_device_properties(device).multi_processor_count


def _block_m(group: int, max_query_len: int) -> int:
    """Rows of the query tile: 16 at least (tl.dot), 64 when prompt chunks can fill it."""
    block_m = max(16, triton.next_power_of_2(group))
    if max_query_len * group >= 64:
        block_m = max(block_m, 64)
    return block_m


def choose_num_splits(
    num_query_tiles: int, num_kv_heads: int, max_context_len: int, device: torch.device
) -> int:
    """Split the context when the batch alone cannot fill the device and contexts are long
    (few long decodes): enough splits for about four programs per multiprocessor."""
    num_programs = num_query_tiles * num_kv_heads
    target = PROGRAMS_PER_MULTIPROCESSOR * _num_multiprocessors(device)
    if num_programs >= target or max_context_len < 2 * MIN_TOKENS_PER_SPLIT:
        return 1
    by_length = max_context_len // MIN_TOKENS_PER_SPLIT
    wanted = min(MAX_SPLITS, by_length, triton.cdiv(target, max(num_programs, 1)))
    return triton.next_power_of_2(wanted) if wanted > 1 else 1


def launch_paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    query_start: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_query_len: int,
    max_context_len: int,
    out: torch.Tensor,
    num_splits: int | None = None,
    deterministic: bool = False,
    tile_n: int = TILE_N,
    **launch_options: int,
) -> torch.Tensor:
    """Run the kernel(s) on checked inputs; ``num_splits`` None picks it by the heuristic.
    ``tile_n`` (context positions a step) and ``launch_options`` (Triton's ``num_warps``,
    ``num_stages``) are the benchmark's tuning knobs; serving keeps the defaults.

    ``deterministic``: a query's result must not depend on the batch, so nothing that shapes
    its sums may: one context split (the heuristic reads the batch's size) and query tiles of
    ``_block_m(group, 64)`` rows whatever the longest chunk. The context tiles past a query's
    position that its query tile walks add exact zeros (weight 0, rescale by 1).

    The split path allocates its float32 partial outputs; the single-pass path allocates nothing.
    """
    num_tokens, num_heads, head_dim = query.shape
    num_rows = context_lens.shape[0]
    if num_tokens == 0 or num_rows == 0:
        return out
    _, block_size, num_kv_heads, _ = key_cache.shape
    group = num_heads // num_kv_heads
    block_m = _block_m(group, 64 if deterministic else max_query_len)
    block_q = block_m // group
    num_query_tiles = num_tokens // block_q + num_rows
    if deterministic:
        num_splits = 1
    elif num_splits is None:
        num_splits = choose_num_splits(num_query_tiles, num_kv_heads, max_context_len, query.device)
    if num_splits < 1 or num_splits & (num_splits - 1):
        raise ValueError(f"num_splits must be a power of two, got {num_splits}")
    head_dim_padded = max(16, triton.next_power_of_2(head_dim))  # tl.dot needs K >= 16
    if num_splits == 1:
        target, lse = out, out  # lse is not touched without splits
        stride_target = (out.stride(0), out.stride(1), 0)
    else:
        target = torch.empty(
            num_tokens, num_heads, num_splits, head_dim, dtype=torch.float32, device=query.device
        )
        lse = torch.empty(
            num_tokens, num_heads, num_splits, dtype=torch.float32, device=query.device
        )
        stride_target = (target.stride(0), target.stride(1), target.stride(2))
    _paged_attention_kernel[(num_query_tiles, num_kv_heads, num_splits)](
        query, key_cache, value_cache, query_start, context_lens, block_tables, target, lse,
        num_rows, num_heads, scale * LOG2_E,
        query.stride(0), query.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        block_tables.stride(0),
        *stride_target,
        BLOCK_SIZE=block_size, HEAD_DIM=head_dim, HEAD_DIM_PADDED=head_dim_padded, GROUP=group,
        BLOCK_M=block_m, BLOCK_Q=block_q, TILE=tile_n, NUM_SPLITS=num_splits,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32", **launch_options,
    )  # fmt: skip
    if num_splits > 1:
        _merge_splits_kernel[(num_tokens, num_heads)](
            target, lse, out, num_heads, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, HEAD_DIM_PADDED=head_dim_padded, NUM_SPLITS=num_splits,
        )  # fmt: skip
    return out
