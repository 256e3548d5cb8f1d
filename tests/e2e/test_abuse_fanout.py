"""Abusive fan-out and per-step cost, sent to the real server: a huge prompt list, a large n,
every stop_token_id and logit_bias entry allowed and more. Over a limit: a 400 naming the param
(or 429 when the queue is full) in the OpenAI error shape; at the limit: the call completes, and
/livez keeps answering within 100 ms meanwhile."""

from __future__ import annotations

import json
import statistics
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from engine.config import EngineConfig
from scheduler.sampling_params import MAX_LOGIT_BIAS, MAX_STOP_TOKEN_IDS
from server.app import default_engine_factory
from server.protocol import MAX_PROMPTS
from server.runner import ServerThread
from tests.e2e.conftest import LIVEZ_P99_BOUND

if TYPE_CHECKING:
    from tests.e2e.conftest import ServerProcess

MAX_SEQUENCES = 128  # the default max_sequences_per_request
# The largest fan-out allowed, carrying every stop id and bias entry allowed.
LARGEST = {
    "prompt": [f"the city river {i}" for i in range(16)],
    "n": MAX_SEQUENCES // 16,
    "max_tokens": 4,
    "stop_token_ids": list(range(500, 500 + MAX_STOP_TOKEN_IDS)),
    "logit_bias": {str(token_id): 0.5 for token_id in range(100, 100 + MAX_LOGIT_BIAS)},
}


def _assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["param"] == param
    return error


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        # more prompts than any server takes: refused before the items are validated
        ("/v1/completions", {"prompt": [[1, 2]] * 100_000}, "prompt"),
        ("/v1/completions", {"prompt": ["x"] * (MAX_PROMPTS + 1)}, "prompt"),
        # over this server's prompts x n
        ("/v1/completions", {"prompt": ["x"] * (MAX_SEQUENCES + 1)}, "prompt"),
        ("/v1/completions", {"prompt": ["x"] * 16, "n": 16}, "n"),
        ("/v1/completions", {"prompt": [[5]] * 2, "n": 128}, "n"),
        ("/v1/chat/completions", {"n": 129}, "n"),
        # more stop ids or bias entries than a request may carry
        ("/v1/completions", {"stop_token_ids": list(range(MAX_STOP_TOKEN_IDS + 1))}, None),
        ("/v1/chat/completions", {"stop_token_ids": [7] * 10_000}, None),
        ("/v1/completions", {"logit_bias": {str(t): 1 for t in range(MAX_LOGIT_BIAS + 1)}}, None),
        ("/v1/chat/completions", {"logit_bias": {str(t): -1 for t in range(900)}}, None),
    ],
)
def test_over_a_limit_is_a_400_naming_the_param(
    tiny_server: ServerThread, path: str, body: dict[str, Any], param: str | None
) -> None:
    if path == "/v1/chat/completions":
        body = {"messages": [{"role": "user", "content": "hi"}], **body}
    else:
        body = {"prompt": "x", **body}
    expected = param or next(key for key in ("stop_token_ids", "logit_bias") if key in body)
    error = _assert_error(httpx.post(tiny_server.url + path, json=body, timeout=30), 400, expected)
    assert len(error["message"]) < 300  # the size, not the list


def test_the_largest_fanout_completes(tiny_server: ServerThread) -> None:
    response = httpx.post(tiny_server.url + "/v1/completions", json=LARGEST, timeout=60)
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    assert [choice["index"] for choice in choices] == list(range(MAX_SEQUENCES))
    assert {choice["finish_reason"] for choice in choices} <= {"stop", "length"}
    chat = {"messages": [{"role": "user", "content": "hi"}], "n": MAX_SEQUENCES, "max_tokens": 2}
    response = httpx.post(tiny_server.url + "/v1/chat/completions", json=chat, timeout=60)
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == MAX_SEQUENCES
    assert not tiny_server.state.engine.engine.has_unfinished_requests()


class _GatedEngine:
    """The real engine, whose steps wait for ``gate``."""

    def __init__(self, config: EngineConfig) -> None:
        self.inner = default_engine_factory(config)
        self.gate = threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def step(self) -> list:
        while not self.gate.wait(0.01):
            pass
        return self.inner.step()


def test_every_sequence_counts_against_the_queue(start_server: Callable[..., ServerThread]) -> None:
    engines: list[_GatedEngine] = []

    def factory(config: EngineConfig) -> _GatedEngine:
        engines.append(_GatedEngine(config))
        return engines[0]

    server = start_server(engine_factory=factory, max_queued_requests=8)
    url = server.url + "/v1/completions"
    # more than the whole queue: it could never be admitted, so a 400, not a 429 to retry
    _assert_error(httpx.post(url, json={"prompt": "x", "n": 9}), 400, "n")
    results: list[httpx.Response] = []
    body = {"prompt": ["a", "b", "c", "d"], "n": 2, "max_tokens": 2}
    waiting = threading.Thread(target=lambda: results.append(httpx.post(url, json=body)))
    waiting.start()
    deadline = time.monotonic() + 10
    while server.state.num_queued != 8:
        assert time.monotonic() < deadline and waiting.is_alive()
        time.sleep(0.01)
    # one API call of 8 sequences fills a queue of 8: the next single prompt is refused
    response = httpx.post(url, json={"prompt": "y"})
    error = _assert_error(response, 429)
    assert "8 sequences waiting" in error["message"]
    assert int(response.headers["Retry-After"]) >= 1
    engines[0].gate.set()
    waiting.join(30)
    assert results[0].status_code == 200 and len(results[0].json()["choices"]) == 8
    assert server.state.num_queued == 0
    assert httpx.post(url, json={"prompt": "y", "max_tokens": 1}).status_code == 200


def test_livez_stays_fast_while_the_largest_fanouts_run_and_abuse_is_refused(
    tiny_server_process: ServerProcess, livez_under_load: Callable[..., list[float]]
) -> None:
    refused_bodies = [
        json.dumps(body).encode()
        for body in (
            {"prompt": [[1, 2]] * (MAX_PROMPTS + 1)},
            {**LARGEST, "n": LARGEST["n"] + 1},
            {**LARGEST, "stop_token_ids": list(range(MAX_STOP_TOKEN_IDS + 1))},
        )
    ]
    stop = threading.Event()
    statuses: list[int] = []

    def abuse() -> None:
        with httpx.Client(base_url=tiny_server_process.url, timeout=30) as client:
            while not stop.is_set():
                for body in refused_bodies:
                    response = client.post(
                        "/v1/completions",
                        content=body,
                        headers={"content-type": "application/json"},
                    )
                    statuses.append(response.status_code)
                stop.wait(0.02)

    abuser = threading.Thread(target=abuse, daemon=True)
    abuser.start()
    try:
        latencies = livez_under_load(tiny_server_process, LARGEST, num_clients=2, join_seconds=30)
    finally:
        stop.set()
        abuser.join(30)
    assert statuses and set(statuses) == {400}
    assert statistics.quantiles(latencies, n=100)[98] < LIVEZ_P99_BOUND
