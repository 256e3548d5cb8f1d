"""The app's shared state and the request flow common to both generation endpoints:

    parse body -> check model -> check accepting -> tokenize + context check -> 429 check
    -> submit -> wait for the first delta (watching for a disconnect) -> respond

Waiting for the first delta before answering means an engine failure or refusal still gets its
own status (500 / 400) and body, streaming or not.

Tenants and load shedding: a request's tenant is named by the ``tenant_header`` (when configured,
for a trusted gateway in front), else by its API key (``key1``, ``key2``, ... in the order the
keys are configured: never the key itself), else ``default``. Under the ``priority`` policy a call
that finds the queue full evicts queued calls of strictly lower priority (the lowest, newest
first) when that makes room; each evicted client gets a 429 with ``Retry-After``.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import itertools
import json
import math
import re
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.types import Receive, Scope, Send

from engine.device import freeze_long_lived_objects
from engine.structured_output import GrammarTokenizer
from scheduler.sampling_params import SamplingParams
from server.async_engine import AsyncEngine
from server.config import ServerConfig
from server.errors import APIError, sampling_error, validation_error
from server.generation import ChoiceDelta, Generation, GenerationError
from server.metrics import ServerMetrics
from server.protocol import UnsupportedFeature
from server.tokens import TokenText

BodyT = TypeVar("BodyT", bound=BaseModel)
T = TypeVar("T")

# One thread parses, validates and tokenizes requests: the GIL-holding parts (json.loads of a
# 4 MiB body: ~50 ms) then never queue behind each other ahead of the event loop.
_PREP_THREADS = 1

# Logprobs of -inf (masked tokens) are sent as this, since JSON has no infinity.
MIN_LOGPROB = -9999.0
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class ClientDisconnected(Exception):
    """The client went away before the response started."""


# A tenant named by a header: what a metric label and a log line can carry.
_TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,63}")


@dataclass(eq=False)
class _Queued:
    """A call waiting for its first deltas; eviction cancels ``task``."""

    priority: int
    num_sequences: int
    order: int
    task: asyncio.Future[list[ChoiceDelta]] | None = None
    evicted: bool = False


class ServerState:
    """Everything the routes share. Lives on ``app.state.server``."""

    def __init__(self, config: ServerConfig, engine: AsyncEngine, metrics: ServerMetrics) -> None:
        self.config = config
        self.engine = engine
        self.metrics = metrics
        self.api_keys = config.all_api_keys()
        self.draining = False
        # Sequences (prompts x n of each API call) waiting for their call's first delta.
        self.num_queued = 0
        self.num_active = 0  # generation HTTP requests not yet answered in full
        self.token_text: TokenText | None = None
        self.grammar_tokenizer: GrammarTokenizer | None = None
        self.model_name = config.served_model_name or ""
        self.max_model_len = 0
        self.created = int(time.time())
        self.fatal_hooks: list[Callable[[str], None]] = []
        self.shed_by_priority = config.engine.scheduling_policy == "priority"
        self._queued: set[_Queued] = set()
        self._queue_order = itertools.count()
        # Parsing, validating, templating and tokenizing a request run here, not on the event
        # loop, so that /livez and the streams keep answering while a big body is prepared.
        self._prep = ThreadPoolExecutor(_PREP_THREADS, thread_name_prefix="splitfuse-prep")
        self._num_preparing = 0

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the preparation threads; 429 when as many calls as
        ``max_queued_requests`` already wait for them."""
        if self._num_preparing >= self.config.max_queued_requests:
            raise APIError(
                429,
                f"the server is preparing {self._num_preparing} requests; retry later",
                code="queue_full",
                headers={"Retry-After": "1"},
            )
        self._num_preparing += 1
        try:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._prep, functools.partial(fn, *args))
        finally:
            self._num_preparing -= 1

    def close(self) -> None:
        """Stops the preparation threads (calls still waiting for them are cancelled)."""
        self._prep.shutdown(wait=False, cancel_futures=True)

    def on_engine_ready(self, engine: Any) -> None:
        # What loading made (modules, tokenizer, compiled code) lives as long as the server: out
        # of the collector's scans, so that a full collection under load does not pause the
        # event loop and the engine's steps for each of those objects; and again once the step
        # graphs, compiled in the background after start-up, are ready, for the compiler's.
        freeze_long_lived_objects()
        wait_until_compiled = getattr(engine, "wait_until_compiled", None)
        if wait_until_compiled is not None:
            threading.Thread(
                target=_freeze_when_compiled,
                args=(wait_until_compiled,),
                name="splitfuse-gc-freeze",
                daemon=True,
            ).start()
        self.token_text = TokenText(engine.tokenizer, engine.max_model_len)
        self.grammar_tokenizer = engine.grammar_tokenizer  # checks structured outputs
        self.model_name = self.config.served_model_name or engine.model_name
        self.max_model_len = engine.max_model_len
        self.metrics.set_engine_info(
            self.model_name, self.config.engine.block_size, getattr(engine, "num_kv_blocks", 0)
        )

    def on_engine_fatal(self, message: str) -> None:
        for hook in self.fatal_hooks:
            hook(message)

    @property
    def ready(self) -> bool:
        return self.engine.ready and self.engine.alive and self.token_text is not None

    # ---- checks, each raising the API error ---------------------------------------------------

    def check_accepting(self) -> TokenText:
        if not self.engine.alive:
            raise APIError(
                500, f"the engine is not running: {self.engine.public_error}", code="engine_dead"
            )
        if self.draining:
            raise APIError(503, "the server is shutting down", code="draining")
        if not self.ready or self.token_text is None:
            raise APIError(
                503, "the model is loading", code="loading", headers={"Retry-After": "5"}
            )
        return self.token_text

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name and self.ready:
            raise APIError(
                404,
                f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                param="model",
                code="model_not_found",
            )

    def check_context(self, num_prompt_tokens: int, max_tokens: int, param: str) -> None:
        if num_prompt_tokens + max_tokens > self.max_model_len:
            raise APIError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in "
                f"the messages, {max_tokens} in the completion). Please reduce the length of the "
                "messages or completion.",
                param=param,
                code="context_length_exceeded",
            )

    def check_num_sequences(self, num_prompts: int, n: int) -> None:
        """400 when one call asks for more sequences (prompts x n) than it may: more than
        max_sequences_per_request, or than max_queued_requests, which it could never fit."""
        limit = min(self.config.max_sequences_per_request, self.config.max_queued_requests)
        if num_prompts * n > limit:
            raise APIError(
                400,
                f"this request asks for {num_prompts} prompt(s) x n={n} = {num_prompts * n} "
                f"completions; this server allows at most {limit} per request",
                param="prompt" if num_prompts > limit else "n",
                code="invalid_value",
            )

    def tenant_of(self, request: Request) -> str:
        """The request's tenant (see the module docstring); 400 for a malformed header."""
        header = self.config.tenant_header
        if header is not None:
            value = request.headers.get(header)
            if value is not None:
                if not _TENANT_NAME.fullmatch(value):
                    raise APIError(
                        400,
                        f"the {header} header must be 1-64 characters of letters, digits and "
                        "'._:-', starting with a letter or digit",
                        param=header,
                        code="invalid_value",
                    )
                return value
        if self.api_keys:
            scheme, _, token = request.headers.get("authorization", "").partition(" ")
            found = 0
            for index, key in enumerate(self.api_keys, start=1):  # every key, constant time
                if hmac.compare_digest(token.strip().encode(), key.encode()):
                    found = found or index
            if found and scheme.lower() == "bearer":
                return f"key{found}"
        return "default"

    def check_queue(self, num_sequences: int, priority: int = 0) -> None:
        """429 when the queue cannot take ``num_sequences`` more, unless (priority policy)
        evicting queued calls of strictly lower priority makes room: those are evicted."""
        overflow = self.num_queued + num_sequences - self.config.max_queued_requests
        if overflow > 0 and self.shed_by_priority:
            victims = sorted(
                (q for q in self._queued if q.priority > priority and not q.evicted),
                key=lambda q: (q.priority, q.order),
                reverse=True,
            )
            chosen: list[_Queued] = []
            for victim in victims:
                if overflow <= 0:
                    break
                chosen.append(victim)
                overflow -= victim.num_sequences
            if overflow <= 0:
                for victim in chosen:
                    victim.evicted = True
                    self.num_queued -= victim.num_sequences
                    if victim.task is not None:
                        victim.task.cancel()
                    self.metrics.requests_evicted.inc()
                return
        if overflow > 0:
            raise APIError(
                429,
                f"the server has {self.num_queued} sequences waiting and this request adds "
                f"{num_sequences} (the limit is {self.config.max_queued_requests}); retry later",
                code="queue_full",
                headers={"Retry-After": "1"},
            )

    # ---- the flow -----------------------------------------------------------------------------

    async def start(
        self,
        request: Request,
        id_prefix: str,
        prompts: list[list[int]],
        n: int,
        params: SamplingParams,
        stream: bool = False,
    ) -> tuple[Generation, list[ChoiceDelta]]:
        """Submits the generation (``stream``: its tokens are sent as they come) and waits for
        its first deltas. Raises APIError (429, 400,
        500) or ClientDisconnected (after aborting)."""
        token_text = self.check_accepting()
        num_sequences = len(prompts) * n  # the routes checked it with check_num_sequences
        priority: int = getattr(request.state, "priority", 0)
        tenant = self.tenant_of(request)
        self.check_queue(num_sequences, priority)
        request_id = f"{id_prefix}-{uuid.uuid4().hex}"
        generation = Generation(
            self.engine,
            token_text.tokenizer,
            request_id,
            prompts,
            n,
            params,
            self.metrics,
            priority=priority,
            tenant=tenant,
            streamed=stream,
        )
        queued = _Queued(priority, num_sequences, next(self._queue_order))
        queued.task = asyncio.ensure_future(generation.next_deltas())
        self._queued.add(queued)
        self.num_queued += num_sequences
        try:
            first = await until_disconnected(request, queued.task)
        except GenerationError as error:
            raise APIError(
                error.status_code,
                error.message,
                code="engine_error" if error.status_code == 500 else "invalid_value",
            ) from None
        except asyncio.CancelledError:
            generation.close()
            if not queued.evicted or _being_cancelled():
                raise
            raise APIError(
                429,
                "this request was evicted from the full queue by one of higher priority; "
                "retry later",
                code="queue_full",
                headers={"Retry-After": "1"},
            ) from None
        except BaseException:
            generation.close()
            raise
        finally:
            self._queued.discard(queued)
            if not queued.evicted:
                self.num_queued -= num_sequences
        return generation, first


async def read_body(request: Request, model: type[BodyT]) -> BodyT:
    """The JSON body validated against ``model``; 400 naming the field otherwise. Parsed and
    validated off the event loop (a 4 MiB body takes tenths of a second). The body's
    ``priority`` is kept on ``request.state`` for ``ServerState.start``. ``deterministic: true``
    is a 400 unless the engine runs in deterministic mode (it cannot be granted to one request
    alone: every request of a step shares its products)."""
    raw = await request.body()
    state: ServerState = request.app.state.server
    body = await state.off_loop(parse_body, raw, model)
    if getattr(body, "deterministic", None) and not state.config.engine.deterministic:
        raise APIError(
            400,
            "deterministic outputs need a server started in deterministic mode "
            "(--deterministic); this one is not",
            param="deterministic",
            code="unsupported",
        )
    request.state.priority = getattr(body, "priority", 0)
    return body


def _freeze_when_compiled(wait_until_compiled: Callable[[], object]) -> None:
    """Freezes what the engine's step-graph compilation made once it is done (a daemon thread)."""
    wait_until_compiled()
    freeze_long_lived_objects()


def _being_cancelled() -> bool:
    """Whether the current task itself is being cancelled (not only something it awaited)."""
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)  # Python 3.11+
    return bool(cancelling()) if cancelling is not None else False


def parse_body(raw: bytes, model: type[BodyT]) -> BodyT:
    try:
        data = json.loads(raw)
    except RecursionError:
        raise APIError(400, "the body's JSON nests too deeply", code="invalid_json") from None
    except ValueError as error:  # JSONDecodeError, UnicodeDecodeError, an integer of > 4300 digits
        raise APIError(400, f"the body is not valid JSON: {error}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "the body must be a JSON object", code="invalid_json")
    if _LONE_SURROGATE_ESCAPE.search(raw) and _has_lone_surrogate(data):
        raise APIError(
            400,
            "the body holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape), "
            "which is not text",
            code="invalid_json",
        )
    try:
        body = model.model_validate(data)
    except ValidationError as error:
        raise validation_error(error) from None
    check = getattr(body, "check_supported", None)
    if check is not None:
        try:
            check()
        except UnsupportedFeature as error:
            raise APIError(400, str(error), param=error.param, code="unsupported") from None
    return body


# JSON escapes \uD800 to \uDFFF: the only way a surrogate gets into a string json.loads returns
_LONE_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def _has_lone_surrogate(data: Any) -> bool:
    """Whether a string anywhere in the parsed body (keys too) holds a surrogate code point
    (paired escapes become one character when parsed: what is left is unpaired)."""
    stack = [data]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if _SURROGATE.search(item):
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


def build_params(make: Callable[[], T]) -> T:
    """Calls a SamplingParams builder, turning its ValueError into a 400 naming the field."""
    try:
        return make()
    except ValueError as error:
        raise sampling_error(error) from None


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Runs ``work``; if the client disconnects first, cancels it and raises ClientDisconnected."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        watcher.cancel()
        raise
    if task in done:
        watcher.cancel()
        return task.result()
    task.cancel()
    raise ClientDisconnected()


async def collect(
    request: Request, generation: Generation, first: list[ChoiceDelta]
) -> dict[int, list[ChoiceDelta]]:
    """Every delta of a non-streaming generation, by choice index; aborts on a disconnect."""

    async def gather() -> dict[int, list[ChoiceDelta]]:
        by_choice: dict[int, list[ChoiceDelta]] = {}
        deltas = first
        while deltas:
            for delta in deltas:
                by_choice.setdefault(delta.index, []).append(delta)
            deltas = await generation.next_deltas()
        return by_choice

    try:
        return await until_disconnected(request, gather())
    except GenerationError as error:
        raise APIError(error.status_code, error.message, code="engine_error") from None
    finally:
        generation.close()


def streaming_response(
    generation: Generation,
    first: list[ChoiceDelta],
    make_chunks: Callable[[list[ChoiceDelta]], list[dict[str, Any]]],
    usage_chunk_base: dict[str, Any] | None,
) -> StreamingResponse:
    """The SSE response of a streamed generation. With ``usage_chunk_base`` (include_usage), a
    last chunk of that base with no choices carries the request's usage."""
    return GenerationStream(
        generation,
        sse_stream(generation, first, make_chunks, usage_chunk_base),
        media_type="text/event-stream",
        headers=SSE_HEADERS,
    )


class GenerationStream(StreamingResponse):
    """A streaming response that aborts its generation however it ends: also when the client
    left before the body began, where the body's generator never runs (nor its ``finally``)."""

    def __init__(self, generation: Generation, content: AsyncIterator[str], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.generation = generation

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.generation.close()


async def sse_stream(
    generation: Generation,
    first: list[ChoiceDelta],
    make_chunks: Callable[[list[ChoiceDelta]], list[dict[str, Any]]],
    usage_chunk_base: dict[str, Any] | None,
) -> AsyncIterator[str]:
    """SSE events: the chunks of each batch of deltas, then the usage chunk (when asked for), then
    [DONE]. An engine failure mid-stream is sent as an error event. Cancellation (a disconnect)
    aborts."""
    try:
        deltas = first
        while deltas:
            for chunk in make_chunks(deltas):
                yield sse_event(chunk)
            deltas = await generation.next_deltas()
        if usage_chunk_base is not None:
            totals = usage(generation.num_prompt_tokens, generation.num_output_tokens)
            yield sse_event({**usage_chunk_base, "choices": [], "usage": totals})
    except GenerationError as error:
        yield sse_event(APIError(error.status_code, error.message, code="engine_error").body())
    finally:
        generation.close()
    yield "data: [DONE]\n\n"


def sse_event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def finite_logprob(value: float) -> float:
    return value if math.isfinite(value) else MIN_LOGPROB


def usage(num_prompt_tokens: int, num_output_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_output_tokens,
        "total_tokens": num_prompt_tokens + num_output_tokens,
    }


def finish_reason_of(deltas: list[ChoiceDelta]) -> str | None:
    for delta in reversed(deltas):
        if delta.finish_reason is not None:
            return delta.finish_reason
    return None
