"""SamplingParams: normalisation of JSON-ish input and validation naming the field."""

import dataclasses
import math

import pytest

from scheduler import SamplingParams
from scheduler.sampling_params import MAX_LOGIT_BIAS, MAX_STOP_TOKEN_IDS


def test_defaults_are_valid_and_random_sampling():
    params = SamplingParams()
    assert params.n == 1 and params.max_tokens == 16 and params.temperature == 1.0
    assert not params.greedy and not params.has_penalties
    assert params.logprobs is None and params.stop == () and params.logit_bias == {}


def test_input_is_normalised():
    params = SamplingParams(
        stop="###", stop_token_ids=[3, 4], top_k=-1, logit_bias={"5": 1}, temperature=0.0
    )
    assert params.stop == ("###",)
    assert params.stop_token_ids == (3, 4)
    assert params.top_k == 0
    assert params.logit_bias == {5: 1.0}
    assert params.greedy
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")


def test_params_are_frozen():
    params = SamplingParams()
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.temperature = 0.5  # type: ignore[misc]


def test_penalties_are_detected():
    assert SamplingParams(presence_penalty=0.5).has_penalties
    assert SamplingParams(frequency_penalty=-0.5).has_penalties
    assert SamplingParams(repetition_penalty=1.2).has_penalties


def test_edge_values_are_accepted():
    SamplingParams(top_p=1.0, min_p=1.0, top_k=1, logprobs=0, min_tokens=16, max_tokens=16)
    SamplingParams(logprobs=20, presence_penalty=2.0, frequency_penalty=-2.0)
    SamplingParams(repetition_penalty=2.0, logit_bias={0: -100, 1: 100}, seed=-3)


@pytest.mark.parametrize(
    "field, value",
    [
        ("n", 0),
        ("max_tokens", 0),
        ("max_tokens", 1.5),
        ("temperature", -0.1),
        ("temperature", math.inf),
        ("temperature", math.nan),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("top_p", math.nan),
        ("top_k", -2),
        ("min_p", -0.1),
        ("min_p", 1.5),
        ("seed", 1.5),
        ("min_tokens", -1),
        ("min_tokens", 17),  # > max_tokens (16)
        ("presence_penalty", 2.5),
        ("frequency_penalty", -2.5),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", 2.5),
        ("repetition_penalty", math.nan),
        ("logprobs", -1),
        ("logprobs", 21),
        ("logprobs", 2.5),
        ("stop", ("ok", "")),
        ("stop_token_ids", (1, -1)),
        ("logit_bias", {-1: 1.0}),
        ("logit_bias", {1: 101.0}),
        ("logit_bias", {1: math.nan}),
    ],
)
def test_invalid_values_raise_value_error_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"^{field} "):
        SamplingParams(**{field: value})


def test_stop_token_ids_and_logit_bias_are_capped_with_the_size_in_the_message():
    at_most = tuple(range(MAX_STOP_TOKEN_IDS))
    SamplingParams(stop_token_ids=at_most, logit_bias=dict.fromkeys(range(MAX_LOGIT_BIAS), 1.0))
    over = MAX_STOP_TOKEN_IDS + 1
    with pytest.raises(
        ValueError, match=f"^stop_token_ids .* {MAX_STOP_TOKEN_IDS} .*, got {over}$"
    ):
        SamplingParams(stop_token_ids=tuple(range(over)))
    with pytest.raises(ValueError, match=f"^logit_bias .* {MAX_LOGIT_BIAS} .*, got 5000$"):
        SamplingParams(logit_bias=dict.fromkeys(range(5000), 1.0))
