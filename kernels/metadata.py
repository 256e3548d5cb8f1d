"""The attention metadata of one ragged step, as the engine's input builder makes it."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    """Where each token's K/V goes and what each row attends to (``engine/input_builder.py``
    draws a worked example)."""

    slot_mapping: torch.Tensor  # [num_tokens] int64, -1: not stored
    query_start: torch.Tensor  # [num_rows + 1] int32
    context_lens: torch.Tensor  # [num_rows] int32
    block_tables: torch.Tensor  # [num_rows, max_blocks] int32
    max_query_len: int
    max_context_len: int
