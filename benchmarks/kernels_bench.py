"""Time the kernels and print achieved memory bandwidth.

    python benchmarks/kernels_bench.py        # CUDA: Triton backend vs the device's copy bandwidth
    python benchmarks/kernels_bench.py --cpu  # the torch backend on this CPU (the CPU serving path)
                                              # and the 8-bit LM head's two products
    python benchmarks/kernels_bench.py --sweep-attention [NAME]  # CUDA: the Triton attention
                                              # kernel's tiles, splits, warps and stages swept

On a machine without a CUDA device the first form says so and exits 0. Each op is timed as a layer
runs it: over a step plan made once (``backend.plan``), whose cost is printed apart on the CPU.
Decode attention is memory-bound: its bytes are the K/V read through the block tables (plus query
and output).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

from kernels import AttentionMetadata, build_cos_sin_cache, get_backend, torch_attention


@dataclass
class AttentionCase:
    name: str
    rows: list[tuple[int, int]]  # (num_cached_tokens, num_query_tokens)
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int = 16


@dataclass
class AttentionInputs:
    """A step's plan inputs (``backend.plan``) and a layer's query and caches."""

    positions: torch.Tensor  # [num_tokens] int64
    metadata: AttentionMetadata
    kv_cache: torch.Tensor  # [1, 2, num_blocks, block_size, num_kv_heads, head_dim]
    query: torch.Tensor  # [num_tokens, num_heads, head_dim]
    scale: float

    def plan(self, backend):
        return backend.plan(
            self.positions, self.metadata, self.kv_cache, self.metadata.max_context_len
        )

    def attention(self, backend, plan) -> Callable[[], object]:
        """One layer's paged attention over ``plan``."""
        key_cache, value_cache = self.kv_cache[0]
        return lambda: backend.paged_attention(self.query, key_cache, value_cache, plan, self.scale)


def make_attention_inputs(case: AttentionCase, dtype: torch.dtype, device: str) -> AttentionInputs:
    """Random query and cache, each row's blocks scattered over the cache in random order; each
    query token's K/V slot is the one of its position."""
    context_lens = [cached + q_len for cached, q_len in case.rows]
    blocks_per_row = [math.ceil(ctx / case.block_size) for ctx in context_lens]
    num_blocks = sum(blocks_per_row)
    physical = torch.randperm(num_blocks, dtype=torch.int32)
    block_tables = torch.zeros(len(case.rows), max(blocks_per_row), dtype=torch.int32)
    next_block = 0
    for row, count in enumerate(blocks_per_row):
        block_tables[row, :count] = physical[next_block : next_block + count]
        next_block += count
    shape = (1, 2, num_blocks, case.block_size, case.num_kv_heads, case.head_dim)
    kv_cache = torch.randn(shape, dtype=dtype, device=device)
    query_lens = [q_len for _, q_len in case.rows]
    query = torch.randn(sum(query_lens), case.num_heads, case.head_dim, dtype=dtype, device=device)
    query_start = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    rows = torch.repeat_interleave(torch.arange(len(case.rows)), torch.tensor(query_lens))
    positions = torch.cat([torch.arange(cached, cached + q_len) for cached, q_len in case.rows])
    blocks = block_tables[rows, positions // case.block_size].long()
    slot_mapping = blocks * case.block_size + positions % case.block_size
    metadata = AttentionMetadata(
        slot_mapping=slot_mapping.to(device),
        query_start=query_start.to(device),
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
        block_tables=block_tables.to(device),
        max_query_len=max(query_lens),
        max_context_len=max(context_lens),
    )
    return AttentionInputs(positions.to(device), metadata, kv_cache, query, case.head_dim**-0.5)


def attention_bytes(case: AttentionCase, dtype: torch.dtype) -> int:
    """K/V of every row's context read once, plus the query read and the output written."""
    element = torch.empty((), dtype=dtype).element_size()
    kv = sum(cached + q_len for cached, q_len in case.rows) * 2 * case.num_kv_heads
    tokens = sum(q_len for _, q_len in case.rows) * 2 * case.num_heads
    return (kv + tokens) * case.head_dim * element


def attention_flops(case: AttentionCase) -> int:
    """Two matmuls over the causal part: 4 * head_dim flops per (query, visible key, head)."""
    visible = sum(
        sum(cached + i + 1 for i in range(q_len)) for cached, q_len in case.rows
    )  # per head
    return 4 * case.head_dim * case.num_heads * visible


# ----------------------------------------------------------------------------------------- CPU


def time_cpu(fn: Callable[[], object], repeats: int = 20) -> tuple[float, float]:
    """(median, fastest) seconds of ``fn`` after two warm-up calls. On a shared machine the fastest
    run is the one least disturbed by other processes."""
    fn()
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), min(times)


def matmul_decode_attention(inputs: AttentionInputs) -> torch.Tensor:
    """The alternative decode path measured against the kept one: the same gather, then batched
    matmuls and a float32 softmax instead of scaled_dot_product_attention."""
    query, (key_cache, value_cache) = inputs.query, inputs.kv_cache[0]
    context_lens, block_tables = inputs.metadata.context_lens, inputs.metadata.block_tables
    num_rows, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    num_ctx_blocks = -(-int(context_lens.max()) // block_size)
    block_ids = block_tables[:, :num_ctx_blocks].reshape(-1)
    padded_len = num_ctx_blocks * block_size
    keys = key_cache.index_select(0, block_ids).view(num_rows, padded_len, num_kv_heads, head_dim)
    values = value_cache.index_select(0, block_ids).view(keys.shape)
    queries = query.view(num_rows, num_kv_heads, num_heads // num_kv_heads, head_dim)
    scores = torch.matmul(queries, keys.permute(0, 2, 3, 1)).float() * inputs.scale
    padding = torch.arange(padded_len) >= context_lens[:, None]
    scores.masked_fill_(padding[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, -1).to(query.dtype)
    return torch.matmul(probs, values.transpose(1, 2)).reshape(num_rows, num_heads, head_dim)


def one_padded_batch_plan(backend, inputs: AttentionInputs):
    """A plan with the decode rows in one batch padded to the longest context, without length
    groups."""
    saved = torch_attention.MIN_SAVED_POSITIONS
    torch_attention.MIN_SAVED_POSITIONS = sys.maxsize
    try:
        return inputs.plan(backend)
    finally:
        torch_attention.MIN_SAVED_POSITIONS = saved


def bench_cpu() -> None:
    backend = get_backend("torch")
    print(f"torch backend on CPU, {torch.get_num_threads()} threads, torch {torch.__version__}")
    smollm = {"num_heads": 9, "num_kv_heads": 3, "head_dim": 64}
    cases = [
        AttentionCase("decode 64 rows x 512 context", [(511, 1)] * 64, **smollm),
        AttentionCase("decode 16 rows x 2048 context", [(2047, 1)] * 16, **smollm),
        AttentionCase(
            "decode 64 rows x 32..2048 context", [(32 * i - 1, 1) for i in range(1, 65)], **smollm
        ),
        AttentionCase("prompt chunk 512, no cache", [(0, 512)], **smollm),
        AttentionCase("prompt chunk 256 after 256 cached", [(256, 256)], **smollm),
        AttentionCase(
            "mixed: 32 decodes x 512 + chunk 256", [(511, 1)] * 32 + [(0, 256)], **smollm
        ),
    ]
    for dtype in (torch.bfloat16, torch.float32):
        for case in cases:
            inputs = make_attention_inputs(case, dtype, "cpu")
            plan_seconds, _ = time_cpu(lambda inputs=inputs: inputs.plan(backend))
            seconds, fastest = time_cpu(inputs.attention(backend, inputs.plan(backend)))
            line = (
                f"{str(dtype):15} {case.name:36} {seconds * 1e3:7.2f} ms (min {fastest * 1e3:6.2f})"
                f"  {attention_bytes(case, dtype) / fastest / 1e9:5.2f} GB/s"
                f"  {attention_flops(case) / fastest / 1e9:6.1f} GFLOP/s at min"
                f"  plan {plan_seconds * 1e3:.2f} ms"
            )
            variants = {}
            if len({cached for cached, q_len in case.rows if q_len == 1}) > 1:
                padded_plan = one_padded_batch_plan(backend, inputs)
                variants["one padded batch"] = inputs.attention(backend, padded_plan)
            elif all(q_len == 1 for _, q_len in case.rows):
                variants["matmul+softmax"] = lambda inputs=inputs: matmul_decode_attention(inputs)
            for name, variant in variants.items():
                variant_median, variant_min = time_cpu(variant)
                line += f"  | {name}: {variant_median * 1e3:.2f} (min {variant_min * 1e3:.2f})"
            print(line, flush=True)
    bench_cpu_small_ops(backend)
    bench_cpu_lm_head()


def bench_cpu_lm_head() -> None:
    """The default model's 8-bit LM head (49152 x 576, groups of 32) for 1, 8 and 32 bfloat16
    rows: ``quant_linear`` (an int8 model's: 16-bit rows) against ``int8_linear`` (an int4
    model's: rows rounded to int8, ``PackedInt8``), taken alternately, medians of 3 rounds."""
    from engine.quantization import PackedInt8, quantize
    from kernels.cpu_ops import load

    if load() == "torch":
        print("LM head: the C++ operators are not built here")
        return
    torch.manual_seed(0)
    num_out, num_in = 49152, 576
    quantized = quantize(torch.randn(num_out, num_in) * 0.05, 8, 32)
    packed = PackedInt8.pack(quantized)
    ops = torch.ops.splitfuse_cpu
    print(
        f"LM head {num_out} x {num_in}, 8 bits ({load()}; int8_linear {ops.int4_instruction_set()})"
    )
    for num_rows in (1, 8, 32):
        x = torch.randn(num_rows, num_in).bfloat16()
        candidates = {
            "quant_linear": lambda x=x: ops.quant_linear(
                x, quantized.qweight, quantized.scales, 32
            ),
            "int8_linear": lambda x=x: ops.int8_linear(
                x, packed.packed, packed.scales, num_out, 32
            ),
        }
        medians: dict[str, list[float]] = {name: [] for name in candidates}
        for _ in range(3):
            for name, fn in candidates.items():
                medians[name].append(time_cpu(fn, repeats=10)[0])
        line = "  ".join(
            f"{name} {statistics.median(t) * 1e3:6.2f} ms" for name, t in medians.items()
        )
        print(f"  {num_rows:2} rows: {line}", flush=True)


def bench_cpu_small_ops(backend) -> None:
    shape = SmallOpShape(num_tokens=512, hidden=576, num_heads=9, num_kv_heads=3, head_dim=64)
    for dtype in (torch.bfloat16, torch.float32):
        for name, fn, _ in small_op_calls(backend, shape, dtype, "cpu"):
            seconds, fastest = time_cpu(fn)
            print(
                f"{str(dtype):15} {name:22} {shape.num_tokens} tokens"
                f" {seconds * 1e3:7.3f} ms (min {fastest * 1e3:.3f})"
            )


@dataclass
class SmallOpShape:
    num_tokens: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int


def small_op_calls(
    backend, shape: SmallOpShape, dtype: torch.dtype, device: str
) -> list[tuple[str, Callable[[], object], int]]:
    """(name, call, bytes moved) for rms_norm, rotary and store_kv; the plan and the rotary rows
    are made once, as for a step."""
    num_tokens, num_heads, num_kv_heads, head_dim = (
        shape.num_tokens, shape.num_heads, shape.num_kv_heads, shape.head_dim
    )  # fmt: skip
    element = torch.empty((), dtype=dtype).element_size()
    x = torch.randn(num_tokens, shape.hidden, dtype=dtype, device=device)
    residual = torch.randn_like(x)
    weight = torch.ones(shape.hidden, dtype=dtype, device=device)
    qkv_heads = num_heads + 2 * num_kv_heads
    qkv = torch.randn(num_tokens, qkv_heads, head_dim, dtype=dtype, device=device)
    qk = qkv[:, : num_heads + num_kv_heads]  # query and key heads, rotated at once
    key, value = qkv[:, num_heads : num_heads + num_kv_heads], qkv[:, num_heads + num_kv_heads :]
    positions = torch.arange(num_tokens, device=device)
    cache = build_cos_sin_cache(head_dim, num_tokens, 10000.0, None).to(device)
    rope = backend.rope(positions, cache)
    num_blocks = 2 * num_tokens // 16
    kv_cache = torch.zeros(1, 2, num_blocks, 16, num_kv_heads, head_dim, dtype=dtype, device=device)
    metadata = AttentionMetadata(  # one prompt row, its tokens' K/V stored in random slots
        slot_mapping=torch.randperm(num_blocks * 16, device=device)[:num_tokens],
        query_start=torch.tensor([0, num_tokens], dtype=torch.int32, device=device),
        context_lens=torch.tensor([num_tokens], dtype=torch.int32, device=device),
        block_tables=torch.arange(num_blocks, dtype=torch.int32, device=device)[None],
        max_query_len=num_tokens,
        max_context_len=num_tokens,
    )
    plan = backend.plan(positions, metadata, kv_cache, num_tokens)
    key_cache, value_cache = kv_cache[0]
    return [
        ("rms_norm", lambda: backend.rms_norm(x, weight, 1e-5), 2 * x.numel() * element),
        (
            "rms_norm + residual",
            lambda: backend.rms_norm(x, weight, 1e-5, residual),
            4 * x.numel() * element,
        ),
        ("rotary", lambda: backend.rotary(qk, rope), 2 * qk.numel() * element),
        (
            "store_kv",
            lambda: backend.store_kv(key, value, key_cache, value_cache, plan),
            4 * key.numel() * element,
        ),
    ]


# ---------------------------------------------------------------------------------------- CUDA


def sdpa_call(case: AttentionCase, device: str) -> Callable[[], object]:
    """``scaled_dot_product_attention`` over the same rows held as dense, unpaged K/V of equal
    lengths (one batch entry a row; causal for a prompt row, the whole context for a decode)."""
    import torch.nn.functional as F

    (cached, q_len), num_rows = case.rows[0], len(case.rows)
    assert all(row == case.rows[0] for row in case.rows), "SDPA baseline: rows of one shape"
    options = {"dtype": torch.bfloat16, "device": device}
    query = torch.randn(num_rows, case.num_heads, q_len, case.head_dim, **options)
    key, value = (
        torch.randn(num_rows, case.num_kv_heads, cached + q_len, case.head_dim, **options)
        for _ in range(2)
    )
    causal = q_len > 1 and cached == 0
    return lambda: F.scaled_dot_product_attention(
        query, key, value, is_causal=causal, enable_gqa=True
    )


def flash_varlen_call(case: AttentionCase, device: str) -> Callable[[], object] | None:
    """FlashAttention's varlen path over the same rows (dense, packed), where it is installed."""
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        print("(flash_attn is not installed: no FlashAttention baseline)")
        return None
    lens = [cached + q_len for cached, q_len in case.rows]
    q_lens = [q_len for _, q_len in case.rows]
    cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    options = {"dtype": torch.bfloat16, "device": device}
    query = torch.randn(sum(q_lens), case.num_heads, case.head_dim, **options)
    key, value = (
        torch.randn(sum(lens), case.num_kv_heads, case.head_dim, **options) for _ in range(2)
    )
    return lambda: flash_attn_varlen_func(
        query, key, value, cu_q.to(device), cu_k.to(device), max(q_lens), max(lens), causal=True
    )


def bench_cuda() -> None:
    import triton.testing

    def bench_ms(fn: Callable[[], object]) -> float:
        return triton.testing.do_bench(fn, warmup=25, rep=100)

    device = "cuda"
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    src = torch.empty(256 * 2**20, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    copy_ms = bench_ms(lambda: dst.copy_(src))
    copy_bandwidth = 2 * src.numel() * 4 / (copy_ms * 1e-3)
    print(f"copy bandwidth: {copy_bandwidth / 1e9:.0f} GB/s (1 GiB read + written)")

    def report(name: str, ms: float, num_bytes: int, flops: int = 0) -> None:
        bandwidth = num_bytes / (ms * 1e-3)
        line = (
            f"{name:48} {ms * 1e3:9.1f} us  {bandwidth / 1e9:7.0f} GB/s "
            f"({100 * bandwidth / copy_bandwidth:3.0f}% of copy)"
        )
        if flops:
            line += f"  {flops / (ms * 1e-3) / 1e12:6.1f} TFLOP/s"
        print(line, flush=True)

    triton_backend, torch_backend = get_backend("triton"), get_backend("torch")
    llama8b = {"num_heads": 32, "num_kv_heads": 8, "head_dim": 128}
    smollm = {"num_heads": 9, "num_kv_heads": 3, "head_dim": 64}
    cases = [
        AttentionCase("decode 64 x 512, 9/3 heads, d64", [(511, 1)] * 64, **smollm),
        AttentionCase("decode 64 x 2048, 32/8 heads, d128", [(2047, 1)] * 64, **llama8b),
        AttentionCase("decode 256 x 1024, 32/8 heads, d128", [(1023, 1)] * 256, **llama8b),
        AttentionCase("decode 1 x 32768 (split), 32/8, d128", [(32767, 1)], **llama8b),
        AttentionCase("decode 4 x 8192 (split), 32/8, d128", [(8191, 1)] * 4, **llama8b),
        AttentionCase("prefill 2048, 32/8 heads, d128", [(0, 2048)], **llama8b),
        AttentionCase("mixed 128 x 1024 + chunk 512", [(1023, 1)] * 128 + [(0, 512)], **llama8b),
        AttentionCase("decode 64 x 2048, block 128", [(2047, 1)] * 64, block_size=128, **llama8b),
    ]
    for case in cases:
        inputs = make_attention_inputs(case, torch.bfloat16, device)
        ms = bench_ms(inputs.attention(triton_backend, inputs.plan(triton_backend)))
        report(f"attention {case.name}", ms, attention_bytes(case, torch.bfloat16),
               attention_flops(case))  # fmt: skip
    case = cases[0]
    inputs = make_attention_inputs(case, torch.bfloat16, device)
    ms = bench_ms(inputs.attention(torch_backend, inputs.plan(torch_backend)))
    report(f"(torch backend) attention {case.name}", ms, attention_bytes(case, torch.bfloat16))
    for case in (cases[1], cases[4], cases[5]):  # dense, unpaged baselines of the same work
        report(f"(SDPA, dense K/V) {case.name}", bench_ms(sdpa_call(case, device)),
               attention_bytes(case, torch.bfloat16), attention_flops(case))  # fmt: skip
    flash = flash_varlen_call(cases[5], device)
    if flash is not None:
        report(f"(flash_attn varlen) {cases[5].name}", bench_ms(flash),
               attention_bytes(cases[5], torch.bfloat16), attention_flops(cases[5]))  # fmt: skip

    shape = SmallOpShape(num_tokens=8192, hidden=4096, num_heads=32, num_kv_heads=8, head_dim=128)
    for name, fn, num_bytes in small_op_calls(triton_backend, shape, torch.bfloat16, device):
        report(f"{name}, {shape.num_tokens} tokens (Llama-8B shapes)", bench_ms(fn), num_bytes)
    bench_quant_linear(copy_bandwidth)


def triton_launch(
    inputs: AttentionInputs, out: torch.Tensor, **settings: int | None
) -> Callable[[], object]:
    """One call of the Triton attention kernel on ``inputs`` into ``out`` under launch
    ``settings`` (``launch_paged_attention``'s num_splits, tile_n, num_warps, num_stages)."""
    from kernels.triton_attention import launch_paged_attention

    meta = inputs.metadata
    key_cache, value_cache = inputs.kv_cache[0]
    return lambda: launch_paged_attention(
        inputs.query, key_cache, value_cache, meta.query_start, meta.context_lens,
        meta.block_tables, inputs.scale, meta.max_query_len, meta.max_context_len, out, **settings,
    )  # fmt: skip


def sweep_attention(only: str = "") -> None:
    """The Triton attention kernel's launch settings swept (the cases whose name holds ``only``):
    context positions a step (TILE), context splits, warps and pipeline stages; each variant's
    result checked against the default's."""
    import itertools

    import triton.testing

    llama8b = {"num_heads": 32, "num_kv_heads": 8, "head_dim": 128}
    smollm = {"num_heads": 9, "num_kv_heads": 3, "head_dim": 64}
    cases = [  # (case, the context splits and tiles to try; warps 4 and 8, pipeline stages 1 and 3)
        (AttentionCase("decode 64 x 512, d64", [(511, 1)] * 64, **smollm), (1, 2, 4), (32, 64)),
        (AttentionCase("decode 8 x 2048, d64", [(2047, 1)] * 8, **smollm), (2, 4, 8), (32, 64)),
        (AttentionCase("decode 4 x 8192", [(8191, 1)] * 4, **llama8b), (8, 16, 32), (32, 64, 128)),
        (AttentionCase("decode 1 x 32768", [(32767, 1)], **llama8b), (16, 32, 64), (32, 64, 128)),
        (AttentionCase("decode 64 x 2048", [(2047, 1)] * 64, **llama8b), (1, 2), (32, 64, 128)),
        (AttentionCase("prefill 2048", [(0, 2048)], **llama8b), (1,), (32, 64)),
        (
            AttentionCase("mixed 128 x 1024 + 512", [(1023, 1)] * 128 + [(0, 512)], **llama8b),
            (1,),
            (32, 64),
        ),
    ]
    copy_src = torch.empty(256 * 2**20, dtype=torch.float32, device="cuda")
    copy_dst = torch.empty_like(copy_src)
    copy_ms = triton.testing.do_bench(lambda: copy_dst.copy_(copy_src), warmup=25, rep=100)
    copy_bandwidth = 2 * copy_src.numel() * 4 / (copy_ms * 1e-3)
    print(f"attention sweep, copy bandwidth {copy_bandwidth / 1e9:.0f} GB/s")
    for case, splits, tiles in cases:
        if only not in case.name:
            continue
        inputs = make_attention_inputs(case, torch.bfloat16, "cuda")
        out = torch.empty_like(inputs.query)

        call = partial(triton_launch, inputs, out)
        call(num_splits=None)()
        expected = out.clone()
        num_bytes = attention_bytes(case, torch.bfloat16)
        results = []
        for num_splits, tile_n, warps, stages in itertools.product(splits, tiles, (4, 8), (1, 3)):
            fn = call(num_splits=num_splits, tile_n=tile_n, num_warps=warps, num_stages=stages)
            try:
                ms = triton.testing.do_bench(fn, warmup=10, rep=40)
            except Exception as error:  # a variant that does not fit (shared memory)
                print(f"  {case.name} splits {num_splits} tile {tile_n} w{warps} s{stages}: "
                      f"{type(error).__name__}")  # fmt: skip
                continue
            error = (out.float() - expected.float()).abs().max().item()
            results.append((ms, num_splits, tile_n, warps, stages, error))
        results.sort()
        base = triton.testing.do_bench(call(num_splits=None), warmup=10, rep=40)
        print(f"{case.name}: default {base * 1e3:.1f} us "
              f"({100 * num_bytes / (base * 1e-3) / copy_bandwidth:.0f}% of copy)")  # fmt: skip
        for ms, num_splits, tile_n, warps, stages, error in results[:6]:
            share = 100 * num_bytes / (ms * 1e-3) / copy_bandwidth
            print(f"  {ms * 1e3:7.1f} us {share:3.0f}%  splits {num_splits:3} tile {tile_n:3} "
                  f"warps {warps} stages {stages}  max diff {error:.2e}", flush=True)  # fmt: skip


def graph_ms(fn: Callable[[], object], calls: int = 20, replays: int = 10) -> float:
    """One call's time inside a CUDA graph of ``calls`` calls (as a captured decode step runs
    it: no launch from the host between kernels)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / (replays * calls)


def bench_quant_linear(copy_bandwidth: float) -> None:
    """The Triton W4A16 / W8A16 product against bfloat16 ``F.linear`` (cuBLAS) at decode and batch
    row counts, each inside a CUDA graph; bandwidth counts the weight's bytes (with its scales)."""
    from engine.quantization import QuantizedTensor, quantize
    from kernels.triton_quant_linear import triton_quant_linear

    shapes = [  # (name, out features, in features)
        ("Llama-8B qkv", 6144, 4096),
        ("Llama-8B down", 4096, 14336),
        ("182M test model gate_up", 5632, 1024),
        ("182M test model down", 1024, 2816),
    ]
    print("quantized product (us a call inside a CUDA graph; % of copy bandwidth for the weight)")
    print(f"{'shape':28} {'rows':>5} {'bfloat16':>16} {'int8 (g128)':>16} {'int4 (g32)':>16}")
    for name, num_out, num_in in shapes:
        weight = torch.randn(num_out, num_in, device="cuda") / num_in**0.5
        dense = weight.to(torch.bfloat16)
        quantized = {}
        for bits, group in ((8, 128), (4, 32)):
            q = quantize(weight.cpu(), bits, group)
            on = [None if t is None else t.cuda() for t in (q.qweight, q.scales, q.mins)]
            quantized[bits] = QuantizedTensor(*on, bits, group)
        for num_rows in (1, 8, 32, 256):
            x = torch.randn(num_rows, num_in, device="cuda", dtype=torch.bfloat16)
            cells = []
            calls = [(partial(F.linear, x, dense), dense.numel() * 2)]
            for q in quantized.values():
                product = partial(
                    triton_quant_linear, x, q.qweight, q.scales, q.mins, q.bits, q.group_size
                )
                calls.append((product, q.nbytes))
            for fn, num_bytes in calls:
                ms = graph_ms(fn)
                share = num_bytes / (ms * 1e-3) / copy_bandwidth
                cells.append(f"{ms * 1e3:8.1f} us {100 * share:3.0f}%")
            print(f"{name:28} {num_rows:5} {' '.join(f'{c:>16}' for c in cells)}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="time the torch backend on the CPU")
    parser.add_argument(
        "--sweep-attention",
        nargs="?",
        const="",
        metavar="NAME",
        help="CUDA: sweep the attention launch settings (the cases whose name holds NAME)",
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="CPU threads (default: torch's, all cores)"
    )
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.cpu:
        bench_cpu()
        return 0
    if not torch.cuda.is_available():
        print("no CUDA GPU: nothing to time (use --cpu for the torch backend on this CPU)")
        return 0
    if args.sweep_attention is not None:
        sweep_attention(args.sweep_attention)
        return 0
    bench_cuda()
    return 0


if __name__ == "__main__":
    sys.exit(main())
