"""The Helm chart: strict lint, Kubernetes 1.30 schemas, yamllint, the plain manifests, and the
properties the deployment depends on (probes, drain, GPUs, shared memory, security)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import helm_python as helm
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
BIN = Path(sys.executable).parent
KUBERNETES_VERSION = "1.30.0"

# The server's routes and port (server/app.py, server/config.py).
SERVER_ROUTES = {"/livez", "/readyz", "/health", "/metrics", "/v1/models"}
SERVER_PORT = 8000


def _load(name: str) -> ModuleType:
    """deploy/ is not a package: its helper modules are loaded by path."""
    spec = importlib.util.spec_from_file_location(name, DEPLOY / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


render_manifests = _load("render_manifests")
queried_metrics = _load("queried_metrics")

# Every optional object and branch of the templates turned on.
ALL_FEATURES: dict[str, Any] = {
    "tensorParallelSize": 3,
    "gpu": {"enabled": True},
    "autoscaling": {"enabled": True},
    "serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}},
    "apiKey": {"existingSecret": "splitfuse-api-keys"},
    "modelCache": {"existingClaim": "splitfuse-models"},
    "imagePullSecrets": [{"name": "registry"}],
    "extraArgs": ["--log-level", "debug"],
    "extraEnv": [{"name": "SPLITFUSE_SEED", "value": "7"}],
    "nodeSelector": {"node.kubernetes.io/instance-type": "gpu"},
    "priorityClassName": "inference",
    "podAnnotations": {"example.com/team": "serving"},
}


def _objects(values: dict[str, Any]) -> dict[str, dict[str, Any]]:
    documents = [yaml.safe_load(text) for _, text in render_manifests.render_documents(values)]
    by_kind = {document["kind"]: document for document in documents}
    assert len(by_kind) == len(documents), "one object of each kind"
    return by_kind


@pytest.fixture(scope="module")
def cpu() -> dict[str, dict[str, Any]]:
    return _objects({})


@pytest.fixture(scope="module")
def gpu() -> dict[str, dict[str, Any]]:
    return _objects(render_manifests.load_values(("values-gpu.yaml",)))


@pytest.fixture(scope="module")
def full() -> dict[str, dict[str, Any]]:
    return _objects(ALL_FEATURES)


def _container(objects: dict[str, dict[str, Any]]) -> dict[str, Any]:
    (container,) = objects["Deployment"]["spec"]["template"]["spec"]["containers"]
    return container


def _config_file(objects: dict[str, dict[str, Any]]) -> dict[str, Any]:
    config: dict[str, Any] = yaml.safe_load(objects["ConfigMap"]["data"]["config.yaml"])
    return config


@pytest.mark.parametrize(
    "values", [{}, render_manifests.load_values(("values-gpu.yaml",)), ALL_FEATURES]
)
def test_chart_lints_strictly(values: dict[str, Any]) -> None:
    report = helm.lint(
        render_manifests.CHART_DIR, values, strict=True, kube_version=f"v{KUBERNETES_VERSION}"
    )
    assert report["errors"] == []
    # severity 1 is informational ("icon is recommended"); 2 = warning, 3 = error
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


@pytest.mark.parametrize("values", [{"tensorParallelSize": 0}, {"port": "8000"}, {"replicas": 2}])
def test_values_schema_rejects_bad_values(values: dict[str, Any]) -> None:
    with helm.Chart.load(render_manifests.CHART_DIR) as chart, pytest.raises(helm.HelmValuesError):
        chart.validate_schema(chart.merge_values(values))


@pytest.mark.parametrize("filename", sorted(render_manifests.MANIFESTS))
def test_plain_manifests_are_the_chart_rendering(filename: str) -> None:
    expected = render_manifests.render(render_manifests.MANIFESTS[filename])
    actual = (render_manifests.K8S_DIR / filename).read_text(encoding="utf-8")
    assert actual == expected, f"deploy/k8s/{filename} is stale: run `make manifests`"


def _write_all_features(tmp_path: Path) -> Path:
    path = tmp_path / "all-features.yaml"
    texts = [text for _, text in render_manifests.render_documents(ALL_FEATURES)]
    path.write_text("".join(f"---\n{text}\n" for text in texts), encoding="utf-8")
    return path


def test_manifests_validate_against_kubernetes_schemas(tmp_path: Path) -> None:
    files = [render_manifests.K8S_DIR / name for name in sorted(render_manifests.MANIFESTS)]
    files.append(_write_all_features(tmp_path))
    result = subprocess.run(
        [BIN / "kubernetes-validate", "--strict", "--kubernetes-version", KUBERNETES_VERSION]
        + [str(path) for path in files],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    # kubernetes-validate has no schema for the Prometheus Operator's CRD: it only warns.
    # test_service_monitor_scrapes_the_metrics_port checks that object instead.
    unchecked = [line for line in lines if not line.startswith("INFO")]
    assert all("kind ServiceMonitor" in line for line in unchecked), unchecked
    assert len(unchecked) == 1
    passed = sum("passed for resource" in line for line in lines)
    documents = [d for path in files for d in yaml.safe_load_all(path.read_text()) if d]
    assert passed == len(documents) - 1  # all but the ServiceMonitor


def test_yaml_is_lint_clean(tmp_path: Path) -> None:
    config = DEPLOY / ".yamllint.yaml"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "yamllint",
            "--strict",
            "-c",
            str(config),
            str(DEPLOY),
            str(_write_all_features(tmp_path)),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_probes_use_server_routes_on_the_server_port(cpu: dict[str, dict[str, Any]]) -> None:
    container = _container(cpu)
    (port,) = container["ports"]
    assert port == {"name": "http", "containerPort": SERVER_PORT, "protocol": "TCP"}
    assert _config_file(cpu)["port"] == SERVER_PORT
    env = {item["name"]: item["value"] for item in container["env"]}
    assert env["SPLITFUSE_PORT"] == str(SERVER_PORT)
    probes = {
        kind: container[f"{kind}Probe"]["httpGet"] for kind in ("startup", "readiness", "liveness")
    }
    assert probes["startup"]["path"] == "/livez"
    assert probes["readiness"]["path"] == "/readyz"
    assert probes["liveness"]["path"] == "/livez"
    for probe in probes.values():
        assert probe["port"] == "http"
        assert probe["path"] in SERVER_ROUTES
    startup = container["startupProbe"]
    # room for converting and loading the default model
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300


def test_service_targets_the_container_port(cpu: dict[str, dict[str, Any]]) -> None:
    service = cpu["Service"]
    (port,) = service["spec"]["ports"]
    assert port["targetPort"] == "http"
    assert service["spec"]["selector"].items() <= (
        cpu["Deployment"]["spec"]["template"]["metadata"]["labels"].items()
    )


@pytest.mark.parametrize("objects_name", ["cpu", "gpu", "full"])
def test_grace_period_covers_prestop_sleep_and_drain(
    objects_name: str, request: pytest.FixtureRequest
) -> None:
    objects = request.getfixturevalue(objects_name)
    pod = objects["Deployment"]["spec"]["template"]["spec"]
    prestop = _container(objects)["lifecycle"]["preStop"]["exec"]["command"]
    assert prestop[0] == "sleep"
    drain_timeout = _config_file(objects)["drain_timeout"]
    assert drain_timeout > 0
    assert pod["terminationGracePeriodSeconds"] > drain_timeout + int(prestop[1])


def test_gpu_overlay_requests_one_gpu_per_tensor_parallel_rank(
    cpu: dict[str, dict[str, Any]], gpu: dict[str, dict[str, Any]]
) -> None:
    assert "nvidia.com/gpu" not in _container(cpu)["resources"]["limits"]
    tp = _config_file(gpu)["engine"]["tp"]
    resources = _container(gpu)["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == tp
    assert resources["requests"]["nvidia.com/gpu"] == tp
    assert _config_file(gpu)["engine"]["device"] == "cuda"
    assert _container(gpu)["image"].endswith("-cuda")


@pytest.mark.parametrize("tp", [1, 3])
def test_gpu_count_follows_tensor_parallel_size(tp: int) -> None:
    values = render_manifests.load_values(("values-gpu.yaml",))
    values["tensorParallelSize"] = tp
    objects = _objects(values)
    assert _config_file(objects)["engine"]["tp"] == tp
    assert _container(objects)["resources"]["limits"]["nvidia.com/gpu"] == tp


def test_config_file_is_the_server_config(cpu: dict[str, dict[str, Any]]) -> None:
    config = _config_file(cpu)
    assert config["host"] == "0.0.0.0"
    assert config["engine"]["model"] == "SmolLM2-135M-Instruct"
    assert config["engine"]["tp"] == 1
    container = _container(cpu)
    assert container["args"][:2] == ["--config", "/etc/splitfuse/config.yaml"]
    mounts = {mount["name"]: mount["mountPath"] for mount in container["volumeMounts"]}
    assert mounts["config"] == "/etc/splitfuse"
    annotations = cpu["Deployment"]["spec"]["template"]["metadata"]["annotations"]
    assert len(annotations["checksum/config"]) == 64  # restarts pods when the config changes


@pytest.mark.parametrize("objects_name", ["cpu", "gpu", "full"])
def test_config_file_loads_as_the_server_config(
    objects_name: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    from server.config import load_config

    objects = request.getfixturevalue(objects_name)
    path = tmp_path / "config.yaml"
    path.write_text(objects["ConfigMap"]["data"]["config.yaml"])
    env = {item["name"]: item["value"] for item in _container(objects)["env"]}
    config = load_config({}, config_file=str(path), environ=env)
    assert (config.host, config.port) == ("0.0.0.0", SERVER_PORT)
    limits = _container(objects)["resources"]["limits"]
    threads = config.engine.num_threads
    assert threads is not None
    assert threads * config.engine.tensor_parallel_size <= int(limits["cpu"])
    if config.engine.device != "cuda":
        # a CPU cache is sized in bytes under the container's memory limit
        assert isinstance(config.engine.kv_cache_memory, int)
        assert config.engine.kv_cache_memory < _quantity_bytes(limits["memory"]) // 2


def _quantity_bytes(quantity: str) -> int:
    """Kubernetes memory quantities: ``'8Gi'`` -> 8589934592."""
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
    for suffix, factor in units.items():
        if quantity.endswith(suffix):
            return int(quantity[: -len(suffix)]) * factor
    return int(quantity)


def test_pod_volumes(cpu: dict[str, dict[str, Any]], full: dict[str, dict[str, Any]]) -> None:
    volumes = {v["name"]: v for v in cpu["Deployment"]["spec"]["template"]["spec"]["volumes"]}
    assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    assert "emptyDir" in volumes["model-cache"]
    container = _container(cpu)
    mounts = {mount["name"]: mount["mountPath"] for mount in container["volumeMounts"]}
    assert mounts["dshm"] == "/dev/shm"
    # writable places on a read-only root filesystem: compile caches live under the home folder
    assert mounts["tmp"] == "/tmp" and mounts["home"] == "/home/splitfuse"
    env = {item["name"]: item["value"] for item in container["env"]}
    assert mounts["model-cache"] == env["SPLITFUSE_CACHE"]
    assert set(mounts) == set(volumes)
    full_volumes = {v["name"]: v for v in full["Deployment"]["spec"]["template"]["spec"]["volumes"]}
    assert full_volumes["model-cache"]["persistentVolumeClaim"]["claimName"] == ("splitfuse-models")


def test_security_context_and_resources(cpu: dict[str, dict[str, Any]]) -> None:
    pod = cpu["Deployment"]["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    assert pod["automountServiceAccountToken"] is False
    container = _container(cpu)
    security = container["securityContext"]
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"]["drop"] == ["ALL"]
    assert security["readOnlyRootFilesystem"] is True
    for key in ("cpu", "memory"):
        assert key in container["resources"]["requests"]
        assert key in container["resources"]["limits"]


def test_optional_objects_are_off_by_default(cpu: dict[str, dict[str, Any]]) -> None:
    assert set(cpu) == {
        "ServiceAccount",
        "ConfigMap",
        "Service",
        "Deployment",
        "PodDisruptionBudget",
    }
    assert cpu["Deployment"]["spec"]["replicas"] == 1
    assert "--api-key-file" not in _container(cpu)["args"]


def test_autoscaler_scales_on_waiting_requests(full: dict[str, dict[str, Any]]) -> None:
    hpa = full["HorizontalPodAutoscaler"]
    assert hpa["spec"]["scaleTargetRef"]["name"] == full["Deployment"]["metadata"]["name"]
    assert queried_metrics.autoscaler_metric_names([hpa]) == {"splitfuse_num_requests_waiting"}
    assert hpa["spec"]["metrics"][0]["pods"]["target"]["type"] == "AverageValue"
    # the autoscaler owns the replica count
    assert "replicas" not in full["Deployment"]["spec"]


def test_service_monitor_scrapes_the_metrics_port(full: dict[str, dict[str, Any]]) -> None:
    monitor = full["ServiceMonitor"]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    assert monitor["spec"]["selector"]["matchLabels"] == full["Service"]["spec"]["selector"]
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics"
    assert endpoint["port"] == full["Service"]["spec"]["ports"][0]["name"]


def test_api_key_secret_is_mounted_and_passed(full: dict[str, dict[str, Any]]) -> None:
    container = _container(full)
    args = container["args"]
    key_file = args[args.index("--api-key-file") + 1]
    volumes = {v["name"]: v for v in full["Deployment"]["spec"]["template"]["spec"]["volumes"]}
    assert volumes["api-keys"]["secret"]["secretName"] == "splitfuse-api-keys"
    mounts = {mount["name"]: mount["mountPath"] for mount in container["volumeMounts"]}
    assert key_file == f"{mounts['api-keys']}/api-keys"
    assert args[-2:] == ["--log-level", "debug"]
