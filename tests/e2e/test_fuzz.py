"""A fuzz pass over the request schemas: whatever the body, the answer is never a 5xx. The
strategies reach what hostile clients send: lone surrogates, huge numbers, deep nesting, long stop
strings, big ``n`` and long prompt lists."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from server.runner import ServerThread

# text that may hold lone UTF-16 surrogates (JSON escapes them as \\udXXX, which Python decodes)
_hostile_text = st.text(
    st.characters(max_codepoint=0x7F) | st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF),
    max_size=12,
)
_text = st.text(max_size=20) | _hostile_text
_scalars = st.none() | st.booleans() | st.integers() | st.floats() | _text
_anything = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=8,
)
_small_int = st.integers(min_value=-3, max_value=40)
_token_ids = st.lists(st.integers(min_value=-2, max_value=1100), max_size=6)

_common: dict[str, st.SearchStrategy[Any]] = {
    "model": st.none() | st.sampled_from(["tiny-llama", "other"]) | st.text(max_size=5),
    "max_tokens": st.none() | _small_int | st.sampled_from([10**6, 1.5, "8"]),
    "temperature": st.none() | st.floats(allow_nan=True, allow_infinity=True) | st.just(0),
    "top_p": st.none() | st.floats(min_value=-1, max_value=2),
    "top_k": st.none() | _small_int,
    "min_p": st.none() | st.floats(min_value=-1, max_value=2),
    "n": st.integers(min_value=-1, max_value=3) | st.sampled_from([16, 128, 129, 10**9]),
    "stop": st.none()
    | _text
    | st.lists(st.text(max_size=3), max_size=3)
    | st.sampled_from([["x" * 257], ["ab" * 2000], ["e"] * 100]),
    "stop_token_ids": st.none() | _token_ids,
    "seed": st.none() | st.integers(min_value=-(2**70), max_value=2**70),
    "presence_penalty": st.floats(min_value=-3, max_value=3),
    "frequency_penalty": st.floats(min_value=-3, max_value=3),
    "repetition_penalty": st.floats(min_value=-1, max_value=3),
    "logit_bias": st.dictionaries(
        st.sampled_from(["1", "5", "999", "-1", "x", "100000"]),
        st.floats(min_value=-200, max_value=200),
        max_size=3,
    ),
    "stream": st.booleans(),
    "stream_options": st.none() | st.fixed_dictionaries({"include_usage": st.booleans()}),
    "ignore_eos": st.booleans(),
    "min_tokens": _small_int,
    "anything_else": _anything,
}
_completion_only = {
    "prompt": st.text(max_size=30)
    | _hostile_text
    | st.lists(st.text(max_size=10), max_size=3)
    | st.integers(min_value=1, max_value=300).map(lambda size: ["x"] * size)
    | _token_ids
    | st.lists(_token_ids, max_size=3)
    | _anything,
    "logprobs": st.none() | _small_int,
    "echo": st.booleans(),
    "suffix": st.none() | st.text(max_size=3),
}
_message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["system", "user", "assistant", "tool", "developer", "x"]),
        "content": st.none()
        | _text
        | st.lists(
            st.fixed_dictionaries(
                {"type": st.sampled_from(["text", "image_url"]), "text": st.text(max_size=8)}
            ),
            max_size=2,
        ),
    }
)
_chat_only = {
    "messages": st.lists(_message, max_size=3) | _anything,
    "max_completion_tokens": st.none() | _small_int,
    "logprobs": st.booleans(),
    "top_logprobs": st.none() | _small_int,
    "response_format": st.none() | st.sampled_from([{"type": "text"}, {"type": "json_object"}]),
    "tools": st.none() | st.just([]) | st.just([{"type": "function"}]),
}


def _bodies(fields: dict[str, st.SearchStrategy[Any]]) -> st.SearchStrategy[dict[str, Any]]:
    """Bodies holding a random subset of the fields."""
    return st.fixed_dictionaries({}, optional=fields)


def _check(client: httpx.Client, path: str, body: dict[str, Any]) -> None:
    # Bound the work of bodies that happen to be valid.
    if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 8:
        body["max_tokens"] = 8
    body.setdefault("max_tokens", 4)
    # Python's encoder writes NaN and Infinity, which Python's decoder (the server's) accepts.
    content = json.dumps(body, allow_nan=True)
    response = client.post(path, content=content, headers={"Content-Type": "application/json"})
    assert response.status_code < 500, (body, response.text)
    if response.status_code >= 400:
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    elif body.get("stream"):
        assert response.text.rstrip().endswith("data: [DONE]")


_settings = settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    derandomize=True,
)


@pytest.fixture(scope="module")
def client(tiny_server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=tiny_server.url, timeout=60) as client:
        yield client


@_settings
@given(body=_bodies({**_common, **_completion_only}))
def test_completions_never_5xx(client: httpx.Client, body: dict[str, Any]) -> None:
    _check(client, "/v1/completions", body)


@_settings
@given(body=_bodies({**_common, **_chat_only}))
def test_chat_never_5xx(client: httpx.Client, body: dict[str, Any]) -> None:
    _check(client, "/v1/chat/completions", body)


# Bodies that are not what json.dumps writes: numbers past Python's 4,300-digit limit, nesting
# past the recursion limit, bytes that are not UTF-8, escapes of lone surrogates.
_raw_bodies = st.sampled_from(
    [
        b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}",
        b'{"prompt": "x", "seed": -' + b"1" * 4400 + b"}",
        b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        b'{"messages": ' + b'{"a": ' * 5000 + b"1" + b"}" * 5001,
        b'{"prompt": "\\ud800", "max_tokens": 2}',
        b'{"prompt": "\\udfff\\ud83d", "stop": ["\\udc00"], "max_tokens": 2}',
        b'{"prompt": "\\ud83d\\ude00", "max_tokens": 2}',  # a valid pair: 200
        b'{"messages": [{"role": "user", "content": "\\udbff"}], "max_tokens": 2}',
        b'{"prompt": "x\xff\xfe", "max_tokens": 2}',
        b'{"prompt": 1e999, "max_tokens": 2}',
    ]
)


@settings(max_examples=20, deadline=None, derandomize=True)
@given(
    raw=_raw_bodies,
    path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/tokenize"]),
)
def test_hostile_raw_bodies_are_400s(client: httpx.Client, raw: bytes, path: str) -> None:
    response = client.post(path, content=raw, headers={"Content-Type": "application/json"})
    assert response.status_code < 500, (raw[:80], response.text)
    if response.status_code >= 400:
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
