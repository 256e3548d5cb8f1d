"""One API call's generation: ``num_prompts * n`` engine requests merged into one stream of
per-choice deltas, with detokenization, stop strings, metrics and the request log line.

Choice ``index = prompt_index * n + sample_index`` (OpenAI's order). Siblings of one prompt share a
``group_id`` so the engine shares the prompt's cached blocks among them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field, replace

from engine.detokenizer import SequenceText, StopStrings
from engine.outputs import RequestOutput, TokenLogprob
from scheduler.sampling_params import SamplingParams
from server.async_engine import AsyncEngine, RejectedOutput
from server.metrics import ServerMetrics

logger = logging.getLogger("splitfuse.requests")

_MAX_SEED = 2**63


class GenerationError(Exception):
    """The engine failed the request (``status`` 500) or refused it (400)."""

    def __init__(self, status_code: int, message: str) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message


@dataclass
class ChoiceDelta:
    """New text of one choice; ``finish_reason`` set on its last delta."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None = None
    # Why a structured output ended on a dead end (finish_reason "grammar_error").
    finish_message: str | None = None


@dataclass
class _Choice:
    index: int
    request_id: str
    num_prompt_tokens: int
    text: SequenceText
    num_output_tokens: int = 0
    finish_reason: str | None = None
    queue_seconds: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    token_gaps: list[float] = field(default_factory=list)


class Generation:
    """Submits the requests at construction; ``next_deltas()`` until it returns []; ``close()``
    aborts whatever has not finished (a client disconnect)."""

    def __init__(
        self,
        engine: AsyncEngine,
        tokenizer: object,
        request_id: str,
        prompts: list[list[int]],
        n: int,
        params: SamplingParams,
        metrics: ServerMetrics | None = None,
        priority: int = 0,
        tenant: str = "default",
        streamed: bool = False,
    ) -> None:
        self.request_id = request_id
        self.tenant = tenant
        self.arrival_time = time.monotonic()
        self._engine = engine
        self._metrics = metrics
        self._queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._choices: dict[str, _Choice] = {}
        self._num_unfinished = 0
        self._closed = False
        self.error: GenerationError | None = None
        # Usage counts each prompt once, however many samples it has (OpenAI's rule).
        self.num_prompt_tokens = sum(len(prompt) for prompt in prompts)
        stops = StopStrings(params.stop)
        for prompt_index, prompt_token_ids in enumerate(prompts):
            group_id = f"{request_id}-p{prompt_index}" if n > 1 else None
            for sample_index in range(n):
                index = prompt_index * n + sample_index
                choice_id = f"{request_id}-{index}"
                choice_params = params
                if params.seed is not None and sample_index > 0:
                    choice_params = replace(params, seed=(params.seed + sample_index) % _MAX_SEED)
                self._choices[choice_id] = _Choice(
                    index=index,
                    request_id=choice_id,
                    num_prompt_tokens=len(prompt_token_ids),
                    text=SequenceText(tokenizer, prompt_token_ids, stops),
                )
                try:
                    engine.add(
                        choice_id,
                        prompt_token_ids,
                        choice_params,
                        group_id=group_id,
                        arrival_time=self.arrival_time,
                        queue=self._queue,
                        priority=priority,
                        tenant=tenant,
                        streamed=streamed,
                    )
                except Exception:
                    self.close()
                    raise
                self._num_unfinished += 1

    @property
    def num_output_tokens(self) -> int:
        return sum(c.num_output_tokens for c in self._choices.values())

    async def next_deltas(self) -> list[ChoiceDelta]:
        """The deltas of the next engine output(s); [] once every choice has finished.
        Raises ``GenerationError`` when the engine fails or refuses the request."""
        while self._num_unfinished > 0:
            outputs = [await self._queue.get()]
            while not self._queue.empty():
                outputs.append(self._queue.get_nowait())
            deltas = [d for d in map(self._process, outputs) if d is not None]
            if self.error is not None:
                self.close()
                raise self.error
            if deltas:
                return deltas
            # Only outputs of choices already ended by a stop string: wait for the others.
        return []

    def _process(self, output: RequestOutput) -> ChoiceDelta | None:
        choice = self._choices.get(output.request_id)
        if choice is None or choice.finish_reason is not None:
            return None  # output after a stop-string abort
        now = time.monotonic()
        if output.queue_seconds is not None:
            choice.queue_seconds = output.queue_seconds
        if output.finish_reason == "error":
            status = 400 if isinstance(output, RejectedOutput) else 500
            self.error = GenerationError(status, output.error or "the engine failed")
            self._finish(choice, "error", now)
            return None
        new_token_ids = list(output.new_token_ids)
        if new_token_ids:
            if choice.first_token_time is None:
                choice.first_token_time = now
            elif choice.last_token_time is not None:
                choice.token_gaps.append(now - choice.last_token_time)
            choice.last_token_time = now
        choice.num_output_tokens = max(
            output.num_output_tokens, choice.num_output_tokens + len(new_token_ids)
        )
        text = choice.text.add(new_token_ids, finished=output.finished)
        finish_reason = output.finish_reason
        if choice.text.stopped:
            finish_reason = "stop"
            if not output.finished:
                self._engine.abort(choice.request_id)
        if finish_reason is not None:
            self._finish(choice, finish_reason, now)
        return ChoiceDelta(
            index=choice.index,
            text=text,
            token_ids=new_token_ids,
            logprobs=list(output.new_logprobs) if output.new_logprobs is not None else None,
            finish_reason=finish_reason,
            finish_message=output.error if finish_reason == "grammar_error" else None,
        )

    def _finish(self, choice: _Choice, finish_reason: str, now: float) -> None:
        choice.finish_reason = finish_reason
        self._num_unfinished -= 1
        if self._metrics is not None:
            self._metrics.observe_finished(
                finish_reason,
                choice.num_prompt_tokens,
                choice.num_output_tokens,
                now - self.arrival_time,
                None
                if choice.first_token_time is None
                else choice.first_token_time - self.arrival_time,
                choice.queue_seconds,
                choice.token_gaps,
                tenant=self.tenant,
            )
        if self._num_unfinished == 0:
            self._log_finished(now)

    def close(self) -> None:
        """Aborts every unfinished choice (idempotent); their blocks are freed before the next
        engine step."""
        if self._closed:
            return
        self._closed = True
        now = time.monotonic()
        for choice in self._choices.values():
            if choice.finish_reason is None:
                self._engine.abort(choice.request_id)
                self._finish(choice, "abort", now)

    def _log_finished(self, now: float) -> None:
        first_tokens = [c.first_token_time for c in self._choices.values() if c.first_token_time]
        ttft = min(first_tokens) - self.arrival_time if first_tokens else None
        reasons = sorted({c.finish_reason or "" for c in self._choices.values()})
        record = {
            "event": "request_finished",
            "id": self.request_id,
            "tenant": self.tenant,
            "prompt_tokens": self.num_prompt_tokens,
            "output_tokens": self.num_output_tokens,
            "ttft_s": None if ttft is None else round(ttft, 4),
            "total_s": round(now - self.arrival_time, 4),
            "finish_reason": ",".join(reasons),
        }
        logger.info(json.dumps(record))
