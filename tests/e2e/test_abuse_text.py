"""Text-side abuse against the real server: stop strings past the length limit and non-canonical
logit_bias keys are refused with a 400 in the OpenAI error shape; the longest allowed stop strings,
with their longest held-back text on every sequence, leave the event loop answering /livez."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from server.protocol import MAX_STOP_STRING_CHARS
from server.runner import ServerThread
from tests.e2e.conftest import LIVEZ_P99_BOUND

if TYPE_CHECKING:
    from tests.e2e.conftest import ServerProcess


def _assert_400(response: httpx.Response, param: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    assert "Error(" not in error["message"]


@pytest.mark.parametrize(
    "stop",
    [
        "s" * (MAX_STOP_STRING_CHARS + 1),
        ["ok", "s" * 8192],
    ],
)
def test_long_stop_strings_are_400(tiny_server: ServerThread, stop: Any) -> None:
    url = tiny_server.url
    for path, body in (
        ("/v1/completions", {"prompt": "x"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
    ):
        _assert_400(httpx.post(url + path, json={**body, "stop": stop, "max_tokens": 2}), "stop")


@pytest.mark.parametrize("key", ["²", "01", " 1", "1 ", "+1", "١", "9" * 5000])
def test_non_canonical_logit_bias_keys_are_400(tiny_server: ServerThread, key: str) -> None:
    body = {"prompt": "x", "max_tokens": 2, "logit_bias": {key: 5}}
    _assert_400(httpx.post(tiny_server.url + "/v1/completions", json=body), "logit_bias")


def test_longest_allowed_stop_strings_keep_livez_fast(
    tiny_server: ServerThread,
    tiny_server_process: ServerProcess,
    tiny_tokenizer: Any,
    livez_under_load: Callable[..., list[float]],
) -> None:
    # Every token is 'a': the last stop string holds back its 255 'a's on every delta of every
    # sequence, and the 15 others, as long, never begin to match.
    (a_id,) = tiny_tokenizer.encode("a", add_special_tokens=False)
    stop = [c * MAX_STOP_STRING_CHARS for c in "bcdefghijklmnop"]
    stop.append("a" * (MAX_STOP_STRING_CHARS - 1) + "b")
    body = {
        "prompt": "x",
        "max_tokens": 300,
        "n": 8,
        "temperature": 0,
        "ignore_eos": True,
        "logit_bias": {str(a_id): 100},
        "stop": stop,
    }
    response = httpx.post(tiny_server.url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    for choice in response.json()["choices"]:
        assert choice["text"] == "a" * 300 and choice["finish_reason"] == "length"
    latencies = livez_under_load(tiny_server_process, body, num_clients=4, join_seconds=30)
    assert statistics.quantiles(latencies, n=100)[98] < LIVEZ_P99_BOUND
