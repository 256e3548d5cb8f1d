"""Tiny random Llama / Qwen2 / Mistral models against transformers, in float32.

1. Ragged logits: three sequences run over five steps (first, middle and last prompt chunks mixed
   with single-token rows, block tables crossing block boundaries, blocks out of order); every
   token's logits match transformers' forward over the whole sequence within 1e-4.
2. Greedy continuations of 32 tokens through ``LLMEngine`` (chunked prefill with a 16-token
   budget, four requests together) equal transformers' ``generate`` under the near-tie rule.
"""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.config import EngineConfig
from engine.input_builder import build_model_input
from engine.llm_engine import LLMEngine
from scheduler.batch import BatchRow, ScheduledBatch
from scheduler.sampling_params import SamplingParams
from tests.model.parity_helpers import LOGITS_ATOL, count_greedy_divergence, hf_generate, hf_logits
from tests.tiny_model import make_tiny_model

pytestmark = pytest.mark.usefixtures("single_thread")

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def _mistral(path: Path) -> Path:
    """A Llama folder relabelled as Mistral (same weights and names; full attention)."""
    make_tiny_model(path, "llama", seed=3)
    config_path = path / "config.json"
    config = json.loads(config_path.read_text())
    config.update(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=None)
    config_path.write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module", params=["llama", "qwen2", "llama-tied-llama3-hd32", "mistral"])
def model_dir(request, tmp_path_factory, tiny_llama_dir, tiny_qwen2_dir) -> Path:
    if request.param == "llama":
        return tiny_llama_dir
    if request.param == "qwen2":
        return tiny_qwen2_dir
    path = tmp_path_factory.mktemp(request.param)
    if request.param == "mistral":
        return _mistral(path)
    return make_tiny_model(
        path, "llama", head_dim=32, tie_word_embeddings=True, rope_scaling=LLAMA3_ROPE, seed=7
    )


@pytest.fixture(scope="module")
def hf_model(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _engine(model_dir: Path, **overrides) -> LLMEngine:
    config = dict(model=str(model_dir), dtype="float32", num_kv_blocks=96, block_size=4)
    config.update(overrides)
    return LLMEngine(EngineConfig(**config))


# (sequence, start, end) per step: every row's logits are compared, not only sampling rows
SCHEDULE = [
    [("a", 0, 8), ("b", 0, 5)],
    [("b", 5, 6), ("a", 8, 15), ("c", 0, 3)],
    [("b", 6, 7), ("c", 3, 4), ("a", 15, 16)],
    [("a", 16, 17), ("b", 7, 13), ("c", 4, 17)],
    [("a", 17, 21)],
]
LENGTHS = {"a": 21, "b": 13, "c": 17}


def test_ragged_logits_match_transformers(model_dir, hf_model) -> None:
    engine = _engine(model_dir)
    runner = engine.runner
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    sequences = {name: [rng.randrange(vocab) for _ in range(n)] for name, n in LENGTHS.items()}
    free_blocks = list(range(engine.num_kv_blocks))
    rng.shuffle(free_blocks)
    tables = {
        name: tuple(free_blocks.pop() for _ in range(-(-n // 4))) for name, n in LENGTHS.items()
    }
    ours: dict[str, list[torch.Tensor]] = {name: [] for name in LENGTHS}
    for step in SCHEDULE:
        rows = tuple(
            BatchRow(name, tuple(sequences[name][start:end]), start, tables[name], True)
            for name, start, end in step
        )
        inputs = build_model_input(ScheduledBatch(rows=rows), block_size=4)
        logits = runner.run(
            dataclasses.replace(inputs, sample_rows=torch.arange(inputs.num_tokens))
        )
        offset = 0
        for row in rows:
            ours[row.request_id].append(logits[offset : offset + row.num_tokens])
            offset += row.num_tokens
    for name, token_ids in sequences.items():
        got = torch.cat(ours[name])
        want = hf_logits(hf_model, token_ids)
        assert got.shape == want.shape
        diff = (got - want).abs().max().item()
        assert diff < LOGITS_ATOL, f"sequence {name}: max |logit difference| {diff:.2e}"


def test_greedy_continuations_match_generate(model_dir, hf_model) -> None:
    engine = _engine(model_dir, max_batch_tokens=16)
    rng = random.Random(1)
    vocab = engine.model_config.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in (5, 23, 40, 11)]
    params = SamplingParams(temperature=0.0, max_tokens=32)
    for index, prompt in enumerate(prompts):
        engine.add_request(f"r{index}", prompt, params)
    outputs: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            outputs[delta.request_id].extend(delta.new_token_ids)
    near_ties = 0
    for index, prompt in enumerate(prompts):
        reference = hf_generate(hf_model, prompt, 32)
        near_ties += count_greedy_divergence(reference, outputs[f"r{index}"], f"prompt {index}")
    print(f"near-ties met: {near_ties}")
