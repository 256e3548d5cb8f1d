"""The chart's InferencePool example and the autoscaler's two metric names, checked offline: helm
lint, the InferencePool against the Gateway API Inference Extension's v1 schema (transcribed
below), its selector and port against the Deployment, and the series the endpoint picker reads
against what the server exports."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from server.metrics import ServerMetrics
from tests.unit.test_deploy_chart import (
    KUBERNETES_VERSION,
    _config_file,
    _container,
    _objects,
    queried_metrics,
    render_manifests,
)

EXAMPLE = ("values-inferencepool.yaml",)

# The endpoint picker's defaults (--total-queued-requests-metric, --total-running-requests-metric,
# --kv-cache-usage-percentage-metric, --cache-info-metric): what it scrapes from every pod.
ENDPOINT_PICKER_SERIES = {
    "vllm:num_requests_waiting",
    "vllm:num_requests_running",
    "vllm:kv_cache_usage_perc",
    "vllm:cache_config_info",
}

# inference.networking.k8s.io/v1 InferencePool, as the extension's CRD defines it (the fields and
# limits this chart uses; unknown fields are refused as the API server's pruning would drop them).
_NAME = {"type": "string", "minLength": 1, "maxLength": 253}
_PORT = {
    "type": "object",
    "additionalProperties": False,
    "required": ["number"],
    "properties": {"number": {"type": "integer", "minimum": 1, "maximum": 65535}},
}
INFERENCE_POOL_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "inference.networking.k8s.io/v1"},
        "kind": {"const": "InferencePool"},
        "metadata": {"type": "object", "required": ["name"], "properties": {"name": _NAME}},
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["selector", "targetPorts", "endpointPickerRef"],
            "properties": {
                "selector": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["matchLabels"],
                    "properties": {
                        "matchLabels": {
                            "type": "object",
                            "minProperties": 1,
                            "maxProperties": 64,
                            "additionalProperties": {"type": "string", "maxLength": 63},
                        }
                    },
                },
                "targetPorts": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 8,
                    "uniqueItems": True,
                    "items": _PORT,
                },
                "appProtocol": {"enum": ["http", "kubernetes.io/h2c"]},
                "endpointPickerRef": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["name", "port"],  # port: required for a Service (the default)
                    "properties": {
                        "group": {"type": "string", "maxLength": 253},
                        "kind": {
                            "type": "string",
                            "pattern": "^[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?$",
                        },
                        "name": _NAME,
                        "port": _PORT,
                        "failureMode": {"enum": ["FailOpen", "FailClose"]},
                    },
                },
            },
        },
    },
}


@pytest.fixture(scope="module")
def example() -> dict[str, dict[str, Any]]:
    return _objects(render_manifests.load_values(EXAMPLE))


def test_example_lints_strictly() -> None:
    values = render_manifests.load_values(EXAMPLE)
    report = helm.lint(
        render_manifests.CHART_DIR, values, strict=True, kube_version=f"v{KUBERNETES_VERSION}"
    )
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


def test_inference_pool_matches_the_v1_schema_and_the_pods(
    example: dict[str, dict[str, Any]],
) -> None:
    pool = example["InferencePool"]
    jsonschema.validate(pool, INFERENCE_POOL_SCHEMA)
    pod_labels = example["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    (port,) = _container(example)["ports"]
    assert pool["spec"]["targetPorts"] == [{"number": port["containerPort"]}]
    assert pool["spec"]["endpointPickerRef"] == {
        "name": "splitfuse-epp",
        "port": {"number": 9002},
        "failureMode": "FailClose",
    }


def test_the_schema_catches_a_malformed_pool(example: dict[str, dict[str, Any]]) -> None:
    pool = yaml.safe_load(yaml.safe_dump(example["InferencePool"]))
    pool["spec"]["endpointPickerRef"]["failureMode"] = "Retry"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(pool, INFERENCE_POOL_SCHEMA)


def test_the_pool_is_off_by_default_and_needs_a_picker() -> None:
    assert "InferencePool" not in _objects({})
    with pytest.raises(helm.HelmError, match="serviceName"):
        _objects({"inferencePool": {"enabled": True}})


def test_example_config_loads_with_priorities_fair_share_and_a_tenant_header(
    example: dict[str, dict[str, Any]], tmp_path: Path
) -> None:
    from server.config import load_config

    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(_config_file(example)))
    config = load_config({}, config_file=str(path), environ={})
    assert config.engine.scheduling_policy == "priority"
    assert config.engine.fair_share is True
    assert config.tenant_header == "x-tenant-id"
    assert config.vllm_metrics is True


@pytest.mark.parametrize("name", ["splitfuse_num_requests_waiting", "vllm:num_requests_waiting"])
def test_the_autoscaler_scales_on_either_name(name: str) -> None:
    objects = _objects({"autoscaling": {"enabled": True, "metricName": name}})
    assert queried_metrics.autoscaler_metric_names([objects["HorizontalPodAutoscaler"]]) == {name}


def test_the_autoscaler_refuses_other_names() -> None:
    with helm.Chart.load(render_manifests.CHART_DIR) as chart, pytest.raises(helm.HelmValuesError):
        chart.validate_schema(chart.merge_values({"autoscaling": {"metricName": "queue_depth"}}))


def test_the_server_exports_what_the_picker_and_the_autoscalers_read() -> None:
    metrics = ServerMetrics()
    metrics.set_engine_info("smollm2", 16, 1024)
    metrics.observe_engine_stats(
        type(
            "Stats",
            (),
            dict(
                num_running=1,
                num_waiting=0,
                kv_cache_usage=0.5,
                prefix_cache_queries=0,
                prefix_cache_hits=0,
                num_preemptions=0,
                last_step_num_tokens=0,
                last_step_seconds=0.0,
                last_step_num_steps=1,
            ),
        ),  # fmt: skip
        stepped=False,
    )
    exported = {family.name for family in text_string_to_metric_families(metrics.render().decode())}
    assert exported >= ENDPOINT_PICKER_SERIES
    assert "vllm:num_requests_waiting" in exported and "splitfuse_num_requests_waiting" in exported
    assert queried_metrics.series_names("sum(vllm:num_requests_waiting{pod!=''})") == {
        "vllm:num_requests_waiting"
    }
