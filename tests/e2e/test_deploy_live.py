"""The deployment against the real server: ``splitfuse serve`` started from the chart's own config
file (on the tiny test model), probed on the chart's probe paths and the image's health check,
scraped for every metric the dashboard and the autoscaler query, then drained with SIGTERM as
Kubernetes does."""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
START_TIMEOUT_SECONDS = 120.0


def _load(name: str) -> ModuleType:
    """deploy/ is not a package: its helper modules are loaded by path."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "deploy" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


render_manifests = _load("render_manifests")
queried_metrics = _load("queried_metrics")


@pytest.fixture(scope="module")
def chart() -> dict[str, dict[str, Any]]:
    """The chart rendered with every optional object on (the autoscaler included)."""
    values = {"autoscaling": {"enabled": True}, "serviceMonitor": {"enabled": True}}
    documents = [yaml.safe_load(text) for _, text in render_manifests.render_documents(values)]
    return {document["kind"]: document for document in documents}


def _container(chart: dict[str, dict[str, Any]]) -> dict[str, Any]:
    (container,) = chart["Deployment"]["spec"]["template"]["spec"]["containers"]
    return container


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class LiveServer:
    process: subprocess.Popen[str]
    base_url: str
    config: dict[str, Any]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]


@pytest.fixture(scope="module")
def live_server(
    chart: dict[str, dict[str, Any]], tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    """``splitfuse serve --config <the chart's config file>`` in a subprocess, on the tiny model.

    The chart's config listens on 0.0.0.0:8000; the test binds loopback and a free port instead
    (flags override the file), since port 8000 may be taken on a test machine.
    """
    workdir = tmp_path_factory.mktemp("deploy-live")
    config = yaml.safe_load(chart["ConfigMap"]["data"]["config.yaml"])
    # The tiny model in float32 with a small fixed cache, instead of the default model, on this
    # machine's cores rather than the pod's CPU limit.
    config["engine"].update(
        model=str(tiny_llama_dir), dtype="float32", kv_cache_memory="64MiB", tp=1
    )
    config["engine"].pop("num_threads", None)
    config_path = workdir / "config.yaml"
    config_path.write_text(yaml.safe_dump(config))
    port = _free_port()
    env = {**os.environ, "SPLITFUSE_CACHE": str(workdir / "cache")}
    env = {k: v for k, v in env.items() if k not in ("SPLITFUSE_HOST", "SPLITFUSE_PORT")}
    log_path = workdir / "server.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [
                str(Path(sys.executable).parent / "splitfuse"),
                "serve",
                "--config",
                str(config_path),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            text=True,
        )
    server = LiveServer(process, f"http://127.0.0.1:{port}", config, log_path)
    try:
        _wait_ready(server)
        yield server
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)


def _wait_ready(server: LiveServer) -> None:
    deadline = time.monotonic() + START_TIMEOUT_SECONDS
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            pytest.fail(f"server exited with {server.process.returncode}:\n{server.log()}")
        try:
            if httpx.get(server.base_url + "/readyz", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    pytest.fail(f"server not ready after {START_TIMEOUT_SECONDS} s:\n{server.log()}")


def test_chart_port_is_the_server_config_port(chart: dict[str, dict[str, Any]]) -> None:
    container = _container(chart)
    (port,) = container["ports"]
    config = yaml.safe_load(chart["ConfigMap"]["data"]["config.yaml"])
    env = {item["name"]: item["value"] for item in container["env"]}
    assert port["containerPort"] == config["port"] == int(env["SPLITFUSE_PORT"])


def test_probe_paths_answer(live_server: LiveServer, chart: dict[str, dict[str, Any]]) -> None:
    container = _container(chart)
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = container[kind]["httpGet"]
        assert probe["port"] == container["ports"][0]["name"]
        response = httpx.get(live_server.base_url + probe["path"], timeout=10)
        assert response.status_code == 200, (kind, response.text)
    # the image's HEALTHCHECK
    (healthcheck,) = re.findall(r"http://127\.0\.0\.1:(\d+)(/\w+)", DOCKERFILE.read_text())
    assert int(healthcheck[0]) == container["ports"][0]["containerPort"]
    assert httpx.get(live_server.base_url + healthcheck[1], timeout=10).status_code == 200
    monitor = chart["ServiceMonitor"]["spec"]["endpoints"][0]
    response = httpx.get(live_server.base_url + monitor["path"], timeout=10)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")


def test_queried_metrics_are_exported(
    live_server: LiveServer, chart: dict[str, dict[str, Any]]
) -> None:
    # One finished request, so that the labelled series (finish_reason, status_code) exist.
    response = httpx.post(
        live_server.base_url + "/v1/completions",
        json={
            "model": live_server.config["served_model_name"],
            "prompt": "The quick brown fox",
            "max_tokens": 4,
            "temperature": 0,
        },
        timeout=60,
    )
    assert response.status_code == 200, response.text
    text = httpx.get(live_server.base_url + "/metrics", timeout=10).text
    exported = {
        sample.name for family in text_string_to_metric_families(text) for sample in family.samples
    }
    queried = set().union(
        *map(
            queried_metrics.series_names,
            queried_metrics.dashboard_queries(queried_metrics.load_dashboard()),
        )
    )
    queried |= queried_metrics.autoscaler_metric_names(chart.values())
    assert "splitfuse_num_requests_waiting" in queried
    assert len(queried) >= 15
    assert queried <= exported, sorted(queried - exported)


def test_sigterm_drains_and_exits_zero(live_server: LiveServer) -> None:
    """Kubernetes sends SIGTERM after the preStop sleep; the pod must exit 0 within the grace."""
    live_server.process.send_signal(signal.SIGTERM)
    try:
        code = live_server.process.wait(timeout=live_server.config["drain_timeout"] + 15)
    except subprocess.TimeoutExpired:
        pytest.fail(f"server still running after SIGTERM:\n{live_server.log()}")
    assert code == 0, live_server.log()
