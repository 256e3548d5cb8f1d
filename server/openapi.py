"""The API's OpenAPI description: request bodies from the pydantic models the routes validate
against, and every status each route answers with, errors in the OpenAI shape.

The routes read their bodies themselves (``read_body``: one 400 format for every error), so
FastAPI alone would describe no request body and no error. The server does not serve this
document (it would tell unauthenticated clients the whole surface); ``app.openapi()`` builds it,
and the test suite fuzzes the server against it.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)

_REF = "#/components/schemas/{model}"

_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}

_STATUS = {"type": "object", "required": ["status"], "properties": {"status": {"type": "string"}}}

_USAGE = {
    "type": "object",
    "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
    "properties": {
        name: {"type": "integer", "minimum": 0}
        for name in ("prompt_tokens", "completion_tokens", "total_tokens")
    },
}


def _generation_result(object_name: str) -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["id", "object", "created", "model", "choices", "usage"],
        "properties": {
            "id": {"type": "string"},
            "object": {"const": object_name},
            "created": {"type": "integer"},
            "model": {"type": "string"},
            "choices": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["index", "finish_reason"],
                    "properties": {"index": {"type": "integer", "minimum": 0}},
                },
            },
            "usage": {"$ref": "#/components/schemas/Usage"},
        },
    }


_RESULTS: dict[str, dict[str, Any]] = {
    "Completion": _generation_result("text_completion"),
    "ChatCompletion": _generation_result("chat.completion"),
    "Tokens": {
        "type": "object",
        "required": ["count", "max_model_len", "tokens"],
        "properties": {
            "count": {"type": "integer", "minimum": 0},
            "max_model_len": {"type": "integer"},
            "tokens": {"type": "array", "items": {"type": "integer", "minimum": 0}},
        },
    },
    "Text": {
        "type": "object",
        "required": ["prompt"],
        "properties": {"prompt": {"type": "string"}},
    },
    "ModelList": {
        "type": "object",
        "required": ["object", "data"],
        "properties": {
            "object": {"const": "list"},
            "data": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["id", "object", "created", "owned_by", "max_model_len"],
                    "properties": {"id": {"type": "string"}, "object": {"const": "model"}},
                },
            },
        },
    },
}

_MEANINGS = {
    400: "the body or a parameter is invalid",
    401: "no valid API key",
    404: "no such model",
    413: "the body is larger than the server accepts",
    429: "too many requests waiting; retry after Retry-After seconds",
    500: "the engine failed (the message has an error id for the server's log)",
    503: "the model is loading, or the server is shutting down",
}

# (path, method): request body model, result schema name (None: text), the error statuses
_ROUTES: dict[tuple[str, str], tuple[type[BaseModel] | None, str | None, tuple[int, ...]]] = {
    ("/v1/completions", "post"): (
        CompletionRequest,
        "Completion",
        (400, 401, 404, 413, 429, 500, 503),
    ),
    ("/v1/chat/completions", "post"): (
        ChatCompletionRequest,
        "ChatCompletion",
        (400, 401, 404, 413, 429, 500, 503),
    ),
    ("/tokenize", "post"): (TokenizeRequest, "Tokens", (400, 401, 404, 413, 500, 503)),
    ("/detokenize", "post"): (DetokenizeRequest, "Text", (400, 401, 404, 413, 500, 503)),
    ("/v1/models", "get"): (None, "ModelList", (401, 500, 503)),
    ("/metrics", "get"): (None, None, (401,)),
}
_STREAMED = {"/v1/completions", "/v1/chat/completions"}
_PROBES = {"/livez", "/readyz", "/health"}


def openapi_schema(app: FastAPI) -> dict[str, Any]:
    """The OpenAPI 3.1 document of ``app``'s routes (built once, then cached as FastAPI does)."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    components: dict[str, Any] = schema.setdefault("components", {}).setdefault("schemas", {})
    components.update({"Error": _ERROR, "Status": _STATUS, "Usage": _USAGE, **_RESULTS})
    for (path, method), (model, result, errors) in _ROUTES.items():
        operation = schema["paths"][path][method]
        if model is not None:
            body = model.model_json_schema(ref_template=_REF)
            components.update(body.pop("$defs", {}))
            components[model.__name__] = body
            operation["requestBody"] = {
                "required": True,
                "content": {
                    "application/json": {"schema": {"$ref": _REF.format(model=model.__name__)}}
                },
            }
        ok: dict[str, Any]
        if result is None:
            ok = {"text/plain": {"schema": {"type": "string"}}}
        else:
            ok = {"application/json": {"schema": {"$ref": _REF.format(model=result)}}}
        if path in _STREAMED:
            ok["text/event-stream"] = {"schema": {"type": "string"}}
        operation["responses"] = {
            "200": {"description": "the result", "content": ok},
            **{str(status): _error_response(status) for status in errors},
        }
    for path in _PROBES:
        status = {"application/json": {"schema": {"$ref": "#/components/schemas/Status"}}}
        schema["paths"][path]["get"]["responses"] = {
            "200": {"description": "alive / ready", "content": status},
            "503": {"description": "dead, loading or draining", "content": status},
        }
    app.openapi_schema = schema
    return schema


def _error_response(status: int) -> dict[str, Any]:
    return {
        "description": _MEANINGS[status],
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
    }
