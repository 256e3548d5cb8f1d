"""The FastAPI app: routes, error handlers, middleware and the engine's lifetime.

``create_app(config)`` returns an app that starts loading the engine (in the engine thread) when
it starts up: ``/livez`` answers at once, ``/readyz`` and the generation routes answer 503 until
the model is ready.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.config import EngineConfig
from server.async_engine import AsyncEngine
from server.chat import create_chat_completion
from server.completions import create_completion
from server.config import ServerConfig
from server.errors import APIError, error_body, validation_error
from server.metrics import CONTENT_TYPE, ServerMetrics
from server.middleware import (
    AuthMiddleware,
    BodyLimitMiddleware,
    ErrorMiddleware,
    MetricsMiddleware,
)
from server.openapi import openapi_schema
from server.protocol import DetokenizeRequest, TokenizeRequest, template_messages
from server.serving import ClientDisconnected, ServerState, read_body
from server.tokens import TokenText

logger = logging.getLogger("splitfuse.server")

EngineFactory = Callable[[EngineConfig], Any]

# How often the loading display reports progress.
_LOADING_REPORT_SECONDS = 5.0


def default_engine_factory(config: EngineConfig) -> Any:
    """The real engine (imported here: the engine is heavy and tests may replace it)."""
    from engine.llm_engine import LLMEngine

    return LLMEngine(config)


def _load_with_progress(factory: EngineFactory, config: EngineConfig) -> Any:
    """Runs the factory while logging elapsed time, then the start-up line with the block count
    and the resident memory (the KV cache is committed by then)."""
    start = time.monotonic()
    done = threading.Event()

    def report() -> None:
        while not done.wait(_LOADING_REPORT_SECONDS):
            logger.info("loading %s ... %.0f s", config.model, time.monotonic() - start)

    logger.info("loading %s", config.model)
    reporter = threading.Thread(target=report, name="splitfuse-loading", daemon=True)
    reporter.start()
    try:
        engine = factory(config)
    finally:
        done.set()
    resolved = getattr(engine, "config", config)
    from engine.step_graphs import resident_mib

    logger.info(
        "engine ready in %.1f s: model=%s dtype=%s kv_cache_dtype=%s quantization=%s "
        "num_kv_blocks=%s max_model_len=%s rss_mib=%.0f config=%s",
        time.monotonic() - start,
        getattr(engine, "model_name", config.model),
        getattr(resolved, "dtype", "?"),
        getattr(resolved, "kv_cache_dtype", "?"),
        getattr(getattr(resolved, "quantization", None), "method", "?"),
        getattr(engine, "num_kv_blocks", "?"),
        getattr(engine, "max_model_len", "?"),
        resident_mib(),
        resolved.model_dump_json() if hasattr(resolved, "model_dump_json") else resolved,
    )
    return engine


def create_app(config: ServerConfig, engine_factory: EngineFactory | None = None) -> FastAPI:
    """The app for ``config``; ``engine_factory(engine_config)`` builds the engine (default: the
    real ``LLMEngine``). ``app.state.server`` holds the shared ``ServerState``."""
    factory = engine_factory or default_engine_factory
    metrics = ServerMetrics(vllm_metrics=config.vllm_metrics)
    holder: dict[str, ServerState] = {}
    async_engine = AsyncEngine(
        functools.partial(_load_with_progress, factory, config.engine),
        metrics=metrics,
        on_fatal=lambda message: holder["state"].on_engine_fatal(message),
        on_ready=lambda engine: holder["state"].on_engine_ready(engine),
    )
    state = ServerState(config, async_engine, metrics)
    holder["state"] = state

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        try:
            yield
        finally:
            async_engine.stop()
            state.close()

    # no /openapi.json, /docs or /redoc: the schema is not served to unauthenticated clients
    app = FastAPI(
        title="splitfuse", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    app.openapi = functools.partial(openapi_schema, app)  # type: ignore[method-assign]
    app.state.server = state
    _add_error_handlers(app)
    _add_routes(app, state)
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=config.max_body_bytes)
    app.add_middleware(
        AuthMiddleware, keys=state.api_keys, metrics_require_auth=config.metrics_require_auth
    )
    app.add_middleware(ErrorMiddleware)  # inside the metrics: they count its 500s
    app.add_middleware(MetricsMiddleware, state=state)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, error: APIError) -> Response:
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def request_validation(_: Request, error: RequestValidationError) -> Response:
        return validation_error(list(error.errors())).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, error: StarletteHTTPException) -> Response:
        return JSONResponse(
            error_body(error.status_code, str(error.detail)),
            status_code=error.status_code,
            headers=getattr(error, "headers", None),
        )

    @app.exception_handler(ClientDisconnected)
    async def disconnected(_: Request, __: ClientDisconnected) -> Response:
        return Response(status_code=499)


def _add_routes(app: FastAPI, state: ServerState) -> None:
    app.add_api_route("/v1/completions", create_completion, methods=["POST"])
    app.add_api_route("/v1/chat/completions", create_chat_completion, methods=["POST"])

    @app.get("/v1/models")
    async def list_models() -> Response:
        state.check_accepting()
        model = {
            "id": state.model_name,
            "object": "model",
            "created": state.created,
            "owned_by": "splitfuse",
            "root": state.model_name,  # not the model's path on this machine
            "max_model_len": state.max_model_len,
        }
        return JSONResponse({"object": "list", "data": [model]})

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        body = await read_body(request, TokenizeRequest)
        token_text = state.check_accepting()
        state.check_model(body.model)
        if body.prompt is not None:
            tokens = await state.off_loop(token_text.encode, body.prompt, body.add_special_tokens)
        else:
            messages = template_messages(body.messages or [])
            try:
                tokens = await state.off_loop(
                    token_text.apply_chat_template, messages, body.add_generation_prompt
                )
            except APIError:
                raise
            except Exception as error:  # template errors are the caller's
                raise APIError(
                    400, f"the chat template failed: {error}", param="messages"
                ) from None
        return JSONResponse(
            {"count": len(tokens), "max_model_len": state.max_model_len, "tokens": tokens}
        )

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        body = await read_body(request, DetokenizeRequest)
        token_text = state.check_accepting()
        state.check_model(body.model)
        return JSONResponse({"prompt": await state.off_loop(_detokenize, token_text, body.tokens)})

    @app.get("/livez")
    async def livez() -> Response:
        if not state.engine.alive:  # the error itself is in the log, not for any caller
            return JSONResponse({"status": "dead"}, status_code=503)
        return JSONResponse({"status": "alive"})

    async def readyz() -> Response:
        if state.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if not state.engine.alive:
            return JSONResponse({"status": "dead"}, status_code=503)
        if not state.ready:
            return JSONResponse({"status": "loading"}, status_code=503)
        return JSONResponse({"status": "ready"})

    app.add_api_route("/readyz", readyz, methods=["GET"])
    app.add_api_route("/health", readyz, methods=["GET"])

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)


def _detokenize(token_text: TokenText, tokens: list[int]) -> str:
    bad = [t for t in tokens if not 0 <= t < token_text.vocab_size]
    if bad:
        raise APIError(
            400, f"token id {bad[0]} is outside [0, {token_text.vocab_size})", param="tokens"
        )
    return token_text.decode(tokens)


def describe_config(config: ServerConfig) -> str:
    """The config as one JSON line for the start-up log, API keys masked."""
    data = config.model_dump(mode="json")
    data["api_key"] = ["***"] * len(config.api_key)
    return json.dumps(data, separators=(",", ":"))
