"""Serving benchmark: fixed-seed random prompts of a given length, sent to an OpenAI-compatible
``/v1/completions`` at a fixed concurrency or a Poisson rate; reports throughput and latency
percentiles (like ``vllm bench serve``). ``run_offline`` runs the same workload on an in-process
engine, the reference for the server's overhead; ``run_offline_profiled`` runs it under
``torch.profiler`` and adds each step's breakdown (forward, attention, sampling, scheduling).

Latencies per request (streamed):
    ttft  arrival -> first token        itl  gaps between token-bearing chunks
    tpot  (e2e - ttft) / (output tokens - 1)        e2e  arrival -> last chunk
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

PERCENTILES = (50, 90, 99)
# profiler events that are attention (its K/V store included): the torch backend's operator on
# CPUs, the Triton backend's kernels on GPUs
ATTENTION_CPU_EVENTS = ("splitfuse::attend",)
ATTENTION_GPU_EVENTS = ("_paged_attention_kernel", "_merge_splits_kernel", "_store_kv_kernel")
TRACE_FILE = "trace.json"
_OFFLINE_RUNS = itertools.count()


@dataclass(frozen=True)
class Workload:
    num_prompts: int
    input_len: int
    output_len: int
    concurrency: int | None = None  # at most this many in flight
    request_rate: float | None = None  # Poisson arrivals per second (None: all at once)
    seed: int = 0
    vocab_size: int = 32000
    ignore_eos: bool = True

    def prompts(self) -> list[list[int]]:
        """Random token ids, drawn from the upper 90% of the vocabulary (clear of special ids)."""
        rng = random.Random(self.seed)
        low = max(1, self.vocab_size // 10)
        return [
            [rng.randrange(low, self.vocab_size) for _ in range(self.input_len)]
            for _ in range(self.num_prompts)
        ]

    def arrival_delays(self) -> list[float]:
        """Seconds to wait before each request (all 0 without a rate)."""
        if self.request_rate is None:
            return [0.0] * self.num_prompts
        rng = random.Random(self.seed + 1)
        return [rng.expovariate(self.request_rate) for _ in range(self.num_prompts)]


@dataclass
class RequestResult:
    ok: bool
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def tpot(self) -> float | None:
        if self.num_output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.num_output_tokens - 1)


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); 0.0 when empty."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _summary_ms(values: Sequence[float]) -> dict[str, float]:
    out = {"mean_ms": 1e3 * sum(values) / len(values) if values else 0.0}
    for q in PERCENTILES:
        out[f"p{q}_ms"] = 1e3 * percentile(values, q)
    return out


def summarize(results: list[RequestResult], duration: float) -> dict[str, Any]:
    done = [r for r in results if r.ok]
    num_output = sum(r.num_output_tokens for r in done)
    num_prompt = sum(r.num_prompt_tokens for r in done)
    return {
        "duration_s": duration,
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "total_prompt_tokens": num_prompt,
        "total_output_tokens": num_output,
        "request_throughput": len(done) / duration if duration else 0.0,
        "output_throughput": num_output / duration if duration else 0.0,
        "total_token_throughput": (num_prompt + num_output) / duration if duration else 0.0,
        "ttft": _summary_ms([r.ttft for r in done]),
        "tpot": _summary_ms([t for r in done if (t := r.tpot) is not None]),
        "itl": _summary_ms([gap for r in done for gap in r.itl]),
        "e2e_latency": _summary_ms([r.e2e for r in done]),
    }


async def _one_request(
    client: httpx.AsyncClient, model: str, prompt: list[int], workload: Workload
) -> RequestResult:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": workload.output_len,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if workload.ignore_eos:
        body["ignore_eos"] = True
    result = RequestResult(ok=False, num_prompt_tokens=len(prompt))
    start = time.perf_counter()
    last = start
    num_chunks = 0
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.error = str(chunk["error"].get("message"))
                    return result
                now = time.perf_counter()
                if chunk.get("choices"):
                    if num_chunks == 0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    num_chunks += 1
                    last = now
                if chunk.get("usage"):
                    result.num_output_tokens = chunk["usage"]["completion_tokens"]
                    result.num_prompt_tokens = chunk["usage"]["prompt_tokens"]
    except httpx.HTTPError as error:
        result.error = f"{type(error).__name__}: {error}"
        return result
    result.e2e = last - start
    result.num_output_tokens = result.num_output_tokens or num_chunks
    result.ok = num_chunks > 0
    if not result.ok:
        result.error = "no tokens streamed"
    return result


async def run_against_server(
    base_url: str, workload: Workload, model: str | None = None, api_key: str | None = None
) -> dict[str, Any]:
    """Runs the workload against ``base_url`` (without /v1) and returns the summary."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=(workload.concurrency or workload.num_prompts) + 4)
    timeout = httpx.Timeout(600.0, connect=30.0)
    async with httpx.AsyncClient(
        base_url=base_url, headers=headers, limits=limits, timeout=timeout
    ) as client:
        if model is None:
            response = await client.get("/v1/models")
            response.raise_for_status()
            model = response.json()["data"][0]["id"]
        prompts = workload.prompts()
        delays = workload.arrival_delays()
        gate = asyncio.Semaphore(workload.concurrency or len(prompts))

        async def limited(prompt: list[int]) -> RequestResult:
            async with gate:
                return await _one_request(client, model, prompt, workload)

        start = time.perf_counter()
        tasks = []
        for prompt, delay in zip(prompts, delays, strict=True):
            if delay:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(limited(prompt)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return {"model": model, "workload": asdict(workload), **summarize(results, duration)}


def run_offline(engine: Any, workload: Workload) -> dict[str, Any]:
    """The same workload on an in-process engine (no HTTP): at most ``concurrency`` requests in
    flight, arrivals ignored. Token timings are taken at step boundaries."""
    from scheduler.sampling_params import SamplingParams

    params = SamplingParams(
        max_tokens=workload.output_len, temperature=0, ignore_eos=workload.ignore_eos
    )
    prompts = workload.prompts()
    limit = workload.concurrency or len(prompts)
    run_id = next(_OFFLINE_RUNS)  # ids stay unique across runs on one engine
    results: dict[str, RequestResult] = {}
    starts: dict[str, float] = {}
    lasts: dict[str, float] = {}
    next_index = 0
    num_in_flight = 0
    start = time.perf_counter()
    while next_index < len(prompts) or engine.has_unfinished_requests():
        while num_in_flight < limit and next_index < len(prompts):
            request_id = f"bench-{run_id}-{next_index}"
            engine.add_request(request_id, prompts[next_index], params)
            results[request_id] = RequestResult(ok=False, num_prompt_tokens=workload.input_len)
            starts[request_id] = time.perf_counter()
            next_index += 1
            num_in_flight += 1
        outputs = engine.step()
        now = time.perf_counter()
        for output in outputs:
            result = results[output.request_id]
            if output.new_token_ids:
                if result.num_output_tokens == 0:
                    result.ttft = now - starts[output.request_id]
                else:
                    result.itl.append(now - lasts[output.request_id])
                lasts[output.request_id] = now
                result.num_output_tokens += len(output.new_token_ids)
            if output.finished:
                result.ok = output.finish_reason in ("stop", "length")
                result.error = output.error or ""
                result.e2e = now - starts[output.request_id]
                num_in_flight -= 1
    duration = time.perf_counter() - start
    return {
        "model": getattr(engine, "model_name", "?"),
        "workload": asdict(workload),
        **summarize(list(results.values()), duration),
    }


def run_offline_profiled(
    engine: Any, workload: Workload, trace_dir: Path | None = None
) -> dict[str, Any]:
    """``run_offline`` under ``torch.profiler`` with the engine's step timings on
    (``engine/step_timings.py``). The summary gains ``profile``: milliseconds per step (the mean
    over the run's forward passes) of the forward pass, attention within it (from the
    profiler's events), sampling, scheduling and the rest of the step; with ``trace_dir``, the
    profiler's Chrome trace is written to ``trace_dir/trace.json``. Both timings and the
    profiler slow the steps down a little: the breakdown's shares are what it is for."""
    from torch.profiler import ProfilerActivity, profile

    on_gpu = engine.runner.device.type == "cuda"
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if on_gpu else [])]
    timings = engine.profile(True)
    try:
        with profile(activities=activities) as profiler:
            summary = run_offline(engine, workload)
    finally:
        engine.profile(False)
    attention_us = 0.0
    for event in profiler.key_averages():
        if on_gpu and event.key in ATTENTION_GPU_EVENTS:
            attention_us += event.device_time_total
        elif not on_gpu and event.key in ATTENTION_CPU_EVENTS:
            attention_us += event.cpu_time_total
    num_steps = max(1, len(timings.forward))
    per_step = {
        "forward_ms": 1e3 * sum(timings.forward) / num_steps,
        "attention_ms": 1e-3 * attention_us / num_steps,
        "sampling_ms": 1e3 * sum(timings.sampling) / num_steps,
        "scheduling_ms": 1e3 * sum(timings.scheduling) / num_steps,
    }
    step_ms = 1e3 * summary["duration_s"] / num_steps
    phases_ms = per_step["forward_ms"] + per_step["sampling_ms"] + per_step["scheduling_ms"]
    per_step["other_ms"] = max(0.0, step_ms - phases_ms)
    summary["profile"] = {"num_steps": len(timings.forward), "step_ms": step_ms, **per_step}
    if trace_dir is not None:
        trace_dir.mkdir(parents=True, exist_ok=True)
        profiler.export_chrome_trace(str(trace_dir / TRACE_FILE))
        summary["profile"]["trace"] = str(trace_dir / TRACE_FILE)
    return summary


def format_profile(profile: dict[str, Any]) -> str:
    """The per-step breakdown of ``run_offline_profiled`` as lines of text."""
    step_ms = profile["step_ms"] or 1.0

    def line(name: str, ms: float, note: str = "") -> str:
        return f"{name:<12} {ms:9.2f} ms  {100 * ms / step_ms:5.1f}%{note}"

    lines = [f"---- per step: mean of {profile['num_steps']} steps, {step_ms:.2f} ms each ----"]
    lines.append(line("forward", profile["forward_ms"]))
    lines.append(line("  attention", profile["attention_ms"], "  (within forward)"))
    lines.append(line("sampling", profile["sampling_ms"]))
    lines.append(line("scheduling", profile["scheduling_ms"]))
    lines.append(line("other", profile["other_ms"], "  (inputs, outputs, the bench loop)"))
    if "trace" in profile:
        lines.append(f"Chrome trace: {profile['trace']} (chrome://tracing, ui.perfetto.dev)")
    return "\n".join(lines)


def format_report(summary: dict[str, Any], title: str) -> str:
    lines = [f"==== {title} ===="]
    lines.append(
        f"completed {summary['completed']}  failed {summary['failed']}  "
        f"duration {summary['duration_s']:.2f} s"
    )
    lines.append(f"request throughput     {summary['request_throughput']:.2f} req/s")
    lines.append(f"output token throughput {summary['output_throughput']:.1f} tok/s")
    lines.append(f"total token throughput  {summary['total_token_throughput']:.1f} tok/s")
    for name in ("ttft", "tpot", "itl", "e2e_latency"):
        stats = summary[name]
        lines.append(
            f"{name:<12} mean {stats['mean_ms']:9.1f} ms  "
            + "  ".join(f"p{q} {stats[f'p{q}_ms']:9.1f} ms" for q in PERCENTILES)
        )
    for error in summary.get("errors", []):
        lines.append(f"error: {error}")
    if "profile" in summary:
        lines.append(format_profile(summary["profile"]))
    return "\n".join(lines)
