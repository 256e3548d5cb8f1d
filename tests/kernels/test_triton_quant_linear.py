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

from kernels.triton_quant_linear import triton_quant_linear  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
if DEVICE == "cpu" and not INTERPRET:
    pytest.skip("Triton needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)

DTYPES = [torch.float32] + ([torch.bfloat16, torch.float16] if DEVICE == "cuda" else [])
RTOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 3e-3}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits,group_size", [(4, 32), (4, 64), (8, 32), (8, 128)])
@pytest.mark.parametrize("num_rows", [1, 7, 20])
def test_triton_product_equals_linear_on_the_dequantized_weight(dtype, bits, group_size, num_rows):
    torch.manual_seed(num_rows + bits)
    num_out, num_in = 70, 128  # 70: a partial tile of output columns
    quantized = quantize(torch.randn(num_out, num_in), bits, group_size)
    x = torch.randn(num_rows, num_in).to(dtype)
    on = dict(device=DEVICE)
    got = triton_quant_linear(
        x.to(**on),
        quantized.qweight.to(**on),
        quantized.scales.to(**on),
        None if quantized.mins is None else quantized.mins.to(**on),
        bits,
        group_size,
    )
    want = F.linear(x.double(), quantized.dequantize().double())
    assert got.dtype == dtype and got.shape == (num_rows, num_out)
    assert (got.cpu().double() - want).abs().max() <= RTOL[dtype] * want.abs().max()
