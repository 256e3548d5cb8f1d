"""Decode steps of a Llama stack on a CPU in one C++ call (4-bit or bfloat16 weights).

``splitfuse_cpu.DecodeStack`` (``kernels/cpu/decode_stack.cpp``) runs every layer of a step whose
tokens all decode (one token a row, at most ``MAX_TOKENS``) in one parallel region of the CPU's
threads, with the operators' own product (``int4_linear``'s or ``blocked_linear``'s) and
attention kernels. As a graph of operators the same step forks and joins the threads ~10 times a
layer and runs the serial work between them on one thread; the other waited ~45% of a 4-bit
one-stream step. The runner (``engine/model_runner.py``) tries it before planning the step for
the graphs, eager or compiled (the operator checks every index it reads); the embedding and the
LM head stay the model's own unless they are 8-bit (below).

It computes what the model's forward computes (``engine/models/llama.py``), with the same
roundings to the activations' dtype; the products and attention give the same bits as the
operators, and its norms, rotary and SiLU are the operators ``rms_norm_rows``, ``rotary_rows``
and ``silu_mul_rows`` that a 4-bit model's forward runs on CPUs: a decode token's logits and K/V
are then the same bits whether the stack or the graphs run its step.
It applies only where the model fits it: a dense Llama stack (no MoE, no q/k norm, no biases) on
one process, every product of the stack either 4-bit packed for the CPU with one group size or
bfloat16 read by ``blocked_linear`` (CPUs with AVX-512 BF16), the C++ operators built, and
attention in the default (not deterministic) mode.

Where the embedding and the LM head are 8-bit packed as ``PackedInt8`` (a 4-bit model's, as the
default model's GGUF holds its tied ``Q8_0`` table), the call also looks the tokens up and runs
the LM head (``int8_linear``'s kernel, the threads sharing the vocabulary): a step goes from
token ids to logits in one call, without the embedding's and the head's own calls, conversions
and fork of the threads; each thread also takes the argmax of the logits it computed, which the
sampler uses for greedy rows (``Sampler.sample``'s ``greedy_ids``).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from engine.input_builder import DecodeSteps
from engine.layers import MatmulLayer
from engine.models.llama import MLP, LlamaForCausalLM
from engine.packed_linear import BLOCKED_ROWS_AMX
from engine.parallel import ParallelContext
from kernels.metadata import AttentionMetadata

logger = logging.getLogger(__name__)

MAX_TOKENS = 32  # decode steps of at most this many tokens; larger ones go to the step graphs
# the largest vocabulary whose LM head the call holds: its argmax's limit, kArgmaxMaxValues in
# kernels/cpu/greedy_argmax.h (the call refuses a larger one; the runner then goes without it)
ARGMAX_MAX_VALUES = 1 << 20


class DecodeStack:
    """``stack(input_ids, positions, metadata, kv_cache, sample_rows)`` -> (the logits of a
    decode step's sampled rows, their argmax or None), or None where the step does not fit (a
    prompt token, too many tokens)."""

    def __init__(
        self, model: LlamaForCausalLM, call: Any, max_tokens: int, holds_head: bool = False
    ) -> None:
        self.model = model
        self.call = call  # torch.classes.splitfuse_cpu.DecodeStack
        self.max_tokens = max_tokens
        self.holds_head = holds_head  # the call looks tokens up and returns logits

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
        kind = _kind(_products(stack.layers[0]))
        weights: list[torch.Tensor] = []
        for layer in stack.layers:
            weights += [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
            for product in _products(layer):
                if kind == INT4:
                    weights += [product.qweight, product.qscales, product.qmins]
                else:
                    weights.append(product.blocked_weight)
        weights.append(stack.norm.weight)
        head = _head(model)
        if head is not None:
            weights += head[:4]
        first = stack.layers[0]
        max_tokens = MAX_TOKENS
        if kind == BLOCKED:  # (with AMX the tiles run more than a few rows)
            max_tokens = min(
                max_tokens,
                *(
                    BLOCKED_ROWS_AMX if p.blocked_tiles else p.blocked_rows
                    for p in _products(first)
                ),
            )
        sizes = [
            first.self_attn.num_heads,
            first.self_attn.num_kv_heads,
            first.self_attn.head_dim,
            first.mlp.local_size,
            first.self_attn.qkv_proj.quant_group_size,
            max_tokens,
            kind,
            0 if head is None else head[4],
            0 if head is None else model.lm_head.vocab_size,
        ]
        call = torch.classes.splitfuse_cpu.DecodeStack(
            weights, stack.cos_sin_cache, sizes, model.config.rms_norm_eps
        )
        logger.info(
            "decode steps of up to %d tokens run the %s stack%s in one call",
            max_tokens,
            "4-bit" if kind == INT4 else "bfloat16",
            "" if head is None else " with the 8-bit embedding and LM head",
        )
        return cls(model, call, max_tokens, holds_head=head is not None)

    def __call__(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        metadata: AttentionMetadata,
        kv_cache: torch.Tensor,  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
        sample_rows: torch.Tensor,  # [num_sampled]
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The step's logits where every row decodes one token and there are at most
        ``max_tokens``, with each row's argmax (``torch.argmax``'s index: greedy sampling's
        token) where the call holds the LM head, else None for it; None where the step does not
        fit. The operator checks every index it reads (no plan is made)."""
        num_tokens = input_ids.shape[0]
        if not 0 < num_tokens <= self.max_tokens or metadata.max_query_len != 1:
            return None
        if metadata.context_lens.shape[0] != num_tokens:
            return None
        step = (
            positions,
            kv_cache,
            metadata.slot_mapping,
            metadata.block_tables,
            metadata.query_start,
            metadata.context_lens,
        )
        if self.holds_head:
            logits, greedy_ids = self.call.logits(input_ids, *step)
            # a decode step's sampled rows are distinct and ascending: as many as its tokens is
            # every row (no tensor compared: each operator call counts after the weights' stream)
            if sample_rows.shape[0] == num_tokens:
                return logits, greedy_ids
            return logits.index_select(0, sample_rows), greedy_ids.index_select(0, sample_rows)
        hidden = self.model.model.embed_tokens(input_ids)  # [num_tokens, hidden_size]
        return self.model.compute_logits(self.call.run(hidden, *step), sample_rows), None

    def run_ahead(self, steps: DecodeSteps, kv_cache: torch.Tensor) -> torch.Tensor:
        """Greedy tokens of several decode steps, [num_steps, num_rows] int64: each step's
        argmax of the LM head is the next step's input (needs ``holds_head``), in one call
        (``greedy_steps``: no Python, scheduling, inputs or sampling between the steps; it checks
        every step's inputs, the stack's head and its row limit included, before the first
        runs)."""
        return self.call.greedy_steps(
            steps.input_ids,
            steps.positions,
            kv_cache,
            steps.slot_mapping,
            steps.block_tables,
            steps.query_start,
            steps.context_lens,
        )


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
    if dtype not in (torch.float32, torch.bfloat16):
        return f"activations in {dtype}"
    kinds, group_sizes = set(), set()
    for layer in stack.layers:
        if not isinstance(layer.mlp, MLP):
            return "a mixture-of-experts layer"
        if layer.self_attn.q_norm is not None:
            return "q/k norms"
        products = _products(layer)
        if any(product.bias is not None for product in products):
            return "a product with a bias"
        kinds.add(_kind(products))
        group_sizes.update(product.quant_group_size for product in products)
    if kinds == {INT4}:
        if len(group_sizes) != 1:
            return f"products in groups of {sorted(group_sizes)}"
        block_cols = 16
    elif kinds == {BLOCKED}:
        block_cols = 64
    else:
        return "products neither all 4-bit nor all bfloat16 in the blocked layout"
    if stack.layers[0].mlp.local_size % block_cols:
        return f"an intermediate size not a multiple of {block_cols}"
    from kernels.cpu_ops import has_fixed_order_attention

    if not has_fixed_order_attention():
        return "the C++ operators are not built"
    return None


def _head(model: LlamaForCausalLM) -> tuple[torch.Tensor, ...] | None:
    """(embedding's packed values, scales, LM head's packed values, scales, group size) where
    both are 8-bit packed as ``PackedInt8`` with one group size over the whole vocabulary, else
    None."""
    embedding, head = model.model.embed_tokens, model.lm_head
    vocab_size = head.vocab_size
    if not embedding.int8_out_features == head.int8_out_features == vocab_size:
        return None
    if vocab_size > ARGMAX_MAX_VALUES:  # (the rows its LM head's argmax takes)
        return None
    if type(model).compute_logits is not LlamaForCausalLM.compute_logits:
        return None
    if embedding.quant_group_size != head.quant_group_size:
        return None
    if embedding.weight.dtype != model.model.norm.weight.dtype:
        return None
    return (
        embedding.qweight,
        embedding.qscales,
        head.qweight,
        head.qscales,
        head.quant_group_size,
    )


# how the products hold their weights (the operator's ``kind``)
INT4 = 4  # 4 bits packed for the CPU (``PackedInt4``)
BLOCKED = 16  # bfloat16 in oneDNN's blocked layout, read by ``blocked_linear``
MIXED = 0  # anything else: not the stack's


def _products(layer: torch.nn.Module) -> list[MatmulLayer]:
    attention, mlp = layer.self_attn, layer.mlp
    return [attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj]


def _kind(products: list[MatmulLayer]) -> int:
    """INT4, BLOCKED (every product of a decode step runs ``blocked_linear``) or MIXED."""
    if all(product.int4_out_features for product in products):
        return INT4
    if all(product.blocked_weight is not None for product in products):
        return BLOCKED
    return MIXED
