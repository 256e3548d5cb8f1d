"""Linear layers: packed weights on CPUs give F.linear's results: float32 to its rounding (oneDNN
sums in another order than MKL), bfloat16 exactly through oneDNN and within one bfloat16 step
through ``splitfuse_cpu::blocked_linear`` (few rows; it sums in another order)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from engine.packed_linear import can_pack

PACKABLE = [
    dtype for dtype in (torch.float32, torch.bfloat16) if can_pack(torch.empty(1, 1, dtype=dtype))
]


@pytest.mark.skipif(not PACKABLE, reason="no oneDNN")
@pytest.mark.parametrize("dtype", PACKABLE, ids=str)
@pytest.mark.parametrize("num_rows", [1, 7, 64, 300])
def test_packed_layers_match_f_linear(num_rows, dtype) -> None:
    generator = torch.Generator().manual_seed(num_rows)
    column = ColumnParallelLinear(64, [32, 16, 16], bias=True, dtype=dtype)
    row = RowParallelLinear(64, 48, bias=False, dtype=dtype)
    head = ParallelLMHead(100, 64, dtype=dtype)
    x = torch.randn(num_rows, 64, generator=generator).to(dtype)
    for layer in (column, row, head):
        with torch.no_grad():
            layer.weight.copy_(torch.randn(layer.weight.shape, generator=generator))
        bias = getattr(layer, "bias", None)
        if bias is not None:
            with torch.no_grad():
                bias.copy_(torch.randn(bias.shape, generator=generator))
        expected = F.linear(x, layer.weight, bias)
        layer.pack_weights()
        assert layer.weight.numel() == 0 and layer.packed_weight is not None
        if dtype == torch.bfloat16 and layer.packed_weight.blocked is None:
            assert torch.equal(layer(x), expected)
        elif dtype == torch.bfloat16:  # one rounding to bfloat16 of float32 sums of 64 products
            torch.testing.assert_close(layer(x), expected, atol=1e-4, rtol=2.0**-7)
        else:  # sums of 64 products of magnitude ~1
            torch.testing.assert_close(layer(x), expected, atol=1e-5, rtol=1e-5)


def test_float16_is_not_packed() -> None:
    layer = RowParallelLinear(8, 4, bias=False, dtype=torch.float16)
    layer.pack_weights()
    assert layer.weight.numel() == 4 * 8 and layer.packed_weight is None


@pytest.mark.skipif(not can_pack(torch.empty(1, 1, dtype=torch.bfloat16)), reason="no oneDNN")
def test_packing_a_tied_head_keeps_the_embedding() -> None:
    embedding = VocabParallelEmbedding(100, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        embedding.weight.copy_(torch.randn(100, 64))
    head = ParallelLMHead(100, 64, dtype=torch.bfloat16, tied_embedding=embedding)
    ids = torch.tensor([3, 97])
    expected = embedding(ids)
    head.pack_weights()
    assert head.packed_weight is not None and head.weight is embedding.weight
    assert torch.equal(embedding(ids), expected)
    assert torch.equal(head(expected), F.linear(expected, embedding.weight))


def test_packed_products_run_on_few_row_counts_and_keep_every_row() -> None:
    from engine.packed_linear import PackedWeight, packed_linear, padded_rows

    sizes = {padded_rows(rows) for rows in range(1, 513)}
    assert len(sizes) <= 60  # one oneDNN kernel per size and weight, not per row count
    for rows in range(1, 1025):
        padded = padded_rows(rows)
        assert rows <= padded <= max(16, rows + rows // 8)
    weight = torch.randn(48, 32)
    packed = PackedWeight(weight)
    for rows in (1, 16, 17, 33, 100):
        x = torch.randn(rows, 32)
        out = packed_linear(x, packed, 48, None)
        assert out.shape == (rows, 48)
        torch.testing.assert_close(out, x @ weight.T, rtol=1e-5, atol=1e-5)
