"""Decode steps of a Llama stack with 4-bit weights on a CPU, in one C++ call.

``splitfuse_cpu.DecodeStack`` (``kernels/cpu/decode_stack.cpp``) runs every layer of a step whose
tokens all decode (one token a row, at most ``MAX_TOKENS``) in one parallel region of the CPU's
threads, with the operators' own 4-bit product and attention kernels. As a graph of operators the
same step forks and joins the threads ~10 times a layer and runs the serial work between them on
one thread; the other waited ~45% of a one-stream step. The runner (``engine/model_runner.py``)
tries it before the step graphs, eager or compiled: the embedding and the LM head stay the
model's own.

It computes what the model's forward computes (``engine/models/llama.py``), with the same
roundings to the activations' dtype; the products and attention give the same bits as the
operators, while its norms, rotary and SiLU may differ from PyTorch's in a float32's last bit.
It applies only where the model fits it: a dense Llama stack (no MoE, no q/k norm, no biases) on
one process, every product of the stack 4-bit and packed for the CPU with one group size, the
C++ operators built, and attention in the default (not deterministic) mode.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from engine.layers import MatmulLayer
from engine.models.llama import MLP, LlamaForCausalLM
from engine.parallel import ParallelContext

logger = logging.getLogger(__name__)

MAX_TOKENS = 8  # decode steps of at most this many tokens; larger ones go to the step graphs


class DecodeStack:
    """``stack(input_ids, positions, plan, sample_rows)`` -> the logits of a decode step, or
    None where the step does not fit (a prompt token, too many tokens): see ``build``."""

    def __init__(self, model: LlamaForCausalLM, call: Any) -> None:
        self.model = model
        self.call = call  # torch.classes.splitfuse_cpu.DecodeStack

    @classmethod
    def build(
        cls,
        model: torch.nn.Module,
        parallel: ParallelContext,
        deterministic: bool,
        kv_cache: torch.Tensor,
    ) -> DecodeStack | None:
        """The stack of ``model``, or None (with the reason logged at debug level) where it
        does not apply."""
        why = unsupported(model, parallel, deterministic, kv_cache)
        if why:
            logger.debug("decode steps run the step graphs: %s", why)
            return None
        assert isinstance(model, LlamaForCausalLM)
        stack = model.model
        weights: list[torch.Tensor] = []
        group_size = 0
        for layer in stack.layers:
            attention, mlp = layer.self_attn, layer.mlp
            weights.append(layer.input_layernorm.weight)
            for product in (attention.qkv_proj, attention.o_proj):
                weights += [product.qweight, product.qscales, product.qmins]
            weights.append(layer.post_attention_layernorm.weight)
            for product in (mlp.gate_up_proj, mlp.down_proj):
                weights += [product.qweight, product.qscales, product.qmins]
            group_size = attention.qkv_proj.quant_group_size
        weights.append(stack.norm.weight)
        config = model.config
        first = stack.layers[0].self_attn
        sizes = [
            first.num_heads,
            first.num_kv_heads,
            first.head_dim,
            stack.layers[0].mlp.local_size,
            group_size,
            MAX_TOKENS,
        ]
        call = torch.classes.splitfuse_cpu.DecodeStack(
            weights, stack.cos_sin_cache, sizes, config.rms_norm_eps
        )
        logger.info("decode steps of up to %d tokens run the 4-bit stack in one call", MAX_TOKENS)
        return cls(model, call)

    def __call__(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        plan: Any,  # the backend's step plan
        sample_rows: torch.Tensor,  # [num_sampled]
    ) -> torch.Tensor | None:
        step = getattr(plan, "operator_step", None)
        num_tokens = input_ids.shape[0]
        # every token decodes (the fixed-order kernel attends it), one a row
        if step is None or not plan.fused or not 0 < num_tokens <= MAX_TOKENS:
            return None
        if step.block_tables.shape[0] != num_tokens:
            return None
        hidden = self.model.model.embed_tokens(input_ids)  # [num_tokens, hidden_size]
        hidden = self.call.run(
            hidden,
            positions,
            step.kv_cache,
            step.slot_mapping,
            step.block_tables,
            step.context_lens,
        )
        return self.model.compute_logits(hidden, sample_rows)


def unsupported(
    model: torch.nn.Module,
    parallel: ParallelContext,
    deterministic: bool,
    kv_cache: torch.Tensor,
) -> str | None:
    """Why the decode stack does not apply to ``model`` (None: it does)."""
    if deterministic:
        return "deterministic mode attends in its own order"
    if kv_cache.device.type != "cpu":
        return "not on a CPU"
    if parallel.world_size != 1:
        return "tensor parallelism"
    if not isinstance(model, LlamaForCausalLM):
        return f"{type(model).__name__} is not a Llama stack"
    stack = model.model
    dtype = stack.norm.weight.dtype
    if dtype not in (torch.float32, torch.bfloat16) or kv_cache.dtype != dtype:
        return f"activations in {dtype} with a {kv_cache.dtype} cache"
    group_sizes = set()
    for layer in stack.layers:
        attention, mlp = layer.self_attn, layer.mlp
        if not isinstance(mlp, MLP):
            return "a mixture-of-experts layer"
        if attention.q_norm is not None:
            return "q/k norms"
        products: list[MatmulLayer] = [
            attention.qkv_proj,
            attention.o_proj,
            mlp.gate_up_proj,
            mlp.down_proj,
        ]
        for product in products:
            if product.bias is not None:
                return "a product with a bias"
            if not product.int4_out_features:
                return "a product not in 4 bits packed for the CPU"
            group_sizes.add(product.quant_group_size)
        if mlp.local_size % 16:
            return "an intermediate size not a multiple of 16"
    if len(group_sizes) != 1:
        return f"products in groups of {sorted(group_sizes)}"
    from kernels.cpu_ops import has_fixed_order_attention

    if not has_fixed_order_attention():
        return "the C++ operators are not built"
    return None
