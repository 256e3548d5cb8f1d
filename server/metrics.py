"""Prometheus metrics, prefixed ``splitfuse_``, on a private registry per app.

Request-level metrics are observed by the server when a request ends; engine-level ones (gauges,
prefix cache, preemptions, batch tokens, step time) by the engine thread after each step.
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

# The *_created series double the output and no dashboard reads them.
disable_created_metrics()

_LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5,
    5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
_TOKEN_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
    0.5, 0.75, 1.0, 2.5,
)  # fmt: skip
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
_BATCH_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class ServerMetrics:
    """All of the server's metrics; one instance per app, each with its own registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "splitfuse_requests",
            "Finished requests by finish reason",
            ["finish_reason"],
            registry=r,
        )
        self.http_requests = Counter(
            "splitfuse_http_requests",
            "HTTP requests by method, route and status code",
            ["method", "route", "status_code"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "splitfuse_prompt_tokens", "Prompt tokens of finished requests", registry=r
        )
        self.generation_tokens = Counter(
            "splitfuse_generation_tokens", "Generated tokens of finished requests", registry=r
        )
        self.time_to_first_token = Histogram(
            "splitfuse_time_to_first_token_seconds",
            "Arrival to first generated token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.inter_token_latency = Histogram(
            "splitfuse_inter_token_latency_seconds",
            "Time between consecutive generated tokens",
            buckets=_TOKEN_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e_request_latency = Histogram(
            "splitfuse_e2e_request_latency_seconds",
            "Arrival to the last token",
            buckets=_E2E_BUCKETS,
            registry=r,
        )
        self.request_queue_time = Histogram(
            "splitfuse_request_queue_time_seconds",
            "Arrival to the first scheduling of the request (time spent waiting)",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.num_requests_running = Gauge(
            "splitfuse_num_requests_running", "Requests in the running batch", registry=r
        )
        self.num_requests_waiting = Gauge(
            "splitfuse_num_requests_waiting", "Requests waiting to be admitted", registry=r
        )
        self.kv_cache_usage = Gauge(
            "splitfuse_kv_cache_usage_ratio", "Fraction of KV blocks in use", registry=r
        )
        self.prefix_cache_queries = Counter(
            "splitfuse_prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache",
            registry=r,
        )
        self.prefix_cache_hits = Counter(
            "splitfuse_prefix_cache_hits", "Prompt tokens found in the prefix cache", registry=r
        )
        self.num_preemptions = Counter(
            "splitfuse_num_preemptions", "Requests preempted for lack of KV blocks", registry=r
        )
        self.batch_tokens = Histogram(
            "splitfuse_batch_tokens",
            "Tokens per engine step",
            buckets=_BATCH_TOKEN_BUCKETS,
            registry=r,
        )
        self.step_duration = Histogram(
            "splitfuse_step_duration_seconds",
            "Engine step time",
            buckets=_TOKEN_LATENCY_BUCKETS,
            registry=r,
        )
        self._last_totals = (0, 0, 0)

    def observe_engine_stats(self, stats: object, stepped: bool) -> None:
        """From ``LLMEngine.stats()``; totals become counter increments. Thread-safe."""
        self.num_requests_running.set(stats.num_running)  # type: ignore[attr-defined]
        self.num_requests_waiting.set(stats.num_waiting)  # type: ignore[attr-defined]
        self.kv_cache_usage.set(stats.kv_cache_usage)  # type: ignore[attr-defined]
        totals = (
            stats.prefix_cache_queries,  # type: ignore[attr-defined]
            stats.prefix_cache_hits,  # type: ignore[attr-defined]
            stats.num_preemptions,  # type: ignore[attr-defined]
        )
        counters = (self.prefix_cache_queries, self.prefix_cache_hits, self.num_preemptions)
        for counter, now, before in zip(counters, totals, self._last_totals, strict=True):
            if now > before:
                counter.inc(now - before)
        self._last_totals = totals
        if stepped and stats.last_step_num_tokens > 0:  # type: ignore[attr-defined]
            self.batch_tokens.observe(stats.last_step_num_tokens)  # type: ignore[attr-defined]
            self.step_duration.observe(stats.last_step_seconds)  # type: ignore[attr-defined]

    def observe_finished(
        self,
        finish_reason: str,
        num_prompt_tokens: int,
        num_output_tokens: int,
        e2e_seconds: float,
        first_token_seconds: float | None,
        queue_seconds: float | None,
        token_gaps: list[float],
    ) -> None:
        """One finished sequence (the n of one API call count as n)."""
        self.requests.labels(finish_reason=finish_reason).inc()
        self.prompt_tokens.inc(num_prompt_tokens)
        self.generation_tokens.inc(num_output_tokens)
        self.e2e_request_latency.observe(e2e_seconds)
        if first_token_seconds is not None:
            self.time_to_first_token.observe(first_token_seconds)
        if queue_seconds is not None:
            self.request_queue_time.observe(queue_seconds)
        for gap in token_gaps:
            self.inter_token_latency.observe(gap)

    def render(self) -> bytes:
        return generate_latest(self.registry)
