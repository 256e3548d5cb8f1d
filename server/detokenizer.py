"""Incremental detokenization and stop strings for one generated sequence.

Byte-level tokenizers split multi-byte UTF-8 characters across tokens: decoding one token alone
gives U+FFFD. The detokenizer decodes a short window of recent tokens and holds text back until
the window decodes cleanly, so every emitted piece is final and the pieces concatenate to
``tokenizer.decode(all_ids)``:

    ids    [.., 'Ġæ', 'Ĺ', '¥', ..]   ('日' is three bytes over three tokens)
    text   ''  ''  ' 日'             (nothing until the character is complete)

Stop strings are matched over the emitted text, across token boundaries: text that could begin a
stop string is held back until it cannot, and the match itself is never emitted.
"""

from __future__ import annotations

from typing import Any

# Tokens of context decoded before the new ones, so that tokenizers that drop a leading space
# (sentencepiece) or merge across tokens produce the same text as a full decode.
_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns token ids into final text pieces, one ``add`` per engine delta."""

    def __init__(
        self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        # The prompt's last tokens seed the context (without being emitted).
        self._token_ids: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._token_ids)

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special)

    def add(self, new_token_ids: list[int]) -> str:
        """The new final text (possibly empty while a character is incomplete)."""
        self._token_ids.extend(new_token_ids)
        prefix = self._decode(self._token_ids[self._prefix_offset : self._read_offset])
        text = self._decode(self._token_ids[self._prefix_offset :])
        if len(text) <= len(prefix) or text.endswith(_REPLACEMENT):
            return ""
        new_text = text[len(prefix) :]
        # Keep a short window: the context for the next call is the tokens just emitted.
        self._prefix_offset = max(self._read_offset, len(self._token_ids) - _CONTEXT_TOKENS)
        self._read_offset = len(self._token_ids)
        if self._prefix_offset > 4 * _CONTEXT_TOKENS:
            drop = self._prefix_offset
            del self._token_ids[:drop]
            self._prefix_offset -= drop
            self._read_offset -= drop
        return new_text

    def flush(self) -> str:
        """At the end of the sequence: whatever is held back, replacement characters included."""
        prefix = self._decode(self._token_ids[self._prefix_offset : self._read_offset])
        text = self._decode(self._token_ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self._token_ids)
        return text[len(prefix) :] if len(text) > len(prefix) else ""


class StopStringMatcher:
    """Holds back text that may begin a stop string; reports the first match."""

    def __init__(self, stop: tuple[str, ...] | list[str]) -> None:
        self._stop = tuple(stop)
        self._pending = ""
        self.stopped = False
        self.matched: str | None = None

    def add(self, text: str) -> str:
        """Text safe to emit now; after a match, the text before it and ``stopped`` is set."""
        if self.stopped:
            return ""
        if not self._stop:
            return text
        self._pending += text
        earliest: tuple[int, str] | None = None
        for stop in self._stop:
            index = self._pending.find(stop)
            if index >= 0 and (earliest is None or index < earliest[0]):
                earliest = (index, stop)
        if earliest is not None:
            self.stopped = True
            self.matched = earliest[1]
            out = self._pending[: earliest[0]]
            self._pending = ""
            return out
        cut = len(self._pending) - self._partial_match_len()
        out, self._pending = self._pending[:cut], self._pending[cut:]
        return out

    def _partial_match_len(self) -> int:
        """The longest end of the pending text that begins some stop string ('ab' for 'xyzab'
        and stop 'abc'): only that much must wait for more text."""
        longest = 0
        for stop in self._stop:
            for size in range(min(len(stop) - 1, len(self._pending)), longest, -1):
                if self._pending.endswith(stop[:size]):
                    longest = size
                    break
        return longest

    def flush(self) -> str:
        """At the end without a match: the held-back text."""
        out, self._pending = ("" if self.stopped else self._pending), ""
        return out


class SequenceText:
    """One generated sequence: token deltas in, emitted text pieces out."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], stop: tuple[str, ...]) -> None:
        self._detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids)
        self._stops = StopStringMatcher(stop)
        self.text = ""

    @property
    def stopped(self) -> bool:
        """True once a stop string matched: the caller aborts the engine request."""
        return self._stops.stopped

    def add(self, new_token_ids: list[int], finished: bool) -> str:
        piece = self._stops.add(self._detokenizer.add(new_token_ids))
        if finished and not self._stops.stopped:
            piece += self._stops.add(self._detokenizer.flush())
            piece += self._stops.flush()
        self.text += piece
        return piece
