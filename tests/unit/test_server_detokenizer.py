"""Incremental detokenization (UTF-8 split across tokens) and stop strings across tokens."""

from __future__ import annotations

import random

import pytest

from engine.detokenizer import (
    IncrementalDetokenizer,
    SequenceText,
    StopStringMatcher,
    StopStrings,
)


@pytest.fixture(scope="module")
def tokenizer():  # noqa: ANN201
    from tests.tiny_model import make_tokenizer

    return make_tokenizer()


TEXT = "héllo 日本語 🎉 world, the capital of France is Paris. ñandú Ω≈ç√∫"


def _feed(detokenizer: IncrementalDetokenizer, ids: list[int], rng: random.Random) -> list[str]:
    pieces = []
    i = 0
    while i < len(ids):
        k = rng.randint(1, 3)
        pieces.append(detokenizer.add(ids[i : i + k]))
        i += k
    pieces.append(detokenizer.flush())
    return pieces


def test_multibyte_characters_split_across_tokens(tokenizer) -> None:  # noqa: ANN001
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    # The tiny tokenizer's corpus is ASCII: '日' takes several tokens.
    assert len(tokenizer.encode("日", add_special_tokens=False)) > 1
    pieces = _feed(IncrementalDetokenizer(tokenizer, [5, 6]), ids, random.Random(0))
    assert "".join(pieces) == TEXT
    assert all("\ufffd" not in piece for piece in pieces)


def test_one_token_at_a_time_never_emits_partial_characters(tokenizer) -> None:  # noqa: ANN001
    ids = tokenizer.encode("🎉🎉 日本", add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tokenizer, [7])
    pieces = [detokenizer.add([token_id]) for token_id in ids]
    assert "".join(pieces) == "🎉🎉 日本"
    assert all("\ufffd" not in piece for piece in pieces)
    assert pieces.count("") >= 3  # held back while a character was incomplete


def test_random_ids_match_a_full_decode(tokenizer) -> None:  # noqa: ANN001
    rng = random.Random(1)
    for _ in range(100):
        ids = [rng.randrange(3, len(tokenizer)) for _ in range(rng.randrange(1, 80))]
        pieces = _feed(IncrementalDetokenizer(tokenizer, [9, 10, 11]), ids, rng)
        assert "".join(pieces) == tokenizer.decode(ids)


def test_special_tokens_are_skipped(tokenizer) -> None:  # noqa: ANN001
    ids = tokenizer.encode("Paris", add_special_tokens=False) + [tokenizer.eos_token_id]
    detokenizer = IncrementalDetokenizer(tokenizer, [1])
    assert detokenizer.add(ids) + detokenizer.flush() == "Paris"


def test_stop_string_across_pieces_is_never_emitted() -> None:
    matcher = StopStringMatcher(StopStrings(["STOP"]))
    out = [matcher.add(piece) for piece in ["abc S", "T", "O", "Pxyz"]]
    assert "".join(out) == "abc "
    assert matcher.stopped and matcher.matched == "STOP"
    assert matcher.add("more") == ""


def test_stop_earliest_match_wins_and_partial_prefix_is_released() -> None:
    matcher = StopStringMatcher(StopStrings(["world", "lo w"]))
    assert matcher.add("hel") == "he"  # 'l' may begin 'lo w'
    assert matcher.add("lo world") == "l"
    assert matcher.matched == "lo w"
    released = StopStringMatcher(StopStrings(["xyz"]))
    assert released.add("abcx") == "abc"
    assert released.add("xy") == "x"
    assert released.add("a") == "xya"
    assert released.add("xy") == ""
    assert released.flush() == "xy"


def test_sequence_text_with_stop_across_tokens(tokenizer) -> None:  # noqa: ANN001
    ids = tokenizer.encode("The capital of France is Paris.", add_special_tokens=False)
    sequence = SequenceText(tokenizer, [1], StopStrings(("ance is",)))
    pieces = []
    for token_id in ids:
        pieces.append(sequence.add([token_id], finished=False))
        if sequence.stopped:
            break
    assert sequence.stopped
    assert sequence.text == "The capital of Fr"
    assert "".join(pieces) == sequence.text


def test_sequence_text_flushes_at_the_end(tokenizer) -> None:  # noqa: ANN001
    ids = tokenizer.encode("abc 日", add_special_tokens=False)
    sequence = SequenceText(tokenizer, [1], StopStrings(("zzzz",)))
    for token_id in ids[:-1]:
        sequence.add([token_id], finished=False)
    sequence.add([ids[-1]], finished=True)
    assert sequence.text == "abc 日"
    assert not sequence.stopped


class _CountingTokenizer:
    """The tokenizer, recording how many tokens each ``decode`` call gets."""

    def __init__(self, tokenizer) -> None:  # noqa: ANN001
        self._tokenizer = tokenizer
        self.window_sizes: list[int] = []

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        self.window_sizes.append(len(token_ids))
        return self._tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)


def test_bytes_that_never_form_a_character_keep_the_window_bounded(tokenizer) -> None:  # noqa: ANN001
    # '©' alone: a UTF-8 continuation byte, U+FFFD however many follow.
    (continuation_id,) = tokenizer.encode("é", add_special_tokens=False)[1:]
    ids = [continuation_id] * 3000
    counting = _CountingTokenizer(tokenizer)
    detokenizer = IncrementalDetokenizer(counting, [5, 6])
    pieces = [detokenizer.add([token_id]) for token_id in ids]
    assert max(counting.window_sizes) <= 32
    assert sum(counting.window_sizes) <= 40 * len(ids)
    assert "".join(pieces) + detokenizer.flush() == tokenizer.decode(ids) == "\ufffd" * 3000
    assert sum(map(len, pieces)) > 2900  # emitted as it goes, not held to the end


def test_skipped_special_tokens_keep_the_window_bounded(tokenizer) -> None:  # noqa: ANN001
    ids = [tokenizer.eos_token_id] * 2000 + tokenizer.encode("Paris", add_special_tokens=False)
    counting = _CountingTokenizer(tokenizer)
    detokenizer = IncrementalDetokenizer(counting, [1])
    pieces = [detokenizer.add([token_id]) for token_id in ids]
    assert max(counting.window_sizes) <= 32
    assert "".join(pieces) + detokenizer.flush() == "Paris"


def test_a_long_run_of_split_characters_stays_exact_and_bounded(tokenizer) -> None:  # noqa: ANN001
    text = "日本語 🎉 héllo " * 100
    ids = tokenizer.encode(text, add_special_tokens=False)
    continuation_id = tokenizer.encode("é", add_special_tokens=False)[1]
    counting = _CountingTokenizer(tokenizer)
    detokenizer = IncrementalDetokenizer(counting, [5])
    pieces = [detokenizer.add([token_id]) for token_id in ids]
    assert "".join(pieces) + detokenizer.flush() == text
    assert all("\ufffd" not in piece for piece in pieces)
    assert max(counting.window_sizes) <= 32
    # Invalid bytes first, then text: the bytes come out as U+FFFD, the text unchanged.
    ids = [continuation_id] * 50 + ids
    pieces = _feed(IncrementalDetokenizer(tokenizer, [5]), ids, random.Random(2))
    assert "".join(pieces) == tokenizer.decode(ids) == "\ufffd" * 50 + text
