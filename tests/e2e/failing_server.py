"""A server whose engine fails after a few steps: ``python failing_server.py MODEL_DIR PORT``.
Used by test_process.py to check that the process exits non-zero."""

from __future__ import annotations

import sys
from typing import Any

from engine.config import EngineConfig
from server.app import create_app, default_engine_factory
from server.config import ServerConfig
from server.runner import run

FAIL_AT_STEP = 3


class FailingEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.inner = default_engine_factory(config)
        self.num_steps = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def step(self) -> list:
        self.num_steps += 1
        if self.num_steps >= FAIL_AT_STEP:
            raise RuntimeError("injected engine failure")
        return self.inner.step()


if __name__ == "__main__":
    model_dir, port = sys.argv[1], int(sys.argv[2])
    config = ServerConfig(
        port=port,
        engine={
            "model": model_dir,
            "dtype": "float32",
            "kv_cache_memory": "64MiB",
            "compile": False,
        },
    )
    sys.exit(run(create_app(config, engine_factory=FailingEngine), "127.0.0.1", port, "warning"))
