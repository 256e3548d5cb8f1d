"""The PyTorch backend's ops against the float64 references in kernel_reference.py."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from kernel_reference import (
    make_ragged_batch,
    reference_attention,
    reference_rms_norm,
    reference_rotary,
    reference_store_kv,
    run_attention,
)

from engine.device import cpu_flags
from kernels import (
    BACKENDS,
    AttentionMetadata,
    KernelInputError,
    build_cos_sin_cache,
    get_backend,
    torch_attention,
)
from kernels.checks import check_attention_inputs, check_kv_inputs
from kernels.torch_attention import length_groups
from kernels.torch_backend import TorchBackend

backend = get_backend("torch")  # on CPUs with the C++ operators built, decodes run through them
sdpa_backend = TorchBackend(cpu_kernel=False)  # decodes in length groups through SDPA
BOTH = pytest.mark.parametrize("attention", [backend, sdpa_backend], ids=["default", "sdpa"])

# Max abs error against float64 for outputs of magnitude ~1 (attention averages N(0, 1) values).
ATTENTION_ATOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]

# (num_cached_tokens, num_query_tokens) per row
BATCHES = {
    "mixed": [(0, 5), (16, 1), (0, 1), (7, 9), (31, 1), (20, 12)],
    "decode_only": [(15, 1), (16, 1), (0, 1), (47, 1), (3, 1)],
    "prompt_only": [(0, 16), (0, 3), (16, 16), (5, 11)],
    "single_token_prompts": [(0, 1), (0, 1), (0, 1)],
    "long_context": [(150, 1), (97, 1), (120, 8)],
    "block_multiple": [(0, 32), (32, 1), (16, 16)],
    "rows_without_queries": [(5, 0), (3, 1), (0, 4), (2, 0)],
    # decode contexts from 1 to 64 blocks: computed in length groups (see the test below)
    "varied_decodes": [(1000, 1), (3, 1), (19, 1), (300, 1), (999, 1), (0, 1), (0, 4)],
    # chunks of 3, 5, 17 and 64 tokens after various prefixes: prompt groups of 1 to 3 rows
    # (1, 2, 4 and 9 blocks; test_torch_plan.py checks the groups)
    "prompt_groups": [
        (0, 3), (13, 5), (2, 17), (40, 17), (0, 64), (70, 64), (5, 1), (100, 1), (29, 3), (0, 5)
    ],
    # prompt groups of at least 2 x QUERY_CHUNK query slots, attended in query chunks: a whole
    # prompt (plain causal), a chunk after a prefix, and rows of several lengths padded together
    "query_chunks": [(0, 200), (37, 150), (60, 131), (1, 1), (0, 129)],
}  # fmt: skip


@BOTH
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", BATCHES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (9, 3), (8, 1)])
def test_paged_attention_matches_reference(name, num_heads, num_kv_heads, dtype, attention):
    batch = make_ragged_batch(
        BATCHES[name], num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=64,
        block_size=16, dtype=dtype, seed=list(BATCHES).index(name),
    )  # fmt: skip
    out = run_attention(attention, batch)
    assert out.dtype == dtype
    expected = reference_attention(batch)
    torch.testing.assert_close(out.double(), expected, atol=ATTENTION_ATOL[dtype], rtol=0)


@BOTH
@pytest.mark.parametrize(("block_size", "head_dim"), [(32, 128), (128, 64), (1, 64)])
def test_paged_attention_block_sizes_and_head_dims(block_size, head_dim, attention):
    rows = [(0, 7), (33, 1), (130, 1), (64, 3)]
    batch = make_ragged_batch(
        rows, num_heads=6, num_kv_heads=2, head_dim=head_dim, block_size=block_size,
        dtype=torch.float32, seed=3,
    )  # fmt: skip
    out = run_attention(attention, batch)
    torch.testing.assert_close(out.double(), reference_attention(batch), atol=2e-5, rtol=0)


def test_long_prompt_groups_attend_in_query_chunks():
    plan, _ = _plan_of(BATCHES["query_chunks"])
    chunked = [group for group in plan.prompt_groups if group.query_chunks]
    assert chunked and all(
        [first for first, *_ in group.query_chunks]
        == list(range(0, group.padded_q, torch_attention.QUERY_CHUNK))
        for group in chunked
    )
    # each chunk reads the context up to its last query's position, never less
    for group in chunked:
        for first, end, length, mask in group.query_chunks:
            assert mask.shape[-2:] == (end - first, length) and length <= group.padded_len


def _plan_of(rows):
    batch = make_ragged_batch(
        rows, num_heads=9, num_kv_heads=3, head_dim=64, block_size=16, dtype=torch.float32, seed=1
    )
    metadata = batch.metadata()
    plan = torch_attention.plan_paged_attention(
        metadata.query_start,
        metadata.context_lens,
        metadata.block_tables,
        block_size=16,
        num_kv_heads=3,
        num_tokens=batch.query.shape[0],
    )
    return plan, batch


def test_length_groups_bound_the_padding():
    assert length_groups([1, 2, 3, 9, 16, 4]) == [[0], [1], [2, 5], [3, 4]]
    assert length_groups([5, 5, 5]) == [[0, 1, 2]]


@pytest.mark.parametrize(
    ("name", "function", "num_calls"),
    [
        # 1, 2, 19 and 63 blocks: groups of block counts 1, 2, 17-32, 33-64
        ("varied_decodes", "_attend_decode_group", 4),
        # 1, 2, 4 and 9 blocks
        ("prompt_groups", "_attend_prompt_group", 4),
    ],
)
def test_rows_run_in_length_groups(monkeypatch, name, function, num_calls):
    calls = []
    group = getattr(torch_attention, function)
    monkeypatch.setattr(torch_attention, function, lambda *args: calls.append(1) or group(*args))
    batch = make_ragged_batch(
        BATCHES[name], num_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
        dtype=torch.float32, seed=8,
    )  # fmt: skip
    out = run_attention(sdpa_backend, batch)
    assert len(calls) == num_calls
    torch.testing.assert_close(out.double(), reference_attention(batch), atol=2e-5, rtol=0)


def test_paged_attention_unshuffled_blocks_and_out_argument():
    batch = make_ragged_batch(
        [(3, 1), (0, 4)], num_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
        dtype=torch.float32, seed=5, shuffle_blocks=False,
    )  # fmt: skip
    out = torch.full_like(batch.query, float("nan"))
    returned = run_attention(backend, batch, out=out)
    assert returned is out
    torch.testing.assert_close(out.double(), reference_attention(batch), atol=2e-5, rtol=0)


def test_paged_attention_accepts_a_strided_query_view():
    batch = make_ragged_batch(
        [(10, 1), (0, 6)], num_heads=6, num_kv_heads=2, head_dim=64, block_size=16,
        dtype=torch.float32, seed=9,
    )  # fmt: skip
    num_tokens = batch.query.shape[0]
    fused = torch.randn(num_tokens, 10, 64)  # [num_tokens, q + k + v heads, head_dim]
    fused[:, :6] = batch.query
    strided = fused[:, :6]
    assert not strided.is_contiguous()
    out = run_attention(backend, batch, query=strided)
    torch.testing.assert_close(out.double(), reference_attention(batch), atol=2e-5, rtol=0)


def test_paged_attention_empty_batch():
    batch = make_ragged_batch(
        [], num_heads=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32, seed=0
    )
    out = run_attention(backend, batch)
    assert out.shape == (0, 4, 64)


def _store_step(slot_mapping: list[int], num_kv_heads: int, dtype: torch.dtype, seed: int):
    """One row of ``len(slot_mapping)`` tokens over a one-layer cache of 5 blocks of 4 slots
    (random K/V): (plan, kv_cache)."""
    num_tokens = len(slot_mapping)
    generator = torch.Generator().manual_seed(seed)
    kv_cache = torch.randn(1, 2, 5, 4, num_kv_heads, 64, generator=generator).to(dtype)
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor(slot_mapping),
        query_start=torch.tensor([0, num_tokens], dtype=torch.int32),
        context_lens=torch.tensor([num_tokens], dtype=torch.int32),
        block_tables=torch.tensor([[0, 1, 2, 3, 4]], dtype=torch.int32),
        max_query_len=num_tokens,
        max_context_len=num_tokens,
    )
    return backend.plan(torch.arange(num_tokens), metadata, kv_cache, 64), kv_cache


def test_paged_attention_rejects_a_query_that_does_not_match_the_plan():
    batch = make_ragged_batch(
        [(3, 1), (0, 4)], num_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
        dtype=torch.float32, seed=5,
    )  # fmt: skip
    with pytest.raises(KernelInputError, match="the plan is for 5 tokens"):
        run_attention(backend, batch, query=batch.query[:4])


def test_paged_attention_and_store_kv_reject_bad_tensors_without_writing():
    batch = make_ragged_batch(
        [(3, 1), (0, 4)], num_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
        dtype=torch.float32, seed=5,
    )  # fmt: skip
    out = torch.zeros(1, 4, 64)
    with pytest.raises(KernelInputError, match="out must be"):
        run_attention(backend, batch, out=out)
    assert not out.any()
    with pytest.raises(KernelInputError, match="query is torch.int32"):
        run_attention(backend, batch, query=batch.query.int())
    with pytest.raises(KernelInputError, match="not a multiple of num_kv_heads"):
        run_attention(backend, batch, query=batch.query[:, :3])
    plan, kv_cache = _store_step([3, 1], num_kv_heads=2, dtype=torch.float32, seed=3)
    with pytest.raises(KernelInputError, match="key is torch.int32"):
        key = torch.ones(2, 2, 64, dtype=torch.int32)
        backend.store_kv(key, key, kv_cache[0, 0], kv_cache[0, 1], plan)
    # (the Triton backend's checks: one dtype for the query, the K/V and the caches)
    with pytest.raises(KernelInputError, match="query is torch.float16"):
        check_attention_inputs(batch.query.half(), batch.key_cache, batch.value_cache)
    with pytest.raises(KernelInputError, match="key is torch.float16"):
        key = torch.randn(2, 2, 64, dtype=torch.float16)
        check_kv_inputs(key, key, kv_cache[0, 0], kv_cache[0, 1])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_store_kv_writes_slots_and_skips_padding(dtype):
    generator = torch.Generator().manual_seed(1)
    num_tokens, num_kv_heads, head_dim = 7, 3, 64
    fused = torch.randn(num_tokens, 3 * num_kv_heads, head_dim, generator=generator).to(dtype)
    key, value = fused[:, :num_kv_heads], fused[:, num_kv_heads : 2 * num_kv_heads]  # strided
    slot_mapping = [19, 0, -1, 4, 7, -1, 12]
    plan, kv_cache = _store_step(slot_mapping, num_kv_heads, dtype, seed=2)
    expected_k, expected_v = kv_cache[0, 0].clone(), kv_cache[0, 1].clone()
    reference_store_kv(key, value, expected_k, expected_v, torch.tensor(slot_mapping))
    backend.store_kv(key, value, kv_cache[0, 0], kv_cache[0, 1], plan)
    assert torch.equal(kv_cache[0, 0], expected_k)
    assert torch.equal(kv_cache[0, 1], expected_v)


# (query dtype, cache dtype): the KV cache in a dtype of its own (EngineConfig.kv_cache_dtype)
MIXED_DTYPES = [
    (torch.float32, torch.bfloat16),
    (torch.float32, torch.float16),
    (torch.bfloat16, torch.float32),
    (torch.float32, torch.float8_e4m3fn),
    (torch.bfloat16, torch.float8_e4m3fn),
]


@BOTH
@pytest.mark.parametrize(("query_dtype", "cache_dtype"), MIXED_DTYPES, ids=str)
@pytest.mark.parametrize("name", ["mixed", "varied_decodes", "query_chunks"])
def test_paged_attention_reads_a_cache_of_another_dtype(name, query_dtype, cache_dtype, attention):
    """Queries over a cache of another dtype: the attention of the cache's values (exact in the
    query's dtype, or rounded to it), in the query's dtype, within its tolerance."""
    batch = make_ragged_batch(
        BATCHES[name], num_heads=9, num_kv_heads=3, head_dim=64, block_size=16,
        dtype=cache_dtype, seed=11,
    )  # fmt: skip
    query = batch.query.to(query_dtype)
    out = run_attention(attention, batch, query=query)
    assert out.dtype == query_dtype
    converted = dataclasses.replace(
        batch,
        query=query,
        key_cache=batch.key_cache.to(query_dtype),
        value_cache=batch.value_cache.to(query_dtype),
    )
    expected = reference_attention(converted)
    torch.testing.assert_close(out.double(), expected, atol=ATTENTION_ATOL[query_dtype], rtol=0)


@pytest.mark.parametrize(("key_dtype", "cache_dtype"), MIXED_DTYPES, ids=str)
def test_store_kv_rounds_to_a_cache_of_another_dtype(key_dtype, cache_dtype):
    generator = torch.Generator().manual_seed(4)
    key = torch.randn(5, 2, 64, generator=generator).to(key_dtype)
    value = torch.randn(5, 2, 64, generator=generator).to(key_dtype)
    slot_mapping = [3, -1, 17, 0, 9]
    plan, kv_cache = _store_step(slot_mapping, num_kv_heads=2, dtype=cache_dtype, seed=6)
    expected_k, expected_v = kv_cache[0, 0].clone(), kv_cache[0, 1].clone()
    reference_store_kv(
        key.to(cache_dtype), value.to(cache_dtype), expected_k, expected_v,
        torch.tensor(slot_mapping),
    )  # fmt: skip
    backend.store_kv(key, value, kv_cache[0, 0], kv_cache[0, 1], plan)
    assert torch.equal(kv_cache[0, 0], expected_k)
    assert torch.equal(kv_cache[0, 1], expected_v)


def test_store_kv_rejects_a_mismatched_token_count_without_writing():
    plan, kv_cache = _store_step([3, 1, -1], num_kv_heads=2, dtype=torch.float32, seed=3)
    before = kv_cache.clone()
    key = torch.randn(2, 2, 64)
    with pytest.raises(KernelInputError, match="do not match the step's plan"):
        backend.store_kv(key, key, kv_cache[0, 0], kv_cache[0, 1], plan)
    assert torch.equal(kv_cache, before)


RMS_TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2)}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(dtype, with_residual):
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(11, 96, generator=generator).to(dtype)
    weight = (1 + 0.1 * torch.randn(96, generator=generator)).to(dtype)
    residual = torch.randn(11, 96, generator=generator).to(dtype) if with_residual else None
    atol, rtol = RMS_TOL[dtype]
    normed, summed = backend.rms_norm(x, weight, 1e-6, residual)
    expected = reference_rms_norm(x, weight, 1e-6, residual)
    assert normed.dtype == dtype
    if with_residual:
        torch.testing.assert_close(normed, expected[0], atol=atol, rtol=rtol)
        assert torch.equal(summed, expected[1])
    else:
        torch.testing.assert_close(normed, expected, atol=atol, rtol=rtol)
        assert summed is x


ROTARY_ATOL = {torch.float32: 5e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rotary_matches_reference_on_fused_query_and_key_heads(dtype, head_dim):
    generator = torch.Generator().manual_seed(4)
    num_tokens, num_heads, num_kv_heads = 9, 6, 2
    fused = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, generator=generator)
    fused = fused.to(dtype)  # [num_tokens, q + k + v heads, head_dim]
    heads = fused[:, : num_heads + num_kv_heads]  # query and key heads side by side
    value_before = fused[:, num_heads + num_kv_heads :].clone()
    positions = torch.tensor([0, 1, 2, 3, 100, 7, 8, 300, 511])
    expected = reference_rotary(positions, heads, 10000.0, head_dim)
    rope = backend.rope(positions, build_cos_sin_cache(head_dim, 512, 10000.0, None))
    rotated = backend.rotary(heads, rope)
    assert rotated.dtype == dtype and rotated.shape == heads.shape
    torch.testing.assert_close(rotated.double(), expected, atol=ROTARY_ATOL[dtype], rtol=0)
    assert torch.equal(fused[:, num_heads + num_kv_heads :], value_before)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_mul_matches_pytorch(dtype):
    generator = torch.Generator().manual_seed(5)
    gate_up = (3 * torch.randn(7, 2 * 80, generator=generator)).to(dtype)
    got = backend.silu_mul(gate_up)
    want = (F.silu(gate_up[:, :80].double()) * gate_up[:, 80:].double()).to(dtype)
    assert got.dtype == dtype and got.shape == (7, 80)
    torch.testing.assert_close(got, want, atol=RMS_TOL[dtype][0], rtol=RMS_TOL[dtype][1])


@pytest.mark.skipif(not backend.cpu_kernel, reason="the C++ operators are not built")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_norm_rotary_and_silu_of_a_row_do_not_depend_on_the_other_rows(dtype):
    """The CPU's ``rms_norm_rows``, ``rotary_rows`` and ``silu_mul_rows`` (the decode stack's
    arithmetic): a row alone gives the bits it gives among 37, near PyTorch's own."""
    generator = torch.Generator().manual_seed(6)
    x = torch.randn(37, 576, generator=generator).to(dtype)
    residual = torch.randn(37, 576, generator=generator).to(dtype)
    weight = (1 + 0.1 * torch.randn(576, generator=generator)).to(dtype)
    qkv = torch.randn(37, 15, 64, generator=generator).to(dtype)
    heads = qkv[:, :12]  # query and key heads of a fused QKV: a strided view
    rope = backend.rope(torch.arange(37) * 7, build_cos_sin_cache(64, 512, 10000.0, None))
    gate_up = (3 * torch.randn(37, 2 * 1536, generator=generator)).to(dtype)
    assert backend._row_ops(x)
    normed, summed = backend.rms_norm(x, weight, 1e-5, residual)
    first, _ = backend.rms_norm(x, weight, 1e-5)
    rotated = backend.rotary(heads, rope)
    act = backend.silu_mul(gate_up)
    for t in (0, 18, 36):
        one = slice(t, t + 1)
        alone, alone_summed = backend.rms_norm(x[one], weight, 1e-5, residual[one])
        assert torch.equal(alone, normed[one]) and torch.equal(alone_summed, summed[one])
        assert torch.equal(backend.rms_norm(x[one], weight, 1e-5)[0], first[one])
        row_rope = (rope[0][one], rope[1][one])
        assert torch.equal(backend.rotary(heads[one], row_rope), rotated[one])
        assert torch.equal(backend.silu_mul(gate_up[one]), act[one])
    atol, rtol = RMS_TOL[dtype]
    want_normed, want_summed = sdpa_backend.rms_norm(x, weight, 1e-5, residual)
    torch.testing.assert_close(normed, want_normed, atol=atol, rtol=rtol)
    assert torch.equal(summed, want_summed)
    torch.testing.assert_close(rotated, sdpa_backend.rotary(heads, rope), atol=atol, rtol=rtol)
    torch.testing.assert_close(act, sdpa_backend.silu_mul(gate_up), atol=atol, rtol=rtol)


_SILU_BITS = """
import sys, torch
from kernels.cpu_ops import load
load()
generator = torch.Generator().manual_seed(7)
gate_up = 20 * torch.randn(37, 2 * 1541, generator=generator)
special = [float("nan"), float("inf"), -float("inf"), -87.0, 87.0, -88.0, 0.0, -0.0]
gate_up.view(-1)[:64] = torch.tensor(special * 8)
gate_up.view(-1)[64:128] = torch.linspace(-100, 100, 64)
gate_up[:, 1541:1541 + 64] = torch.tensor(special * 8)  # up values too
rows = torch.ops.splitfuse_cpu.silu_mul_rows
torch.save([rows(gate_up), rows(gate_up.bfloat16())], sys.argv[1])
"""


@pytest.mark.skipif(not backend.cpu_kernel, reason="the C++ operators are not built")
@pytest.mark.skipif("avx2" not in cpu_flags(), reason="this CPU has no AVX2")
def test_silu_rows_on_avx2_give_the_loops_bits(tmp_path):
    """``silu_mul_rows`` held to AVX2 (the vector SiLU of CPUs without AVX-512) gives the bits of
    the per-value loop (``SPLITFUSE_CPU_ISA=sse2``), NaN, infinities, the clamp at -87 and a row
    length that is not a whole number of vectors included."""
    results = {}
    for isa in ("avx2", "sse2"):
        path = tmp_path / f"{isa}.pt"
        done = subprocess.run(
            [sys.executable, "-c", _SILU_BITS, str(path)],
            env={**os.environ, "SPLITFUSE_CPU_ISA": isa},
            capture_output=True,
            text=True,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        results[isa] = torch.load(path)
    for got, want in zip(results["avx2"], results["sse2"], strict=True):
        bits = torch.int32 if got.dtype == torch.float32 else torch.int16
        assert torch.equal(got.view(bits), want.view(bits))


def test_rope_rows_are_the_tables_rows_of_the_positions():
    cache = build_cos_sin_cache(64, 32, 10000.0, None)
    positions = torch.tensor([5, 0, 31, 5])
    cos, sin = backend.rope(positions, cache)
    assert cos.shape == sin.shape == (4, 1, 64) and cos.dtype == sin.dtype == torch.float32
    rows = cache[positions][:, None, :]
    assert torch.equal(cos, torch.cat((rows[..., :32], rows[..., :32]), -1))
    assert torch.equal(sin, torch.cat((-rows[..., 32:], rows[..., 32:]), -1))


ROPE_SCALINGS = {
    "none": None,
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
}


@pytest.mark.parametrize("name", ROPE_SCALINGS)
def test_cos_sin_cache_matches_transformers(name):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    base, head_dim, max_position = 500000.0, 64, 256
    scaling = ROPE_SCALINGS[name]
    rope_parameters = {"rope_type": "default", **(scaling or {}), "rope_theta": base}
    config = LlamaConfig(
        hidden_size=4 * head_dim, num_attention_heads=4, max_position_embeddings=max_position,
        rope_parameters=rope_parameters,
    )  # fmt: skip
    cos, sin = LlamaRotaryEmbedding(config)(
        torch.zeros(1, max_position, head_dim), torch.arange(max_position)[None]
    )
    cache = build_cos_sin_cache(head_dim, max_position, base, scaling)
    half = head_dim // 2
    assert cache.shape == (max_position, head_dim) and cache.dtype == torch.float32
    torch.testing.assert_close(cache[:, :half], cos[0, :, :half], atol=1e-6, rtol=0)
    torch.testing.assert_close(cache[:, half:], sin[0, :, :half], atol=1e-6, rtol=0)


def test_cos_sin_cache_rejects_unknown_scaling():
    with pytest.raises(ValueError, match="unsupported rope scaling"):
        build_cos_sin_cache(64, 16, 10000.0, {"rope_type": "yarn", "factor": 2.0})
    with pytest.raises(ValueError, match="factor"):
        build_cos_sin_cache(64, 16, 10000.0, {"type": "linear"})


def test_get_backend_names_and_unknown_backend():
    assert get_backend("torch").name == "torch" and set(BACKENDS) == {"torch", "triton"}
    with pytest.raises(ValueError, match="unknown kernel backend"):
        get_backend("cuda")


def test_decode_only_steps_return_the_attention_itself_contiguous():
    """A step of decodes alone returns its one attention call's output (no copy): it must be
    contiguous, as ``splitfuse::attend`` promises a compiled graph."""
    batch = make_ragged_batch(
        BATCHES["decode_only"], num_heads=9, num_kv_heads=3, head_dim=64, block_size=16,
        dtype=torch.bfloat16, seed=4,
    )  # fmt: skip
    out = run_attention(backend, batch)
    assert out.is_contiguous() and out.shape == batch.query.shape
    expected = reference_attention(batch)
    torch.testing.assert_close(out.double(), expected, atol=ATTENTION_ATOL[torch.bfloat16], rtol=0)
