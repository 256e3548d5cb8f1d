"""Real HTTP servers for the e2e tests: uvicorn in a thread on a free loopback port."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from server.app import create_app
from server.config import ServerConfig
from server.runner import ServerThread

# Small, fixed KV cache: tests do not depend on the machine's free memory. Float32 throughout,
# the cache too (auto gives quantized weights a float16 one): the near-tie rule of the
# batch-invariance test (1e-3) is float32's, and a 16-bit cache holds K/V that two code paths
# (the decode stack, the model's forward) may round a step apart (~2e-3 on a logit).
TINY_ENGINE = {
    "dtype": "float32",
    "kv_cache_dtype": "float32",
    "kv_cache_memory": "64MiB",
    "compile": False,
}


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


# What the abuse tests assert of /livez's p99 while they run: the event loop never waits for the
# abusive work (before the fixes it did, for 0.4-4 s per body). They print p50 and p99, measured
# from a process of their own against a server process (2026-11-24, 2 cores: 7-15 ms for the
# largest fan-outs and stop strings, 26-33 ms for ~1.8 MB bodies on every route; the target is
# 100 ms); the load comes from the test's threads on the same 2 cores of a shared CI machine, so
# the assertion leaves room for their scheduling.
LIVEZ_P99_BOUND = 1.0


_PROBE = """
import json, sys, time, httpx
latencies = []
with httpx.Client(base_url=sys.argv[1]) as client:
    for _ in range(int(sys.argv[2])):
        start = time.perf_counter()
        assert client.get("/livez").status_code == 200
        latencies.append(time.perf_counter() - start)
        time.sleep(0.01)
print(json.dumps(latencies))
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_ready(url: str, process: subprocess.Popen, timeout: float = 120) -> None:
    """Until ``url``/readyz answers 200; fails with the server's stderr if it exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, process.communicate()[1]
        try:
            if httpx.get(url + "/readyz", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise TimeoutError("the server did not become ready")


def probe_livez(url: str, count: int = 100) -> list[float]:
    """Seconds of ``count`` /livez calls, 10 ms apart, made from a process of their own: the
    test's threads that load the server do not delay them."""
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, url, str(count)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


class ServerProcess:
    """``splitfuse serve`` in its own process: what its ``/livez`` does under load is the
    server's alone, not shared (one GIL) with the threads of the test that loads it. ``flags``
    are added to its command line; ``SPLITFUSE_*`` variables other than the cache's are not
    passed on, so the flags alone set it up."""

    def __init__(self, model_dir: Path, *flags: str) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        command = [sys.executable, "-m", "server.cli", "serve", str(model_dir),
                   "--port", str(port), "--dtype", "float32", "--kv-cache-memory", "64MiB",
                   "--no-compile", "--num-threads", "1", "--log-level", "warning",
                   *flags]  # fmt: skip
        env = {k: v for k, v in os.environ.items() if not k.startswith("SPLITFUSE_")}
        if os.environ.get("SPLITFUSE_CACHE"):
            env["SPLITFUSE_CACHE"] = os.environ["SPLITFUSE_CACHE"]
        self.process = subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env
        )
        wait_ready(self.url, self.process)

    def num_running(self) -> float:
        metrics = httpx.get(self.url + "/metrics").text
        line = next(
            x for x in metrics.splitlines() if x.startswith("splitfuse_num_requests_running")
        )
        return float(line.split()[-1])

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


@pytest.fixture(scope="session")
def tiny_server_process(tiny_llama_dir: Path) -> Iterator[ServerProcess]:
    """One ``splitfuse serve`` process on the tiny model, float32, eager, for the tests that
    measure ``/livez`` while they abuse the server."""
    server = ServerProcess(tiny_llama_dir)
    yield server
    server.stop()


def livez_latencies_under_load(
    server: ServerThread | ServerProcess,
    body: dict[str, Any],
    num_clients: int,
    join_seconds: float,
) -> list[float]:
    """Seconds of 100 ``/livez`` calls made while ``num_clients`` clients keep posting ``body`` to
    /v1/completions (the engine saturated); prints p50 and p99."""
    stop = threading.Event()

    async def load() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:

            async def one_client() -> None:
                while not stop.is_set():
                    await client.post("/v1/completions", json=body)

            await asyncio.gather(*(one_client() for _ in range(num_clients)))

    loader = threading.Thread(target=asyncio.run, args=(load(),), daemon=True)
    loader.start()
    deadline = time.monotonic() + 30
    if isinstance(server, ServerProcess):
        while server.num_running() < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
    else:
        while server.state.engine.num_in_flight < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
    latencies = probe_livez(server.url)
    stop.set()
    loader.join(join_seconds)
    p99 = statistics.quantiles(latencies, n=100)[98]
    print(f"/livez under load: p50 {statistics.median(latencies) * 1e3:.1f} ms, "
          f"p99 {p99 * 1e3:.1f} ms")  # fmt: skip
    return latencies


@pytest.fixture
def livez_under_load() -> Callable[..., list[float]]:
    """``livez_under_load(server, body, num_clients, join_seconds)``: see
    ``livez_latencies_under_load``."""
    return livez_latencies_under_load
