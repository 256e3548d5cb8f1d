"""Deterministic mode's kernels: a row's result is the same bits whatever else the call holds.

Products: random rows at random places among 2..300 others against the same rows in one call of
300 (``engine/deterministic_rows.py``), run whole or in fixed tiles as this machine's probe
(``rows_independent``) decides, as deterministic mode runs them. Attention: a query at a given
position of a sequence, alone as a decode, or inside prompt chunks of any length among other rows
(decodes, chunks, long and short contexts), gives ``torch.equal`` outputs; the torch backend, and
Triton under the interpreter at small shapes.
"""

from __future__ import annotations

import os
import random

import pytest
import torch
import torch.nn.functional as F

from engine import deterministic_rows
from engine.deterministic_rows import (
    PROBE_ROWS,
    TILE_ROWS,
    at_least_two_rows,
    fixed_tiles,
    rows_independent,
)
from engine.layers import ColumnParallelLinear
from engine.packed_linear import PackedWeight, can_pack, packed_linear
from engine.quantization import quantize
from kernels import AttentionMetadata, get_backend
from kernels.cpu_ops import has_fixed_order_attention
from kernels.torch_backend import TorchBackend
from tests.kernels.test_quant_linear import product as quantized_product

ROW_COUNTS = [2, 3, 4, 5, 7, 12, 16, 17, 33, 64, 100, 255]


def _assert_rows_invariant(product, in_features: int, dtype: torch.dtype, seed: int) -> None:
    """``product`` (x -> x W^T) arranged as deterministic mode arranges it here: whole (a single
    row as two) where the probe finds its rows independent, in fixed tiles otherwise."""
    whole = rows_independent(
        lambda x, _: product(x), in_features, dtype, ("test", id(product), in_features, dtype)
    )
    arrange = at_least_two_rows if whole else fixed_tiles

    def arranged(x: torch.Tensor) -> torch.Tensor:
        return arrange(lambda x, _: product(x), x, None)

    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(300, in_features, generator=generator).to(dtype)
    full = arranged(x)
    for num_rows in ROW_COUNTS:
        rows = torch.randperm(300, generator=generator)[:num_rows]
        assert torch.equal(arranged(x[rows]), full[rows]), num_rows
    assert torch.equal(arranged(x[7:8]), full[7:8])


def _packable(dtype: torch.dtype) -> None:
    if not can_pack(torch.empty(2, 2, dtype=dtype)):
        pytest.skip(f"this CPU does not pack {dtype} weights")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(576, 192), (576, 3072), (1536, 576), (64, 1000)])
def test_packed_product_rows_do_not_depend_on_the_batch(dtype, shape):
    _packable(dtype)
    in_features, out_features = shape
    weight = (torch.randn(out_features, in_features) * 0.05).to(dtype)
    packed = PackedWeight(weight)
    packed.one_kernel()  # as deterministic mode runs it (``MatmulLayer.set_deterministic``)
    _assert_rows_invariant(
        lambda x: packed_linear(x, packed, out_features, None), in_features, dtype, seed=1
    )


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_product_rows_do_not_depend_on_the_batch(bits, dtype):
    from kernels.cpu_ops import load

    load()
    quantized = quantize(torch.randn(768, 576) * 0.05, bits, 32)

    def product(x: torch.Tensor) -> torch.Tensor:
        return quantized_product(x.contiguous(), quantized)

    _assert_rows_invariant(product, 576, dtype, seed=2)


def test_fixed_tiles_run_every_call_on_tile_rows():
    weight = torch.randn(40, 24)
    shapes = []

    def product(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        shapes.append(tuple(x.shape))
        return F.linear(x, weight, bias)

    x = torch.randn(35, 24)
    out = fixed_tiles(product, x, None)
    assert shapes == [(TILE_ROWS, 24)] * 3 and out.shape == (35, 40)
    assert torch.equal(fixed_tiles(product, x[20:21], None), out[20:21])
    assert torch.equal(fixed_tiles(product, x[16:32], None), out[16:32])


def test_the_probe_tells_rows_that_depend_on_the_count(monkeypatch):
    monkeypatch.setattr(deterministic_rows, "_probed", {})
    # small integers: every sum is exact in float32, whatever order a library adds it in
    weight = torch.randint(-3, 4, (8, 16)).float()

    def independent(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x.round(), weight, bias)

    def dependent(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        # other bits from 5 rows on, as a library that switches kernels by the row count
        out = F.linear(x.round(), weight, bias)
        return out + 0.5 if x.shape[0] >= 5 else out

    assert rows_independent(independent, 16, torch.float32, ("a",))
    assert not rows_independent(dependent, 16, torch.float32, ("b",))
    assert not rows_independent(independent, 16, torch.float32, ("b",))  # measured once a key
    assert set(deterministic_rows._probed) == {("a", PROBE_ROWS), ("b", PROBE_ROWS)}


def test_a_layer_whose_product_fails_the_probe_runs_in_tiles(monkeypatch):
    from engine import layers

    monkeypatch.setattr(layers, "rows_independent", lambda *args: False)
    layer = ColumnParallelLinear(64, [96], bias=False, dtype=torch.float32)
    torch.nn.init.normal_(layer.weight, std=0.1)
    layer.pack_weights()
    layer.set_deterministic()
    assert layer.in_tiles
    shapes = []
    product = layer._product

    def recorded(x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        shapes.append(x.shape[0])
        return product(x, bias)

    monkeypatch.setattr(layer, "_product", recorded)
    x = torch.randn(20, 64)
    full = layer(x)
    assert shapes == [TILE_ROWS, TILE_ROWS]
    assert torch.equal(layer(x[5:6]), full[5:6])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_deterministic_layer_row_alone_equals_row_among_others(dtype):
    """Packed (float32; bfloat16 with the hardware) and unpacked (``F.linear`` in tiles)."""
    layer = ColumnParallelLinear(64, [96], bias=True, dtype=dtype)
    torch.nn.init.normal_(layer.weight, std=0.1)
    torch.nn.init.normal_(layer.bias)
    layer.pack_weights()
    layer.set_deterministic()
    x = torch.randn(50, 64).to(dtype)
    full = layer(x)
    for row in (0, 17, 49):
        assert torch.equal(layer(x[row : row + 1]), full[row : row + 1])
    assert torch.equal(layer(x[3:40]), full[3:40])


# ---- attention --------------------------------------------------------------------------------

BLOCK_SIZE = 8


class Sequences:
    """Sequences of K/V (in one paged cache, blocks shuffled) and one query vector per position;
    a batch picks (sequence, first query position, query count) rows out of them."""

    def __init__(self, lengths, num_heads, num_kv_heads, head_dim, dtype, device, seed=0):
        generator = torch.Generator().manual_seed(seed)
        blocks = [-(-length // BLOCK_SIZE) for length in lengths]
        order = torch.randperm(sum(blocks) + 2, generator=generator).tolist()
        self.tables, start = [], 0
        for count in blocks:
            self.tables.append(order[start : start + count])
            start += count
        shape = (sum(blocks) + 2, BLOCK_SIZE, num_kv_heads, head_dim)
        self.key_cache = torch.randn(shape, generator=generator).to(device=device, dtype=dtype)
        self.value_cache = torch.randn(shape, generator=generator).to(device=device, dtype=dtype)
        self.queries = [
            torch.randn(length, num_heads, head_dim, generator=generator).to(device, dtype)
            for length in lengths
        ]
        self.scale = head_dim**-0.5
        self.device = device

    def attend(self, backend, rows: list[tuple[int, int, int]]) -> torch.Tensor:
        """Attention of the rows (sequence, first position, query count), already cached."""
        max_blocks = max(len(table) for table in self.tables)
        tables = torch.zeros(len(rows), max_blocks, dtype=torch.int32)
        slots = []
        for index, (sequence, first, count) in enumerate(rows):
            table = self.tables[sequence]
            tables[index, : len(table)] = torch.tensor(table, dtype=torch.int32)
            slots += [
                table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
                for p in range(first, first + count)
            ]
        query = torch.cat([self.queries[s][first : first + n] for s, first, n in rows])
        lens = [first + n for _, first, n in rows]
        starts = [0]
        for _, _, count in rows:
            starts.append(starts[-1] + count)
        device = self.device
        metadata = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            query_start=torch.tensor(starts, dtype=torch.int32, device=device),
            context_lens=torch.tensor(lens, dtype=torch.int32, device=device),
            block_tables=tables.to(device),
            max_query_len=max(n for _, _, n in rows),
            max_context_len=max(lens),
        )
        positions = torch.tensor(
            [p for _, first, n in rows for p in range(first, first + n)], device=device
        )
        kv_cache = torch.stack((self.key_cache, self.value_cache))[None]
        plan = backend.plan(positions, metadata, kv_cache, max(lens))
        return backend.paged_attention(query, self.key_cache, self.value_cache, plan, self.scale)


def _random_batches(lengths: list[int], target: tuple[int, int], seed: int, num_batches: int):
    """Batches that each hold the target (sequence, position) as a decode or inside a prompt
    chunk, with random other rows; yields (rows, the target's token index)."""
    rng = random.Random(seed)
    sequence, position = target
    for _ in range(num_batches):
        rows = []
        for _ in range(rng.randrange(0, 5)):
            other = rng.randrange(len(lengths))
            count = min(rng.choice([1, 1, rng.randrange(1, 30)]), lengths[other])
            first = rng.randrange(0, lengths[other] - count + 1)
            rows.append((other, first, count))
        before = rng.randrange(0, min(position, 20) + 1)
        after = rng.randrange(0, min(lengths[sequence] - position - 1, 20) + 1)
        index = rng.randrange(len(rows) + 1)
        rows.insert(index, (sequence, position - before, before + 1 + after))
        token = sum(count for _, _, count in rows[:index]) + before
        yield rows, token


def _assert_attention_invariant(backend, sequences, lengths, seed, num_batches):
    for target in [(0, lengths[0] - 1), (1, 5), (2, lengths[2] // 2)]:
        alone = sequences.attend(backend, [(target[0], target[1], 1)])[0]
        for rows, token in _random_batches(lengths, target, seed, num_batches):
            assert torch.equal(sequences.attend(backend, rows)[token], alone), (target, rows)


@pytest.mark.parametrize("kernel", [True, False], ids=["cpp", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_attention_query_does_not_depend_on_the_batch(dtype, kernel):
    if kernel and not has_fixed_order_attention():
        pytest.skip("the C++ operators did not build")
    lengths = [150, 40, 77, 9]
    sequences = Sequences(lengths, 9, 3, 64, dtype, "cpu")
    backend = TorchBackend(deterministic=True, cpu_kernel=kernel)
    _assert_attention_invariant(backend, sequences, lengths, seed=3, num_batches=25)
    # whole prompts of 150 and 140 tokens: attended by query chunks (``QUERY_CHUNK``)
    whole = sequences.attend(backend, [(2, 0, 77), (0, 0, 150)])
    tail = sequences.attend(backend, [(0, 10, 140), (3, 8, 1)])
    for position in (0, 5, 63, 64, 70, 127, 149):
        alone = sequences.attend(backend, [(0, position, 1)])[0]
        assert torch.equal(whole[77 + position], alone), position
        if position >= 10:
            assert torch.equal(tail[position - 10], alone), position


def test_triton_attention_query_does_not_depend_on_the_batch():
    pytest.importorskip("triton")
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if not interpret and not torch.cuda.is_available():
        pytest.skip("Triton needs CUDA or TRITON_INTERPRET=1")
    device = "cpu" if interpret else "cuda"
    lengths = [70, 30, 45]
    sequences = Sequences(lengths, 4, 2, 16, torch.float32, device)
    backend = get_backend("triton", deterministic=True)
    _assert_attention_invariant(backend, sequences, lengths, seed=4, num_batches=4)
