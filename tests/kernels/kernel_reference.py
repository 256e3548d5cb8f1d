"""Random ragged batches over a paged KV cache, the backends' step inputs made from them, and the
simplest possible reference ops (float64).

Shared by the PyTorch-backend tests and the Triton-backend tests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kernels import AttentionMetadata


@dataclass
class RaggedBatch:
    query: torch.Tensor  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor
    query_start: torch.Tensor  # [num_rows + 1] int32
    context_lens: torch.Tensor  # [num_rows] int32
    block_tables: torch.Tensor  # [num_rows, max_blocks_per_row] int32
    max_query_len: int
    max_context_len: int
    scale: float

    def token_positions(self) -> list[tuple[int, int]]:
        """(row, position) of each query token: token i of a row of q_len sits at
        context_len - q_len + i."""
        starts, ctx_lens = self.query_start.tolist(), self.context_lens.tolist()
        return [
            (row, ctx - (starts[row + 1] - starts[row]) + i)
            for row, ctx in enumerate(ctx_lens)
            for i in range(starts[row + 1] - starts[row])
        ]

    def positions(self) -> torch.Tensor:
        """The query tokens' positions, [num_tokens] int64."""
        positions = [position for _, position in self.token_positions()]
        return torch.tensor(positions, dtype=torch.int64, device=self.query.device)

    def slot_mapping(self) -> torch.Tensor:
        """[num_tokens] int64: the cache slot of each query token's position."""
        block_size, tables = self.key_cache.shape[1], self.block_tables.tolist()
        slots = [
            tables[row][position // block_size] * block_size + position % block_size
            for row, position in self.token_positions()
        ]
        return torch.tensor(slots, dtype=torch.int64, device=self.query.device)

    def metadata(self, **changes) -> AttentionMetadata:
        """The batch's attention metadata, with ``changes`` to its fields."""
        fields = {
            "slot_mapping": self.slot_mapping(),
            "query_start": self.query_start,
            "context_lens": self.context_lens,
            "block_tables": self.block_tables,
            "max_query_len": self.max_query_len,
            "max_context_len": self.max_context_len,
        }
        return AttentionMetadata(**{**fields, **changes})

    def kv_cache(self) -> torch.Tensor:
        """A one-layer ``[1, 2, num_blocks, block_size, num_kv_heads, head_dim]`` copy of the
        caches."""
        return torch.stack((self.key_cache, self.value_cache))[None].contiguous()

    @property
    def max_position(self) -> int:
        return max(self.max_context_len, 1)


def step_inputs(batch: RaggedBatch) -> tuple[torch.Tensor, AttentionMetadata, torch.Tensor]:
    """(positions, metadata, one-layer kv_cache): what a backend's ``plan`` takes."""
    return batch.positions(), batch.metadata(), batch.kv_cache()


def run_attention(
    backend,
    batch: RaggedBatch,
    *,
    query: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    **kwargs,
) -> torch.Tensor:
    """``backend``'s plan, then its paged attention of ``query`` (default: the batch's) over the
    batch's caches."""
    positions, metadata, kv_cache = step_inputs(batch)
    plan = backend.plan(positions, metadata, kv_cache, batch.max_position)
    key_cache, value_cache = kv_cache[0]
    query = batch.query if query is None else query
    return backend.paged_attention(query, key_cache, value_cache, plan, batch.scale, out, **kwargs)


def make_ragged_batch(
    rows: list[tuple[int, int]],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int,
    shuffle_blocks: bool = True,
    device: str = "cpu",
) -> RaggedBatch:
    """``rows``: (num_cached_tokens, num_query_tokens) per row. Cache slots that belong to no
    row's context are filled with NaN, so a kernel that reads them fails the comparison."""
    generator = torch.Generator().manual_seed(seed)
    query_lens = [q_len for _, q_len in rows]
    context_lens = [cached + q_len for cached, q_len in rows]
    blocks_per_row = [math.ceil(ctx / block_size) for ctx in context_lens]
    num_used = sum(blocks_per_row)
    num_blocks = num_used + 3
    order = torch.randperm(num_blocks, generator=generator) if shuffle_blocks else None
    physical = order.tolist() if order is not None else list(range(num_blocks))
    max_blocks = max(blocks_per_row, default=0) + 1
    block_tables = torch.zeros(len(rows), max_blocks, dtype=torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.full(shape, float("nan"), dtype=torch.float32)
    value_cache = torch.full(shape, float("nan"), dtype=torch.float32)
    next_block = 0
    for row, (ctx, num_row_blocks) in enumerate(zip(context_lens, blocks_per_row, strict=True)):
        ids = physical[next_block : next_block + num_row_blocks]
        next_block += num_row_blocks
        block_tables[row, :num_row_blocks] = torch.tensor(ids, dtype=torch.int32)
        for pos in range(ctx):
            block, offset = ids[pos // block_size], pos % block_size
            key_cache[block, offset] = torch.randn(num_kv_heads, head_dim, generator=generator)
            value_cache[block, offset] = torch.randn(num_kv_heads, head_dim, generator=generator)
    num_tokens = sum(query_lens)
    query = torch.randn(num_tokens, num_heads, head_dim, generator=generator)
    query_start = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    return RaggedBatch(
        query=query.to(device=device, dtype=dtype),
        key_cache=key_cache.to(device=device, dtype=dtype),
        value_cache=value_cache.to(device=device, dtype=dtype),
        query_start=query_start.to(device),
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
        block_tables=block_tables.to(device),
        max_query_len=max(query_lens, default=0),
        max_context_len=max(context_lens, default=0),
        scale=head_dim**-0.5,
    )


def reference_attention(batch: RaggedBatch) -> torch.Tensor:
    """Per row, per query token, per head: dense softmax in float64."""
    query = batch.query.double().cpu()
    key_cache, value_cache = batch.key_cache.double().cpu(), batch.value_cache.double().cpu()
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = query.shape[1] // num_kv_heads
    out = torch.zeros_like(query)
    starts = batch.query_start.tolist()
    for row, ctx in enumerate(batch.context_lens.tolist()):
        table = batch.block_tables[row].tolist()
        keys = torch.stack([key_cache[table[p // block_size], p % block_size] for p in range(ctx)])
        values = torch.stack(
            [value_cache[table[p // block_size], p % block_size] for p in range(ctx)]
        )
        q_len = starts[row + 1] - starts[row]
        for i in range(q_len):
            token, position = starts[row] + i, ctx - q_len + i
            for head in range(query.shape[1]):
                kv_head = head // group
                scores = keys[: position + 1, kv_head] @ query[token, head] * batch.scale
                out[token, head] = torch.softmax(scores, 0) @ values[: position + 1, kv_head]
    return out


def reference_store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    block_size = key_cache.shape[1]
    for token, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            key_cache[slot // block_size, slot % block_size] = key[token]
            value_cache[slot // block_size, slot % block_size] = value[token]


def reference_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
):
    summed = x if residual is None else x + residual
    hidden = summed.double()
    normed = hidden / torch.sqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    result = (normed * weight.double()).to(x.dtype)
    return result if residual is None else (result, summed)


def reference_rotary(
    positions: torch.Tensor, x: torch.Tensor, base: float, head_dim: int
) -> torch.Tensor:
    """x [num_tokens, heads, head_dim] rotated by rotate_half, angles in float64."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = positions.double()[:, None] * inv_freq[None, :]  # [num_tokens, head_dim // 2]
    cos = torch.cat((angles.cos(), angles.cos()), -1)[:, None, :]
    sin = torch.cat((angles.sin(), angles.sin()), -1)[:, None, :]
    x = x.double()
    half = head_dim // 2
    rotated_half = torch.cat((-x[..., half:], x[..., :half]), -1)
    return x * cos + rotated_half * sin
