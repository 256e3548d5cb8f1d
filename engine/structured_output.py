"""Structured outputs: grammars (llguidance) that constrain what a request may generate.

    StructuredOutput (kind, spec) --compile_grammar--> llguidance grammar text (cached)
    grammar + GrammarTokenizer (built once per engine) --> one matcher per request

Each step, for the sampling rows whose request has a matcher: ``start(request_ids)`` fills their
allowed-token bitmasks on llguidance's own thread while the forward pass runs; ``finish()`` waits
for them; the sampler adds them to those rows' logits as one batched operation (``apply_bitmask``)
and, once the step's tokens are known, each matcher consumes its row's token (``accept``). Rows
without a matcher cost nothing. A matcher lives from the request's first scheduling to its end
(preemption keeps it: the recomputed tokens are not sampled again).

A grammar that cannot go on (the matcher errs, or no token is allowed) is a dead end: the request
ends with ``grammar_error`` and the matcher's message, never a stall.
"""

from __future__ import annotations

import functools
import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import llguidance
import llguidance.hf
import torch
from llguidance import LLMatcher

from scheduler.sampling_params import StructuredOutput

# JSON is generated as json.dumps writes it (", " and ": ", no other whitespace): a model cannot
# run on in whitespace, and every output is one canonical text.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# Error messages name the failing part of the grammar, not the parser's internal state.
_LIMITS = llguidance.LLParserLimits(verbose_errors=False)
# Distinct grammars kept compiled (a grammar is a few kB of text).
_GRAMMAR_CACHE_SIZE = 512


class GrammarError(ValueError):
    """A structured output the engine cannot compile or run; the message says which part."""


class GrammarTokenizer:
    """The tokenizer as llguidance sees it, built from a fast transformers tokenizer on the first
    structured output (``llg``), and the bitmask layout: ``num_words = ceil(vocab_size / 32)``
    int32 words per row, token ``t`` allowed when bit ``t % 32`` of word ``t // 32`` is set."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self.vocab_size = vocab_size
        self.num_words = -(-vocab_size // 32)
        self._tokenizer = tokenizer
        self._eos_token_ids = list(eos_token_ids)
        self._llg: llguidance.LLTokenizer | None = None
        self._llg_lock = threading.Lock()

        self._checked: OrderedDict[StructuredOutput, None] = OrderedDict()
        self._checked_lock = threading.Lock()

    @property
    def llg(self) -> llguidance.LLTokenizer:
        """llguidance's tokenizer, built once, on first use: for the default model's 49k
        vocabulary it takes ~0.4 s and holds ~32 MiB, which a server that never gets a
        structured output (or a tool call) does not pay. Thread-safe."""
        if self._llg is None:
            with self._llg_lock:
                if self._llg is None:
                    self._llg = llguidance.hf.from_tokenizer(
                        self._tokenizer,
                        n_vocab=self.vocab_size,
                        eos_token=self._eos_token_ids or None,
                    )
        return self._llg

    def matcher(self, structured: StructuredOutput) -> LLMatcher:
        """A fresh matcher at the grammar's start; GrammarError when the grammar is invalid or
        unsatisfiable (found when the matcher is built: about 2 ms for a typical schema)."""
        matcher = LLMatcher(self.llg, compile_grammar(structured), log_level=0, limits=_LIMITS)
        if matcher.is_error():
            raise GrammarError(_describe(structured, matcher.get_error()))
        return matcher

    def check(self, structured: StructuredOutput) -> None:
        """Raises GrammarError unless a matcher of this grammar can run; remembers the last
        _GRAMMAR_CACHE_SIZE grammars that passed. Thread-safe (the server checks on its own
        threads, the engine again when the request is added)."""
        with self._checked_lock:
            if structured in self._checked:
                self._checked.move_to_end(structured)
                return
        self.matcher(structured)
        with self._checked_lock:
            self._checked[structured] = None
            if len(self._checked) > _GRAMMAR_CACHE_SIZE:
                self._checked.popitem(last=False)


def _describe(structured: StructuredOutput, error: str) -> str:
    what = {"json_schema": "JSON schema", "regex": "regex", "choice": "choice",
            "grammar": "grammar"}[structured.kind]  # fmt: skip
    return f"the {what} is not supported: {error.strip()}"


@functools.lru_cache(maxsize=_GRAMMAR_CACHE_SIZE)
def compile_grammar(structured: StructuredOutput) -> str:
    """The llguidance grammar of a structured output. Raises GrammarError naming the problem (a
    keyword the engine does not implement, an invalid regex, a schema that is not JSON)."""
    kind, spec = structured.kind, structured.spec
    try:
        if kind == "json_schema":
            grammar = LLMatcher.grammar_from_json_schema(spec, defaults=JSON_OPTIONS)
        elif kind == "regex":
            grammar = LLMatcher.grammar_from_regex(spec)
        elif kind == "choice":
            grammar = LLMatcher.grammar_from_lark(_choice_lark(json.loads(spec)))
        else:
            grammar = llguidance.grammar_from("grammar", spec)
    except (ValueError, TypeError) as error:
        raise GrammarError(_describe(structured, str(error))) from None
    message = LLMatcher.validate_grammar(grammar, None, limits=_LIMITS)
    if message:
        raise GrammarError(_describe(structured, message))
    return grammar


def _choice_lark(choices: Any) -> str:
    """``["yes", "no"]`` -> ``start: "yes" | "no"`` (each a JSON string, which Lark reads)."""
    if not isinstance(choices, list) or not choices:
        raise ValueError("choice must be a non-empty list of strings")
    if not all(isinstance(choice, str) and choice for choice in choices):
        raise ValueError("choice must hold non-empty strings only")
    return "start: " + " | ".join(json.dumps(choice) for choice in dict.fromkeys(choices))


# One byte of a bitmask -> what its 8 tokens add to their logits: 0 (allowed) or -inf.
_BYTE_TO_BIAS = torch.where(
    ((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1).bool(), 0.0, float("-inf")
)  # [256, 8] float32


def apply_bitmask(logits: torch.Tensor, rows: torch.Tensor | slice, bitmask: torch.Tensor) -> None:
    """In place: -inf on ``logits[rows]`` for every token the rows' bitmasks leave out.

    logits [num_rows, vocab_size] float32; bitmask [len(rows), num_words] int32 on the CPU. The
    bitmask's bytes index a [256, 8] table of 0 / -inf (little-endian: byte b of word w holds
    tokens 32w + 8b .. 32w + 8b + 7), so the whole mask is one lookup and one add.
    """
    vocab_size = logits.shape[1]
    table = _BYTE_TO_BIAS.to(logits.device)
    byte_ids = bitmask.view(torch.uint8).to(device=logits.device, dtype=torch.int32)
    bias = table[byte_ids].view(bitmask.shape[0], -1)[:, :vocab_size]  # [rows, vocab_size]
    logits[rows] += bias


@dataclass
class StepMasks:
    """The bitmasks of one step: ``rows`` index the step's sampling rows that have a matcher,
    ``bitmask[i]`` is the mask of ``rows[i]``; ``dead_ends`` maps a row to why its grammar
    cannot go on (its mask is left to allow everything)."""

    rows: list[int]
    bitmask: torch.Tensor  # [len(rows), num_words] int32, CPU
    dead_ends: dict[int, str]


class Matchers:
    """The matchers of the requests that have a structured output, by request id. Used by the
    engine's thread only; the bitmask fill runs on llguidance's thread pool meanwhile."""

    def __init__(self, tokenizer: GrammarTokenizer) -> None:
        self.tokenizer = tokenizer
        self._matchers: dict[str, LLMatcher] = {}
        self._executor = llguidance.LLExecutor()
        # One thread hands the fill to llguidance (which releases the GIL while it works), so
        # the engine's thread goes on to run the forward pass.
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="splitfuse-masks")
        self._pending: tuple[list[str], Future[torch.Tensor]] | None = None

    def __len__(self) -> int:
        return len(self._matchers)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._matchers

    def add(self, request_id: str, structured: StructuredOutput) -> None:
        """Raises GrammarError (adding nothing) when the grammar cannot run."""
        self._matchers[request_id] = self.tokenizer.matcher(structured)

    def remove(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def start(self, request_ids: Sequence[str]) -> None:
        """Starts filling the masks of the rows (of ``request_ids``, the step's sampling rows)
        that have a matcher; ``finish`` returns them."""
        self._drain()
        rows, ids = self._rows(request_ids)
        if not rows:
            return
        matchers = [(self._matchers[request_id], j) for j, request_id in enumerate(ids)]
        bitmask = torch.empty(len(rows), self.tokenizer.num_words, dtype=torch.int32)
        self._pending = (ids, self._pool.submit(self._fill, matchers, bitmask))

    def _rows(self, request_ids: Sequence[str]) -> tuple[list[int], list[str]]:
        rows = [i for i, request_id in enumerate(request_ids) if request_id in self._matchers]
        return rows, [request_ids[i] for i in rows]

    def _fill(self, matchers: list[tuple[LLMatcher, int]], bitmask: torch.Tensor) -> torch.Tensor:
        self._executor.unsafe_compute_mask_ptr(
            matchers, bitmask.data_ptr(), bitmask.shape[1] * 4, bitmask.shape[0]
        )
        return bitmask

    def finish(self, request_ids: Sequence[str]) -> StepMasks | None:
        """The masks ``start`` began for these rows (filled now when it was not called for
        them); None when no row has a matcher."""
        rows, ids = self._rows(request_ids)
        if self._pending is None or self._pending[0] != ids:
            self.start(request_ids)
        if self._pending is None:
            return None
        future = self._pending[1]
        self._pending = None
        bitmask = future.result()
        dead_ends = {}
        allows_any = bitmask.ne(0).any(dim=1).tolist()
        for j, (row, request_id) in enumerate(zip(rows, ids, strict=True)):
            matcher = self._matchers[request_id]
            if matcher.is_error() or not allows_any[j]:
                dead_ends[row] = _dead_end_message(matcher)
                bitmask[j] = -1
        return StepMasks(rows=rows, bitmask=bitmask, dead_ends=dead_ends)

    def accept(self, request_id: str, token_id: int) -> str | None:
        """The matcher of ``request_id`` (if any) consumes its sampled token; returns why the
        grammar cannot go on when it fails, else None."""
        matcher = self._matchers.get(request_id)
        if matcher is None or matcher.consume_token(token_id):
            return None
        return _dead_end_message(matcher)

    def _drain(self) -> None:
        """Waits for a fill a failed step left behind (its masks are of no use now)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending[1].exception()

    def close(self) -> None:
        self._drain()
        self._pool.shutdown(wait=True)
        self._matchers.clear()


def _dead_end_message(matcher: LLMatcher) -> str:
    error = matcher.get_error().strip()
    reason = error or "no token can continue the output"
    return f"the structured output reached a dead end: {reason}"
