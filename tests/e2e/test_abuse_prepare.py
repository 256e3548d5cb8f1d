"""Big bodies are parsed, validated and tokenized off the event loop: /livez keeps answering
within 100 ms (p99) while clients keep sending them, and a text too long for any context is
refused before it is tokenized."""

from __future__ import annotations

import json
import statistics
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from server.runner import ServerThread
from tests.e2e.conftest import LIVEZ_P99_BOUND, probe_livez

if TYPE_CHECKING:
    from tests.e2e.conftest import ServerProcess

# ~1.9 MB each, under the 2 MiB body limit
_IDS = list(range(1, 900)) * 420
_BIG_BODIES = [
    ("/v1/completions", {"prompt": _IDS, "max_tokens": 1}),  # validated, then too long: 400
    ("/v1/completions", {"prompt": [_IDS[:700]] * 520, "max_tokens": 1}),  # 400: too many
    ("/detokenize", {"tokens": _IDS}),  # 200, a long text
    ("/tokenize", {"prompt": "lorem ipsum " * 160_000}),  # 400 before tokenizing
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "ab " * 640_000}]}),
]


@pytest.fixture(scope="module")
def encoded() -> list[tuple[str, bytes]]:
    return [(path, json.dumps(body).encode()) for path, body in _BIG_BODIES]


def _livez_while_posting(
    url: str, bodies: list[tuple[str, bytes]], num_clients: int = 2
) -> tuple[list[float], list[int]]:
    stop = threading.Event()
    statuses: list[int] = []

    def client(offset: int) -> None:
        with httpx.Client(base_url=url, timeout=120) as http:
            index = offset
            while not stop.is_set():
                path, raw = bodies[index % len(bodies)]
                index += 1
                response = http.post(
                    path, content=raw, headers={"Content-Type": "application/json"}
                )
                statuses.append(response.status_code)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(num_clients)]
    for thread in threads:
        thread.start()
    time.sleep(0.5)
    latencies = probe_livez(url)
    stop.set()
    for thread in threads:
        thread.join(120)
    return latencies, statuses


def test_livez_answers_while_big_bodies_are_prepared(
    tiny_server_process: ServerProcess, encoded: list[tuple[str, bytes]]
) -> None:
    latencies, statuses = _livez_while_posting(tiny_server_process.url, encoded)
    p99 = statistics.quantiles(latencies, n=100)[98]
    print(f"/livez while big bodies are prepared: p50 {statistics.median(latencies) * 1e3:.1f} "
          f"ms, p99 {p99 * 1e3:.1f} ms, {len(statuses)} bodies")  # fmt: skip
    assert len(statuses) >= len(encoded)
    assert set(statuses) <= {200, 400}
    assert p99 < LIVEZ_P99_BOUND


@pytest.fixture
def client(tiny_server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=tiny_server.url, timeout=60) as http:
        yield http


def test_a_text_too_long_for_the_context_is_refused_untokenized(client: httpx.Client) -> None:
    for path, body, param in [
        ("/tokenize", {"prompt": "x" * 2_000_000}, "prompt"),
        ("/v1/completions", {"prompt": "x" * 2_000_000}, "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 2_000_000}]},
         "messages"),
    ]:  # fmt: skip
        start = time.perf_counter()
        response = client.post(path, json=body)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["code"] == "context_length_exceeded" and error["param"] == param
        assert time.perf_counter() - start < 5


def test_token_ids_are_checked_as_before(client: httpx.Client) -> None:
    for prompt in ([1, -1], [[1], []], [1, True], [1.0, 2], [[1], "a"], ["a", [1]], []):
        response = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
        assert response.status_code == 400, (prompt, response.text)
        assert response.json()["error"]["param"] == "prompt"
    ok = client.post("/v1/completions", json={"prompt": [[5, 6], [7]], "max_tokens": 1})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 2
    bad = client.post("/detokenize", json={"tokens": [1, "2"]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert client.post("/detokenize", json={"tokens": [5, 6]}).status_code == 200


def test_a_long_detokenize_gives_the_tokenizers_own_text(
    client: httpx.Client, tiny_tokenizer: Any
) -> None:
    """Long lists are decoded with the GIL released (another call of the tokenizer): same text,
    special tokens skipped as before."""
    ids = [*range(900), tiny_tokenizer.eos_token_id] * 20
    response = client.post("/detokenize", json={"tokens": ids})
    assert response.status_code == 200, response.text
    assert response.json()["prompt"] == tiny_tokenizer.decode(ids, skip_special_tokens=True)
