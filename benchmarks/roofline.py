"""The engine's speed as a fraction of this machine's own limits, measured in one process.

    python benchmarks/roofline.py                 # the default model unquantized (auto dtype)
    python benchmarks/roofline.py --dtype float32 --skip-served
    python benchmarks/roofline.py --quantization int4 --skip-served   # the GGUF's 4-bit blocks

Limits, measured first:
    read bandwidth   bytes/s of a streaming read (``max``) over tensors of the byte sizes of
                     the model's weights, best of several passes
    matmul FLOP/s    a large matrix product in the serving dtype (and float32, for reference)

Then the engine on the model (compiled step graphs, as ``splitfuse serve`` runs them):
    one stream       median time per output token vs weight bytes read per decode step / read
                     bandwidth (target: <= 1.3x); a token's time is its decode step's, or where
                     the engine runs several decode steps per pass (``num_scheduler_steps``)
                     the pass's time over its tokens; quantized, the bytes are the quantized
                     weights' (values, scales and mins). The steps run in rounds, each after a
                     bandwidth reading of its own, and the median of the rounds' ratios is
                     printed too: a shared host's load moves the bandwidth between runs far
                     more than within a round
    32 streams       output tokens/s of 32 requests decoding at context ~256, vs one stream
                     (target: >= 4x); they run in each round too, after its one stream, and the
                     median of the rounds' ratios is the figure (the host's load moves a step's
                     time by 10-30% between minutes, which a ratio of runs minutes apart reads
                     as a change of speed)
    prefill          prompt tokens/s of 64 prompts x 512 tokens vs FLOP/s / FLOPs per token
                     (target: >= 50%); in 4 rounds of 16 prompts, each after a matrix product
                     bound read of its own (the bound moved 1.9-2.4 TFLOP/s between runs of one
                     day on one machine, and a step's time with it), the median of the rounds'
                     ratios the figure
    served           ``splitfuse bench`` (32 concurrent 512/64 requests) against a server on
                     this model vs the same workload on the in-process engine (target: within 15%)

Every figure holds for this machine only: the CPU model is printed with them.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from engine.config import DEFAULT_MODEL, EngineConfig  # noqa: E402
from engine.device import freeze_long_lived_objects  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.model_config import ModelConfig  # noqa: E402
from scheduler.sampling_params import SamplingParams  # noqa: E402


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        match = re.search(r"Model name:\s*(.+)", out)
        if match:
            return match.group(1).strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return platform.processor() or "unknown CPU"


# -- the machine's limits -------------------------------------------------------------------


def weight_shapes(config: ModelConfig) -> list[tuple[int, int]]:
    """Every matrix a decode step reads: per layer QKV, O, gate+up, down; then the LM head."""
    hidden, head_dim = config.hidden_size, config.head_dim
    qkv = (config.num_heads + 2 * config.num_kv_heads) * head_dim
    layer = [
        (qkv, hidden),
        (hidden, config.num_heads * head_dim),
        (2 * config.intermediate_size, hidden),
        (hidden, config.intermediate_size),
    ]
    return layer * config.num_layers + [(config.vocab_size, hidden)]


def weight_bytes_per_step(engine: LLMEngine, shapes: list[tuple[int, int]], dtype) -> list[int]:
    """Bytes of each weight a decode step reads: every matrix product's weight, the LM head's
    included (the embedding gives only a few rows). Quantized layers count their quantized bytes
    (values, scales and mins)."""
    from engine.layers import MatmulLayer

    layers = [m for m in engine.runner.model.modules() if isinstance(m, MatmulLayer)]
    quantized = [m.quantized for m in layers if m.quant_bits]
    if not quantized:
        return [rows * cols * dtype.itemsize for rows, cols in shapes]
    if len(quantized) != len(layers):
        raise RuntimeError("some products kept float weights: count them by hand")
    return [q.nbytes for q in quantized if q is not None]


def read_bandwidth(sizes: list[int], passes: int = 7) -> float:
    """Bytes/s of ``max`` over freshly written float32 tensors of these byte sizes (the weights a
    step reads; best pass). float32: its ``max`` is vectorized on every CPU, where a bfloat16 one
    converts element by element and measures the conversion instead."""
    return best_read(read_tensors(sizes), passes)


def read_tensors(sizes: list[int]) -> list[torch.Tensor]:
    return [torch.ones(size // 4) for size in sizes]


def best_read(tensors: list[torch.Tensor], passes: int) -> float:
    """Bytes/s of the best of ``passes`` passes of ``max`` over ``tensors``."""
    num_bytes = sum(t.numel() * t.element_size() for t in tensors)
    best = float("inf")
    for _ in range(passes):
        start = time.perf_counter()
        for tensor in tensors:
            tensor.max()
        best = min(best, time.perf_counter() - start)
    return num_bytes / best


def matmul_flops(dtype: torch.dtype, size: int = 2048, repeats: int = 5) -> float:
    """FLOP/s of a ``size``-cubed matrix product (best of ``repeats``): the faster of ATen's
    ``a @ b`` and oneDNN's product with a packed weight, where the CPU packs this dtype (on AMD
    CPUs MKL's float32 product runs at about half of oneDNN's)."""
    from engine.packed_linear import PackedWeight, can_pack, packed_linear

    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    products = [lambda: a @ b]
    if can_pack(b):
        packed = PackedWeight(b)
        products.append(lambda: packed_linear(a, packed, size, None))
    best = float("inf")
    for product in products:
        product()
        for _ in range(repeats):
            start = time.perf_counter()
            product()
            best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


# -- the engine -----------------------------------------------------------------------------


def decode_step_seconds(
    engine: LLMEngine,
    num_streams: int,
    context: int,
    steps: int,
    tag: str = "",
    streamed: bool = False,
) -> float:
    """Median time of a decode step of ``num_streams`` requests at context ~``context`` (each
    decodes a token): an engine step's time, or where the step runs several decode steps (a pass
    of ``num_scheduler_steps``) its time over the tokens each request got from it. ``streamed``:
    the requests are added as streamed ones (a decode step per pass)."""
    prompts = _random_prompts(num_streams, context, engine.model_config.vocab_size, seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
    for index, prompt in enumerate(prompts):
        request_id = f"decode{tag}-{num_streams}-{index}{'-streamed' if streamed else ''}"
        engine.add_request(request_id, prompt, params, streamed=streamed)
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        outputs = engine.step()
        seconds = time.perf_counter() - start
        tokens = sum(len(output.new_token_ids) for output in outputs)
        # a pure decode step: one token (or one per pass's step) per running request
        stats = engine.stats()
        if stats.last_step_num_tokens == num_streams and stats.num_waiting == 0 and tokens:
            times.append(seconds * num_streams / tokens)
    if not times:
        raise SystemExit(
            f"no step decoded all {num_streams} requests alone: with {steps} decode steps each, "
            "the first requests finished before the last prompts were read; raise --decode-steps"
        )
    return statistics.median(times[1:] or times)


def decode_rounds(
    engine: LLMEngine, sizes: list[int], steps: int, rounds: int = 6
) -> list[tuple[float, float, float, float]]:
    """(read bandwidth, median one-stream decode step, the same streamed, median 32-stream
    decode step, all at context ~256) of each round: the bandwidth is measured (best of 3 passes)
    right before the round's steps, so that they see the same load of a shared host; the read
    floor moves with it between runs (25-48 GB/s on one machine in a day)."""
    tensors = read_tensors(sizes)
    return [
        (
            best_read(tensors, passes=3),
            decode_step_seconds(engine, 1, 256, steps, f"-{round_}"),
            decode_step_seconds(engine, 1, 256, steps, f"-{round_}", streamed=True),
            decode_step_seconds(engine, 32, 256, steps, f"-{round_}"),
        )
        for round_ in range(rounds)
    ]


def prefill_tokens_per_second(
    engine: LLMEngine, num_prompts: int, prompt_len: int, seed: int = 2, tag: str = ""
) -> float:
    prompts = _random_prompts(num_prompts, prompt_len, engine.model_config.vocab_size, seed=seed)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    start = time.perf_counter()
    for index, prompt in enumerate(prompts):
        engine.add_request(f"prefill{tag}-{index}", prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
    return num_prompts * prompt_len / (time.perf_counter() - start)


def prefill_rounds(
    engine: LLMEngine, dtype: torch.dtype, num_prompts: int, rounds: int = 4
) -> list[tuple[float, float]]:
    """(matmul FLOP/s, prompt tokens/s) of each round of ``num_prompts / rounds`` prompts of 512
    tokens, the bound read right before the round's prompts (as ``decode_rounds`` reads the
    bandwidth), so that both see the same load of a shared host."""
    per_round = max(1, num_prompts // rounds)
    return [
        (
            matmul_flops(dtype),
            prefill_tokens_per_second(engine, per_round, 512, seed=2 + round_, tag=f"-{round_}"),
        )
        for round_ in range(rounds)
    ]


def _random_prompts(count: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    low = vocab_size // 10
    return torch.randint(low, vocab_size, (count, length), generator=generator).tolist()


def flops_per_prompt_token(config: ModelConfig, mean_context: float) -> float:
    """Matrix products of a layer stack (the LM head runs on one row per prompt) plus the
    attention scores and weighted sums over ``mean_context`` tokens."""
    matmul = sum(rows * cols for rows, cols in weight_shapes(config)[:-1])
    attention = 2 * config.num_heads * config.head_dim * mean_context * config.num_layers
    return 2 * (matmul + attention)


# -- served vs offline ----------------------------------------------------------------------


def _run_server(args: argparse.Namespace, port: int, log_path: str, workload: Any) -> dict:
    """Starts ``splitfuse serve`` on the model, waits until its graphs are compiled, runs the
    workload against it, stops it."""
    from server.bench import run_against_server

    command = [
        sys.executable, "-c", "import sys; from server.cli import main; sys.exit(main())",
        "serve", args.model, "--host", "127.0.0.1", "--port", str(port), "--dtype", args.dtype,
        "--kv-cache-dtype", args.kv_cache_dtype, "--quantization", args.quantization,
        "--log-level", "info",
    ]  # fmt: skip
    if args.scheduler_steps is not None:
        command += ["--num-scheduler-steps", str(args.scheduler_steps)]
    log_file = open(log_path, "w")  # noqa: SIM115 - the server's whole life
    server = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        deadline = time.monotonic() + 600
        while "step graphs ready" not in Path(log_path).read_text():
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not compile its graphs (log: {log_path})")
            if "not used" in Path(log_path).read_text():
                break
            time.sleep(1)
        served = asyncio.run(run_against_server(f"http://127.0.0.1:{port}", workload))
    finally:
        server.terminate()
        server.wait(60)
        log_file.close()
    return served


def served_vs_offline(engine: LLMEngine, args: argparse.Namespace) -> tuple[float, float]:
    """Output tokens/s of 32 concurrent 512/64 requests: through a server, then offline."""
    from server.bench import Workload, run_offline

    workload = Workload(
        num_prompts=args.served_requests,
        input_len=512,
        output_len=64,
        concurrency=32,
        vocab_size=engine.model_config.vocab_size,
    )
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False) as log:
        served = _run_server(args, port, log.name, workload)
    offline = run_offline(engine, workload)
    for name, summary in (("served", served), ("offline", offline)):
        if summary["failed"]:
            raise RuntimeError(f"{name}: {summary['failed']} requests failed: {summary['errors']}")
    return served["output_throughput"], offline["output_throughput"]


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a positive count")
    return value


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--kv-cache-dtype", default="auto", help="the KV cache's (auto)")
    parser.add_argument("--threads", type=_positive, help="CPU threads (default: all)")
    parser.add_argument("--decode-steps", type=_positive, default=48)
    parser.add_argument("--prefill-prompts", type=_positive, default=64)
    parser.add_argument("--served-requests", type=_positive, default=64)
    parser.add_argument("--quantization", default="none", help="none, int8, int4 or auto")
    parser.add_argument(
        "--scheduler-steps",
        type=int,
        default=None,
        help="decode steps per scheduling pass (default: the engine's)",
    )
    parser.add_argument("--skip-served", action="store_true", help="no server run")
    parser.add_argument("--skip-prefill", action="store_true", help="no prefill run")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    start = time.perf_counter()
    engine = LLMEngine(
        EngineConfig(
            model=args.model,
            dtype=args.dtype,
            kv_cache_dtype=args.kv_cache_dtype,
            compile=True,
            kv_cache_memory="2GiB",
            quantization=args.quantization,
            num_scheduler_steps=args.scheduler_steps,
        )
    )
    ready = time.perf_counter() - start
    engine.wait_until_compiled()
    compiled = time.perf_counter() - start
    freeze_long_lived_objects()  # as the server does once its graphs are compiled
    config = engine.model_config
    dtype = getattr(torch, engine.config.dtype)
    shapes = weight_shapes(config)
    weight_sizes = weight_bytes_per_step(engine, shapes, dtype)
    weight_bytes = sum(weight_sizes)

    print(f"CPU: {cpu_model()}, {torch.get_num_threads()} threads; torch {torch.__version__}")
    print(
        f"model: {engine.model_name} ({config.num_layers} layers, hidden {config.hidden_size}), "
        f"{engine.config.dtype} ({engine.config.kv_cache_dtype} KV cache), "
        f"quantization {engine.config.quantization.method}, "
        f"{engine.num_scheduler_steps} decode step(s) per pass; "
        f"ready in {ready:.1f} s, graphs compiled after {compiled:.1f} s "
        f"({engine.runner.graphs.mode})"
    )
    bandwidth = read_bandwidth(weight_sizes)
    flops = matmul_flops(dtype)
    print(
        f"limits: read {bandwidth / 1e9:.1f} GB/s over {weight_bytes / 1e6:.0f} MB of weights; "
        f"matmul {flops / 1e9:.0f} GFLOP/s ({engine.config.dtype}), "
        f"{matmul_flops(torch.float32) / 1e9:.0f} GFLOP/s (float32)"
    )
    print()
    rows = []
    rounds = decode_rounds(engine, weight_sizes, args.decode_steps)
    one = statistics.median(step for _, step, _, _ in rounds)
    ratios = sorted(step * read / weight_bytes for read, step, _, _ in rounds)
    floor = weight_bytes / bandwidth
    rows.append(
        ("one stream decoding", f"{one * 1e3:.1f} ms/step", f"{one / floor:.2f}x the read floor "
         f"({floor * 1e3:.1f} ms)", "<= 1.3x")
    )  # fmt: skip
    rows.append(
        ("  the floor read beside it", f"{len(rounds)} rounds",
         f"{statistics.median(ratios):.2f}x (rounds {ratios[0]:.2f}-{ratios[-1]:.2f}x; read "
         f"{min(r for r, *_ in rounds) / 1e9:.0f}-{max(r for r, *_ in rounds) / 1e9:.0f} "
         "GB/s)", "<= 1.3x")
    )  # fmt: skip
    streamed = statistics.median(step for _, _, step, _ in rounds)
    streamed_ratios = sorted(step * read / weight_bytes for read, _, step, _ in rounds)
    rows.append(
        ("  streamed (a step per pass)", f"{streamed * 1e3:.1f} ms/step",
         f"{streamed / floor:.2f}x the first read; {statistics.median(streamed_ratios):.2f}x "
         f"beside each round ({streamed_ratios[0]:.2f}-{streamed_ratios[-1]:.2f}x)", "")
    )  # fmt: skip
    many = statistics.median(step for *_, step in rounds)
    gains = sorted(32 * one_step / many_step for _, one_step, _, many_step in rounds)
    rows.append(
        ("32 streams decoding, ctx 256", f"{32 / many:.0f} tok/s ({many * 1e3:.0f} ms/step)",
         f"{statistics.median(gains):.1f}x one stream in its round (rounds {gains[0]:.1f}-"
         f"{gains[-1]:.1f}x; one stream {1 / one:.1f} tok/s)", ">= 4x")
    )  # fmt: skip
    eight = decode_step_seconds(engine, 8, 256, args.decode_steps)
    rows.append(
        ("8 streams decoding, ctx 256", f"{8 / eight:.0f} tok/s ({eight * 1e3:.0f} ms/step)",
         f"{one * 8 / eight:.1f}x one stream", "")
    )  # fmt: skip
    if not args.skip_prefill:
        per_token = flops_per_prompt_token(config, mean_context=256)
        prefills = prefill_rounds(engine, dtype, args.prefill_prompts)
        prefill = statistics.median(tokens for _, tokens in prefills)
        shares = sorted(tokens * per_token / bound for bound, tokens in prefills)
        rows.append(
            (f"prefill {args.prefill_prompts} x 512", f"{prefill:.0f} tok/s",
             f"{statistics.median(shares):.0%} of the matmul bound beside each round (rounds "
             f"{shares[0]:.0%}-{shares[-1]:.0%}; bound {min(b for b, _ in prefills) / 1e12:.2f}-"
             f"{max(b for b, _ in prefills) / 1e12:.2f} TFLOP/s, {per_token / 1e6:.0f} "
             f"MFLOP/token); {prefill / (flops / per_token):.0%} of the first bound", ">= 50%")
        )  # fmt: skip
    if not args.skip_served:
        served, offline = served_vs_offline(engine, args)
        rows.append(
            ("served vs offline, 32 x 512/64", f"{served:.0f} vs {offline:.0f} out tok/s",
             f"{served / offline:.0%} of offline", ">= 85%")
        )  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)))
    engine.shutdown()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.stdout.reconfigure(line_buffering=True)
    sys.exit(main())
