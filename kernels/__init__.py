"""Attention backends: one object per backend, with one signature per op.

``get_backend("torch")`` is the PyTorch implementation (CPU runtime path and the reference);
``get_backend("triton")`` the Triton kernels (CUDA, or CPU under ``TRITON_INTERPRET=1``), imported
only when asked for. Both have the shape of ``AttentionBackend``: ``plan`` once per step (checks,
indices; ``operator_step`` gives it as tensors alone where a graph can take it so), ``rope`` once
per step, then per layer ``rms_norm``, ``rotary``, ``attend`` (the K/V
store and paged attention; ``store_kv`` and ``paged_attention`` are its two halves) and
``silu_mul`` (SwiGLU's activation; ``silu_mul_product`` the same of a gate-and-up layer's
product in one call where the backend has one for its weights, else None), and in
mixture-of-experts layers ``moe_experts`` (``kernels/torch_moe.py``).
"""

from __future__ import annotations

import importlib
from typing import Any, Protocol

import torch

from kernels.checks import KernelInputError
from kernels.metadata import AttentionMetadata
from kernels.rope import build_cos_sin_cache

__all__ = [
    "BACKENDS",
    "AttentionBackend",
    "AttentionMetadata",
    "KernelInputError",
    "build_cos_sin_cache",
    "get_backend",
]

# backend name -> (module, class)
BACKENDS = {
    "torch": ("kernels.torch_backend", "TorchBackend"),
    "triton": ("kernels.triton_backend", "TritonBackend"),
}


class AttentionBackend(Protocol):
    name: str

    def plan(
        self,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        kv_cache: torch.Tensor,
        max_position: int,
    ) -> Any: ...

    def operator_step(self, plan: Any) -> Any | None: ...

    def rope(
        self, positions: torch.Tensor, cos_sin_cache: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def rotary(
        self, heads: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor: ...

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        plan: Any,
        layer: int,
        scale: float,
    ) -> torch.Tensor: ...

    def rms_norm(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        residual: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...

    def silu_mul_product(self, layer: Any, x: torch.Tensor) -> torch.Tensor | None: ...

    def moe_experts(
        self,
        hidden: torch.Tensor,
        w_gate_up: torch.Tensor,
        w_down: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor: ...


def get_backend(name: str, deterministic: bool = False) -> AttentionBackend:
    """A new backend object for ``name`` ("torch" or "triton"); ``deterministic``: its attention
    gives a query the same bits whatever else the step holds (slower)."""
    if name not in BACKENDS:
        raise ValueError(f"unknown kernel backend {name!r} (choices: {', '.join(BACKENDS)})")
    module, cls = BACKENDS[name]
    backend: AttentionBackend = getattr(importlib.import_module(module), cls)(deterministic)
    return backend
