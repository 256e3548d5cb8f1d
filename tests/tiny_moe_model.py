"""Tiny random mixture-of-experts folders (Mixtral, Qwen2-MoE, Qwen3-MoE) for tests and the MoE
benchmark, built from transformers configs without any download, with the tokenizer of
``tests/tiny_model.py``.

Weights are drawn as there (std 1/sqrt(fan_in), so that logits spread), the stacked expert tensors
of transformers 5 included (their fan-in is their last dimension); the router's logits then have
std ~1 and tokens spread over the experts. ``save_pretrained`` writes the per-expert names of Hub
checkpoints (``experts.E.w1`` / ``experts.E.gate_proj``).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from tests.tiny_model import _randomize, make_tokenizer

MOE_ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe")


def _config(arch: str, common: dict[str, Any], moe_intermediate_size: int, **extra: Any):
    from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    if arch == "mixtral":
        return MixtralConfig(intermediate_size=moe_intermediate_size, **common, **extra)
    qwen = dict(moe_intermediate_size=moe_intermediate_size, **common, **extra)
    if arch == "qwen2_moe":
        qwen.setdefault("shared_expert_intermediate_size", 2 * moe_intermediate_size)
        return Qwen2MoeConfig(**qwen)
    if arch == "qwen3_moe":
        qwen.setdefault("norm_topk_prob", True)
        return Qwen3MoeConfig(**qwen)
    raise ValueError(f"unknown arch {arch!r}: expected one of {', '.join(MOE_ARCHS)}")


def make_tiny_moe_model(
    path: str | Path,
    arch: str = "mixtral",
    *,
    num_layers: int = 2,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    num_experts: int = 8,
    top_k: int = 2,
    moe_intermediate_size: int = 32,
    intermediate_size: int = 96,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    **extra: Any,
) -> Path:
    """Writes a tiny random ``arch`` MoE folder (config, safetensors, tokenizer) at ``path``.

    ``intermediate_size`` is the Qwen models' dense MLP (layers in ``mlp_only_layers``);
    ``extra`` goes to the transformers config (``mlp_only_layers``, ``norm_topk_prob``, ...).
    Deterministic in ``seed``."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer()
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        num_experts_per_tok=top_k,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    )
    if arch == "mixtral":
        common["num_local_experts"] = num_experts
    else:
        common.update(num_experts=num_experts, intermediate_size=intermediate_size)
    config = _config(arch, common, moe_intermediate_size, **extra)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, seed)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 3:  # stacked experts [num_experts, out, in]
                noise = torch.randn(param.shape, generator=generator)
                param.copy_(noise / math.sqrt(param.shape[-1]))
    model.to(dtype).save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path
