"""``splitfuse_cpu::store_and_attend_step`` (``kernels/cpu/ragged_attention.cpp``): one layer's
store and attention of a whole ragged step from tensors alone. Against the Python path
(``kernels/torch_attention.py``) and a float64 reference, for prompt chunks on both sides of the
query-chunking threshold, with and without a cached prefix, decodes, rows of no token and
grouped-query heads; decode tokens give the fixed-order kernel's bits (a step of decodes alone:
its result over the stored cache); every bad input refused before the cache changes; traced whole
by torch.compile."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from kernel_reference import make_ragged_batch, reference_attention

from engine.device import cpu_flags
from kernels.cpu_ops import attends_whole, has_fixed_order_attention, prompt_kernel
from kernels.torch_attention import paged_attention, plan_paged_attention

pytestmark = pytest.mark.skipif(
    not has_fixed_order_attention(), reason="the C++ operators did not build"
)

# (num_cached_tokens, num_query_tokens) per row: chunks of 2 .. 200 tokens (chunks of 128 and
# more attend in query chunks of 64), decodes and rows of no token
BATCHES = {
    "short chunks": [(0, 2), (40, 1), (0, 63), (5, 0), (17, 1), (30, 64), (0, 1), (100, 65)],
    "long chunks": [(0, 127), (3, 1), (64, 128), (9, 0), (0, 200), (250, 1)],
}
# a decode token of each whose K/V are already in its slot (slot -1)
UNSTORED = {"short chunks": 66, "long chunks": 127}

# the largest error, relative to the result's largest magnitude: float32 arithmetic's; and
# bfloat16's roundings of the result and of SDPA's intermediates (8-bit mantissa)
RELATIVE_ERROR = {torch.float32: 2**-19, torch.bfloat16: 2**-7}


def _step(rows, num_heads, num_kv_heads, head_dim, dtype, seed, unstored=()):
    """(batch, query, key, value, kv_cache, slots): a ragged batch (``make_ragged_batch``:
    blocks out of order, NaN in the slots of no context); the step's query, key and value as
    views of one fused projection [num_tokens, num_heads + 2 * num_kv_heads, head_dim] (key and
    value: what the batch's cache holds at the step's slots); the batch's one-layer cache [1, 2,
    ...] with the step's slots zeroed; the step's slots, -1 for the tokens in ``unstored``
    (their K/V stay in the cache)."""
    batch = make_ragged_batch(
        rows, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        block_size=16, dtype=dtype, seed=seed,
    )  # fmt: skip
    slots = batch.slot_mapping()
    kv_cache = batch.kv_cache()
    slot_rows = kv_cache.view(1, 2, -1, num_kv_heads, head_dim)  # [1, 2, num_slots, ...]
    key, value = slot_rows[0, 0, slots], slot_rows[0, 1, slots]
    fused = torch.cat((batch.query, key, value), dim=1)
    query, key, value = fused.split((num_heads, num_kv_heads, num_kv_heads), dim=1)
    slots[list(unstored)] = -1
    slot_rows[:, :, slots[slots >= 0]] = 0  # the step stores them
    return batch, query, key, value, kv_cache, slots


def _store_and_attend_step(batch, query, key, value, kv_cache, slots):
    """The operator on the batch's metadata (layer 0)."""
    return torch.ops.splitfuse_cpu.store_and_attend_step(
        query, key, value, kv_cache, 0, slots, batch.block_tables, batch.query_start,
        batch.context_lens, batch.scale,
    )  # fmt: skip


def _python_path(batch, query, key, value, kv_cache, slots, cpu_kernel=False):
    """The step stored with ``index_copy_`` into a copy of ``kv_cache``, then attended by
    ``paged_attention`` (SDPA for every row; with ``cpu_kernel`` the C++ kernels where the plan
    hands them rows): (result, the cache after)."""
    kv_cache = kv_cache.clone()
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    key_cache, value_cache = kv_cache[0]
    stored = slots >= 0
    for cache, rows in ((key_cache, key), (value_cache, value)):
        cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots[stored], rows[stored])
    plan = plan_paged_attention(
        batch.query_start, batch.context_lens, batch.block_tables, block_size=16,
        num_kv_heads=num_kv_heads, num_tokens=query.shape[0], cpu_kernel=cpu_kernel,
    )  # fmt: skip
    return paged_attention(query, key_cache, value_cache, plan, batch.scale), kv_cache


def _assert_near(actual, expected, dtype):
    expected = expected.double()
    error = (actual.double() - expected).abs().max()
    assert error <= RELATIVE_ERROR[dtype] * expected.abs().max(), error


def _assert_same_cache(actual, expected):
    """Equal, NaN (slots of no context) included."""
    torch.testing.assert_close(actual, expected, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("head_dim", [64, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", BATCHES)
def test_matches_the_python_path_and_a_float64_reference(name, dtype, head_dim):
    step = _step(BATCHES[name], 6, 2, head_dim, dtype, seed=head_dim, unstored=[UNSTORED[name]])
    batch, query, key, value, kv_cache, slots = step
    want, want_cache = _python_path(batch, query, key, value, kv_cache, slots)
    got = _store_and_attend_step(batch, query, key, value, kv_cache, slots)
    assert got.dtype == dtype and got.shape == query.shape and got.is_contiguous()
    _assert_same_cache(kv_cache, want_cache)
    _assert_same_cache(kv_cache[0, 0], batch.key_cache)  # what the batch's cache held
    _assert_near(got, want, dtype)
    _assert_near(got, reference_attention(batch), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_whole_prompt_attends_as_the_python_path_decides(dtype):
    """A prompt of 200 tokens with nothing cached: in one causal call where torch's flash kernel
    multiplies on AMX tiles (``attends_whole``), else by query chunks; the operator and the Python
    path decide alike and give the same bits. bfloat16 through our own kernel where the CPU runs
    it (``prompt_kernel``: AMX tiles or AVX-512 BF16): the kernel of ``prompt_attention``, which
    the Python path calls where its plan may hand rows to the C++ operators, and near SDPA's
    result elsewhere."""
    if dtype == torch.float32 or "amx_bf16" not in cpu_flags():
        assert not attends_whole(dtype)
    if dtype == torch.float32 or "avx512_bf16" not in cpu_flags():
        assert not (dtype == torch.bfloat16 and prompt_kernel(64))
    batch, query, key, value, kv_cache, slots = _step([(0, 200)], 9, 3, 64, dtype, seed=7)
    own = dtype == torch.bfloat16 and bool(prompt_kernel(64))
    want, _ = _python_path(batch, query, key, value, kv_cache, slots, cpu_kernel=own)
    got = _store_and_attend_step(batch, query, key, value, kv_cache, slots)
    assert torch.equal(got, want)
    if own:
        sdpa, _ = _python_path(batch, query, key, value, kv_cache, slots)
        _assert_near(got, sdpa, dtype)


@pytest.mark.parametrize("kernel", ["amx", "avx512_bf16"])
def test_prompt_chunks_give_a_token_the_same_bits_however_chunked(kernel):
    """``prompt_attention`` (our own kernel of bfloat16 prompt chunks, on AMX tiles or in
    AVX-512 BF16): a token's result over slots out of order is the same bits whether its prompt
    attends whole or in chunks of any size after a cached prefix (one token alone too), near a
    float64 reference (grouped heads: 9 queries, 3 KV heads); bad inputs are refused. On a CPU
    with AMX the AVX-512 kernel runs in a process that asks for it (SPLITFUSE_CPU_ISA)."""
    if prompt_kernel(64) != kernel:
        if kernel != "avx512_bf16" or "avx512_bf16" not in cpu_flags() or not prompt_kernel(64):
            pytest.skip(f"the {kernel} kernel does not run on this CPU")
        env = {**os.environ, "SPLITFUSE_CPU_ISA": "avx512_bf16"}
        test = f"{__file__}::test_prompt_chunks_give_a_token_the_same_bits_however_chunked"
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"{test}[{kernel}]"],
            env=env,
            capture_output=True,
            text=True,
        )
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
        return
    torch.manual_seed(3)
    num_tokens, num_slots = 150, 200
    query = torch.randn(num_tokens, 9, 64).bfloat16()
    key_rows = torch.randn(num_slots, 3, 64).bfloat16()
    value_rows = torch.randn(num_slots, 3, 64).bfloat16()
    slots = torch.randperm(num_slots)[:num_tokens].contiguous()
    op = torch.ops.splitfuse_cpu.prompt_attention
    whole = op(query, key_rows, value_rows, slots, 0.125)
    for cuts in ((0, 77, 150), (0, 1, 2, 31, 32, 33, 100, 149, 150), (0, 64, 128, 150)):
        for begin, end in zip(cuts, cuts[1:], strict=False):
            got = op(query[begin:end], key_rows, value_rows, slots[:end], 0.125)
            assert torch.equal(got, whole[begin:end])
    # float64: token i sees positions 0 .. i
    keys = key_rows[slots].double().repeat_interleave(3, dim=1).transpose(0, 1)  # [9, n, 64]
    values = value_rows[slots].double().repeat_interleave(3, dim=1).transpose(0, 1)
    scores = query.double().transpose(0, 1) @ keys.transpose(1, 2) * 0.125  # [9, n, n]
    causal = torch.ones(num_tokens, num_tokens, dtype=torch.bool).tril()
    weights = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    want = (weights @ values).transpose(0, 1)
    _assert_near(whole, want, torch.bfloat16)
    with pytest.raises(RuntimeError, match="slots read"):
        op(query, key_rows, value_rows, slots + num_slots, 0.125)
    with pytest.raises(RuntimeError, match="context_len >= q_len"):
        op(query, key_rows, value_rows, slots[:10], 0.125)
    with pytest.raises(RuntimeError, match="bfloat16"):
        op(query.float(), key_rows, value_rows, slots, 0.125)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", BATCHES)
def test_a_float8_cache_gives_the_bits_of_its_values_in_the_querys_dtype(name, dtype):
    """A float8 e4m3fn cache (``kv_cache_dtype="fp8"``) against a cache in the query's dtype
    holding the same numbers: the same stored bytes (K/V rounded as torch rounds them) and the
    same result, prompt chunks (their contexts widened by a table) and decodes (the fixed-order
    kernel reads float8 in registers) alike."""
    step = _step(BATCHES[name], 9, 3, 64, dtype, seed=21, unstored=[UNSTORED[name]])
    batch, query, key, value, kv_cache, slots = step
    f8 = torch.float8_e4m3fn
    # numbers float8 holds (NaN in the slots of no context stays NaN)
    kv_cache.copy_(kv_cache.to(f8).to(dtype))
    key, value = key.to(f8).to(dtype), value.to(f8).to(dtype)
    float8_cache = kv_cache.to(f8)
    want = _store_and_attend_step(batch, query, key, value, kv_cache, slots)
    got = _store_and_attend_step(batch, query, key.to(f8), value.to(f8), float8_cache, slots)
    assert torch.equal(got, want)
    _assert_same_cache(float8_cache.to(dtype), kv_cache)


def _decode_tokens(batch):
    """[(token, row, context_len)] of the batch's decode rows."""
    starts = batch.query_start.tolist()
    return [
        (starts[row], row, ctx)
        for row, ctx in enumerate(batch.context_lens.tolist())
        if starts[row + 1] - starts[row] == 1
    ]


def test_decodes_give_the_fixed_order_kernels_bits():
    """A step of decodes alone: the kernel's result over the cache with the step's K/V stored
    (and that cache). Among prompt chunks: the same bits for each decode token."""
    decodes = [(15, 1), (0, 1), (3, 0), (47, 1), (200, 1), (16, 1)]
    batch, query, key, value, kv_cache, slots = _step(decodes, 9, 3, 64, torch.bfloat16, seed=4)
    _, rows, lens = zip(*_decode_tokens(batch), strict=True)
    want_cache = kv_cache.clone()
    stored = slots >= 0
    for cache, tensor in zip(want_cache[0], (key, value), strict=True):
        cache.view(-1, *cache.shape[2:])[slots[stored]] = tensor[stored]
    want = torch.ops.splitfuse_cpu.fixed_order_attention(
        query, want_cache[0, 0], want_cache[0, 1], batch.block_tables,
        torch.tensor(rows, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32), batch.scale,
    )  # fmt: skip
    got = _store_and_attend_step(batch, query, key, value, kv_cache, slots)
    assert torch.equal(got, want)
    _assert_same_cache(kv_cache, want_cache)

    # decode rows among prompt chunks: each decode token the kernel's bits for it alone
    mixed = [(0, 5), *decodes[:3], (30, 40), *decodes[3:], (0, 2)]
    batch, query, key, value, kv_cache, slots = _step(mixed, 9, 3, 64, torch.bfloat16, seed=5)
    got = _store_and_attend_step(batch, query, key, value, kv_cache, slots)
    key_cache, value_cache = kv_cache[0]
    for token, row, ctx_len in _decode_tokens(batch):
        want = torch.ops.splitfuse_cpu.fixed_order_attention(
            query[token : token + 1], key_cache, value_cache, batch.block_tables,
            _int32(row), _int32(ctx_len), batch.scale,
        )  # fmt: skip
        assert torch.equal(got[token : token + 1], want), token


def _small_step():
    """The operator's arguments for rows (cached 0, query 3), (cached 5, query 1), (cached 9,
    query 0), (cached 18, query 2): 6 tokens, tables of 3 blocks of 16 (capacity 48), 8 blocks
    in the cache, no NaN in it."""
    step = _step([(0, 3), (5, 1), (9, 0), (18, 2)], 4, 2, 16, torch.float32, seed=5)
    batch, query, key, value, kv_cache, slots = step
    kv_cache.nan_to_num_(0.0)
    return {
        "query": query, "key": key, "value": value, "kv_cache": kv_cache, "layer": 0,
        "slots": slots, "block_tables": batch.block_tables, "query_start": batch.query_start,
        "context_lens": batch.context_lens, "scale": batch.scale,
    }  # fmt: skip


def _int32(*values):
    return torch.tensor(values, dtype=torch.int32)


def _with(tensor, index, value):
    changed = tensor.clone()
    changed[index] = value
    return changed


# name -> (the changed arguments, a function of the good ones; the error's words)
BAD_INPUTS = {
    "query_start from 1": (lambda a: {"query_start": _int32(1, 3, 4, 4, 6)},
                           "run from 0 to num_tokens 6, got 1 .. 6"),
    "query_start short of the tokens": (lambda a: {"query_start": _int32(0, 3, 4, 4, 5)},
                                        "run from 0 to num_tokens 6, got 0 .. 5"),
    "query_start decreases": (lambda a: {"query_start": _int32(0, 3, 2, 4, 6)},
                              "query_start decreases at row 1: 3 -> 2"),
    "query_start of other rows": (lambda a: {"query_start": _int32(0, 3, 6)},
                                  r"query_start must be int32 \[num_rows \+ 1\]"),
    "query_start int64": (lambda a: {"query_start": a["query_start"].long()},
                          "query_start must be int32"),
    "context shorter than its chunk": (lambda a: {"context_lens": _int32(2, 6, 9, 20)},
                                       "row 0 of 3 query tokens has context_len 2"),
    "context past the table": (lambda a: {"context_lens": _int32(3, 6, 9, 49)},
                               r"context_len 49 \(must be in \[2, 48\]\)"),
    "decode context past the table": (lambda a: {"context_lens": _int32(3, 49, 9, 20)},
                                      "row 1 of 1 query tokens has context_len 49"),
    "context_lens of other rows": (lambda a: {"context_lens": _int32(3, 6, 9)},
                                   "context_lens int32"),
    "context_lens int64": (lambda a: {"context_lens": a["context_lens"].long()},
                           "context_lens int32"),
    "block past the cache": (lambda a: {"block_tables": _with(a["block_tables"], (3, 1), 8)},
                             "row 3 reads block 8 of 8"),
    "negative block": (lambda a: {"block_tables": _with(a["block_tables"], (0, 0), -1)},
                       "row 0 reads block -1 of 8"),
    "block_tables int64": (lambda a: {"block_tables": a["block_tables"].long()},
                           "block_tables must be contiguous int32"),
    "block_tables not contiguous": (lambda a: {"block_tables": a["block_tables"].t()
                                               .contiguous().t()},
                                    "block_tables must be contiguous int32"),
    "slot past the cache": (lambda a: {"slots": _with(a["slots"], 5, 128)},
                            "token 5 stores into slot 128 of 128"),
    "slot below -1": (lambda a: {"slots": _with(a["slots"], 1, -2)},
                      "token 1 stores into slot -2"),
    "slots int32": (lambda a: {"slots": a["slots"].int()}, "slots must be int64"),
    "slots short": (lambda a: {"slots": a["slots"][:5]}, "slots must be int64"),
    "key in another dtype": (lambda a: {"key": a["key"].bfloat16()}, "key and value must be"),
    "value of other heads": (lambda a: {"value": a["value"][:, :1]}, "key and value must be"),
    "query of float64": (lambda a: {"query": a["query"].double()}, "query must be"),
    "query of other heads": (lambda a: {"query": a["query"][:, :3].contiguous()},
                             "does not match the cache's 2 KV heads of 16"),
    "query of other tokens": (lambda a: {"query": a["query"][:5]},
                              r"key and value must be \[num_tokens"),
    "layer past the cache": (lambda a: {"layer": 1}, "layer 1 of a cache of 1 layers"),
}  # fmt: skip


@pytest.mark.parametrize("name", BAD_INPUTS)
def test_bad_inputs_are_refused_before_the_cache_changes(name):
    change, message = BAD_INPUTS[name]
    args = _small_step()
    before = args["kv_cache"].clone()
    with pytest.raises(RuntimeError, match=f"store_and_attend_step: .*{message}"):
        torch.ops.splitfuse_cpu.store_and_attend_step(**{**args, **change(args)})
    assert torch.equal(args["kv_cache"], before)


def test_the_good_arguments_store():
    args = _small_step()
    before = args["kv_cache"].clone()
    torch.ops.splitfuse_cpu.store_and_attend_step(**args)
    assert not torch.equal(args["kv_cache"], before)


def test_a_step_of_no_token():
    step = _step([(4, 0), (0, 0)], 4, 2, 16, torch.float32, seed=6)
    assert _store_and_attend_step(*step).shape == (0, 4, 16)


def test_compiles_whole():
    """Traced with no graph break (its fake implementation gives the result's shape); the
    compiled function stores into the cache it was given and attends as the operator does."""
    step = _step([(0, 5), (7, 1), (3, 9)], 4, 2, 16, torch.float32, seed=7)
    batch, query, key, value, kv_cache, slots = step
    eager_cache = kv_cache.clone()
    want = _store_and_attend_step(batch, query, key, value, eager_cache, slots) * 2

    def attend_twice(query, key, value, kv_cache, slots, tables, query_start, context_lens):
        attended = torch.ops.splitfuse_cpu.store_and_attend_step(
            query, key, value, kv_cache, 0, slots, tables, query_start, context_lens, batch.scale
        )
        return attended * 2

    compiled = torch.compile(attend_twice, fullgraph=True, backend="aot_eager")
    got = compiled(
        query, key, value, kv_cache, slots, batch.block_tables, batch.query_start,
        batch.context_lens,
    )  # fmt: skip
    assert torch.equal(got, want)
    _assert_same_cache(kv_cache, eager_cache)


def test_passes_opcheck():
    """Its schema (kv_cache mutated, nothing else; a new result), its fake implementation and
    its calls under AOT autograd, as ``torch.library.opcheck`` checks them."""
    torch.library.opcheck(
        torch.ops.splitfuse_cpu.store_and_attend_step.default, tuple(_small_step().values())
    )
