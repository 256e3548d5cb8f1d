"""bfloat16 matrix products on CPUs with the weight packed once into oneDNN's blocked layout.

``F.linear`` on a bfloat16 CPU tensor reorders the weight into that layout at every call. Packed
once at load time, a decode-sized product (one row) runs about twice as fast and a prefill-sized
one about 10% faster, with bit-identical results (measured on this project's 2-core AMX machine).
Other dtypes and devices keep ``F.linear``.
"""

from __future__ import annotations

import torch


def can_pack(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and weight.dim() == 2
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """An opaque oneDNN tensor holding ``weight`` ([out_features, in_features])."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), 1)


def packed_linear(
    x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``x W^T + b`` for a packed W; ``x`` [num_rows, in_features] -> [num_rows, out_features]."""
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")
