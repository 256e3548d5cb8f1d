"""Metric names are a contract with the dashboard and the autoscaler: check each one."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client.parser import text_string_to_metric_families

from server.metrics import ServerMetrics

EXPECTED = {
    "splitfuse_requests": "counter",
    "splitfuse_http_requests": "counter",
    "splitfuse_prompt_tokens": "counter",
    "splitfuse_generation_tokens": "counter",
    "splitfuse_time_to_first_token_seconds": "histogram",
    "splitfuse_inter_token_latency_seconds": "histogram",
    "splitfuse_e2e_request_latency_seconds": "histogram",
    "splitfuse_request_queue_time_seconds": "histogram",
    "splitfuse_num_requests_running": "gauge",
    "splitfuse_num_requests_waiting": "gauge",
    "splitfuse_kv_cache_usage_ratio": "gauge",
    "splitfuse_prefix_cache_queries": "counter",
    "splitfuse_prefix_cache_hits": "counter",
    "splitfuse_num_preemptions": "counter",
    "splitfuse_batch_tokens": "histogram",
    "splitfuse_step_duration_seconds": "histogram",
}


def _stats(**overrides: float) -> SimpleNamespace:
    values = dict(num_running=3, num_waiting=2, kv_cache_usage=0.25, prefix_cache_queries=100,
                  prefix_cache_hits=40, num_preemptions=1, last_step_num_tokens=64,
                  last_step_seconds=0.02)  # fmt: skip
    return SimpleNamespace(**{**values, **overrides})


def test_every_metric_has_its_name_and_type() -> None:
    metrics = ServerMetrics()
    metrics.http_requests.labels(method="GET", route="/livez", status_code="200").inc()
    metrics.observe_finished("stop", 10, 5, 1.0, 0.1, 0.05, [0.02, 0.03])
    metrics.observe_engine_stats(_stats(), stepped=True)
    families = {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}
    assert {name: families[name].type for name in EXPECTED} == EXPECTED
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in families.values()
        for s in family.samples
    }
    assert samples[("splitfuse_requests_total", (("finish_reason", "stop"),))] == 1
    assert samples[("splitfuse_generation_tokens_total", ())] == 5
    assert samples[("splitfuse_inter_token_latency_seconds_count", ())] == 2
    assert samples[("splitfuse_kv_cache_usage_ratio", ())] == 0.25
    assert samples[("splitfuse_batch_tokens_sum", ())] == 64
    assert samples[("splitfuse_num_requests_waiting", ())] == 2


def test_engine_totals_become_counter_increments() -> None:
    metrics = ServerMetrics()
    metrics.observe_engine_stats(_stats(prefix_cache_queries=100, num_preemptions=1), True)
    metrics.observe_engine_stats(_stats(prefix_cache_queries=160, num_preemptions=3), False)
    text = metrics.render().decode()
    assert "splitfuse_prefix_cache_queries_total 160.0" in text
    assert "splitfuse_num_preemptions_total 3.0" in text
    assert "splitfuse_batch_tokens_count 1.0" in text  # only steps that ran are observed


def test_each_app_has_its_own_registry() -> None:
    first, second = ServerMetrics(), ServerMetrics()
    first.requests.labels(finish_reason="stop").inc()
    assert b'finish_reason="stop"' not in second.render()
