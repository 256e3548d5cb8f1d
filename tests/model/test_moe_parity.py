"""Tiny random mixture-of-experts models (Mixtral; Qwen2-MoE with its shared expert, no top-k
renormalization; Qwen3-MoE with q/k norm, renormalization and a dense layer) against transformers,
in float32.

1. Ragged logits: three sequences over five steps (prompt chunks mixed with single-token rows,
   blocks out of order); every token's logits match transformers within 1e-4.
2. Greedy 32-token continuations of four prompts (chunked prefill, 16-token budget) equal
   transformers' ``generate``, under the near-tie rule; again with a KV pool so small that
   requests are preempted and recomputed.
3. Tensor parallelism (gloo): tp=2 logits equal tp=1, and so do greedy continuations.
4. The stacked expert layout of transformers 5 loads as the per-expert one; the compiled step
   graphs run the MoE layers with no graph break; what the engine cannot run is refused by name.
"""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import engine.step_graphs as step_graphs
from engine.config import EngineConfig
from engine.input_builder import build_model_input
from engine.llm_engine import LLMEngine
from engine.model_config import ModelConfig, ModelConfigError
from engine.tensor_parallel.sharding import TensorParallelConfigError
from scheduler.batch import BatchRow, ScheduledBatch
from scheduler.sampling_params import SamplingParams
from tests.model.parity_helpers import (
    LOGITS_ATOL,
    count_greedy_divergence,
    hf_generate,
    hf_logits,
    reference_from_sequence,
)
from tests.tiny_moe_model import make_tiny_moe_model

pytestmark = pytest.mark.usefixtures("single_thread")

BLOCK_SIZE = 4
MODELS = {
    "mixtral": dict(arch="mixtral", seed=1),
    "qwen2_moe": dict(arch="qwen2_moe", seed=2),
    "qwen3_moe": dict(arch="qwen3_moe", seed=3, head_dim=32, mlp_only_layers=[1]),
}
# (sequence, start, end) per step: every row's logits are compared, not only sampling rows
SCHEDULE = [
    [("a", 0, 8), ("b", 0, 5)],
    [("b", 5, 6), ("a", 8, 15), ("c", 0, 3)],
    [("b", 6, 7), ("c", 3, 4), ("a", 15, 16)],
    [("a", 16, 17), ("b", 7, 13), ("c", 4, 17)],
    [("a", 17, 21)],
]
LENGTHS = {"a": 21, "b": 13, "c": 17}
MAX_TOKENS = 32


@pytest.fixture(scope="module", params=list(MODELS))
def model_dir(request, tmp_path_factory) -> Path:
    spec = dict(MODELS[request.param])
    return make_tiny_moe_model(tmp_path_factory.mktemp(request.param), spec.pop("arch"), **spec)


@pytest.fixture(scope="module")
def hf_model(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _engine(model_dir: Path, **overrides) -> LLMEngine:
    config = dict(
        model=str(model_dir),
        dtype="float32",
        device="cpu",
        num_kv_blocks=96,
        block_size=BLOCK_SIZE,
        max_batch_tokens=16,
        num_threads=1,
    )
    config.update(overrides)
    return LLMEngine(EngineConfig(**config))


def _ragged_logits(engine: LLMEngine, seed: int = 0) -> tuple[dict, dict]:
    """(token ids, our logits [len, vocab]) per sequence, run through ``SCHEDULE``."""
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    sequences = {name: [rng.randrange(vocab) for _ in range(n)] for name, n in LENGTHS.items()}
    free_blocks = list(range(engine.num_kv_blocks))
    rng.shuffle(free_blocks)
    tables = {
        name: tuple(free_blocks.pop() for _ in range(-(-n // BLOCK_SIZE)))
        for name, n in LENGTHS.items()
    }
    ours: dict[str, list[torch.Tensor]] = {name: [] for name in LENGTHS}
    for step in SCHEDULE:
        rows = tuple(
            BatchRow(name, tuple(sequences[name][start:end]), start, tables[name], True)
            for name, start, end in step
        )
        inputs = build_model_input(ScheduledBatch(rows=rows), block_size=BLOCK_SIZE)
        logits = engine.runner.run(
            dataclasses.replace(inputs, sample_rows=torch.arange(inputs.num_tokens))
        )
        offset = 0
        for row in rows:
            ours[row.request_id].append(logits[offset : offset + row.num_tokens])
            offset += row.num_tokens
    return sequences, {name: torch.cat(parts) for name, parts in ours.items()}


def _prompts(count: int = 4, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = (5, 23, 40, 11, 30, 17, 8, 26)[:count]
    return [[rng.randrange(3, 1000) for _ in range(n)] for n in lengths]


def _greedy(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for index, prompt in enumerate(prompts):
        engine.add_request(str(index), prompt, params)
    outputs: list[list[int]] = [[] for _ in prompts]
    while engine.has_unfinished_requests():
        for delta in engine.step():
            assert delta.error is None, delta.error
            outputs[int(delta.request_id)].extend(delta.new_token_ids)
        engine.scheduler.check_integrity()
    return outputs


def test_ragged_logits_match_transformers(model_dir, hf_model) -> None:
    sequences, ours = _ragged_logits(_engine(model_dir))
    for name, token_ids in sequences.items():
        want = hf_logits(hf_model, token_ids)
        assert ours[name].shape == want.shape
        diff = (ours[name] - want).abs().max().item()
        assert diff < LOGITS_ATOL, f"sequence {name}: max |logit difference| {diff:.2e}"


@pytest.mark.parametrize("num_kv_blocks", [96, 24], ids=["roomy", "preemption"])
def test_greedy_continuations_match_generate(model_dir, hf_model, num_kv_blocks) -> None:
    """With 24 blocks of 4 tokens, the four requests (up to 72 tokens each) cannot all hold
    their blocks: the newest are preempted and recomputed, invisibly."""
    engine = _engine(model_dir, num_kv_blocks=num_kv_blocks)
    prompts = _prompts()
    outputs = _greedy(engine, prompts)
    near_ties = 0
    for index, prompt in enumerate(prompts):
        reference = hf_generate(hf_model, prompt, MAX_TOKENS)
        near_ties += count_greedy_divergence(reference, outputs[index], f"prompt {index}")
    preemptions = engine.stats().num_preemptions
    print(f"near-ties met: {near_ties}, preemptions: {preemptions}")
    assert (preemptions > 0) == (num_kv_blocks == 24)


@pytest.fixture(scope="module")
def sharded_engines(tmp_path_factory):
    """(tp=1, tp=2 engine, folder) of a Qwen2-MoE (routed and shared experts both split);
    the workers stop after."""
    model_dir = make_tiny_moe_model(tmp_path_factory.mktemp("qwen2-moe-tp"), "qwen2_moe", seed=4)
    single = _engine(model_dir)
    sharded = _engine(model_dir, tp=2)
    yield single, sharded, model_dir
    sharded.shutdown()
    assert all(not process.is_alive() for process in sharded.executor.group.processes)


def test_tp2_logits_and_greedy_outputs_equal_tp1(sharded_engines) -> None:
    single, sharded, model_dir = sharded_engines
    _, want = _ragged_logits(single, seed=5)
    _, got = _ragged_logits(sharded, seed=5)
    worst = max((got[name] - want[name]).abs().max().item() for name in LENGTHS)
    assert worst < LOGITS_ATOL, f"max |logit difference| tp=2 vs tp=1: {worst:.2e}"
    prompts = _prompts()
    want_tokens = _greedy(single, prompts)
    got_tokens = _greedy(sharded, prompts)
    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for index, prompt in enumerate(prompts):
        reference = reference_from_sequence(hf_model, prompt, want_tokens[index])
        count_greedy_divergence(reference, got_tokens[index], f"prompt {index}")


def test_stacked_expert_tensors_load_as_per_expert_ones(tmp_path) -> None:
    """transformers 5's module layout (``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj``
    [E, H, I]) gives the same model as the Hub's per-expert names."""
    per_expert = make_tiny_moe_model(tmp_path / "per-expert", "mixtral", num_layers=1, seed=6)
    stacked = tmp_path / "stacked"
    stacked.mkdir()
    for path in per_expert.iterdir():
        if path.suffix != ".safetensors":
            (stacked / path.name).write_bytes(path.read_bytes())
    tensors = load_file(per_expert / "model.safetensors")
    prefix = "model.layers.0.block_sparse_moe.experts"
    num_experts = 8
    stack = {
        name: torch.stack([tensors.pop(f"{prefix}.{e}.{name}.weight") for e in range(num_experts)])
        for name in ("w1", "w3", "w2")
    }
    tensors["model.layers.0.mlp.experts.gate_up_proj"] = torch.cat([stack["w1"], stack["w3"]], 1)
    tensors["model.layers.0.mlp.experts.down_proj"] = stack["w2"]
    save_file(tensors, stacked / "model.safetensors")
    _, want = _ragged_logits(_engine(per_expert))
    _, got = _ragged_logits(_engine(stacked))
    for name in LENGTHS:
        assert torch.equal(got[name], want[name]), name


def test_compiled_moe_layers_have_no_graph_break(tmp_path, monkeypatch) -> None:
    """The routed experts are one opaque operator: the stack compiles whole, and its logits are
    the eager forward's."""
    monkeypatch.setattr(step_graphs.StepGraphs, "stance", "fail_on_recompile")
    model_dir = make_tiny_moe_model(tmp_path, "qwen2_moe", num_layers=1, seed=7)
    torch._dynamo.utils.counters.clear()
    engine = _engine(model_dir, compile=True, num_kv_blocks=32)
    assert engine.wait_until_compiled(timeout=600)
    assert engine.runner.graphs.mode == step_graphs.COMPILED
    assert not torch._dynamo.utils.counters["graph_break"]
    rows = (BatchRow("a", tuple(range(3, 12)), 0, (0, 1, 2), True),)
    inputs = build_model_input(ScheduledBatch(rows=rows), block_size=BLOCK_SIZE)
    inputs = dataclasses.replace(inputs, sample_rows=torch.arange(inputs.num_tokens))
    compiled = engine.runner.run(inputs)
    engine.runner.graphs.mode = step_graphs.EAGER
    torch.testing.assert_close(compiled, engine.runner.run(inputs), atol=LOGITS_ATOL, rtol=0)


def _edited(path: Path, **changes) -> Path:
    config_path = path / "config.json"
    config = json.loads(config_path.read_text())
    config.update(changes)
    config_path.write_text(json.dumps(config))
    return path


def test_what_cannot_run_is_refused_by_name(tmp_path) -> None:
    model_dir = make_tiny_moe_model(tmp_path, "qwen2_moe", num_layers=2, seed=8)
    raw = json.loads((model_dir / "config.json").read_text())
    with pytest.raises(ModelConfigError, match="num_experts_per_tok"):
        ModelConfig.from_dict({**raw, "num_experts_per_tok": 9})
    with pytest.raises(ModelConfigError, match=r"mlp_only_layers \[2\]"):
        ModelConfig.from_dict({**raw, "mlp_only_layers": [2]})
    sparse_every_other = ModelConfig.from_dict({**raw, "decoder_sparse_step": 2})
    assert sparse_every_other.dense_mlp_layers == (0,)
    with pytest.raises(ValueError, match="quantization 'int8' is not supported for mixture"):
        _engine(model_dir, quantization="int8")
    with pytest.raises(ValueError, match="deterministic mode is not supported for mixture"):
        _engine(model_dir, deterministic=True)
    _edited(model_dir, moe_intermediate_size=33)  # refused before any weight is read
    with pytest.raises(TensorParallelConfigError, match=r"moe_intermediate_size \(33\)"):
        _engine(model_dir, tp=2)
