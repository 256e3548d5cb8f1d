"""A request's output does not depend on what else runs with it.

Greedy: each of 32 requests alone (budget 512) is the reference; all 32 together with budgets of
16, 64 and 512 tokens, with prefix caching of shared prompt prefixes, and with a KV pool so small
that requests are preempted and recomputed, give the same tokens (under the near-tie rule, against
transformers' logits over the reference sequence). Seeded sampling: the same tokens alone and among
the others under the same budget. (The logits alone and among others may still differ in the last
bits: a prompt's rows go through products of other row counts. A draw from the whole distribution
moves only if its point falls within those bits of an interval's end; a top-p draw ranks the
random model's near-uniform probabilities first, where such bits reorder near-ties and move whole
intervals, so the test draws without top-p. A budget that cuts a prompt elsewhere can give one of
its tokens to another kernel, a one-token chunk to the C++ decode attention, a longer one to SDPA.
Deterministic mode gives the same logits, to the bit, under every budget:
tests/model/test_deterministic_model.py.)
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from scheduler.sampling_params import SamplingParams
from tests.model.parity_helpers import count_greedy_divergence, reference_from_sequence

pytestmark = pytest.mark.usefixtures("single_thread")

NUM_REQUESTS = 32
MAX_TOKENS = 24


def _prompts() -> list[list[int]]:
    """32 prompts of 3..70 tokens; every fourth starts with one shared 40-token prefix."""
    rng = random.Random(5)
    shared = [rng.randrange(3, 1000) for _ in range(40)]
    prompts = []
    for index in range(NUM_REQUESTS):
        tail = [rng.randrange(3, 1000) for _ in range(rng.randrange(3, 31))]
        prompts.append(shared + tail if index % 4 == 0 else tail + tail[:5])
    return prompts


def _engine(model_dir: Path, **overrides) -> LLMEngine:
    config = dict(model=str(model_dir), dtype="float32", num_kv_blocks=256, block_size=8)
    config.update(overrides)
    return LLMEngine(EngineConfig(**config))


def _run_together(
    engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]
) -> list[list[int]]:
    for index, (prompt, param) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(str(index), prompt, param)
    outputs: list[list[int]] = [[] for _ in prompts]
    while engine.has_unfinished_requests():
        for delta in engine.step():
            assert delta.error is None, delta.error
            outputs[int(delta.request_id)].extend(delta.new_token_ids)
        engine.scheduler.check_integrity()
    return outputs


def _run_alone(engine: LLMEngine, prompts, params) -> list[list[int]]:
    outputs = []
    for index, (prompt, param) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"alone-{index}", prompt, param)
        tokens: list[int] = []
        while engine.has_unfinished_requests():
            for delta in engine.step():
                tokens.extend(delta.new_token_ids)
        outputs.append(tokens)
    return outputs


@pytest.fixture(scope="module")
def greedy_reference(tiny_llama_dir):
    prompts = _prompts()
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)] * len(
        prompts
    )
    alone = _run_alone(_engine(tiny_llama_dir, enable_prefix_caching=False), prompts, params)
    hf_model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    references = [
        reference_from_sequence(hf_model, prompt, output)
        for prompt, output in zip(prompts, alone, strict=True)
    ]
    return prompts, params, references


@pytest.mark.parametrize(
    "overrides",
    [
        {"max_batch_tokens": 16},
        {"max_batch_tokens": 64},
        {"max_batch_tokens": 512},
        {"max_batch_tokens": 64, "num_kv_blocks": 24},  # preemption
    ],
    ids=["budget-16", "budget-64", "budget-512", "preemption"],
)
def test_greedy_output_is_batch_invariant(tiny_llama_dir, greedy_reference, overrides) -> None:
    prompts, params, references = greedy_reference
    engine = _engine(tiny_llama_dir, **overrides)
    together = _run_together(engine, prompts, params)
    near_ties = sum(
        count_greedy_divergence(reference, output, f"request {index}")
        for index, (reference, output) in enumerate(zip(references, together, strict=True))
    )
    stats = engine.stats()
    print(f"{overrides}: near-ties met {near_ties}, preemptions {stats.num_preemptions}")
    assert stats.prefix_cache_hits > 0  # the shared prefix was reused
    if "num_kv_blocks" in overrides:
        assert stats.num_preemptions > 0


def test_seeded_sampling_is_batch_invariant(tiny_llama_dir) -> None:
    prompts = _prompts()
    params = [
        SamplingParams(temperature=0.8, max_tokens=MAX_TOKENS, seed=100 + index)
        for index in range(len(prompts))
    ]
    alone = _run_alone(_engine(tiny_llama_dir), prompts[:8], params[:8])
    together = _run_together(_engine(tiny_llama_dir, max_batch_tokens=512), prompts, params)
    assert together[:8] == alone
    assert len({tuple(tokens) for tokens in together}) == len(together)  # not all the same draw
