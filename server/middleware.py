"""Pure ASGI middleware (no buffering of responses, so SSE and disconnects pass straight through):
request metrics and counting, unhandled errors, API-key auth, and the body size limit.

    client -> MetricsMiddleware -> ErrorMiddleware -> AuthMiddleware -> BodyLimitMiddleware -> app
"""

from __future__ import annotations

import hmac
import json
import logging
import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from server.errors import APIError

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

GENERATION_ROUTES = frozenset({"/v1/completions", "/v1/chat/completions"})
KNOWN_ROUTES = GENERATION_ROUTES | {
    "/v1/models",
    "/tokenize",
    "/detokenize",
    "/livez",
    "/readyz",
    "/health",
    "/metrics",
}
HEALTH_ROUTES = frozenset({"/livez", "/readyz", "/health"})
# the metrics' method label: any other string a client sends is counted as "other"
KNOWN_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})

logger = logging.getLogger("splitfuse.server")


async def send_error(send: Send, error: APIError) -> None:
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    for name, value in (error.headers or {}).items():
        headers.append((name.lower().encode(), value.encode()))
    await send({"type": "http.response.start", "status": error.status_code, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class MetricsMiddleware:
    """Counts HTTP requests by method, route and status; tracks in-flight generation requests
    (the drain waits for them)."""

    def __init__(self, app: ASGIApp, state: Any) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        route = path if path in KNOWN_ROUTES else "other"
        status = {"code": 500}

        async def send_wrapper(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        generation = path in GENERATION_ROUTES
        if generation:
            self.state.num_active += 1
        try:
            await self.app(scope, receive, send_wrapper)
        except BaseException:
            status["code"] = 499 if status["code"] == 500 else status["code"]
            raise
        finally:
            if generation:
                self.state.num_active -= 1
            method = scope["method"] if scope["method"] in KNOWN_METHODS else "other"
            self.state.metrics.http_requests.labels(
                method=method, route=route, status_code=str(status["code"])
            ).inc()


class ErrorMiddleware:
    """An exception no handler turned into a response: logged with an error id, answered with a
    500 that names only that id (never the exception's text), and swallowed, so the connection
    stays open for the client's next request. Inside MetricsMiddleware, which counts the 500. A
    response already under way (a stream) cannot be replaced: its connection is closed."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_wrapper(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        except Exception:
            error_id = uuid.uuid4().hex[:16]
            logger.exception(
                "unhandled error %s in %s %s", error_id, scope["method"], scope["path"]
            )
            if started:
                raise
            message = f"internal server error (error id {error_id})"
            await send_error(send, APIError(500, message, code="internal_error"))


class AuthMiddleware:
    """401 unless ``Authorization: Bearer <key>`` holds one of the keys (constant-time compare,
    every key compared). Health routes stay open; /metrics too unless configured otherwise."""

    def __init__(self, app: ASGIApp, keys: tuple[str, ...], metrics_require_auth: bool) -> None:
        self.app = app
        self.keys = tuple(key.encode() for key in keys)
        self.open_routes = HEALTH_ROUTES if metrics_require_auth else HEALTH_ROUTES | {"/metrics"}

    def authorized(self, scope: Scope) -> bool:
        header = b""
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                header = value
                break
        scheme, _, token = header.partition(b" ")
        token = token.strip()
        matched = False
        for key in self.keys:
            matched |= hmac.compare_digest(token, key)
        return matched and scheme.lower() == b"bearer"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or not self.keys
            or scope["path"] in self.open_routes
            or self.authorized(scope)
        ):
            await self.app(scope, receive, send)
            return
        error = APIError(
            401,
            "a valid API key is required: send 'Authorization: Bearer <key>'",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )
        await send_error(send, error)


class BodyLimitMiddleware:
    """413 for a body over ``max_body_bytes``: at once from Content-Length, otherwise while
    reading (chunked bodies are buffered up to the limit and replayed)."""

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    def _too_large(self) -> APIError:
        return APIError(
            413,
            f"the request body is larger than the limit of {self.max_body_bytes} bytes",
            code="request_too_large",
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = self.max_body_bytes + 1
                if declared > self.max_body_bytes:
                    await send_error(send, self._too_large())
                    return
        chunks: list[bytes] = []
        num_bytes = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left while sending
            chunk = message.get("body", b"")
            num_bytes += len(chunk)
            if num_bytes > self.max_body_bytes:
                await send_error(send, self._too_large())
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)
