"""Runs the app under uvicorn with our own shutdown rules:

- SIGTERM / SIGINT: drain. ``/readyz`` turns 503, new requests get 503, in-flight ones finish
  within ``drain_timeout`` seconds (then they are cut), and the process exits 0. A second signal
  exits at once.
- The engine loop dies: pending requests get their 500s, then the server stops and ``run``
  returns 1 so that a supervisor restarts the process.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys
import threading
import time
from types import FrameType

import uvicorn
from fastapi import FastAPI

from server.serving import ServerState

logger = logging.getLogger("splitfuse.server")

# Time given to error responses to reach their clients before an engine failure stops the server.
_FATAL_FLUSH_SECONDS = 1.0
# After the drain, what uvicorn gives connections still open (streams cut at the deadline).
_CLOSE_SECONDS = 2.0


class DrainingServer(uvicorn.Server):
    """A uvicorn server whose signals start a drain instead of closing the sockets at once."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state
        self.exit_code = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        state.fatal_hooks.append(self._on_fatal)

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not recorded in _captured_signals: uvicorn would re-raise it after shutdown and the
        # process would die of the signal instead of exiting 0.
        if self.state.draining or self._loop is None:
            self.should_exit = True
            self.force_exit = self.force_exit or sig == signal.SIGINT and self.state.draining
            return
        self._loop.call_soon_threadsafe(self.start_drain)

    def start_drain(self) -> None:
        if self.state.draining:
            return
        self.state.draining = True
        asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        timeout = self.state.config.drain_timeout
        logger.info(
            "draining: %d requests in flight, waiting up to %.0f s", self.state.num_active, timeout
        )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.state.num_active > 0 and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if self.state.num_active > 0:
            logger.warning("drain timeout: cutting %d requests", self.state.num_active)
        else:
            logger.info("drained")
        self.should_exit = True

    def _on_fatal(self, message: str) -> None:
        self.exit_code = 1
        logger.error("stopping: %s", message)
        if self._loop is not None:
            self._loop.call_later(_FATAL_FLUSH_SECONDS, self._exit_now)

    def _exit_now(self) -> None:
        self.should_exit = True


def make_server(app: FastAPI, host: str, port: int, log_level: str = "info") -> DrainingServer:
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        timeout_graceful_shutdown=_CLOSE_SECONDS,
        lifespan="on",
        access_log=log_level == "debug",
    )
    return DrainingServer(config, app.state.server)


def run(app: FastAPI, host: str, port: int, log_level: str = "info") -> int:
    """Serves until drained (0) or until the engine fails (1)."""
    server = make_server(app, host, port, log_level)
    server.run()
    from engine.step_graphs import compiling_in_background

    code = 1 if server.exit_code == 0 and not server.started else server.exit_code
    if compiling_in_background():
        # stopped before the step graphs were ready: the compile cannot be interrupted, and the
        # interpreter's own exit would abort under it (SIGABRT instead of this exit code)
        logger.info("exiting while the step graphs compile")
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


class ServerThread:
    """Runs the app in a background thread on a free loopback port (embedding and tests)::

    with ServerThread(create_app(config)) as server:
        httpx.get(server.url + "/livez")
    """

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", log_level: str = "warning") -> None:
        self.app = app
        self.state: ServerState = app.state.server
        # proto IPPROTO_TCP: asyncio sets TCP_NODELAY on accepted connections only then (with
        # proto 0, Nagle holds each response body back behind its headers for ~40 ms).
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((host, 0))
        self.port = self._socket.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        self.server = make_server(app, host, self.port, log_level)
        self._thread: threading.Thread | None = None

    def start(self) -> ServerThread:
        self._thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self._socket]}, daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        return self

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Blocks until the engine has loaded; raises if it failed."""
        deadline = time.monotonic() + timeout
        while not self.state.ready:
            if not self.state.engine.alive:
                raise RuntimeError(f"the engine failed: {self.state.engine.error}")
            if time.monotonic() > deadline:
                raise TimeoutError("the engine did not load in time")
            time.sleep(0.02)

    def drain(self) -> None:
        """What SIGTERM does, from another thread."""
        loop = self.server._loop
        if loop is not None:
            loop.call_soon_threadsafe(self.server.start_drain)

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
