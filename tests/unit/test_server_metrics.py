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
                  last_step_seconds=0.02, last_step_num_steps=1)  # fmt: skip
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


def test_a_pass_of_several_decode_steps_counts_as_that_many_steps() -> None:
    metrics = ServerMetrics()
    metrics.observe_engine_stats(
        _stats(last_step_num_tokens=8, last_step_seconds=0.04, last_step_num_steps=4), True
    )
    families = {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}
    samples = {s.name: s.value for family in families.values() for s in family.samples}
    assert samples["splitfuse_batch_tokens_count"] == 4
    assert samples["splitfuse_batch_tokens_sum"] == 32
    assert samples["splitfuse_step_duration_seconds_count"] == 4
    assert abs(samples["splitfuse_step_duration_seconds_sum"] - 0.04) < 1e-9


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


# What gateways and autoscalers read from vLLM-compatible servers: name -> (type, labels). The
# endpoint picker's defaults are the first four (total-queued, total-running, kv-cache-usage and
# cache-info metrics); the rest are what llm-d dashboards and KEDA/HPA recipes query.
VLLM_SERIES = {
    "vllm:num_requests_waiting": ("gauge", {"model_name", "engine"}),
    "vllm:num_requests_running": ("gauge", {"model_name", "engine"}),
    "vllm:kv_cache_usage_perc": ("gauge", {"model_name", "engine"}),
    "vllm:cache_config_info": ("gauge", {"block_size", "num_gpu_blocks", "engine"}),
    "vllm:time_to_first_token_seconds": ("histogram", {"model_name", "engine"}),
    "vllm:inter_token_latency_seconds": ("histogram", {"model_name", "engine"}),
    "vllm:e2e_request_latency_seconds": ("histogram", {"model_name", "engine"}),
    "vllm:request_queue_time_seconds": ("histogram", {"model_name", "engine"}),
    "vllm:prompt_tokens": ("counter", {"model_name", "engine"}),
    "vllm:generation_tokens": ("counter", {"model_name", "engine"}),
    "vllm:request_success": ("counter", {"model_name", "engine", "finished_reason"}),
    "vllm:num_preemptions": ("counter", {"model_name", "engine"}),
    "vllm:prefix_cache_queries": ("counter", {"model_name", "engine"}),
    "vllm:prefix_cache_hits": ("counter", {"model_name", "engine"}),
}


def _observed(metrics: ServerMetrics) -> dict:
    metrics.set_engine_info("tiny", 16, 4096)
    metrics.observe_finished("stop", 10, 5, 1.0, 0.1, 0.05, [0.02, 0.03], tenant="key1")
    metrics.observe_engine_stats(_stats(), stepped=True)
    return {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}


def test_vllm_series_have_vllms_names_types_labels_and_units() -> None:
    families = _observed(ServerMetrics())
    for name, (kind, labels) in VLLM_SERIES.items():
        family = families[name]
        assert family.type == kind, name
        assert family.samples, name
        for sample in family.samples:
            assert set(sample.labels) - {"le"} == labels, (name, sample.labels)
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in families.values() for s in f.samples}  # fmt: skip
    labels = (("engine", "0"), ("model_name", "tiny"))
    assert samples[("vllm:kv_cache_usage_perc", labels)] == 0.25  # a fraction, as in vLLM
    assert samples[("vllm:num_requests_waiting", labels)] == 2
    assert samples[("vllm:prompt_tokens_total", labels)] == 10
    assert samples[("vllm:generation_tokens_total", labels)] == 5
    success = (("engine", "0"), ("finished_reason", "stop"), ("model_name", "tiny"))
    assert samples[("vllm:request_success_total", success)] == 1
    assert samples[("vllm:inter_token_latency_seconds_count", labels)] == 2
    info = (("block_size", "16"), ("engine", "0"), ("num_gpu_blocks", "4096"))
    assert samples[("vllm:cache_config_info", info)] == 1
    # vLLM's buckets: TTFT from 1 ms to 2560 s, inter-token from 10 ms to 80 s
    ttft = [s.labels["le"] for s in families["vllm:time_to_first_token_seconds"].samples
            if s.name.endswith("_bucket")]  # fmt: skip
    assert ttft[0] == "0.001" and ttft[-2:] == ["2560.0", "+Inf"] and len(ttft) == 23
    itl = [s.labels["le"] for s in families["vllm:inter_token_latency_seconds"].samples
           if s.name.endswith("_bucket")]  # fmt: skip
    assert itl[0] == "0.01" and itl[-2:] == ["80.0", "+Inf"] and len(itl) == 20


def test_vllm_series_can_be_turned_off_and_tenants_are_counted() -> None:
    families = _observed(ServerMetrics(vllm_metrics=False))
    assert not [name for name in families if name.startswith("vllm:")]
    tokens = families["splitfuse_tenant_prompt_tokens"].samples
    assert [(s.labels["tenant"], s.value) for s in tokens if s.name.endswith("_total")] == [
        ("key1", 10)
    ]


def test_tenant_labels_are_capped() -> None:
    metrics = ServerMetrics()
    for index in range(40):
        metrics.observe_finished("stop", 1, 1, 1.0, None, None, [], tenant=f"t{index}")
    families = {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}
    tenants = {s.labels["tenant"] for s in families["splitfuse_tenant_prompt_tokens"].samples}
    assert len(tenants) == 33 and "other" in tenants
