"""The rotary embedding's cos/sin table, with inverse frequencies computed as transformers does."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def build_cos_sin_cache(
    head_dim: int,
    max_position: int,
    base: float,
    rope_scaling: Mapping[str, Any] | None = None,
) -> torch.Tensor:
    """The float32 table ``[max_position, head_dim]``: cos in the first half, sin in the second.

    ``rope_scaling``: None (or ``rope_type`` "default"), ``{"rope_type": "linear", "factor": f}``,
    or ``{"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
    "original_max_position_embeddings"}``; the older key ``type`` is accepted for ``rope_type``.
    """
    if head_dim <= 0 or head_dim % 2:
        raise ValueError(f"head_dim must be a positive even number, got {head_dim}")
    if max_position <= 0:
        raise ValueError(f"max_position must be positive, got {max_position}")
    if base <= 0:
        raise ValueError(f"the rope base must be positive, got {base}")
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (base**exponents)  # [head_dim // 2]
    inv_freq = _scale_inv_freq(inv_freq, rope_scaling)
    positions = torch.arange(max_position, dtype=torch.int64).float()
    freqs = torch.outer(positions, inv_freq)  # [max_position, head_dim // 2]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).contiguous()


def _scale_inv_freq(inv_freq: torch.Tensor, rope_scaling: Mapping[str, Any] | None) -> torch.Tensor:
    if not rope_scaling:
        return inv_freq
    rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / _positive(rope_scaling, "factor")
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, rope_scaling)
    raise ValueError(f"unsupported rope scaling {rope_type!r} (supported: default, linear, llama3)")


def _positive(rope_scaling: Mapping[str, Any], key: str) -> float:
    value = rope_scaling.get(key)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"rope scaling {key!r} must be a positive number, got {value!r}")
    return float(value)


def _llama3_inv_freq(inv_freq: torch.Tensor, rope_scaling: Mapping[str, Any]) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by factor, short ones kept, the band between blended."""
    factor, low_freq_factor, high_freq_factor, old_context_len = (
        _positive(rope_scaling, key) for key in _LLAMA3_KEYS
    )
    if high_freq_factor <= low_freq_factor:
        raise ValueError("rope scaling needs high_freq_factor > low_freq_factor")
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)
