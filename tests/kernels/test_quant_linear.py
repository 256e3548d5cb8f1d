"""Weight-only quantization: the layouts against float references, the C++ products against
PyTorch references (every instruction set the machine runs, row counts 1, 7, 64, 300), and GGUF
blocks decoded as the ``gguf`` package decodes them.

8 bits (``quant_linear``): the weight is exactly the dequantized one and only the order of the
float32 sums differs from ``F.linear`` in float64, so the error is float32 rounding: relative 1e-5
of the largest output.

4 bits (``int4_linear``): x is rounded to int8 in runs of 32 first. Against the reference that
rounds it the same way (``int4_linear_reference``) the error is float32 rounding again (1e-5).
Against ``F.linear`` on x itself, each x value is off by at most half its run's step d, so an
output is off by at most sum_k |w[n, k]| d[m, run(k)] / 2 (plus the float32 rounding): the bound
the products are held to. 8 bits packed as ``PackedInt8`` (``int8_linear``, a 4-bit model's LM
head) round x the same way and are held to the same bounds.

On a CPU with AMX tiles, the rows of a step's prompt tokens (``int4_tile_rows``) multiply x
rounded to bfloat16 by the weight's values rounded to bfloat16 in float32 sums
(``int4_tiles_reference``; 1e-5 again), each within 2^-8 of its exact value: an output is then
off by at most 2^-7 sum_k |x[m, k] w[n, k]| from ``F.linear`` on x (both roundings, plus float32
sums).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from engine.device import cpu_flags
from engine.gguf_quantized import decode_blocks
from engine.quantization import (
    PackedInt4,
    PackedInt8,
    QuantizedTensor,
    dequantize_groups,
    int4_linear_reference,
    int4_tiles_reference,
    pack_4bit,
    quantize,
    quantize_activations,
    unpack_4bit,
)
from kernels.cpu_ops import has_int4_tiles, int4_tile_rows, load

LAYOUTS = [(4, 32), (4, 64), (4, 128), (8, 32), (8, 128), (8, None)]


def test_packing_puts_value_j_and_j_plus_16_of_a_run_in_one_byte():
    q = torch.arange(64).remainder(16).reshape(1, 64)  # two runs of 0..15, 0..15
    packed = pack_4bit(q)
    assert packed.shape == (1, 32)
    assert packed[0, 0].item() == 0 | (0 << 4) and packed[0, 1].item() == 1 | (1 << 4)
    q = torch.randint(0, 16, (5, 96))
    assert torch.equal(unpack_4bit(pack_4bit(q)), q.to(torch.uint8))


@pytest.mark.parametrize("bits,group_size", LAYOUTS)
def test_quantize_then_dequantize_is_within_half_a_step_of_the_float_weight(bits, group_size):
    torch.manual_seed(bits)
    weight = torch.randn(12, 256) * torch.logspace(-3, 1, 12)[:, None]  # rows of any scale
    quantized = quantize(weight, bits, group_size or 256)
    size = group_size or 256
    restored = quantized.dequantize()
    step = quantized.scales.float().repeat_interleave(size, dim=1)
    # half a step from rounding, plus the float16 rounding of the min (4 bits) and scale
    slack = 1e-3 * weight.abs().reshape(12, -1, size).amax(2).repeat_interleave(size, dim=1)
    assert ((restored - weight).abs() <= step / 2 + slack).all()
    # Quantizing what dequantizing gave back is exact: the layout holds those numbers.
    again = quantize(restored, bits, size)
    assert torch.equal(again.dequantize(), restored)


def test_a_quantized_tensor_is_sharded_by_rows_and_by_whole_groups_of_columns():
    quantized = quantize(torch.randn(8, 128), 4, 32)
    full = quantized.dequantize()
    assert torch.equal(quantized[2:5].dequantize(), full[2:5])
    assert torch.equal(quantized[:, 64:128].dequantize(), full[:, 64:128])
    with pytest.raises(ValueError, match="cut a group of 32"):
        quantized[:, 16:80]
    holder = QuantizedTensor.empty(8, 128, 4, 32)
    holder[4:8].copy_(quantized[0:4])
    assert torch.equal(holder.dequantize()[4:8], full[0:4])


def product(x: torch.Tensor, quantized: QuantizedTensor, packed8: bool = False) -> torch.Tensor:
    """The C++ product the engine runs for this weight (``packed8``: an 8-bit weight packed as
    a 4-bit model's LM head)."""
    if packed8:
        packed8_weight = PackedInt8.pack(quantized)
        return torch.ops.splitfuse_cpu.int8_linear(
            x,
            packed8_weight.packed,
            packed8_weight.scales,
            packed8_weight.out_features,
            packed8_weight.group_size,
        )
    if quantized.bits == 8:
        return torch.ops.splitfuse_cpu.quant_linear(
            x, quantized.qweight, quantized.scales, quantized.group_size
        )
    packed = PackedInt4.pack(quantized)
    return torch.ops.splitfuse_cpu.int4_linear(
        x, packed.packed, packed.scales, packed.mins, packed.out_features, packed.group_size
    )


def assert_int4_product(got: torch.Tensor, x: torch.Tensor, quantized: QuantizedTensor) -> None:
    """``int4_linear``'s (or ``int8_linear``'s) result against its reference and against x."""
    packed = (PackedInt4 if quantized.bits == 4 else PackedInt8).pack(quantized)
    want = int4_linear_reference(x, packed).double()
    assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()
    # against x itself: each value off by at most half its run's step
    _, step = quantize_activations(x)
    weight = quantized.dequantize().double()
    half_steps = step.double().repeat_interleave(32, dim=1) / 2  # [M, K]
    bound = half_steps @ weight.abs().t()
    exact = F.linear(x.double(), weight)
    assert ((got.double() - exact).abs() <= bound + 1e-5 * exact.abs().max()).all()


@pytest.mark.parametrize("bits,group_size", LAYOUTS)
@pytest.mark.parametrize("num_rows", [1, 7, 64, 300])
def test_the_product_equals_linear_on_the_dequantized_weight(bits, group_size, num_rows):
    load()
    torch.manual_seed(num_rows)
    num_out, num_in = 45, 256  # 45: a last tile of one output column, a last block of 13
    quantized = quantize(torch.randn(num_out, num_in), bits, group_size or num_in)
    x = torch.randn(num_rows, num_in)
    got = product(x, quantized)
    assert got.dtype == torch.float32 and got.shape == (num_rows, num_out)
    if bits == 4:
        assert_int4_product(got, x, quantized)
        return
    want = F.linear(x.double(), quantized.dequantize().double())
    assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()


@pytest.mark.parametrize("group_size", [32, 64, 96, None])
@pytest.mark.parametrize("num_rows", [1, 2, 7, 64, 300])
def test_8bit_weights_packed_for_dot_products_multiply_rows_rounded_to_int8(group_size, num_rows):
    """``int8_linear``: float32 and bfloat16 rows (their float32 values, exact), large x too,
    groups of one to three runs and one per output channel; 45 outputs: a last block of 13."""
    load()
    torch.manual_seed(num_rows + (group_size or 0))
    num_in = 192
    quantized = quantize(torch.randn(45, num_in) * 0.1, 8, group_size or num_in)
    for scale in (1.0, 1e3):
        x = torch.randn(num_rows, num_in) * scale
        for rows in (x, x.bfloat16()):
            got = product(rows, quantized, packed8=True)
            assert got.dtype == torch.float32 and got.shape == (num_rows, 45)
            assert_int4_product(got, rows.float(), quantized)


def test_a_row_of_the_packed_8bit_product_does_not_depend_on_the_others():
    """The same row alone, among 7 and among 300 gives the same bits (the column blocks' sums
    run in one order whatever the row count)."""
    load()
    quantized = quantize(torch.randn(70, 128), 8, 32)
    x = torch.randn(300, 128)
    alone = product(x[5:6], quantized, packed8=True)
    assert torch.equal(product(x[:7], quantized, packed8=True)[5:6], alone)
    assert torch.equal(product(x, quantized, packed8=True)[5:6], alone)


def test_packing_8bit_weights_for_dot_products_keeps_their_numbers():
    for num_rows, num_cols, group_size in [(45, 256, 32), (16, 64, 64), (3, 96, 96)]:
        quantized = quantize(torch.randn(num_rows, num_cols), 8, group_size)
        packed = PackedInt8.pack(quantized)
        blocks = -(-num_rows // 16)
        assert packed.packed.shape == (blocks, num_cols * 16)
        assert packed.scales.shape == (blocks, num_cols // group_size, 16)
        assert packed.shape == quantized.shape
        back = packed.unpack()
        assert torch.equal(back.qweight, quantized.qweight)
        assert torch.equal(back.scales, quantized.scales)
        ids = torch.tensor([0, num_rows - 1, num_rows // 2, 0])
        assert torch.equal(packed.dequantize_rows(ids), quantized.dequantize_rows(ids))
    # step s, column c: values 4 s + 0..3, each as q + 128
    q = (torch.arange(16)[:, None] * 3 - torch.arange(32)[None, :] * 5).clamp(-127, 127)
    quantized = QuantizedTensor(q.to(torch.int8), torch.ones(16, 1).half(), None, 8, 32)
    step = PackedInt8.pack(quantized).packed[0, 128:192].reshape(16, 4)  # step 2
    assert torch.equal(step.long(), q[:, 8:12] + 128)


@pytest.mark.parametrize("num_rows", [1, 7, 64])
def test_bfloat16_rows_multiply_the_bfloat16_rounded_weight_or_the_exact_one(num_rows):
    """8 bits. One row: the exact weight in float32. More rows where the CPU multiplies bfloat16
    in hardware: the weight rounded to bfloat16, as a bfloat16 copy of the float weight holds it;
    elsewhere the exact weight."""
    kind = load()
    torch.manual_seed(num_rows)
    quantized = quantize(torch.randn(45, 256), 8, 32)
    x = torch.randn(num_rows, 256).bfloat16()
    got = product(x, quantized)
    weight = quantized.dequantize()
    if kind == "avx512_bf16" and num_rows > 1:
        weight = weight.bfloat16()
    want = F.linear(x.double(), weight.double())
    assert got.dtype == torch.float32
    assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()


@pytest.mark.parametrize(
    "num_in,group_size",
    [(576, 32), (160, 32), (32, 32), (256, 64), (192, 96), (384, 128)],
)
@pytest.mark.parametrize("num_rows", [1, 5])
def test_4bit_products_of_bfloat16_rows_and_any_group_size(num_in, group_size, num_rows):
    """bfloat16 rows are rounded as their float32 values (exact) are. Groups of one to four runs
    of 32, one that is not a power of two (96), a single run (32); large x too (1e3)."""
    load()
    torch.manual_seed(num_in + group_size)
    quantized = quantize(torch.randn(45, num_in) * 0.1, 4, group_size)
    for scale in (1.0, 1e3):
        x = (torch.randn(num_rows, num_in) * scale).bfloat16()
        assert_int4_product(product(x, quantized), x.float(), quantized)


def assert_tiles_product(got: torch.Tensor, x: torch.Tensor, packed: PackedInt4) -> None:
    """``int4_linear``'s prompt rows on AMX tiles against their reference and against x (module
    docstring)."""
    want = int4_tiles_reference(x, packed).double()
    assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()
    weight = packed.unpack().dequantize().double()
    exact = F.linear(x.double(), weight)
    bound = F.linear(x.double().abs(), weight.abs()) * 2**-7
    assert ((got.double() - exact).abs() <= bound + 1e-5 * exact.abs().max()).all()


@pytest.mark.parametrize("group_size", [32, 64, 96, 128])
def test_prompt_rows_multiply_on_amx_tiles_each_row_on_its_own(group_size):
    """Rows from ``int4_tile_rows``' row on go on the tiles, the rows before it as without it:
    bfloat16 and float32 rows, 45 outputs (three column blocks: a pair and one alone, the last
    of 13 columns), calls at 16- and 32-row tile edges and past them. A row's result is the
    same bits whatever the call's rows and wherever the prompt rows start."""
    if not has_int4_tiles():
        pytest.skip("no AMX tiles here (or SPLITFUSE_CPU_ISA asks for narrower instructions)")
    torch.manual_seed(group_size)
    num_in = 384
    quantized = quantize(torch.randn(45, num_in) * 0.1, 4, group_size)
    packed = PackedInt4.pack(quantized)
    x = torch.randn(300, num_in) * 3
    for dtype in (torch.bfloat16, torch.float32):
        rows = x.to(dtype)
        integer = product(rows, quantized)
        with int4_tile_rows(0):
            tiled = product(rows, quantized)
            alone = [product(rows[m : m + 1], quantized)[0] for m in (0, 17, 299)]
        assert_tiles_product(tiled, rows.float(), packed)
        assert all(torch.equal(a, tiled[m]) for a, m in zip(alone, (0, 17, 299), strict=True))
        for num_rows, first in ((1, 0), (16, 3), (33, 32), (47, 5), (64, 64), (65, 1), (300, 100)):
            with int4_tile_rows(first):
                got = product(rows[:num_rows], quantized)
            assert got.shape == (num_rows, 45)
            assert torch.equal(got[:first], integer[:first])
            assert torch.equal(got[first:], tiled[first:num_rows])


def test_tile_rows_apply_inside_their_block_and_to_its_thread_only():
    torch.manual_seed(0)
    quantized = quantize(torch.randn(20, 64) * 0.1, 4, 32)
    x = torch.randn(8, 64)
    integer = product(x, quantized)
    with int4_tile_rows(None):
        assert torch.equal(product(x, quantized), integer)
    with int4_tile_rows(4):
        inside = product(x, quantized)
        with int4_tile_rows(None):  # None changes nothing: the setting around it holds
            assert torch.equal(product(x, quantized), inside)
        with int4_tile_rows(6):
            assert torch.equal(product(x, quantized)[:6], integer[:6])
        assert torch.equal(product(x, quantized), inside)
        other: list[torch.Tensor] = []
        thread = threading.Thread(target=lambda: other.append(product(x, quantized)))
        thread.start()
        thread.join()
        assert torch.equal(other[0], integer)
    assert torch.equal(product(x, quantized), integer)
    assert torch.equal(inside[:4], integer[:4])
    assert torch.equal(inside[4:], integer[4:]) != has_int4_tiles()


def test_packing_4bit_weights_for_integer_dot_products_keeps_their_numbers():
    for num_rows, num_cols, group_size in [
        (45, 256, 32),
        (16, 64, 64),
        (3, 96, 96),
        (50, 128, 128),
    ]:
        quantized = quantize(torch.randn(num_rows, num_cols), 4, group_size)
        packed = PackedInt4.pack(quantized)
        blocks = -(-num_rows // 16)
        assert packed.packed.shape == (blocks, num_cols * 8)
        assert packed.scales.shape == (blocks, num_cols // group_size, 16)
        back = packed.unpack()
        assert torch.equal(back.qweight, quantized.qweight)
        assert torch.equal(back.scales, quantized.scales)
        assert torch.equal(back.mins, quantized.mins)
    # step s, column c: values 8 s + 0..3 in the low nibbles, 8 s + 4..7 in the high ones
    q = (torch.arange(16)[:, None] + torch.arange(32)[None, :]).remainder(16)
    packed = PackedInt4.pack(QuantizedTensor(pack_4bit(q), *[torch.ones(16, 1).half()] * 2, 4, 32))
    step = packed.packed[0, 64:128].reshape(16, 4)  # step 1
    assert torch.equal(step & 15, q[:, 8:12].to(torch.uint8))
    assert torch.equal(step >> 4, q[:, 12:16].to(torch.uint8))


def test_activations_round_to_int8_in_runs_of_32():
    x = torch.randn(3, 96) * torch.tensor([1e-3, 1.0, 1e3])[:, None]
    x[1, 32:64] = 0.0  # an all-zero run
    q, step = quantize_activations(x)
    assert q.dtype == torch.int8 and step.shape == (3, 3)
    assert q.abs().max() <= 127 and torch.equal(q[1, 32:64], torch.zeros(32, dtype=torch.int8))
    restored = q.float().reshape(3, 3, 32) * step[:, :, None]
    error = (restored.reshape(3, 96) - x).abs()
    assert (error <= step.repeat_interleave(32, dim=1) / 2 * (1 + 1e-6)).all()
    # the largest value of a run is exactly +-127 steps; ties round to even
    assert (q.reshape(3, 3, 32).abs().amax(dim=2)[step > 0] == 127).all()
    ties = torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5] + [0.0] * 27])
    assert quantize_activations(ties)[0][0, :5].tolist() == [127, 0, 2, 2, 0]


@pytest.mark.parametrize("num_out,num_in,group_size", [(48, 64, 32), (40, 128, 64), (9, 96, 96)])
def test_a_product_rounded_to_x_is_the_float32_result_rounded(num_out, num_in, group_size):
    """``int4_linear(..., round_to_x=True)`` = ``int4_linear(...).to(x.dtype)`` bit for bit:
    float32 and bfloat16 rows, whole and partial column blocks (40 = 2.5, 9 < 1), prompt rows
    on the tiles from any row (where the CPU has them) or none, 100 rows in strips of 32 and a
    partial one; a NaN stays NaN and infinities stay infinite."""
    if load() == "torch":
        pytest.skip("the C++ operators are not built here")
    ops = torch.ops.splitfuse_cpu
    torch.manual_seed(num_out)
    packed = PackedInt4.pack(quantize(torch.randn(num_out, num_in) * 0.1, 4, group_size))
    weight = packed.packed, packed.scales, packed.mins
    for num_rows in (1, 17, 40, 100):
        for dtype in (torch.float32, torch.bfloat16):
            x = (torch.randn(num_rows, num_in) * 2).to(dtype)
            x[num_rows // 2, 3] = float("nan")
            x[0, 5] = float("inf")
            for first in (None, 0, num_rows // 2, num_rows):
                with int4_tile_rows(first):
                    want = ops.int4_linear(x, *weight, num_out, group_size).to(dtype)
                    got = ops.int4_linear(x, *weight, num_out, group_size, True)
                assert got.dtype == dtype
                assert torch.equal(got.isnan(), want.isnan())
                assert torch.equal(got.nan_to_num(), want.nan_to_num())
    if has_int4_tiles():  # ties on the tiles go to the even neighbour: 1 + 3 * 2^-8 -> 1 + 2^-6
        ones = QuantizedTensor(
            pack_4bit(torch.ones(16, 64, dtype=torch.uint8)),
            torch.ones(16, 2, dtype=torch.half),
            torch.zeros(16, 2, dtype=torch.half),
            4,
            32,
        )
        tied = PackedInt4.pack(ones)
        x = torch.zeros(16, 64, dtype=torch.bfloat16)
        x[:, 0], x[:, 1], x[:, 2] = 1.0, 2.0**-7, 2.0**-8
        with int4_tile_rows(0):
            got = ops.int4_linear(x, tied.packed, tied.scales, tied.mins, 16, 32, True)
        assert (got == 1 + 2.0**-6).all()


@pytest.mark.parametrize(
    "intermediate,num_in,group_size", [(48, 64, 32), (80, 128, 64), (16, 96, 96)]
)
def test_the_fused_gate_up_and_silu_give_the_bits_of_the_three_steps(
    intermediate, num_in, group_size
):
    """``int4_silu_mul`` = ``silu_mul_rows(int4_linear(x).to(x.dtype))`` bit for bit: float32
    and bfloat16 rows, pairs of column blocks and one alone (48 = 3 blocks), prompt rows on the
    tiles from any row (where the CPU has them) or none; 100 rows are four strips of the tiles'
    32, the last of 4, each strip's SiLU run beside the next strip's products."""
    if load() == "torch":
        pytest.skip("the C++ operators are not built here")
    ops = torch.ops.splitfuse_cpu
    torch.manual_seed(intermediate)
    packed = PackedInt4.pack(quantize(torch.randn(2 * intermediate, num_in) * 0.1, 4, group_size))
    weight = packed.packed, packed.scales, packed.mins
    for num_rows in (1, 17, 40, 100):
        for dtype in (torch.float32, torch.bfloat16):
            x = (torch.randn(num_rows, num_in) * 2).to(dtype)
            for first in (None, 0, num_rows // 2, num_rows):
                with int4_tile_rows(first):
                    products = ops.int4_linear(x, *weight, 2 * intermediate, group_size)
                    want = ops.silu_mul_rows(products.to(dtype))
                    got = ops.int4_silu_mul(x, *weight, intermediate, group_size)
                assert got.dtype == dtype and torch.equal(got, want)
    x = torch.randn(2, num_in)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        ops.int4_silu_mul(x, *weight, intermediate - 8, group_size)
    with pytest.raises(RuntimeError, match="packed must be"):
        ops.int4_silu_mul(x, *weight, intermediate + 16, group_size)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.int4_silu_mul(x.double(), *weight, intermediate, group_size)


def test_the_products_refuse_what_they_cannot_read():
    load()
    quantized = quantize(torch.randn(8, 64), 8, 32)
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="group_size"):
        torch.ops.splitfuse_cpu.quant_linear(x, quantized.qweight, quantized.scales, 48)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        torch.ops.splitfuse_cpu.quant_linear(x.double(), quantized.qweight, quantized.scales, 32)
    packed = PackedInt4.pack(quantize(torch.randn(8, 64), 4, 32))
    args = packed.packed, packed.scales, packed.mins
    with pytest.raises(RuntimeError, match="8-bit"):
        torch.ops.splitfuse_cpu.quant_linear(x, packed.packed, quantized.scales, 32)
    with pytest.raises(RuntimeError, match="group_size"):
        torch.ops.splitfuse_cpu.int4_linear(x, *args, 8, 48)
    with pytest.raises(RuntimeError, match="packed must be"):
        torch.ops.splitfuse_cpu.int4_linear(x, *args, 17, 32)  # two blocks' worth of columns
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        torch.ops.splitfuse_cpu.int4_linear(x.double(), *args, 8, 32)
    packed8 = PackedInt8.pack(quantized)
    with pytest.raises(RuntimeError, match="packed must be"):  # a 4-bit weight's bytes
        torch.ops.splitfuse_cpu.int8_linear(x, packed.packed, packed8.scales, 8, 32)
    with pytest.raises(RuntimeError, match="scales"):
        torch.ops.splitfuse_cpu.int8_linear(x, packed8.packed, packed.scales[:, :1], 8, 32)
    with pytest.raises(RuntimeError, match="group_size"):
        torch.ops.splitfuse_cpu.int8_linear(x, packed8.packed, packed8.scales, 8, 48)


_NARROWER_CHECK = """
import torch, torch.nn.functional as F
from engine.quantization import quantize
from kernels.cpu_ops import has_int4_tiles, int4_tile_rows, load
from tests.kernels.test_quant_linear import assert_int4_product, integer_dot_digest, product
kind = load()
for bits, size in [(4, 32), (4, 64), (8, 64), (8, 128)]:
    for rows in (1, 3, 7, 64):
        q = quantize(torch.randn(37, 128), bits, size)
        x = torch.randn(rows, 128)
        got = product(x, q)
        if bits == 4:
            assert_int4_product(got, x, q)
            continue
        assert_int4_product(product(x, q, packed8=True), x, q)
        want = F.linear(x.double(), q.dequantize().double())
        assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max(), (bits, size, rows)
print(kind, torch.ops.splitfuse_cpu.int4_instruction_set(), integer_dot_digest())
"""


def integer_dot_digest() -> str:
    """A digest of ``int4_linear``'s and ``int8_linear``'s outputs on fixed inputs: their int32
    sums are exact and the float arithmetic after them the same, so every instruction set with
    FMA gives the same bits."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(37, 192, generator=generator)
    # the largest sums a run can hold: every x value +-127 after rounding, every 4-bit value 15
    # and every 8-bit one +-127 (the int16 sums of the instruction sets without VNNI)
    extreme_x = torch.ones(5, 192)
    extreme_x[1::2] = -1.0
    extreme_w = torch.ones(45, 192)
    extreme_w[:, ::64] = 0.0  # each group's least value, so that the others are its largest
    extreme_w[::2] *= -1.0
    outputs = []
    for bits in (4, 8):
        quantized = quantize(torch.randn(45, 192, generator=generator), bits, 64)
        for rows in (1, 2, 5, 37):
            outputs.append(product(x[:rows], quantized, packed8=bits == 8))
        extreme = quantize(extreme_w, bits, 64)
        for rows in (1, 2, 5):
            outputs.append(product(extreme_x[:rows], extreme, packed8=bits == 8))
    return hashlib.sha256(torch.cat([o.flatten() for o in outputs]).numpy().tobytes()).hexdigest()


@pytest.mark.parametrize("isa", ["avx512", "avx2", "sse2"])
def test_the_narrower_instruction_sets_compute_the_same(isa):
    """SPLITFUSE_CPU_ISA=avx512 leaves VNNI out of the 4-bit product and the packed 8-bit one
    (``quant_linear`` runs as without the variable)."""
    if load() == "torch":
        pytest.skip("the C++ product is not built here")
    if isa not in cpu_flags() and not (isa == "avx512" and "avx512bw" in cpu_flags()):
        pytest.skip(f"this CPU has no {isa.upper()}")
    env = {**os.environ, "SPLITFUSE_CPU_ISA": isa}
    result = subprocess.run(
        [sys.executable, "-c", _NARROWER_CHECK], env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-2000:]
    kind, int4_kind, digest = result.stdout.split()
    assert int4_kind == isa
    if isa != "sse2":  # (SSE2 has no FMA: its multiply-adds after the sums round twice)
        assert digest == integer_dot_digest()
    if isa != "avx512":
        assert kind == isa


def _gguf_blocks(type_name: str, values: np.ndarray) -> np.ndarray:
    import gguf

    qtype = getattr(gguf.GGMLQuantizationType, type_name)
    return gguf.quants.quantize(values, qtype), qtype


@pytest.mark.parametrize("type_name,type_id", [("Q4_0", 2), ("Q4_1", 3), ("Q8_0", 8)])
def test_gguf_blocks_decode_to_what_the_gguf_package_dequantizes(type_name, type_id):
    import gguf

    values = np.random.default_rng(type_id).standard_normal((6, 128)).astype(np.float32)
    blocks, qtype = _gguf_blocks(type_name, values)
    want = torch.from_numpy(gguf.quants.dequantize(blocks, qtype).astype(np.float32))
    decoded = decode_blocks(blocks, type_id, 6, 128)
    assert torch.equal(decoded.dequantize(), want)
    got = dequantize_groups(
        decoded.qweight, decoded.scales, decoded.mins, decoded.bits, decoded.group_size
    )
    assert torch.equal(got, want)
