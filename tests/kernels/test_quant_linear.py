"""Weight-only quantization: the layouts against float references, the C++ product
``splitfuse_cpu::quant_linear`` against ``F.linear`` on the dequantized weight (every instruction
set the machine runs, row counts 1, 7, 64, 300), and GGUF blocks decoded as the ``gguf`` package
decodes them.

Tolerance of the product: the weight is exactly the dequantized one, only the order of the float32
sums differs, so the error is float32 rounding: relative 1e-5 of the largest output."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from engine.device import cpu_flags
from engine.gguf_quantized import decode_blocks
from engine.quantization import (
    QuantizedTensor,
    dequantize_groups,
    pack_4bit,
    quantize,
    unpack_4bit,
)
from kernels.cpu_ops import load

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


@pytest.mark.parametrize("bits,group_size", LAYOUTS)
@pytest.mark.parametrize("num_rows", [1, 7, 64, 300])
def test_the_product_equals_linear_on_the_dequantized_weight(bits, group_size, num_rows):
    load()
    torch.manual_seed(num_rows)
    num_out, num_in = 45, 256  # 45: a last tile of one output column
    quantized = quantize(torch.randn(num_out, num_in), bits, group_size or num_in)
    x = torch.randn(num_rows, num_in)
    got = torch.ops.splitfuse_cpu.quant_linear(
        x, quantized.qweight, quantized.scales, quantized.mins, bits, quantized.group_size
    )
    want = F.linear(x.double(), quantized.dequantize().double())
    assert got.dtype == torch.float32 and got.shape == (num_rows, num_out)
    assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("num_rows", [1, 7, 64])
def test_bfloat16_rows_multiply_the_bfloat16_rounded_weight_or_the_exact_one(bits, num_rows):
    """One row: the exact weight in float32. More rows where the CPU multiplies bfloat16 in
    hardware: the weight rounded to bfloat16, as a bfloat16 copy of the float weight holds it;
    elsewhere the exact weight."""
    kind = load()
    torch.manual_seed(num_rows)
    quantized = quantize(torch.randn(45, 256), bits, 32)
    x = torch.randn(num_rows, 256).bfloat16()
    got = torch.ops.splitfuse_cpu.quant_linear(
        x, quantized.qweight, quantized.scales, quantized.mins, bits, 32
    )
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
def test_one_bfloat16_row_takes_scales_and_mins_out_of_the_sums(num_in, group_size):
    """Where the CPU multiplies bfloat16 in hardware, one bfloat16 row sums x q per run of 32
    and applies the scales and mins afterwards: the exact weight, float32 rounding. The shapes
    cover a last run of 32 outside the steps of 64 (160, 32), groups that change between the
    two runs of a step or not (96, 64, 128) and a last tile of one column (45)."""
    load()
    torch.manual_seed(num_in + group_size)
    quantized = quantize(torch.randn(45, num_in) * 0.1, 4, group_size)
    for scale in (1.0, 1e3):  # large x: the scale and min parts cancel more
        x = (torch.randn(1, num_in) * scale).bfloat16()
        got = torch.ops.splitfuse_cpu.quant_linear(
            x, quantized.qweight, quantized.scales, quantized.mins, 4, group_size
        )
        want = F.linear(x.double(), quantized.dequantize().double())
        assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()


def test_the_product_refuses_what_it_cannot_read():
    load()
    quantized = quantize(torch.randn(8, 64), 4, 32)
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="group_size"):
        torch.ops.splitfuse_cpu.quant_linear(
            x, quantized.qweight, quantized.scales, quantized.mins, 4, 48
        )
    with pytest.raises(RuntimeError, match="4-bit weights need mins"):
        torch.ops.splitfuse_cpu.quant_linear(x, quantized.qweight, quantized.scales, None, 4, 32)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        torch.ops.splitfuse_cpu.quant_linear(
            x.double(), quantized.qweight, quantized.scales, quantized.mins, 4, 32
        )


_NARROWER_CHECK = """
import torch, torch.nn.functional as F
from engine.quantization import quantize
from kernels.cpu_ops import load
kind = load()
for bits, size in [(4, 32), (8, 64), (8, 128)]:
    for rows in (1, 3, 7, 64):
        q = quantize(torch.randn(37, 128), bits, size)
        x = torch.randn(rows, 128)
        got = torch.ops.splitfuse_cpu.quant_linear(x, q.qweight, q.scales, q.mins, bits, size)
        want = F.linear(x.double(), q.dequantize().double())
        assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max(), (bits, size, rows)
print(kind)
"""


@pytest.mark.parametrize("isa", ["avx2", "sse2"])
def test_the_narrower_instruction_sets_compute_the_same(isa):
    if load() == "torch":
        pytest.skip("the C++ product is not built here")
    if isa == "avx2" and "avx2" not in cpu_flags():
        pytest.skip("this CPU has no AVX2")
    env = {**os.environ, "SPLITFUSE_CPU_ISA": isa}
    result = subprocess.run(
        [sys.executable, "-c", _NARROWER_CHECK], env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == isa


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
