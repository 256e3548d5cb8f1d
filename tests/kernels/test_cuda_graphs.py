"""CUDA graphs of decode steps (``engine/cuda_graphs.py``): capture sizes, static inputs and their
padding, checked on the tiny model with the Triton backend. On a CPU (the Triton interpreter) a
"graph" is the forward re-run over the static inputs at each replay, which reads them as a
captured graph reads their memory; on CUDA the same checks run with real graphs."""

from __future__ import annotations

import logging
import os
from collections import Counter

import pytest
import torch

from engine.cuda_graphs import DecodeGraphs, capture_sizes, cuda_graphs_unsupported
from engine.input_builder import build_model_input
from engine.llm import LLM
from engine.step_graphs import COMPILED, EAGER
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


def _use_graphs(llm: LLM, sizes: list[int], capture) -> DecodeGraphs:  # type: ignore[no-untyped-def]
    runner = llm.engine.runner
    graphs = DecodeGraphs(
        runner.model, runner.backend, runner.kv_cache, sizes, runner.max_position, True,
        capture=capture,
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
    assert graphs.slot_mapping[3] == build_model_input(four, 16).metadata.slot_mapping[3]
    graphs.input_ids[3] = graphs.input_ids[3] + 1  # another token: other K/V for that slot
    before = runner.kv_cache.clone()
    # the same tokens and positions as before: the same K/V in the same slots, nothing else
    logits = runner.forward(ScheduledBatch(rows=four.rows[:3]))
    assert logits.shape[0] == 3
    assert torch.equal(runner.kv_cache, before)
    assert graphs.slot_mapping[3] == -1


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
