"""The Triton attention backend: the same object as ``kernels/torch_backend.py``, with each op a
Triton kernel. Runs on CUDA tensors, or on CPU tensors under ``TRITON_INTERPRET=1`` (the tests).

``plan`` checks the step's metadata at the boundary; on the CPU (the interpreter), where reading
them costs no device sync, it checks the index values too (slots, positions, row lengths). On CUDA
the kernels never access memory outside the tensors for bad index values: such slots are not
written and such positions not rotated. Per-layer calls check the tensors' shapes and layouts,
which costs no sync.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn.functional as F

from kernels.checks import (
    KernelInputError,
    check_attention_inputs,
    check_capacity,
    check_index_values,
    check_kv_cache,
    check_kv_inputs,
    check_metadata,
    check_rms_norm,
    check_rotary,
)
from kernels.metadata import AttentionMetadata
from kernels.triton_attention import launch_paged_attention
from kernels.triton_moe import triton_moe_experts
from kernels.triton_rms_norm import launch_rms_norm
from kernels.triton_rotary import launch_rotary_embedding
from kernels.triton_store_kv import launch_store_kv

__all__ = ["TritonBackend", "TritonStepPlan"]

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


class TritonStepPlan:
    """The step's checked metadata and KV cache, as the kernels read them."""

    def __init__(self, metadata: AttentionMetadata, kv_cache: torch.Tensor) -> None:
        self.metadata = metadata
        self.kv_cache = kv_cache  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]


def _check_device(tensor: torch.Tensor) -> None:
    if tensor.device.type == "cuda" or (_INTERPRET and tensor.device.type == "cpu"):
        return
    raise KernelInputError(
        f"the triton backend needs CUDA tensors (or CPU tensors with TRITON_INTERPRET=1), "
        f"got {tensor.device}"
    )


class TritonBackend:
    name = "triton"

    def __init__(self, deterministic: bool = False) -> None:
        """``deterministic``: one context split and one query-tile size whatever the batch
        (``launch_paged_attention``)."""
        self.deterministic = deterministic

    def plan(
        self,
        positions: torch.Tensor,  # [num_tokens] int64
        metadata: AttentionMetadata,
        kv_cache: torch.Tensor,  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
        max_position: int,
    ) -> TritonStepPlan:
        """Checks the step's metadata (values too, on host tensors); raises KernelInputError."""
        check_kv_cache(kv_cache)
        _check_device(kv_cache)
        check_metadata(positions, metadata, kv_cache.device)
        if positions.device.type == "cpu":
            check_index_values(positions, metadata, kv_cache.shape, max_position)
        else:  # the values stay on the device: the capacity alone is checked
            check_capacity(metadata, kv_cache.shape[3])
        return TritonStepPlan(metadata, kv_cache)

    def operator_step(self, plan: TritonStepPlan) -> None:
        """None: no step is run by inductor's C++ wrapper here (``TorchBackend.operator_step``)."""
        return None

    def rope(
        self, positions: torch.Tensor, cos_sin_cache: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary kernel reads the table by position: (positions, cos_sin_cache)."""
        return positions, cos_sin_cache

    def rotary(
        self,
        heads: torch.Tensor,  # [num_tokens, num_heads, head_dim]: query and key heads
        rope: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        """Rotates ``heads`` in place (see ``TorchBackend.rotary``) and returns it."""
        positions, cos_sin_cache = rope
        check_rotary(heads, positions, cos_sin_cache)
        _check_device(heads)
        # the kernel rotates two head groups; one group and an empty one is the same thing
        launch_rotary_embedding(positions, heads, heads[:, :0], cos_sin_cache)
        return heads

    def store_kv(
        self,
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,
        key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        value_cache: torch.Tensor,
        plan: TritonStepPlan,
    ) -> None:
        """Writes each token's K/V into its cache slot; tokens whose slot is -1 are skipped."""
        check_kv_inputs(key, value, key_cache, value_cache)
        if key.shape[0] != plan.metadata.slot_mapping.shape[0]:
            raise KernelInputError(f"key/value {tuple(key.shape)} do not match the step's plan")
        launch_store_kv(key, value, key_cache, value_cache, plan.metadata.slot_mapping)

    def paged_attention(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        value_cache: torch.Tensor,
        plan: TritonStepPlan,
        scale: float,
        out: torch.Tensor | None = None,
        num_splits: int | None = None,
    ) -> torch.Tensor:
        """Causal attention of the step's rows over the cache; ``num_splits`` None: chosen by
        the flash-decoding heuristic (``kernels/triton_attention.py``; one in deterministic
        mode)."""
        check_attention_inputs(query, key_cache, value_cache, out)
        metadata = plan.metadata
        if query.shape[0] != metadata.slot_mapping.shape[0]:
            raise KernelInputError(f"query {tuple(query.shape)} does not match the step's plan")
        if out is None:
            out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        return launch_paged_attention(
            query, key_cache, value_cache, metadata.query_start, metadata.context_lens,
            metadata.block_tables, scale, metadata.max_query_len, metadata.max_context_len, out,
            num_splits, self.deterministic,
        )  # fmt: skip

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        plan: TritonStepPlan,
        layer: int,
        scale: float,
    ) -> torch.Tensor:
        """Stores the layer's K/V, then attends over its cache."""
        key_cache, value_cache = plan.kv_cache[layer]
        self.store_kv(key, value, key_cache, value_cache, plan)
        return self.paged_attention(query, key_cache, value_cache, plan, scale)

    def rms_norm(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        residual: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(s) * weight, s)``, ``s = x + residual`` (see ``TorchBackend.rms_norm``)."""
        check_rms_norm(x, weight, eps, residual)
        _check_device(x)
        result = launch_rms_norm(x, weight, eps, residual)
        return (result, x) if residual is None else result  # type: ignore[return-value]

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """SwiGLU's ``silu(gate) * up`` of ``gate_up`` [num_tokens, 2 * intermediate] (gate, then
        up), in PyTorch."""
        intermediate = gate_up.shape[-1] // 2
        return F.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]

    def silu_mul_product(self, layer: Any, x: torch.Tensor) -> torch.Tensor | None:
        """None: the product and ``silu_mul`` run apart here."""
        return None

    def moe_experts(
        self,
        hidden: torch.Tensor,
        w_gate_up: torch.Tensor,
        w_down: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:
        """The routed experts' weighted SwiGLU (see ``TorchBackend.moe_experts``), checked."""
        _check_device(hidden)
        return triton_moe_experts(hidden, w_gate_up, w_down, topk_weights, topk_ids)
