"""The routed experts' SwiGLU on GPUs: a fused-MoE grouped matrix product in Triton, the same
function as ``moe_experts`` of ``kernels/torch_moe.py`` (its reference; layouts there).

The (token, expert) pairs are sorted by expert and each expert's run is padded to a whole number
of ``BLOCK_M`` rows (``align_pairs``, tensor ops with no host read), so that every block of rows
belongs to one expert:

    experts of pairs 0..5 [2, 0, 0, 1, 2, 1], BLOCK_M 4  (pad: 6, the number of pairs)
    sorted_pairs  [1, 2, 6, 6 | 3, 5, 6, 6 | 0, 4, 6, 6]    block_experts [0, 1, 2]

One kernel, launched twice, multiplies each block of rows by its expert's weight:

    gate_up [num_pairs, 2 * intermediate] = hidden[pair // top_k] @ w_gate_up[expert]^T
    (silu(gate) * up, in PyTorch)
    down    [num_pairs, hidden]           = activated[pair] @ w_down[expert]^T * weight[pair]

and the ``top_k`` rows of each token are summed. Products accumulate in float32.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.torch_moe import check_moe_inputs

__all__ = ["align_pairs", "triton_moe_experts"]

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# The interpreter's tl.dot gives wrong results on bfloat16 operands: dot in float32 there only.
INTERPRET = tl.constexpr(_INTERPRETED)


@triton.jit
def _moe_matmul_kernel(
    a_ptr,  # [num_a_rows, num_k]: pair p's input is row p // A_ROWS_PER_ROW
    b_ptr,  # [num_experts, num_n, num_k]
    c_ptr,  # [num_pairs, num_n], contiguous
    weights_ptr,  # [num_pairs] routing weights, read when MUL_WEIGHT
    sorted_pairs_ptr,  # [max_padded] pair ids by expert, padding = num_pairs
    block_experts_ptr,  # [max_padded / BLOCK_M] expert of each block of rows
    num_padded_ptr,  # [1] rows in use of sorted_pairs
    num_pairs,
    num_n,  # output columns
    num_k,  # inner dimension
    stride_am,
    stride_be,
    stride_bn,
    A_ROWS_PER_ROW: tl.constexpr,  # top_k for the first product, 1 for the second
    MUL_WEIGHT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for float32 (no TF32 rounding), else the default
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
    pairs = tl.load(sorted_pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < num_pairs
    a_rows = (pairs // A_ROWS_PER_ROW).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < num_n
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    b_base = b_ptr + expert * stride_be + offs_n[None, :].to(tl.int64) * stride_bn
    for k0 in range(0, num_k, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < num_k
        a = tl.load(
            a_ptr + a_rows[:, None] * stride_am + offs_k[None, :],
            mask=valid[:, None] & mask_k[None, :],
            other=0.0,
        )  # [BLOCK_M, BLOCK_K]
        b = tl.load(
            b_base + offs_k[:, None], mask=mask_k[:, None] & mask_n[None, :], other=0.0
        )  # [BLOCK_K, BLOCK_N]
        if INTERPRET:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc += tl.dot(a, b, input_precision=DOT_PRECISION)
    if MUL_WEIGHT:
        weights = tl.load(weights_ptr + pairs, mask=valid, other=0.0).to(tl.float32)
        acc = acc * weights[:, None]
    c = c_ptr + pairs[:, None].to(tl.int64) * num_n + offs_n[None, :]
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & mask_n[None, :])


def align_pairs(
    topk_ids: torch.Tensor,  # [num_tokens, top_k] int64
    num_experts: int,
    block_m: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(sorted_pairs, block_experts, num_padded)`` of the module docstring, sized for the worst
    case (every expert's run padded) so that nothing is read back to the host: ``sorted_pairs``
    [num_pairs + num_experts * (block_m - 1), rounded up to block_m] int32, padding ``num_pairs``;
    ``block_experts`` [len(sorted_pairs) / block_m] int32 (blocks past ``num_padded`` unused);
    ``num_padded`` [1] int32."""
    device = topk_ids.device
    expert_of_pair = topk_ids.reshape(-1)
    num_pairs = expert_of_pair.numel()
    order = torch.argsort(expert_of_pair, stable=True)  # pairs by expert
    # [num_experts]; not bincount, whose output size is read back from the device (a sync,
    # which a CUDA graph cannot hold)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, expert_of_pair, torch.ones_like(expert_of_pair))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)  # [num_experts]
    padded_start = padded_end - padded
    start = torch.cumsum(counts, 0) - counts  # each expert's first row among the sorted pairs
    sorted_experts = expert_of_pair[order]
    rank_in_expert = torch.arange(num_pairs, device=device) - start[sorted_experts]
    max_padded = -(-(num_pairs + num_experts * (block_m - 1)) // block_m) * block_m
    sorted_pairs = torch.full((max_padded,), num_pairs, dtype=torch.int32, device=device)
    sorted_pairs[padded_start[sorted_experts] + rank_in_expert] = order.to(torch.int32)
    block_starts = torch.arange(0, max_padded, block_m, device=device)
    block_experts = torch.searchsorted(padded_end, block_starts, right=True)
    block_experts = block_experts.clamp_(max=num_experts - 1).to(torch.int32)
    num_padded = padded_end[-1:].to(torch.int32)
    return sorted_pairs, block_experts, num_padded


def _block_m(num_pairs: int) -> int:
    """Rows per block: small for decode steps (few pairs per expert), larger for prompts."""
    return 16 if num_pairs <= 256 or _INTERPRETED else 64


def _launch(
    a: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor,
    weights: torch.Tensor,
    aligned: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    rows_per_a_row: int,
    mul_weight: bool,
    block_m: int,
) -> None:
    sorted_pairs, block_experts, num_padded = aligned
    num_n, num_k = b.shape[1], b.shape[2]
    block_n = 32 if _INTERPRETED else 64  # the interpreter: small tiles, partial ones tested
    block_k = 32 if _INTERPRETED else 64
    grid = (block_experts.numel(), triton.cdiv(num_n, block_n))
    _moe_matmul_kernel[grid](
        a, b, out, weights, sorted_pairs, block_experts, num_padded,
        out.shape[0], num_n, num_k, a.stride(0), b.stride(0), b.stride(1),
        A_ROWS_PER_ROW=rows_per_a_row,
        MUL_WEIGHT=mul_weight,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )  # fmt: skip


def triton_moe_experts(
    hidden: torch.Tensor,  # [num_tokens, hidden]
    w_gate_up: torch.Tensor,  # [num_experts, 2 * intermediate, hidden]
    w_down: torch.Tensor,  # [num_experts, hidden, intermediate]
    topk_weights: torch.Tensor,  # [num_tokens, top_k]
    topk_ids: torch.Tensor,  # [num_tokens, top_k] int64
) -> torch.Tensor:
    """``moe_experts`` of ``kernels/torch_moe.py`` with the Triton product: ``[num_tokens,
    hidden]`` in hidden's dtype. Raises ValueError for inputs that do not fit together."""
    check_moe_inputs(hidden, w_gate_up, w_down, topk_weights, topk_ids)
    if w_gate_up.stride(2) != 1 or w_down.stride(2) != 1:
        raise ValueError("moe: expert weights must be contiguous along their input features")
    num_tokens, top_k = topk_ids.shape
    num_pairs = num_tokens * top_k
    intermediate = w_down.shape[2]
    hidden = hidden.contiguous()
    block_m = _block_m(num_pairs)
    aligned = align_pairs(topk_ids, w_down.shape[0], block_m)
    weights = topk_weights.reshape(-1).contiguous()
    gate_up = hidden.new_empty(num_pairs, 2 * intermediate)
    _launch(hidden, w_gate_up, gate_up, weights, aligned, top_k, False, block_m)
    activated = F.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]  # contiguous
    down = hidden.new_empty(num_pairs, hidden.shape[1])
    _launch(activated, w_down, down, weights, aligned, 1, True, block_m)
    return down.view(num_tokens, top_k, hidden.shape[1]).sum(dim=1)
