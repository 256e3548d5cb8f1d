"""The Triton kernels at serving shapes, compiled on a CUDA device, against the PyTorch backend on
the host: head_dim 64 and 128, GQA 4 and 8, contexts to 8k tokens, blocks of 16 and 32, prompt
chunks of hundreds of tokens beside long decodes, and the context splits (flash-decoding) the
kernel picks for the step and forced ones. Skipped without CUDA: under the interpreter these
shapes take hours (``test_triton_ops.py`` covers the same code paths at small shapes)."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch
from kernel_reference import make_ragged_batch, run_attention

from kernels import get_backend

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if INTERPRET or not torch.cuda.is_available():
    pytest.skip("serving shapes run compiled on a CUDA device only", allow_module_level=True)

triton_backend = get_backend("triton")
torch_backend = get_backend("torch")

ATOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}
RTOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}

# (head_dim, num_heads, num_kv_heads, block_size): GQA 4 and 8
SHAPES = [(64, 32, 8, 16), (128, 32, 8, 32), (128, 32, 4, 16), (64, 16, 2, 32)]
# (num_cached_tokens, num_query_tokens) per row
ROWS = {
    "decode": [(8191, 1), (4000, 1), (7000, 1), (100, 1), (2047, 1), (15, 1)],
    "mixed": [(8000, 1), (0, 512), (2048, 256), (3000, 1), (31, 1), (6000, 64)],
}


def _batch(rows, head_dim, num_heads, num_kv_heads, block_size, dtype, seed):
    return make_ragged_batch(
        rows, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        block_size=block_size, dtype=dtype, seed=seed, device="cuda",
    )  # fmt: skip


def _expected(batch):
    """The PyTorch backend's output over the same batch on the host."""
    tensors = {name: value.cpu() for name, value in vars(batch).items() if torch.is_tensor(value)}
    return run_attention(torch_backend, replace(batch, **tensors))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows", list(ROWS))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda shape: "hd{}-h{}-kv{}-bs{}".format(*shape))
def test_attention_at_serving_shapes(shape, rows, dtype):
    batch = _batch(ROWS[rows], *shape, dtype=dtype, seed=sum(shape))
    expected = _expected(batch)
    out = run_attention(triton_backend, batch)
    torch.testing.assert_close(out.cpu(), expected, atol=ATOL[dtype], rtol=RTOL[dtype])
    if rows == "decode":
        for num_splits in (1, 16):
            out = run_attention(triton_backend, batch, num_splits=num_splits)
            torch.testing.assert_close(out.cpu(), expected, atol=ATOL[dtype], rtol=RTOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("hidden", [2048, 4096, 8192])
def test_rms_norm_at_serving_shapes(hidden, dtype):
    generator = torch.Generator().manual_seed(hidden)
    x = torch.randn(1024, hidden, generator=generator).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden, generator=generator)).to(dtype)
    residual = torch.randn(1024, hidden, generator=generator).to(dtype)
    expected = torch_backend.rms_norm(x, weight, 1e-5, residual)
    normed, summed = triton_backend.rms_norm(x.cuda(), weight.cuda(), 1e-5, residual.cuda())
    torch.testing.assert_close(normed.cpu(), expected[0], atol=ATOL[dtype], rtol=RTOL[dtype])
    torch.testing.assert_close(summed.cpu(), expected[1], atol=ATOL[dtype], rtol=RTOL[dtype])
