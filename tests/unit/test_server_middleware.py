"""Auth and body-limit middleware, driven as plain ASGI apps."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from server.middleware import AuthMiddleware, BodyLimitMiddleware


async def _echo_app(scope: dict, receive: Any, send: Any) -> None:
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": body})


def _call(
    app: Any,
    path: str = "/v1/completions",
    headers: list | None = None,
    chunks: list[bytes] | None = None,
    method: str = "POST",
) -> tuple[int, bytes]:
    scope = {"type": "http", "path": path, "method": method, "headers": headers or []}
    pending = [
        {"type": "http.request", "body": chunk, "more_body": i < len(chunks or [b""]) - 1}
        for i, chunk in enumerate(chunks or [b""])
    ]
    sent: list[dict] = []

    async def receive() -> dict:
        return pending.pop(0) if pending else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return sent[0]["status"], body


def test_auth_accepts_any_configured_key_only_as_bearer() -> None:
    app = AuthMiddleware(_echo_app, ("alpha", "beta"), metrics_require_auth=False)
    assert _call(app)[0] == 401
    assert _call(app, headers=[(b"authorization", b"Bearer beta")])[0] == 200
    assert _call(app, headers=[(b"authorization", b"bearer alpha")])[0] == 200
    assert _call(app, headers=[(b"authorization", b"Bearer alph")])[0] == 401
    assert _call(app, headers=[(b"authorization", b"Token alpha")])[0] == 401
    status, body = _call(app, headers=[(b"authorization", b"Bearer ")])
    assert status == 401
    assert json.loads(body)["error"]["type"] == "authentication_error"


def test_auth_leaves_health_open_and_metrics_as_configured() -> None:
    open_metrics = AuthMiddleware(_echo_app, ("k",), metrics_require_auth=False)
    closed_metrics = AuthMiddleware(_echo_app, ("k",), metrics_require_auth=True)
    for path in ("/livez", "/readyz", "/health"):
        assert _call(open_metrics, path, method="GET")[0] == 200
        assert _call(closed_metrics, path, method="GET")[0] == 200
    assert _call(open_metrics, "/metrics", method="GET")[0] == 200
    assert _call(closed_metrics, "/metrics", method="GET")[0] == 401


def test_no_keys_means_no_auth() -> None:
    assert _call(AuthMiddleware(_echo_app, (), metrics_require_auth=True))[0] == 200


def test_body_limit_by_content_length_and_by_counting() -> None:
    app = BodyLimitMiddleware(_echo_app, max_body_bytes=10)
    assert _call(app, headers=[(b"content-length", b"11")], chunks=[b"x" * 11])[0] == 413
    assert _call(app, chunks=[b"x" * 6, b"y" * 6])[0] == 413  # chunked, no length
    status, body = _call(app, chunks=[b"x" * 4, b"y" * 6])
    assert (status, body) == (200, b"xxxxyyyyyy")  # replayed whole
    assert _call(app, method="GET", chunks=[b"z" * 50])[0] == 200  # GET bodies are not limited
