"""The per-step message from rank 0 to the other tensor-parallel ranks: the flat model inputs.

Rank 0 builds the ``ModelInput`` of each step (``engine/input_builder.py``) and sends it as two
broadcasts of int64 CPU tensors on the control group: a header, then one payload holding every
input back to back. The other ranks never see a request or the scheduler.

    header  [COMMAND, num_tokens, num_rows, max_blocks, num_sampled, max_query_len, max_context_len,
             tile_from (-1: None)]
    payload input_ids [num_tokens] ++ positions [num_tokens] ++ slot_mapping [num_tokens]
            ++ query_start [num_rows + 1] ++ context_lens [num_rows]
            ++ block_tables [num_rows * max_blocks] ++ sample_rows [num_sampled]

A 3-row step of 6 tokens with 2-block tables and 2 sampling rows sends 8 + 33 integers.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Any

import torch
import torch.distributed as dist

from engine.input_builder import ModelInput
from kernels import AttentionMetadata

HEADER_SIZE = 8


class Command(IntEnum):
    STOP = 0  # the engine is shutting down: leave the loop
    STEP = 1  # a payload follows; run one forward pass


def _header(command: Command, inputs: ModelInput | None = None) -> torch.Tensor:
    header = torch.zeros(HEADER_SIZE, dtype=torch.int64)
    header[0] = int(command)
    if inputs is not None:
        meta = inputs.metadata
        num_rows, max_blocks = meta.block_tables.shape
        header[1:] = torch.tensor(
            [
                inputs.num_tokens,
                num_rows,
                max_blocks,
                inputs.sample_rows.shape[0],
                meta.max_query_len,
                meta.max_context_len,
                -1 if inputs.tile_from is None else inputs.tile_from,
            ]
        )
    return header


def pack_model_input(inputs: ModelInput) -> tuple[torch.Tensor, torch.Tensor]:
    """``(header, payload)`` int64 CPU tensors for ``inputs`` (see the module docstring)."""
    meta = inputs.metadata
    parts = [
        inputs.input_ids,
        inputs.positions,
        meta.slot_mapping,
        meta.query_start,
        meta.context_lens,
        meta.block_tables.reshape(-1),
        inputs.sample_rows,
    ]
    payload = torch.cat([part.to("cpu", torch.int64) for part in parts])
    return _header(Command.STEP, inputs), payload


def unpack_model_input(
    header: torch.Tensor, payload: torch.Tensor, device: torch.device | str = "cpu"
) -> ModelInput:
    """The ``ModelInput`` that ``pack_model_input`` packed, on ``device``."""
    _, num_tokens, num_rows, max_blocks, num_sampled, max_query_len, max_context_len, tile_from = (
        header.tolist()
    )
    sizes = [num_tokens, num_tokens, num_tokens, num_rows + 1, num_rows, num_rows * max_blocks]
    sizes.append(num_sampled)
    if payload.numel() != sum(sizes):
        raise RuntimeError(f"step payload of {payload.numel()} values, expected {sum(sizes)}")
    payload = payload.to(device)
    input_ids, positions, slots, query_start, context_lens, tables, sample_rows = payload.split(
        sizes
    )
    return ModelInput(
        input_ids=input_ids,
        positions=positions,
        metadata=AttentionMetadata(
            slot_mapping=slots,
            query_start=query_start.to(torch.int32),
            context_lens=context_lens.to(torch.int32),
            block_tables=tables.to(torch.int32).view(num_rows, max_blocks),
            max_query_len=max_query_len,
            max_context_len=max_context_len,
        ),
        sample_rows=sample_rows,
        tile_from=None if tile_from < 0 else tile_from,
    )


def send_step(inputs: ModelInput, group: Any) -> None:
    """Rank 0: sends this step's inputs to every other rank of ``group``."""
    header, payload = pack_model_input(inputs)
    dist.broadcast(header, src=0, group=group)
    dist.broadcast(payload, src=0, group=group)


def send_stop(group: Any) -> None:
    """Rank 0: tells the other ranks to leave their loop."""
    dist.broadcast(_header(Command.STOP), src=0, group=group)


def receive_step(group: Any, device: torch.device | str = "cpu") -> ModelInput | None:
    """Ranks other than 0: waits for rank 0's next message; None means stop."""
    header = torch.empty(HEADER_SIZE, dtype=torch.int64)
    dist.broadcast(header, src=0, group=group)
    command = Command(int(header[0]))
    if command == Command.STOP:
        return None
    payload_size = int(header[1]) * 3 + int(header[2]) * (2 + int(header[3])) + 1 + int(header[4])
    payload = torch.empty(payload_size, dtype=torch.int64)
    dist.broadcast(payload, src=0, group=group)
    return unpack_model_input(header, payload, device)
