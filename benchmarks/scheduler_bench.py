"""Cost of one scheduler step (``schedule()`` + ``update()``) with N requests decoding.

    python benchmarks/scheduler_bench.py [--running 256 1024] [--steps 200] [--prompt-len 512]

Every request is admitted and past its prompt before timing starts, so each timed step is N decode
rows (one block-boundary allocation every ``block_size`` steps per request, prefix-cache
registration of each completed block). Prints medians over several rounds of wall-clock and
process CPU time per step.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from kv_cache import KVCacheManager
from scheduler import Request, SamplingParams, Scheduler


def build(num_running: int, prompt_len: int, num_steps: int, block_size: int) -> Scheduler:
    max_len = prompt_len + num_steps * 4 + 8
    num_blocks = num_running * (-(-max_len // block_size))
    kv = KVCacheManager(num_blocks, block_size)
    scheduler = Scheduler(
        max_batch_tokens=max(num_running, 8192),
        max_batch_seqs=num_running,
        max_model_len=max_len,
        kv_manager=kv,
    )
    rng = random.Random(0)
    params = SamplingParams(max_tokens=max_len - prompt_len, ignore_eos=True)
    for index in range(num_running):
        prompt = [rng.randrange(1, 32000) for _ in range(prompt_len)]
        scheduler.add_request(Request(f"r{index}", prompt, params, eos_token_ids=(2,)))
    # Run the prompts, then a few decodes, outside the timed region.
    while scheduler.num_waiting or any(
        r.num_output_tokens < 2 for r in scheduler.running_requests()
    ):
        step(scheduler)
    return scheduler


def step(scheduler: Scheduler) -> int:
    batch = scheduler.schedule()
    scheduler.update(batch, [7] * len(batch.sample_request_ids))
    return batch.num_rows


def measure(
    num_running: int, prompt_len: int, num_steps: int, rounds: int
) -> tuple[list[float], list[float]]:
    """Per-step milliseconds, wall clock and process CPU time (the machine may be shared), each
    the mean of ``num_steps`` steps, once per round."""
    wall_ms, cpu_ms = [], []
    for _ in range(rounds):
        scheduler = build(num_running, prompt_len, num_steps, block_size=16)
        start_wall, start_cpu = time.perf_counter(), time.process_time()
        for _ in range(num_steps):
            assert step(scheduler) == num_running
        wall_ms.append((time.perf_counter() - start_wall) / num_steps * 1e3)
        cpu_ms.append((time.process_time() - start_cpu) / num_steps * 1e3)
        scheduler.check_integrity()
    return wall_ms, cpu_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--running", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompt-len", type=int, default=512)
    args = parser.parse_args()
    print(f"schedule() + update(), all requests decoding, prompt {args.prompt_len} tokens")
    for num_running in args.running:
        wall_ms, cpu_ms = measure(num_running, args.prompt_len, args.steps, args.rounds)
        wall, cpu = statistics.median(wall_ms), statistics.median(cpu_ms)
        print(
            f"running {num_running:5d}: {wall:7.3f} ms per step wall, {cpu:7.3f} ms CPU "
            f"({cpu / num_running * 1e3:.2f} us CPU per request; median of {args.rounds} rounds "
            f"of {args.steps} steps, wall min {min(wall_ms):.3f} max {max(wall_ms):.3f})"
        )


if __name__ == "__main__":
    main()
