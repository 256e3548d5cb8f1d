"""The mixture-of-experts ops: routing, the grouped PyTorch op ``splitfuse::moe_experts`` against a
per-token loop in float64, and the Triton fused-MoE kernel against the PyTorch op (under the
interpreter on CPU, compiled on CUDA when TRITON_INTERPRET is not "1"; small shapes there).

Tolerances: float32 operands round as float32 products do (relative 1e-5 of the output's scale);
bfloat16 (CUDA only) rounds operands and the intermediate to 8 bits (2e-2).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from kernels.torch_moe import moe_experts, route_topk

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
TRITON_DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
RTOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _experts(num_experts: int, hidden: int, intermediate: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    w_gate_up = torch.randn(num_experts, 2 * intermediate, hidden, generator=generator)
    w_down = torch.randn(num_experts, hidden, intermediate, generator=generator)
    return w_gate_up / hidden**0.5, w_down / intermediate**0.5


def _per_token(hidden, w_gate_up, w_down, topk_weights, topk_ids) -> torch.Tensor:
    """The definition, one token and one expert at a time, in float64."""
    intermediate = w_down.shape[2]
    out = torch.zeros(hidden.shape, dtype=torch.float64)
    for token in range(hidden.shape[0]):
        for weight, expert in zip(topk_weights[token], topk_ids[token], strict=True):
            gate_up = w_gate_up[expert].double() @ hidden[token].double()
            activated = F.silu(gate_up[:intermediate]) * gate_up[intermediate:]
            out[token] += float(weight) * (w_down[expert].double() @ activated)
    return out


def test_routing_picks_the_top_k_and_renormalizes_when_asked() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0], [3.0, 3.0, 0.0, 0.0]])
    weights, ids = route_topk(logits, 2, renormalize=False)
    probs = torch.softmax(logits, dim=-1)
    assert ids[0].tolist() == [1, 2] and set(ids[1].tolist()) == {0, 1}
    torch.testing.assert_close(weights[0], probs[0, [1, 2]])
    weights, _ = route_topk(logits, 2, renormalize=True)
    torch.testing.assert_close(weights.sum(dim=-1), torch.ones(2))
    torch.testing.assert_close(weights[1], torch.tensor([0.5, 0.5]))


@pytest.mark.parametrize("num_tokens", [1, 5, 33])
def test_grouped_experts_equal_the_per_token_definition(num_tokens) -> None:
    num_experts, hidden, intermediate, top_k = 6, 16, 24, 2
    w_gate_up, w_down = _experts(num_experts, hidden, intermediate, seed=num_tokens)
    x = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(1))
    router = torch.randn(num_tokens, num_experts, generator=torch.Generator().manual_seed(2))
    topk_weights, topk_ids = route_topk(router, top_k, renormalize=True)
    got = moe_experts(x, w_gate_up, w_down, topk_weights, topk_ids)
    want = _per_token(x, w_gate_up, w_down, topk_weights, topk_ids)
    assert got.shape == x.shape and got.dtype == x.dtype
    assert (got.double() - want).abs().max() <= RTOL[torch.float32] * want.abs().max()


def test_no_tokens_give_an_empty_output() -> None:
    w_gate_up, w_down = _experts(4, 8, 8, seed=0)
    empty_ids = torch.empty(0, 2, dtype=torch.int64)
    out = moe_experts(torch.empty(0, 8), w_gate_up, w_down, torch.empty(0, 2), empty_ids)
    assert out.shape == (0, 8)


def test_inputs_that_do_not_fit_are_refused() -> None:
    w_gate_up, w_down = _experts(4, 8, 6, seed=0)
    x, weights, ids = torch.randn(3, 8), torch.rand(3, 2), torch.zeros(3, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match="does not fit experts of hidden size 8"):
        moe_experts(torch.randn(3, 9), w_gate_up, w_down, weights, ids)
    with pytest.raises(ValueError, match="does not match w_down"):
        moe_experts(x, w_gate_up[:, :10], w_down, weights, ids)
    with pytest.raises(ValueError, match="int64 topk_ids"):
        moe_experts(x, w_gate_up, w_down, weights, ids.int())


def test_pairs_are_aligned_to_whole_blocks_per_expert() -> None:
    pytest.importorskip("triton")
    from kernels.triton_moe import align_pairs

    # the module docstring's example: experts of pairs 0..5 [2, 0, 0, 1, 2, 1], BLOCK_M 4
    topk_ids = torch.tensor([[2, 0], [0, 1], [2, 1]])
    sorted_pairs, block_experts, num_padded = align_pairs(topk_ids, 3, 4)
    assert int(num_padded) == 12
    assert sorted_pairs[:12].tolist() == [1, 2, 6, 6, 3, 5, 6, 6, 0, 4, 6, 6]
    assert block_experts[:3].tolist() == [0, 1, 2]
    assert (sorted_pairs[12:] == 6).all()


@pytest.mark.parametrize(
    "dtype", [torch.float32] + ([torch.bfloat16] if TRITON_DEVICE == "cuda" else [])
)
@pytest.mark.parametrize("num_tokens,top_k", [(1, 2), (9, 2), (6, 3)])
def test_triton_fused_moe_equals_the_torch_op(dtype, num_tokens, top_k) -> None:
    pytest.importorskip("triton")
    if TRITON_DEVICE == "cpu" and not INTERPRET:
        pytest.skip("Triton needs CUDA or TRITON_INTERPRET=1")
    from kernels.triton_moe import triton_moe_experts

    # hidden 40 and intermediate 24: partial tiles of both products' columns and inner dimension
    num_experts, hidden, intermediate = 5, 40, 24
    w_gate_up, w_down = _experts(num_experts, hidden, intermediate, seed=top_k)
    x = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(num_tokens))
    router = torch.randn(num_tokens, num_experts, generator=torch.Generator().manual_seed(3))
    topk_weights, topk_ids = route_topk(router, top_k, renormalize=False)
    on = dict(device=TRITON_DEVICE, dtype=dtype)
    got = triton_moe_experts(
        x.to(**on),
        w_gate_up.to(**on),
        w_down.to(**on),
        topk_weights.to(**on),
        topk_ids.to(TRITON_DEVICE),
    )
    want = _per_token(x, w_gate_up, w_down, topk_weights, topk_ids)
    assert got.dtype == dtype and got.shape == (num_tokens, hidden)
    assert (got.cpu().double() - want).abs().max() <= RTOL[dtype] * want.abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_experts_equal_the_per_token_definition(dtype) -> None:
    """The CPU path on oneDNN-packed weights (``engine/moe_packed.py``), where this CPU packs
    the dtype."""
    from engine.moe_packed import PackedExperts, can_pack_experts

    w_gate_up, w_down = _experts(4, 32, 48, seed=9)
    w_gate_up, w_down = w_gate_up.to(dtype), w_down.to(dtype)
    if not can_pack_experts(w_gate_up):
        pytest.skip(f"this CPU does not pack {dtype} weights")
    x = torch.randn(7, 32, generator=torch.Generator().manual_seed(4)).to(dtype)
    router = torch.randn(7, 4, generator=torch.Generator().manual_seed(5))
    topk_weights, topk_ids = route_topk(router, 2, renormalize=True)
    got = torch.ops.splitfuse.packed_moe_experts(
        x, PackedExperts(w_gate_up, w_down), topk_weights.to(dtype), topk_ids
    )
    want = _per_token(x, w_gate_up, w_down, topk_weights, topk_ids)
    assert got.dtype == dtype and got.shape == x.shape
    assert (got.double() - want).abs().max() <= RTOL[dtype] * want.abs().max()
