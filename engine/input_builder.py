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
        )


def build_model_input(
    batch: ScheduledBatch, block_size: int, device: torch.device | str = "cpu"
) -> ModelInput:
    """Flattens ``batch`` into tensors on ``device``. Raises ValueError for an empty batch or a
    row whose block table does not cover its tokens."""
    if batch.is_empty:
        raise ValueError("cannot build inputs for an empty batch")
    input_ids: list[int] = []
    positions: list[int] = []
    slot_mapping: list[int] = []
    query_start = [0]
    context_lens: list[int] = []
    row_tables: list[tuple[int, ...]] = []
    sample_rows: list[int] = []
    for row in batch.rows:
        start, end = row.start_pos, row.context_len
        num_blocks = -(-end // block_size)
        if not row.token_ids or num_blocks > len(row.block_table):
            raise ValueError(
                f"row {row.request_id!r}: {row.num_tokens} tokens from position {start} need "
                f"{num_blocks} blocks, its block table has {len(row.block_table)}"
            )
        table = row.block_table[:num_blocks]
        input_ids.extend(row.token_ids)
        positions.extend(range(start, end))
        slot_mapping.extend(
            table[pos // block_size] * block_size + pos % block_size for pos in range(start, end)
        )
        query_start.append(len(input_ids))
        context_lens.append(end)
        row_tables.append(table)
        if row.sample:
            sample_rows.append(len(input_ids) - 1)
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
