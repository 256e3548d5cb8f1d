"""The asyncio <-> engine-thread bridge, against a test double of ``LLMEngine``."""

from __future__ import annotations

import asyncio
import math
import threading
import time
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from engine.outputs import RequestOutput, TokenLogprob
from scheduler.sampling_params import SamplingParams
from server.async_engine import AsyncEngine, EngineDeadError, RejectedOutput
from server.metrics import ServerMetrics

BLOCK_SIZE = 4


@dataclass
class _FakeRequest:
    prompt_token_ids: list[int]
    params: SamplingParams
    output_token_ids: list[int]
    num_blocks: int


class FakeEngine:
    """Deterministic stand-in for ``LLMEngine``: each step, every request gets the next token of
    ``3 + (sum of its tokens * 31 + its length) % 500``. Records which threads call it."""

    def __init__(
        self,
        config: object = None,
        step_delay: float = 0.0,
        num_kv_blocks: int = 256,
        fail_at_step: int | None = None,
        max_model_len: int = 256,
    ) -> None:
        from tests.tiny_model import make_tokenizer

        self.config = config
        self.tokenizer = make_tokenizer()
        self.model_name = "fake-model"
        self.max_model_len = max_model_len
        self.eos_token_ids = (self.tokenizer.eos_token_id,)
        self.num_kv_blocks = num_kv_blocks
        self.num_free_blocks = num_kv_blocks
        self.step_delay = step_delay
        self.fail_at_step = fail_at_step
        self.num_steps = 0
        self.caller_threads: set[int] = set()
        self.requests: dict[str, _FakeRequest] = {}
        self.aborted: list[str] = []
        self.abort_steps: list[int] = []  # num_steps when each abort arrived

    @staticmethod
    def next_token(token_ids: list[int]) -> int:
        return 3 + (sum(token_ids) * 31 + len(token_ids)) % 500

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        group_id: str | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        tenant: str = "",
        streamed: bool = False,
    ) -> None:
        self.caller_threads.add(threading.get_ident())
        if not prompt_token_ids:
            raise ValueError("prompt_token_ids must not be empty")
        if len(prompt_token_ids) + sampling_params.max_tokens > self.max_model_len:
            raise ValueError("too long")
        num_blocks = math.ceil((len(prompt_token_ids) + sampling_params.max_tokens) / BLOCK_SIZE)
        self.num_free_blocks -= num_blocks
        self.requests[request_id] = _FakeRequest(
            list(prompt_token_ids), sampling_params, [], num_blocks
        )

    def abort_request(self, request_id: str) -> RequestOutput | None:
        self.caller_threads.add(threading.get_ident())
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        self.aborted.append(request_id)
        self.abort_steps.append(self.num_steps)
        self.num_free_blocks += request.num_blocks
        return RequestOutput(request_id, finish_reason="abort")

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[RequestOutput]:
        self.caller_threads.add(threading.get_ident())
        self.num_steps += 1
        if self.fail_at_step is not None and self.num_steps >= self.fail_at_step:
            raise RuntimeError("injected engine failure")
        if self.step_delay:
            time.sleep(self.step_delay)
        outputs = []
        for request_id, request in list(self.requests.items()):
            token_id = self.next_token(request.prompt_token_ids + request.output_token_ids)
            request.output_token_ids.append(token_id)
            params = request.params
            finish = None
            if token_id in params.stop_token_ids:
                finish = "stop"
            elif len(request.output_token_ids) >= params.max_tokens:
                finish = "length"
            logprobs = None
            if params.logprobs is not None:
                top = tuple((token_id + k, -0.5 - k) for k in range(params.logprobs))
                logprobs = [TokenLogprob(token_id, -0.5, top)]
            outputs.append(
                RequestOutput(
                    request_id,
                    [token_id],
                    logprobs,
                    finish,
                    num_prompt_tokens=len(request.prompt_token_ids),
                    num_output_tokens=len(request.output_token_ids),
                )
            )
            if finish:
                del self.requests[request_id]
                self.num_free_blocks += request.num_blocks
        return outputs

    def stats(self) -> SimpleNamespace:
        return SimpleNamespace(
            num_running=len(self.requests),
            num_waiting=0,
            kv_cache_usage=1 - self.num_free_blocks / self.num_kv_blocks,
            prefix_cache_queries=10 * self.num_steps,
            prefix_cache_hits=self.num_steps,
            num_preemptions=0,
            last_step_num_tokens=len(self.requests) or 1,
            last_step_seconds=self.step_delay,
            last_step_num_steps=1,
        )


def _run(coro):  # noqa: ANN001, ANN202
    return asyncio.run(asyncio.wait_for(coro, timeout=30))


async def _started(engine: FakeEngine, **kwargs: object) -> AsyncEngine:
    bridge = AsyncEngine(lambda: engine, **kwargs)  # type: ignore[arg-type]
    bridge.start()
    while not bridge.ready:
        await asyncio.sleep(0.005)
    return bridge


def test_generate_streams_deltas_from_the_engine_thread() -> None:
    engine = FakeEngine()

    async def main() -> list[int]:
        bridge = await _started(engine)
        params = SamplingParams(max_tokens=5, temperature=0)
        tokens = []
        async for output in bridge.generate("r1", [5, 6, 7], params):
            tokens.extend(output.new_token_ids)
        bridge.stop()
        return tokens

    tokens = _run(main())
    expected: list[int] = []
    for _ in range(5):
        expected.append(FakeEngine.next_token([5, 6, 7] + expected))
    assert tokens == expected
    assert threading.get_ident() not in engine.caller_threads
    assert len(engine.caller_threads) == 1


def test_closing_the_stream_aborts_and_frees_blocks() -> None:
    engine = FakeEngine(step_delay=0.01)

    async def main() -> None:
        bridge = await _started(engine)
        params = SamplingParams(max_tokens=100, temperature=0)
        stream = bridge.generate("r1", [5, 6], params)
        await stream.__anext__()
        await stream.aclose()
        closed_at_step.append(engine.num_steps)
        for _ in range(200):
            if not engine.requests:
                break
            await asyncio.sleep(0.01)
        bridge.stop()

    closed_at_step: list[int] = []
    _run(main())
    assert engine.aborted == ["r1"]
    # Aborted before the engine's next step (the step running at close may still finish).
    assert engine.abort_steps[0] <= closed_at_step[0] + 1
    assert engine.num_free_blocks == engine.num_kv_blocks


def test_cancelled_consumer_aborts() -> None:
    engine = FakeEngine(step_delay=0.01)

    async def main() -> None:
        bridge = await _started(engine)

        async def consume() -> None:
            async for _ in bridge.generate("r1", [5], SamplingParams(max_tokens=200)):
                pass

        task = asyncio.ensure_future(consume())
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(200):
            if not engine.requests:
                break
            await asyncio.sleep(0.01)
        bridge.stop()

    _run(main())
    assert engine.aborted == ["r1"]
    assert engine.num_free_blocks == engine.num_kv_blocks


def test_rejected_request_ends_with_a_rejected_output() -> None:
    engine = FakeEngine(max_model_len=8)

    async def main() -> list[RequestOutput]:
        bridge = await _started(engine)
        outputs = [o async for o in bridge.generate("r1", [1] * 6, SamplingParams(max_tokens=5))]
        bridge.stop()
        return outputs

    outputs = _run(main())
    assert len(outputs) == 1
    assert isinstance(outputs[0], RejectedOutput)
    assert outputs[0].finish_reason == "error"


def test_an_unexpected_add_failure_fails_that_request_alone() -> None:
    engine = FakeEngine()
    real_add = engine.add_request

    def add_request(request_id: str, prompt: list[int], *args: object, **kwargs: object) -> None:
        if request_id == "bad":
            raise TypeError("unexpected add failure")
        real_add(request_id, prompt, *args, **kwargs)  # type: ignore[arg-type]

    engine.add_request = add_request  # type: ignore[method-assign]
    fatal: list[str] = []

    async def main() -> tuple[list[RequestOutput], list[RequestOutput]]:
        bridge = await _started(engine, on_fatal=fatal.append)
        params = SamplingParams(max_tokens=3)
        bad = [o async for o in bridge.generate("bad", [4], params)]
        good = [o async for o in bridge.generate("good", [4], params)]
        assert bridge.alive
        bridge.stop()
        return bad, good

    bad, good = _run(main())
    assert len(bad) == 1 and not isinstance(bad[0], RejectedOutput)  # a 500, not a 400
    assert bad[0].finish_reason == "error" and "error id" in (bad[0].error or "")
    assert "unexpected" not in (bad[0].error or "")
    assert good[-1].finish_reason == "length" and not fatal


def test_a_failing_on_ready_stops_instead_of_loading_forever() -> None:
    engine = FakeEngine()
    fatal: list[str] = []

    def on_ready(_: object) -> None:
        raise KeyError("no tokenizer")

    async def main() -> None:
        bridge = await _started(engine, on_fatal=fatal.append, on_ready=on_ready)
        for _ in range(200):
            if fatal:
                break
            await asyncio.sleep(0.005)
        assert not bridge.alive
        with pytest.raises(EngineDeadError, match="error id"):
            bridge.check_available()
        bridge.stop()

    _run(main())
    assert len(fatal) == 1 and "no tokenizer" in fatal[0]


def test_stop_shuts_the_engine_down() -> None:
    engine = FakeEngine()
    calls: list[int] = []
    engine.shutdown = lambda: calls.append(threading.get_ident())  # type: ignore[attr-defined]

    async def main() -> None:
        bridge = await _started(engine)
        bridge.stop()

    _run(main())
    assert len(calls) == 1 and calls[0] != threading.get_ident()  # on the engine thread


def test_engine_failure_ends_every_pending_request_and_calls_on_fatal() -> None:
    engine = FakeEngine(fail_at_step=3)
    fatal: list[str] = []

    async def main() -> list[RequestOutput]:
        bridge = await _started(engine, on_fatal=fatal.append)

        async def last(request_id: str) -> RequestOutput:
            outputs = [
                o async for o in bridge.generate(request_id, [4], SamplingParams(max_tokens=50))
            ]
            return outputs[-1]

        finals = await asyncio.gather(*(last(f"r{i}") for i in range(4)))
        await asyncio.sleep(0.05)
        assert not bridge.alive
        with pytest.raises(EngineDeadError):
            bridge.add("late", [1], SamplingParams())
        return list(finals)

    finals = _run(main())
    assert [f.finish_reason for f in finals] == ["error"] * 4
    # clients see an error id; the log and on_fatal have the exception
    assert all("error id" in (f.error or "") for f in finals)
    assert not any("injected" in (f.error or "") for f in finals)
    assert len(fatal) == 1 and "injected engine failure" in fatal[0]


def test_idle_engine_thread_does_not_step() -> None:
    engine = FakeEngine()

    async def main() -> None:
        bridge = await _started(engine)
        await asyncio.sleep(0.2)
        bridge.stop()

    _run(main())
    assert engine.num_steps == 0


def test_engine_stats_feed_the_metrics() -> None:
    engine = FakeEngine()
    metrics = ServerMetrics()

    async def main() -> None:
        bridge = await _started(engine, metrics=metrics)
        async for _ in bridge.generate("r1", [5], SamplingParams(max_tokens=4)):
            pass
        bridge.stop()

    _run(main())
    text = metrics.render().decode()
    assert "splitfuse_batch_tokens_count 4.0" in text
    assert "splitfuse_prefix_cache_queries_total 40.0" in text
    assert "splitfuse_prefix_cache_hits_total 4.0" in text


def test_the_server_freezes_what_loading_and_then_compiling_made(monkeypatch):
    """``on_engine_ready`` takes what loading made out of the collector's scans at once, and what
    the step graphs' compilation made once the engine says it is done (a daemon thread)."""
    from server import serving
    from server.config import ServerConfig

    frozen = []
    monkeypatch.setattr(serving, "freeze_long_lived_objects", lambda: frozen.append(time.time()))
    compiled = threading.Event()
    engine = FakeEngine()
    engine.grammar_tokenizer = None
    engine.wait_until_compiled = compiled.wait
    state = serving.ServerState(ServerConfig(), None, ServerMetrics())
    try:
        state.on_engine_ready(engine)
        assert len(frozen) == 1 and state.model_name == "fake-model"
        time.sleep(0.05)
        assert len(frozen) == 1  # still compiling
        compiled.set()
        deadline = time.monotonic() + 10
        while len(frozen) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(frozen) == 2
        # an engine without step graphs (a test double) is frozen once, at ready
        del engine.wait_until_compiled
        state.on_engine_ready(engine)
        time.sleep(0.05)
        assert len(frozen) == 3
    finally:
        state.close()
