"""The sparse mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE) and its checkpoint names.

    router logits = x W_gate^T                       [num_tokens, num_experts], replicated
    top-k experts and weights (softmax, renormalized or not: ``kernels/torch_moe.py``)
    out = sum over the token's experts of weight * down_e(silu(gate_e(x)) * up_e(x))
        (+ sigmoid(x W_shared_gate^T) * shared_expert(x), Qwen2-MoE)

Tensor parallelism splits every expert by its intermediate dimension, as the dense MLP: a rank holds
rows ``[rank * I / world, (rank + 1) * I / world)`` of each expert's gate and up projections and the
same columns of its down projection, runs every expert on its share, and the partial sums are
all-reduced. The router is replicated. (No expert parallelism: each rank holds all the experts.)

Checkpoints name the experts in either of two layouts, both accepted:

    per expert (Hub files, transformers' save_pretrained):
        Mixtral  model.layers.L.block_sparse_moe.experts.E.{w1, w3, w2}.weight   (gate, up, down)
        Qwen     model.layers.L.mlp.experts.E.{gate_proj, up_proj, down_proj}.weight
    stacked (transformers 5 modules):
        model.layers.L.mlp.experts.gate_up_proj [E, 2 * I, hidden], .down_proj [E, hidden, I]

Stacked tensors are split into the per-expert names (``split_stacked_experts``) before loading.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.model_config import ModelConfig
from engine.moe_packed import PackedExperts, can_pack_experts
from engine.parallel import ParallelContext
from kernels import AttentionBackend
from kernels.torch_moe import route_topk

# model.layers.L.<block>.experts.E.<projection>.weight (the per-expert layout)
_EXPERT_WEIGHT = re.compile(
    r"^(?P<layer>.*)\.(?:block_sparse_moe|mlp)\.experts\.(?P<expert>\d+)\."
    r"(?P<projection>w1|w3|w2|gate_proj|up_proj|down_proj)\.weight$"
)
# model.layers.L.mlp.experts.<gate_up_proj | down_proj> (the stacked layout)
_STACKED_EXPERTS = re.compile(
    r"^(?P<layer>.*)\.(?:block_sparse_moe|mlp)\.experts\.(?P<projection>gate_up_proj|down_proj)$"
)
# projection -> part of the fused gate/up weight (0, 1), or None for the down projection
_PROJECTION_PART = {"w1": 0, "gate_proj": 0, "w3": 1, "up_proj": 1, "w2": None, "down_proj": None}


def expert_param_name(checkpoint_name: str) -> tuple[str, int] | None:
    """``(parameter, shard_id)`` for a per-expert checkpoint weight, None for any other name.
    shard_id: ``expert * 2 + part`` (gate 0, up 1) in ``w_gate_up``, ``expert`` in ``w_down``.

        model.layers.3.block_sparse_moe.experts.5.w3.weight
            -> model.layers.3.mlp.experts.w_gate_up, 11
    """
    match = _EXPERT_WEIGHT.match(checkpoint_name)
    if match is None:
        return None
    layer, expert = match["layer"], int(match["expert"])
    part = _PROJECTION_PART[match["projection"]]
    if part is None:
        return f"{layer}.mlp.experts.w_down", expert
    return f"{layer}.mlp.experts.w_gate_up", expert * 2 + part


def split_stacked_experts(weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """The checkpoint's ``(name, slice)`` pairs with each stacked expert tensor replaced by its
    experts' per-expert weights (read one expert at a time); other pairs pass unchanged."""
    for name, loaded in weights:
        match = _STACKED_EXPERTS.match(name)
        if match is None:
            yield name, loaded
            continue
        shape = tuple(loaded.get_shape()) if hasattr(loaded, "get_shape") else loaded.shape
        if len(shape) != 3:
            raise ValueError(f"{name}: expected [num_experts, rows, cols], got {list(shape)}")
        prefix = f"{match['layer']}.mlp.experts"
        for expert in range(shape[0]):
            weight = loaded[expert : expert + 1][0]  # [rows, cols]
            if match["projection"] == "down_proj":
                yield f"{prefix}.{expert}.down_proj.weight", weight
                continue
            if shape[1] % 2:
                raise ValueError(f"{name}: gate_up_proj has an odd number of rows ({shape[1]})")
            half = shape[1] // 2
            yield f"{prefix}.{expert}.gate_proj.weight", weight[:half]
            yield f"{prefix}.{expert}.up_proj.weight", weight[half:]


def _checked_shape(loaded: Any, expected: tuple[int, int], what: str) -> None:
    shape = tuple(loaded.get_shape()) if hasattr(loaded, "get_shape") else tuple(loaded.shape)
    if shape != expected:
        raise ValueError(f"{what} has shape {list(shape)}, expected {list(expected)}")


class ReplicatedLinear(nn.Module):
    """``y = x W^T`` with W whole on every rank (the router and the shared expert's gate: a few
    rows, kept in the model's dtype, never quantized)."""

    def __init__(self, input_size: int, output_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=dtype), False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class StackedExperts(nn.Module):
    """One layer's routed experts, stacked for the grouped product; this rank's share of each:

    w_gate_up [num_experts, 2 * local_size, hidden]   local gate rows, then local up rows
    w_down    [num_experts, hidden, local_size]

    ``forward(x, topk_weights, topk_ids)`` runs the backend's ``moe_experts``, or on a CPU, once
    ``pack_weights()`` has run, the same grouping on oneDNN-packed weights
    (``engine/moe_packed.py``).
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        dtype: torch.dtype,
        backend: AttentionBackend,
        parallel: ParallelContext,
    ) -> None:
        super().__init__()
        self.backend = backend
        self.packed: PackedExperts | None = None
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.local_size = parallel.shard(intermediate_size, "the experts' intermediate size")
        self.local_start = parallel.rank * self.local_size
        self.w_gate_up = nn.Parameter(
            torch.empty(num_experts, 2 * self.local_size, hidden_size, dtype=dtype), False
        )
        self.w_gate_up.weight_loader = self._load_gate_up  # type: ignore[attr-defined]
        self.w_down = nn.Parameter(
            torch.empty(num_experts, hidden_size, self.local_size, dtype=dtype), False
        )
        self.w_down.weight_loader = self._load_down  # type: ignore[attr-defined]

    def _expert(self, shard_id: int) -> int:
        if not 0 <= shard_id < self.num_experts:
            raise ValueError(f"expert {shard_id} is not one of the {self.num_experts} experts")
        return shard_id

    def _load_gate_up(self, param: torch.Tensor, loaded: Any, shard_id: int) -> None:
        """``shard_id = expert * 2 + part``: an expert's gate (0) or up (1) weight [I, hidden]."""
        expert, part = divmod(shard_id, 2)
        self._expert(expert)
        _checked_shape(loaded, (self.intermediate_size, self.hidden_size), "expert gate/up")
        rows = slice(part * self.local_size, (part + 1) * self.local_size)
        param[expert, rows].copy_(loaded[self.local_start : self.local_start + self.local_size])

    def _load_down(self, param: torch.Tensor, loaded: Any, shard_id: int) -> None:
        """``shard_id = expert``: its down weight [hidden, I]."""
        expert = self._expert(shard_id)
        _checked_shape(loaded, (self.hidden_size, self.intermediate_size), "expert down")
        param[expert].copy_(loaded[:, self.local_start : self.local_start + self.local_size])

    def pack_weights(self) -> None:
        """Call once, after loading, as for ``MatmulLayer``: the experts then multiply with
        packed copies (where the CPU packs their dtype), and the stacked parameters give their
        storage up."""
        if self.packed is None and can_pack_experts(self.w_gate_up):
            self.packed = PackedExperts(self.w_gate_up, self.w_down)
            self.w_gate_up.data = self.w_gate_up.data.new_empty(0)
            self.w_down.data = self.w_down.data.new_empty(0)

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        topk_weights: torch.Tensor,  # [num_tokens, top_k], x's dtype
        topk_ids: torch.Tensor,  # [num_tokens, top_k] int64
    ) -> torch.Tensor:
        """This rank's partial sums of the routed experts' weighted outputs [num_tokens, hidden]."""
        if self.packed is not None:
            return torch.ops.splitfuse.packed_moe_experts(x, self.packed, topk_weights, topk_ids)
        return self.backend.moe_experts(x, self.w_gate_up, self.w_down, topk_weights, topk_ids)

    def expected_shard_ids(self, param_name: str) -> range:
        """The shard ids a checkpoint must fill for ``param_name`` (``w_gate_up`` or ``w_down``)."""
        per_expert = 2 if param_name == "w_gate_up" else 1
        return range(self.num_experts * per_expert)


class SparseMoeBlock(nn.Module):
    """The MoE MLP of one layer: ``forward(x [num_tokens, hidden]) -> [num_tokens, hidden]``,
    whole on every rank. ``shared_expert``: Qwen2-MoE's dense SwiGLU MLP, gated per token by a
    sigmoid, added to every token's output (itself tensor-parallel and all-reduced)."""

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        backend: AttentionBackend,
        parallel: ParallelContext,
        shared_expert: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.parallel = parallel
        self.top_k = config.num_experts_per_tok
        self.renormalize = config.norm_topk_prob
        hidden_size = config.hidden_size
        self.gate = ReplicatedLinear(hidden_size, config.num_experts, dtype)
        self.experts = StackedExperts(
            config.num_experts, hidden_size, config.moe_intermediate_size, dtype, backend, parallel
        )
        self.shared_expert = shared_expert
        self.shared_expert_gate = (
            ReplicatedLinear(hidden_size, 1, dtype) if shared_expert is not None else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        router_logits = self.gate(x)  # [num_tokens, num_experts]
        topk_weights, topk_ids = route_topk(router_logits, self.top_k, self.renormalize)
        out = self.parallel.all_reduce(self.experts(x, topk_weights.to(x.dtype), topk_ids))
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
