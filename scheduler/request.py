"""The mutable per-request state owned by the scheduler.

Progress is counters, not phases: ``num_computed_tokens`` catches up with ``num_tokens``.
A request whose ``num_computed_tokens < num_prompt_tokens`` is still in its prompt; one with
``num_computed_tokens == num_tokens - 1`` is caught up and decodes one token per step.
"""

from __future__ import annotations

import enum
import time

from scheduler.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"
    # The request's structured output reached a state its grammar cannot leave (a dead end).
    FINISHED_GRAMMAR_ERROR = "grammar_error"

    @property
    def finished(self) -> bool:
        return self not in (RequestStatus.WAITING, RequestStatus.RUNNING)


class Request:
    """One sequence. ``token_ids`` is the prompt followed by the generated tokens."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: tuple[int, ...] = (),
        arrival_time: float | None = None,
        group_id: str | None = None,
        priority: int = 0,
        tenant: str = "",
        streamed: bool = False,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError("prompt_token_ids must not be empty")
        if type(priority) is not int:
            raise ValueError(f"priority must be an integer, got {priority!r}")
        self.request_id = request_id
        self.sampling_params = sampling_params
        self.eos_token_ids = tuple(eos_token_ids)
        # The tokens that end the request once min_tokens outputs precede them: stop_token_ids,
        # and the EOS ids unless ignore_eos. A set, as it is checked on every sampled token.
        self.stop_ids: frozenset[int] = frozenset(sampling_params.stop_token_ids).union(
            () if sampling_params.ignore_eos else self.eos_token_ids
        )
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        # Requests of one group (the n sequences of one API call) share a prompt: the scheduler
        # admits the siblings once the first has cached the prompt's full blocks.
        self.group_id = group_id
        # Lower runs first under the scheduler's ``priority`` policy (0 by default, as in vLLM).
        self.priority = priority
        # Who asked for it: fair sharing splits each step's prompt tokens between tenants.
        self.tenant = tenant
        # Its tokens leave as they are sampled (a stream): its batches run one decode step at a
        # time, so that each token leaves one step after the previous.
        self.streamed = streamed
        self.num_prompt_tokens = len(prompt_token_ids)
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        # Tokens of the prompt found in the prefix cache at first admission (for usage reporting).
        self.num_cached_tokens = 0
        self.num_preemptions = 0
        # Of those, preemptions in favour of a waiting request of higher priority.
        self.num_priority_preemptions = 0
        self.status = RequestStatus.WAITING
        # The token that ended the request (an EOS or a stop_token_id), if any.
        self.stop_token_id: int | None = None
        # Monotonic time of the first scheduling and of the first sampled token (metrics).
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"tokens={self.num_tokens}, computed={self.num_computed_tokens})"
        )
