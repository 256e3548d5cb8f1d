"""The Grafana dashboard: well-formed, covers the serving signals, and queries only metrics the
server exports (the live check against a running server is tests/e2e/test_deploy_live.py)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str) -> ModuleType:
    """deploy/ is not a package: its helper modules are loaded by path."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "deploy" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


queried_metrics = _load("queried_metrics")

# The server's metrics (server/metrics.py), by Prometheus type.
COUNTERS = {
    "splitfuse_requests_total",
    "splitfuse_http_requests_total",
    "splitfuse_prompt_tokens_total",
    "splitfuse_generation_tokens_total",
    "splitfuse_prefix_cache_queries_total",
    "splitfuse_prefix_cache_hits_total",
    "splitfuse_num_preemptions_total",
}
GAUGES = {
    "splitfuse_num_requests_running",
    "splitfuse_num_requests_waiting",
    "splitfuse_kv_cache_usage_ratio",
}
HISTOGRAMS = {
    "splitfuse_time_to_first_token_seconds",
    "splitfuse_inter_token_latency_seconds",
    "splitfuse_e2e_request_latency_seconds",
    "splitfuse_request_queue_time_seconds",
    "splitfuse_batch_tokens",
    "splitfuse_step_duration_seconds",
}
EXPORTED_SERIES = (
    COUNTERS
    | GAUGES
    | {name + suffix for name in HISTOGRAMS for suffix in ("_bucket", "_sum", "_count")}
)


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return queried_metrics.load_dashboard()


def test_series_names_are_parsed_from_promql() -> None:
    expr = (
        "histogram_quantile(0.99, sum by (le) "
        '(rate(splitfuse_step_duration_seconds_bucket{job=~"$job"}[$__rate_interval])))'
        " / sum(splitfuse_num_requests_running)"
    )
    assert queried_metrics.series_names(expr) == {
        "splitfuse_step_duration_seconds_bucket",
        "splitfuse_num_requests_running",
    }


def test_every_query_reads_exported_series(dashboard: dict[str, Any]) -> None:
    queries = queried_metrics.dashboard_queries(dashboard)
    assert len(queries) >= 20
    for query in queries:
        names = queried_metrics.series_names(query)
        assert names, f"no splitfuse metric in {query!r}"
        assert names <= EXPORTED_SERIES, names - EXPORTED_SERIES


def test_counters_are_read_as_rates(dashboard: dict[str, Any]) -> None:
    for query in queried_metrics.dashboard_queries(dashboard):
        for name in queried_metrics.series_names(query) & COUNTERS:
            assert re.search(rf"rate\({name}\{{[^}}]*\}}\[", query), query


@pytest.mark.parametrize(
    ("title_word", "series"),
    [
        ("throughput", "splitfuse_generation_tokens_total"),
        ("first token", "splitfuse_time_to_first_token_seconds_bucket"),
        ("inter-token", "splitfuse_inter_token_latency_seconds_bucket"),
        ("running", "splitfuse_num_requests_running"),
        ("waiting", "splitfuse_num_requests_waiting"),
        ("kv cache", "splitfuse_kv_cache_usage_ratio"),
        ("preemption", "splitfuse_num_preemptions_total"),
        ("prefix cache", "splitfuse_prefix_cache_hits_total"),
        ("step time", "splitfuse_step_duration_seconds_bucket"),
    ],
)
def test_dashboard_covers(dashboard: dict[str, Any], title_word: str, series: str) -> None:
    panels = [
        p for p in dashboard["panels"] if p["type"] != "row" and title_word in p["title"].lower()
    ]
    assert panels, f"no panel titled with {title_word!r}"
    queried = set().union(
        *(queried_metrics.series_names(t["expr"]) for p in panels for t in p["targets"])
    )
    assert series in queried


def test_latency_panels_show_percentiles(dashboard: dict[str, Any]) -> None:
    for title in ("Time to first token", "Inter-token latency"):
        (panel,) = [p for p in dashboard["panels"] if p["title"] == title]
        quantiles = [
            re.match(r"histogram_quantile\(([0-9.]+),", t["expr"])[1] for t in panel["targets"]
        ]
        assert quantiles == ["0.5", "0.9", "0.99"]
        assert panel["fieldConfig"]["defaults"]["unit"] == "s"


def test_layout_is_well_formed(dashboard: dict[str, Any]) -> None:
    assert dashboard["uid"] == "splitfuse"
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}"
            assert all(t["refId"] for t in panel["targets"])
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"datasource", "job", "instance"} <= variables


def test_autoscaler_metric_is_exported() -> None:
    hpa = {
        "kind": "HorizontalPodAutoscaler",
        "spec": {
            "metrics": [
                {"type": "Pods", "pods": {"metric": {"name": "splitfuse_num_requests_waiting"}}},
                {"type": "Resource", "resource": {"name": "cpu"}},
            ]
        },
    }
    names = queried_metrics.autoscaler_metric_names([hpa, {"kind": "Service"}])
    assert names == {"splitfuse_num_requests_waiting"} <= EXPORTED_SERIES
