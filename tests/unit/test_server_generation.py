"""One API call's choices: stop strings end a choice (and abort it), siblings continue."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from engine.outputs import RequestOutput
from scheduler.sampling_params import SamplingParams
from server.generation import Generation, GenerationError
from server.metrics import ServerMetrics


class StubEngine:
    """Records adds and aborts; the test pushes outputs into the shared queue."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[RequestOutput] | None = None
        self.added: list[tuple[str, str | None, int | None]] = []
        self.aborted: list[str] = []

    def add(self, request_id: str, prompt: list[int], params: SamplingParams, group_id: Any = None,
            arrival_time: Any = None, queue: Any = None, priority: int = 0,
            tenant: str = "", streamed: bool = False) -> Any:  # fmt: skip
        self.queue = queue
        self.added.append((request_id, group_id, params.seed))
        self.streamed = streamed
        return queue

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


@pytest.fixture(scope="module")
def tokenizer():  # noqa: ANN201
    from tests.tiny_model import make_tokenizer

    return make_tokenizer()


def test_stop_string_ends_one_choice_and_siblings_go_on(tokenizer: Any) -> None:
    async def main() -> None:
        engine = StubEngine()
        params = SamplingParams(max_tokens=50, stop=("Paris",), seed=7)
        metrics = ServerMetrics()
        generation = Generation(engine, tokenizer, "cmpl-1", [[5, 6]], 2, params, metrics)  # type: ignore[arg-type]
        assert [a[1] for a in engine.added] == ["cmpl-1-p0", "cmpl-1-p0"]  # one group
        assert [a[2] for a in engine.added] == [7, 8]  # distinct seeds per sample
        ids = tokenizer.encode("The capital is Paris.", add_special_tokens=False)
        assert engine.queue is not None
        engine.queue.put_nowait(RequestOutput("cmpl-1-0", ids, num_output_tokens=len(ids)))
        deltas = await generation.next_deltas()
        assert deltas[0].text == "The capital is " and deltas[0].finish_reason == "stop"
        assert engine.aborted == ["cmpl-1-0"]
        # A late output of the stopped choice alone must not end the stream.
        engine.queue.put_nowait(RequestOutput("cmpl-1-0", [7], num_output_tokens=1))
        waiting = asyncio.ensure_future(generation.next_deltas())
        await asyncio.sleep(0.05)
        assert not waiting.done()
        engine.queue.put_nowait(RequestOutput("cmpl-1-1", ids[:2], finish_reason="length"))
        last = await waiting
        assert [(d.index, d.finish_reason) for d in last] == [(1, "length")]
        assert await generation.next_deltas() == []
        text = metrics.render().decode()
        assert 'splitfuse_requests_total{finish_reason="stop"} 1.0' in text
        assert 'splitfuse_requests_total{finish_reason="length"} 1.0' in text

    asyncio.run(asyncio.wait_for(main(), 10))


def test_engine_error_raises_and_aborts_the_rest(tokenizer: Any) -> None:
    async def main() -> None:
        engine = StubEngine()
        generation = Generation(engine, tokenizer, "c", [[5], [6]], 1, SamplingParams())  # type: ignore[arg-type]
        assert engine.queue is not None
        engine.queue.put_nowait(RequestOutput("c-0", finish_reason="error", error="boom"))
        with pytest.raises(GenerationError) as raised:
            await generation.next_deltas()
        assert raised.value.status_code == 500 and "boom" in raised.value.message
        assert engine.aborted == ["c-1"]
        generation.close()  # idempotent
        assert engine.aborted == ["c-1"]

    asyncio.run(asyncio.wait_for(main(), 10))


def test_a_streamed_generation_asks_the_engine_for_a_step_per_pass(tokenizer: Any) -> None:
    for streamed in (False, True):
        engine = StubEngine()
        Generation(engine, tokenizer, "c", [[5]], 1, SamplingParams(), streamed=streamed)  # type: ignore[arg-type]
        assert engine.streamed is streamed
