"""``splitfuse top``: frames rendered from recorded metrics (the server's own exposition)."""

from __future__ import annotations

import math

from server.metrics import ServerMetrics
from server.top_command import parse_metrics, quantile, render_frame


def _stats(waiting: int, preemptions: int) -> object:
    return type("Stats", (), dict(num_running=3, num_waiting=waiting, kv_cache_usage=0.425,
                                  prefix_cache_queries=0, prefix_cache_hits=0,
                                  num_preemptions=preemptions, last_step_num_tokens=0,
                                  last_step_seconds=0.0, last_step_num_steps=1))  # fmt: skip


def test_quantile_worked_example() -> None:
    buckets = [(0.1, 2.0), (0.2, 6.0), (math.inf, 6.0)]
    assert quantile(0.5, buckets) == 0.125
    assert quantile(0.99, [(0.1, 0.0), (math.inf, 4.0)]) == 0.1  # in +Inf: the last bound
    assert quantile(0.5, [(0.1, 0.0), (math.inf, 0.0)]) is None


def test_a_frame_from_two_recorded_scrapes() -> None:
    metrics = ServerMetrics()
    metrics.observe_engine_stats(_stats(waiting=0, preemptions=1), stepped=False)
    # before the window: a slow request that must not count in the last minute's percentiles
    metrics.observe_finished("stop", 100, 10, 30.0, 20.0, 0.0, [1.0], tenant="key1")
    first = parse_metrics(metrics.render().decode(), at=100.0)
    for _ in range(9):
        metrics.observe_finished("stop", 300, 20, 1.0, 0.12, 0.0, [0.02] * 19, tenant="key1")
    metrics.observe_finished("length", 100, 40, 2.0, 0.9, 0.0, [0.04] * 39, tenant="key2")
    metrics.observe_engine_stats(_stats(waiting=7, preemptions=4), stepped=False)
    second = parse_metrics(metrics.render().decode(), at=104.0)

    frame = render_frame([first, second], "http://server:8000")
    lines = frame.splitlines()
    assert lines[0] == "splitfuse top - http://server:8000"
    assert lines[1] == "  requests   running 3   waiting 7   KV cache 42.5% used"
    # (9 x 300 + 100) prompt tokens and (9 x 20 + 40) generated over 4 s
    assert lines[2] == "  tokens/s   in 700   out 55   (finished requests, last 4 s)"
    # TTFT: 9 x 0.12 s in (0.1, 0.15], 1 x 0.9 s in (0.75, 1.0]; the 20 s one is older.
    # p50 = 0.1 + 0.05 x 5/9, p90 = 0.15, p99 = 0.75 + 0.25 x 0.9
    assert lines[4].split() == ["TTFT", "128", "ms", "150", "ms", "975", "ms"]
    # ITL: 171 x 0.02 s in (0.015, 0.02], 39 x 0.04 s in (0.03, 0.04]
    # p50 = 0.015 + 0.005 x 105/171, p99 = 0.03 + 0.01 x 36.9/39
    itl = lines[5].split()
    assert itl[:3] == ["ITL", "18", "ms"] and itl[5:] == ["39", "ms"]
    assert lines[6] == "  preemptions 3   evicted 0   (last 4 s)"
    # key1: 9 x 320 tokens, key2: 140 -> 95.4% and 4.6%
    assert lines[8].split()[:2] == ["key1", "95.4%"]
    assert lines[9].split()[:2] == ["key2", "4.6%"]


def test_a_frame_without_a_server() -> None:
    frame = render_frame([], "http://nowhere:1", error="connection refused")
    assert "unreachable: connection refused" in frame and "waiting for the first scrape" in frame
