"""Inputs that used to answer 500 with an exception's text, close the connection or mislabel the
metrics, sent to the real server: each gets a 400 (or a generic 500) in the OpenAI error shape and
leaves the connection usable."""

from __future__ import annotations

import time

import httpx
import pytest

from server.runner import ServerThread

HEADERS = {"content-type": "application/json"}


def _assert_clean_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    # no exception class or repr reaches the client
    for leak in ("Error(", "Traceback", "Exception", "TypeError", "ValueError"):
        assert leak not in response.text
    return error


@pytest.mark.parametrize(
    ("path", "raw"),
    [
        ("/v1/completions", b'{"prompt": "a\\ud800b", "max_tokens": 2}'),
        ("/v1/completions", b'{"prompt": ["ok", "\\udfff"], "max_tokens": 2}'),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud83d"}]}'),
        ("/tokenize", b'{"prompt": "\\uDC00"}'),
        ("/v1/completions", b'{"prompt": "x", "\\ud800": 1}'),
    ],
)
def test_lone_surrogates_are_400(tiny_server: ServerThread, path: str, raw: bytes) -> None:
    with httpx.Client(base_url=tiny_server.url) as client:
        error = _assert_clean_error(client.post(path, content=raw, headers=HEADERS), 400)
        assert "surrogate" in error["message"]
        # the same connection serves the next request
        assert client.get("/livez").status_code == 200


def test_paired_surrogate_escapes_are_text(tiny_server: ServerThread) -> None:
    raw = b'{"prompt": "smile \\ud83d\\ude00"}'
    response = httpx.post(tiny_server.url + "/tokenize", content=raw, headers=HEADERS)
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        (b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", "not valid JSON"),
        (b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nests too deeply"),
        (b'{"prompt": "x", "max_tokens": 2', "not valid JSON"),
        (b"\xff\xfe", "not valid JSON"),
    ],
)
def test_malformed_json_is_400(tiny_server: ServerThread, raw: bytes, words: str) -> None:
    with httpx.Client(base_url=tiny_server.url) as client:
        response = client.post("/v1/completions", content=raw, headers=HEADERS)
        error = _assert_clean_error(response, 400)
        assert words in error["message"]
        assert client.get("/livez").status_code == 200


def _count(server: ServerThread, **labels: str) -> float:
    value = server.state.metrics.registry.get_sample_value("splitfuse_http_requests_total", labels)
    return value or 0.0


def _count_reaches(server: ServerThread, expected: float, **labels: str) -> bool:
    """Whether the count reaches ``expected`` within a few seconds: a request is counted once
    its response has gone out, so the client may see the answer before the count moves."""
    deadline = time.monotonic() + 5
    while _count(server, **labels) < expected and time.monotonic() < deadline:
        time.sleep(0.01)
    return _count(server, **labels) == expected


def test_an_unhandled_error_is_a_generic_500_counted_as_500(
    start_server, monkeypatch, caplog
) -> None:
    server = start_server()

    def broken() -> None:
        raise RuntimeError("secret detail from deep inside")

    monkeypatch.setattr(server.state, "check_accepting", broken)
    labels = {"method": "GET", "route": "/v1/models", "status_code": "500"}
    before = _count(server, **labels)
    with httpx.Client(base_url=server.url) as client:
        response = client.get("/v1/models")
        error = _assert_clean_error(response, 500)
        assert "secret detail" not in response.text and "error id" in error["message"]
        # the connection is kept: the next request on it is answered
        assert client.get("/livez").status_code == 200
    assert _count_reaches(server, before + 1, **labels)
    error_id = error["message"].split("error id ")[1].rstrip(")")
    assert error_id in caplog.text and "secret detail" in caplog.text


def test_unknown_methods_share_one_metrics_label(tiny_server: ServerThread) -> None:
    before = _count(tiny_server, method="other", route="/livez", status_code="405")
    for method in ("BREW", "PROPFIND", "X-ANYTHING"):
        httpx.request(method, tiny_server.url + "/livez")
    assert _count_reaches(
        tiny_server, before + 3, method="other", route="/livez", status_code="405"
    )
    text = httpx.get(tiny_server.url + "/metrics").text
    assert 'method="BREW"' not in text and 'method="PROPFIND"' not in text


def test_nothing_about_the_machine_is_disclosed(tiny_server: ServerThread) -> None:
    """No filesystem path in /v1/models, no OpenAPI schema or docs pages."""
    model = httpx.get(tiny_server.url + "/v1/models").json()["data"][0]
    assert model["root"] == model["id"] and "/" not in model["root"]
    for path in ("/openapi.json", "/docs", "/redoc"):
        assert httpx.get(tiny_server.url + path).status_code == 404
