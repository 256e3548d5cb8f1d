"""The bridge between the asyncio server and the (not thread-safe) engine.

One engine thread is the engine's only caller. The event loop never waits for it:

    event loop                         engine thread
    ----------                         -------------
    generate() -> commands.append ---> drain commands (add / abort)
                  notify               step()
    per-request asyncio.Queue  <------ loop.call_soon_threadsafe(dispatch, outputs)

The thread sleeps on a condition while the engine is idle. A request the engine cannot add
ends alone: with a 400 for a ValueError (bad input), a 500 for anything else. If a step raises
(the scheduler's state can no longer be trusted), or the server cannot start on the loaded
engine, every pending request ends with an error output, ``alive`` turns false and ``on_fatal``
is called on the loop. Clients see an error id, never the exception; the log has both.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import threading
import time
import traceback
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from engine.outputs import RequestOutput
from scheduler.sampling_params import SamplingParams
from server.metrics import ServerMetrics

logger = logging.getLogger("splitfuse.server")

_SWITCH_INTERVAL_SECONDS = 0.001


class EngineDeadError(RuntimeError):
    """The engine loop has failed; no request can be served."""


class EngineNotReadyError(RuntimeError):
    """The engine is still loading."""


class RejectedOutput(RequestOutput):
    """The engine refused the request (its ``add_request`` raised ValueError): a client error."""


@dataclass(frozen=True)
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    group_id: str | None
    arrival_time: float
    priority: int = 0
    tenant: str = ""
    streamed: bool = False


@dataclass(frozen=True)
class _Abort:
    request_id: str


class AsyncEngine:
    """Owns the engine thread. Create on the event loop, then ``start()``."""

    def __init__(
        self,
        engine_factory: Callable[[], Any],
        metrics: ServerMetrics | None = None,
        on_fatal: Callable[[str], None] | None = None,
        on_ready: Callable[[Any], None] | None = None,
    ) -> None:
        self._engine_factory = engine_factory
        self._metrics = metrics
        self._on_fatal = on_fatal
        self._on_ready = on_ready
        self._loop: asyncio.AbstractEventLoop | None = None
        self._cond = threading.Condition()
        self._commands: list[_Add | _Abort] = []
        self._stopping = False
        self._thread: threading.Thread | None = None
        # Event-loop side: request id -> its output queue.
        self._queues: dict[str, asyncio.Queue[RequestOutput]] = {}
        self.engine: Any = None
        self.ready = False
        self.error: str | None = None  # why the engine stopped (the log's words)
        self.public_error: str | None = None  # what clients are told: an error id

    @property
    def alive(self) -> bool:
        return self.error is None

    @property
    def num_in_flight(self) -> int:
        return len(self._queues)

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        # The engine thread holds the GIL through the Python parts of a step; a shorter switch
        # interval (default 5 ms) lets the event loop take it back sooner at each await.
        sys.setswitchinterval(min(sys.getswitchinterval(), _SWITCH_INTERVAL_SECONDS))
        self._thread = threading.Thread(target=self._run, name="splitfuse-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Aborts what is in flight, stops the thread after its current step; pending requests
        end with an error."""
        with self._cond:
            self._commands.extend(_Abort(request_id) for request_id in self._queues)
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.warning("the engine thread did not stop within %.0f s", timeout)
        if self.error is None:
            self.error = self.public_error = "the server is shutting down"
        self._fail_all(self.public_error or self.error)

    # ---- event-loop side -------------------------------------------------------------------

    def check_available(self) -> None:
        if self.public_error is not None:
            raise EngineDeadError(self.public_error)
        if not self.ready:
            raise EngineNotReadyError("the model is loading")

    def add(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        group_id: str | None = None,
        arrival_time: float | None = None,
        queue: asyncio.Queue[RequestOutput] | None = None,
        priority: int = 0,
        tenant: str = "",
        streamed: bool = False,
    ) -> asyncio.Queue[RequestOutput]:
        """Submits a request; its outputs arrive on ``queue`` (a new one unless given; several
        requests may share one), the last one finished. ``streamed``: the engine's
        ``add_request``'s (each token is sent as it comes)."""
        self.check_available()
        if request_id in self._queues:
            raise ValueError(f"duplicate request id {request_id!r}")
        if queue is None:
            queue = asyncio.Queue()
        self._queues[request_id] = queue
        command = _Add(
            request_id,
            prompt_token_ids,
            sampling_params,
            group_id,
            time.monotonic() if arrival_time is None else arrival_time,
            priority,
            tenant,
            streamed,
        )
        self._submit(command)
        return queue

    def abort(self, request_id: str) -> None:
        """Idempotent. The engine drops the request (and frees its blocks) before its next step."""
        if self._queues.pop(request_id, None) is not None and self.error is None:
            self._submit(_Abort(request_id))

    def release(self, request_id: str) -> None:
        """Forgets a finished request's queue."""
        self._queues.pop(request_id, None)

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        group_id: str | None = None,
        arrival_time: float | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yields the request's deltas until it finishes. Closing or cancelling the iterator
        early (a client disconnect) aborts the request."""
        queue = self.add(
            request_id, prompt_token_ids, sampling_params, group_id, arrival_time, streamed=True
        )
        finished = False
        try:
            while True:
                output = await queue.get()
                finished = output.finished
                yield output
                if finished:
                    return
        finally:
            if finished:
                self.release(request_id)
            else:
                self.abort(request_id)

    def _submit(self, command: _Add | _Abort) -> None:
        with self._cond:
            self._commands.append(command)
            self._cond.notify()

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            queue = self._queues.get(output.request_id)
            if queue is not None:
                queue.put_nowait(output)
                if output.finished:
                    self._queues.pop(output.request_id, None)

    def _fail_all(self, message: str) -> None:
        """Ends every pending request with an error output (on the loop thread)."""
        if self._loop is None or self._loop.is_closed():
            return

        def fail() -> None:
            queues, self._queues = self._queues, {}
            for request_id, queue in queues.items():
                queue.put_nowait(RequestOutput(request_id, finish_reason="error", error=message))

        if self._on_loop_thread():
            fail()
        else:
            self._loop.call_soon_threadsafe(fail)

    def _on_loop_thread(self) -> bool:
        try:
            return asyncio.get_running_loop() is self._loop
        except RuntimeError:
            return False

    def _post(self, callback: Callable[..., None], *args: Any) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed in between
                loop.call_soon_threadsafe(callback, *args)

    # ---- engine thread ---------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self.engine = self._engine_factory()
        except BaseException as error:  # noqa: BLE001 - any load failure ends the process
            self._die(f"the engine failed to load: {error!r}", traceback.format_exc())
            return
        add_fatal_listener = getattr(self.engine, "add_fatal_listener", None)
        if add_fatal_listener is not None:  # e.g. a tensor-parallel worker died, even when idle
            add_fatal_listener(lambda message: self._die(message, "reported by the engine"))
        self.ready = True
        if self._on_ready is not None:
            self._post(self._start_serving, self.engine)
        try:
            self._loop_steps()
        except BaseException as error:  # noqa: BLE001 - report, fail requests, exit non-zero
            self._die(f"the engine failed: {error!r}", traceback.format_exc())
        finally:
            self._shutdown_engine()

    def _start_serving(self, engine: Any) -> None:
        """``on_ready``, on the loop; if it raises, the server could never turn ready: it stops."""
        assert self._on_ready is not None
        try:
            self._on_ready(engine)
        except Exception as error:  # noqa: BLE001 - report, fail requests, exit non-zero
            self._die(
                f"the server cannot serve the loaded engine: {error!r}", traceback.format_exc()
            )

    def _shutdown_engine(self) -> None:
        """The engine's own shutdown (tensor-parallel workers, ...), once its thread is done."""
        shutdown = getattr(self.engine, "shutdown", None)
        if shutdown is None:
            return
        try:
            shutdown()
        except Exception:  # noqa: BLE001 - stopping anyway
            logger.exception("the engine's shutdown failed")

    def _loop_steps(self) -> None:
        engine = self.engine
        while True:
            with self._cond:
                while (
                    not self._commands
                    and not self._stopping
                    and not engine.has_unfinished_requests()
                ):
                    self._cond.wait()
                commands, self._commands = self._commands, []
                if self._stopping:
                    self._apply([c for c in commands if isinstance(c, _Abort)])
                    return
            outputs = self._apply(commands)
            stepped = False
            if engine.has_unfinished_requests():
                outputs.extend(engine.step())
                stepped = True
            if outputs:
                self._post(self._dispatch, outputs)
            if self._metrics is not None:
                self._metrics.observe_engine_stats(engine.stats(), stepped)

    def _apply(self, commands: list[_Add | _Abort]) -> list[RequestOutput]:
        """Adds and aborts, in order. A rejected add ends that request with an error output."""
        outputs: list[RequestOutput] = []
        for command in commands:
            if isinstance(command, _Abort):
                self.engine.abort_request(command.request_id)
                continue
            try:
                self.engine.add_request(
                    command.request_id,
                    command.prompt_token_ids,
                    command.sampling_params,
                    group_id=command.group_id,
                    arrival_time=command.arrival_time,
                    priority=command.priority,
                    tenant=command.tenant,
                    streamed=command.streamed,
                )
            except ValueError as error:
                outputs.append(
                    RejectedOutput(command.request_id, finish_reason="error", error=str(error))
                )
            except Exception:  # noqa: BLE001 - this request's fault or ours: it fails alone
                error_id = uuid.uuid4().hex[:12]
                logger.exception(
                    "adding request %s failed (error id %s)", command.request_id, error_id
                )
                with contextlib.suppress(Exception):  # whatever part of it got in
                    self.engine.abort_request(command.request_id)
                message = f"the engine could not take this request (error id {error_id})"
                outputs.append(
                    RequestOutput(command.request_id, finish_reason="error", error=message)
                )
        return outputs

    def _die(self, message: str, details: str) -> None:
        if self.error is not None:
            return  # already stopped
        error_id = uuid.uuid4().hex[:12]
        logger.error("%s (error id %s)\n%s", message, error_id, details)
        self.error = message
        self.public_error = f"the engine stopped (error id {error_id})"
        self._fail_all(self.public_error)
        if self._on_fatal is not None:
            self._post(self._on_fatal, message)
