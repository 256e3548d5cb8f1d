"""The Triton implementation of each op, with the same signatures as kernels.torch_ops.

Runs on CUDA tensors, or on CPU tensors under ``TRITON_INTERPRET=1`` (the tests). Inputs are checked
at the boundary (kernels.checks); on CPU, where reading them costs no device sync, the index values
(slots, positions, row lengths) are checked too. On CUDA the kernels never access memory outside
the tensors for bad index values: such slots are not written and such positions not rotated.
"""

from __future__ import annotations

import os

import torch

from kernels.checks import (
    KernelInputError,
    check_paged_attention,
    check_rms_norm,
    check_rotary_embedding,
    check_store_kv,
)
from kernels.triton_attention import launch_paged_attention
from kernels.triton_rms_norm import launch_rms_norm
from kernels.triton_rotary import launch_rotary_embedding
from kernels.triton_store_kv import launch_store_kv

__all__ = ["paged_attention", "rms_norm", "rotary_embedding", "store_kv"]

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _check_device(tensor: torch.Tensor) -> None:
    if tensor.device.type == "cuda" or (_INTERPRET and tensor.device.type == "cpu"):
        return
    raise KernelInputError(
        f"the triton backend needs CUDA tensors (or CPU tensors with TRITON_INTERPRET=1), "
        f"got {tensor.device}"
    )


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write each token's K/V into its cache slot; tokens whose slot is -1 are skipped."""
    check_store_kv(key, value, key_cache, value_cache, slot_mapping)
    _check_device(key_cache)
    num_slots = key_cache.shape[0] * key_cache.shape[1]
    on_host = slot_mapping.device.type == "cpu" and slot_mapping.numel() > 0
    if on_host and not -1 <= int(slot_mapping.min()) <= int(slot_mapping.max()) < num_slots:
        raise KernelInputError(f"slot_mapping must hold -1 or slots in [0, {num_slots})")
    launch_store_kv(key, value, key_cache, value_cache, slot_mapping)


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    query_start: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_query_len: int,
    max_context_len: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of a ragged batch over the paged KV cache (see kernels.torch_ops)."""
    check_paged_attention(
        query, key_cache, value_cache, query_start, context_lens, block_tables,
        max_query_len, max_context_len, out,
    )  # fmt: skip
    _check_device(query)
    if query_start.device.type == "cpu":
        _check_rows(query, query_start, context_lens, max_query_len, max_context_len)
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    return launch_paged_attention(
        query, key_cache, value_cache, query_start, context_lens, block_tables, scale,
        max_query_len, max_context_len, out,
    )  # fmt: skip


def _check_rows(
    query: torch.Tensor,
    query_start: torch.Tensor,
    context_lens: torch.Tensor,
    max_query_len: int,
    max_context_len: int,
) -> None:
    """The row lengths agree with each other and with the declared maxima (host tensors only)."""
    query_lens = query_start[1:] - query_start[:-1]  # [num_rows]
    if int(query_start[0]) != 0 or int(query_start[-1]) != query.shape[0]:
        raise KernelInputError(f"query_start must run from 0 to num_tokens {query.shape[0]}")
    if query_lens.numel() == 0:
        return
    if int(query_lens.min()) < 0 or int(query_lens.max()) > max_query_len:
        raise KernelInputError(f"query lengths must be in [0, max_query_len {max_query_len}]")
    if bool((context_lens < query_lens).any()) or int(context_lens.max()) > max_context_len:
        raise KernelInputError(
            f"context_lens must be in [query length, max_context_len {max_context_len}]"
        )


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm (see kernels.torch_ops.rms_norm); returns new tensors."""
    check_rms_norm(x, weight, eps, residual)
    _check_device(x)
    return launch_rms_norm(x, weight, eps, residual)


def rotary_embedding(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor
) -> None:
    """Rotate query and key in place by their positions (see kernels.torch_ops)."""
    check_rotary_embedding(positions, query, key, cos_sin_cache)
    _check_device(query)
    max_position = cos_sin_cache.shape[0]
    on_host = positions.device.type == "cpu" and positions.numel() > 0
    if on_host and not 0 <= int(positions.min()) <= int(positions.max()) < max_position:
        raise KernelInputError(f"positions must be in [0, {max_position})")
    launch_rotary_embedding(positions, query, key, cos_sin_cache)
