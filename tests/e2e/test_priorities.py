"""Priorities, tenants and load shedding over HTTP: a high-priority tenant's TTFT under a
long-prompt flood from another tenant, eviction from a full queue, the ``priority`` field's
validation, the tenant header, and the probes while draining."""

from __future__ import annotations

import asyncio
import random
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from server.runner import ServerThread
from tests.e2e.conftest import ServerProcess
from tests.e2e.test_load import SlowStepEngine

KEYS = ("flood-key", "chat-key")  # tenants key1 (the flood) and key2 (the interactive one)

# The stated bound (README, "Priorities, fair share and load shedding"): with --fair-share, a
# request of at most a tenant's share of the step budget is admitted in the first step after it
# arrives, whatever another tenant has queued, so its TTFT is about two steps plus HTTP. Measured
# p99 on the tiny model, 2 shared cores: ~0.05-0.15 s; the bound leaves room for a noisy machine.
TTFT_P99_BOUND_SECONDS = 1.0
FLOOD_CLIENTS = 16
FLOOD_PROMPT_TOKENS = 900
FLOOD_PROMPTS_PER_REQUEST = 8
NUM_INTERACTIVE = 30


def _flood_and_measure(url: str) -> dict[str, list[float]]:
    """Tenant key1 floods long prompts at priority 5 from FLOOD_CLIENTS clients (8 prompts of 900
    tokens per request: the engine, not the clients, is the bottleneck); tenant key2 sends
    short streamed requests at priority 0, one at a time. Returns each tenant's TTFTs (s)."""
    rng = random.Random(0)
    stop = threading.Event()
    ttfts: dict[str, list[float]] = {"flood": [], "interactive": []}

    async def first_token_seconds(client: httpx.AsyncClient, key: str, body: dict) -> float:
        start = time.perf_counter()
        headers = {"Authorization": f"Bearer {key}"}
        async with client.stream(
            "POST", "/v1/completions", json={**body, "stream": True}, headers=headers
        ) as response:
            assert response.status_code == 200, await response.aread()
            elapsed = None
            async for line in response.aiter_lines():
                if elapsed is None and line.startswith("data: {"):
                    elapsed = time.perf_counter() - start
        assert elapsed is not None
        return elapsed

    async def flood_client(client: httpx.AsyncClient, index: int) -> None:
        while not stop.is_set():
            # new prompts each time: no prefix-cache hit makes the flood lighter
            prompt = [
                [rng.randrange(3, 1000) for _ in range(FLOOD_PROMPT_TOKENS)]
                for _ in range(FLOOD_PROMPTS_PER_REQUEST)
            ]
            body = {"prompt": prompt, "max_tokens": 4, "ignore_eos": True, "priority": 5}
            ttfts["flood"].append(await first_token_seconds(client, KEYS[0], body))

    async def interactive(client: httpx.AsyncClient) -> None:
        await asyncio.sleep(2.0)  # the flood's queue fills up first
        for index in range(NUM_INTERACTIVE):
            body = {"prompt": f"What is the capital of France? {index}", "max_tokens": 2,
                    "ignore_eos": True, "priority": 0}  # fmt: skip
            ttfts["interactive"].append(await first_token_seconds(client, KEYS[1], body))
            await asyncio.sleep(0.05)
        stop.set()

    async def run() -> None:
        limits = httpx.Limits(max_connections=FLOOD_CLIENTS + 8)
        async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
            await asyncio.gather(
                interactive(client), *(flood_client(client, i) for i in range(FLOOD_CLIENTS))
            )

    asyncio.run(run())
    return ttfts


def _p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[98]


@pytest.fixture
def fair_server(tiny_llama_dir: Path) -> Iterator[ServerProcess]:
    server = ServerProcess(
        tiny_llama_dir, "--api-key", KEYS[0], "--api-key", KEYS[1],
        "--scheduling-policy", "priority", "--fair-share",
    )  # fmt: skip
    yield server
    server.stop()


def test_a_high_priority_tenant_keeps_its_ttft_under_a_long_prompt_flood(
    fair_server: ServerProcess,
) -> None:
    ttfts = _flood_and_measure(fair_server.url)
    interactive, flood = ttfts["interactive"], ttfts["flood"]
    print(
        f"fair share + priority: interactive TTFT p50 {statistics.median(interactive):.3f} s, "
        f"p99 {_p99(interactive):.3f} s ({len(interactive)} requests); flood TTFT p50 "
        f"{statistics.median(flood):.3f} s, p99 {_p99(flood):.3f} s ({len(flood)} requests)"
    )
    assert len(interactive) == NUM_INTERACTIVE and len(flood) >= FLOOD_CLIENTS
    assert _p99(interactive) < TTFT_P99_BOUND_SECONDS
    # the flood itself was not starved: it was served throughout
    assert statistics.median(flood) < 30
    metrics = httpx.get(fair_server.url + "/metrics").text
    assert 'splitfuse_tenant_prompt_tokens_total{tenant="key1"}' in metrics
    assert 'splitfuse_tenant_prompt_tokens_total{tenant="key2"}' in metrics


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("priority", ["1", 1.5, True, 2**31, None])
def test_a_priority_that_is_not_an_integer_is_a_400_naming_it(
    tiny_server: ServerThread, route: str, priority: object
) -> None:
    body: dict = {"max_tokens": 1, "priority": priority}
    if route == "/v1/completions":
        body["prompt"] = "x"
    else:
        body["messages"] = [{"role": "user", "content": "x"}]
    response = httpx.post(tiny_server.url + route, json=body, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "priority"


def test_both_routes_take_a_priority(tiny_server: ServerThread) -> None:
    for route, body in (
        ("/v1/completions", {"prompt": "x", "max_tokens": 1, "priority": -3}),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1, "priority": 7},
        ),  # fmt: skip
    ):
        assert httpx.post(tiny_server.url + route, json=body, timeout=30).status_code == 200


def _post_in_thread(url: str, body: dict, results: list[httpx.Response]) -> threading.Thread:
    def post() -> None:
        results.append(httpx.post(url + "/v1/completions", json=body, timeout=60))

    thread = threading.Thread(target=post)
    thread.start()
    return thread


def _slow(config: object) -> SlowStepEngine:
    return SlowStepEngine(config, 0.2)  # type: ignore[arg-type]


def test_a_full_queue_evicts_the_lowest_priority_for_a_higher_one(
    start_server: Callable[..., ServerThread],
) -> None:
    server = start_server(
        engine={"scheduling_policy": "priority"}, engine_factory=_slow, max_queued_requests=2
    )
    long_body = {"prompt": "x", "max_tokens": 12, "ignore_eos": True}
    results: list[httpx.Response] = []
    # one running (its first token sent), then two queued behind the slow steps
    runner = _post_in_thread(server.url, {**long_body, "priority": 0}, results)
    deadline = time.monotonic() + 30
    while server.state.engine.num_in_flight < 1 or server.state.num_queued:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    low = [_post_in_thread(server.url, {**long_body, "priority": p}, results) for p in (3, 9)]
    while server.state.num_queued < 2:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    # equal to the lowest queued: refused, nothing evicted
    refused = httpx.post(server.url + "/v1/completions", json={**long_body, "priority": 9})
    assert refused.status_code == 429 and "Retry-After" in refused.headers
    high = httpx.post(server.url + "/v1/completions", json={**long_body, "priority": 1}, timeout=60)
    assert high.status_code == 200, high.text
    for thread in [runner, *low]:
        thread.join(60)
    statuses = sorted(r.status_code for r in results)
    assert statuses == [200, 200, 429]
    (evicted,) = [r for r in results if r.status_code == 429]
    assert evicted.headers["Retry-After"] == "1"
    assert "evicted" in evicted.json()["error"]["message"]
    metrics = httpx.get(server.url + "/metrics").text
    assert "splitfuse_requests_evicted_total 1.0" in metrics


def test_fcfs_refuses_instead_of_evicting(start_server: Callable[..., ServerThread]) -> None:
    server = start_server(engine_factory=_slow, max_queued_requests=1)
    results: list[httpx.Response] = []
    queued = _post_in_thread(server.url, {"prompt": "x", "max_tokens": 2, "priority": 9}, results)
    deadline = time.monotonic() + 30
    while server.state.num_queued < 1:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    refused = httpx.post(server.url + "/v1/completions", json={"prompt": "y", "priority": -5})
    assert refused.status_code == 429
    queued.join(60)
    assert results[0].status_code == 200


def test_a_malformed_tenant_header_is_a_400(start_server: Callable[..., ServerThread]) -> None:
    server = start_server(tenant_header="X-Tenant-Id")
    body = {"prompt": "x", "max_tokens": 1}
    bad = httpx.post(
        server.url + "/v1/completions", json=body, headers={"X-Tenant-Id": "a b/c"}, timeout=30
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "x-tenant-id"
    good = httpx.post(
        server.url + "/v1/completions", json=body, headers={"X-Tenant-Id": "team-a"}, timeout=30
    )
    assert good.status_code == 200
    assert 'tenant="team-a"' in httpx.get(server.url + "/metrics").text


def test_liveness_stays_200_while_draining_and_readiness_turns_503(
    start_server: Callable[..., ServerThread],
) -> None:
    server = start_server(engine_factory=_slow, drain_timeout=30)
    results: list[httpx.Response] = []
    body = {"prompt": "x", "max_tokens": 10, "ignore_eos": True}  # two seconds of slow steps
    in_flight = _post_in_thread(server.url, body, results)
    deadline = time.monotonic() + 30
    while server.state.engine.num_in_flight < 1:  # in the engine, not still being parsed
        assert time.monotonic() < deadline
        time.sleep(0.01)
    server.drain()
    while not server.state.draining:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert httpx.get(server.url + "/livez").status_code == 200
    assert httpx.get(server.url + "/readyz").status_code == 503
    assert httpx.get(server.url + "/health").status_code == 503
    in_flight.join(60)
    assert results[0].status_code == 200


def test_top_renders_a_frame_from_a_live_server(
    tiny_server: ServerThread, capsys: pytest.CaptureFixture[str]
) -> None:
    from server.cli import main

    body = {"prompt": "x", "max_tokens": 2}
    assert httpx.post(tiny_server.url + "/v1/completions", json=body, timeout=30).status_code == 200
    assert main(["top", "--url", tiny_server.url, "--once", "--interval", "0.2"]) == 0
    frame = capsys.readouterr().out
    assert frame.startswith(f"splitfuse top - {tiny_server.url}")
    assert "requests   running" in frame and "TTFT" in frame and "tenant share" in frame
    assert main(["top", "--url", "http://127.0.0.1:9", "--once", "--interval", "0.05"]) == 1
    assert "unreachable" in capsys.readouterr().out
