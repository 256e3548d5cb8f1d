"""Under load: 64 concurrent greedy streams match their solo runs, disconnects free every block,
and the event loop keeps answering /livez while the engine is busy."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from engine.config import EngineConfig
from server.app import default_engine_factory
from server.runner import ServerThread

NEAR_TIE = 1e-3  # the engine issue's rule: a divergence is accepted where top-2 are this close
NUM_STREAMS = 64


def _prompts(count: int, seed: int) -> list[str]:
    text = "the city river boat harbour paris france capital light sound water sun moon cache"
    words = text.split(" ")
    rng = random.Random(seed)
    return [" ".join(rng.choice(words) for _ in range(rng.randint(3, 40))) for _ in range(count)]


async def _stream_completion(client: httpx.AsyncClient, body: dict) -> dict[str, Any]:
    """Text, token strings and top logprobs of one streamed completion."""
    tokens: list[str] = []
    tops: list[dict[str, float]] = []
    text = ""
    ids = set()
    finish = None
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            ids.add(chunk["id"])
            choice = chunk["choices"][0]
            text += choice["text"]
            finish = choice["finish_reason"] or finish
            if choice["logprobs"]:
                tokens += choice["logprobs"]["tokens"]
                tops += choice["logprobs"]["top_logprobs"]
    assert len(ids) == 1
    return {"text": text, "tokens": tokens, "tops": tops, "finish": finish}


def _compare(batched: dict, alone: dict) -> int:
    """Token-by-token; a divergence is accepted only at a near-tie of the reference's top-2
    logprobs. Returns the number of near-ties met (0 or 1)."""
    for i, (got, want) in enumerate(zip(batched["tokens"], alone["tokens"], strict=False)):
        if got != want:
            top2 = sorted(alone["tops"][i].values(), reverse=True)[:2]
            assert len(top2) == 2 and top2[0] - top2[1] < NEAR_TIE, (
                f"diverged at token {i} without a near-tie: {got!r} vs {want!r}, top-2 {top2}"
            )
            return 1
    assert batched["text"] == alone["text"]
    return 0


def test_64_concurrent_greedy_streams_match_solo_runs(tiny_server: ServerThread) -> None:
    prompts = _prompts(NUM_STREAMS, seed=0)
    bodies = [
        {"prompt": p, "max_tokens": 24, "temperature": 0, "logprobs": 2, "ignore_eos": True}
        for p in prompts
    ]

    async def run() -> tuple[list[dict], list[dict]]:
        limits = httpx.Limits(max_connections=NUM_STREAMS + 8)
        async with httpx.AsyncClient(base_url=tiny_server.url, timeout=120, limits=limits) as c:
            batched = await asyncio.gather(*(_stream_completion(c, b) for b in bodies))
            alone = [await _stream_completion(c, b) for b in bodies]
        return list(batched), alone

    batched, alone = asyncio.run(run())
    assert all(b["finish"] == "length" and len(b["tokens"]) == 24 for b in batched)
    near_ties = sum(_compare(b, a) for b, a in zip(batched, alone, strict=True))
    print(f"64 concurrent greedy streams: {near_ties} near-tie divergences accepted")


def test_random_disconnects_free_every_block(start_server: Callable[..., ServerThread]) -> None:
    server = start_server(engine={"max_batch_tokens": 256})
    engine = server.state.engine.engine
    rng = random.Random(7)
    prompts = _prompts(60, seed=1)

    async def disconnecting_stream(client: httpx.AsyncClient, prompt: str) -> None:
        body = {"prompt": prompt, "max_tokens": 400, "ignore_eos": True, "stream": True}
        num_chunks = rng.randint(0, 8)
        async with client.stream("POST", "/v1/completions", json=body) as response:
            seen = 0
            async for _ in response.aiter_lines():
                seen += 1
                if seen > num_chunks:
                    break  # leaving the block closes the connection

    async def disconnecting_request(client: httpx.AsyncClient, prompt: str) -> None:
        body = {"prompt": prompt, "max_tokens": 400, "ignore_eos": True}
        with contextlib.suppress(httpx.TimeoutException):
            await client.post("/v1/completions", json=body, timeout=rng.uniform(0.5, 2.0))

    async def finishing_request(client: httpx.AsyncClient, prompt: str) -> None:
        response = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 8})
        assert response.status_code == 200

    async def run() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            tasks = []
            for i, prompt in enumerate(prompts):
                if i % 6 == 5:
                    tasks.append(finishing_request(client, prompt))
                elif i % 2:
                    tasks.append(disconnecting_stream(client, prompt))
                else:
                    tasks.append(disconnecting_request(client, prompt))
            await asyncio.gather(*tasks)

    asyncio.run(run())
    deadline = time.monotonic() + 30
    while server.state.engine.num_in_flight or engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "requests still running after their clients left"
        time.sleep(0.05)
    time.sleep(0.1)  # the engine thread finishes its last iteration
    assert engine.kv_manager.num_free_blocks == engine.num_kv_blocks
    families = {
        family.name: family
        for family in text_string_to_metric_families(httpx.get(server.url + "/metrics").text)
    }
    finished = {
        sample.labels["finish_reason"]: sample.value
        for sample in families["splitfuse_requests"].samples
        if sample.name == "splitfuse_requests_total"
    }
    num_answered = sum(
        sample.value
        for sample in families["splitfuse_http_requests"].samples
        if sample.name == "splitfuse_http_requests_total"
        and sample.labels["route"] == "/v1/completions"
    )
    print(f"finished requests: {finished}")
    # Each stream left early; a timed-out plain request may leave before the server starts it.
    assert finished.get("abort", 0) >= 20
    # The ten 8-token requests end on their length or, earlier, on EOS.
    assert finished.get("length", 0) + finished.get("stop", 0) >= 10
    assert sum(finished.values()) == num_answered


class SlowStepEngine:
    """The real engine with each step lengthened by a GIL-free wait (a long forward pass)."""

    def __init__(self, config: EngineConfig, step_seconds: float) -> None:
        self.inner = default_engine_factory(config)
        self.step_seconds = step_seconds

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def step(self) -> list:
        time.sleep(self.step_seconds)
        return self.inner.step()


def test_livez_stays_fast_while_the_engine_is_saturated(
    start_server: Callable[..., ServerThread], livez_under_load: Callable[..., list[float]]
) -> None:
    server = start_server(engine_factory=lambda config: SlowStepEngine(config, 0.1))
    body = {"prompt": "x " * 50, "max_tokens": 5}
    latencies = livez_under_load(server, body, num_clients=8, join_seconds=30)
    p90 = statistics.quantiles(latencies, n=10)[8]
    # A loop that waited for a step would take >= 100 ms for most calls; the p99 (printed) also
    # holds this test process's own pauses (its collector scanning the whole suite's objects).
    assert p90 < 0.05
