"""What a structured output costs: TPOT with and without a JSON schema, the grammar mask per token,
and the time to first token of a schema the engine has never seen.

    python benchmarks/structured.py                   # default model, eager, a few seconds each
    python benchmarks/structured.py --compile         # with the step graphs

In one process (the engine, no HTTP): for each concurrency C in (1, 8), C requests decode at
once, first unconstrained (EOS ignored, --output-len tokens), then under a schema whose every
output is --output-len/2 integers (about as many tokens). TPOT is each request's time from its
first to its last token over its tokens after the first, the median over requests. The mask time
is llguidance's fill of the step's bitmasks (all constrained rows at once) per row. TTFT: one
request of a short prompt, max_tokens 1, unconstrained, then each time under a new schema (a
property name never used before), medians of --repeats.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import uuid

from engine.structured_output import Matchers
from scheduler.sampling_params import SamplingParams, StructuredOutput


def _run(engine: object, params: list[SamplingParams], prompt: list[int]) -> list[float]:
    """TPOT of each request (seconds per token after its first)."""
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    tokens: dict[str, int] = {}
    for index, request_params in enumerate(params):
        engine.add_request(f"bench-{uuid.uuid4().hex}-{index}", prompt, request_params)
    while engine.has_unfinished_requests():
        for delta in engine.step():
            now = time.perf_counter()
            if delta.new_token_ids:
                first.setdefault(delta.request_id, now)
                last[delta.request_id] = now
                tokens[delta.request_id] = tokens.get(delta.request_id, 0) + 1
    return [(last[r] - first[r]) / (tokens[r] - 1) for r in first if tokens[r] > 1]


def _ttft(engine: object, prompt: list[int], params: SamplingParams) -> float:
    start = time.perf_counter()
    engine.add_request(f"ttft-{uuid.uuid4().hex}", prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - start


def _schema(num_items: int, property_name: str = "values") -> StructuredOutput:
    items = {"type": "integer", "minimum": 0, "maximum": 9}
    schema = {
        "type": "object",
        "properties": {
            property_name: {
                "type": "array", "items": items, "minItems": num_items, "maxItems": num_items,
            },
            "label": {"enum": ["alpha", "beta"]},
        },
        "required": [property_name, "label"],
        "additionalProperties": False,
    }  # fmt: skip
    return StructuredOutput("json_schema", json.dumps(schema))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--compile", action="store_true")
    args = parser.parse_args()

    from engine import LLMEngine
    from engine.config import EngineConfig

    engine = LLMEngine(
        EngineConfig(model=args.model, dtype=args.dtype, kv_cache_memory="512MiB",
                     compile=args.compile)
    )  # fmt: skip
    engine.wait_until_compiled()
    prompt = engine.tokenizer.encode("List some numbers as JSON:")

    fill_seconds: list[float] = []
    fill_rows: list[int] = []
    original_fill = Matchers._fill

    def timed_fill(self: Matchers, matchers: list, bitmask: object) -> object:
        start = time.perf_counter()
        result = original_fill(self, matchers, bitmask)
        fill_seconds.append(time.perf_counter() - start)
        fill_rows.append(len(matchers))
        return result

    Matchers._fill = timed_fill  # type: ignore[method-assign]

    plain = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    constrained = SamplingParams(
        temperature=0.0, max_tokens=4 * args.output_len, structured=_schema(args.output_len // 2)
    )
    _run(engine, [plain], prompt)  # warm-up
    print(f"model {args.model}, dtype {engine.config.dtype}, compile {args.compile}")
    print("| concurrency | TPOT unconstrained | TPOT json_schema | overhead | mask per row |")
    print("|---|---|---|---|---|")
    for concurrency in (1, 8):
        free = statistics.median(_run(engine, [plain] * concurrency, prompt))
        fill_seconds.clear()
        fill_rows.clear()
        bound = statistics.median(_run(engine, [constrained] * concurrency, prompt))
        per_row = sum(fill_seconds) / max(1, sum(fill_rows))
        print(f"| {concurrency} | {free * 1e3:.1f} ms | {bound * 1e3:.1f} ms | "
              f"{(bound / free - 1) * 100:+.1f}% | {per_row * 1e3:.3f} ms |")  # fmt: skip

    one = SamplingParams(temperature=0.0, max_tokens=1)
    _ttft(engine, prompt, one)
    free = statistics.median(_ttft(engine, prompt, one) for _ in range(args.repeats))
    new = statistics.median(
        _ttft(engine, prompt, SamplingParams(temperature=0.0, max_tokens=1,
                                             structured=_schema(4, f"p{uuid.uuid4().hex[:8]}")))
        for _ in range(args.repeats)
    )  # fmt: skip
    print(f"TTFT: unconstrained {free * 1e3:.1f} ms, new schema {new * 1e3:.1f} ms "
          f"(overhead {(new - free) * 1e3:+.1f} ms)")  # fmt: skip


if __name__ == "__main__":
    main()
