"""One pure function: a ``ScheduledBatch`` -> the flat tensors of one ragged forward pass.

Worked example, block_size 4, three rows (a decode, a middle prompt chunk, a whole prompt):

    row  token_ids     start_pos  block_table  sample
    a    [50]          5          [3, 8]       yes     positions [5]        slots [8*4+1]
    b    [60, 61, 62]  2          [6, 1]       no      positions [2, 3, 4]  slots [26, 27, 4]
    c    [70, 71]      0          [2]          yes     positions [0, 1]     slots [8, 9]

    input_ids    [50, 60, 61, 62, 70, 71]
    positions    [5, 2, 3, 4, 0, 1]
    slot_mapping [33, 26, 27, 4, 8, 9]
    query_start  [0, 1, 4, 6]
    context_lens [6, 5, 2]
    block_tables [[3, 8], [6, 1], [2, 0]]     (padded with 0, never read past context_lens)
    sample_rows  [0, 5]                       (the last token of each sampling row)

With ``prompt_tiles`` (a CPU that multiplies prompt tokens on AMX tiles: ``ModelRunner``) the
tokens of each row before its ``prompt_end`` are prompt tokens and the others generated ones,
and every generated token comes before every prompt token: a row of both kinds (a preempted
request computing its prompt and its output again) becomes two rows of the step, its generated
part among the rows before ``tile_from`` and its prompt part after it, each attending to the
positions up to its own tokens (the K/V of the whole step are stored before any row attends).
The sampling rows stay in the batch's row order. Where the batch is already in that order
(decodes first, then prompt chunks, as the scheduler makes it) nothing moves.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from kernels.metadata import AttentionMetadata
from scheduler.batch import ScheduledBatch


@dataclass(frozen=True)
class ModelInput:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    metadata: AttentionMetadata
    sample_rows: torch.Tensor  # [num_sampled] int64: token index of each sampling row's last token
    # the first token of the step's prompt tokens, all after it prompt tokens too, which a CPU
    # with AMX multiplies on tiles (``kernels.cpu_ops.int4_tile_rows``); None: none of them
    tile_from: int | None = None

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    def to(self, device: torch.device | str) -> ModelInput:
        """The same inputs on ``device``; the copies are asynchronous where these are pinned."""

        def move(tensor: torch.Tensor) -> torch.Tensor:
            return tensor.to(device, non_blocking=True)

        metadata = self.metadata
        return ModelInput(
            input_ids=move(self.input_ids),
            positions=move(self.positions),
            metadata=dataclasses.replace(
                metadata,
                slot_mapping=move(metadata.slot_mapping),
                query_start=move(metadata.query_start),
                context_lens=move(metadata.context_lens),
                block_tables=move(metadata.block_tables),
            ),
            sample_rows=move(self.sample_rows),
            tile_from=self.tile_from,
        )


def build_model_input(
    batch: ScheduledBatch,
    block_size: int,
    device: torch.device | str = "cpu",
    prompt_tiles: bool = False,
) -> ModelInput:
    """Flattens ``batch`` into tensors on ``device``; ``prompt_tiles``: generated tokens first,
    then prompt tokens from ``tile_from`` on (module docstring). Raises ValueError for an empty
    batch or a row whose block table does not cover its tokens."""
    if batch.is_empty:
        raise ValueError("cannot build inputs for an empty batch")
    # (row index, first token, end token) of each row of the step, in the step's order
    generated: list[tuple[int, int, int]] = []
    prompt: list[tuple[int, int, int]] = []
    for index, row in enumerate(batch.rows):
        start, end = row.start_pos, row.context_len
        num_blocks = -(-end // block_size)
        if not row.token_ids or num_blocks > len(row.block_table):
            raise ValueError(
                f"row {row.request_id!r}: {row.num_tokens} tokens from position {start} need "
                f"{num_blocks} blocks, its block table has {len(row.block_table)}"
            )
        split = min(max(row.prompt_end - start, 0), row.num_tokens) if prompt_tiles else 0
        if split:
            prompt.append((index, 0, split))
        if split < row.num_tokens:
            generated.append((index, split, row.num_tokens))
    input_ids: list[int] = []
    positions: list[int] = []
    slot_mapping: list[int] = []
    query_start = [0]
    context_lens: list[int] = []
    row_tables: list[tuple[int, ...]] = []
    last_token = [-1] * batch.num_rows  # each row's last token in the step
    for index, first, stop in generated + prompt:
        row = batch.rows[index]
        start, end = row.start_pos + first, row.start_pos + stop
        table = row.block_table[: -(-end // block_size)]
        input_ids.extend(row.token_ids[first:stop])
        positions.extend(range(start, end))
        slot_mapping.extend(
            table[pos // block_size] * block_size + pos % block_size for pos in range(start, end)
        )
        query_start.append(len(input_ids))
        context_lens.append(end)
        row_tables.append(table)
        if stop == row.num_tokens:
            last_token[index] = len(input_ids) - 1
    sample_rows = [last_token[i] for i, row in enumerate(batch.rows) if row.sample]
    tile_from = query_start[len(generated)] if prompt else None
    max_blocks = max(len(table) for table in row_tables)
    padded_tables = [list(table) + [0] * (max_blocks - len(table)) for table in row_tables]
    max_query_len = max(b - a for a, b in zip(query_start[:-1], query_start[1:], strict=True))

    def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    return ModelInput(
        input_ids=tensor(input_ids, torch.int64),
        positions=tensor(positions, torch.int64),
        metadata=AttentionMetadata(
            slot_mapping=tensor(slot_mapping, torch.int64),
            query_start=tensor(query_start, torch.int32),
            context_lens=tensor(context_lens, torch.int32),
            block_tables=tensor(padded_tables, torch.int32),
            max_query_len=max_query_len,
            max_context_len=max(context_lens),
        ),
        sample_rows=tensor(sample_rows, torch.int64),
        tile_from=tile_from,
    )


@dataclass(frozen=True)
class DecodeSteps:
    """The inputs of a batch of several decode steps (``ScheduledBatch.num_steps``): each row's
    token at the first step, and per step its position, slot and context length. Worked example,
    block_size 4, two steps, rows a (token 50 at position 6, blocks [3, 8]) and b (token 60 at
    position 1, blocks [2]):

        input_ids    [50, 60]
        positions    [[6, 1], [7, 2]]
        slot_mapping [[34, 9], [35, 10]]
        context_lens [[7, 2], [8, 3]]
        query_start  [0, 1, 2]
        block_tables [[3, 8], [2, 0]]
    """

    input_ids: torch.Tensor  # [num_rows] int64
    positions: torch.Tensor  # [num_steps, num_rows] int64
    slot_mapping: torch.Tensor  # [num_steps, num_rows] int64
    context_lens: torch.Tensor  # [num_steps, num_rows] int32
    query_start: torch.Tensor  # [num_rows + 1] int32: a token a row
    block_tables: torch.Tensor  # [num_rows, max_blocks] int32, covering every step

    @property
    def num_steps(self) -> int:
        return self.positions.shape[0]


def build_decode_steps(
    batch: ScheduledBatch, block_size: int, device: torch.device | str = "cpu"
) -> DecodeSteps:
    """The inputs of ``batch``'s ``num_steps`` decode steps on ``device``. Raises ValueError for
    an empty batch, a row that is not one sampled token, or a block table that does not cover
    the last step."""
    num_steps = batch.num_steps
    if batch.is_empty:
        raise ValueError("cannot build inputs for an empty batch")
    input_ids: list[int] = []
    starts: list[int] = []
    row_tables: list[tuple[int, ...]] = []
    for row in batch.rows:
        num_blocks = -(-(row.start_pos + num_steps) // block_size)
        if row.num_tokens != 1 or not row.sample:
            raise ValueError(f"row {row.request_id!r} is not one decode token")
        if num_blocks > len(row.block_table):
            raise ValueError(
                f"row {row.request_id!r}: {num_steps} steps from position {row.start_pos} need "
                f"{num_blocks} blocks, its block table has {len(row.block_table)}"
            )
        input_ids.append(row.token_ids[0])
        starts.append(row.start_pos)
        row_tables.append(row.block_table[:num_blocks])
    positions = [[start + step for start in starts] for step in range(num_steps)]
    slot_mapping = [
        [
            table[p // block_size] * block_size + p % block_size
            for table, p in zip(row_tables, step_positions, strict=True)
        ]
        for step_positions in positions
    ]
    max_blocks = max(len(table) for table in row_tables)

    def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    return DecodeSteps(
        input_ids=tensor(input_ids, torch.int64),
        positions=tensor(positions, torch.int64),
        slot_mapping=tensor(slot_mapping, torch.int64),
        context_lens=tensor([[p + 1 for p in ps] for ps in positions], torch.int32),
        query_start=tensor(list(range(len(starts) + 1)), torch.int32),
        block_tables=tensor(
            [list(table) + [0] * (max_blocks - len(table)) for table in row_tables], torch.int32
        ),
    )


def pad_to_two_tokens(inputs: ModelInput) -> ModelInput:
    """A one-token step as two rows: the token, then a copy that stores no K/V (slot -1) and is
    never sampled; the copy reads the same context and its output is dropped. Deterministic mode
    runs every step through the compiled graph of two tokens and up (``engine/model_runner.py``).
    """
    if inputs.num_tokens != 1:
        raise ValueError(f"pad_to_two_tokens takes a one-token step, not {inputs.num_tokens}")
    metadata = inputs.metadata
    return ModelInput(
        input_ids=inputs.input_ids.repeat(2),
        positions=inputs.positions.repeat(2),
        metadata=AttentionMetadata(
            slot_mapping=torch.cat(
                (metadata.slot_mapping, metadata.slot_mapping.new_full((1,), -1))
            ),
            query_start=torch.cat((metadata.query_start, metadata.query_start[1:] + 1)),
            context_lens=metadata.context_lens.repeat(2),
            block_tables=metadata.block_tables.repeat(2, 1),
            max_query_len=1,
            max_context_len=metadata.max_context_len,
        ),
        sample_rows=inputs.sample_rows,
    )
