"""Render the Helm chart into the plain manifests in deploy/k8s (``make manifests``).

    python deploy/render_manifests.py            # writes deploy/k8s/cpu.yaml and gpu.yaml
    python deploy/render_manifests.py --check    # exits 1 when the files differ from the chart

Rendering uses helm-python-sdk (Helm's Go SDK bundled as a shared library): no helm binary, no
cluster and no network. The tests import ``render`` and ``MANIFESTS`` from this file.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import helm_python as helm
import yaml

DEPLOY_DIR = Path(__file__).resolve().parent
CHART_DIR = DEPLOY_DIR / "helm" / "splitfuse"
K8S_DIR = DEPLOY_DIR / "k8s"
RELEASE_NAME = "splitfuse"

# output file -> the values files layered over the chart's values.yaml, in order
MANIFESTS: dict[str, tuple[str, ...]] = {
    "cpu.yaml": (),
    "gpu.yaml": ("values-gpu.yaml",),
}

# The order `kubectl apply -f` creates objects in: what the Deployment refers to comes first.
KIND_ORDER = (
    "ServiceAccount",
    "Secret",
    "ConfigMap",
    "Service",
    "Deployment",
    "PodDisruptionBudget",
    "HorizontalPodAutoscaler",
    "ServiceMonitor",
    "InferencePool",
)


def load_values(values_files: tuple[str, ...]) -> dict[str, Any]:
    """Merge the named values files (relative to the chart) in order, as `helm -f` would."""
    merged: dict[str, Any] = {}
    for name in values_files:
        with open(CHART_DIR / name, encoding="utf-8") as handle:
            _deep_merge(merged, yaml.safe_load(handle) or {})
    return merged


def _deep_merge(base: dict[str, Any], override: dict[str, Any]) -> None:
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _deep_merge(base[key], value)
        else:
            base[key] = value


def render_documents(values: dict[str, Any] | None = None) -> list[tuple[str, str]]:
    """The chart's objects as ``(template path, YAML text)``, in apply order."""
    with helm.Chart.load(CHART_DIR) as chart:
        rendered = chart.render(values or None, name=RELEASE_NAME, is_install=True)
    documents: list[tuple[str, str]] = []
    for template in sorted(rendered):
        if not template.endswith((".yaml", ".yml")):
            continue
        for text in rendered[template].split("\n---\n"):
            text = text.strip().removeprefix("---").strip()
            if yaml.safe_load(text) is not None:
                documents.append((template, text))
    return sorted(documents, key=lambda doc: _kind_rank(yaml.safe_load(doc[1])["kind"]))


def _kind_rank(kind: str) -> int:
    return KIND_ORDER.index(kind) if kind in KIND_ORDER else len(KIND_ORDER)


def render(values_files: tuple[str, ...]) -> str:
    """One multi-document manifest file: the chart rendered with ``values_files``."""
    layers = " + ".join(("values.yaml", *values_files))
    lines = [
        "# Generated from deploy/helm/splitfuse by `make manifests`; do not edit.",
        f"# Values: {layers}; release name: {RELEASE_NAME}.",
    ]
    for template, text in render_documents(load_values(values_files)):
        lines += ["---", f"# Source: {template}", text]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    args = parser.parse_args(argv)
    stale = []
    for filename, values_files in MANIFESTS.items():
        path = K8S_DIR / filename
        text = render(values_files)
        if args.check:
            if not path.exists() or path.read_text(encoding="utf-8") != text:
                stale.append(path.name)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
            print(f"wrote {path.relative_to(DEPLOY_DIR.parent)}")
    if stale:
        print(f"out of date with the chart: {', '.join(stale)} (run `make manifests`)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
