"""What quantization costs in accuracy, on the default model (or --model), in one process.

    python benchmarks/accuracy.py
    python benchmarks/accuracy.py --configs float32/none float32/int8 float32/int4

For each configuration (dtype/quantization, or dtype/quantization/KV-cache dtype; the cache's
is the engine's auto otherwise, and the table names it):
    perplexity   of a fixed public-domain text shipped with the tests (the Gettysburg Address,
                 then the Zen of Python from the standard library's ``this`` module), one
                 forward over the whole text, every position scored
    agreement    greedy continuations of 32 prompts x 64 tokens against the first configuration:
                 the share of tokens equal to it position by position, and the mean length of
                 the common prefix

Bars: int8 perplexity within 1% of float32; int4 within 5% of the model whose float weights are
the Q4_1 blocks dequantized (the default model's float32 weights are exactly those, so int4 should
come out near 0%).
"""

from __future__ import annotations

import argparse
import codecs
import contextlib
import dataclasses
import io
import math
import os
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from engine.config import DEFAULT_MODEL  # noqa: E402
from engine.device import cpu_runs_bf16  # noqa: E402
from engine.input_builder import build_model_input  # noqa: E402
from engine.llm import LLM  # noqa: E402
from scheduler.batch import BatchRow, ScheduledBatch  # noqa: E402
from scheduler.sampling_params import SamplingParams  # noqa: E402

TEXT_FILE = REPO / "tests" / "data" / "gettysburg.txt"
PROMPTS = [
    "The capital of France is", "def fibonacci(n):", "Once upon a time", "The best way to learn",
    "import numpy as np\n", "Water boils at", "In 1969, the first", "A list of fruits:",
    "The theory of relativity", "SELECT name FROM", "My favourite book is", "To make bread, you",
    "The meaning of life", "class Stack:\n", "Photosynthesis is the process", "Dear customer,",
    "The three primary colours", "How do airplanes fly?", "The stock market", "Q: 7 x 8?\nA:",
    "The largest planet", "Here is a haiku about", "The French Revolution", "for i in range(10):",
    "Climate change is", "The recipe calls for", "An electron is", "The Great Wall of China",
    "Machine learning models", "The sun rises in the", "Shakespeare wrote", "The internet was",
]  # fmt: skip


def evaluation_text() -> str:
    with contextlib.redirect_stdout(io.StringIO()):  # importing ``this`` prints it
        import this  # noqa: F401 - its text is ROT13 in this.s

    zen = codecs.decode(sys.modules["this"].s, "rot13")
    return TEXT_FILE.read_text() + "\n" + zen


def perplexity(llm: LLM, token_ids: list[int]) -> float:
    """exp(mean negative log-likelihood) of every token after the first, from one forward of
    them as a prompt."""
    engine = llm.engine
    block_size = engine.config.block_size
    table = tuple(range(-(-len(token_ids) // block_size)))
    row = BatchRow("ppl", tuple(token_ids), 0, table, True, len(token_ids))
    inputs = build_model_input(
        ScheduledBatch(rows=(row,)), block_size, engine.runner.device, engine.runner.prompt_tiles
    )
    logits = engine.runner.run(
        dataclasses.replace(inputs, sample_rows=torch.arange(len(token_ids)))
    )
    logprobs = torch.log_softmax(logits[:-1].double(), dim=-1)
    targets = torch.tensor(token_ids[1:])
    return math.exp(-logprobs[torch.arange(len(targets)), targets].mean().item())


def continuations(llm: LLM, max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [result.outputs[0].token_ids for result in llm.generate(PROMPTS, params)]


def agreement(ours: list[list[int]], reference: list[list[int]]) -> tuple[float, float]:
    same = total = 0
    prefixes = []
    for a, b in zip(ours, reference, strict=True):
        same += sum(x == y for x, y in zip(a, b, strict=True))
        total += len(b)
        prefix = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(b))
        prefixes.append(prefix)
    return same / total, sum(prefixes) / len(prefixes)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    # (float32 activations over quantized weights get a float16 cache under auto; the last
    # configuration shows what that costs)
    default = ["float32/none", "float32/int8", "float32/int4", "float32/int4/float32"]
    if cpu_runs_bf16():
        default[1:1] = ["bfloat16/none", "bfloat16/int4"]
    parser.add_argument(
        "--configs", nargs="+", default=default, metavar="DTYPE/QUANTIZATION[/KV_CACHE_DTYPE]"
    )
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()

    text = evaluation_text()
    rows = []
    reference: list[list[int]] | None = None
    base_ppl = None
    for spec in args.configs:
        dtype, quantization, *cache = spec.split("/")
        start = time.perf_counter()
        llm = LLM(
            args.model,
            dtype=dtype,
            quantization=quantization,
            kv_cache_dtype=cache[0] if cache else "auto",
            num_kv_blocks=256,
        )
        label = f"{dtype}/{quantization}, {llm.engine.config.kv_cache_dtype} cache"
        token_ids = llm.tokenizer.encode(text)
        ppl = perplexity(llm, token_ids)
        tokens = continuations(llm, args.max_tokens)
        llm.engine.shutdown()
        if reference is None:
            reference, base_ppl = tokens, ppl
        same, prefix = agreement(tokens, reference)
        rows.append(
            (label, f"{ppl:.3f}", f"{(ppl / base_ppl - 1) * 100:+.2f}%", f"{same:.1%}",
             f"{prefix:.1f} / {args.max_tokens}", f"{time.perf_counter() - start:.0f} s")
        )  # fmt: skip
        print(f"{spec}: done", file=sys.stderr)
    print(f"model: {args.model}; text: {len(token_ids)} tokens; {len(PROMPTS)} prompts x "
          f"{args.max_tokens} greedy tokens, compared with {args.configs[0]}")  # fmt: skip
    header = (
        "dtype/quantization, KV cache",
        "perplexity",
        "vs first",
        "same tokens",
        "common prefix",
        "time",
    )
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
