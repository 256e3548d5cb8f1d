"""The Triton quantized product (GPUs) against ``F.linear`` on the dequantized weight, under the
interpreter on CPU (compiled on CUDA when TRITON_INTERPRET is not "1"). Small shapes: the
interpreter is ~1000x slower than torch. Tolerance: float32 operands give float32 rounding
(relative 1e-5); half-precision operands round the dequantized weight and x to 8 or 11 bits."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from engine.quantization import quantize

pytest.importorskip("triton")

from kernels.triton_quant_linear import (  # noqa: E402
    Tiles,
    dequantize_weight,
    tiles,
    triton_quant_linear,
)

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
if DEVICE == "cpu" and not INTERPRET:
    pytest.skip("Triton needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)

DTYPES = [torch.float32] + ([torch.bfloat16, torch.float16] if DEVICE == "cuda" else [])
RTOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 3e-3}


def product(x, quantized, bits, group_size, config=None):
    on = dict(device=DEVICE)
    return triton_quant_linear(
        x.to(**on),
        quantized.qweight.to(**on),
        quantized.scales.to(**on),
        None if quantized.mins is None else quantized.mins.to(**on),
        bits,
        group_size,
        config,
    ).cpu()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits,group_size", [(4, 32), (4, 64), (8, 32), (8, 128)])
@pytest.mark.parametrize("num_rows", [1, 7, 20])
def test_triton_product_equals_linear_on_the_dequantized_weight(dtype, bits, group_size, num_rows):
    torch.manual_seed(num_rows + bits)
    num_out, num_in = 70, 128  # 70: a partial tile of output columns
    quantized = quantize(torch.randn(num_out, num_in), bits, group_size)
    x = torch.randn(num_rows, num_in).to(dtype)
    got = product(x, quantized, bits, group_size)
    want = F.linear(x.double(), quantized.dequantize().double())
    assert got.dtype == dtype and got.shape == (num_rows, num_out)
    assert (got.double() - want).abs().max() <= RTOL[dtype] * want.abs().max()


@pytest.mark.parametrize(
    "bits,num_rows,num_in,block_k",
    [
        (4, 1, 96, 32),
        (4, 3, 192, 64),
        (4, 16, 256, 64),
        (8, 1, 96, 32),
        (8, 3, 192, 64),
        (8, 16, 256, 128),
    ],
)
def test_every_step_of_k(bits, num_rows, num_in, block_k):
    torch.manual_seed(num_in + bits)
    quantized = quantize(torch.randn(33, num_in), bits, 32)
    x = torch.randn(num_rows, num_in)
    want = F.linear(x.double(), quantized.dequantize().double())
    assert tiles(num_in, bits) == Tiles(16, 32, block_k)
    got = product(x, quantized, bits, 32)
    assert (got.double() - want).abs().max() <= RTOL[torch.float32] * want.abs().max()
    other = product(x, quantized, bits, 32, Tiles(16, 16, 32, num_warps=2))  # other tiles
    assert (other.double() - want).abs().max() <= RTOL[torch.float32] * want.abs().max()


@pytest.mark.parametrize("bits,group_size", [(4, 32), (4, 128), (8, 64)])
def test_dequantized_weight_is_the_layouts_own(bits, group_size):
    """More than 16 rows multiply the weight dequantized by a kernel: exactly ``dequantize``."""
    torch.manual_seed(bits)
    quantized = quantize(torch.randn(35, 384), bits, group_size)
    on = dict(device=DEVICE)
    weight = dequantize_weight(
        quantized.qweight.to(**on),
        quantized.scales.to(**on),
        None if quantized.mins is None else quantized.mins.to(**on),
        bits,
        group_size,
        torch.float32,
    )
    assert torch.equal(weight.cpu(), quantized.dequantize())


def test_many_rows_dequantize_a_slice_of_the_weight_at_a_time(monkeypatch):
    import kernels.triton_quant_linear as module

    monkeypatch.setattr(module, "DEQUANTIZED_BYTES", 16 * 64 * 4)  # 16 rows of 64 float32s
    torch.manual_seed(3)
    quantized = quantize(torch.randn(40, 64), 4, 32)  # slices of 16, 16 and 8 rows
    x = torch.randn(20, 64)
    want = F.linear(x.double(), quantized.dequantize().double())
    got = product(x, quantized, 4, 32)
    assert (got.double() - want).abs().max() <= RTOL[torch.float32] * want.abs().max()


def test_a_step_that_does_not_divide_the_inputs_is_refused():
    quantized = quantize(torch.randn(16, 96), 4, 32)
    with pytest.raises(ValueError, match="a step of 64 inputs must divide the 96"):
        product(torch.randn(1, 96), quantized, 4, 32, Tiles(16, 32, 64))


@pytest.mark.skipif(INTERPRET, reason="the interpreter's tl.dot is numpy's, blocked by shape")
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_rows_result_does_not_depend_on_the_number_of_rows(dtype):
    """The fused product's K steps depend on K alone: up to 16 rows, a row's sums run in one order
    whatever the batch."""
    torch.manual_seed(5)
    quantized = quantize(torch.randn(40, 256), 4, 64)
    x = torch.randn(16, 256).to(dtype)
    alone = product(x[:1], quantized, 4, 64)
    for num_rows in (2, 7, 16):
        assert torch.equal(product(x[:num_rows], quantized, 4, 64)[:1], alone), num_rows
