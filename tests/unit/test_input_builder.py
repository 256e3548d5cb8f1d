"""The pure function that flattens a ScheduledBatch into the forward pass's tensors."""

from __future__ import annotations

import pytest
import torch

from engine.input_builder import ModelInput, build_decode_steps, build_model_input
from scheduler.batch import BatchRow, ScheduledBatch


def _lists(batch: ScheduledBatch, block_size: int) -> dict[str, list]:
    return _as_lists(build_model_input(batch, block_size))


def _as_lists(inputs: ModelInput) -> dict[str, list]:
    meta = inputs.metadata
    assert inputs.input_ids.dtype == torch.int64 and inputs.positions.dtype == torch.int64
    assert meta.slot_mapping.dtype == torch.int64 and inputs.sample_rows.dtype == torch.int64
    assert meta.query_start.dtype == torch.int32 and meta.context_lens.dtype == torch.int32
    assert meta.block_tables.dtype == torch.int32
    return {
        "input_ids": inputs.input_ids.tolist(),
        "positions": inputs.positions.tolist(),
        "slot_mapping": meta.slot_mapping.tolist(),
        "query_start": meta.query_start.tolist(),
        "context_lens": meta.context_lens.tolist(),
        "block_tables": meta.block_tables.tolist(),
        "sample_rows": inputs.sample_rows.tolist(),
        "max_query_len": meta.max_query_len,
        "max_context_len": meta.max_context_len,
    }


def test_docstring_example() -> None:
    batch = ScheduledBatch(
        rows=(
            BatchRow("a", (50,), 5, (3, 8), True),
            BatchRow("b", (60, 61, 62), 2, (6, 1), False),
            BatchRow("c", (70, 71), 0, (2,), True),
        )
    )
    assert _lists(batch, 4) == {
        "input_ids": [50, 60, 61, 62, 70, 71],
        "positions": [5, 2, 3, 4, 0, 1],
        "slot_mapping": [33, 26, 27, 4, 8, 9],
        "query_start": [0, 1, 4, 6],
        "context_lens": [6, 5, 2],
        "block_tables": [[3, 8], [6, 1], [2, 0]],
        "sample_rows": [0, 5],
        "max_query_len": 3,
        "max_context_len": 6,
    }


def test_decodes_and_first_middle_last_chunks_across_block_boundaries() -> None:
    # block_size 4. Two decodes (one on the first slot of a fresh block, one mid-block), then a
    # first prompt chunk (positions 0-5, crossing into its second block), a middle chunk
    # (positions 6-9, crossing from block 2 to block 3) and a last chunk (positions 10-12).
    batch = ScheduledBatch(
        rows=(
            BatchRow("d1", (11,), 8, (4, 5, 9), True),  # position 8: block 9, offset 0
            BatchRow("d2", (12,), 6, (7, 0), True),  # position 6: block 0, offset 2
            BatchRow("first", (1, 2, 3, 4, 5, 6), 0, (10, 2, 13, 14), False),
            BatchRow("middle", (7, 8, 9, 10), 6, (15, 16, 17, 18), False),
            BatchRow("last", (20, 21, 22), 10, (19, 20, 21, 22), True),
        )
    )
    got = _lists(batch, 4)
    assert got["input_ids"] == [11, 12, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 20, 21, 22]
    assert got["positions"] == [8, 6, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]
    assert got["slot_mapping"] == [
        36,  # d1: 9 * 4 + 0
        2,  # d2: 0 * 4 + 2
        40, 41, 42, 43, 8, 9,  # first: block 10 then block 2
        66, 67, 68, 69,  # middle: positions 6, 7 in block 16; 8, 9 in block 17
        86, 87, 88,  # last: positions 10, 11 in block 21; 12 in block 22
    ]  # fmt: skip
    assert got["query_start"] == [0, 1, 2, 8, 12, 15]
    assert got["context_lens"] == [9, 7, 6, 10, 13]
    # Tables are cut to the blocks the context uses (ceil(context_len / 4)), padded with 0.
    assert got["block_tables"] == [
        [4, 5, 9, 0],
        [7, 0, 0, 0],
        [10, 2, 0, 0],
        [15, 16, 17, 0],
        [19, 20, 21, 22],
    ]
    assert got["sample_rows"] == [0, 1, 14]
    assert got["max_query_len"] == 6 and got["max_context_len"] == 13


def test_block_size_one_and_single_decode() -> None:
    batch = ScheduledBatch(rows=(BatchRow("x", (5,), 2, (7, 3, 9), True),))
    got = _lists(batch, 1)
    assert got["slot_mapping"] == [9]
    assert got["block_tables"] == [[7, 3, 9]]
    assert got["query_start"] == [0, 1] and got["context_lens"] == [3]
    assert got["sample_rows"] == [0]


def test_no_sampling_rows() -> None:
    batch = ScheduledBatch(rows=(BatchRow("p", (1, 2, 3), 0, (0,), False),))
    assert _lists(batch, 16)["sample_rows"] == []


def test_rejects_empty_batch_and_short_block_tables() -> None:
    with pytest.raises(ValueError, match="empty batch"):
        build_model_input(ScheduledBatch(rows=()), 4)
    short = ScheduledBatch(rows=(BatchRow("s", (1, 2, 3), 3, (5,), True),))  # needs 2 blocks
    with pytest.raises(ValueError, match="need 2 blocks"):
        build_model_input(short, 4)


def test_a_one_token_step_padded_to_two() -> None:
    """Deterministic mode's padding: the copy reads the same context, stores nothing (slot -1)
    and is never sampled."""
    from engine.input_builder import pad_to_two_tokens

    batch = ScheduledBatch(rows=(BatchRow("a", (50,), 5, (3, 8), True),))
    padded = pad_to_two_tokens(build_model_input(batch, 4))
    meta = padded.metadata
    assert padded.input_ids.tolist() == [50, 50] and padded.positions.tolist() == [5, 5]
    assert meta.slot_mapping.tolist() == [33, -1] and meta.query_start.tolist() == [0, 1, 2]
    assert meta.context_lens.tolist() == [6, 6] and meta.block_tables.tolist() == [[3, 8]] * 2
    assert padded.sample_rows.tolist() == [0] and meta.max_query_len == 1
    two = ScheduledBatch(rows=(BatchRow("a", (50, 51), 5, (3, 8), True),))
    with pytest.raises(ValueError, match="one-token step"):
        pad_to_two_tokens(build_model_input(two, 4))


def test_inputs_moved_to_another_device_keep_their_values_and_dtypes() -> None:
    """``ModelInput.to``: a CUDA-graph runner builds a step on the host and moves it when it
    does not replay (``engine/model_runner.py``); the meta device stands in for a GPU here."""
    batch = ScheduledBatch(
        rows=(BatchRow("a", (50,), 5, (3, 8), True), BatchRow("b", (60, 61), 0, (2,), False))
    )
    inputs = build_model_input(batch, 4)
    moved = inputs.to("meta")
    pairs = [
        (inputs.input_ids, moved.input_ids),
        (inputs.positions, moved.positions),
        (inputs.sample_rows, moved.sample_rows),
    ]
    for name in ("slot_mapping", "query_start", "context_lens", "block_tables"):
        pairs.append((getattr(inputs.metadata, name), getattr(moved.metadata, name)))
    for before, after in pairs:
        assert after.device.type == "meta"
        assert after.shape == before.shape and after.dtype == before.dtype
    assert moved.metadata.max_query_len == 2 and moved.metadata.max_context_len == 6
    same = inputs.to("cpu")
    assert same.input_ids.tolist() == [50, 60, 61]
    assert same.metadata.block_tables.tolist() == [[3, 8], [2, 0]]


def test_decode_steps_docstring_example() -> None:
    batch = ScheduledBatch(
        rows=(BatchRow("a", (50,), 6, (3, 8), True), BatchRow("b", (60,), 1, (2,), True)),
        num_steps=2,
    )
    steps = build_decode_steps(batch, block_size=4)
    assert steps.num_steps == 2
    assert steps.input_ids.tolist() == [50, 60]
    assert steps.positions.tolist() == [[6, 1], [7, 2]]
    assert steps.slot_mapping.tolist() == [[34, 9], [35, 10]]
    assert steps.context_lens.tolist() == [[7, 2], [8, 3]]
    assert steps.query_start.tolist() == [0, 1, 2]
    assert steps.block_tables.tolist() == [[3, 8], [2, 0]]
    assert steps.context_lens.dtype == steps.query_start.dtype == torch.int32
    assert steps.block_tables.dtype == torch.int32
    assert steps.positions.dtype == steps.slot_mapping.dtype == torch.int64


def test_decode_steps_refuse_prompt_rows_and_tables_short_of_the_last_step() -> None:
    def build(row: BatchRow, num_steps: int = 3) -> None:
        build_decode_steps(ScheduledBatch(rows=(row,), num_steps=num_steps), block_size=4)

    build(BatchRow("a", (5,), 1, (0,), True))  # positions 1 .. 3: one block
    with pytest.raises(ValueError, match="blocks"):
        build(BatchRow("a", (5,), 2, (0,), True))  # position 4 needs a second block
    with pytest.raises(ValueError, match="decode token"):
        build(BatchRow("a", (5, 6), 0, (0,), True))
    with pytest.raises(ValueError, match="decode token"):
        build(BatchRow("a", (5,), 0, (0,), False))
    with pytest.raises(ValueError, match="empty"):
        build_decode_steps(ScheduledBatch(rows=(), num_steps=2), block_size=4)


def _tiled(batch: ScheduledBatch, block_size: int) -> tuple[dict[str, list], int | None]:
    inputs = build_model_input(batch, block_size, prompt_tiles=True)
    return _as_lists(inputs), inputs.tile_from


def test_prompt_tiles_put_generated_tokens_first_and_split_a_row_of_both_kinds() -> None:
    # block_size 4. A prompt chunk (prompt of 6 tokens, positions 0-2), a decode (prompt of 3,
    # position 5), and a preempted request computing again its prompt of 2 and its first two
    # generated tokens (positions 0-3): its generated part goes with the decode, its prompt part
    # after the other prompt chunk, each attending up to its own last position.
    batch = ScheduledBatch(
        rows=(
            BatchRow("p", (60, 61, 62), 0, (6, 1), False, 6),
            BatchRow("d", (50,), 5, (3, 8), True, 3),
            BatchRow("r", (70, 71, 72, 73), 0, (2,), True, 2),
        )
    )
    lists, tile_from = _tiled(batch, 4)
    assert lists == {
        "input_ids": [50, 72, 73, 60, 61, 62, 70, 71],
        "positions": [5, 2, 3, 0, 1, 2, 0, 1],
        "slot_mapping": [33, 10, 11, 24, 25, 26, 8, 9],
        "query_start": [0, 1, 3, 6, 8],
        "context_lens": [6, 4, 3, 2],
        "block_tables": [[3, 8], [2, 0], [6, 0], [2, 0]],
        "sample_rows": [0, 2],  # the batch's row order: d, then r's last token
        "max_query_len": 3,
        "max_context_len": 6,
    }
    assert tile_from == 3


def test_prompt_tiles_leave_a_batch_in_order_as_it_is() -> None:
    # decodes first, then prompt chunks (the scheduler's order): nothing moves; without prompt
    # tokens no row is tiled; without prompt_tiles, or with prompt_end 0, nothing changes
    rows = (
        BatchRow("a", (50,), 5, (3, 8), True, 4),
        BatchRow("b", (60, 61, 62), 2, (6, 1), False, 9),
        BatchRow("c", (70, 71), 0, (2,), True, 2),
    )
    plain = _lists(ScheduledBatch(rows=rows), 4)
    lists, tile_from = _tiled(ScheduledBatch(rows=rows), 4)
    assert lists == plain and tile_from == 1
    lists, tile_from = _tiled(ScheduledBatch(rows=rows[:1]), 4)
    assert lists == _lists(ScheduledBatch(rows=rows[:1]), 4) and tile_from is None
    assert build_model_input(ScheduledBatch(rows=rows), 4).tile_from is None
    untagged = tuple(
        BatchRow(r.request_id, r.token_ids, r.start_pos, r.block_table, r.sample) for r in rows
    )
    assert _tiled(ScheduledBatch(rows=untagged), 4) == (plain, None)


def test_a_prompts_last_token_alone_is_a_prompt_token() -> None:
    # the rest of its prompt was cached: one token, scheduled as a decode, still a prompt token
    batch = ScheduledBatch(rows=(BatchRow("a", (50,), 7, (3, 8), True, 8),))
    lists, tile_from = _tiled(batch, 4)
    assert tile_from == 0 and lists["slot_mapping"] == [35]
