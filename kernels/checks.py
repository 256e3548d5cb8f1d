"""Boundary checks shared by both backends: shapes, dtypes, devices, strides; never tensor values,
except in ``check_index_values``, which reads host tensors.

Every op calls its check before touching memory, so a bad argument raises `KernelInputError` and
changes nothing. The other checks read metadata only (no device sync).
"""

from __future__ import annotations

import torch

from kernels.metadata import AttentionMetadata


class KernelInputError(ValueError):
    """An op was called with tensors of the wrong shape, dtype, device or layout."""


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise KernelInputError(message)


def _check_device(name: str, tensor: torch.Tensor, device: torch.device) -> None:
    _require(tensor.device == device, f"{name} is on {tensor.device}, expected {device}")


def _check_index(name: str, tensor: torch.Tensor, dtype: torch.dtype, dim: int) -> None:
    _require(tensor.dtype == dtype, f"{name} must be {dtype}, got {tensor.dtype}")
    _require(tensor.dim() == dim, f"{name} must have {dim} dimension(s), got {tuple(tensor.shape)}")


def _check_cache_pair(key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    _require(
        key_cache.dim() == 4,
        "key_cache must be [num_blocks, block_size, num_kv_heads, head_dim], "
        f"got {tuple(key_cache.shape)}",
    )
    _require(
        value_cache.shape == key_cache.shape,
        f"value_cache {tuple(value_cache.shape)} != key_cache {tuple(key_cache.shape)}",
    )
    _require(
        value_cache.dtype == key_cache.dtype,
        f"value_cache is {value_cache.dtype}, key_cache is {key_cache.dtype}",
    )
    _check_device("value_cache", value_cache, key_cache.device)
    _require(
        key_cache.is_contiguous() and value_cache.is_contiguous(),
        "key_cache and value_cache must be contiguous",
    )


def check_kv_cache(kv_cache: torch.Tensor) -> None:
    _require(
        kv_cache.dim() == 6 and kv_cache.shape[1] == 2,
        "kv_cache must be [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim], "
        f"got {tuple(kv_cache.shape)}",
    )
    _require(kv_cache.is_floating_point(), f"kv_cache must be floating, got {kv_cache.dtype}")
    _require(kv_cache.is_contiguous(), "kv_cache must be contiguous")


def check_metadata(
    positions: torch.Tensor, metadata: AttentionMetadata, device: torch.device
) -> None:
    """The metadata's dtypes, shapes and devices agree with each other (values: the plan's)."""
    _check_index("positions", positions, torch.int64, 1)
    _check_index("slot_mapping", metadata.slot_mapping, torch.int64, 1)
    _check_index("query_start", metadata.query_start, torch.int32, 1)
    _check_index("context_lens", metadata.context_lens, torch.int32, 1)
    _check_index("block_tables", metadata.block_tables, torch.int32, 2)
    num_tokens, num_rows = positions.shape[0], metadata.context_lens.shape[0]
    _require(
        metadata.slot_mapping.shape[0] == num_tokens,
        f"slot_mapping has {metadata.slot_mapping.shape[0]} slots for {num_tokens} tokens",
    )
    _require(
        metadata.query_start.shape[0] == num_rows + 1,
        f"query_start has {metadata.query_start.shape[0]} entries for {num_rows} rows "
        "(expected rows + 1)",
    )
    _require(
        metadata.block_tables.shape[0] == num_rows,
        f"block_tables has {metadata.block_tables.shape[0]} rows, context_lens {num_rows}",
    )
    for name in ("slot_mapping", "query_start", "context_lens", "block_tables"):
        _check_device(name, getattr(metadata, name), device)
    _check_device("positions", positions, device)
    max_query_len, max_context_len = metadata.max_query_len, metadata.max_context_len
    _require(
        isinstance(max_query_len, int) and isinstance(max_context_len, int),
        "max_query_len and max_context_len must be Python ints",
    )
    _require(
        0 <= max_query_len <= max(max_context_len, 0),
        f"max_query_len {max_query_len} must be in [0, max_context_len {max_context_len}]",
    )


def check_capacity(metadata: AttentionMetadata, block_size: int) -> None:
    """The block tables hold ``max_context_len`` positions (no value read)."""
    capacity = metadata.block_tables.shape[1] * block_size
    _require(
        metadata.max_context_len <= capacity,
        f"max_context_len {metadata.max_context_len} exceeds the block tables' capacity {capacity}",
    )


def check_index_values(
    positions: torch.Tensor,  # [num_tokens] int64, on the host
    metadata: AttentionMetadata,  # on the host, checked by ``check_metadata``
    kv_cache_shape: torch.Size,  # [num_layers, 2, num_blocks, block_size, ...]
    max_position: int,
) -> None:
    """The step's index values, read on the host: the tables hold ``max_context_len``, slots are
    -1 or inside the cache, positions below ``max_position``, and the rows' lengths agree with
    each other and with the declared maxima."""
    num_blocks, block_size = kv_cache_shape[2], kv_cache_shape[3]
    check_capacity(metadata, block_size)
    num_tokens = positions.shape[0]
    if num_tokens:
        num_slots, slots = num_blocks * block_size, metadata.slot_mapping
        _require(
            -1 <= int(slots.min()) <= int(slots.max()) < num_slots,
            f"slot_mapping must hold -1 or slots in [0, {num_slots})",
        )
        _require(
            0 <= int(positions.min()) <= int(positions.max()) < max_position,
            f"positions must be in [0, {max_position})",
        )
    query_start, context_lens = metadata.query_start, metadata.context_lens
    _require(
        int(query_start[0]) == 0 and int(query_start[-1]) == num_tokens,
        f"query_start must run from 0 to num_tokens {num_tokens}",
    )
    query_lens = query_start[1:] - query_start[:-1]  # [num_rows]
    if query_lens.numel() == 0:
        return
    max_query_len, max_context_len = metadata.max_query_len, metadata.max_context_len
    _require(
        int(query_lens.min()) >= 0 and int(query_lens.max()) <= max_query_len,
        f"query lengths must be in [0, max_query_len {max_query_len}]",
    )
    _require(
        not bool((context_lens < query_lens).any()) and int(context_lens.max()) <= max_context_len,
        f"context_lens must be in [query length, max_context_len {max_context_len}]",
    )


def check_attention_inputs(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    out: torch.Tensor | None = None,
    converts: bool = False,
) -> None:
    """A layer's query and caches (``[num_blocks, block_size, num_kv_heads, head_dim]`` each),
    in one dtype (``converts``: the query in any floating dtype, for a backend that reads the
    caches in the query's)."""
    _check_cache_pair(key_cache, value_cache)
    head_dim, num_kv_heads = key_cache.shape[3], key_cache.shape[2]
    _require(
        query.dim() == 3 and query.shape[2] == head_dim,
        f"query must be [num_tokens, num_heads, {head_dim}], got {tuple(query.shape)}",
    )
    _require(
        query.shape[1] % num_kv_heads == 0,
        f"num_heads {query.shape[1]} is not a multiple of num_kv_heads {num_kv_heads}",
    )
    _require(
        query.dtype == key_cache.dtype or (converts and query.is_floating_point()),
        f"query is {query.dtype}, cache {key_cache.dtype}",
    )
    _check_device("query", query, key_cache.device)
    _require(query.stride(-1) == 1, "query must have a unit stride in head_dim")
    if out is not None:
        _require(
            out.shape == query.shape and out.dtype == query.dtype,
            f"out must be {tuple(query.shape)} {query.dtype}, got {tuple(out.shape)} {out.dtype}",
        )
        _check_device("out", out, key_cache.device)
        _require(out.stride(-1) == 1, "out must have a unit stride in head_dim")


def check_kv_inputs(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    converts: bool = False,
) -> None:
    """A layer's new K/V ``[num_tokens, num_kv_heads, head_dim]`` against its caches, in the
    caches' dtype (``converts``: any floating dtype, for a backend that converts them)."""
    _check_cache_pair(key_cache, value_cache)
    for name, tensor in (("key", key), ("value", value)):
        _require(
            tensor.dim() == 3 and tensor.shape[1:] == key_cache.shape[2:],
            f"{name} must be [num_tokens, {key_cache.shape[2]}, {key_cache.shape[3]}], "
            f"got {tuple(tensor.shape)}",
        )
        _require(
            tensor.dtype == key_cache.dtype or (converts and tensor.is_floating_point()),
            f"{name} is {tensor.dtype}, the cache is {key_cache.dtype}",
        )
        _check_device(name, tensor, key_cache.device)
        _require(tensor.stride(-1) == 1, f"{name} must have a unit stride in head_dim")
    _require(value.shape == key.shape, f"value {tuple(value.shape)} != key {tuple(key.shape)}")


def check_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None
) -> None:
    _require(x.dim() == 2, f"x must be [num_tokens, hidden], got {tuple(x.shape)}")
    _require(
        weight.dim() == 1 and weight.shape[0] == x.shape[1],
        f"weight must be [{x.shape[1]}], got {tuple(weight.shape)}",
    )
    _require(x.is_floating_point(), f"x must be a floating tensor, got {x.dtype}")
    _check_device("weight", weight, x.device)
    _require(x.stride(-1) == 1, "x must have a unit stride in hidden")
    _require(eps > 0, f"eps must be positive, got {eps}")
    if residual is not None:
        _require(
            residual.shape == x.shape and residual.dtype == x.dtype,
            f"residual must be {tuple(x.shape)} {x.dtype}, "
            f"got {tuple(residual.shape)} {residual.dtype}",
        )
        _check_device("residual", residual, x.device)
        _require(residual.stride(-1) == 1, "residual must have a unit stride in hidden")


def check_rotary(heads: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> None:
    _require(
        heads.dim() == 3,
        f"heads must be [num_tokens, num_heads, head_dim], got {tuple(heads.shape)}",
    )
    num_tokens, _, head_dim = heads.shape
    _require(head_dim % 2 == 0, f"head_dim must be even, got {head_dim}")
    _require(heads.is_floating_point(), f"heads must be a floating tensor, got {heads.dtype}")
    _check_index("positions", positions, torch.int64, 1)
    _require(
        positions.shape[0] == num_tokens,
        f"positions has {positions.shape[0]} entries for {num_tokens} tokens",
    )
    _require(
        cos_sin_cache.dim() == 2 and cos_sin_cache.shape[1] == head_dim,
        f"cos_sin_cache must be [max_position, {head_dim}], got {tuple(cos_sin_cache.shape)}",
    )
    _require(
        cos_sin_cache.dtype == torch.float32,
        f"cos_sin_cache must be float32, got {cos_sin_cache.dtype}",
    )
    _require(cos_sin_cache.is_contiguous(), "cos_sin_cache must be contiguous")
    for name, tensor in (("positions", positions), ("cos_sin_cache", cos_sin_cache)):
        _check_device(name, tensor, heads.device)
    _require(heads.stride(-1) == 1, "heads must have a unit stride in head_dim")
