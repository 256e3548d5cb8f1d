"""Offline throughput: the same workloads through splitfuse and through transformers ``generate``.

    python benchmarks/offline_throughput.py                      # 1, 8 and 32 concurrent requests
    python benchmarks/offline_throughput.py --concurrency 8 --output-len 64   # a quick look
    python benchmarks/offline_throughput.py --profile            # where a decode step's time goes
    python benchmarks/offline_throughput.py --deterministic      # the cost of deterministic mode
    python benchmarks/offline_throughput.py --quantization auto  # splitfuse as serve runs it

For each concurrency C, in one process and one run: 2C requests (random token ids of exactly
``--prompt-len`` tokens, exactly ``--output-len`` output tokens each, EOS ignored) through (1) the
splitfuse engine with at most C requests in flight (continuous batching, chunked prefill) and
(2) transformers ``generate`` in padded static batches of C. Prints output tokens/s of each and
their ratio.

splitfuse compiles its step graphs first, as ``splitfuse serve`` does (the start-up and compile
times are printed); ``--no-compile`` runs the eager forward throughout.

``--deterministic`` compares splitfuse with itself instead: the same workloads through the default
engine, then through one in deterministic mode (eager steps, batch-invariant products and
attention), and prints output tokens/s, mean TPOT and the ratios at each concurrency.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

import torch


def _prompts(num_requests: int, prompt_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [rng.randrange(100, vocab_size) for _ in range(prompt_len)] for _ in range(num_requests)
    ]


def start_splitfuse(
    args: argparse.Namespace, deterministic: bool = False
) -> tuple[object, float, float]:
    """The engine, its start-up time (ready to serve) and the time until its graphs compiled."""
    from engine import LLMEngine
    from engine.config import EngineConfig

    start = time.perf_counter()
    engine = LLMEngine(
        EngineConfig(
            model=args.model,
            dtype=args.dtype,
            max_batch_tokens=args.max_batch_tokens,
            kv_cache_memory=args.kv_cache_memory,
            compile=args.compile,
            deterministic=deterministic,
            quantization=args.quantization,
        )
    )
    ready = time.perf_counter() - start
    engine.wait_until_compiled()
    return engine, ready, time.perf_counter() - start


def run_splitfuse(
    engine: object, prompts: list[list[int]], args: argparse.Namespace, concurrency: int
) -> float:
    """Output tokens/s with at most ``concurrency`` requests in flight."""
    return splitfuse_summary(engine, prompts, args, concurrency)["output_throughput"]


def splitfuse_summary(
    engine: object, prompts: list[list[int]], args: argparse.Namespace, concurrency: int
) -> dict:
    """``server.bench.run_offline``'s summary with at most ``concurrency`` requests in flight."""
    from server.bench import Workload, run_offline

    warmup = Workload(num_prompts=2, input_len=8, output_len=4, vocab_size=args.vocab_size)
    run_offline(engine, warmup)
    workload = Workload(
        num_prompts=len(prompts),
        input_len=args.prompt_len,
        output_len=args.output_len,
        concurrency=concurrency,
        seed=args.seed,
        vocab_size=args.vocab_size,
    )
    summary = run_offline(engine, workload)
    assert summary["failed"] == 0, summary["errors"]
    return summary


def compare_deterministic(
    args: argparse.Namespace, prompts: list[list[int]], levels: list[int]
) -> None:
    """The default engine, then one in deterministic mode, on the same workloads: output
    tokens/s and mean TPOT of each, and deterministic's cost (default / deterministic
    throughput, deterministic / default TPOT)."""
    results = {}
    for deterministic in (False, True):
        engine, ready, compiled = start_splitfuse(args, deterministic)
        mode = "deterministic" if deterministic else "default"
        print(
            f"{mode}: ready in {ready:.1f} s, graphs {engine.runner.graphs.mode} after "
            f"{compiled:.1f} s, {engine.config.dtype}, {torch.get_num_threads()} threads"
        )
        results[deterministic] = {
            c: splitfuse_summary(engine, prompts[: 2 * c], args, c) for c in levels
        }
        engine.shutdown()
        del engine
    print(f"workload: 2C requests x ({args.prompt_len} prompt, {args.output_len} output) tokens")
    print(
        f"{'concurrency':>12}{'default tok/s':>15}{'determ. tok/s':>15}{'cost':>7}"
        f"{'default TPOT':>14}{'determ. TPOT':>14}{'cost':>7}"
    )
    for c in levels:
        default, deterministic = results[False][c], results[True][c]
        tpot, tpot_det = default["tpot"]["mean_ms"], deterministic["tpot"]["mean_ms"]
        rate, rate_det = default["output_throughput"], deterministic["output_throughput"]
        print(
            f"{c:12d}{rate:15.1f}{rate_det:15.1f}{rate / rate_det:7.2f}"
            f"{tpot:11.1f} ms{tpot_det:11.1f} ms{tpot_det / tpot:7.2f}"
        )


def load_transformers(args: argparse.Namespace) -> object:
    from transformers import AutoModelForCausalLM

    from engine.model_resolver import resolve_model

    dtype = torch.float32 if args.dtype == "auto" else getattr(torch, args.dtype)
    return AutoModelForCausalLM.from_pretrained(resolve_model(args.model), dtype=dtype).eval()


def run_transformers(
    model: object, prompts: list[list[int]], args: argparse.Namespace, batch_size: int
) -> float:
    """Output tokens/s of ``generate`` over padded static batches of ``batch_size``."""
    pad_id = model.generation_config.pad_token_id or 0

    def generate(batch: list[list[int]], num_tokens: int) -> int:
        length = max(len(p) for p in batch)
        input_ids = torch.tensor([[pad_id] * (length - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (length - len(p)) + [1] * len(p) for p in batch])
        with torch.inference_mode():
            out = model.generate(
                input_ids,
                attention_mask=mask,
                max_new_tokens=num_tokens,
                min_new_tokens=num_tokens,
                do_sample=False,
                pad_token_id=pad_id,
            )
        return (out.shape[1] - length) * len(batch)

    generate(prompts[:2], 4)  # warm-up
    start = time.perf_counter()
    num_output = 0
    for index in range(0, len(prompts), batch_size):
        num_output += generate(prompts[index : index + batch_size], args.output_len)
    return num_output / (time.perf_counter() - start)


def profile_steps(args: argparse.Namespace, prompts: list[list[int]]) -> None:
    """Where a decode step's time goes, at one request and at all of them: the medians of the
    step's parts (schedule, input tensors, forward, sampling, update), then torch.profiler's
    operators by self CPU time."""
    from torch.profiler import ProfilerActivity, profile

    from engine import LLMEngine
    from engine.config import EngineConfig
    from engine.input_builder import build_model_input
    from scheduler.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=10**6, ignore_eos=True)
    for num_requests in sorted({1, len(prompts)}):
        engine = LLMEngine(
            EngineConfig(
                model=args.model,
                dtype=args.dtype,
                max_batch_tokens=args.max_batch_tokens,
                max_batch_seqs=max(num_requests, 1),
                kv_cache_memory=args.kv_cache_memory,
                compile=args.compile,
                quantization=args.quantization,
            )
        )
        engine.wait_until_compiled()
        for index, prompt in enumerate(prompts[:num_requests]):
            engine.add_request(str(index), prompt, params)
        engine.step()
        while engine.stats().last_step_num_tokens != num_requests:
            engine.step()  # until every request decodes
        scheduler, runner = engine.scheduler, engine.runner
        parts: dict[str, list[float]] = {
            name: [] for name in ("schedule", "inputs", "forward", "sample", "update", "step")
        }
        for _ in range(10):
            t0 = time.perf_counter()
            batch = scheduler.schedule()
            t1 = time.perf_counter()
            inputs = build_model_input(
                batch, runner.block_size, runner.input_device(), runner.prompt_tiles
            )
            t2 = time.perf_counter()
            logits = runner.run(inputs)
            t3 = time.perf_counter()
            sampled = runner.sampler.sample(logits, batch.sample_request_ids)
            t4 = time.perf_counter()
            scheduler.update(batch, sampled.token_ids)
            t5 = time.perf_counter()
            for name, seconds in zip(
                parts, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t5 - t0), strict=True
            ):
                parts[name].append(seconds * 1e3)
        medians = ", ".join(f"{name} {statistics.median(v):.2f}" for name, v in parts.items())
        print(f"\ndecode step, {num_requests} rows (median ms): {medians}")
        num_steps = 3
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(num_steps):
                engine.step()
        events = prof.key_averages()
        num_ops = sum(event.count for event in events) / num_steps  # nested operators included
        num_layers = engine.model_config.num_layers
        print(f"operators per step: {num_ops:.0f} ({num_ops / num_layers:.0f} per layer)")
        print(events.table(sort_by="self_cpu_time_total", row_limit=12))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    parser.add_argument(
        "--quantization",
        default="none",
        choices=["none", "int8", "int4", "auto"],
        help="splitfuse's weights (transformers keeps the model's dtype; serve's default: auto)",
    )
    parser.add_argument("--concurrency", default="1,8,32", help="comma-separated (1,8,32)")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-batch-tokens", type=int, default=512)
    parser.add_argument("--kv-cache-memory", default="2GiB")
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="compile splitfuse's step graphs first, as serve does (default: on)",
    )
    parser.add_argument(
        "--profile", action="store_true", help="profile decode steps instead of the comparison"
    )
    parser.add_argument(
        "--deterministic",
        action="store_true",
        help="compare the default engine with deterministic mode instead of transformers",
    )
    args = parser.parse_args(argv)
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    levels = [int(level) for level in args.concurrency.split(",")]

    from engine.model_config import ModelConfig
    from engine.model_resolver import resolve_model

    args.vocab_size = ModelConfig.from_dir(resolve_model(args.model)).vocab_size
    prompts = _prompts(2 * max(levels), args.prompt_len, args.vocab_size, args.seed)
    if args.profile:
        profile_steps(args, prompts[: max(levels)])
        return 0
    if args.deterministic:
        compare_deterministic(args, prompts, levels)
        return 0
    engine, ready, compiled = start_splitfuse(args)
    dtype = engine.config.dtype
    print(
        f"workload: 2C requests x ({args.prompt_len} prompt, {args.output_len} output) tokens, "
        f"{dtype}, {torch.get_num_threads()} threads; splitfuse (weights: "
        f"{engine.config.quantization.method}) ready in {ready:.1f} s, graphs compiled after "
        f"{compiled:.1f} s ({engine.runner.graphs.mode})"
    )
    ours = {c: run_splitfuse(engine, prompts[: 2 * c], args, c) for c in levels}
    engine.shutdown()
    del engine
    theirs: dict[int, float] = {}
    if not args.skip_transformers:
        args.dtype = dtype  # the same numbers as ours
        model = load_transformers(args)
        theirs = {c: run_transformers(model, prompts[: 2 * c], args, c) for c in levels}
    print(f"{'concurrency':>12}{'splitfuse tok/s':>17}{'transformers tok/s':>20}{'ratio':>8}")
    for c in levels:
        other = theirs.get(c)
        cells = f"{c:12d}{ours[c]:17.1f}"
        if other:
            cells += f"{other:20.1f}{ours[c] / other:8.2f}"
        print(cells)
    return 0


if __name__ == "__main__":
    sys.exit(main())
