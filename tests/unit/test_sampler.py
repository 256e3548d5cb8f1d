"""Sampler: greedy, temperature, top-k / top-p / min-p, penalties, logit_bias, min_tokens, logprobs,
and misuse. CPU, small vocabularies.

Distribution checks draw many rows in one call (one request per row) from a sampler with a fixed
seed, and compare the counts with the expected probabilities by Pearson's chi-square statistic
against the 0.1% critical value of its degrees of freedom. The seed makes each check deterministic;
a wrong distribution (for instance softmax(logits) where softmax(logits / T) is due) gives a
statistic in the hundreds or thousands.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from engine.logits_processors import (
    TOP_P_CANDIDATES,
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
    sample_from_probs,
)
from engine.sampler import (
    DuplicateRequestError,
    InvalidTokenIdError,
    Sampler,
    SamplerError,
    UnknownRequestError,
)
from scheduler.batch import NewRequestData
from scheduler.sampling_params import SamplingParams

VOCAB_SIZE = 8
EOS_ID = 7
CPU = torch.device("cpu")
NUM_DRAWS = 8_000
# Chi-square critical values at p = 0.001, by degrees of freedom.
CHI2_CRITICAL = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}
LOGITS = [2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2]


def add(sampler: Sampler, request_id: str, prompt: tuple[int, ...] = (0,), **params: Any) -> None:
    data = NewRequestData(request_id, prompt, SamplingParams(**params), (EOS_ID,))
    sampler.add_request(data)


def draw_many(params: dict[str, Any], logits: list[float], seed: int = 0) -> list[int]:
    """NUM_DRAWS tokens, one request per row, all rows with the same logits and params."""
    sampler = Sampler(len(logits), CPU, seed=seed)
    request_ids = [f"r{i}" for i in range(NUM_DRAWS)]
    sampling_params = SamplingParams(**params)
    for request_id in request_ids:
        sampler.add_request(NewRequestData(request_id, (0,), sampling_params, (EOS_ID,)))
    batch = torch.tensor(logits).expand(NUM_DRAWS, -1).contiguous()
    return sampler.sample(batch, request_ids).token_ids


def softmax(values: list[float]) -> list[float]:
    top = max(values)
    weights = [math.exp(v - top) for v in values]
    return [w / sum(weights) for w in weights]


def reference_distribution(
    logits: list[float], temperature: float, top_k: int, top_p: float, min_p: float
) -> list[float]:
    """Written out in plain Python, step by step, independently of the tensor code."""
    scaled = [value / temperature for value in logits]
    order = sorted(range(len(logits)), key=lambda i: -scaled[i])
    kept = order[:top_k] if top_k else order
    probs = dict(zip(kept, softmax([scaled[i] for i in kept]), strict=True))
    if top_p < 1:
        nucleus, mass = [], 0.0
        for token_id in kept:
            if mass >= top_p:
                break
            nucleus.append(token_id)
            mass += probs[token_id]
        kept = nucleus
        probs = dict(zip(kept, softmax([scaled[i] for i in kept]), strict=True))
    if min_p > 0:
        highest = max(probs.values())
        kept = [i for i in kept if probs[i] >= min_p * highest]
        probs = dict(zip(kept, softmax([scaled[i] for i in kept]), strict=True))
    return [probs.get(i, 0.0) for i in range(len(logits))]


def assert_matches(token_ids: list[int], expected: list[float]) -> None:
    """Tokens of probability 0 never appear; the others pass the chi-square test."""
    counts = [0] * len(expected)
    for token_id in token_ids:
        counts[token_id] += 1
    outside = {i: c for i, c in enumerate(counts) if expected[i] == 0 and c}
    assert not outside, f"sampled tokens outside the allowed set: {outside}"
    support = [i for i, p in enumerate(expected) if p > 0]
    if len(support) == 1:
        return
    n = len(token_ids)
    chi2 = sum((counts[i] - n * expected[i]) ** 2 / (n * expected[i]) for i in support)
    critical = CHI2_CRITICAL[len(support) - 1]
    assert chi2 < critical, f"chi2 {chi2:.1f} >= {critical} (counts {counts}, expected {expected})"


# --- greedy ---------------------------------------------------------------------------------------


def test_greedy_takes_the_argmax_of_every_row() -> None:
    sampler = Sampler(VOCAB_SIZE, CPU, seed=0)
    request_ids = [f"r{i}" for i in range(16)]
    for request_id in request_ids:
        add(sampler, request_id, temperature=0.0)
    logits = torch.randn(16, VOCAB_SIZE, generator=torch.Generator().manual_seed(1))
    assert sampler.sample(logits, request_ids).token_ids == logits.argmax(dim=-1).tolist()


def test_greedy_ids_given_are_the_plain_greedy_rows_tokens() -> None:
    """The caller's argmax (the decode stack's) is taken as is where every row is plain greedy,
    and left where one is not (a bias: the processed logits' argmax)."""
    sampler = Sampler(VOCAB_SIZE, CPU, seed=0)
    add(sampler, "a", temperature=0.0)
    add(sampler, "b", temperature=0.0)
    logits = torch.randn(2, VOCAB_SIZE, generator=torch.Generator().manual_seed(3))
    given = torch.tensor([5, 9])  # (not the argmax: shows which was taken)
    assert sampler.sample(logits, ["a", "b"], given).token_ids == [5, 9]
    add(sampler, "biased", temperature=0.0, logit_bias={3: 100.0})
    output = sampler.sample(logits, ["a", "biased"], given)
    assert output.token_ids == [int(logits[0].argmax()), 3]


def test_greedy_rows_beside_random_rows_still_take_the_argmax() -> None:
    sampler = Sampler(VOCAB_SIZE, CPU, seed=0)
    add(sampler, "greedy", temperature=0.0)
    add(sampler, "tiny-temperature", temperature=1e-7)
    add(sampler, "random", temperature=1.0)
    add(sampler, "greedy-biased", temperature=0.0, logit_bias={3: 0.1})
    logits = torch.randn(4, VOCAB_SIZE, generator=torch.Generator().manual_seed(2))
    output = sampler.sample(logits, ["greedy", "tiny-temperature", "random", "greedy-biased"])
    argmax = logits.argmax(dim=-1).tolist()
    biased = logits[3].clone()
    biased[3] += 0.1
    assert output.token_ids[:2] == argmax[:2]
    assert output.token_ids[3] == int(biased.argmax())


# --- temperature, top-k, top-p, min-p -------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_matches_softmax_of_scaled_logits(temperature: float) -> None:
    token_ids = draw_many({"temperature": temperature}, LOGITS)
    assert_matches(token_ids, softmax([v / temperature for v in LOGITS]))


def test_reference_distribution_worked_examples() -> None:
    # LOGITS ranked: 0 (2.0), 6 (1.5), 1 (1.0), 2 (0.5), 7 (0.2), 3, 4, 5.
    assert [i for i, p in enumerate(reference_distribution(LOGITS, 1, 3, 1, 0)) if p] == [0, 1, 6]
    # Softmax: p0 = 0.380, p6 = 0.231, p1 = 0.140. 0 and 6 reach 0.611: enough for top_p = 0.6;
    # top_p = 0.62 needs token 1 as well.
    assert [i for i, p in enumerate(reference_distribution(LOGITS, 1, 0, 0.6, 0)) if p] == [0, 6]
    assert [i for i, p in enumerate(reference_distribution(LOGITS, 1, 0, 0.62, 0)) if p] == [
        0,
        1,
        6,
    ]
    # min_p = 0.5 keeps tokens at least half as likely as token 0: e^-0.5 = 0.61 (6), e^-1 (1) no.
    assert [i for i, p in enumerate(reference_distribution(LOGITS, 1, 0, 1, 0.5)) if p] == [0, 6]


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "min_p"),
    [
        (1.0, 3, 1.0, 0.0),
        (1.0, 1, 1.0, 0.0),
        (1.0, 0, 0.55, 0.0),
        (2.0, 0, 0.55, 0.0),  # a flatter distribution needs more tokens to reach 0.55
        (1.0, 0, 0.3, 0.0),  # the first token alone reaches 0.3
        (1.0, 4, 0.8, 0.0),  # top-p over the renormalised top-4
        (1.0, 0, 1.0, 0.3),
        (0.7, 5, 0.9, 0.2),
    ],
)
def test_filters_keep_the_allowed_set_and_renormalise(
    temperature: float, top_k: int, top_p: float, min_p: float
) -> None:
    params = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "min_p": min_p}
    expected = reference_distribution(LOGITS, temperature, top_k, top_p, min_p)
    assert_matches(draw_many(params, LOGITS), expected)


def test_top_k_top_p_and_min_p_functions_match_the_reference_on_random_rows() -> None:
    generator = torch.Generator().manual_seed(3)
    vocab_size = 32
    for _ in range(30):
        logits = torch.randn(4, vocab_size, generator=generator) * 2
        top_k = torch.randint(1, vocab_size + 1, (4,), generator=generator)
        top_k[2:] = vocab_size  # reference: no top-k on the last two rows
        top_p = torch.rand(4, generator=generator).clamp_min(0.05)
        min_p = torch.rand(4, generator=generator) * 0.5
        filtered = apply_top_k_top_p(logits, top_k, int(top_k.max()), top_p)
        # Rows without a top-k go through the sort instead of the topk.
        filtered[2:] = apply_top_k_top_p(logits[2:], None, vocab_size, top_p[2:])
        filtered = apply_min_p(filtered, min_p)
        for row in range(4):
            expected = reference_distribution(
                logits[row].tolist(),
                1.0,
                int(top_k[row]),
                float(top_p[row]),
                float(min_p[row]),
            )
            kept = torch.isfinite(filtered[row])
            assert kept.tolist() == [p > 0 for p in expected]
            assert torch.equal(filtered[row][kept], logits[row][kept])


@pytest.mark.parametrize(
    ("scales", "uses_candidates"),
    [
        ((2.0, 4.0, 2.0), [True, True, True]),
        ((0.1, 0.1, 0.1), [False, False, False]),
        ((4.0, 0.1, 2.0), [True, False, True]),
    ],
)
def test_top_p_over_a_large_vocabulary_matches_the_reference(
    scales: tuple[float, ...], uses_candidates: list[bool]
) -> None:
    """3000 tokens, more than TOP_P_CANDIDATES: peaked rows are ranked from the candidates alone,
    flat rows (the candidates hold too little mass) by the full sort, alone or side by side.
    Every row keeps the same set as the reference."""
    generator = torch.Generator().manual_seed(7)
    logits = torch.randn(3, 3000, generator=generator) * torch.tensor(scales).unsqueeze(1)
    top_p = torch.tensor([0.5, 0.85, 0.9])  # at scale 2 the candidates hold 0.93 of a row
    candidate_mass = logits.softmax(dim=-1).topk(TOP_P_CANDIDATES).values.sum(dim=-1)
    assert (candidate_mass >= top_p).tolist() == uses_candidates
    filtered = apply_top_k_top_p(logits, None, 3000, top_p)
    for row in range(3):
        expected = reference_distribution(logits[row].tolist(), 1.0, 0, float(top_p[row]), 0.0)
        assert torch.isfinite(filtered[row]).tolist() == [p > 0 for p in expected]
        assert torch.equal(
            filtered[row][torch.isfinite(filtered[row])], logits[row][torch.tensor(expected) > 0]
        )


def test_top_k_keeps_exactly_k_tokens_among_ties() -> None:
    filtered = apply_top_k_top_p(torch.zeros(1, 6), torch.tensor([2]), 2, None)
    assert int(torch.isfinite(filtered).sum()) == 2


@pytest.mark.parametrize(("top_p", "kept"), [(0.45, 1), (0.7, 2), (0.85, 3), (1.0, 3)])
def test_top_p_worked_example(top_p: float, kept: int) -> None:
    # probs [0.5, 0.3, 0.2]: the first token holds 0.5, the first two 0.8, all three 1.
    logits = torch.tensor([[0.5, 0.3, 0.2]]).log()
    filtered = apply_top_k_top_p(logits, None, 3, torch.tensor([top_p]))
    assert torch.isfinite(filtered).tolist() == [[True] * kept + [False] * (3 - kept)]


def test_top_p_of_one_keeps_tokens_of_negligible_mass() -> None:
    logits = torch.tensor([[30.0, 0.0, -30.0]])
    assert torch.equal(apply_top_k_top_p(logits, torch.tensor([3]), 3, torch.tensor([1.0])), logits)


def test_sample_from_probs_maps_uniform_numbers_through_the_cdf() -> None:
    # CDF [0.25, 0.25, 1.0]: [0, 0.25) -> token 0; token 1 has no interval; [0.25, 1) -> token 2.
    probs = torch.tensor([[0.25, 0.0, 0.75]]).expand(5, -1)
    uniform = torch.tensor([0.0, 0.2499, 0.25, 0.5, 1.0 - 2**-53], dtype=torch.float64)
    assert sample_from_probs(probs, uniform).tolist() == [0, 0, 2, 2, 2]
    # Unnormalised rows are scaled by their sum; a row with no finite value stays in range.
    weights = torch.tensor([[1.0, 3.0, 0.0], [float("nan")] * 3])
    assert sample_from_probs(weights, torch.tensor([0.3, 0.5], dtype=torch.float64)).tolist() == [
        1,
        2,
    ]


def test_sample_from_probs_across_chunks_with_a_padded_vocabulary() -> None:
    # 600 tokens: chunks of 256, 256 and 88 (padded). Intervals: 5 [0, 0.25), 256 [0.25, 0.375),
    # 300 [0.375, 0.875), 599 [0.875, 1); the other tokens have probability 0.
    probs = torch.zeros(7, 600)
    probs[:, [5, 256, 300, 599]] = torch.tensor([0.25, 0.125, 0.5, 0.125])
    uniform = torch.tensor([0.0, 0.2499, 0.2501, 0.3749, 0.3751, 0.8751, 1 - 2**-53])
    tokens = sample_from_probs(probs, uniform.double()).tolist()
    assert tokens == [5, 5, 256, 256, 300, 599, 599]


def test_sample_from_probs_agrees_with_a_full_float64_cdf() -> None:
    """Two-level lookup vs one float64 cumulative sum over the whole row: the same token except
    where a uniform number falls within float rounding (~1e-7 of a token's edge)."""
    generator = torch.Generator().manual_seed(6)
    probs = (torch.randn(1000, 1000, generator=generator) * 3).softmax(dim=-1)
    uniform = torch.rand(1000, generator=generator, dtype=torch.float64)
    cdf = probs.double().cumsum(dim=-1)
    expected = torch.searchsorted(cdf, (uniform * cdf[:, -1]).unsqueeze(1), right=True)
    mismatches = int((sample_from_probs(probs, uniform) != expected.squeeze(1)).sum())
    assert mismatches <= 1


# --- penalties ------------------------------------------------------------------------------------


def test_apply_penalties_hand_computed() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, -2.0, 1.0, 3.0]])
    output_counts = torch.tensor([[0.0, 0.0, 2.0, 1.0, 0.0, 0.0]])
    prompt_mask = torch.tensor([[True, True, False, False, False, False]])
    result = apply_penalties(
        logits,
        output_counts,
        prompt_mask,
        presence_penalty=torch.tensor([0.5]),
        frequency_penalty=torch.tensor([0.25]),
        repetition_penalty=torch.tensor([2.0]),
    )
    # 0: prompt, positive: 2 / 2. 1: prompt, negative: -1 * 2.
    # 2: output x2: 0.5 / 2 - 0.25 * 2 - 0.5. 3: output x1: -2 * 2 - 0.25 - 0.5. 4, 5: unseen.
    expected = torch.tensor([[1.0, -2.0, -0.75, -4.75, 1.0, 3.0]])
    assert torch.allclose(result, expected, rtol=0, atol=1e-6), result
    assert logits[0, 0] == 2.0  # the input is left unchanged


@pytest.mark.parametrize(
    ("presence", "frequency", "repetition", "expected"),
    [
        (0.5, None, None, [2.0, -1.0, 0.0, -2.5, 1.0, 3.0]),
        (None, 0.25, None, [2.0, -1.0, 0.0, -2.25, 1.0, 3.0]),
        (None, None, 2.0, [1.0, -2.0, 0.25, -4.0, 1.0, 3.0]),
    ],
)
def test_apply_penalties_one_at_a_time(
    presence: float | None, frequency: float | None, repetition: float | None, expected: list
) -> None:
    def as_tensor(value: float | None) -> torch.Tensor | None:
        return None if value is None else torch.tensor([value])

    result = apply_penalties(
        torch.tensor([[2.0, -1.0, 0.5, -2.0, 1.0, 3.0]]),
        torch.tensor([[0.0, 0.0, 2.0, 1.0, 0.0, 0.0]]),
        torch.tensor([[True, True, False, False, False, False]]),
        as_tensor(presence),
        as_tensor(frequency),
        as_tensor(repetition),
    )
    assert torch.allclose(result, torch.tensor([expected]), rtol=0, atol=1e-6), result


@pytest.mark.parametrize(
    ("logits", "expected_token"),
    [
        # Positive logits: token 0 (in the prompt) 2.0 / 1.5 = 1.33 falls below token 1's 1.5.
        ([2.0, 1.5, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0], 1),
        # Negative logits: -1.0 * 1.5 = -1.5 falls below -1.2 (dividing would raise it instead).
        ([-1.0, -1.2, -3.0, -3.0, -3.0, -3.0, -3.0, -3.0], 1),
    ],
)
def test_repetition_penalty_applies_to_prompt_tokens(
    logits: list[float], expected_token: int
) -> None:
    sampler = Sampler(VOCAB_SIZE, CPU)
    add(sampler, "penalised", prompt=(0, 5), temperature=0.0, repetition_penalty=1.5)
    add(sampler, "plain", prompt=(0, 5), temperature=0.0)
    output = sampler.sample(torch.tensor([logits, logits]), ["penalised", "plain"])
    assert output.token_ids == [expected_token, 0]


def run_greedy(logits: list[float], steps: int, prompt: tuple[int, ...], **params: Any) -> list:
    sampler = Sampler(VOCAB_SIZE, CPU)
    add(sampler, "r", prompt=prompt, temperature=0.0, **params)
    row = torch.tensor([logits])
    return [sampler.sample(row, ["r"]).token_ids[0] for _ in range(steps)]


LEADING = [1.0, 0.6, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]


def test_presence_penalty_counts_output_tokens_once_and_ignores_the_prompt() -> None:
    # Token 0 is in the prompt but is not penalised until sampled; then 1.0 - 0.5 = 0.5 < 0.6.
    # Once both were sampled: 0.5 vs 0.1, and presence does not grow with repeats.
    assert run_greedy(LEADING, 5, prompt=(0,), presence_penalty=0.5) == [0, 1, 0, 0, 0]


def test_frequency_penalty_grows_with_each_repeat() -> None:
    # 0: 1.0, 0.7, 0.4 (vs 0.6 -> 1), 0.4 vs 0.3 -> 0, 0.1 vs 0.3 -> 1.
    assert run_greedy(LEADING, 5, prompt=(0,), frequency_penalty=0.3) == [0, 0, 1, 0, 1]


def test_repetition_penalty_covers_output_tokens() -> None:
    # Prompt (5,): 0 is sampled, then 1.0 / 2 = 0.5 < 0.6 -> 1, then 0.5 vs 0.3 -> 0 again.
    assert run_greedy(LEADING, 3, prompt=(5,), repetition_penalty=2.0) == [0, 1, 0]


def test_penalty_slots_are_reused_clean_and_grow() -> None:
    sampler = Sampler(VOCAB_SIZE, CPU)
    row = torch.tensor([LEADING])
    for request_id in ["a", "b", "c", "d", "e", "f"]:  # more than the initial capacity
        add(sampler, request_id, temperature=0.0, frequency_penalty=0.3)
    for request_id in ["a", "b", "c", "d", "e", "f"]:
        assert [sampler.sample(row, [request_id]).token_ids[0] for _ in range(5)] == [0, 0, 1, 0, 1]
    sampler.remove_requests(["c"])
    add(sampler, "g", temperature=0.0, frequency_penalty=0.3)  # takes c's slot
    assert [sampler.sample(row, ["g"]).token_ids[0] for _ in range(5)] == [0, 0, 1, 0, 1]


# --- logit_bias and min_tokens --------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logit_bias_forces_and_bans_tokens(temperature: float) -> None:
    sampler = Sampler(VOCAB_SIZE, CPU, seed=0)
    logits = torch.randn(2, VOCAB_SIZE, generator=torch.Generator().manual_seed(4))
    banned = int(logits[1].argmax())
    add(sampler, "forced", temperature=temperature, logit_bias={5: 100.0})
    add(sampler, "banned", temperature=0.0, logit_bias={banned: -100.0})
    for _ in range(20):
        output = sampler.sample(logits, ["forced", "banned"])
        assert output.token_ids[0] == 5
        assert output.token_ids[1] == int(logits[1].topk(2).indices[1])


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_min_tokens_blocks_eos_and_stop_ids_until_reached(ignore_eos: bool) -> None:
    sampler = Sampler(VOCAB_SIZE, CPU)
    add(sampler, "r", temperature=0.0, min_tokens=3, stop_token_ids=(6,), ignore_eos=ignore_eos)
    stop_first = torch.tensor([[0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 9.0, 8.0]])
    eos_first = torch.tensor([[0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 8.0, 9.0]])
    tokens = [sampler.sample(stop_first, ["r"]).token_ids[0] for _ in range(3)]
    assert tokens == [1, 1, 1]
    assert sampler.sample(stop_first, ["r"]).token_ids == [6]
    assert sampler.sample(eos_first, ["r"]).token_ids == [EOS_ID]


def test_min_tokens_masks_sampled_rows_too() -> None:
    params = {"temperature": 1.0, "min_tokens": 1, "stop_token_ids": (6,)}
    expected = softmax(LOGITS[:6] + [float("-inf"), float("-inf")])
    assert_matches(draw_many(params, LOGITS), expected)


def test_precomputed_bias_and_mask_tensors_give_the_per_element_logits() -> None:
    """The bias and min_tokens tensors built once per request give, step after step, exactly
    the logits of adding each bias and masking each id one element at a time."""
    vocab_size = 1000
    rng = torch.Generator().manual_seed(7)
    sampler = Sampler(vocab_size, CPU, seed=0)
    configs: dict[str, dict[str, Any]] = {
        "plain": {},
        "bias": {"logit_bias": {3: 1.5, 999: -100.0, 40: 0.25}},
        "max_bias": {"logit_bias": {t: (t % 201) - 100.0 for t in range(0, 900, 3)}},
        "mask": {"min_tokens": 2, "stop_token_ids": (5, 6, 7)},
        "both": {"min_tokens": 1, "stop_token_ids": (EOS_ID, 9), "logit_bias": {9: 3.0, 1: -2.0}},
    }
    for request_id, params in configs.items():
        add(sampler, request_id, temperature=0.0, max_tokens=8, **params)
    request_ids = list(configs)
    states = sampler._lookup(torch.zeros(len(request_ids), vocab_size), request_ids)
    for num_outputs in range(3):
        logits = torch.randn(len(request_ids), vocab_size, generator=rng)
        expected = logits.clone()
        for row, params in enumerate(configs.values()):
            for token_id, bias in params.get("logit_bias", {}).items():
                expected[row, token_id] += torch.tensor(bias, dtype=torch.float32)
            if num_outputs < params.get("min_tokens", 0):
                for token_id in (EOS_ID, *params["stop_token_ids"]):
                    expected[row, token_id] = float("-inf")
        processed = logits.clone()
        sampler._apply_bias_and_mask(processed, states)
        assert torch.equal(processed, expected), num_outputs
        sampler.sample(logits, request_ids)


# --- logprobs -------------------------------------------------------------------------------------


def test_logprobs_are_raw_log_softmax_with_sorted_top_k() -> None:
    sampler = Sampler(VOCAB_SIZE, CPU, seed=0)
    add(sampler, "none", temperature=1.0)
    add(sampler, "zero", temperature=0.0, logprobs=0)
    add(sampler, "three", temperature=0.8, logprobs=3, presence_penalty=1.0, logit_bias={2: 5.0})
    add(sampler, "all", temperature=1.0, top_k=2, logprobs=20)  # more than the vocabulary
    logits = torch.randn(4, VOCAB_SIZE, generator=torch.Generator().manual_seed(5))
    request_ids = ["none", "zero", "three", "all"]
    for _ in range(3):
        output = sampler.sample(logits, request_ids)
        raw = torch.log_softmax(logits, dim=-1)
        assert output.logprobs[0] is None
        for row, k in [(1, 0), (2, 3), (3, VOCAB_SIZE)]:
            logprob = output.logprobs[row]
            assert logprob is not None
            assert logprob.token_id == output.token_ids[row]
            assert logprob.logprob == pytest.approx(float(raw[row, logprob.token_id]), abs=1e-6)
            assert len(logprob.top) == k
            values = [value for _, value in logprob.top]
            assert values == sorted(values, reverse=True)
            for token_id, value in logprob.top:
                assert value == pytest.approx(float(raw[row, token_id]), abs=1e-6)
            assert [t for t, _ in logprob.top] == raw[row].topk(k).indices.tolist()


# --- misuse ---------------------------------------------------------------------------------------


def test_add_request_twice_raises_and_keeps_the_first() -> None:
    sampler = Sampler(VOCAB_SIZE, CPU)
    add(sampler, "r", temperature=0.0)
    with pytest.raises(DuplicateRequestError):
        add(sampler, "r", temperature=1.0, logit_bias={3: 100.0})
    assert sampler.sample(torch.tensor([LEADING]), ["r"]).token_ids == [0]


def test_sample_for_unknown_or_removed_request_raises_and_changes_nothing() -> None:
    sampler = Sampler(VOCAB_SIZE, CPU)
    add(sampler, "r", temperature=0.0, frequency_penalty=0.3)
    row = torch.tensor([LEADING])
    assert sampler.sample(row, ["r"]).token_ids == [0]
    with pytest.raises(UnknownRequestError):
        sampler.sample(torch.tensor([LEADING, LEADING]), ["r", "ghost"])
    # The failed call recorded nothing: the frequency sequence goes on as [0, 0, 1, 0, 1].
    assert [sampler.sample(row, ["r"]).token_ids[0] for _ in range(4)] == [0, 1, 0, 1]
    sampler.remove_requests(["r", "never-added"])
    assert len(sampler) == 0 and "r" not in sampler
    with pytest.raises(UnknownRequestError):
        sampler.sample(row, ["r"])


@pytest.mark.parametrize(
    "logits",
    [torch.zeros(2, VOCAB_SIZE), torch.zeros(1, VOCAB_SIZE + 1), torch.zeros(VOCAB_SIZE)],
)
def test_sample_with_wrong_logits_shape_raises(logits: torch.Tensor) -> None:
    sampler = Sampler(VOCAB_SIZE, CPU)
    add(sampler, "r")
    with pytest.raises(SamplerError, match="shape"):
        sampler.sample(logits, ["r"])


def test_sample_with_a_repeated_request_id_raises() -> None:
    sampler = Sampler(VOCAB_SIZE, CPU)
    add(sampler, "r")
    with pytest.raises(SamplerError, match="more than once"):
        sampler.sample(torch.zeros(2, VOCAB_SIZE), ["r", "r"])


@pytest.mark.parametrize(
    ("prompt", "params"),
    [
        ((0, VOCAB_SIZE), {}),
        ((0,), {"stop_token_ids": (VOCAB_SIZE + 3,)}),
        ((0,), {"logit_bias": {VOCAB_SIZE: 1.0}}),
    ],
)
def test_token_ids_outside_the_vocabulary_raise_and_add_nothing(
    prompt: tuple[int, ...], params: dict[str, Any]
) -> None:
    sampler = Sampler(VOCAB_SIZE, CPU)
    with pytest.raises(InvalidTokenIdError, match="outside the vocabulary") as error:
        add(sampler, "r", prompt=prompt, **params)
    assert isinstance(error.value, ValueError)
    assert len(sampler) == 0


def test_empty_call_returns_nothing() -> None:
    sampler = Sampler(VOCAB_SIZE, CPU)
    assert sampler.sample(torch.zeros(0, VOCAB_SIZE), []).token_ids == []


def test_greedy_argmax_is_torchs_argmax():
    """The C++ argmax gives torch's indices: ties (across vectors and within one) to the first,
    NaN as the largest, rows of -inf, every row count, rows shorter than a vector and not a
    whole number of them, a strided view."""
    from engine.sampler import greedy_argmax

    torch.manual_seed(0)
    vocab = 8 * 1024
    logits = torch.randn(12, vocab)
    logits[1, [5, 3000, 7000]] = 50.0  # a tie across chunks
    logits[2, [2050, 2051]] = 50.0  # a tie inside one
    logits[3, [4000, 100]] = float("nan")
    logits[4] = float("-inf")
    logits[5, 6000] = float("inf")
    logits[6, vocab - 1] = 99.0
    logits[7, [10, 20]] = float("nan")
    logits[7, 30] = float("inf")
    for rows in (logits, logits[:1], logits[5:9]):
        assert torch.equal(greedy_argmax(rows), rows.argmax(dim=-1))
    odd = torch.randn(3, vocab + 7)
    odd[1, vocab + 5] = 80.0  # in the scalar tail
    odd[2, [vocab + 6, 17]] = float("nan")
    for rows in (odd, odd[:, :9], odd[:, 3:], torch.full((2, 5), float("-inf"))):
        assert torch.equal(greedy_argmax(rows), rows.argmax(dim=-1))
