"""The server as a real process: SIGTERM drains and exits 0; an engine failure exits non-zero."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from tests.e2e.conftest import free_port, wait_ready

PYTHON = sys.executable
SPLITFUSE = [PYTHON, "-m", "server.cli"]


def _serve(model_dir: Path, port: int, *flags: str) -> subprocess.Popen:
    command = [*SPLITFUSE, "serve", str(model_dir), "--port", str(port), "--dtype", "float32",
               "--kv-cache-memory", "64MiB", "--log-level", "warning", *flags]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)


def test_sigterm_drains_in_flight_requests_and_exits_0(tiny_llama_dir: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = _serve(tiny_llama_dir, port, "--drain-timeout", "60")
    try:
        wait_ready(url, process)
        started = threading.Event()
        lines: list[str] = []

        def stream() -> None:
            body = {"prompt": "x", "max_tokens": 400, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
                for line in response.iter_lines():
                    started.set()
                    if line:
                        lines.append(line)

        client = threading.Thread(target=stream)
        client.start()
        assert started.wait(30)
        process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while httpx.get(url + "/readyz").status_code != 503:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        refused = httpx.post(url + "/v1/completions", json={"prompt": "y"})
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "draining"
        client.join(60)
        assert lines[-1] == "data: [DONE]"
        chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert process.wait(30) == 0
    finally:
        if process.poll() is None:
            process.kill()


def test_engine_failure_exits_non_zero(tiny_llama_dir: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    script = Path(__file__).with_name("failing_server.py")
    root = str(Path(__file__).parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    process = subprocess.Popen(
        [PYTHON, str(script), str(tiny_llama_dir), str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    try:
        wait_ready(url, process)
        response = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 20})
        assert response.status_code == 500
        message = response.json()["error"]["message"]
        assert "error id" in message and "injected" not in message
        assert process.wait(30) != 0
        log = process.communicate()[1]
        error_id = re.search(r"error id (\w+)", message)
        assert error_id and b"injected engine failure" in log and error_id[1].encode() in log
    finally:
        if process.poll() is None:
            process.kill()
