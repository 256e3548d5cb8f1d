"""The routed experts on CPUs with every expert's weights packed once into oneDNN's layout.

``F.linear`` reorders a bfloat16 weight into oneDNN's blocked layout at every call (see
``engine/packed_linear.py``): for an expert of 1024 x 512, about 8 ms a product on a 2-core
AVX-512 BF16 machine, whatever the row count. Packed once at load, each expert's gate/up and down
products run as the dense layers' do. The grouping is ``kernels/torch_moe.py``'s (pairs sorted by
expert, one product per expert with work, weighted sums per token), so results agree with the
PyTorch op to the products' rounding.

``packed_moe_experts`` is the custom operator ``splitfuse::packed_moe_experts`` and the packed
experts a reference-type opaque object: a compiled graph calls it as it is.
"""

from __future__ import annotations

import torch
from torch._library.opaque_object import register_opaque_type
from torch._opaque_base import OpaqueBase

from engine.packed_linear import PackedWeight, can_pack, packed_linear
from kernels.torch_moe import grouped_experts

__all__ = ["PackedExperts", "can_pack_experts"]


def can_pack_experts(w_gate_up: torch.Tensor) -> bool:
    """Whether this CPU packs weights of this dtype (float32, or bfloat16 with its hardware)."""
    return can_pack(w_gate_up[0])


class PackedExperts(OpaqueBase):
    """A layer's experts, each projection of each expert packed on its own:
    ``w_gate_up`` [num_experts, 2 * intermediate, hidden], ``w_down`` [num_experts, hidden,
    intermediate] (a tensor-parallel rank's shares)."""

    def __init__(self, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> None:
        self.gate_up = [PackedWeight(weight) for weight in w_gate_up]
        self.down = [PackedWeight(weight) for weight in w_down]
        self.intermediate = w_down.shape[2]
        self.hidden_size = w_down.shape[1]


register_opaque_type(PackedExperts, typ="reference")


def packed_moe_experts(
    hidden: torch.Tensor,  # [num_tokens, hidden]
    experts: PackedExperts,
    topk_weights: torch.Tensor,  # [num_tokens, top_k], hidden's dtype
    topk_ids: torch.Tensor,  # [num_tokens, top_k] int64
) -> torch.Tensor:
    """``moe_experts`` of ``kernels/torch_moe.py`` on packed weights: ``[num_tokens, hidden]``."""
    intermediate = experts.intermediate
    return grouped_experts(
        hidden,
        topk_weights,
        topk_ids,
        len(experts.down),
        intermediate,
        lambda rows, e: packed_linear(rows, experts.gate_up[e], 2 * intermediate, None),
        lambda rows, e: packed_linear(rows, experts.down[e], experts.hidden_size, None),
    )


def _packed_moe_experts_shape(
    hidden: torch.Tensor,
    experts: PackedExperts,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    return torch.empty_like(hidden, memory_format=torch.contiguous_format)


_LIBRARY = torch.library.Library("splitfuse", "FRAGMENT")
_LIBRARY.define(
    "packed_moe_experts(Tensor hidden, engine.moe_packed.PackedExperts experts, "
    "Tensor topk_weights, Tensor topk_ids) -> Tensor"
)
_LIBRARY.impl("packed_moe_experts", packed_moe_experts, "CPU")
_LIBRARY.impl("packed_moe_experts", _packed_moe_experts_shape, "Meta")
