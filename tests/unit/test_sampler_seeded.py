"""Seeded sampling: a request's tokens depend on its seed and its logits alone, not on the batch
around it (other seeded, unseeded and greedy rows, in any order) nor on the sampler's own seed."""

from __future__ import annotations

import math
import random
from typing import Any

import torch

from engine.sampler import Sampler
from scheduler.batch import NewRequestData
from scheduler.sampling_params import SamplingParams

VOCAB_SIZE = 16
NUM_STEPS = 16
CPU = torch.device("cpu")

# The request under test: every filter and penalty on, so every path sees the seeded row.
SEEDED = {
    "temperature": 0.9,
    "top_k": 10,
    "top_p": 0.95,
    "min_p": 0.02,
    "presence_penalty": 0.3,
    "repetition_penalty": 1.2,
    "logit_bias": {3: 1.0},
    "seed": 1234,
}
COMPANIONS = {
    "other-seeded": {"temperature": 1.0, "seed": 7, "top_p": 0.8},
    "unseeded": {"temperature": 1.3},
    "unseeded-top-k": {"temperature": 0.7, "top_k": 4, "frequency_penalty": 0.5},
    "greedy": {"temperature": 0.0, "repetition_penalty": 1.5},
}


def step_logits(num_steps: int, request_id: str) -> list[torch.Tensor]:
    """Per-step logits of one request, fixed by its id: the same in every run. [vocab_size] each."""
    generator = torch.Generator().manual_seed(sum(map(ord, request_id)))
    return [torch.randn(VOCAB_SIZE, generator=generator) for _ in range(num_steps)]


def add(sampler: Sampler, request_id: str, params: dict[str, Any]) -> None:
    data = NewRequestData(request_id, (1, 2, 3), SamplingParams(**params), (0,))
    sampler.add_request(data)


def run(
    requests: dict[str, dict[str, Any]], sampler_seed: int, shuffle_seed: int | None
) -> dict[str, list[int]]:
    """Sample NUM_STEPS tokens for every request in one batch, the row order shuffled each step
    when ``shuffle_seed`` is given. Returns each request's tokens."""
    sampler = Sampler(VOCAB_SIZE, CPU, seed=sampler_seed)
    for request_id, params in requests.items():
        add(sampler, request_id, params)
    logits = {request_id: step_logits(NUM_STEPS, request_id) for request_id in requests}
    tokens: dict[str, list[int]] = {request_id: [] for request_id in requests}
    order = list(requests)
    shuffler = random.Random(shuffle_seed)
    for step in range(NUM_STEPS):
        if shuffle_seed is not None:
            shuffler.shuffle(order)
        batch = torch.stack([logits[request_id][step] for request_id in order])
        output = sampler.sample(batch, order)
        for request_id, token_id in zip(order, output.token_ids, strict=True):
            tokens[request_id].append(token_id)
    return tokens


def test_same_seed_gives_the_same_tokens_alone_and_in_any_batch() -> None:
    alone = run({"seeded": SEEDED}, sampler_seed=0, shuffle_seed=None)["seeded"]
    for sampler_seed, shuffle_seed in [(1, 1), (2, 2)]:
        mixed = run({"seeded": SEEDED, **COMPANIONS}, sampler_seed, shuffle_seed)
        assert mixed["seeded"] == alone
        assert (
            mixed["other-seeded"]
            == run({"other-seeded": COMPANIONS["other-seeded"]}, sampler_seed=9, shuffle_seed=None)[
                "other-seeded"
            ]
        )


def test_the_seeded_row_is_not_trivially_constant() -> None:
    tokens = run({"seeded": SEEDED}, sampler_seed=0, shuffle_seed=None)["seeded"]
    assert len(set(tokens)) > 3


def test_different_seeds_give_different_tokens() -> None:
    runs = [
        run({"seeded": {**SEEDED, "seed": seed}}, sampler_seed=0, shuffle_seed=None)["seeded"]
        for seed in (1, 2, 3)
    ]
    assert runs[0] != runs[1] and runs[1] != runs[2] and runs[0] != runs[2]


def test_unseeded_rows_follow_the_sampler_seed() -> None:
    requests = {"a": {"temperature": 1.0}, "b": {"temperature": 1.0}}
    first = run(requests, sampler_seed=5, shuffle_seed=None)
    assert run(requests, sampler_seed=5, shuffle_seed=None) == first
    assert run(requests, sampler_seed=6, shuffle_seed=None) != first


def test_seeded_rows_sample_the_right_distribution() -> None:
    """One token from each of 10,000 requests seeded 0..9999: the draws follow softmax(logits / T)
    (chi-square against the 0.1% critical value 16.27 for three degrees of freedom)."""
    logits = [1.0, 0.5, 0.0, -0.5]
    temperature = 0.8
    num_requests = 10_000
    sampler = Sampler(len(logits), CPU, seed=0)
    request_ids = [f"r{seed}" for seed in range(num_requests)]
    for seed, request_id in enumerate(request_ids):
        data = NewRequestData(request_id, (0,), SamplingParams(temperature=0.8, seed=seed), ())
        sampler.add_request(data)
    batch = torch.tensor(logits).expand(num_requests, -1).contiguous()
    counts = [0] * len(logits)
    for token_id in sampler.sample(batch, request_ids).token_ids:
        counts[token_id] += 1
    weights = [math.exp(value / temperature) for value in logits]
    expected = [num_requests * weight / sum(weights) for weight in weights]
    chi2 = sum((c - e) ** 2 / e for c, e in zip(counts, expected, strict=True))
    assert chi2 < 16.27, f"chi2 {chi2:.1f} (counts {counts}, expected {expected})"
