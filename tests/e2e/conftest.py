"""Real HTTP servers for the e2e tests: uvicorn in a thread on a free loopback port."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from server.app import create_app
from server.config import ServerConfig
from server.runner import ServerThread

# Small, fixed KV cache: tests do not depend on the machine's free memory.
TINY_ENGINE = {"dtype": "float32", "kv_cache_memory": "64MiB"}


def tiny_config(
    model_dir: Path, engine: dict[str, Any] | None = None, **server: Any
) -> ServerConfig:
    return ServerConfig(engine={"model": str(model_dir), **TINY_ENGINE, **(engine or {})}, **server)


@pytest.fixture(scope="session")
def tiny_server(tiny_llama_dir: Path) -> Iterator[ServerThread]:
    """One shared server on the tiny model, float32."""
    with ServerThread(create_app(tiny_config(tiny_llama_dir))) as server:
        server.wait_ready()
        yield server


@pytest.fixture
def start_server(tiny_llama_dir: Path) -> Iterator[Callable[..., ServerThread]]:
    """Starts a dedicated server: ``start_server(engine={...}, engine_factory=..., **server)``;
    stopped at teardown."""
    servers: list[ServerThread] = []

    def start(
        engine: dict[str, Any] | None = None,
        engine_factory: Callable[..., Any] | None = None,
        wait_ready: bool = True,
        **server: Any,
    ) -> ServerThread:
        config = tiny_config(tiny_llama_dir, engine, **server)
        thread = ServerThread(create_app(config, engine_factory=engine_factory)).start()
        servers.append(thread)
        if wait_ready:
            thread.wait_ready()
        return thread

    yield start
    for server in servers:
        server.stop()


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_llama_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama_dir)
