"""Quantized models end to end.

1. Tiny random models under int8 (per channel) and int4 (groups of 32 and 64), embeddings and LM
   head int8: ragged logits against transformers running the *dequantized* weights, within the
   float32 parity bound (1e-4). The quantized engine multiplies by exactly those numbers, so only
   the order of the float32 sums differs: the bound is the one every float32 parity test uses.
   Against the float model itself the logits move by the quantization error, bounded loosely to
   catch a wrong layout (uncorrelated logits: relative RMS ~140%): a weight's rounding error is
   uniform within half a step, RMS step / sqrt(12); int8 per channel: step ~ 6 sigma / 254, ~0.7%
   of the weights' RMS, bound 3%; int4 in groups of 32: step ~ 4.5 sigma / 15, ~9% per layer,
   which these random models (logits std ~1, two layers) amplify to ~30%: bound 50%.
2. The default model with ``quantization="int4"`` runs the GGUF file's own numbers: its logits
   equal the float32 model's (prepared from the same file) within the float32 bound.
3. Tensor parallelism (2 ranks on gloo) gives the single-process quantized logits.
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.config import EngineConfig
from engine.input_builder import build_model_input
from engine.llm_engine import LLMEngine
from engine.quantization import quantize
from scheduler.batch import BatchRow, ScheduledBatch
from tests.model.parity_helpers import LOGITS_ATOL, hf_logits
from tests.tiny_model import make_tiny_model

pytestmark = pytest.mark.usefixtures("single_thread")

SCHEDULE = [
    [("a", 0, 8), ("b", 0, 5)],
    [("b", 5, 6), ("a", 8, 15), ("c", 0, 3)],
    [("b", 6, 7), ("c", 3, 4), ("a", 15, 16)],
]
LENGTHS = {"a": 16, "b": 7, "c": 4}
LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module", params=["untied", "tied"])
def model_dir(request, tmp_path_factory, tiny_llama_dir) -> Path:
    if request.param == "untied":
        return tiny_llama_dir
    path = tmp_path_factory.mktemp("tied")
    return make_tiny_model(path, "llama", tie_word_embeddings=True, seed=5)


def ragged_logits(engine: LLMEngine, sequences: dict[str, list[int]]) -> dict[str, torch.Tensor]:
    """Every token's logits over the three steps of SCHEDULE (block size 4)."""
    tables, next_block = {}, 0
    for name, token_ids in sequences.items():
        num_blocks = -(-len(token_ids) // 4)
        tables[name] = tuple(range(next_block, next_block + num_blocks))
        next_block += num_blocks
    ours: dict[str, list[torch.Tensor]] = {name: [] for name in sequences}
    for step in SCHEDULE:
        rows = tuple(
            BatchRow(name, tuple(sequences[name][start:end]), start, tables[name], True)
            for name, start, end in step
        )
        inputs = build_model_input(ScheduledBatch(rows=rows), block_size=4)
        logits = engine.runner.run(
            dataclasses.replace(inputs, sample_rows=torch.arange(inputs.num_tokens))
        )
        offset = 0
        for row in rows:
            ours[row.request_id].append(logits[offset : offset + row.num_tokens])
            offset += row.num_tokens
    return {name: torch.cat(parts) for name, parts in ours.items()}


def dequantized_reference(model_dir: Path, bits: int, group_size: int | None):
    """transformers' model with every weight replaced by the numbers the engine multiplies by."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.rsplit(".", 1)[-1] in LINEAR_NAMES:
                weight = module.weight
                size = group_size or weight.shape[1]
                weight.copy_(quantize(weight, bits, size).dequantize())
        embedding = model.get_input_embeddings().weight
        embedding.copy_(quantize(embedding, 8, 32).dequantize())
        if not model.config.tie_word_embeddings:
            head = model.get_output_embeddings().weight
            head.copy_(quantize(head, 8, 32).dequantize())
    return model


@pytest.mark.parametrize(
    "method,group_size,rms_bound", [("int8", None, 0.03), ("int4", 32, 0.5), ("int4", 64, 0.5)]
)
def test_quantized_logits_match_transformers_on_the_dequantized_weights(
    model_dir, method, group_size, rms_bound
):
    quantization = {"method": method, "group_size": group_size}
    engine = LLMEngine(
        EngineConfig(
            model=str(model_dir),
            dtype="float32",
            num_kv_blocks=16,
            block_size=4,
            quantization=quantization,
        )
    )
    rng = random.Random(1)
    vocab = engine.model_config.vocab_size
    sequences = {name: [rng.randrange(vocab) for _ in range(n)] for name, n in LENGTHS.items()}
    ours = ragged_logits(engine, sequences)
    reference = dequantized_reference(model_dir, int(method[3:]), group_size)
    original = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for name, token_ids in sequences.items():
        want = hf_logits(reference, token_ids)
        diff = (ours[name] - want).abs().max().item()
        assert diff < LOGITS_ATOL, f"{method} sequence {name}: max |logit difference| {diff:.2e}"
        unquantized = hf_logits(original, token_ids)
        rms = ((ours[name] - unquantized).pow(2).mean() / unquantized.pow(2).mean()).sqrt()
        assert rms < rms_bound, f"{method}: relative RMS change from the float model {rms:.3f}"


def test_the_default_model_in_int4_runs_the_numbers_of_its_gguf_file(default_model_dir):
    common = dict(model=str(default_model_dir), dtype="float32", num_kv_blocks=16, block_size=4)
    quantized = LLMEngine(EngineConfig(quantization="int4", **common))
    assert (
        sum(m.quant_bits == 4 for m in quantized.runner.model.modules() if hasattr(m, "quant_bits"))
        == 30 * 4
    )
    rng = random.Random(2)
    sequences = {name: [rng.randrange(49152) for _ in range(n)] for name, n in LENGTHS.items()}
    got = ragged_logits(quantized, sequences)
    del quantized
    unquantized = LLMEngine(EngineConfig(**common))
    want = ragged_logits(unquantized, sequences)
    for name in sequences:
        scale = want[name].abs().max().item()
        diff = (got[name] - want[name]).abs().max().item()
        assert diff < LOGITS_ATOL * max(1.0, scale), (
            f"sequence {name}: {diff:.2e} (scale {scale:.1f})"
        )


def test_tensor_parallel_quantized_logits_equal_one_process(tmp_path):
    """Each rank quantizes its shard; a shard holds whole groups (here uneven head splits: 32 and
    64 input columns of o_proj), so the ranks multiply by the numbers one process does."""
    model_dir = make_tiny_model(tmp_path, "llama", hidden_size=96, num_heads=6, num_kv_heads=3)
    common = dict(
        model=str(model_dir),
        dtype="float32",
        device="cpu",
        num_kv_blocks=16,
        block_size=4,
        num_threads=1,
        quantization="int4",
    )
    single = LLMEngine(EngineConfig(**common))
    sharded = LLMEngine(EngineConfig(tp=2, **common))
    try:
        rng = random.Random(3)
        vocab = single.model_config.vocab_size
        sequences = {name: [rng.randrange(vocab) for _ in range(n)] for name, n in LENGTHS.items()}
        want = ragged_logits(single, sequences)
        got = ragged_logits(sharded, sequences)
    finally:
        sharded.shutdown()
    for name in sequences:
        diff = (got[name] - want[name]).abs().max().item()
        assert diff < LOGITS_ATOL, f"sequence {name}: tp=2 vs tp=1 {diff:.2e}"
