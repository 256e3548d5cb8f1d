"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` and a status."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse
from pydantic import ValidationError

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """Raised anywhere in a request handler; becomes the OpenAI error body."""

    def __init__(
        self,
        status_code: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.status_code, self.message, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status_code, headers=self.headers)


def error_body(
    status_code: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": _ERROR_TYPES.get(status_code, "invalid_request_error"),
            "param": param,
            "code": code,
        }
    }


def _loc_to_param(loc: tuple[Any, ...]) -> str | None:
    # pydantic adds the union member's type name to the location ('prompt.str'); drop those.
    parts = [str(p) for p in loc if p not in ("body", "str", "list[str]", "list[int]")]
    parts = [p for p in parts if not p.startswith(("list[", "function-", "TextPart", "OtherPart"))]
    return ".".join(parts) or None


def validation_error(error: ValidationError | list[dict[str, Any]]) -> APIError:
    """The first pydantic error as a 400 naming its field."""
    errors = error.errors() if isinstance(error, ValidationError) else error
    first = errors[0]
    param = _loc_to_param(tuple(first.get("loc", ())))
    message = str(first.get("msg", "invalid request"))
    if param:
        message = f"{param}: {message}"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more errors)"
    return APIError(400, message, param=param, code="invalid_value")


def sampling_error(error: ValueError) -> APIError:
    """A ``SamplingParams`` ValueError (its message starts with the field name) as a 400."""
    message = str(error)
    param = message.split(" ", 1)[0] if message else None
    return APIError(400, message, param=param, code="invalid_value")
