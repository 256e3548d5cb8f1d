"""``splitfuse_cpu::blocked_linear``: bfloat16 rows times a weight in oneDNN's blocked layout for
AVX-512 BF16 ([N / 64, K / 2, 64, 2]), read in place from the packed weight
(``engine/packed_linear.py``).

Tolerance: VDPBF16PS multiplies bfloat16 pairs exactly and sums in float32, and the result is
rounded once to bfloat16; against a float64 reference, the difference is at most one bfloat16
step of the result (relative 2^-8) plus the float32 rounding of the sums (K products of
magnitude <= ~16 here: well under 1e-4)."""

from __future__ import annotations

import pytest
import torch

from engine.device import cpu_flags
from engine.layers import ColumnParallelLinear
from engine.packed_linear import PackedWeight, can_pack, packed_linear
from kernels.cpu_ops import has_blocked_linear

pytestmark = pytest.mark.skipif(
    not has_blocked_linear() or not can_pack(torch.empty(2, 2, dtype=torch.bfloat16)),
    reason="needs AVX-512 BF16, oneDNN and the C++ operators",
)


def _blocked(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] in the kernel's layout [N / 64, K / 2, 64, 2]."""
    out_features, in_features = weight.shape
    blocks = weight.view(out_features // 64, 64, in_features // 2, 2)
    return blocks.transpose(1, 2).contiguous()


def _reference(x, weight, bias=None) -> torch.Tensor:
    out = x.double() @ weight.double().T
    return out if bias is None else out + bias.double()


def _assert_one_bf16_step(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert got.dtype == torch.bfloat16
    difference = (got.double() - expected).abs()
    bound = expected.abs() * 2.0**-8 + 1e-4
    assert bool((difference <= bound).all()), float((difference - bound).max())


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("num_rows", [1, 3, 7, 64, 300])
@pytest.mark.parametrize("shape", [(64, 70), (192, 576), (576, 1536)])  # (N, K); K / 2 odd first
def test_matches_a_float64_reference(shape, num_rows, bias) -> None:
    out_features, in_features = shape
    generator = torch.Generator().manual_seed(num_rows * 7 + in_features)
    weight = torch.randn(shape, generator=generator).bfloat16()
    x = torch.randn(num_rows, in_features, generator=generator).bfloat16()
    b = torch.randn(out_features, generator=generator).bfloat16() if bias else None
    got = torch.ops.splitfuse_cpu.blocked_linear(x, _blocked(weight), b)
    assert got.shape == (num_rows, out_features)
    _assert_one_bf16_step(got, _reference(x, weight, b))


def test_a_rows_result_does_not_depend_on_the_others() -> None:
    """Each row's sums run in one order whatever the row count (tiles of 1 to 6 rows alike; with
    AMX, more than 4 rows on the tiles, whose TDPBF16PS adds a pair's products as VDPBF16PS
    does: the same bits)."""
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(192, 576, generator=generator).bfloat16()
    blocked = _blocked(weight)
    x = torch.randn(100, 576, generator=generator).bfloat16()
    full = torch.ops.splitfuse_cpu.blocked_linear(x, blocked, None)
    for num_rows in (1, 2, 5, 6, 7, 13, 64):
        rows = torch.randperm(100, generator=generator)[:num_rows]
        alone = torch.ops.splitfuse_cpu.blocked_linear(x[rows], blocked, None)
        assert torch.equal(alone, full[rows])


@pytest.mark.parametrize("num_rows", [3, 37])  # with AMX: VDPBF16PS, then the tiles
@pytest.mark.parametrize("out_features", [64, 576, 960])  # 1, 9 and 15 blocks
def test_the_result_does_not_depend_on_the_threads(out_features, num_rows) -> None:
    """Threads share the blocks; a column's sum is the same whichever thread computes it."""
    generator = torch.Generator().manual_seed(out_features)
    weight = torch.randn(out_features, 576, generator=generator).bfloat16()
    bias = torch.randn(out_features, generator=generator).bfloat16()
    x = torch.randn(num_rows, 576, generator=generator).bfloat16()
    threads = torch.get_num_threads()
    results = []
    try:
        for num_threads in (1, 2, 3):
            torch.set_num_threads(num_threads)
            results.append(torch.ops.splitfuse_cpu.blocked_linear(x, _blocked(weight), bias))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(result, results[0]) for result in results[1:])
    _assert_one_bf16_step(results[0], _reference(x, weight, bias))


def test_packed_weights_are_read_in_place() -> None:
    weight = torch.randn(192, 576).bfloat16()
    packed = PackedWeight(weight)
    if packed.blocked is None:
        pytest.skip("oneDNN packs bfloat16 weights in another layout on this CPU")
    assert packed.blocked.data_ptr() == torch.ops.mkldnn.data_ptr(packed.packed)  # no copy
    assert torch.equal(packed.blocked, _blocked(weight))
    if packed.tiles:  # AMX: the kernel for every row count (more than 4 on the tiles)
        for num_rows in (1, 4, 5, 300):
            x = torch.randn(num_rows, 576).bfloat16()
            expected = torch.ops.splitfuse_cpu.blocked_linear(x, packed.blocked, None)
            assert torch.equal(packed_linear(x, packed, 192, None), expected)
        return
    for num_rows in (1, 4, packed.blocked_rows):  # few rows: the kernel; more: oneDNN
        x = torch.randn(num_rows, 576).bfloat16()
        expected = torch.ops.splitfuse_cpu.blocked_linear(x, packed.blocked, None)
        assert torch.equal(packed_linear(x, packed, 192, None), expected)
    x = torch.randn(packed.blocked_rows + 1, 576).bfloat16()
    expected = torch.ops.mkldnn._linear_pointwise(x, packed.packed, None, "none", [], "")
    assert torch.equal(packed_linear(x, packed, 192, None), expected)


def test_weights_it_cannot_read_keep_onednn() -> None:
    assert PackedWeight(torch.randn(48, 576).bfloat16()).blocked is None  # N not a multiple of 64
    assert PackedWeight(torch.randn(64, 576)).blocked is None  # float32
    # a buffer that does not hold the weight in the kernel's layout is never read
    from engine.packed_linear import _blocked_view

    weight = torch.randn(64, 576).bfloat16()
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
    assert _blocked_view(packed, weight + 1) is None


def test_deterministic_layers_run_one_kernel_for_every_row_count() -> None:
    layer = ColumnParallelLinear(576, [64, 64], bias=False, dtype=torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(layer.weight.shape))
    layer.pack_weights()
    packed = layer.packed_weight
    assert packed is not None
    reads_it = packed.blocked is not None and "amx_bf16" not in cpu_flags()
    layer.set_deterministic()
    if reads_it:  # the kernel, for any row count
        x = torch.randn(300, 576).bfloat16()
        expected = torch.ops.splitfuse_cpu.blocked_linear(x, packed.blocked, None)
        assert torch.equal(layer(x), expected)
    else:  # oneDNN alone
        assert packed.blocked is None


@pytest.mark.parametrize(
    "case",
    ["float32 rows", "strided rows", "weight dims", "weight K", "bias size", "bias dtype"],
)
def test_bad_inputs_are_refused(case) -> None:
    weight = _blocked(torch.randn(64, 32).bfloat16())
    x = torch.randn(3, 32).bfloat16()
    bias = None
    if case == "float32 rows":
        x = x.float()
    elif case == "strided rows":
        x = torch.randn(3, 64).bfloat16()[:, ::2]
    elif case == "weight dims":
        weight = weight.view(-1, 64, 2)
    elif case == "weight K":
        x = torch.randn(3, 34).bfloat16()
    elif case == "bias size":
        bias = torch.zeros(32).bfloat16()
    else:
        bias = torch.zeros(64)
    with pytest.raises(RuntimeError, match="blocked_linear"):
        torch.ops.splitfuse_cpu.blocked_linear(x, weight, bias)


def test_layers_use_it_and_stay_within_a_step_of_f_linear() -> None:
    layer = ColumnParallelLinear(576, [64, 128], bias=True, dtype=torch.bfloat16)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(layer.weight.shape, generator=generator))
        layer.bias.copy_(torch.randn(layer.bias.shape, generator=generator))
    x = torch.randn(2, 576, generator=generator).bfloat16()
    expected = _reference(x, layer.weight, layer.bias)
    layer.pack_weights()
    if layer.packed_weight.blocked is None:
        pytest.skip("oneDNN packs bfloat16 weights in another layout on this CPU")
    _assert_one_bf16_step(layer(x), expected)


@pytest.mark.parametrize("num_rows", [1, 4, 5, 37, 300])  # with AMX: VDPBF16PS, then the tiles
@pytest.mark.parametrize("shape", [(64, 70), (128, 576), (1536, 576)])  # (intermediate, K)
def test_silu_mul_gives_the_product_then_silu_mul_rows(shape, num_rows) -> None:
    """``blocked_silu_mul``: SwiGLU's activation of the gate-and-up product in one call, the
    same bits as ``blocked_linear`` then ``silu_mul_rows``."""
    intermediate, in_features = shape
    generator = torch.Generator().manual_seed(num_rows + intermediate)
    weight = (torch.randn(2 * intermediate, in_features, generator=generator) * 0.1).bfloat16()
    x = torch.randn(num_rows, in_features, generator=generator).bfloat16()
    blocked = _blocked(weight)
    product = torch.ops.splitfuse_cpu.blocked_linear(x, blocked, None)
    expected = torch.ops.splitfuse_cpu.silu_mul_rows(product)
    got = torch.ops.splitfuse_cpu.blocked_silu_mul(x, blocked, intermediate)
    assert got.shape == (num_rows, intermediate)
    assert torch.equal(got, expected)


def test_gate_up_layers_use_the_fused_product_on_amx_tiles() -> None:
    layer = ColumnParallelLinear(576, [128, 128], bias=False, dtype=torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(layer.weight.shape) * 0.1)
    layer.pack_weights()
    x = torch.randn(40, 576).bfloat16()
    act = layer.silu_mul_product(x, row_ops=False)
    if not layer.blocked_tiles:  # no AMX, or another layout: the product and SiLU apart
        assert act is None
        return
    assert act is not None
    assert torch.equal(act, torch.ops.splitfuse_cpu.silu_mul_rows(layer(x)))
    layer.set_deterministic()  # oneDNN alone there: no fused call
    assert layer.silu_mul_product(x, row_ops=False) is None


@pytest.mark.parametrize("case", ["float32 rows", "weight shape", "intermediate"])
def test_silu_mul_refuses_bad_inputs(case) -> None:
    weight = _blocked(torch.randn(128, 64).bfloat16())
    x = torch.randn(3, 64).bfloat16()
    intermediate = 64
    if case == "float32 rows":
        x = x.float()
    elif case == "weight shape":
        weight = _blocked(torch.randn(256, 64).bfloat16())
    else:
        intermediate = 32
    with pytest.raises(RuntimeError, match="blocked_silu_mul"):
        torch.ops.splitfuse_cpu.blocked_silu_mul(x, weight, intermediate)
