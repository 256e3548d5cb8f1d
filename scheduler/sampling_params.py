"""Per-request sampling parameters, validated once at construction and frozen afterwards."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

MAX_LOGPROBS = 20
# Entries of logit_bias and of stop_token_ids one request may give: each is work on every step
# the request runs (a bias added to its logits, a stop id checked and masked).
MAX_LOGIT_BIAS = 300
MAX_STOP_TOKEN_IDS = 300

# What a structured output's ``spec`` holds, by ``kind``: JSON text of a JSON Schema (json_schema),
# a regular expression (regex), a JSON list of strings (choice), a Lark or GBNF grammar (grammar).
STRUCTURED_OUTPUT_KINDS = ("json_schema", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on a request's whole output: the text must match ``spec`` (see
    STRUCTURED_OUTPUT_KINDS), and the request ends on its end-of-sequence token once it does.
    The engine compiles it into a grammar (``engine/structured_output.py``)."""

    kind: str
    spec: str

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_OUTPUT_KINDS:
            raise ValueError(
                f"structured output kind must be one of {STRUCTURED_OUTPUT_KINDS}, "
                f"got {self.kind!r}"
            )
        if not isinstance(self.spec, str) or not self.spec:
            raise ValueError("structured output spec must be a non-empty string")


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples. Invalid values raise ``ValueError`` naming the field.

    ``temperature == 0`` means greedy. ``top_k == 0`` (or -1) disables top-k; ``top_p == 1`` and
    ``min_p == 0`` disable theirs. ``logprobs`` is the number of top alternatives returned per
    token (None: no logprobs; 0: only the sampled token's logprob).
    """

    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: int | None = None
    structured: StructuredOutput | None = None

    def __post_init__(self) -> None:
        # Lists from JSON become tuples so that the object stays immutable and hashable fields.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(
            self, "logit_bias", {int(k): float(v) for k, v in dict(self.logit_bias).items()}
        )
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        self._validate()

    def _validate(self) -> None:
        def fail(name: str, why: str) -> None:
            raise ValueError(f"{name} {why}, got {getattr(self, name)!r}")

        # Sizes first: the message gives the size, not the whole list.
        for name, size, limit in (
            ("stop_token_ids", len(self.stop_token_ids), MAX_STOP_TOKEN_IDS),
            ("logit_bias", len(self.logit_bias), MAX_LOGIT_BIAS),
        ):
            if size > limit:
                raise ValueError(f"{name} may hold at most {limit} token ids, got {size}")

        if not isinstance(self.n, int) or self.n < 1:
            fail("n", "must be an integer >= 1")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            fail("max_tokens", "must be an integer >= 1")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            fail("temperature", "must be a finite number >= 0")
        if not (0.0 < self.top_p <= 1.0):
            fail("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            fail("top_k", "must be 0 or -1 (disabled) or a positive integer")
        if not (0.0 <= self.min_p <= 1.0):
            fail("min_p", "must be in [0, 1]")
        if self.seed is not None and not isinstance(self.seed, int):
            fail("seed", "must be an integer")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            fail("min_tokens", "must be an integer >= 0")
        if self.min_tokens > self.max_tokens:
            fail("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        if not (-2.0 <= self.presence_penalty <= 2.0):
            fail("presence_penalty", "must be in [-2, 2]")
        if not (-2.0 <= self.frequency_penalty <= 2.0):
            fail("frequency_penalty", "must be in [-2, 2]")
        if not (0.0 < self.repetition_penalty <= 2.0) or not math.isfinite(self.repetition_penalty):
            fail("repetition_penalty", "must be in (0, 2]")
        if self.logprobs is not None and (
            not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            fail("logprobs", f"must be an integer in [0, {MAX_LOGPROBS}]")
        if self.structured is not None:
            # The grammar ends on EOS: it must stay allowed, and it must end the request.
            if self.min_tokens > 0:
                fail("min_tokens", "cannot be combined with a structured output")
            if self.ignore_eos:
                fail("ignore_eos", "cannot be combined with a structured output")
        if any(not s for s in self.stop):
            fail("stop", "must not contain empty strings")
        if any(t < 0 for t in self.stop_token_ids):
            fail("stop_token_ids", "must be non-negative token ids")
        for token_id, bias in self.logit_bias.items():
            if token_id < 0:
                fail("logit_bias", "keys must be non-negative token ids")
            if not (-100.0 <= bias <= 100.0):
                fail("logit_bias", "values must be in [-100, 100]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def plain_greedy(self) -> bool:
        """Greedy, with nothing that reads the logits but their argmax (no logit_bias,
        penalties, logprobs or structured output): its tokens may be taken several decode steps
        at a time (``min_tokens``, which masks stop tokens for a while, is the scheduler's to
        check)."""
        return (
            self.greedy
            and not self.logit_bias
            and not self.has_penalties
            and self.logprobs is None
            and self.structured is None
        )

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )
