"""Tensor parallelism on CPU (gloo): tiny random Llama and Qwen2 models at tp=2 against tp=1.

Models: KV heads divisible by 2 (4 query / 2 KV), not divisible with whole groups per rank
(6 / 3: one KV head on rank 0, two on rank 1), and fewer KV heads than ranks (4 / 1: the KV head
replicated, its query heads split).

1. Ragged logits: three sequences over five steps (prompt chunks mixed with single-token rows,
   blocks out of order); every token's logits at tp=2 equal tp=1 within 1e-4 (float32).
2. Greedy 32-token continuations of four prompts through ``LLMEngine`` (chunked prefill) are
   identical at tp=1 and tp=2, under the near-tie rule.
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.config import EngineConfig
from engine.input_builder import build_model_input
from engine.llm_engine import LLMEngine
from engine.tensor_parallel.sharding import TensorParallelConfigError
from scheduler.batch import BatchRow, ScheduledBatch
from scheduler.sampling_params import SamplingParams
from tests.model.parity_helpers import (
    LOGITS_ATOL,
    count_greedy_divergence,
    reference_from_sequence,
)
from tests.tiny_model import make_tiny_model

pytestmark = pytest.mark.usefixtures("single_thread")

MODELS = {
    "llama-kv2": dict(arch="llama"),
    "llama-kv3": dict(arch="llama", hidden_size=96, num_heads=6, num_kv_heads=3, seed=5),
    "qwen2-kv2": dict(arch="qwen2", seed=2),
    "qwen2-kv1": dict(arch="qwen2", num_kv_heads=1, seed=4),
}
BLOCK_SIZE = 4
MAX_TOKENS = 32
# (sequence, start, end) per step
SCHEDULE = [
    [("a", 0, 8), ("b", 0, 5)],
    [("b", 5, 6), ("a", 8, 15), ("c", 0, 3)],
    [("b", 6, 7), ("c", 3, 4), ("a", 15, 16)],
    [("a", 16, 17), ("b", 7, 13), ("c", 4, 17)],
    [("a", 17, 21)],
]
LENGTHS = {"a": 21, "b": 13, "c": 17}


def _engine(model_dir: Path, tp: int) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=str(model_dir),
            dtype="float32",
            device="cpu",
            num_kv_blocks=96,
            block_size=BLOCK_SIZE,
            max_batch_tokens=16,
            tp=tp,
            num_threads=1,
        )
    )


@pytest.fixture(scope="module", params=list(MODELS))
def engines(request, tmp_path_factory):
    """(tp=1 engine, tp=2 engine, model folder) for one tiny model; the workers stop after."""
    spec = dict(MODELS[request.param])
    model_dir = make_tiny_model(tmp_path_factory.mktemp(request.param), spec.pop("arch"), **spec)
    single = _engine(model_dir, 1)
    sharded = _engine(model_dir, 2)
    yield single, sharded, model_dir
    sharded.shutdown()
    assert all(not process.is_alive() for process in sharded.executor.group.processes)


def test_ragged_logits_equal_at_tp1_and_tp2(engines) -> None:
    single, sharded, _ = engines
    rng = random.Random(0)
    vocab = single.model_config.vocab_size
    sequences = {name: [rng.randrange(vocab) for _ in range(n)] for name, n in LENGTHS.items()}
    free_blocks = list(range(single.num_kv_blocks))
    rng.shuffle(free_blocks)
    tables = {
        name: tuple(free_blocks.pop() for _ in range(-(-n // BLOCK_SIZE)))
        for name, n in LENGTHS.items()
    }
    worst = 0.0
    for step in SCHEDULE:
        rows = tuple(
            BatchRow(name, tuple(sequences[name][start:end]), start, tables[name], True)
            for name, start, end in step
        )
        inputs = build_model_input(ScheduledBatch(rows=rows), block_size=BLOCK_SIZE)
        inputs = dataclasses.replace(inputs, sample_rows=torch.arange(inputs.num_tokens))
        runner = single.runner
        want = runner.run(inputs)
        got = sharded.runner.run(inputs)
        assert got.shape == want.shape == (inputs.num_tokens, vocab)
        worst = max(worst, (got - want).abs().max().item())
    assert worst < LOGITS_ATOL, f"max |logit difference| tp=2 vs tp=1: {worst:.2e}"


def _greedy(engine: LLMEngine, prompts: list[list[int]]) -> dict[str, list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for index, prompt in enumerate(prompts):
        engine.add_request(f"r{index}", prompt, params)
    outputs: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            assert delta.error is None, delta.error
            outputs[delta.request_id].extend(delta.new_token_ids)
    return outputs


def test_greedy_outputs_equal_at_tp1_and_tp2(engines) -> None:
    single, sharded, model_dir = engines
    rng = random.Random(1)
    vocab = single.model_config.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in (5, 23, 40, 11)]
    want = _greedy(single, prompts)
    got = _greedy(sharded, prompts)
    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    near_ties = 0
    for index, prompt in enumerate(prompts):
        key = f"r{index}"
        assert len(want[key]) == MAX_TOKENS
        reference = reference_from_sequence(hf_model, prompt, want[key])
        near_ties += count_greedy_divergence(reference, got[key], f"prompt {index}")
    print(f"near-ties met: {near_ties}")


def test_unsplittable_model_is_refused_before_loading(tmp_path) -> None:
    # 6 query / 3 KV heads cannot run on 4 ranks; nothing is spawned or loaded
    model_dir = make_tiny_model(tmp_path, "llama", hidden_size=96, num_heads=6, num_kv_heads=3)
    (model_dir / "model.safetensors").unlink()  # loading would fail differently
    with pytest.raises(TensorParallelConfigError, match="cannot be split over 4"):
        _engine(model_dir, 4)
