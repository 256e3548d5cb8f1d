"""Quantized models end to end.

1. Tiny random models under int8 (per channel) and int4 (groups of 32 and 64), embeddings and LM
   head int8: ragged logits against transformers running the *dequantized* weights. int8: within
   the float32 parity bound (1e-4); the engine multiplies by exactly those numbers, so only the
   order of the float32 sums differs. int4 products also round their input to int8 in runs of 32
   (``quantize_activations``), and so does the 8-bit LM head of an int4 model (``PackedInt8``),
   which the reference then does too, before each linear layer and the head: the engine matches
   it to ~4e-7 relative RMS. Float32 differences of ~1e-7 can still move a value
   across a rounding boundary (of the 27,648 values rounded here, the nearest lies 2e-5 steps
   from one), and one such flip moves these logits by up to 8e-3 relative RMS (measured by forcing
   one in each product): bound 1e-2, a wrong layout or scale gives 10% and more. The rounding of
   the inputs alone moves the logits by 1-2% relative RMS (each value off by at most 1/254 of its
   run's largest, RMS ~0.5% of the values' RMS, amplified ~3x by these models): bound 5%.
   Against the float model itself the logits move by the quantization error, bounded loosely to
   catch a wrong layout (uncorrelated logits: relative RMS ~140%): a weight's rounding error is
   uniform within half a step, RMS step / sqrt(12); int8 per channel: step ~ 6 sigma / 254, ~0.7%
   of the weights' RMS, bound 3%; int4 in groups of 32: step ~ 4.5 sigma / 15, ~9% per layer,
   which these random models (logits std ~1, two layers) amplify to ~30%: bound 50%.
2. The default model with ``quantization="int4"`` runs the GGUF file's own numbers: every 4-bit
   weight equals the float32 model's (prepared from the same file) exactly, and its logits stay
   within the rounding of the products' inputs of the float32 model's.
3. Tensor parallelism (2 ranks on gloo) gives the single-process quantized logits: the shards hold
   whole groups, so the ranks round the same runs of inputs (bound as in 1 for rounding flips).
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
from engine.quantization import quantize, quantize_activations
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


def _round_inputs(module: torch.nn.Module, args: tuple) -> tuple:
    """A linear layer's input as an int4 product multiplies it (``quantize_activations``)."""
    x = args[0]
    q, scale = quantize_activations(x.reshape(-1, x.shape[-1]))
    runs = q.float().reshape(q.shape[0], -1, 32) * scale[:, :, None]
    return (runs.reshape(x.shape),)


def relative_rms(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).pow(2).mean() / want.pow(2).mean()).sqrt().item()


def dequantized_reference(
    model_dir: Path, bits: int, group_size: int | None, round_inputs: bool = False
):
    """transformers' model with every weight replaced by the numbers the engine multiplies by
    (``round_inputs``: and the linear layers' inputs rounded as int4 products round them)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.rsplit(".", 1)[-1] in LINEAR_NAMES:
                if round_inputs:
                    module.register_forward_pre_hook(_round_inputs)
                weight = module.weight
                size = group_size or weight.shape[1]
                weight.copy_(quantize(weight, bits, size).dequantize())
        embedding = model.get_input_embeddings().weight
        embedding.copy_(quantize(embedding, 8, 32).dequantize())
        if round_inputs:  # a 4-bit model's 8-bit LM head rounds its input alike (PackedInt8)
            model.get_output_embeddings().register_forward_pre_hook(_round_inputs)
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
            # the products' parity: a float32 cache, as transformers' (auto's float16 cache
            # moves these logits by ~4e-4 relative RMS, up to 2e-3)
            kv_cache_dtype="float32",
        )
    )
    rng = random.Random(1)
    vocab = engine.model_config.vocab_size
    sequences = {name: [rng.randrange(vocab) for _ in range(n)] for name, n in LENGTHS.items()}
    ours = ragged_logits(engine, sequences)
    bits = int(method[3:])
    reference = dequantized_reference(model_dir, bits, group_size, round_inputs=bits == 4)
    weights_only = dequantized_reference(model_dir, bits, group_size)
    original = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for name, token_ids in sequences.items():
        want = hf_logits(reference, token_ids)
        if bits == 8:
            diff = (ours[name] - want).abs().max().item()
            assert diff < LOGITS_ATOL, (
                f"{method} sequence {name}: max |logit difference| {diff:.2e}"
            )
        else:
            rms = relative_rms(ours[name], want)
            assert rms < 1e-2, f"{method} sequence {name}: relative RMS {rms:.2e}"
            rms = relative_rms(ours[name], hf_logits(weights_only, token_ids))
            assert rms < 0.05, f"{method}: the inputs' rounding moved the logits by {rms:.3f}"
        rms = relative_rms(ours[name], hf_logits(original, token_ids))
        assert rms < rms_bound, f"{method}: relative RMS change from the float model {rms:.3f}"


def test_the_default_model_in_int4_runs_the_numbers_of_its_gguf_file(default_model_dir):
    from safetensors import safe_open

    from engine.layers import MatmulLayer

    common = dict(model=str(default_model_dir), dtype="float32", num_kv_blocks=16, block_size=4)
    quantized = LLMEngine(EngineConfig(quantization="int4", **common))
    model = quantized.runner.model
    layers = {
        path: module
        for path, module in model.named_modules()
        if isinstance(module, MatmulLayer) and module.quant_bits == 4
    }
    assert len(layers) == 30 * 4
    # Each 4-bit weight, as its product reads it, against the float32 checkpoint's (the file's
    # blocks dequantized when the folder was prepared), fused parts gathered as the loader does.
    holders = {path: torch.zeros(module.quantized.shape) for path, module in layers.items()}
    with safe_open(str(default_model_dir / "model.safetensors"), "pt") as handle:
        for name in handle.keys():  # noqa: SIM118 - a safetensors handle is no mapping
            target, shard_id = model.param_name(name)
            path = None if target is None else target.removesuffix(".weight")
            if path in layers:
                loader = layers[path].weight.weight_loader
                loader(holders[path], handle.get_tensor(name), shard_id)
    for path, module in layers.items():
        assert torch.equal(module.quantized.dequantize(), holders[path]), path
    # the tied Q8_0 table: one copy, packed for the head's integer dot products, its numbers
    embedding, head = model.model.embed_tokens, model.lm_head
    assert embedding.int8_out_features == head.int8_out_features == 49152
    assert head.qweight.data_ptr() == embedding.qweight.data_ptr()
    with safe_open(str(default_model_dir / "model.safetensors"), "pt") as handle:
        table = handle.get_tensor("model.embed_tokens.weight")
    assert torch.equal(head.quantized.dequantize(), table)
    rng = random.Random(2)
    sequences = {name: [rng.randrange(49152) for _ in range(n)] for name, n in LENGTHS.items()}
    got = ragged_logits(quantized, sequences)
    del quantized, model, layers
    unquantized = LLMEngine(EngineConfig(**common))
    want = ragged_logits(unquantized, sequences)
    for name in sequences:
        # the products' inputs rounded to int8 in runs of 32 (measured: 1.3-2.8% relative RMS)
        rms = relative_rms(got[name], want[name])
        assert rms < 0.05, f"sequence {name}: relative RMS {rms:.3f}"


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
        # the all-reduce sums in another order: a value can round to the other int8 (see 1.)
        rms = relative_rms(got[name], want[name])
        assert rms < 1e-2, f"sequence {name}: tp=2 vs tp=1 relative RMS {rms:.2e}"


def test_a_bfloat16_model_gets_the_quantized_heads_float32_logits_unrounded(tiny_llama_dir):
    """The 8-bit LM head of an int4 model sums in float32: its logits reach the sampler as they
    are, not rounded to bfloat16 (the hidden's dtype) and widened again."""
    engine = LLMEngine(
        EngineConfig(
            model=str(tiny_llama_dir),
            dtype="bfloat16",
            num_kv_blocks=16,
            block_size=4,
            quantization="int4",
            compile=False,
        )
    )
    head = engine.runner.model.lm_head
    assert head.int8_out_features, "the LM head of a CPU int4 model is packed for int8_linear"
    hidden = torch.randn(5, engine.model_config.hidden_size).bfloat16()
    got = engine.runner.model.compute_logits(hidden, torch.arange(5))
    want = torch.ops.splitfuse_cpu.int8_linear(
        hidden, head.qweight, head.qscales, head.int8_out_features, head.quant_group_size
    )
    assert got.dtype == torch.float32
    assert torch.equal(got, want[:, : engine.model_config.vocab_size])
    assert not torch.equal(got, got.bfloat16().float()), "these logits are not all bfloat16s"
