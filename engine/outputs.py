"""What the engine hands back after each step: one delta per request that progressed."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TokenLogprob:
    """The sampled token's log-probability and the ``top`` most likely alternatives
    (``(token_id, logprob)`` pairs, most likely first; empty when none were asked for)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class RequestOutput:
    """A delta: tokens generated for ``request_id`` since the previous output.

    ``finish_reason`` is None while the request runs, then one of "stop", "length", "abort",
    "error" (``error`` then says what failed). Logprobs, when the request asked for them, are
    aligned with ``new_token_ids``. ``queue_seconds`` is the time from the request's arrival to its
    first scheduling (None until it was scheduled).
    """

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    stop_token_id: int | None = None
    error: str | None = None
    queue_seconds: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
