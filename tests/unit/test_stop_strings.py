"""Stop strings: the streaming matcher against a simple reference and its hold-back bound; the
limits the API puts on stop strings and on logit_bias keys."""

from __future__ import annotations

import random

import pytest
from pydantic import ValidationError

from engine.detokenizer import StopStringMatcher, StopStrings
from server.protocol import MAX_STOP_STRING_CHARS, CompletionRequest


class ReferenceMatcher:
    """Stop strings the obvious way: after each delta, search all the text so far for every stop
    string; emit up to the earliest match, or up to the longest end that begins a stop string."""

    def __init__(self, stop: list[str]) -> None:
        self.stop = stop
        self.text = ""
        self.num_emitted = 0
        self.stopped = False
        self.matched: str | None = None

    def add(self, delta: str) -> str:
        if self.stopped:
            return ""
        self.text += delta
        found = [(self.text.find(s), i) for i, s in enumerate(self.stop) if s in self.text]
        if found:
            start, index = min(found)
            self.stopped, self.matched = True, self.stop[index]
            return self.text[self.num_emitted : start]
        keep = max(
            (n for s in self.stop for n in range(1, len(s)) if self.text.endswith(s[:n])),
            default=0,
        )
        out = self.text[self.num_emitted : len(self.text) - keep]
        self.num_emitted = len(self.text) - keep
        return out

    def flush(self) -> str:
        return "" if self.stopped else self.text[self.num_emitted :]


def _run(matcher: StopStringMatcher | ReferenceMatcher, deltas: list[str]) -> list[str]:
    return [matcher.add(delta) for delta in deltas] + [matcher.flush()]


def test_earliest_start_wins_even_when_it_ends_later() -> None:
    # 'bc' is complete first, but 'abcd' starts earlier in the same delta.
    matcher = StopStringMatcher(StopStrings(["bc", "abcd"]))
    assert matcher.add("xxabcdyy") == "xx"
    assert matcher.matched == "abcd"
    # Across deltas, only the text seen so far counts: 'bc' completes before 'abcd' can.
    matcher = StopStringMatcher(StopStrings(["bc", "abcd"]))
    assert _run(matcher, ["xxab", "c", "d"]) == ["xx", "a", "", ""]
    assert matcher.matched == "bc"


def test_same_start_goes_to_the_first_listed() -> None:
    matcher = StopStringMatcher(StopStrings(["abc", "ab"]))
    assert matcher.add("zabcz") == "z"
    assert matcher.matched == "abc"


def test_stop_inside_a_longer_partial_match() -> None:
    # 'abcx' fails at 'y', but 'bcy' (which began inside it) matches.
    matcher = StopStringMatcher(StopStrings(["abcx", "bcy"]))
    assert _run(matcher, ["ab", "c", "y"]) == ["", "", "a", ""]
    assert matcher.matched == "bcy"


def test_no_stop_strings_pass_text_through() -> None:
    matcher = StopStringMatcher(StopStrings([]))
    assert matcher.add("anything") == "anything"
    assert matcher.flush() == ""


def test_held_back_text_is_at_most_the_longest_stop_string_minus_one() -> None:
    matcher = StopStringMatcher(StopStrings(["a" * 10 + "b", "xyz"]))
    emitted = ""
    for num_fed in range(1, 101):
        emitted += matcher.add("a")
        assert num_fed - len(emitted) == min(num_fed, 10)
    assert emitted + matcher.flush() == "a" * 100
    released = StopStringMatcher(StopStrings(["xyz"]))
    assert _run(released, ["abcx", "y", "a"]) == ["abc", "", "xya", ""]


@pytest.mark.parametrize("seed", range(4))
def test_random_cases_match_the_reference(seed: int) -> None:
    rng = random.Random(seed)
    alphabet = "ab日 "
    for _ in range(500):
        stops = [
            "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 5)))
            for _ in range(rng.randint(1, 4))
        ]
        deltas = [
            "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 4)))
            for _ in range(rng.randint(1, 12))
        ]
        reference, matcher = ReferenceMatcher(stops), StopStringMatcher(StopStrings(stops))
        expected = _run(reference, deltas)
        assert _run(matcher, deltas) == expected, (stops, deltas)
        assert (matcher.stopped, matcher.matched) == (reference.stopped, reference.matched)
        if not matcher.stopped:
            assert "".join(expected) == "".join(deltas)


def test_long_stop_strings_with_long_held_back_text() -> None:
    size = 8192
    stops = ["c" * size + "d"] * 15 + ["a" * size + "b"]
    matcher = StopStringMatcher(StopStrings(stops))
    assert matcher.add("a" * (size - 100)) == ""
    assert [matcher.add("a") for _ in range(101)] == [""] * 100 + ["a"]
    assert matcher.add("b") == ""
    assert matcher.matched == stops[-1]


def _completion(**fields: object) -> CompletionRequest:
    return CompletionRequest(prompt="x", **fields)


def test_stop_strings_longer_than_the_limit_are_refused() -> None:
    _completion(stop=["s" * MAX_STOP_STRING_CHARS])
    for stop in ("s" * (MAX_STOP_STRING_CHARS + 1), ["ok", "s" * (MAX_STOP_STRING_CHARS + 1)]):
        with pytest.raises(ValidationError) as error:
            _completion(stop=stop)
        assert error.value.errors()[0]["loc"][0] == "stop"
        assert str(MAX_STOP_STRING_CHARS) in str(error.value)


@pytest.mark.parametrize("key", ["0", "1", "42", "50256", "1" * 18])
def test_canonical_logit_bias_keys_are_accepted(key: str) -> None:
    request = _completion(logit_bias={key: 1.0})
    assert request.sampling_params(4, None, 10**19).logit_bias == {int(key): 1.0}


@pytest.mark.parametrize(
    "key",
    ["", "01", "00", " 1", "1 ", "+1", "-1", "1.0", "1e3", "²", "١", "０", "1" * 19, "9" * 5000],
)
def test_non_canonical_logit_bias_keys_are_refused(key: str) -> None:
    with pytest.raises(ValidationError) as error:
        _completion(logit_bias={key: 1.0})
    assert error.value.errors()[0]["loc"][0] == "logit_bias"


def test_keys_naming_one_token_id_twice_are_refused() -> None:
    with pytest.raises(ValidationError):
        _completion(logit_bias={"1": 1.0, "01": -1.0})
