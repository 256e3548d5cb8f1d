"""Offline throughput: the same workload through splitfuse and through transformers ``generate``.

    python benchmarks/offline_throughput.py                       # 64 x (128 prompt, 256 output)
    python benchmarks/offline_throughput.py --num-requests 16 --output-len 64   # a quick look

In one process and one run: (1) splitfuse ``LLM.generate`` over all requests at once (continuous
batching, chunked prefill); (2) transformers ``generate`` in padded static batches of
``--hf-batch-size``; (3) one request alone through each, timing the decode rate after the first
token. Prompts are random token ids of exactly ``--prompt-len`` tokens; every request generates
exactly ``--output-len`` tokens (EOS ignored). Prints tokens/s for each and the ratios.

splitfuse compiles its one-token forward at start-up, as ``splitfuse serve`` does (the start-up
time is printed); ``--no-compile`` runs the eager forward throughout.
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


def run_splitfuse(args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, float]:
    from engine import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        max_batch_tokens=args.max_batch_tokens,
        max_batch_seqs=max(len(prompts), 1),
        kv_cache_memory=args.kv_cache_memory,
        compile=args.compile,
    )
    startup = time.perf_counter() - start
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4))  # warm-up

    start = time.perf_counter()
    results = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    num_output = sum(len(r.token_ids) for r in results)
    assert num_output == len(prompts) * args.output_len, num_output

    engine = llm.engine
    engine.add_request("single", prompts[0], params)
    step_times = []
    first_token_time = None
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        step_start = time.perf_counter()
        outputs = engine.step()
        if outputs and first_token_time is None:
            first_token_time = time.perf_counter() - start
        elif outputs:
            step_times.append(time.perf_counter() - step_start)
    return {
        "throughput": num_output / seconds,
        "seconds": seconds,
        "single_decode": 1.0 / statistics.median(step_times),
        "single_ttft": first_token_time or 0.0,
        "startup": startup,
    }


def run_transformers(args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, float]:
    from transformers import AutoModelForCausalLM

    from engine.model_resolver import resolve_model

    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(resolve_model(args.model), dtype=dtype).eval()
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
    for index in range(0, len(prompts), args.hf_batch_size):
        num_output += generate(prompts[index : index + args.hf_batch_size], args.output_len)
    seconds = time.perf_counter() - start

    start = time.perf_counter()
    generate(prompts[:1], 1)
    first_token = time.perf_counter() - start
    start = time.perf_counter()
    generate(prompts[:1], args.output_len)
    whole = time.perf_counter() - start
    return {
        "throughput": num_output / seconds,
        "seconds": seconds,
        "single_decode": (args.output_len - 1) / max(whole - first_token, 1e-9),
        "single_ttft": first_token,
    }


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
            )
        )
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
            inputs = build_model_input(batch, runner.block_size, runner.device)
            t2 = time.perf_counter()
            logits = runner.model(
                inputs.input_ids, inputs.positions, inputs.metadata, runner.kv_cache,
                inputs.sample_rows,
            )  # fmt: skip
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
        num_layers = len(runner.model.layers)
        print(f"operators per step: {num_ops:.0f} ({num_ops / num_layers:.0f} per layer)")
        print(events.table(sort_by="self_cpu_time_total", row_limit=12))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--hf-batch-size", type=int, default=8)
    parser.add_argument("--max-batch-tokens", type=int, default=512)
    parser.add_argument("--kv-cache-memory", default="2GiB")
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="compile splitfuse's one-token forward at start-up, as serve does (default: on)",
    )
    parser.add_argument(
        "--profile", action="store_true", help="profile decode steps instead of the comparison"
    )
    args = parser.parse_args(argv)
    if args.num_threads:
        torch.set_num_threads(args.num_threads)

    from engine.model_config import ModelConfig
    from engine.model_resolver import resolve_model

    vocab_size = ModelConfig.from_dir(resolve_model(args.model)).vocab_size
    prompts = _prompts(args.num_requests, args.prompt_len, vocab_size, args.seed)
    print(
        f"workload: {args.num_requests} requests x ({args.prompt_len} prompt, {args.output_len} "
        f"output) tokens, {args.dtype}, {torch.get_num_threads()} threads",
        file=sys.stderr,
    )
    if args.profile:
        profile_steps(args, prompts)
        return 0
    ours = run_splitfuse(args, prompts)
    print(f"splitfuse: {ours}", file=sys.stderr, flush=True)
    theirs = None if args.skip_transformers else run_transformers(args, prompts)
    print(f"transformers: {theirs}", file=sys.stderr, flush=True)

    print(f"{'':28}{'splitfuse':>12}{'transformers':>14}{'ratio':>8}")
    rows = [
        ("throughput (output tok/s)", "throughput"),
        ("wall time (s)", "seconds"),
        ("single stream decode tok/s", "single_decode"),
        ("single stream TTFT (s)", "single_ttft"),
    ]
    print(f"splitfuse start-up (s): {ours['startup']:.1f} (compile: {args.compile})")
    for label, key in rows:
        mine = ours[key]
        if theirs is None:
            print(f"{label:28}{mine:12.2f}")
            continue
        other = theirs[key]
        ratio = mine / other if other else float("nan")
        print(f"{label:28}{mine:12.2f}{other:14.2f}{ratio:8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
