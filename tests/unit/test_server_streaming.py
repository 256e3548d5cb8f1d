"""A streamed response aborts its generation however it ends, also when the client is gone before
the body's first byte (the body generator then never runs)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from server.serving import GenerationStream


class _Generation:
    def __init__(self) -> None:
        self.closed = 0

    def close(self) -> None:
        self.closed += 1


async def _body(started: list[bool]) -> AsyncIterator[str]:
    started.append(True)
    yield "data: x\n\n"


def _scope() -> dict[str, Any]:
    return {"type": "http", "asgi": {"spec_version": "2.4"}, "method": "POST", "headers": []}


@pytest.mark.parametrize("spec_version", ["2.0", "2.4"])
def test_a_client_gone_before_the_body_aborts_the_generation(spec_version: str) -> None:
    generation = _Generation()
    started: list[bool] = []
    response = GenerationStream(generation, _body(started), media_type="text/event-stream")

    async def receive() -> dict[str, Any]:
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        raise OSError("connection reset by peer")

    scope = {**_scope(), "asgi": {"spec_version": spec_version}}
    with pytest.raises(Exception):  # noqa: B017, PT011 - starlette's own disconnect error, or OSError
        asyncio.run(response(scope, receive, send))
    assert not started  # the body generator never ran: its own cleanup could not abort
    assert generation.closed == 1


def test_a_stream_sent_in_full_closes_the_generation_once_more_harmlessly() -> None:
    generation = _Generation()
    started: list[bool] = []
    response = GenerationStream(generation, _body(started), media_type="text/event-stream")
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        await asyncio.sleep(10)
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(response(_scope(), receive, send))
    assert started and sent[-1]["type"] == "http.response.body"
    assert generation.closed == 1
