"""Paged ragged attention in PyTorch: the CPU serving path and the Triton kernel's reference.

On CPUs where the C++ operators build (``kernels/cpu_ops.py``), decode rows (one query token)
attend through ``splitfuse_cpu::fixed_order_attention``, which reads each context in place
(``KernelTokens``), and in deterministic mode every token does. Otherwise decode rows are computed
together: their contexts are gathered through the block tables into one padded batch, grouped by
length when padding to the longest would waste much, and attended with one
``scaled_dot_product_attention`` call per group under a length mask. Prompt
chunks (several query tokens) are computed together too, in power-of-two context-length groups:
queries padded to the group's longest chunk, under a mask that is causal relative to each row's
cached prefix. A layer's attention is therefore a bounded number of calls, whatever the number of
requests in the step.

Everything that depends on the batch alone (the rows' kinds, the cache slot of every context
position, the masks, the length groups, the checks of the metadata's values) is worked out once
per step by ``plan_paged_attention``; ``paged_attention`` then costs each layer a few operators
per group.

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

from kernels.checks import KernelInputError
from kernels.cpu_ops import attends_whole, prompt_kernel

__all__ = ["AttentionPlan", "paged_attention", "plan_paged_attention"]

# Split decode rows into length groups only when that avoids gathering this many padding positions.
MIN_SAVED_POSITIONS = 2048
# Prompt groups of at least twice this many query slots attend in query chunks of this many, each
# over the context its last query sees: causal attention skips the keys past the chunk, which
# torch's CPU flash kernel does not (512 x 512, 9 heads, bfloat16 on 2 cores: 3.8 -> 2.8 ms). Not
# whole prompts with nothing cached where that kernel multiplies on AMX tiles (``attends_whole``):
# one causal call there, as ``store_and_attend_step`` makes.
QUERY_CHUNK = 64
# Deterministic mode: context positions per value product (see ``_fixed_order_attention``); a
# deterministic plan pads every group's context to a multiple of it
DETERMINISTIC_TILE = 64


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
class PromptGroup:
    """Prompt chunks attended in one call: queries padded to the group's longest chunk, contexts
    to its longest context, and a mask that is causal relative to each row's cached prefix.

    Two rows, (cached 2, query 2) and (cached 0, query 3): padded_q 3, padded_len 4
        query_rows [[t0, t1, t1], [t2, t3, t4]]   (padding repeats a row's last token)
        mask row 0: [[1,1,1,0], [1,1,1,1], [1,1,1,1]]   (position 2 + i sees 0 .. 2 + i)
        mask row 1: [[1,0,0,0], [1,1,0,0], [1,1,1,0]]
    """

    query_rows: torch.Tensor  # [num_rows * padded_q] int64 token index of each query slot
    kv_rows: torch.Tensor  # [num_rows * num_kv_heads * padded_len] int64 (slot, head) rows
    mask: torch.Tensor | None  # [num_rows, 1, padded_q, padded_len] bool; None: plain causal
    valid: torch.Tensor | slice  # [num_group_tokens] index of each real query slot
    tokens: torch.Tensor | slice  # [num_group_tokens] its token index in the query
    num_rows: int
    padded_q: int
    padded_len: int
    # (first query slot, end, context length it reads, mask [num_rows, 1, end - first, length])
    # per query chunk; () when the group attends in one call
    query_chunks: tuple[tuple[int, int, int, torch.Tensor], ...] = ()
    # (first token, query tokens, slots int64 [context_len]) per row, where the plan may hand
    # its rows to the C++ operator (``cpu_kernel``): bfloat16 queries there attend through our
    # own kernel row by row (``prompt_kernel``), as ``store_and_attend_step`` does; () elsewhere
    rows: tuple[tuple[int, int, torch.Tensor], ...] = ()


@dataclass(frozen=True)
class KernelTokens:
    """Query tokens attended by the C++ operator ``splitfuse_cpu::fixed_order_attention``: the
    i-th of them attends to positions 0 .. lens[i] - 1 of row rows[i] of the block tables, in
    place. Every token in deterministic mode; the decode tokens otherwise (the operator reads a
    context in place, where the grouped path gathers it for SDPA: 1.3-8x faster for decodes,
    ``kernels/cpu/fixed_order_attention.cpp``)."""

    tokens: torch.Tensor | slice  # [num_kernel_tokens] their token index in the query
    block_tables: torch.Tensor  # [num_rows, max_blocks_per_row] int32, contiguous
    rows: torch.Tensor  # [num_kernel_tokens] int32
    lens: torch.Tensor  # [num_kernel_tokens] int32


@dataclass(frozen=True)
class AttentionPlan:
    """What a step's attention reads, checked and indexed once for every layer."""

    num_tokens: int
    block_size: int
    num_kv_heads: int
    decode_groups: tuple[DecodeGroup, ...]
    prompt_groups: tuple[PromptGroup, ...]
    # attend in a fixed order whatever the batch (``_fixed_order_attention``); the groups then
    # always hold their masks and no query chunks
    deterministic: bool = False
    # tokens the C++ operator attends (then no decode groups; in deterministic mode, no groups)
    kernel_tokens: KernelTokens | None = None

    @property
    def sole_decode_group(self) -> DecodeGroup | None:
        """The decode group when it is the step's every token, in order (a step of decodes
        alone): its attention is then the whole output, with no copy into it."""
        if len(self.decode_groups) != 1 or self.prompt_groups:
            return None
        group = self.decode_groups[0]
        return group if group.tokens == slice(0, self.num_tokens) else None


def plan_paged_attention(
    query_start: torch.Tensor,  # [num_rows + 1] int32
    context_lens: torch.Tensor,  # [num_rows] int32
    block_tables: torch.Tensor,  # [num_rows, max_blocks_per_row] int32
    *,
    block_size: int,
    num_kv_heads: int,
    num_tokens: int,
    deterministic: bool = False,
    cpu_kernel: bool = False,
) -> AttentionPlan:
    """Checks the metadata's values and computes every layer's gather indices and masks
    (``deterministic``: for ``_fixed_order_attention``). With ``cpu_kernel`` (CPU tensors, the
    C++ operators built), the C++ operator attends the decode tokens, or every token in
    deterministic mode (``KernelTokens``).

    Raises KernelInputError when query_start does not run from 0 to ``num_tokens`` by
    non-decreasing steps, or a row's context_len is outside [its query tokens, the capacity of
    its block table]. Reads the metadata once (one device sync per step, none per layer).
    """
    num_rows = context_lens.shape[0]
    capacity = block_tables.shape[1] * block_size
    if num_rows == 0:
        return AttentionPlan(num_tokens, block_size, num_kv_heads, (), (), deterministic)
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
    if deterministic and cpu_kernel:
        every = _kernel_tokens(query_start, context_lens, block_tables, num_tokens)
        return AttentionPlan(num_tokens, block_size, num_kv_heads, (), (), deterministic, every)
    kernel_tokens = None
    if cpu_kernel and decode_rows:
        kernel_tokens = _decode_kernel_tokens(decode_rows, starts, ctx_lens, block_tables)
        decode_rows = []
    if not decode_rows and not prompt_rows:  # the C++ operator attends every token
        return AttentionPlan(
            num_tokens, block_size, num_kv_heads, (), (), deterministic, kernel_tokens
        )
    tables = block_tables.long()  # [num_rows, max_blocks_per_row]
    heads = torch.arange(num_kv_heads, device=tables.device)[:, None]  # [num_kv_heads, 1]
    groups = tuple(
        _plan_decode_group(
            rows, [starts[row] for row in rows], ctx_lens, tables, block_size, heads, deterministic
        )
        for rows in _decode_groups(decode_rows, ctx_lens, block_size)
    )
    prompts = tuple(
        _plan_prompt_group(
            rows, starts, ctx_lens, tables, block_size, heads, deterministic, cpu_kernel
        )
        for rows in _prompt_groups(prompt_rows, ctx_lens, block_size)
    )
    return AttentionPlan(
        num_tokens, block_size, num_kv_heads, groups, prompts, deterministic, kernel_tokens
    )


def _kernel_tokens(
    query_start: torch.Tensor,  # [num_rows + 1] int32, checked
    context_lens: torch.Tensor,  # [num_rows] int32, checked
    block_tables: torch.Tensor,  # [num_rows, max_blocks_per_row] int32
    num_tokens: int,
) -> KernelTokens:
    """Each token's row, and how many positions it sees: the token at index t of a row ending at
    token index ``end`` sits at position context_len - (end - t)."""
    q_lens = query_start[1:] - query_start[:-1]
    rows = torch.repeat_interleave(
        torch.arange(q_lens.shape[0]), q_lens.long(), output_size=num_tokens
    )
    ends = query_start[1:].long()[rows]
    lens = context_lens.long()[rows] - ends + torch.arange(num_tokens) + 1
    tables = block_tables.int().contiguous()
    return KernelTokens(slice(0, num_tokens), tables, rows.int(), lens.int())


def _decode_kernel_tokens(
    decode_rows: list[int], starts: list[int], ctx_lens: list[int], block_tables: torch.Tensor
) -> KernelTokens:
    """The decode rows' tokens (a decode's token sees its whole context)."""
    tokens = [starts[row] for row in decode_rows]
    index: torch.Tensor | slice = torch.tensor(tokens)
    if tokens == list(range(tokens[0], tokens[0] + len(tokens))):  # consecutive: a view
        index = slice(tokens[0], tokens[0] + len(tokens))
    return KernelTokens(
        index,
        block_tables.int().contiguous(),
        torch.tensor(decode_rows, dtype=torch.int32),
        torch.tensor([ctx_lens[row] for row in decode_rows], dtype=torch.int32),
    )


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


def _prompt_groups(prompt_rows: list[int], ctx_lens: list[int], block_size: int) -> list[list[int]]:
    """Prompt rows in power-of-two context-length groups: a bounded number of calls per layer
    whatever the number of chunks, each padded to at most twice its shortest context."""
    num_blocks = [-(-ctx_lens[row] // block_size) for row in prompt_rows]
    return [[prompt_rows[i] for i in group] for group in length_groups(num_blocks)]


def _plan_decode_group(
    rows: list[int],
    tokens: list[int],
    ctx_lens: list[int],
    tables: torch.Tensor,  # [num_rows, max_blocks_per_row] int64
    block_size: int,
    heads: torch.Tensor,  # [num_kv_heads, 1] int64
    deterministic: bool,
) -> DecodeGroup:
    device = tables.device
    lengths = torch.tensor([ctx_lens[row] for row in rows], device=device)  # [num_group_rows]
    padded_len = max(ctx_lens[row] for row in rows)
    if deterministic:
        padded_len = -(-padded_len // DETERMINISTIC_TILE) * DETERMINISTIC_TILE
    positions = torch.arange(padded_len, device=device)  # [padded_len]
    inside = positions < lengths[:, None]  # [num_group_rows, padded_len]
    # Padding positions read the row's position 0: written, finite, masked out.
    positions = positions * inside
    row_index = torch.tensor(rows, device=device)
    block_ids = tables[row_index].gather(1, positions // block_size)
    slots = block_ids * block_size + positions % block_size  # [num_group_rows, padded_len]
    kv_rows = (slots[:, None, :] * heads.shape[0] + heads).reshape(-1)
    mask = inside[:, None, None, :]
    if not deterministic and all(ctx_lens[row] == padded_len for row in rows):
        mask = None
    token_index: torch.Tensor | slice = torch.tensor(tokens, device=device)
    if tokens == list(range(tokens[0], tokens[0] + len(tokens))):  # consecutive: a view
        token_index = slice(tokens[0], tokens[0] + len(tokens))
    return DecodeGroup(token_index, kv_rows, mask, len(rows), padded_len)


def _plan_prompt_group(
    rows: list[int],
    starts: list[int],
    ctx_lens: list[int],
    tables: torch.Tensor,  # [num_rows, max_blocks_per_row] int64
    block_size: int,
    heads: torch.Tensor,  # [num_kv_heads, 1] int64
    deterministic: bool,
    cpu_kernel: bool = False,
) -> PromptGroup:
    device = tables.device
    q_lens = [starts[row + 1] - starts[row] for row in rows]
    lengths = [ctx_lens[row] for row in rows]
    padded_q, padded_len = max(q_lens), max(lengths)
    if deterministic:
        padded_len = -(-padded_len // DETERMINISTIC_TILE) * DETERMINISTIC_TILE
    first = torch.tensor([starts[row] for row in rows], device=device)[:, None]  # [n, 1]
    q_len = torch.tensor(q_lens, device=device)[:, None]  # [n, 1]
    ctx_len = torch.tensor(lengths, device=device)[:, None]  # [n, 1]
    query_pos = torch.arange(padded_q, device=device)  # [padded_q]
    query_rows = first + torch.minimum(query_pos, q_len - 1)  # [n, padded_q]
    positions = torch.arange(padded_len, device=device)  # [padded_len]
    inside = positions < ctx_len  # [n, padded_len]
    clamped = positions * inside  # padding reads the row's position 0: written, finite
    block_ids = tables[torch.tensor(rows, device=device)].gather(1, clamped // block_size)
    slots = block_ids * block_size + clamped % block_size  # [n, padded_len]
    kv_rows = (slots[:, None, :] * heads.shape[0] + heads).reshape(-1)
    # query slot i of a row sits at position ctx_len - q_len + i
    last_seen = (ctx_len - q_len)[:, :, None] + query_pos[None, :, None]  # [n, padded_q, 1]
    full_mask = ((positions[None, None, :] <= last_seen) & inside[:, None, :])[:, None]
    mask = None  # [n, 1, padded_q, padded_len]; None: plain causal (SDPA's is_causal)
    if (
        deterministic
        or any(q != padded_q or n != padded_len for q, n in zip(q_lens, lengths, strict=True))
        or padded_q != padded_len
    ):
        mask = full_mask
    query_chunks = []
    if padded_q >= 2 * QUERY_CHUNK:
        # the first position no query of the chunk sees: max over rows of ctx_len - q_len + end
        offset = max(n - q for q, n in zip(q_lens, lengths, strict=True))
        for first in range(0, padded_q, QUERY_CHUNK):
            end = min(first + QUERY_CHUNK, padded_q)
            length = min(offset + end, padded_len)
            if deterministic:  # whole tiles: the ones left out held only masked positions
                length = min(-(-length // DETERMINISTIC_TILE) * DETERMINISTIC_TILE, padded_len)
            query_chunks.append((first, end, length, full_mask[:, :, first:end, :length]))
    real = query_pos[None, :] < q_len  # [n, padded_q]
    tokens = [t for row in rows for t in range(starts[row], starts[row + 1])]
    valid: torch.Tensor | slice = real.reshape(-1).nonzero().squeeze(1)
    token_index: torch.Tensor | slice = torch.tensor(tokens, device=device)
    if len(rows) == 1 or all(q == padded_q for q in q_lens):
        valid = slice(0, len(tokens))
    if tokens == list(range(tokens[0], tokens[0] + len(tokens))):
        token_index = slice(tokens[0], tokens[0] + len(tokens))
    row_spans = ()
    if cpu_kernel and not deterministic and tables.device.type == "cpu":
        row_spans = tuple(
            (starts[row], q, slots[i, :n].contiguous())
            for i, (row, q, n) in enumerate(zip(rows, q_lens, lengths, strict=True))
        )
    return PromptGroup(
        query_rows.reshape(-1),
        kv_rows,
        mask,
        valid,
        token_index,
        len(rows),
        padded_q,
        padded_len,
        tuple(query_chunks),
        row_spans,
    )


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    plan: AttentionPlan,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of a ragged batch (prompt chunks and decodes) over the paged KV cache.

    Row r owns query tokens ``query_start[r] .. query_start[r + 1] - 1``; its i-th of q_len tokens
    sits at position ``context_lens[r] - q_len + i`` and attends to positions 0 .. that position,
    whose K/V are already in the cache. The metadata's work is ``plan_paged_attention``'s; this
    checks that the query and the caches agree with the plan (the backend's ``plan`` checked
    their dtypes and layouts)."""
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
    kernel = plan.kernel_tokens
    if kernel is not None:
        attended = torch.ops.splitfuse_cpu.fixed_order_attention(
            query[kernel.tokens],
            key_cache,
            value_cache,
            kernel.block_tables,
            kernel.rows,
            kernel.lens,
            scale,
        )
        if out is None and kernel.tokens == slice(0, plan.num_tokens):  # every token
            return attended
        if out is None:
            out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        out[kernel.tokens] = attended
    # [num_slots * num_kv_heads, head_dim] views of the caches: one row per (slot, head)
    key_rows, value_rows = key_cache.view(-1, head_dim), value_cache.view(-1, head_dim)
    if out is None and plan.sole_decode_group is not None:  # every token decodes, in one call
        group = plan.sole_decode_group
        return _decode_attention(query, key_rows, value_rows, group, scale, plan.deterministic)
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    for group in plan.decode_groups:
        _attend_decode_group(query, key_rows, value_rows, group, scale, out, plan.deterministic)
    for prompts in plan.prompt_groups:
        if plan.deterministic:
            _attend_prompt_group_fixed_order(query, key_rows, value_rows, prompts, scale, out)
        else:
            _attend_prompt_group(
                query, key_rows, value_rows, prompts, scale, out, plan.num_kv_heads
            )
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
    deterministic: bool,
) -> None:
    """Decode rows at once, written into ``out``."""
    out[group.tokens] = _decode_attention(
        query[group.tokens], key_rows, value_rows, group, scale, deterministic
    )


def _decode_attention(
    query: torch.Tensor,  # [num_rows, num_heads, head_dim]: the group's query tokens
    key_rows: torch.Tensor,  # [num_slots * num_kv_heads, head_dim]
    value_rows: torch.Tensor,
    group: DecodeGroup,
    scale: float,
    deterministic: bool,
) -> torch.Tensor:
    """Gathers the rows' contexts padded to the longest, masks the padding: [num_rows,
    num_heads, head_dim]."""
    num_rows, padded_len = group.num_rows, group.padded_len
    num_heads, head_dim = query.shape[1], query.shape[2]
    shape = (num_rows, -1, padded_len, head_dim)  # [num_rows, num_kv_heads, padded_len, head_dim]
    keys = key_rows.index_select(0, group.kv_rows).view(shape).to(query.dtype)
    values = value_rows.index_select(0, group.kv_rows).view(shape).to(query.dtype)
    # [num_rows, num_kv_heads, heads per KV head, head_dim]
    queries = query.view(num_rows, keys.shape[1], -1, head_dim)
    if deterministic:
        assert group.mask is not None  # a deterministic plan always holds it
        attended = _fixed_order_attention(queries, keys, values, group.mask, scale)
        return attended.to(query.dtype).view(num_rows, num_heads, head_dim)
    attended = F.scaled_dot_product_attention(
        queries, keys, values, attn_mask=group.mask, scale=scale
    )  # [num_rows, num_kv_heads, heads per KV head, head_dim]
    # reshape: on CUDA, SDPA's output can come back in another memory order
    return attended.reshape(num_rows, num_heads, head_dim)


def _gather_prompt_group(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_rows: torch.Tensor,  # [num_slots * num_kv_heads, head_dim]
    value_rows: torch.Tensor,
    group: PromptGroup,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The group's queries ``[num_rows, num_heads, padded_q, head_dim]`` and its rows' keys and
    values ``[num_rows, num_kv_heads, padded_len, head_dim]``."""
    num_rows, num_heads, head_dim = group.num_rows, query.shape[1], query.shape[2]
    queries = query[group.query_rows].view(num_rows, group.padded_q, num_heads, head_dim)
    shape = (num_rows, -1, group.padded_len, head_dim)
    keys = key_rows.index_select(0, group.kv_rows).view(shape).to(query.dtype)
    values = value_rows.index_select(0, group.kv_rows).view(shape).to(query.dtype)
    return queries.transpose(1, 2), keys, values


def _attend_prompt_group(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_rows: torch.Tensor,  # [num_slots * num_kv_heads, head_dim]
    value_rows: torch.Tensor,
    group: PromptGroup,
    scale: float,
    out: torch.Tensor,
    num_kv_heads: int,
) -> None:
    """Prompt chunks at once: query i of a row (position ctx_len - q_len + i) sees positions
    0 .. its own."""
    num_rows, num_heads, head_dim = group.num_rows, query.shape[1], query.shape[2]
    if group.rows and query.dtype == torch.bfloat16 and prompt_kernel(head_dim):
        # each row through our own kernel (AMX tiles or AVX-512 BF16), reading the caches in
        # place
        keys_by_slot = key_rows.view(-1, num_kv_heads, head_dim)
        values_by_slot = value_rows.view(-1, num_kv_heads, head_dim)
        for first, q_len, slots in group.rows:
            out[first : first + q_len] = torch.ops.splitfuse_cpu.prompt_attention(
                query[first : first + q_len], keys_by_slot, values_by_slot, slots, scale
            )
        return
    queries, keys, values = _gather_prompt_group(query, key_rows, value_rows, group)
    gqa = num_heads != keys.shape[1]
    # whole prompts with nothing cached: in one causal call where the C++ operator makes one
    # (torch's flash kernel on AMX tiles, ``attends_whole``)
    if group.query_chunks and not (
        group.mask is None and query.device.type == "cpu" and attends_whole(query.dtype)
    ):
        attended = torch.cat(
            [
                F.scaled_dot_product_attention(
                    queries[:, :, first:end],
                    keys[:, :, :length],
                    values[:, :, :length],
                    attn_mask=mask,
                    scale=scale,
                    enable_gqa=gqa,
                )
                for first, end, length, mask in group.query_chunks
            ],
            dim=2,
        )  # [num_rows, num_heads, padded_q, head_dim]
    else:
        attended = F.scaled_dot_product_attention(
            queries,
            keys,
            values,
            attn_mask=group.mask,
            is_causal=group.mask is None,
            scale=scale,
            enable_gqa=gqa,
        )  # [num_rows, num_heads, padded_q, head_dim]
    flat = attended.transpose(1, 2).reshape(num_rows * group.padded_q, num_heads, head_dim)
    out[group.tokens] = flat[group.valid]


def _attend_prompt_group_fixed_order(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_rows: torch.Tensor,  # [num_slots * num_kv_heads, head_dim]
    value_rows: torch.Tensor,
    group: PromptGroup,
    scale: float,
    out: torch.Tensor,
) -> None:
    """``_attend_prompt_group`` through ``_fixed_order_attention``, by query chunks as there:
    a chunk's context stops at a whole tile, and the tiles it leaves out would have added exact
    zeros, so chunking changes no bit."""
    num_rows, num_heads, head_dim = group.num_rows, query.shape[1], query.shape[2]
    padded_q, padded_len = group.padded_q, group.padded_len
    queries, keys, values = _gather_prompt_group(query, key_rows, value_rows, group)
    num_kv_heads = keys.shape[1]
    group_heads = num_heads // num_kv_heads
    assert group.mask is not None  # a deterministic plan always holds it
    chunks = group.query_chunks or ((0, padded_q, padded_len, group.mask),)
    attended = []
    for first, end, length, mask in chunks:
        # head-major: [num_rows, num_kv_heads, heads per KV head * chunk, head_dim]
        chunk = queries[:, :, first:end].reshape(num_rows, num_kv_heads, -1, head_dim)
        chunk_mask = mask[:, :, None].expand(num_rows, 1, group_heads, end - first, length)
        chunk_mask = chunk_mask.reshape(num_rows, 1, -1, length)
        result = _fixed_order_attention(
            chunk, keys[:, :, :length], values[:, :, :length], chunk_mask, scale
        )
        attended.append(result.view(num_rows, num_heads, end - first, head_dim))
    # [num_rows, num_heads, padded_q, head_dim] -> [num_rows * padded_q, num_heads, head_dim]
    joined = torch.cat(attended, dim=2).transpose(1, 2)
    flat = joined.reshape(num_rows * padded_q, num_heads, head_dim).to(query.dtype)
    out[group.tokens] = flat[group.valid]


def _fixed_order_attention(
    queries: torch.Tensor,  # [num_rows, num_kv_heads, num_queries, head_dim]
    keys: torch.Tensor,  # [num_rows, num_kv_heads, context, head_dim]
    values: torch.Tensor,  # [num_rows, num_kv_heads, context, head_dim]
    mask: torch.Tensor,  # [num_rows, 1, num_queries or 1, context] bool: True where seen
    scale: float,
) -> torch.Tensor:
    """Attention whose result for a query is the same bits whatever else the call holds: how
    many queries, rows and padding positions, and where the query sits. ``context`` is a
    multiple of DETERMINISTIC_TILE (the plan pads to it). Float32 throughout; returns
    [num_rows, num_kv_heads, num_queries, head_dim] float32.

    - scores: one product over head_dim per (query, position), on a query count padded to a
      multiple of 4 (MKL rounds a row alike for every such count, ``tests/kernels/
      test_deterministic_kernels.py``);
    - softmax weights ``p = exp(score - max)``: exact per element, 0 where masked;
    - ``p @ V`` and the sum of ``p`` per tile of DETERMINISTIC_TILE positions, tiles starting at
      position 0: a position is always in the same tile at the same place, padding only adds
      tiles of zeros, and the tiles' results are added in position order (adding an exact zero
      changes nothing).
    """
    num_rows, num_kv_heads, num_queries, head_dim = queries.shape
    num_tiles = keys.shape[2] // DETERMINISTIC_TILE
    padded_queries = -(-num_queries // 4) * 4
    queries = F.pad(queries.float(), (0, 0, 0, padded_queries - num_queries))
    if mask.shape[2] != 1:  # the padding queries see every position (their results are dropped)
        mask = F.pad(mask, (0, 0, 0, padded_queries - num_queries), value=True)
    scores = torch.matmul(queries, keys.float().transpose(-1, -2)) * scale  # [.., queries, ctx]
    scores.masked_fill_(~mask, float("-inf"))
    weights = torch.exp(scores - scores.amax(-1, keepdim=True))
    # [rows, kv heads, queries, tiles, tile] -> per tile: weights @ values and sum of weights
    weights = weights.view(num_rows, num_kv_heads, padded_queries, num_tiles, DETERMINISTIC_TILE)
    sums = weights.sum(-1)  # [rows, kv heads, queries, tiles]
    values = values.float().view(num_rows, num_kv_heads, num_tiles, DETERMINISTIC_TILE, head_dim)
    tiles = torch.matmul(weights.transpose(2, 3), values)  # [rows, kv heads, tiles, queries, dim]
    weighted, total = tiles[:, :, 0], sums[..., 0]
    for tile in range(1, num_tiles):
        weighted = weighted + tiles[:, :, tile]
        total = total + sums[..., tile]
    return weighted[:, :, :num_queries] / total[:, :, :num_queries, None]
