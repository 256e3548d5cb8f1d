"""Incremental detokenization and stop strings for one generated sequence, shared by the server
and the offline ``LLM.generate``.

Byte-level tokenizers split multi-byte UTF-8 characters across tokens: decoding one token alone
gives U+FFFD. The detokenizer decodes a short window of recent tokens and holds text back until
the window decodes cleanly, so every emitted piece is final and the pieces concatenate to
``tokenizer.decode(all_ids)``:

    ids    [.., 'Ġæ', 'Ĺ', '¥', ..]   ('日' is three bytes over three tokens)
    text   ''  ''  ' 日'             (nothing until the character is complete)

Stop strings are matched over the emitted text, across token boundaries: text that could begin a
stop string is held back until it cannot, and the match itself is never emitted. Both cost a
bounded amount per token, however long the sequence or the held-back text.
"""

from __future__ import annotations

from typing import Any

# Tokens of context decoded before the new ones, so that tokenizers that drop a leading space
# (sentencepiece) or merge across tokens produce the same text as a full decode.
_CONTEXT_TOKENS = 5
# Tokens held back while the window ends in U+FFFD before the text is emitted anyway. A UTF-8
# character is at most 4 bytes, so valid text completes long before; only bytes that never form
# a character (or skipped special tokens) reach it, and they would otherwise grow the window, and
# the cost of every later token, without bound. Text emitted this way may differ from a full
# decode in its replacement characters.
_MAX_HELD_TOKENS = 16
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
        # _token_ids[_prefix_offset:_read_offset] is context already emitted,
        # _token_ids[_read_offset:] is held back.
        self._prefix_offset = 0
        self._read_offset = len(self._token_ids)

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special)

    def add(self, new_token_ids: list[int]) -> str:
        """The new final text (possibly empty while a character is incomplete)."""
        self._token_ids.extend(new_token_ids)
        end = len(self._token_ids)
        prefix = self._decode(self._token_ids[self._prefix_offset : self._read_offset])
        text = self._decode(self._token_ids[self._prefix_offset :])
        if len(text) > len(prefix) and not text.endswith(_REPLACEMENT):
            return self._emit(end, text[len(prefix) :])
        if end - self._read_offset <= _MAX_HELD_TOKENS:
            return ""
        # Too many tokens held: emit up to the last clean boundary among the last few tokens (the
        # bytes of one incomplete character), else everything, replacement characters included.
        for clean_end in range(end - 1, max(self._read_offset, end - 4), -1):
            clean = self._decode(self._token_ids[self._prefix_offset : clean_end])
            if len(clean) > len(prefix) and not clean.endswith(_REPLACEMENT):
                return self._emit(clean_end, clean[len(prefix) :])
        return self._emit(end, text[len(prefix) :])

    def _emit(self, end: int, new_text: str) -> str:
        """Moves the read offset to ``end``, whose text is ``new_text``; keeps a short window:
        the context for the next call is the tokens just emitted."""
        self._prefix_offset = max(self._read_offset, end - _CONTEXT_TOKENS)
        self._read_offset = end
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


class StopStrings:
    """The stop strings of one request, compiled once into an Aho-Corasick automaton and shared
    by the matchers of its sequences.

    Node 0 of the trie of the stop strings is the root; for each node: its edges (``goto``), its
    failure link (the node of its longest proper suffix that is also in the trie), its depth, and
    the indices of the stop strings that end at it or at a node on its failure chain (``ends``).
    With stops ('abc', 'bd'): nodes a, ab, abc, b, bd; ab fails to b, abc and bd to the root.
    """

    def __init__(self, stop: tuple[str, ...] | list[str]) -> None:
        self.strings = tuple(stop)
        self.max_len = max(map(len, self.strings), default=0)
        goto: list[dict[str, int]] = [{}]
        depth = [0]
        ends: list[tuple[int, ...]] = [()]
        for index, string in enumerate(self.strings):
            node = 0
            for char in string:
                child = goto[node].get(char)
                if child is None:
                    child = goto[node][char] = len(goto)
                    goto.append({})
                    depth.append(depth[node] + 1)
                    ends.append(())
                node = child
            ends[node] += (index,)
        fail = [0] * len(goto)
        # Breadth first: a failure link points to a shallower node, whose own link is set.
        queue = list(goto[0].values())
        for node in queue:
            for char, child in goto[node].items():
                fallback = fail[node]
                while fallback and char not in goto[fallback]:
                    fallback = fail[fallback]
                fail[child] = target = goto[fallback].get(char, 0)
                if ends[target]:
                    ends[child] += ends[target]
                queue.append(child)
        self.goto, self.fail, self.depth, self.ends = goto, fail, depth, ends


class StopStringMatcher:
    """Holds back text that may begin a stop string; reports the earliest match.

    The automaton's state after the text so far is the longest end of that text that begins some
    stop string, so only the new text of each delta is scanned, and exactly the state's depth (at
    most the longest stop string - 1 characters) is held back. With stops ('abc', 'bd'):

        add('xab') -> 'x'    ('ab' may begin 'abc')
        add('d')   -> 'a'    ('bd' matched; it and what follows are never emitted)

    When several stop strings are complete in the text seen so far, the one that starts first
    wins (on a tie, the first listed).
    """

    def __init__(self, stops: StopStrings) -> None:
        self._stops = stops
        self._state = 0
        self._pending = ""  # the held-back text: the last depth[_state] characters
        self.stopped = False
        self.matched: str | None = None

    def add(self, text: str) -> str:
        """Text safe to emit now; after a match, the text before it and ``stopped`` is set."""
        if self.stopped:
            return ""
        stops = self._stops
        if not stops.strings:
            return text
        goto, fail, ends = stops.goto, stops.fail, stops.ends
        pending = self._pending + text
        state = self._state
        earliest: tuple[int, int] | None = None  # (start in pending, stop index)
        for position in range(len(self._pending), len(pending)):
            # A match that starts no later than the earliest one ends by now.
            if earliest is not None and position >= earliest[0] + stops.max_len:
                break
            char = pending[position]
            while state and char not in goto[state]:
                state = fail[state]
            state = goto[state].get(char, 0)
            for index in ends[state]:
                match = (position + 1 - len(stops.strings[index]), index)
                if earliest is None or match < earliest:
                    earliest = match
        if earliest is not None:
            self.stopped = True
            self.matched = stops.strings[earliest[1]]
            self._pending = ""
            return pending[: earliest[0]]
        self._state = state
        cut = len(pending) - stops.depth[state]
        out, self._pending = pending[:cut], pending[cut:]
        return out

    def flush(self) -> str:
        """At the end without a match: the held-back text."""
        out, self._pending = ("" if self.stopped else self._pending), ""
        self._state = 0
        return out


class SequenceText:
    """One generated sequence: token deltas in, emitted text pieces out."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], stops: StopStrings) -> None:
        self._detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids)
        self._stops = StopStringMatcher(stops)
        self._pieces: list[str] = []

    @property
    def stopped(self) -> bool:
        """True once a stop string matched: the caller aborts the engine request."""
        return self._stops.stopped

    @property
    def text(self) -> str:
        """All the text emitted so far."""
        return "".join(self._pieces)

    def add(self, new_token_ids: list[int], finished: bool) -> str:
        piece = self._stops.add(self._detokenizer.add(new_token_ids))
        if finished and not self._stops.stopped:
            piece += self._stops.add(self._detokenizer.flush())
            piece += self._stops.flush()
        self._pieces.append(piece)
        return piece
