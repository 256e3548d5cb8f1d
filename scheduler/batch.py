"""The per-step message from the scheduler to the engine. Immutable; the only thing that crosses."""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.sampling_params import SamplingParams


@dataclass(frozen=True)
class BatchRow:
    """One request's tokens in this step.

    ``token_ids`` are the request's tokens at positions ``start_pos .. start_pos + len - 1``; their
    K/V are written into the cache this step. The context attended to is every position up to and
    including each token, through ``block_table`` (physical block ids, logical order), which covers
    at least ``start_pos + len(token_ids)`` tokens. ``sample`` is true when the row's last token
    produces the request's next token (a decode, or the chunk that finishes the prompt).
    ``prompt_end``: the request's prompt length; its tokens at positions below it are prompt
    tokens, the others generated ones (0: every token generated). Where a CPU multiplies prompt
    tokens on AMX tiles, a token's kind decides how its products run (``build_model_input``).
    """

    request_id: str
    token_ids: tuple[int, ...]
    start_pos: int
    block_table: tuple[int, ...]
    sample: bool
    prompt_end: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def context_len(self) -> int:
        return self.start_pos + len(self.token_ids)


@dataclass(frozen=True)
class NewRequestData:
    """Sent once, the first time a request is scheduled, so the runner can set up sampling state
    (seeded generator, penalty counts). A preempted request is not sent again."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...]


@dataclass(frozen=True)
class ScheduledBatch:
    """What runs in one forward pass.

    ``rows``: decode rows first (oldest request first), then prompt chunks in arrival order.
    ``finished_request_ids``: requests that finished or were aborted since the previous batch; the
    runner drops their state.
    ``num_steps``: decode steps the batch runs in one pass (> 1 only where every row decodes a
    token of a plain greedy request: see ``Scheduler``): each row then samples ``num_steps``
    tokens, each token sampled the input of the row's next step, and its block table covers the
    K/V of positions ``start_pos .. start_pos + num_steps - 1``.
    """

    rows: tuple[BatchRow, ...]
    new_requests: tuple[NewRequestData, ...] = ()
    finished_request_ids: tuple[str, ...] = ()
    num_preempted: int = 0
    num_steps: int = 1

    @property
    def num_tokens(self) -> int:
        return sum(len(row.token_ids) for row in self.rows)

    @property
    def num_rows(self) -> int:
        return len(self.rows)

    @property
    def sample_request_ids(self) -> list[str]:
        return [row.request_id for row in self.rows if row.sample]

    @property
    def is_empty(self) -> bool:
        return not self.rows
