"""Attention, KV-store, RMSNorm and rotary ops behind one signature per op, two backends.

``get_ops("torch")`` is the PyTorch implementation (CPU runtime path and reference);
``get_ops("triton")`` the Triton kernels (CUDA, or CPU under ``TRITON_INTERPRET=1``), imported only
when asked for. Both expose ``store_kv``, ``paged_attention``, ``rms_norm``, ``rotary_embedding``.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from kernels.checks import KernelInputError
from kernels.rope import build_cos_sin_cache

__all__ = ["BACKENDS", "KernelInputError", "build_cos_sin_cache", "get_ops"]

BACKENDS = {"torch": "kernels.torch_ops", "triton": "kernels.triton_ops"}


def get_ops(backend: str) -> ModuleType:
    """The module implementing the four ops for ``backend`` ("torch" or "triton")."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r} (choices: {', '.join(BACKENDS)})")
    return importlib.import_module(BACKENDS[backend])
