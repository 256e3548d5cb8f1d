"""The Prometheus metrics that the Grafana dashboard and the chart's autoscaler read.

The tests check these names against what the server exports: statically against the list of
metric names, and live against a running server's ``/metrics``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

DASHBOARD = Path(__file__).resolve().parent / "grafana" / "splitfuse.json"

# The server's metric names all start with ``splitfuse_`` (or ``vllm:``, the vLLM-compatible
# series); label names and PromQL functions never do, so every such identifier in a query is a
# series name.
_SERIES_NAME = re.compile(r"\b(?:splitfuse_|vllm:)[a-zA-Z0-9_:]+")


def series_names(expr: str) -> set[str]:
    """``'rate(splitfuse_x_bucket{job="a"}[5m])'`` -> ``{'splitfuse_x_bucket'}``;
    ``'sum(vllm:num_requests_waiting)'`` -> ``{'vllm:num_requests_waiting'}``."""
    return set(_SERIES_NAME.findall(expr))


def dashboard_queries(dashboard: dict[str, Any]) -> list[str]:
    """Every PromQL expression of the dashboard: panel targets and template variable queries."""
    queries = [
        target["expr"]
        for panel in _panels(dashboard["panels"])
        for target in panel.get("targets", ())
    ]
    for variable in dashboard.get("templating", {}).get("list", ()):
        if variable.get("type") == "query":
            query = variable["query"]
            queries.append(query["query"] if isinstance(query, dict) else query)
    return queries


def _panels(panels: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", ()))  # rows nest their collapsed panels


def load_dashboard(path: Path = DASHBOARD) -> dict[str, Any]:
    with open(path, encoding="utf-8") as handle:
        dashboard: dict[str, Any] = json.load(handle)
    return dashboard


def autoscaler_metric_names(documents: Iterable[dict[str, Any]]) -> set[str]:
    """The metric names the HorizontalPodAutoscalers among ``documents`` scale on."""
    names = set()
    for document in documents:
        if document.get("kind") != "HorizontalPodAutoscaler":
            continue
        for metric in document["spec"].get("metrics", ()):
            source = metric.get(metric["type"][0].lower() + metric["type"][1:], {})
            if "metric" in source:
                names.add(source["metric"]["name"])
    return names
