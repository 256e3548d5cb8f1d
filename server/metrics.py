"""Prometheus metrics, prefixed ``splitfuse_``, on a private registry per app.

Request-level metrics are observed by the server when a request ends; engine-level ones (gauges,
prefix cache, preemptions, batch tokens, step time) by the engine thread after each step.

Unless turned off (``vllm_metrics: false``), the same observations also feed the ``vllm:*``
series that gateways and autoscalers read from vLLM-compatible servers (the Gateway API Inference
Extension's endpoint picker: waiting, running, KV-cache usage, cache config; llm-d and KEDA/HPA
recipes: the latency histograms and token counters), with vLLM's names, units (seconds; KV usage
as a fraction 0..1), histogram buckets and labels (``model_name``, ``engine``).
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

# vLLM's own buckets for its series (vllm/v1/metrics/loggers.py), so that recorded quantiles match.
_VLLM_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
_VLLM_ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
)  # fmt: skip
_VLLM_REQUEST_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
_VLLM_LABELS = ("model_name", "engine")
# vLLM's finished_reason values; ours are the same words.
_VLLM_FINISH_REASONS = ("stop", "length", "abort", "error")

# Per-tenant series keep at most this many tenant labels; later tenants count as "other".
MAX_TENANT_LABELS = 32

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class ServerMetrics:
    """All of the server's metrics; one instance per app, each with its own registry."""

    def __init__(self, vllm_metrics: bool = True) -> None:
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
        self.tenant_prompt_tokens = Counter(
            "splitfuse_tenant_prompt_tokens",
            "Prompt tokens of finished requests by tenant",
            ["tenant"],
            registry=r,
        )
        self.tenant_generation_tokens = Counter(
            "splitfuse_tenant_generation_tokens",
            "Generated tokens of finished requests by tenant",
            ["tenant"],
            registry=r,
        )
        self.requests_evicted = Counter(
            "splitfuse_requests_evicted",
            "Queued requests evicted by a request of higher priority (each got a 429)",
            registry=r,
        )
        self._tenants: set[str] = set()
        self._last_totals = (0, 0, 0)
        self.vllm: _VllmSeries | None = _VllmSeries(r) if vllm_metrics else None

    def set_engine_info(self, model_name: str, block_size: int, num_kv_blocks: int) -> None:
        """Once the engine is loaded: the ``model_name`` label and vLLM's cache-config series."""
        if self.vllm is not None:
            self.vllm.bind(model_name, block_size, num_kv_blocks)

    def _tenant_label(self, tenant: str) -> str:
        if tenant not in self._tenants and len(self._tenants) >= MAX_TENANT_LABELS:
            return "other"
        self._tenants.add(tenant)
        return tenant

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
        if self.vllm is not None:
            self.vllm.observe_engine_stats(stats)
        if stepped and stats.last_step_num_tokens > 0:  # type: ignore[attr-defined]
            # a pass of several decode steps counts as that many steps, each its share of the time
            num_steps = stats.last_step_num_steps  # type: ignore[attr-defined]
            for _ in range(num_steps):
                self.batch_tokens.observe(stats.last_step_num_tokens)  # type: ignore[attr-defined]
                self.step_duration.observe(stats.last_step_seconds / num_steps)  # type: ignore[attr-defined]

    def observe_finished(
        self,
        finish_reason: str,
        num_prompt_tokens: int,
        num_output_tokens: int,
        e2e_seconds: float,
        first_token_seconds: float | None,
        queue_seconds: float | None,
        token_gaps: list[float],
        tenant: str = "default",
    ) -> None:
        """One finished sequence (the n of one API call count as n)."""
        label = self._tenant_label(tenant)
        self.tenant_prompt_tokens.labels(tenant=label).inc(num_prompt_tokens)
        self.tenant_generation_tokens.labels(tenant=label).inc(num_output_tokens)
        if self.vllm is not None:
            self.vllm.observe_finished(
                finish_reason,
                num_prompt_tokens,
                num_output_tokens,
                e2e_seconds,
                first_token_seconds,
                queue_seconds,
                token_gaps,
            )
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


class _VllmSeries:
    """The ``vllm:*`` series, labelled ``model_name`` (the served name) and ``engine`` ("0")."""

    def __init__(self, r: CollectorRegistry) -> None:
        labels = _VLLM_LABELS
        self.num_requests_running = Gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches.",
            labels, registry=r,
        )  # fmt: skip
        self.num_requests_waiting = Gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed.",
            labels, registry=r,
        )  # fmt: skip
        self.kv_cache_usage = Gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
            labels, registry=r,
        )  # fmt: skip
        self.prefix_cache_queries = Counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.", labels, registry=r,
        )  # fmt: skip
        self.prefix_cache_hits = Counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.", labels, registry=r,
        )  # fmt: skip
        self.num_preemptions = Counter(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine.",
            labels, registry=r,
        )  # fmt: skip
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", labels, registry=r
        )
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", labels, registry=r
        )
        self.request_success = Counter(
            "vllm:request_success", "Count of successfully processed requests.",
            (*labels, "finished_reason"), registry=r,
        )  # fmt: skip
        self.time_to_first_token = Histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
            labels, buckets=_VLLM_TTFT_BUCKETS, registry=r,
        )  # fmt: skip
        self.inter_token_latency = Histogram(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
            labels, buckets=_VLLM_ITL_BUCKETS, registry=r,
        )  # fmt: skip
        self.e2e_request_latency = Histogram(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
            labels, buckets=_VLLM_REQUEST_BUCKETS, registry=r,
        )  # fmt: skip
        self.request_queue_time = Histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            labels, buckets=_VLLM_REQUEST_BUCKETS, registry=r,
        )  # fmt: skip
        self.cache_config_info = Gauge(
            "vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
            ("block_size", "num_gpu_blocks", "engine"), registry=r,
        )  # fmt: skip
        self._registry = r
        self._model_name = ""
        self._last_totals = (0, 0, 0)

    def bind(self, model_name: str, block_size: int, num_kv_blocks: int) -> None:
        self._model_name = model_name
        self.cache_config_info.labels(
            block_size=str(block_size), num_gpu_blocks=str(num_kv_blocks), engine="0"
        ).set(1)

    def _labels(self) -> dict[str, str]:
        return {"model_name": self._model_name, "engine": "0"}

    def observe_engine_stats(self, stats: object) -> None:
        if not self._model_name:
            return  # the server has not bound the engine yet
        labels = self._labels()
        self.num_requests_running.labels(**labels).set(stats.num_running)  # type: ignore[attr-defined]
        self.num_requests_waiting.labels(**labels).set(stats.num_waiting)  # type: ignore[attr-defined]
        self.kv_cache_usage.labels(**labels).set(stats.kv_cache_usage)  # type: ignore[attr-defined]
        totals = (
            stats.prefix_cache_queries,  # type: ignore[attr-defined]
            stats.prefix_cache_hits,  # type: ignore[attr-defined]
            stats.num_preemptions,  # type: ignore[attr-defined]
        )
        counters = (self.prefix_cache_queries, self.prefix_cache_hits, self.num_preemptions)
        for counter, now, before in zip(counters, totals, self._last_totals, strict=True):
            if now > before:
                counter.labels(**labels).inc(now - before)
        self._last_totals = totals

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
        labels = self._labels()
        if finish_reason in _VLLM_FINISH_REASONS:
            self.request_success.labels(**labels, finished_reason=finish_reason).inc()
        self.prompt_tokens.labels(**labels).inc(num_prompt_tokens)
        self.generation_tokens.labels(**labels).inc(num_output_tokens)
        self.e2e_request_latency.labels(**labels).observe(e2e_seconds)
        if first_token_seconds is not None:
            self.time_to_first_token.labels(**labels).observe(first_token_seconds)
        if queue_seconds is not None:
            self.request_queue_time.labels(**labels).observe(queue_seconds)
        histogram = self.inter_token_latency.labels(**labels)
        for gap in token_gaps:
            histogram.observe(gap)
