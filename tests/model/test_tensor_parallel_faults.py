"""Tensor-parallel faults.

1. A worker killed mid-generation: ``splitfuse serve --tp 2`` on a tiny model ends the streaming
   request with an error within seconds, reports dead on ``/livez``, exits non-zero, and leaves no
   process behind.
2. Rank 0 killed (SIGKILL, no clean-up): its workers exit on their own.
3. Rank 0 failing to load its shard stops the workers at once (they would otherwise wait in a
   collective rank 0 never reaches).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from tests.tiny_model import make_tiny_model

REPO_ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT = 180.0
# the watchdog sees a death at once; the request must end well within this
FAIL_TIMEOUT = 5.0
EXIT_TIMEOUT = 30.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (from /proc children lists)."""
    found: list[int] = []
    pending = [pid]
    while pending:
        parent = pending.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = (task / "children").read_text().split()
            except OSError:
                continue
            for child in map(int, children):
                found.append(child)
                pending.append(child)
    return found


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.fixture
def server(tiny_llama_dir, tmp_path):
    port = _free_port()
    log_path = tmp_path / "server.log"
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    command = [
        sys.executable, "-m", "server.cli", "serve", str(tiny_llama_dir),
        "--port", str(port), "--tp", "2", "--device", "cpu", "--dtype", "float32",
        "--num-kv-blocks", "256", "--block-size", "4", "--num-threads", "1",
    ]  # fmt: skip
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    descendants: list[int] = []
    try:
        yield process, f"http://127.0.0.1:{port}", log_path, descendants
    finally:
        descendants.extend(_descendants(process.pid))
        if process.poll() is None:
            process.kill()
            process.wait()
        for pid in descendants:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def _wait_ready(process: subprocess.Popen, base_url: str, log_path: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"the server exited with {process.returncode}:\n{log_path.read_text()}")
        try:
            if httpx.get(f"{base_url}/readyz", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    pytest.fail(f"the server was not ready in {START_TIMEOUT} s:\n{log_path.read_text()}")


def test_killed_worker_fails_requests_and_leaves_no_process(server) -> None:
    process, base_url, log_path, descendants = server
    _wait_ready(process, base_url, log_path)
    descendants.extend(_descendants(process.pid))
    workers = [pid for pid in descendants if "spawn_main" in _cmdline(pid)]
    assert len(workers) == 1, [(pid, _cmdline(pid)) for pid in descendants]

    body = {"prompt": "once upon a time", "max_tokens": 900, "ignore_eos": True, "stream": True}
    events: list[dict] = []
    killed_at = None
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=30.0) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            events.append(json.loads(line.removeprefix("data: ")))
            if killed_at is None and len(events) >= 3:
                os.kill(workers[0], signal.SIGKILL)
                killed_at = time.monotonic()
            if "error" in events[-1]:
                break
    assert killed_at is not None, f"the stream ended before the kill: {events}"
    failed_after = time.monotonic() - killed_at
    assert "error" in events[-1], events[-1]
    message = events[-1]["error"]["message"]
    error_id = re.search(r"error id (\w+)", message)
    assert error_id and "rank" not in message, events[-1]  # the client gets an id, the log the why
    assert failed_after < FAIL_TIMEOUT, failed_after
    generated = sum(len(event["choices"][0]["text"]) > 0 for event in events[:-1])
    assert generated < 900, "the request ran to completion despite the dead worker"

    try:
        livez = httpx.get(f"{base_url}/livez", timeout=2.0)
        assert livez.status_code == 503 and livez.json()["status"] == "dead"
    except httpx.TransportError:
        pass  # the server may already be gone: it exits about a second after the failure
    assert process.wait(EXIT_TIMEOUT) != 0
    log = log_path.read_text()
    assert "tensor-parallel worker rank 1" in log and error_id[1] in log, log[-2000:]
    deadline = time.monotonic() + 5.0
    while any(_alive(pid) for pid in descendants) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [(pid, _cmdline(pid)) for pid in descendants if _alive(pid)]
    assert not left, f"processes left behind: {left}"
    print(
        f"request failed {failed_after:.2f} s after the kill; exit code {process.returncode}; "
        f"{len(descendants)} descendant processes gone"
    )


def test_workers_exit_when_rank0_is_killed(server) -> None:
    process, base_url, log_path, descendants = server
    _wait_ready(process, base_url, log_path)
    descendants.extend(_descendants(process.pid))
    assert any("spawn_main" in _cmdline(pid) for pid in descendants), descendants
    process.kill()
    process.wait()
    deadline = time.monotonic() + 10.0
    while any(_alive(pid) for pid in descendants) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [(pid, _cmdline(pid)) for pid in descendants if _alive(pid)]
    assert not left, f"orphaned processes: {left}"


def _spawned_children() -> list[int]:
    return [pid for pid in _descendants(os.getpid()) if "spawn_main" in _cmdline(pid)]


def test_a_load_failure_stops_the_workers(tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    model_dir = make_tiny_model(tmp_path, "llama")
    weights = load_file(model_dir / "model.safetensors")
    del weights["model.layers.1.mlp.down_proj.weight"]
    save_file(weights, model_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="down_proj"):
        LLMEngine(
            EngineConfig(
                model=str(model_dir), dtype="float32", device="cpu", num_kv_blocks=32, tp=2
            )
        )
    left = [pid for pid in _spawned_children() if _alive(pid)]
    assert not left, [(pid, _cmdline(pid)) for pid in left]
