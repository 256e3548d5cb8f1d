"""CUDA graphs of decode steps (``engine/cuda_graphs.py``): capture sizes, static inputs (one
buffer, filled from a host copy) and their padding, the host checks of a replayed step, checked
on the tiny model with the Triton backend. On a CPU (the Triton interpreter) a "graph" is the
forward re-run over the static inputs at each replay, which reads them as a captured graph reads
their memory; on CUDA the same checks run with real graphs."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections import Counter

import pytest
import torch

from engine.cuda_graphs import (
    DecodeGraphs,
    DecodeInputs,
    capture_sizes,
    cuda_graphs_unsupported,
)
from engine.input_builder import build_model_input
from engine.llm import LLM
from engine.step_graphs import COMPILED, EAGER
from kernels import KernelInputError
from scheduler.batch import ScheduledBatch
from scheduler.sampling_params import SamplingParams

pytest.importorskip("triton")

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
if DEVICE == "cpu" and not INTERPRET:
    pytest.skip("Triton needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)

PROMPTS = [[3, 4, 5, 6, 7], list(range(10, 31)), [40, 41], [50, 51, 52, 53]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)


class RerunCapture:
    """A stand-in for ``capture_cuda_graph``: the "graph" re-runs the forward, which reads the
    static inputs at replay time, and rewrites the captured output in place."""

    def __init__(self) -> None:
        self.captured: list[int] = []
        self.replays: Counter[int] = Counter()

    def __call__(self, forward, pool):  # type: ignore[no-untyped-def]
        output = forward()
        size = output.shape[0]
        self.captured.append(size)

        def replay() -> None:
            self.replays[size] += 1
            output.copy_(forward())

        return replay, output


def _llm(tiny_llama_dir) -> LLM:
    return LLM(
        model=str(tiny_llama_dir), attention_backend="triton", device=DEVICE, dtype="float32",
        block_size=16, num_kv_blocks=32, max_batch_seqs=8,
    )  # fmt: skip


def _use_graphs(llm: LLM, sizes: list[int], capture, max_position: int | None = None):  # type: ignore[no-untyped-def]
    runner = llm.engine.runner
    graphs = DecodeGraphs(
        runner.model, runner.backend, runner.kv_cache, sizes, max_position or runner.max_position,
        True, capture=capture,
    )  # fmt: skip
    graphs.start()
    runner.graphs = graphs
    return graphs


def _record_batches(llm: LLM, monkeypatch) -> list:  # type: ignore[no-untyped-def]
    batches = []
    runner = llm.engine.runner
    execute = runner.execute

    def recorded(batch):  # type: ignore[no-untyped-def]
        batches.append(batch)
        return execute(batch)

    monkeypatch.setattr(runner, "execute", recorded)
    return batches


def _is_decode(batch) -> bool:  # type: ignore[no-untyped-def]
    return all(row.num_tokens == 1 for row in batch.rows)


def test_capture_sizes() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(128)[-3:] == [112, 120, 128]
    assert capture_sizes(10_000)[-1] == 256  # larger decode steps run eagerly
    with pytest.raises(ValueError, match="at least 1"):
        capture_sizes(0)


def test_the_static_inputs_a_step_reads_are_a_prefix_of_one_buffer() -> None:
    """The layout drawn in ``DecodeInputs``' docstring: a step of ``size`` rows is sent to the
    device as the buffer's first ``num_bytes(size)`` bytes."""
    inputs = DecodeInputs(4, 3, torch.device("cpu"))
    assert inputs.tables_offset == 144 and inputs.num_bytes(2) == 168
    assert inputs.buffer.numel() == inputs.num_bytes(4) == 192
    for max_rows, max_blocks in ((4, 3), (3, 5), (1, 1), (7, 2)):
        inputs = DecodeInputs(max_rows, max_blocks, torch.device("cpu"))
        base = inputs.buffer.data_ptr()
        fields = (inputs.input_ids, inputs.positions, inputs.slot_mapping, inputs.sample_rows)
        fields += (inputs.context_lens, inputs.block_tables)
        assert [field.dtype for field in fields] == [torch.int64] * 4 + [torch.int32] * 2
        assert all((field.data_ptr() - base) % 16 == 0 for field in fields)
        for size in range(1, max_rows + 1):
            for field in fields:  # the end of each field's row size - 1
                last = field[size - 1]
                end = last.data_ptr() - base + last.numel() * last.element_size()
                assert end <= inputs.num_bytes(size)
            assert inputs.block_tables[size - 1].data_ptr() - base + 4 * max_blocks == (
                inputs.num_bytes(size)
            )
        # filled as a step of no rows would be
        assert inputs.slot_mapping.tolist() == [-1] * max_rows
        assert inputs.context_lens.tolist() == [1] * max_rows
        assert not inputs.block_tables.any() and not inputs.input_ids.any()


def test_where_cuda_graphs_are_used() -> None:
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert cuda_graphs_unsupported(cuda, "triton", 1) == ""
    assert "CUDA devices" in cuda_graphs_unsupported(cpu, "triton", 1)
    assert "triton attention backend" in cuda_graphs_unsupported(cuda, "torch", 1)
    assert "tensor-parallel" in cuda_graphs_unsupported(cuda, "triton", 2)


def test_decode_steps_replay_the_next_size_up_with_the_eager_logits(tiny_llama_dir, monkeypatch):
    llm = _llm(tiny_llama_dir)
    capture = RerunCapture()
    graphs = _use_graphs(llm, [1, 2, 4, 8], capture)
    assert graphs.mode == COMPILED and capture.captured == [8, 4, 2, 1]  # largest first
    assert graphs.graph_size(3) == 4 and graphs.graph_size(8) == 8
    assert graphs.graph_size(9) is None
    batches = _record_batches(llm, monkeypatch)
    # 4 requests, then 3 of them: decode steps of 4 and 3 rows (the 3 padded to 4)
    results = llm.generate(PROMPTS, GREEDY)
    results += llm.generate(PROMPTS[:3], GREEDY)
    assert all(len(result.token_ids) == GREEDY.max_tokens for result in results)
    num_batches = len(batches)
    graphs.mode = EAGER
    eager_results = llm.generate(PROMPTS, GREEDY) + llm.generate(PROMPTS[:3], GREEDY)
    graphs.mode = COMPILED
    assert [r.token_ids for r in results] == [r.token_ids for r in eager_results]
    del batches[num_batches:]  # the eager run's
    decodes = [batch for batch in batches if _is_decode(batch)]
    assert {batch.num_rows for batch in decodes} >= {3, 4}
    assert sum(capture.replays.values()) == len(decodes)  # prompt steps ran eagerly
    assert set(capture.replays) <= {4}
    runner = llm.engine.runner
    for batch in decodes[-4:]:
        replayed = runner.forward(batch)
        graphs.mode = EAGER
        eager = runner.forward(batch)
        graphs.mode = COMPILED
        assert replayed.shape == eager.shape == (batch.num_rows, runner.model_config.vocab_size)
        torch.testing.assert_close(replayed, eager, rtol=1e-5, atol=1e-5)


def test_padding_rows_store_nothing(tiny_llama_dir, monkeypatch):
    """A step of 3 rows after one of 4 replays the graph of 4: its padding row holds the slot the
    4-row step left in the static inputs unless the step resets it, and would then store K/V
    there."""
    llm = _llm(tiny_llama_dir)
    graphs = _use_graphs(llm, [4], RerunCapture())
    batches = _record_batches(llm, monkeypatch)
    llm.generate(PROMPTS, GREEDY)
    runner = llm.engine.runner
    four = next(batch for batch in batches if _is_decode(batch) and batch.num_rows == 4)
    runner.forward(four)  # leaves its 4th row's slot and token in the static inputs
    assert graphs.inputs.slot_mapping[3] == build_model_input(four, 16).metadata.slot_mapping[3]
    assert graphs.inputs.context_lens[3] > 1
    # another token in the host copy that the next step sends: other K/V for that slot
    graphs.staging.input_ids[3] = graphs.staging.input_ids[3] + 1
    graphs.staging.block_tables[3, -1] = 1  # a valid block the padding row never reads
    before = runner.kv_cache.clone()
    # the same tokens and positions as before: the same K/V in the same slots, nothing else
    logits = runner.forward(ScheduledBatch(rows=four.rows[:3]))
    assert logits.shape[0] == 3
    assert torch.equal(runner.kv_cache, before)
    for inputs in (graphs.inputs, graphs.staging):
        assert inputs.slot_mapping[3] == -1 and inputs.context_lens[3] == 1
    # one copy sent the host copy's every byte (the graph of 4 reads the whole buffer)
    assert torch.equal(graphs.inputs.buffer.cpu(), graphs.staging.buffer)


def _decode_inputs(llm: LLM, monkeypatch, num_rows: int):  # type: ignore[no-untyped-def]
    """A decode batch of ``num_rows`` rows the engine ran, and its inputs on the host."""
    batches = _record_batches(llm, monkeypatch)
    llm.generate(PROMPTS, GREEDY)
    batch = next(batch for batch in batches if _is_decode(batch) and batch.num_rows == num_rows)
    return batch, build_model_input(batch, 16)


def test_bad_inputs_raise_before_anything_is_written(tiny_llama_dir, monkeypatch):
    llm = _llm(tiny_llama_dir)
    capture = RerunCapture()
    graphs = _use_graphs(llm, [1, 2, 4], capture)
    runner = llm.engine.runner
    batch, good = _decode_inputs(llm, monkeypatch, 4)
    num_slots = runner.kv_cache.shape[2] * runner.kv_cache.shape[3]
    meta = good.metadata
    bad_steps = {
        "slot_mapping must hold": dataclasses.replace(
            good, metadata=dataclasses.replace(meta, slot_mapping=meta.slot_mapping + num_slots)
        ),
        "slot_mapping must hold -1": dataclasses.replace(
            good, metadata=dataclasses.replace(meta, slot_mapping=meta.slot_mapping.clamp(max=-2))
        ),
        "positions must be in": dataclasses.replace(
            good, positions=good.positions + runner.max_position
        ),
        "context_lens must be in": dataclasses.replace(
            good, metadata=dataclasses.replace(meta, context_lens=meta.context_lens * 0)
        ),
        "capacity": dataclasses.replace(
            good, metadata=dataclasses.replace(meta, block_tables=meta.block_tables[:, :0])
        ),
        "positions must be torch.int64": dataclasses.replace(good, positions=good.positions.int()),
    }
    replays = sum(capture.replays.values())
    static, staging = graphs.inputs.buffer.clone(), graphs.staging.buffer.clone()
    kv_cache = runner.kv_cache.clone()
    for message, inputs in bad_steps.items():
        with pytest.raises(KernelInputError, match=message):
            runner.run(inputs)
    # through the engine's own path: a block id past the cache's gives slots past it
    row = batch.rows[0]
    past = dataclasses.replace(row, block_table=(runner.num_kv_blocks,) * len(row.block_table))
    with pytest.raises(KernelInputError, match="slot_mapping"):
        runner.forward(ScheduledBatch(rows=(past, *batch.rows[1:])))
    assert torch.equal(graphs.inputs.buffer, static)
    assert torch.equal(graphs.staging.buffer, staging)
    assert torch.equal(runner.kv_cache, kv_cache)
    assert sum(capture.replays.values()) == replays
    # the good step still replays
    torch.testing.assert_close(runner.run(good), runner.forward(batch), rtol=0, atol=0)
    assert sum(capture.replays.values()) == replays + 2


def test_steps_that_do_not_fit_run_eagerly(tiny_llama_dir, monkeypatch):
    """More rows than the largest size, or tables wider than the captured ones (here 1 block:
    max_position 16), run the eager forward with the same logits."""
    llm = _llm(tiny_llama_dir)
    capture = RerunCapture()
    graphs = _use_graphs(llm, [1, 2], capture, max_position=16)
    assert graphs.max_blocks == 1
    batches = _record_batches(llm, monkeypatch)
    llm.generate(PROMPTS, GREEDY)  # decode steps of 4 rows
    assert not capture.replays
    llm.generate(PROMPTS[1:2], GREEDY)  # 21 tokens and more: 2 blocks
    assert not capture.replays
    llm.generate(PROMPTS[:1], GREEDY)  # 5 tokens and more: 1 block, 1 row
    assert capture.replays[1] == GREEDY.max_tokens - 1
    runner = llm.engine.runner
    wide = next(
        b for b in batches if _is_decode(b) and b.num_rows == 1 and b.rows[0].start_pos > 20
    )
    for batch in (next(b for b in batches if _is_decode(b) and b.num_rows == 4), wide):
        replays = sum(capture.replays.values())
        eager = runner.forward(batch)
        assert sum(capture.replays.values()) == replays
        graphs.mode = EAGER
        torch.testing.assert_close(eager, runner.forward(batch), rtol=0, atol=0)
        graphs.mode = COMPILED


def test_a_step_built_on_the_device_replays_too(tiny_llama_dir, monkeypatch):
    """``run`` given inputs on the device (here: the graphs called with a plan, as ``run`` calls
    them then) writes the static inputs there, with the same padding."""
    llm = _llm(tiny_llama_dir)
    capture = RerunCapture()
    graphs = _use_graphs(llm, [4], capture)
    runner = llm.engine.runner
    four, inputs = _decode_inputs(llm, monkeypatch, 4)
    three = build_model_input(ScheduledBatch(rows=four.rows[:3]), 16, runner.device)
    expected = runner.forward(ScheduledBatch(rows=four.rows[:3]))
    runner.forward(four)  # leaves its 4th row in the static inputs
    replays = capture.replays[4]
    with torch.inference_mode():
        plan = runner.backend.plan(
            three.positions, three.metadata, runner.kv_cache, runner.max_position
        )
        logits = graphs(three.input_ids, three.positions, plan, three.sample_rows)
    assert capture.replays[4] == replays + 1
    torch.testing.assert_close(logits, expected, rtol=0, atol=0)
    assert graphs.inputs.slot_mapping[3] == -1 and graphs.inputs.context_lens[3] == 1


def test_a_failed_capture_leaves_every_step_eager(tiny_llama_dir, caplog):
    llm = _llm(tiny_llama_dir)

    def broken(forward, pool):  # type: ignore[no-untyped-def]
        raise RuntimeError("operation not permitted when stream is capturing")

    with caplog.at_level(logging.ERROR, logger="engine.cuda_graphs"):
        graphs = _use_graphs(llm, [1, 2, 4], broken)
    assert graphs.mode == EAGER
    assert "capture failed" in caplog.text
    results = llm.generate(PROMPTS[:2], GREEDY)
    assert all(len(result.token_ids) == GREEDY.max_tokens for result in results)


@pytest.mark.skipif(DEVICE != "cuda", reason="captures real CUDA graphs")
def test_the_engine_captures_cuda_graphs_on_a_gpu(tiny_llama_dir):
    eager = LLM(model=str(tiny_llama_dir), device="cuda", dtype="float32", compile=False)
    graphs = LLM(model=str(tiny_llama_dir), device="cuda", dtype="float32", compile=True)
    assert isinstance(graphs.engine.runner.graphs, DecodeGraphs)
    assert graphs.engine.runner.graphs.mode == COMPILED
    assert eager.engine.runner.graphs.mode == EAGER
    expected = [result.token_ids for result in eager.generate(PROMPTS, GREEDY)]
    assert [result.token_ids for result in graphs.generate(PROMPTS, GREEDY)] == expected
