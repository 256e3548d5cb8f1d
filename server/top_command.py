"""``splitfuse top``: a live terminal view of a server, redrawn each second from its /metrics.

    splitfuse top --url http://127.0.0.1:8000          # Ctrl-C to quit
    splitfuse top --once                               # one frame (two scrapes) and exit

Each scrape becomes a ``Snapshot`` (the counters, gauges and histogram buckets the view needs);
rates come from the snapshots of the last few seconds, percentiles and shares from the buckets
and counters gained over the last minute, as PromQL's ``histogram_quantile`` over ``increase``
would compute them. ``render_frame`` is a pure function of the snapshots, tested on recorded
metrics.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

RATE_WINDOW_SECONDS = 5.0
LATENCY_WINDOW_SECONDS = 60.0
_CLEAR = "\x1b[H\x1b[2J"


@dataclass
class Snapshot:
    """What one scrape of /metrics says, at monotonic ``time``."""

    time: float
    gauges: dict[str, float] = field(default_factory=dict)
    counters: dict[str, float] = field(default_factory=dict)
    # histogram name -> [(upper bound, cumulative count)], ascending, +Inf last
    buckets: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    tenant_tokens: dict[str, float] = field(default_factory=dict)  # prompt + generated


_GAUGES = (
    "splitfuse_num_requests_running",
    "splitfuse_num_requests_waiting",
    "splitfuse_kv_cache_usage_ratio",
)
_COUNTERS = (
    "splitfuse_prompt_tokens_total",
    "splitfuse_generation_tokens_total",
    "splitfuse_num_preemptions_total",
    "splitfuse_requests_evicted_total",
)
_HISTOGRAMS = ("splitfuse_time_to_first_token_seconds", "splitfuse_inter_token_latency_seconds")
_TENANT_COUNTERS = (
    "splitfuse_tenant_prompt_tokens_total",
    "splitfuse_tenant_generation_tokens_total",
)


def parse_metrics(text: str, at: float) -> Snapshot:
    """A snapshot of the Prometheus text ``text`` scraped at ``at``."""
    from prometheus_client.parser import text_string_to_metric_families

    snapshot = Snapshot(at)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name
            if name in _GAUGES:
                snapshot.gauges[name] = sample.value
            elif name in _COUNTERS:
                snapshot.counters[name] = sample.value
            elif name in _TENANT_COUNTERS:
                tenant = sample.labels.get("tenant", "")
                snapshot.tenant_tokens[tenant] = (
                    snapshot.tenant_tokens.get(tenant, 0.0) + sample.value
                )
            elif name.endswith("_bucket") and name[: -len("_bucket")] in _HISTOGRAMS:
                bound = float(sample.labels["le"])
                snapshot.buckets.setdefault(name[: -len("_bucket")], []).append(
                    (bound, sample.value)
                )
    for buckets in snapshot.buckets.values():
        buckets.sort()
    return snapshot


def quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """``histogram_quantile``: linear within the bucket holding the q-th observation; the last
    finite bound when it falls in +Inf; None without observations. Worked example, buckets
    [(0.1, 2), (0.2, 6), (inf, 6)]: q=0.5 is the 3rd of 6, 1 of the 4 in (0.1, 0.2] -> 0.125."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank and count > lower_count:
            if math.isinf(bound):
                return lower_bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (
                count - lower_count
            )
        lower_bound, lower_count = bound, count
    return lower_bound


def _since(now: Snapshot, before: Snapshot, name: str) -> list[tuple[float, float]]:
    """The buckets gained between two snapshots (a restarted server: all of ``now``'s)."""
    current = now.buckets.get(name, [])
    earlier = dict(before.buckets.get(name, []))
    gained = [(bound, count - earlier.get(bound, 0.0)) for bound, count in current]
    return gained if all(count >= 0 for _, count in gained) else current


def _oldest_within(snapshots: Sequence[Snapshot], seconds: float) -> Snapshot:
    now = snapshots[-1].time
    for snapshot in snapshots:
        if now - snapshot.time <= seconds:
            return snapshot
    return snapshots[-1]


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f} ms"


def render_frame(snapshots: Sequence[Snapshot], url: str, error: str | None = None) -> str:
    """The view of the latest snapshot, with rates and percentiles from the earlier ones."""
    lines = [f"splitfuse top - {url}"]
    if error is not None:
        lines.append(f"  unreachable: {error}")
    if not snapshots:
        lines.append("  waiting for the first scrape")
        return "\n".join(lines) + "\n"
    now = snapshots[-1]
    recent = _oldest_within(snapshots, RATE_WINDOW_SECONDS)
    minute = _oldest_within(snapshots, LATENCY_WINDOW_SECONDS)
    elapsed = now.time - recent.time

    def rate(name: str) -> str:
        if elapsed <= 0:
            return "-"
        gained = now.counters.get(name, 0.0) - recent.counters.get(name, 0.0)
        return f"{max(gained, 0.0) / elapsed:,.0f}"

    def gained(name: str) -> int:
        return int(max(now.counters.get(name, 0.0) - minute.counters.get(name, 0.0), 0.0))

    gauges = now.gauges
    lines += [
        f"  requests   running {gauges.get('splitfuse_num_requests_running', 0):.0f}"
        f"   waiting {gauges.get('splitfuse_num_requests_waiting', 0):.0f}"
        f"   KV cache {gauges.get('splitfuse_kv_cache_usage_ratio', 0) * 100:.1f}% used",
        f"  tokens/s   in {rate('splitfuse_prompt_tokens_total')}"
        f"   out {rate('splitfuse_generation_tokens_total')}"
        f"   (finished requests, last {elapsed:.0f} s)",
    ]
    window = now.time - minute.time
    lines.append(f"  latency over the last {window:.0f} s       p50      p90      p99")
    for label, name in (("TTFT", _HISTOGRAMS[0]), ("ITL", _HISTOGRAMS[1])):
        buckets = _since(now, minute, name)
        cells = "".join(f"{_ms(quantile(q, buckets)):>9}" for q in (0.5, 0.9, 0.99))
        lines.append(f"    {label:<30}{cells}")
    lines.append(
        f"  preemptions {gained('splitfuse_num_preemptions_total')}"
        f"   evicted {gained('splitfuse_requests_evicted_total')}   (last {window:.0f} s)"
    )
    tenants = {
        tenant: tokens - minute.tenant_tokens.get(tenant, 0.0)
        for tenant, tokens in now.tenant_tokens.items()
    }
    total = sum(max(tokens, 0.0) for tokens in tenants.values())
    lines.append(f"  tenant share of tokens (last {window:.0f} s)")
    if total <= 0:
        lines.append("    none finished")
    for tenant, tokens in sorted(tenants.items(), key=lambda item: -item[1]):
        if tokens > 0:
            share = tokens / total
            bar = "#" * round(share * 30)
            lines.append(f"    {tenant:<16} {share * 100:5.1f}%  {bar}")
    return "\n".join(lines) + "\n"


def scrape(url: str, api_key: str | None, timeout: float = 5.0) -> str:
    request = urllib.request.Request(url.rstrip("/") + "/metrics")
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    with urllib.request.urlopen(request, timeout=timeout) as response:
        text: str = response.read().decode("utf-8")
    return text


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "top",
        help="a live terminal view of a running server",
        description="Requests, token rates, TTFT and inter-token latency percentiles over the "
        "last minute, KV-cache usage, preemptions and each tenant's share, from a server's "
        "/metrics, redrawn every --interval seconds.",
    )
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between scrapes")
    parser.add_argument("--api-key", help="for a server whose /metrics requires the API key")
    parser.add_argument("--once", action="store_true", help="print one frame and exit")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if not args.interval > 0:
        print("splitfuse top: --interval must be positive", file=sys.stderr)
        return 2
    snapshots: deque[Snapshot] = deque()
    scrapes = 2 if args.once else None
    try:
        while scrapes is None or scrapes > 0:
            error = None
            try:
                snapshots.append(parse_metrics(scrape(args.url, args.api_key), time.monotonic()))
            except (OSError, urllib.error.URLError, ValueError) as failure:
                error = str(getattr(failure, "reason", failure))
            while snapshots and snapshots[-1].time - snapshots[0].time > LATENCY_WINDOW_SECONDS:
                snapshots.popleft()
            if scrapes is not None:
                scrapes -= 1
                if scrapes == 0:
                    sys.stdout.write(render_frame(snapshots, args.url, error))
                    return 0 if error is None else 1
            else:
                sys.stdout.write(_CLEAR + render_frame(snapshots, args.url, error))
                sys.stdout.flush()
            time.sleep(args.interval)
    except KeyboardInterrupt:
        return 0
    return 0
