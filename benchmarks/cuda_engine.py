"""The engine on a CUDA device: parity with transformers, invariance checks, and decode figures.

    python benchmarks/cuda_engine.py                    # a random Llama (hidden 1024, 16 layers)
    python benchmarks/cuda_engine.py --layers 2 --hidden 64 --heads 4 --kv-heads 2 --device cpu

Builds a random Llama folder (``tests/tiny_model.py``: its ~1,000-token tokenizer, weights of std
1/sqrt(fan_in)) and prints one line per check, then the figures:

1. parity: greedy continuations of splitfuse (Triton backend, CUDA graphs) against transformers'
   ``generate`` on the same device, float32 and bfloat16, token by token; a divergence counts as a
   near-tie where transformers' top-2 logits there are within ``--near-tie`` (float32) or, in
   bfloat16, 8x that or at most two steps of bfloat16 at the top logit's size (transformers'
   logits are rounded to those steps); the largest difference of the sampled tokens'
   log-probabilities is printed.
2. the Triton backend against the torch backend (same device, float32); with and without CUDA
   graphs; batch invariance (a prompt alone against the same prompt among 15 others); preemption
   (a KV cache too small for every request at once) and prefix caching (a repeated prompt) against
   the plain run; deterministic mode (three prompts alone against the same among 16, bitwise).
3. single-stream decode latency (ms per token) with and without CUDA graphs, and offline
   throughput (generated tokens/s) at several concurrencies, bfloat16; the same with int8 and
   int4 weights (the Triton product), with CUDA graphs;
4. where one stream's step goes: the engine's phase timings and torch.profiler's busiest host
   operators.

Never asserts: a failed check prints FAIL and the script goes on; the exit status is the number of
failed checks (at most 100). On a machine without CUDA, ``--device cpu`` runs it at small sizes.
"""

from __future__ import annotations

import argparse
import gc
import math
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.llm import LLM  # noqa: E402
from scheduler.sampling_params import SamplingParams  # noqa: E402
from tests.model.parity_helpers import hf_generate  # noqa: E402
from tests.tiny_model import make_tiny_model  # noqa: E402

FAILURES: list[str] = []


def check(name: str, ok: bool, detail: str = "") -> None:
    print(f"{'ok  ' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}", flush=True)
    if not ok:
        FAILURES.append(name)


def prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (length,), generator=generator).tolist() for _ in range(count)]


def greedy(max_tokens: int, logprobs: int | None = None) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=logprobs
    )


def first_difference(expected: list[int], actual: list[int]) -> int | None:
    """The first index where the two differ (a shorter one differs where it ends), or None."""
    for index, (want, got) in enumerate(zip(expected, actual, strict=False)):
        if want != got:
            return index
    return None if len(expected) == len(actual) else min(len(expected), len(actual))


def free(*llms: LLM) -> None:
    """Shuts the engines down and gives their device memory back before the next one starts."""
    for llm in llms:
        llm.engine.shutdown()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def bfloat16_step(value: float) -> float:
    """The spacing of bfloat16 numbers (8 significant bits) around ``value``."""
    return 2.0 ** (math.floor(math.log2(max(abs(value), 2.0**-126))) - 7)


def parity(args, model_dir: Path, vocab: int) -> None:
    from transformers import AutoModelForCausalLM

    batch = prompts(4, 24, vocab, seed=1)
    for dtype in ("float32", "bfloat16"):
        torch_dtype = getattr(torch, dtype)
        reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype)
        reference.to(args.device).eval()
        near_tie = args.near_tie * (1 if dtype == "float32" else 8)
        llm = LLM(
            model=str(model_dir),
            device=args.device,
            dtype=dtype,
            compile=True,
            max_batch_tokens=32,  # the 24-token prompts run in chunks mixed with decodes
            kv_cache_memory="256MiB",
        )
        results = llm.generate(batch, greedy(args.parity_tokens, logprobs=0))
        worst_logprob = 0.0
        for index, (prompt, result) in enumerate(zip(batch, results, strict=True)):
            with torch.device(args.device):
                expected = hf_generate(reference, prompt, args.parity_tokens)
            logits = expected.logits.float().cpu()
            parted = first_difference(expected.token_ids, result.token_ids)
            if parted == len(expected.token_ids):  # transformers stopped at EOS: same so far
                parted = None
            compared = len(expected.token_ids) if parted is None else parted
            for position in range(compared):
                token = expected.token_ids[position]
                want = float(torch.log_softmax(logits[position], -1)[token])
                got = result.logprobs[position].logprob
                worst_logprob = max(worst_logprob, abs(want - got))
            if parted is None:
                check(f"parity {dtype} prompt {index}", True, f"{compared} tokens equal")
                continue
            top2 = logits[parted].topk(2).values
            gap = float(top2[0] - top2[1])
            # in bfloat16 also a gap of at most two steps at the top logit's size
            steps = 2 * bfloat16_step(float(top2[0])) if dtype == "bfloat16" else 0.0
            check(
                f"parity {dtype} prompt {index}",
                gap < near_tie or gap <= steps,
                f"parts at token {parted} where transformers' top-2 gap is {gap:.3g} "
                f"(near-tie below {near_tie:g}" + (f" or up to {steps:g})" if steps else ")"),
            )
        print(f"     parity {dtype}: largest |logprob difference| {worst_logprob:.3g}", flush=True)
        free(llm)
        del reference
        free()


def engine_checks(args, model_dir: Path, vocab: int) -> None:
    batch = prompts(16, 40, vocab, seed=2)
    params = greedy(args.check_tokens)
    base = dict(model=str(model_dir), device=args.device, dtype="float32")

    def run(**config) -> tuple[list[list[int]], LLM]:
        llm = LLM(**{**base, **config})
        return [result.token_ids for result in llm.generate(batch, params)], llm

    plain, llm = run(attention_backend="triton", compile=False, kv_cache_memory="512MiB")
    alone = [llm.generate([prompt], params)[0].token_ids for prompt in batch[:3]]
    check("batch invariance (3 prompts alone vs among 16)", alone == plain[:3])
    repeat = llm.generate(batch[:4], params)
    stats = llm.engine.stats()
    check(
        "prefix caching (4 prompts again)",
        [result.token_ids for result in repeat] == plain[:4] and stats.prefix_cache_hits > 0,
        f"{stats.prefix_cache_hits} of {stats.prefix_cache_queries} prompt tokens found",
    )
    free(llm)
    for name, config in (
        ("CUDA graphs", dict(attention_backend="triton", compile=True, kv_cache_memory="512MiB")),
        ("torch backend", dict(attention_backend="torch", compile=False, kv_cache_memory="512MiB")),
        # 16 rows of up to 40+N tokens in 16-token blocks need 16*ceil((40+N)/16) blocks
        ("preemption", dict(attention_backend="triton", compile=False, num_kv_blocks=24)),
    ):
        try:
            tokens, llm = run(**config)
            stats = llm.engine.stats()
            differ = sum(a != b for a, b in zip(tokens, plain, strict=True))
            extra = f", {stats.num_preemptions} preemptions" if name == "preemption" else ""
            ok = differ == 0 and (name != "preemption" or stats.num_preemptions > 0)
            check(f"{name} vs triton eager", ok, f"{differ} of 16 sequences differ{extra}")
            free(llm)
        except Exception:
            traceback.print_exc()
            check(f"{name} vs triton eager", False, "raised")
    try:  # deterministic mode: a prompt's tokens alone equal its tokens among 15 others, bitwise
        llm = LLM(**base, attention_backend="triton", deterministic=True, kv_cache_memory="512MiB")
        together = [result.token_ids for result in llm.generate(batch, params)]
        alone = [llm.generate([prompt], params)[0].token_ids for prompt in batch[:3]]
        differ = sum(a != b for a, b in zip(together, plain, strict=True))
        check(
            "deterministic mode: 3 prompts alone vs among 16",
            alone == together[:3],
            f"{differ} of 16 sequences differ from the default mode's",
        )
        free(llm)
    except Exception:
        traceback.print_exc()
        check("deterministic mode", False, "raised")


def decode_latency(llm: LLM, vocab: int, device: str, tokens: int) -> float:
    """Seconds per decode step of one stream (a 16-token prompt, ``tokens`` generated)."""
    prompt = prompts(1, 16, vocab, seed=3)
    llm.generate(prompt, greedy(8))  # warm-up
    sync(device)
    start = time.perf_counter()
    llm.generate(prompt, greedy(tokens + 1))
    sync(device)
    first = time.perf_counter()
    llm.generate(prompt, greedy(1))
    sync(device)
    prefill = time.perf_counter() - first
    return (first - start - prefill) / tokens


def throughput(llm: LLM, vocab: int, device: str, concurrency: int, prompt_len: int, out: int):
    """Generated tokens/s of ``concurrency`` requests at once. Warmed up first by the same
    workload on other prompts (a few tokens each): the same prompt chunks and mixed steps, so
    that Triton compiles their kernel variants before the timed run, and no prefix-cache hit
    (the timed prompts are new to the cache)."""
    llm.generate(prompts(concurrency, prompt_len, vocab, seed=1000 + concurrency), greedy(8))
    batch = prompts(concurrency, prompt_len, vocab, seed=2000 + concurrency)
    sync(device)
    start = time.perf_counter()
    results = llm.generate(batch, greedy(out))
    sync(device)
    elapsed = time.perf_counter() - start
    return sum(len(result.token_ids) for result in results) / elapsed


def figures(args, model_dir: Path, vocab: int, parameters: int) -> None:
    dtype = args.bench_dtype
    latencies = {}
    for quantization in args.bench_quantization.split(","):
        for graphs in (False, True) if quantization == "none" else (True,):
            llm = LLM(
                model=str(model_dir),
                device=args.device,
                dtype=dtype,
                quantization=quantization,
                compile=graphs,
                max_batch_tokens=2048,
                max_batch_seqs=256,
                kv_cache_memory=args.kv_cache_memory,
            )
            name = f"{dtype}, {quantization} weights"
            latencies[quantization, graphs] = latency = decode_latency(
                llm, vocab, args.device, args.decode_tokens
            )
            print(
                f"     {name}, one stream, CUDA graphs {'on ' if graphs else 'off'}: "
                f"{latency * 1e3:.3f} ms per token",
                flush=True,
            )
            if graphs:
                for concurrency in (int(level) for level in args.concurrency.split(",")):
                    rate = throughput(
                        llm, vocab, args.device, concurrency, args.prompt_len, args.output_len
                    )
                    print(
                        f"     {name}, offline, {concurrency} requests ({args.prompt_len} prompt + "
                        f"{args.output_len} generated tokens each): {rate:,.0f} tokens/s",
                        flush=True,
                    )
            free(llm)
    if ("none", False) in latencies and ("none", True) in latencies:
        speedup = latencies["none", False] / latencies["none", True]
        print(f"     CUDA graphs make one stream {speedup:.2f}x faster ({dtype})", flush=True)
    weight_bytes = parameters * torch.empty((), dtype=getattr(torch, dtype)).element_size()
    print(f"     ({weight_bytes / 1e6:.0f} MB of {dtype} weights read a step)", flush=True)


def profile(args, model_dir: Path, vocab: int, parameters: int) -> None:
    """Where one stream's decode step goes with CUDA graphs: the engine's phase timings (each
    phase synchronized, ``engine/step_timings.py``) and torch.profiler's busiest host operators."""
    import statistics

    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    llm = LLM(model=str(model_dir), device=args.device, dtype=args.bench_dtype, compile=True,
              kv_cache_memory=args.kv_cache_memory)  # fmt: skip
    prompt = prompts(1, 16, vocab, seed=5)
    llm.generate(prompt, greedy(8))
    timings = llm.engine.profile(True)
    sync(args.device)
    start = time.perf_counter()
    llm.generate(prompt, greedy(args.decode_tokens))
    sync(args.device)
    elapsed = (time.perf_counter() - start) / args.decode_tokens
    llm.engine.profile(False)
    assert timings is not None
    parts = {
        "forward": statistics.median(timings.forward),
        "sampling": statistics.median(timings.sampling),
        "scheduling (schedule + update)": 2 * statistics.median(timings.scheduling),
    }
    print(f"     profiled one stream: {elapsed * 1e3:.3f} ms per step (phases synchronized)")
    for name, seconds in parts.items():
        print(f"       {name}: {seconds * 1e3:.3f} ms (median)")
    rest = elapsed - sum(parts.values())
    print(
        f"       the rest (inputs, outputs, detokenizing, the generate loop): {rest * 1e3:.3f} ms"
    )
    activities = [ProfilerActivity.CPU]
    if args.device == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with torch_profile(activities=activities) as prof:
        llm.generate(prompt, greedy(32))
        sync(args.device)
    averages = prof.key_averages()
    print(averages.table(sort_by="self_cpu_time_total", row_limit=25), flush=True)
    if args.device == "cuda":
        # the device's side: its kernels (those a graph replays too), busiest first, and their
        # time a step against the step's wall time above
        print(averages.table(sort_by="self_device_time_total", row_limit=20), flush=True)
        # (the device's own events: an operator's row repeats its kernels' time)
        kernels = [event for event in averages if event.device_type != DeviceType.CPU]
        kernels_us = sum(event.self_device_time_total for event in kernels)
        print(f"     device busy: {kernels_us / 32 / 1e3:.3f} ms per step over 32 steps "
              f"({sum(event.count for event in kernels)} kernels)")  # fmt: skip
    free(llm)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--near-tie", type=float, default=1e-3)
    parser.add_argument("--parity-tokens", type=int, default=32)
    parser.add_argument("--check-tokens", type=int, default=24)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--concurrency", default="1,8,32,128")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--bench-dtype", default="bfloat16")
    parser.add_argument("--bench-quantization", default="none,int8,int4")
    parser.add_argument("--kv-cache-memory", default="4GiB")
    parser.add_argument("--skip", default="", help="comma-separated: parity,checks,figures,profile")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device here: run with --device cpu (small sizes) or on a GPU")
        return 0
    skip = set(filter(None, args.skip.split(",")))
    if args.device == "cuda":
        properties = torch.cuda.get_device_properties(0)
        print(
            f"device: {properties.name}, {properties.total_memory / 2**30:.0f} GiB, "
            f"torch {torch.__version__}"
        )
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = make_tiny_model(
            Path(scratch) / "llama",
            num_layers=args.layers,
            hidden_size=args.hidden,
            num_heads=args.heads,
            num_kv_heads=args.kv_heads,
            intermediate_size=args.intermediate,
            max_position_embeddings=4096,
        )
        from engine.model_config import ModelConfig

        config = ModelConfig.from_dir(model_dir)
        vocab = config.vocab_size
        head_dim = args.hidden // args.heads
        kv = args.kv_heads * head_dim
        per_layer = args.hidden * (args.hidden + 2 * kv) + args.hidden * args.hidden
        per_layer += 3 * args.hidden * args.intermediate
        parameters = args.layers * per_layer + 2 * vocab * args.hidden
        print(
            f"model: random Llama, {args.layers} layers, hidden {args.hidden}, {args.heads} heads "
            f"/ {args.kv_heads} KV heads, vocab {vocab}, {parameters / 1e6:.0f}M parameters",
            flush=True,
        )
        for name, part in (("parity", parity), ("checks", engine_checks)):
            if name in skip:
                continue
            try:
                part(args, model_dir, vocab)
            except Exception:
                traceback.print_exc()
                check(name, False, "raised")
        for name, part in (("figures", figures), ("profile", profile)):
            if name in skip:
                continue
            try:
                part(args, model_dir, vocab, parameters)
            except Exception:
                traceback.print_exc()
                check(name, False, "raised")
    print(f"{len(FAILURES)} failed: {', '.join(FAILURES) or 'none'}")
    return min(len(FAILURES), 100)


if __name__ == "__main__":
    sys.exit(main())
