"""Tensor-parallel cost model and throughput on this machine (CPU, gloo).

    python benchmarks/tp_bench.py                # both parts
    python benchmarks/tp_bench.py --part comm    # collectives alone, 2 ranks
    python benchmarks/tp_bench.py --part engine  # offline throughput, tp=1 vs tp=2

1. comm: two ranks time the collectives a step makes, by tokens in the step: the all-reduce of a
   ``[num_tokens, hidden]`` activation (two per layer, after o_proj and down_proj, plus one for the
   embedding), the LM head's all-gather of ``[num_sampled, vocab / 2]`` logits, and rank 0's input
   broadcast (header + payload). A step's communication is then
   ``(2 * num_layers + 1) * all_reduce + all_gather + broadcast``.
2. engine: ``LLM.generate`` on the default model at tp=1 and tp=2 (same prompts, greedy), with the
   time rank 0 spends inside the model's collectives in the real steps.

Medians of several repetitions; the machine is shared, so compare figures from one run.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine.input_builder import build_model_input
from engine.tensor_parallel.distributed import (
    DistributedSetup,
    connect_loopback_store,
    join_process_group,
    leave_process_group,
    open_loopback_store,
)
from engine.tensor_parallel.protocol import HEADER_SIZE, pack_model_input
from scheduler.batch import BatchRow, ScheduledBatch

# SmolLM2-135M
HIDDEN = 576
VOCAB = 49152
NUM_LAYERS = 30
COLLECTIVES_PER_STEP = 2 * NUM_LAYERS + 1  # all-reduces: o_proj and down_proj per layer + embed
TOKEN_COUNTS = (1, 8, 32, 128, 512)
REPEATS = 40


def _median_ms(fn: Callable[[], Any], repeats: int = REPEATS) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _decode_batch(num_rows: int, context: int = 200, block_size: int = 16) -> ScheduledBatch:
    """``num_rows`` decode rows with ``context`` tokens of context each."""
    blocks = -(-context // block_size)
    rows = tuple(
        BatchRow(f"r{i}", (7,), context - 1, tuple(range(i * blocks, (i + 1) * blocks)), True)
        for i in range(num_rows)
    )
    return ScheduledBatch(rows=rows)


def _measure(setup: DistributedSetup, dtype: torch.dtype) -> list[tuple]:
    """Run by both ranks in step: (tokens, all-reduce ms, all-gather ms, broadcast ms, ints)."""
    rows = []
    for num_tokens in TOKEN_COUNTS:
        activation = torch.randn(num_tokens, HIDDEN, dtype=dtype)
        logits = torch.randn(num_tokens, VOCAB // 2, dtype=dtype)
        parts = [torch.empty_like(logits) for _ in range(2)]
        header, payload = pack_model_input(build_model_input(_decode_batch(num_tokens), 16))

        def broadcast(h: torch.Tensor = header, p: torch.Tensor = payload) -> None:
            dist.broadcast(h, 0, group=setup.control_group)
            dist.broadcast(p, 0, group=setup.control_group)

        dist.barrier()
        reduce_ms = _median_ms(lambda a=activation: dist.all_reduce(a))
        dist.barrier()
        gather_ms = _median_ms(lambda p=parts, x=logits: dist.all_gather(p, x), REPEATS // 4)
        dist.barrier()
        broadcast_ms = _median_ms(broadcast)
        rows.append((num_tokens, reduce_ms, gather_ms, broadcast_ms, HEADER_SIZE + payload.numel()))
    dist.barrier()
    return rows


def _comm_rank1(port: int, dtype_name: str) -> None:
    torch.set_num_threads(1)
    setup = join_process_group(1, 2, "cpu", store=connect_loopback_store(port, 2))
    _measure(setup, getattr(torch, dtype_name))
    leave_process_group()


def run_comm(dtype_name: str) -> None:
    store = open_loopback_store(2)
    process = mp.get_context("spawn").Process(
        target=_comm_rank1, args=(store.port, dtype_name), daemon=True
    )
    process.start()
    torch.set_num_threads(1)
    setup = join_process_group(0, 2, "cpu", store=store)
    rows = _measure(setup, getattr(torch, dtype_name))
    leave_process_group()
    process.join(60)
    print(f"\n== collectives at tp=2, gloo over loopback, {dtype_name}, medians ==")
    print(
        f"{'tokens':>6} {'all-reduce':>11} {f'x{COLLECTIVES_PER_STEP}/step':>10} "
        f"{'all-gather':>11} {'inputs':>9} {'ints':>6} {'comm/step':>10}"
    )
    for num_tokens, reduce_ms, gather_ms, broadcast_ms, num_ints in rows:
        reduces_ms = COLLECTIVES_PER_STEP * reduce_ms
        per_step = reduces_ms + gather_ms + broadcast_ms
        print(
            f"{num_tokens:>6} {reduce_ms:>8.3f} ms {reduces_ms:>7.2f} ms {gather_ms:>8.3f} ms "
            f"{broadcast_ms:>6.3f} ms {num_ints:>6} {per_step:>7.2f} ms"
        )
    print(
        "all-reduce: one [tokens, 576] activation (one per layer boundary); all-gather: every "
        "token's logits (a decode step samples every row); inputs: rank 0's header + payload"
    )


class _CollectiveTimer:
    """Wraps the model's collectives on rank 0 and sums the time spent in them."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0
        self._originals = {name: getattr(dist, name) for name in ("all_reduce", "all_gather")}

    def __enter__(self) -> _CollectiveTimer:
        for name, original in self._originals.items():
            setattr(dist, name, self._timed(original))
        return self

    def __exit__(self, *exc: object) -> None:
        for name, original in self._originals.items():
            setattr(dist, name, original)

    def _timed(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
                self.calls += 1

        return timed


def run_engine(dtype: str, num_prompts: int, max_tokens: int) -> None:
    from engine.llm import LLM
    from scheduler.sampling_params import SamplingParams

    prompts = [
        f"Question {i}: explain in a few sentences how {topic} works."
        for i, topic in enumerate(
            ["a bicycle", "rain", "a compiler", "photosynthesis", "a bank", "memory", "sound"] * 8
        )
    ][:num_prompts]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    print(f"\n== offline throughput, default model, {dtype}, {num_prompts} prompts x {max_tokens} "
          "tokens, greedy ==")  # fmt: skip
    print(
        f"{'tp':>3} {'threads/rank':>12} {'tokens/s':>9} {'steps':>6} {'ms/step':>8} "
        f"{'in collectives/step':>20}"
    )
    outputs = {}
    # tp=1 on both cores and on one (OpenMP threads spin-waiting on a busy machine can cost more
    # than they gain), then tp=2 with one thread per rank
    for tp, num_threads in ((1, 2), (1, 1), (2, 1)):
        llm = LLM(
            dtype=dtype, device="cpu", tp=tp, num_threads=num_threads, kv_cache_memory="512MiB"
        )
        llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
        engine = llm.engine
        num_steps = 0
        original_step = engine.step

        def counted_step(step: Callable[[], list] = original_step) -> list:
            nonlocal num_steps
            num_steps += 1
            return step()

        engine.step = counted_step  # type: ignore[method-assign]
        with _CollectiveTimer() as timer:
            start = time.perf_counter()
            results = llm.generate(prompts, params)
            seconds = time.perf_counter() - start
        num_tokens = sum(len(result.token_ids) for result in results)
        outputs[tp] = [result.token_ids for result in results]  # tp=1: the one-thread run
        comm = (
            f"{timer.seconds / num_steps * 1e3:.2f} ms ({timer.calls // num_steps} calls)"
            if tp > 1
            else "-"
        )
        print(
            f"{tp:>3} {num_threads:>12} {num_tokens / seconds:>9.1f} {num_steps:>6} "
            f"{seconds / num_steps * 1e3:>8.1f} {comm:>20}"
        )
        engine.shutdown()
        del llm, engine
    same = sum(a == b for a, b in zip(outputs[1], outputs[2], strict=True))
    print(f"greedy outputs identical at tp=1 and tp=2: {same} of {len(outputs[1])}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=["all", "comm", "engine"], default="all")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    if args.part in ("all", "comm"):
        run_comm(args.dtype)
    if args.part in ("all", "engine"):
        run_engine(args.dtype, args.num_prompts, args.max_tokens)


if __name__ == "__main__":
    main()
