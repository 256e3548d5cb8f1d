"""Mixture-of-experts throughput: a small random MoE model through splitfuse and through
transformers ``generate``, in one run.

    python benchmarks/moe_bench.py                        # Mixtral-shaped, 1, 8 and 32 requests
    python benchmarks/moe_bench.py --arch qwen2_moe --concurrency 8 --output-len 32
    python benchmarks/moe_bench.py --no-compile           # any flag of offline_throughput.py

Builds once, into ``--model-dir``, a random model of the chosen architecture: 4 layers, hidden
512, 8 query / 2 KV heads, 8 experts of intermediate size 1024 with top-2 routing (Qwen2-MoE adds
its shared expert of 2048), the tests' tokenizer (vocabulary ~1,000). Then runs the comparison of
``benchmarks/offline_throughput.py`` on it: for each concurrency C, 2C requests of random prompts
(128 tokens, 128 output tokens, EOS ignored) with at most C in flight through splitfuse, and in
padded static batches of C through ``generate`` (transformers runs its experts one after another
over the tokens routed to each). Output tokens/s of each and their ratio.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import offline_throughput  # noqa: E402

from tests.tiny_moe_model import MOE_ARCHS, make_tiny_moe_model  # noqa: E402

MODEL_SHAPE = dict(
    num_layers=4,
    hidden_size=512,
    num_heads=8,
    num_kv_heads=2,
    num_experts=8,
    top_k=2,
    moe_intermediate_size=1024,
    intermediate_size=2048,
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], add_help=False)
    parser.add_argument("--arch", default="mixtral", choices=MOE_ARCHS)
    parser.add_argument(
        "--model-dir", type=Path, default=None, help="where the model is built (default: /tmp)"
    )
    args, rest = parser.parse_known_args(argv)
    if "--model" in rest:
        parser.error("--model is this benchmark's own model (use offline_throughput.py)")
    model_dir = args.model_dir or Path("/tmp") / f"splitfuse-moe-bench-{args.arch}"
    if not (model_dir / "config.json").is_file():
        make_tiny_moe_model(model_dir, args.arch, **MODEL_SHAPE)
    shape = ", ".join(f"{key} {value}" for key, value in MODEL_SHAPE.items())
    print(f"model: random {args.arch} ({shape}) in {model_dir}")
    return offline_throughput.main(["--model", str(model_dir), *rest])


if __name__ == "__main__":
    sys.exit(main())
