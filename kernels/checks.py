"""Boundary checks shared by both backends: shapes, dtypes, devices, strides; never tensor values.

Every op calls its check before touching memory, so a bad argument raises `KernelInputError` and
changes nothing. The checks read metadata only (no device sync).
"""

from __future__ import annotations

import torch


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


def check_store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    _check_cache_pair(key_cache, value_cache)
    device = key_cache.device
    for name, tensor in (("key", key), ("value", value)):
        _require(
            tensor.dim() == 3 and tensor.shape[1:] == key_cache.shape[2:],
            f"{name} must be [num_tokens, {key_cache.shape[2]}, {key_cache.shape[3]}], "
            f"got {tuple(tensor.shape)}",
        )
        _require(
            tensor.dtype == key_cache.dtype,
            f"{name} is {tensor.dtype}, the cache is {key_cache.dtype}",
        )
        _check_device(name, tensor, device)
        _require(tensor.stride(-1) == 1, f"{name} must have a unit stride in head_dim")
    _require(value.shape == key.shape, f"value {tuple(value.shape)} != key {tuple(key.shape)}")
    _check_index("slot_mapping", slot_mapping, torch.int64, 1)
    _require(
        slot_mapping.shape[0] == key.shape[0],
        f"slot_mapping has {slot_mapping.shape[0]} slots for {key.shape[0]} tokens",
    )
    _check_device("slot_mapping", slot_mapping, device)


def check_paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    query_start: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_query_len: int,
    max_context_len: int,
    out: torch.Tensor | None,
) -> None:
    _check_cache_pair(key_cache, value_cache)
    device = key_cache.device
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    _require(
        query.dim() == 3 and query.shape[2] == head_dim,
        f"query must be [num_tokens, num_heads, {head_dim}], got {tuple(query.shape)}",
    )
    _require(
        query.shape[1] % num_kv_heads == 0,
        f"num_heads {query.shape[1]} is not a multiple of num_kv_heads {num_kv_heads}",
    )
    _require(query.dtype == key_cache.dtype, f"query is {query.dtype}, cache {key_cache.dtype}")
    _check_device("query", query, device)
    _require(query.stride(-1) == 1, "query must have a unit stride in head_dim")
    _check_index("query_start", query_start, torch.int32, 1)
    _check_index("context_lens", context_lens, torch.int32, 1)
    _check_index("block_tables", block_tables, torch.int32, 2)
    num_rows = context_lens.shape[0]
    _require(
        query_start.shape[0] == num_rows + 1,
        f"query_start has {query_start.shape[0]} entries for {num_rows} rows (expected rows + 1)",
    )
    _require(
        block_tables.shape[0] == num_rows,
        f"block_tables has {block_tables.shape[0]} rows, context_lens {num_rows}",
    )
    for name, tensor in (
        ("query_start", query_start),
        ("context_lens", context_lens),
        ("block_tables", block_tables),
    ):
        _check_device(name, tensor, device)
    _require(
        isinstance(max_query_len, int) and isinstance(max_context_len, int),
        "max_query_len and max_context_len must be Python ints",
    )
    _require(
        0 <= max_query_len <= max(max_context_len, 0),
        f"max_query_len {max_query_len} must be in [0, max_context_len {max_context_len}]",
    )
    capacity = block_tables.shape[1] * block_size
    _require(
        max_context_len <= capacity,
        f"max_context_len {max_context_len} exceeds the block tables' capacity {capacity}",
    )
    if out is not None:
        _require(
            out.shape == query.shape and out.dtype == query.dtype,
            f"out must be {tuple(query.shape)} {query.dtype}, got {tuple(out.shape)} {out.dtype}",
        )
        _check_device("out", out, device)
        _require(out.stride(-1) == 1, "out must have a unit stride in head_dim")


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


def check_rotary_embedding(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor
) -> None:
    _require(
        query.dim() == 3,
        f"query must be [num_tokens, num_heads, head_dim], got {tuple(query.shape)}",
    )
    _require(
        key.dim() == 3, f"key must be [num_tokens, num_kv_heads, head_dim], got {tuple(key.shape)}"
    )
    num_tokens, _, head_dim = query.shape
    _require(
        key.shape[0] == num_tokens and key.shape[2] == head_dim,
        f"key {tuple(key.shape)} does not match query {tuple(query.shape)}",
    )
    _require(head_dim % 2 == 0, f"head_dim must be even, got {head_dim}")
    _require(key.dtype == query.dtype, f"key is {key.dtype}, query is {query.dtype}")
    _require(query.is_floating_point(), f"query must be a floating tensor, got {query.dtype}")
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
    for name, tensor in (("key", key), ("positions", positions), ("cos_sin_cache", cos_sin_cache)):
        _check_device(name, tensor, query.device)
    _require(
        query.stride(-1) == 1 and key.stride(-1) == 1,
        "query and key must have a unit stride in head_dim",
    )
