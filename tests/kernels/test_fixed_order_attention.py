"""``splitfuse_cpu::fixed_order_attention`` (``kernels/cpu/fixed_order_attention.cpp``), the C++
attention of deterministic mode on CPUs: against a float64 reference over the same paged cache,
for every query and cache dtype, grouped-query ratios and head sizes that are not a multiple of
its 16 lanes; a token's result the same bits alone, among others, through every instruction
set's body and from caches of any dtype that hold the same numbers; bad tables refused before
anything runs (``store_and_attend_step``, which stores a step's K/V and calls it for decode
tokens: ``test_ragged_attention.py``)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from kernels.cpu_ops import has_fixed_order_attention
from tests.kernels.test_quant_linear import cpu_flags

pytestmark = pytest.mark.skipif(
    not has_fixed_order_attention(), reason="the C++ operators did not build"
)


def _case(
    q_lens, ctx_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, cache_dtype, seed
):
    """A paged cache with shuffled blocks, rows (q_len, ctx_len) and each token's row and
    context length, as the deterministic plan builds them."""
    generator = torch.Generator().manual_seed(seed)
    blocks = [-(-n // block_size) for n in ctx_lens]
    num_blocks = sum(blocks) + 3
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=generator).to(cache_dtype)
    value_cache = torch.randn(shape, generator=generator).to(cache_dtype)
    order = torch.randperm(num_blocks, generator=generator).tolist()
    tables = torch.zeros(len(ctx_lens), max(blocks), dtype=torch.int32)
    start = 0
    for row, count in enumerate(blocks):
        tables[row, :count] = torch.tensor(order[start : start + count])
        start += count
    query = (torch.randn(sum(q_lens), num_heads, head_dim, generator=generator) * 2).to(dtype)
    rows, lens = [], []
    for row, (q_len, ctx_len) in enumerate(zip(q_lens, ctx_lens, strict=True)):
        rows += [row] * q_len
        lens += [ctx_len - q_len + i + 1 for i in range(q_len)]
    return (
        query,
        key_cache,
        value_cache,
        tables,
        torch.tensor(rows, dtype=torch.int32),
        torch.tensor(lens, dtype=torch.int32),
    )


def _reference(query, key_cache, value_cache, tables, rows, lens, scale):
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    group = query.shape[1] // num_kv_heads
    out = []
    for token in range(query.shape[0]):
        positions = torch.arange(int(lens[token]))
        table = tables[int(rows[token])].long()
        slots = table[positions // block_size] * block_size + positions % block_size
        keys = key_cache.view(-1, num_kv_heads, head_dim)[slots].double()
        values = value_cache.view(-1, num_kv_heads, head_dim)[slots].double()
        keys = keys.repeat_interleave(group, 1)  # [positions, heads, head_dim]
        values = values.repeat_interleave(group, 1)
        scores = torch.einsum("hd,phd->hp", query[token].double(), keys) * scale
        out.append(torch.einsum("hp,phd->hd", scores.softmax(-1), values))
    return torch.stack(out)


def _attend(query, key_cache, value_cache, tables, rows, lens, scale):
    return torch.ops.splitfuse_cpu.fixed_order_attention(
        query, key_cache, value_cache, tables, rows, lens, scale
    )


@pytest.mark.parametrize(
    "dtype,cache_dtype",
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.float16, torch.float16),
        (torch.float32, torch.bfloat16),
        (torch.float32, torch.float8_e4m3fn),
        (torch.bfloat16, torch.float8_e4m3fn),
    ],
)
@pytest.mark.parametrize("heads,head_dim", [((4, 4), 16), ((9, 3), 64), ((8, 2), 40)])
def test_matches_a_float64_reference(dtype, cache_dtype, heads, head_dim):
    case = _case([1, 1, 5, 1, 30], [1, 33, 70, 200, 30], *heads, head_dim, 8, dtype, cache_dtype, 0)
    scale = head_dim**-0.5
    got = _attend(*case, scale)
    assert got.dtype == dtype and got.shape == case[0].shape
    want = _reference(*case, scale)
    # float32 arithmetic, then rounded to the query's dtype (half an ulp: 2^-9, 2^-12)
    rtol = {torch.float32: 0, torch.bfloat16: 2**-8, torch.float16: 2**-11}[dtype]
    torch.testing.assert_close(got.double(), want, rtol=rtol, atol=2e-6)


def test_a_token_gives_the_same_bits_alone_and_among_others():
    case = _case([1, 40, 1, 17], [90, 40, 3, 60], 9, 3, 64, 16, torch.bfloat16, torch.bfloat16, 1)
    query, key_cache, value_cache, tables, rows, lens = case
    together = _attend(*case, 0.125)
    for token in (0, 1, 20, 40, 41, 42, 57):
        alone = _attend(
            query[token : token + 1],
            key_cache,
            value_cache,
            tables,
            rows[token : token + 1],
            lens[token : token + 1],
            0.125,
        )
        assert torch.equal(alone[0], together[token]), token
    # tokens in another order, the tables padded wider: the same bits
    order = torch.randperm(query.shape[0], generator=torch.Generator().manual_seed(2))
    wider = torch.cat((tables, tables[:, :1].expand(-1, 3)), dim=1).contiguous()
    shuffled = _attend(query[order], key_cache, value_cache, wider, rows[order], lens[order], 0.125)
    assert torch.equal(shuffled, together[order])


@pytest.mark.parametrize("head_dim", [64, 40])
def test_a_bfloat16_result_is_the_float32_one_rounded(head_dim):
    """The same numbers as bfloat16 and as float32 queries: the bfloat16 result is the float32
    one rounded to nearest even, whichever way each path stores its rows (64-dim heads: 32 dims
    at a time); a NaN becomes c10::BFloat16's 0x7FC0."""
    query, keys, values, tables, rows, lens = _case(
        [1, 3, 1, 20], [70, 20, 33, 40], 9, 3, head_dim, 16, torch.bfloat16, torch.bfloat16, 9
    )
    values[int(tables[2, 0]), 5, 1, 7] = float("nan")  # dim 7 of token 4's second KV head
    want = _attend(query.float(), keys, values, tables, rows, lens, 0.125)
    got = _attend(query, keys, values, tables, rows, lens, 0.125)
    nan = want.isnan()
    assert nan.sum() == 3 and nan[4, 3:6, 7].all()
    assert torch.equal(got.view(torch.int16)[nan], torch.full((3,), 0x7FC0, dtype=torch.int16))
    assert torch.equal(got[~nan].view(torch.int16), want[~nan].bfloat16().view(torch.int16))


@pytest.mark.parametrize("head_dim", [64, 40])
def test_the_caches_values_not_their_dtype_decide_the_bits(head_dim):
    """Caches of float32, bfloat16 and float16 holding the same numbers give the same bits. With
    64-dim heads every cache takes the path that reads rows into registers (float16 ones
    converted by F16C; the plain build, without it, widens them into a buffer: the test across
    instruction sets below compares the two), with 40-dim heads the buffered one."""
    query, keys, values, tables, rows, lens = _case(
        [1, 3, 1, 20], [70, 20, 33, 40], 9, 3, head_dim, 16, torch.bfloat16, torch.bfloat16, 8
    )
    # numbers that bfloat16 and float16 both hold exactly
    keys, values = (torch.where(t.abs() < 1e-3, 0, t) for t in (keys, values))
    for t in (keys, values):
        assert torch.equal(t.half().bfloat16(), t)
    want = _attend(query, keys, values, tables, rows, lens, 0.125)
    for dtype in (torch.float32, torch.float16):
        got = _attend(query, keys.to(dtype), values.to(dtype), tables, rows, lens, 0.125)
        assert torch.equal(got, want), dtype


@pytest.mark.parametrize("head_dim", [64, 40])
def test_float16_caches_widen_exactly(head_dim):
    """float16's extremes (subnormals, the largest finite value, signed zeros) in a float16
    cache give the bits of the same numbers in a float32 one."""
    query, keys, values, tables, rows, lens = _case(
        [1, 1, 4], [40, 70, 33], 9, 3, head_dim, 16, torch.float32, torch.float16, 12
    )
    generator = torch.Generator().manual_seed(13)
    extremes = torch.tensor([2**-24, -(2**-24), 3 * 2**-20, 2**-14 - 2**-24, 0.0, -0.0, 1.0])
    for t in (keys, values):
        picks = torch.randint(len(extremes), t.shape, generator=generator)
        use = torch.rand(t.shape, generator=generator) < 0.3
        t.copy_(torch.where(use, extremes[picks].half(), t))
    keys[0, 0, 0, 0], values[1, 2, 1, 3] = 65504.0, -65504.0
    want = _attend(query, keys.float(), values.float(), tables, rows, lens, 0.125)
    got = _attend(query, keys, values, tables, rows, lens, 0.125)
    assert torch.equal(got, want)


@pytest.mark.parametrize("head_dim", [64, 40])
def test_float8_caches_widen_exactly(head_dim):
    """Every float8 e4m3fn value (subnormals, +-448, signed zeros: all 254 finite bytes) in a
    float8 cache gives the bits of the same numbers in a float32 one: read / 256 and times 256
    again, and as keys / 256 against queries times 256 in the path of 64-dim heads."""
    query, keys, values, tables, rows, lens = _case(
        [1, 1, 4, 1], [40, 70, 33, 128], 9, 3, head_dim, 16, torch.float32, torch.float8_e4m3fn, 14
    )
    generator = torch.Generator().manual_seed(15)
    finite = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
    for t in (keys, values):
        picks = torch.randint(len(finite), t.shape, generator=generator)
        t.view(torch.uint8).copy_(finite[picks])
    scale = 0.125 / 64  # scores of keys up to 448 within exp's range
    want = _attend(query, keys.float(), values.float(), tables, rows, lens, scale)
    got = _attend(query, keys, values, tables, rows, lens, scale)
    assert torch.equal(got, want)
    for t in (keys, values):  # every value was there
        assert torch.unique(t.view(torch.uint8)).numel() == len(finite)


@pytest.mark.parametrize("head_dim", [64, 40])
def test_the_block_size_does_not_change_the_bits(head_dim):
    """The same contexts paged in blocks of 5, 8, 16 and 48 positions give the same bits: blocks
    of a multiple of 16 positions find 16 positions' rows from one division, the others each
    position's, and the reads ahead run one block at a time."""
    generator = torch.Generator().manual_seed(11)
    ctx_lens, num_kv_heads = [70, 20, 33, 100], 3
    query = torch.randn(len(ctx_lens), 9, head_dim, generator=generator).bfloat16()
    contexts = [
        torch.randn(2, n, num_kv_heads, head_dim, generator=generator).bfloat16() for n in ctx_lens
    ]
    rows = torch.arange(len(ctx_lens), dtype=torch.int32)
    lens = torch.tensor(ctx_lens, dtype=torch.int32)
    results = []
    for block_size in (5, 8, 16, 48):
        blocks = [-(-n // block_size) for n in ctx_lens]
        num_blocks = sum(blocks) + 2
        caches = torch.zeros(2, num_blocks, block_size, num_kv_heads, head_dim).bfloat16()
        order = torch.randperm(num_blocks, generator=generator)
        tables = torch.zeros(len(ctx_lens), max(blocks), dtype=torch.int32)
        start = 0
        for row, (count, context) in enumerate(zip(blocks, contexts, strict=True)):
            tables[row, :count] = order[start : start + count]
            start += count
            for position in range(context.shape[1]):
                block = int(tables[row, position // block_size])
                caches[:, block, position % block_size] = context[:, position]
        results.append(_attend(query, caches[0], caches[1], tables, rows, lens, 0.125))
    for got in results[1:]:
        assert torch.equal(got, results[0])


def test_bad_tables_are_refused():
    query, key_cache, value_cache, tables, rows, lens = _case(
        [1, 1], [9, 20], 4, 2, 16, 8, torch.float32, torch.float32, 3
    )
    bad = tables.clone()
    bad[1, 2] = key_cache.shape[0]  # a block past the cache
    with pytest.raises(RuntimeError, match="reads block"):
        _attend(query, key_cache, value_cache, bad, rows, lens, 0.25)
    with pytest.raises(RuntimeError, match="positions"):
        _attend(query, key_cache, value_cache, tables, rows, lens * 100, 0.25)
    with pytest.raises(RuntimeError, match="int32"):
        _attend(query, key_cache, value_cache, tables.long(), rows, lens, 0.25)


_NARROWER_CHECK = """
import sys, torch
from kernels.cpu_ops import load
from tests.kernels.test_fixed_order_attention import _attend, _case
load()
bf16, f16, f32, f8 = torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn
results = []
for dtype, cache_dtype, head_dim in [
    (bf16, bf16, 64), (f32, f32, 64), (f32, bf16, 64), (f16, f16, 64), (f32, f32, 80),
    (f32, f8, 64), (bf16, f8, 64), (f32, f8, 40)
]:
    case = _case([1, 9, 1], [50, 30, 17], 9, 3, head_dim, 8, dtype, cache_dtype, 5)
    results.append(_attend(*case, 0.125))
# 40 decode tokens: items of a token's every KV head, the next one's context asked for ahead
case = _case([1] * 40, [70 + 3 * i for i in range(40)], 9, 3, 64, 16, f32, f32, 6)
results.append(_attend(*case, 0.125))
torch.save(results, sys.argv[1])
"""


def test_every_instruction_set_gives_the_same_bits(tmp_path):
    results = {}
    for isa in ["", "avx2", "sse2"]:
        if isa == "avx2" and "avx2" not in cpu_flags():
            continue
        path = tmp_path / f"{isa or 'widest'}.pt"
        env = {**os.environ, "SPLITFUSE_CPU_ISA": isa}
        done = subprocess.run(
            [sys.executable, "-c", _NARROWER_CHECK, str(path)],
            env=env,
            capture_output=True,
            text=True,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        results[isa] = torch.load(path)
    widest = results.pop("")
    for isa, result in results.items():
        for case, (got, want) in enumerate(zip(result, widest, strict=True)):
            assert torch.equal(got, want), (isa, case)
