"""Mixture-of-experts ops in PyTorch: top-k routing, and the routed experts' SwiGLU as grouped
matrix products. The CPU serving path, and the reference of ``kernels/triton_moe.py``.

The experts of one layer are stacked (a tensor-parallel rank holds its share of ``intermediate``):

    w_gate_up [num_experts, 2 * intermediate, hidden]   each expert's gate rows, then its up rows
    w_down    [num_experts, hidden, intermediate]

A token routed to ``top_k`` experts makes ``top_k`` (token, expert) pairs, pair ``p`` being token
``p // top_k``. The pairs are sorted by expert, so that each expert with work runs once, on all of
its tokens together (at most ``num_experts`` products per projection, never one per token):

    topk_ids [[2, 0], [0, 1], [2, 1]]     3 tokens, top-2: pairs 0..5 -> experts [2, 0, 0, 1, 2, 1]
    pairs sorted by expert  [1, 2 | 3, 5 | 0, 4]   expert 0: tokens [0, 1], 1: [1, 2], 2: [0, 2]

Each pair's output is scaled by its routing weight and added into its token's row, experts in
ascending order (the order transformers adds them in).

``moe_experts`` is the operator ``splitfuse::moe_experts``: opaque to ``torch.compile`` (its
per-expert row counts are data), so a compiled step graph does not specialize on the routing.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

__all__ = ["add_pairs", "grouped_experts", "moe_experts", "route_topk", "sort_pairs"]


def route_topk(
    router_logits: torch.Tensor,  # [num_tokens, num_experts]
    top_k: int,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(topk_weights, topk_ids)``, both ``[num_tokens, top_k]``: the ``top_k`` largest softmax
    probabilities (float32) and their experts (int64), the weights renormalized to sum to 1 when
    ``renormalize`` (Mixtral, Qwen3-MoE) or left as they are (Qwen2-MoE)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights, topk_ids


def check_moe_inputs(
    hidden: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> None:
    """Shapes and dtypes of ``moe_experts``'s arguments (no values: expert ids are the model's
    own top-k). Raises ValueError naming the first that does not fit."""
    if hidden.dim() != 2 or w_gate_up.dim() != 3 or w_down.dim() != 3:
        raise ValueError(
            f"moe: expected hidden [tokens, hidden], w_gate_up and w_down [experts, ...], got "
            f"{tuple(hidden.shape)}, {tuple(w_gate_up.shape)}, {tuple(w_down.shape)}"
        )
    num_experts, hidden_size, intermediate = w_down.shape
    if tuple(w_gate_up.shape) != (num_experts, 2 * intermediate, hidden_size):
        raise ValueError(
            f"moe: w_gate_up {tuple(w_gate_up.shape)} does not match w_down "
            f"{tuple(w_down.shape)} (expected {(num_experts, 2 * intermediate, hidden_size)})"
        )
    if hidden.shape[1] != hidden_size or len({hidden.dtype, w_gate_up.dtype, w_down.dtype}) > 1:
        raise ValueError(
            f"moe: hidden {tuple(hidden.shape)} {hidden.dtype} does not fit experts of hidden "
            f"size {hidden_size} in {w_down.dtype}"
        )
    if topk_ids.dim() != 2 or topk_ids.shape[0] != hidden.shape[0]:
        raise ValueError(f"moe: topk_ids {tuple(topk_ids.shape)} is not [num_tokens, top_k]")
    if topk_weights.shape != topk_ids.shape or topk_ids.dtype != torch.int64:
        raise ValueError(
            f"moe: topk_weights {tuple(topk_weights.shape)} and int64 topk_ids "
            f"{tuple(topk_ids.shape)} {topk_ids.dtype} must have one shape"
        )


def moe_experts(
    hidden: torch.Tensor,  # [num_tokens, hidden]
    w_gate_up: torch.Tensor,  # [num_experts, 2 * intermediate, hidden]
    w_down: torch.Tensor,  # [num_experts, hidden, intermediate]
    topk_weights: torch.Tensor,  # [num_tokens, top_k], hidden's dtype
    topk_ids: torch.Tensor,  # [num_tokens, top_k] int64
) -> torch.Tensor:
    """``sum_j topk_weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t))`` with ``e =
    topk_ids[t, j]``, for every token t: ``[num_tokens, hidden]`` in hidden's dtype (a rank's
    partial sum under tensor parallelism). Checked; then ``splitfuse::moe_experts``."""
    check_moe_inputs(hidden, w_gate_up, w_down, topk_weights, topk_ids)
    return torch.ops.splitfuse.moe_experts(hidden, w_gate_up, w_down, topk_weights, topk_ids)


def sort_pairs(
    topk_ids: torch.Tensor,  # [num_tokens, top_k] int64
    num_experts: int,
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """``(order, token_of_pair, counts)``: the pair ids sorted by expert (stable), the token of
    each sorted pair, and the number of pairs per expert (one host read). With the module
    docstring's example: order [1, 2, 3, 5, 0, 4], tokens [0, 1, 1, 2, 0, 2], counts [2, 2, 2]."""
    expert_of_pair = topk_ids.reshape(-1)  # [num_pairs]
    order = torch.argsort(expert_of_pair, stable=True)
    counts = torch.bincount(expert_of_pair, minlength=num_experts).tolist()
    return order, order // topk_ids.shape[1], counts


def add_pairs(
    pair_out: torch.Tensor,  # [num_pairs, hidden], sorted order
    topk_weights: torch.Tensor,  # [num_tokens, top_k]
    order: torch.Tensor,
    token_of_pair: torch.Tensor,
) -> torch.Tensor:
    """Each sorted pair's output scaled by its routing weight and added into its token's row:
    ``[num_tokens, hidden]`` (in place on ``pair_out``)."""
    pair_out *= topk_weights.reshape(-1)[order, None]
    out = pair_out.new_zeros(topk_weights.shape[0], pair_out.shape[1])
    return out.index_add_(0, token_of_pair, pair_out)


def grouped_experts(
    hidden: torch.Tensor,  # [num_tokens, hidden]
    topk_weights: torch.Tensor,  # [num_tokens, top_k]
    topk_ids: torch.Tensor,  # [num_tokens, top_k] int64
    num_experts: int,
    intermediate: int,
    gate_up: Callable[[torch.Tensor, int], torch.Tensor],
    down: Callable[[torch.Tensor, int], torch.Tensor],
) -> torch.Tensor:
    """The grouping of ``moe_experts`` around any product: ``gate_up(rows, expert)`` ->
    ``[count, 2 * intermediate]`` and ``down(rows, expert)`` -> ``[count, hidden]`` run once per
    expert with work, on all of its tokens; ``[num_tokens, hidden]``."""
    order, token_of_pair, counts = sort_pairs(topk_ids, num_experts)
    sorted_hidden = hidden[token_of_pair]  # [num_pairs, hidden]
    pair_out = torch.empty_like(sorted_hidden)
    start = 0
    for expert, count in enumerate(counts):
        if not count:
            continue
        rows = slice(start, start + count)
        projected = gate_up(sorted_hidden[rows], expert)  # [count, 2 * intermediate]
        activated = F.silu(projected[:, :intermediate]) * projected[:, intermediate:]
        pair_out[rows] = down(activated, expert)
        start += count
    return add_pairs(pair_out, topk_weights, order, token_of_pair)


def _moe_experts(
    hidden: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    return grouped_experts(
        hidden,
        topk_weights,
        topk_ids,
        w_down.shape[0],
        w_down.shape[2],
        lambda rows, expert: F.linear(rows, w_gate_up[expert]),
        lambda rows, expert: F.linear(rows, w_down[expert]),
    )


def _moe_experts_shape(
    hidden: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    return torch.empty_like(hidden, memory_format=torch.contiguous_format)


# The low-level library API, as for ``splitfuse::attend`` (kernels/torch_backend.py): the
# custom_op wrapper's per-call cost matters for a small decode step.
_LIBRARY = torch.library.Library("splitfuse", "FRAGMENT")
_LIBRARY.define(
    "moe_experts(Tensor hidden, Tensor w_gate_up, Tensor w_down, Tensor topk_weights, "
    "Tensor topk_ids) -> Tensor"
)
_LIBRARY.impl("moe_experts", _moe_experts, "CPU")
_LIBRARY.impl("moe_experts", _moe_experts, "CUDA")
_LIBRARY.impl("moe_experts", _moe_experts_shape, "Meta")
