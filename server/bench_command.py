"""``splitfuse bench``: a serving benchmark against any OpenAI-compatible URL (or, with
``--offline MODEL``, against an in-process engine on the same workload)."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="benchmark a running server (throughput, TTFT, ITL, TPOT, latency percentiles)",
        description=(
            "Send fixed-seed random prompts of --input-len tokens to BASE_URL/v1/completions "
            "(streaming, greedy, ignore_eos so that every request makes --output-len tokens), at "
            "--concurrency or at a Poisson --request-rate; print a report and write JSON."
        ),
    )
    add = parser.add_argument
    add("--base-url", default="http://127.0.0.1:8000", help="server URL, without /v1")
    add("--model", help="model name to send (default: the first of /v1/models)")
    add("--api-key", help="sent as 'Authorization: Bearer KEY'")
    add("--num-prompts", type=int, default=64)
    add("--input-len", type=int, default=128, help="prompt tokens per request")
    add("--output-len", type=int, default=128, help="generated tokens per request")
    add("--concurrency", type=int, help="requests in flight at most")
    add("--request-rate", type=float, help="Poisson arrivals per second (default: all at once)")
    add("--seed", type=int, default=0)
    add("--vocab-size", type=int, default=32000, help="prompt token ids are drawn below this")
    add("--no-ignore-eos", dest="ignore_eos", action="store_false", help="stop at EOS")
    add("--warmup", type=int, default=2, help="requests sent first and not measured")
    add("--output", type=Path, help="write the results as JSON here")
    add(
        "--offline",
        metavar="MODEL",
        help="run the workload on an in-process engine with MODEL instead of a server",
    )
    add("--dtype", default="auto", help="engine dtype for --offline")
    add("--max-batch-tokens", type=int, default=512, help="engine budget for --offline")
    add("--kv-cache-memory", default="0.3", help="engine KV cache for --offline")
    add("--num-threads", type=int, help="engine CPU threads for --offline (default: all cores)")
    add(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="compile the --offline engine's step graphs, as serve does (default: on)",
    )
    add(
        "--profile",
        action="store_true",
        help="--offline: run the measured workload under torch.profiler and print each step's "
        "breakdown (forward, attention, sampling, scheduling)",
    )
    add(
        "--profile-dir",
        type=Path,
        metavar="DIR",
        help="--offline: write the measured workload's torch.profiler Chrome trace to "
        "DIR/trace.json (implies --profile)",
    )
    parser.set_defaults(func=run)


def _check(args: argparse.Namespace) -> str | None:
    for name in ("num_prompts", "input_len", "output_len"):
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be >= 1"
    if args.concurrency is not None and args.concurrency < 1:
        return "--concurrency must be >= 1"
    if args.request_rate is not None and args.request_rate <= 0:
        return "--request-rate must be > 0"
    if args.vocab_size < 10:
        return "--vocab-size must be >= 10"
    if (args.profile or args.profile_dir is not None) and not args.offline:
        return "--profile and --profile-dir profile an in-process engine: they need --offline"
    return None


def run(args: argparse.Namespace) -> int:
    from server.bench import (
        Workload,
        format_report,
        run_against_server,
        run_offline,
        run_offline_profiled,
    )

    problem = _check(args)
    if problem:
        print(f"splitfuse bench: {problem}", file=sys.stderr)
        return 2
    workload = Workload(
        num_prompts=args.num_prompts,
        input_len=args.input_len,
        output_len=args.output_len,
        concurrency=args.concurrency,
        request_rate=args.request_rate,
        seed=args.seed,
        vocab_size=args.vocab_size,
        ignore_eos=args.ignore_eos,
    )
    warmup = Workload(
        num_prompts=args.warmup,
        input_len=args.input_len,
        output_len=min(args.output_len, 8),
        seed=args.seed + 1000,
        vocab_size=args.vocab_size,
    )
    if args.offline:
        from engine.config import EngineConfig
        from engine.device import freeze_long_lived_objects
        from engine.llm_engine import LLMEngine

        engine = LLMEngine(
            EngineConfig(
                model=args.offline,
                dtype=args.dtype,
                max_batch_tokens=args.max_batch_tokens,
                kv_cache_memory=args.kv_cache_memory,
                num_threads=args.num_threads,
                compile=args.compile,
            )
        )
        engine.wait_until_compiled()
        freeze_long_lived_objects()  # as the server does once its graphs are compiled
        if args.warmup:
            run_offline(engine, warmup)
        if args.profile or args.profile_dir is not None:
            summary = run_offline_profiled(engine, workload, args.profile_dir)
        else:
            summary = run_offline(engine, workload)
        title = f"offline engine {summary['model']}"
    else:
        try:
            if args.warmup:
                asyncio.run(run_against_server(args.base_url, warmup, args.model, args.api_key))
            summary = asyncio.run(
                run_against_server(args.base_url, workload, args.model, args.api_key)
            )
        except Exception as error:  # noqa: BLE001 - a CLI reports and exits non-zero
            print(f"splitfuse bench: {args.base_url}: {error}", file=sys.stderr)
            return 1
        title = f"{args.base_url} {summary['model']}"
    mode = f"concurrency {args.concurrency}" if args.concurrency else "unbounded concurrency"
    if args.request_rate:
        mode += f", {args.request_rate} req/s"
    print(format_report(summary, f"{title}: {args.input_len}/{args.output_len} tokens, {mode}"))
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(summary, indent=2))
    return 0 if summary["failed"] == 0 else 1
