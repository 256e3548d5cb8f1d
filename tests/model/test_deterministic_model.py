"""Deterministic mode: a request's logits are the same bits whatever else runs with it.

Each request alone (budget 512, no prefix cache) is the reference; the same requests all at once,
under step budgets that cut their prompts into different chunks and mix them with decodes, with
prefix-cache hits on a shared prefix, and with a KV pool so small that requests are preempted and
recomputed, must give ``torch.equal`` logits at every sampled position (the runner's float32
logits, before sampling), the same tokens and the same logprobs. Float32 and bfloat16; seeded
sampling too.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from scheduler.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("single_thread")

NUM_REQUESTS = 24
MAX_TOKENS = 10

# (max_batch_tokens, num_kv_blocks): chunked, mixed, and preempted (a pool of 20 blocks of 8)
TOGETHER = [(512, 256), (37, 256), (13, 20)]


def _prompts() -> list[list[int]]:
    """24 prompts of 3..70 tokens; every third starts with one shared 40-token prefix."""
    rng = random.Random(7)
    shared = [rng.randrange(3, 1000) for _ in range(40)]
    prompts = []
    for index in range(NUM_REQUESTS):
        tail = [rng.randrange(3, 1000) for _ in range(rng.randrange(3, 31))]
        prompts.append(shared + tail if index % 3 == 0 else tail)
    return prompts


def _params(seeded: bool) -> list[SamplingParams]:
    if not seeded:
        return [
            SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=3)
        ] * (NUM_REQUESTS)
    return [
        SamplingParams(
            temperature=1.0, seed=index, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=3
        )
        for index in range(NUM_REQUESTS)
    ]


class _Run:
    """Every sampled position's logits, tokens and logprobs, per request."""

    def __init__(self, engine: LLMEngine) -> None:
        self.logits: dict[str, list[torch.Tensor]] = {}
        self.tokens: dict[str, list[int]] = {}
        self.logprobs: dict[str, list] = {}
        forward = engine.runner.forward

        def recording_forward(batch):  # type: ignore[no-untyped-def]
            logits = forward(batch)
            for request_id, row in zip(batch.sample_request_ids, logits, strict=True):
                self.logits.setdefault(request_id, []).append(row.clone())
            return logits

        engine.runner.forward = recording_forward  # type: ignore[method-assign]
        self.engine = engine

    def step_until_done(self) -> None:
        while self.engine.has_unfinished_requests():
            for delta in self.engine.step():
                assert delta.error is None, delta.error
                self.tokens.setdefault(delta.request_id, []).extend(delta.new_token_ids)
                self.logprobs.setdefault(delta.request_id, []).extend(delta.new_logprobs or [])
            self.engine.scheduler.check_integrity()


def _engine(model_dir: Path, dtype: str, **overrides) -> LLMEngine:
    config = dict(
        model=str(model_dir), dtype=dtype, num_kv_blocks=256, block_size=8, deterministic=True
    )
    config.update(overrides)
    return LLMEngine(EngineConfig(**config))


def _alone(model_dir: Path, dtype: str, params: list[SamplingParams], **overrides) -> _Run:
    run = _Run(_engine(model_dir, dtype, enable_prefix_caching=False, **overrides))
    for index, (prompt, param) in enumerate(zip(_prompts(), params, strict=True)):
        run.engine.add_request(str(index), prompt, param)
        run.step_until_done()
    return run


def _together(
    model_dir: Path, dtype: str, params, budget: int, num_blocks: int, **overrides
) -> _Run:
    run = _Run(
        _engine(model_dir, dtype, max_batch_tokens=budget, num_kv_blocks=num_blocks, **overrides)
    )
    for index, (prompt, param) in enumerate(zip(_prompts(), params, strict=True)):
        run.engine.add_request(str(index), prompt, param)
    run.step_until_done()
    return run


def _assert_same(alone: _Run, together: _Run) -> None:
    assert set(together.tokens) == set(alone.tokens) == {str(i) for i in range(NUM_REQUESTS)}
    for request_id, rows in alone.logits.items():
        assert len(together.logits[request_id]) == len(rows) == MAX_TOKENS
        for position, (expected, got) in enumerate(
            zip(rows, together.logits[request_id], strict=True)
        ):
            assert torch.equal(expected, got), (request_id, position)
        assert together.tokens[request_id] == alone.tokens[request_id]
        assert together.logprobs[request_id] == alone.logprobs[request_id]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_logits_alone_equal_logits_together(tiny_llama_dir, dtype):
    params = _params(seeded=False)
    alone = _alone(tiny_llama_dir, dtype, params)
    preempted = 0
    for budget, num_blocks in TOGETHER:
        together = _together(tiny_llama_dir, dtype, params, budget, num_blocks)
        _assert_same(alone, together)
        preempted += together.engine.scheduler.num_preemptions
    assert preempted > 0  # the small pool did preempt and recompute


def test_compiled_steps_alone_equal_together(tiny_llama_dir, monkeypatch):
    """Compiled (float32: every product packed): one graph of two tokens and up, a lone decode
    token padded to two, so a row runs the same loops in every step; no step runs eagerly."""
    from engine import step_graphs

    monkeypatch.setattr(step_graphs.StepGraphs, "stance", "fail_on_recompile")
    params = _params(seeded=False)
    alone = _alone(tiny_llama_dir, "float32", params, compile=True)
    assert alone.engine.runner.graphs.mode == step_graphs.COMPILED
    budget, num_blocks = TOGETHER[2]
    together = _together(tiny_llama_dir, "float32", params, budget, num_blocks, compile=True)
    assert together.engine.scheduler.num_preemptions > 0
    _assert_same(alone, together)


def test_seeded_sampling_alone_equal_together(tiny_llama_dir):
    params = _params(seeded=True)
    alone = _alone(tiny_llama_dir, "float32", params)
    budget, num_blocks = TOGETHER[2]
    _assert_same(alone, _together(tiny_llama_dir, "float32", params, budget, num_blocks))


def test_deterministic_setting_from_flags_environment_and_its_limits():
    from server.config import load_config

    assert load_config({"deterministic": True}, environ={}).engine.deterministic
    assert load_config({}, environ={"SPLITFUSE_DETERMINISTIC": "1"}).engine.deterministic
    assert not load_config({}, environ={}).engine.deterministic
    with pytest.raises(ValueError, match="deterministic mode runs in one process"):
        EngineConfig(deterministic=True, tensor_parallel_size=2)
