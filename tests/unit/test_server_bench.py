"""The benchmark's workload and statistics."""

from __future__ import annotations

import pytest

from server.bench import RequestResult, Workload, percentile, summarize


def test_percentile_interpolates_like_numpy() -> None:
    values = [1.0, 2.0, 3.0, 4.0]
    assert percentile(values, 50) == pytest.approx(2.5)
    assert percentile(values, 90) == pytest.approx(3.7)
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 4.0
    assert percentile([], 50) == 0.0


def test_workload_is_deterministic_and_in_range() -> None:
    workload = Workload(num_prompts=3, input_len=5, output_len=2, seed=4, vocab_size=1000)
    prompts = workload.prompts()
    assert prompts == workload.prompts()
    assert [len(p) for p in prompts] == [5, 5, 5]
    assert all(100 <= t < 1000 for p in prompts for t in p)
    assert prompts != Workload(3, 5, 2, seed=5, vocab_size=1000).prompts()
    assert workload.arrival_delays() == [0.0, 0.0, 0.0]
    delays = Workload(2000, 1, 1, request_rate=10.0).arrival_delays()
    assert sum(delays) / len(delays) == pytest.approx(0.1, rel=0.1)


def test_summarize() -> None:
    results = [
        RequestResult(True, 10, 5, ttft=0.1, e2e=0.5, itl=[0.1] * 4),
        RequestResult(True, 10, 5, ttft=0.3, e2e=0.7, itl=[0.1] * 4),
        RequestResult(False, 10, error="HTTP 500"),
    ]
    summary = summarize(results, duration=2.0)
    assert summary["completed"] == 2 and summary["failed"] == 1
    assert summary["output_throughput"] == pytest.approx(5.0)
    assert summary["request_throughput"] == pytest.approx(1.0)
    assert summary["ttft"]["p50_ms"] == pytest.approx(200.0)
    assert summary["tpot"]["mean_ms"] == pytest.approx(100.0)
    assert summary["itl"]["p99_ms"] == pytest.approx(100.0)
    assert summary["errors"] == ["HTTP 500"]
