"""The PyTorch ops against the float64 references in kernel_reference.py."""

from __future__ import annotations

import pytest
import torch
from kernel_reference import (
    make_ragged_batch,
    reference_attention,
    reference_rms_norm,
    reference_rotary,
    reference_store_kv,
)

from kernels import KernelInputError, build_cos_sin_cache, get_ops, torch_attention
from kernels.torch_attention import length_groups

ops = get_ops("torch")

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
    # decode contexts from 1 to 64 blocks: computed in length groups (see the test below)
    "varied_decodes": [(1000, 1), (3, 1), (19, 1), (300, 1), (999, 1), (0, 1), (0, 4)],
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", BATCHES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (9, 3), (8, 1)])
def test_paged_attention_matches_reference(name, num_heads, num_kv_heads, dtype):
    batch = make_ragged_batch(
        BATCHES[name], num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=64,
        block_size=16, dtype=dtype, seed=list(BATCHES).index(name),
    )  # fmt: skip
    out = ops.paged_attention(*batch.attention_args())
    assert out.dtype == dtype
    expected = reference_attention(batch)
    torch.testing.assert_close(out.double(), expected, atol=ATTENTION_ATOL[dtype], rtol=0)


@pytest.mark.parametrize(("block_size", "head_dim"), [(32, 128), (128, 64), (1, 64)])
def test_paged_attention_block_sizes_and_head_dims(block_size, head_dim):
    rows = [(0, 7), (33, 1), (130, 1), (64, 3)]
    batch = make_ragged_batch(
        rows, num_heads=6, num_kv_heads=2, head_dim=head_dim, block_size=block_size,
        dtype=torch.float32, seed=3,
    )  # fmt: skip
    out = ops.paged_attention(*batch.attention_args())
    torch.testing.assert_close(out.double(), reference_attention(batch), atol=2e-5, rtol=0)


def test_length_groups_bound_the_padding():
    assert length_groups([1, 2, 3, 9, 16, 4]) == [[0], [1], [2, 5], [3, 4]]
    assert length_groups([5, 5, 5]) == [[0, 1, 2]]


def test_varied_decode_contexts_run_in_length_groups(monkeypatch):
    calls = []
    group = torch_attention._attend_decode_group
    monkeypatch.setattr(
        torch_attention, "_attend_decode_group", lambda *args: calls.append(1) or group(*args)
    )
    batch = make_ragged_batch(
        BATCHES["varied_decodes"], num_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
        dtype=torch.float32, seed=8,
    )  # fmt: skip
    out = ops.paged_attention(*batch.attention_args())
    assert len(calls) == 4  # 1, 2, 19 and 63 blocks: groups of block counts 1, 2, 17-32, 33-64
    torch.testing.assert_close(out.double(), reference_attention(batch), atol=2e-5, rtol=0)


def test_paged_attention_unshuffled_blocks_and_out_argument():
    batch = make_ragged_batch(
        [(3, 1), (0, 4)], num_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
        dtype=torch.float32, seed=5, shuffle_blocks=False,
    )  # fmt: skip
    out = torch.full_like(batch.query, float("nan"))
    returned = ops.paged_attention(*batch.attention_args(), out=out)
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
    out = ops.paged_attention(strided, *batch.attention_args()[1:])
    torch.testing.assert_close(out.double(), reference_attention(batch), atol=2e-5, rtol=0)


def test_paged_attention_empty_batch():
    batch = make_ragged_batch(
        [], num_heads=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32, seed=0
    )
    out = ops.paged_attention(*batch.attention_args())
    assert out.shape == (0, 4, 64)


def test_paged_attention_rejects_bad_inputs():
    batch = make_ragged_batch(
        [(3, 1), (0, 4)], num_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
        dtype=torch.float32, seed=5,
    )  # fmt: skip
    args = list(batch.attention_args())
    with pytest.raises(KernelInputError, match="query_start must be torch.int32"):
        ops.paged_attention(args[0], args[1], args[2], args[3].long(), *args[4:])
    with pytest.raises(KernelInputError, match="not a multiple of num_kv_heads"):
        ops.paged_attention(args[0][:, :3], *args[1:])
    with pytest.raises(KernelInputError, match="query is torch.float16"):
        ops.paged_attention(args[0].half(), *args[1:])
    with pytest.raises(KernelInputError, match="capacity"):
        ops.paged_attention(*args[:8], 10_000)
    with pytest.raises(KernelInputError, match="out must be"):
        ops.paged_attention(*args, out=torch.empty(1, 4, 64))
    too_long = batch.context_lens.clone()
    too_long[0] = batch.block_tables.shape[1] * 16 + 1
    with pytest.raises(KernelInputError, match="context_lens"):
        ops.paged_attention(*args[:4], too_long, *args[5:])
    with pytest.raises(KernelInputError, match="query_start must run from 0 to num_tokens"):
        ops.paged_attention(args[0][:-1], *args[1:])
    too_short = batch.context_lens.clone()
    too_short[1] = 3  # a row of 4 query tokens
    out = torch.zeros_like(batch.query)
    with pytest.raises(KernelInputError, match="row 1 of 4 query tokens has context_len 3"):
        ops.paged_attention(*args[:4], too_short, *args[5:], out=out)
    assert not out.any()  # the decode row before it was not written either


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_store_kv_writes_slots_and_skips_padding(dtype):
    generator = torch.Generator().manual_seed(1)
    num_tokens, num_kv_heads, head_dim = 7, 3, 64
    fused = torch.randn(num_tokens, 3 * num_kv_heads, head_dim, generator=generator).to(dtype)
    key, value = fused[:, :num_kv_heads], fused[:, num_kv_heads : 2 * num_kv_heads]  # strided
    key_cache = torch.randn(5, 4, num_kv_heads, head_dim, generator=generator).to(dtype)
    value_cache = torch.randn(5, 4, num_kv_heads, head_dim, generator=generator).to(dtype)
    slot_mapping = torch.tensor([19, 0, -1, 4, 7, -1, 12])
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    reference_store_kv(key, value, expected_k, expected_v, slot_mapping)
    ops.store_kv(key, value, key_cache, value_cache, slot_mapping)
    assert torch.equal(key_cache, expected_k)
    assert torch.equal(value_cache, expected_v)


def test_store_kv_rejects_bad_inputs_without_writing():
    key = torch.randn(2, 2, 8)
    key_cache, value_cache = torch.zeros(3, 4, 2, 8), torch.zeros(3, 4, 2, 8)
    for bad_slots in ([1, 12], [-2, 1]):
        with pytest.raises(KernelInputError, match="slot_mapping must hold -1 or slots"):
            ops.store_kv(key, key, key_cache, value_cache, torch.tensor(bad_slots))
    assert not key_cache.any() and not value_cache.any()
    with pytest.raises(KernelInputError, match="slot_mapping must be torch.int64"):
        ops.store_kv(key, key, key_cache, value_cache, torch.tensor([1, 2], dtype=torch.int32))
    with pytest.raises(KernelInputError, match="key must be"):
        ops.store_kv(key[:, :1], key, key_cache, value_cache, torch.tensor([1, 2]))
    with pytest.raises(KernelInputError, match="contiguous"):
        ops.store_kv(key, key, key_cache.mT, value_cache.mT, torch.tensor([1, 2]))


RMS_TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2)}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(dtype, with_residual):
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(11, 96, generator=generator).to(dtype)
    weight = (1 + 0.1 * torch.randn(96, generator=generator)).to(dtype)
    residual = torch.randn(11, 96, generator=generator).to(dtype) if with_residual else None
    atol, rtol = RMS_TOL[dtype]
    got = ops.rms_norm(x, weight, 1e-6, residual)
    expected = reference_rms_norm(x, weight, 1e-6, residual)
    if with_residual:
        torch.testing.assert_close(got[0], expected[0], atol=atol, rtol=rtol)
        assert torch.equal(got[1], expected[1])
    else:
        assert got.dtype == dtype
        torch.testing.assert_close(got, expected, atol=atol, rtol=rtol)


def test_rms_norm_rejects_bad_inputs():
    x = torch.randn(3, 8)
    with pytest.raises(KernelInputError, match="weight must be"):
        ops.rms_norm(x, torch.ones(7), 1e-6)
    with pytest.raises(KernelInputError, match="residual must be"):
        ops.rms_norm(x, torch.ones(8), 1e-6, torch.randn(3, 8, dtype=torch.float64))
    with pytest.raises(KernelInputError, match="eps"):
        ops.rms_norm(x, torch.ones(8), 0.0)


ROTARY_ATOL = {torch.float32: 5e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rotary_embedding_in_place_on_fused_views(dtype, head_dim):
    generator = torch.Generator().manual_seed(4)
    num_tokens, num_heads, num_kv_heads = 9, 6, 2
    fused = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, generator=generator)
    fused = fused.to(dtype)
    query, key = fused[:, :num_heads], fused[:, num_heads : num_heads + num_kv_heads]
    value_before = fused[:, num_heads + num_kv_heads :].clone()
    positions = torch.tensor([0, 1, 2, 3, 100, 7, 8, 300, 511])
    expected_q = reference_rotary(positions, query, 10000.0, head_dim)
    expected_k = reference_rotary(positions, key, 10000.0, head_dim)
    cache = build_cos_sin_cache(head_dim, 512, 10000.0, None)
    ops.rotary_embedding(positions, query, key, cache)
    torch.testing.assert_close(query.double(), expected_q, atol=ROTARY_ATOL[dtype], rtol=0)
    torch.testing.assert_close(key.double(), expected_k, atol=ROTARY_ATOL[dtype], rtol=0)
    assert torch.equal(fused[:, num_heads + num_kv_heads :], value_before)


@pytest.mark.parametrize("layout", ["separate", "key_before_query"])
def test_rotary_embedding_on_tensors_that_are_not_adjacent(layout):
    generator = torch.Generator().manual_seed(6)
    if layout == "separate":
        query, key = torch.randn(5, 4, 64, generator=generator), torch.randn(5, 2, 64)
    else:
        fused = torch.randn(5, 6, 64, generator=generator)
        key, query = fused[:, :2], fused[:, 2:]
    positions = torch.tensor([0, 9, 3, 40, 2])
    expected_q = reference_rotary(positions, query, 10000.0, 64)
    expected_k = reference_rotary(positions, key, 10000.0, 64)
    ops.rotary_embedding(positions, query, key, build_cos_sin_cache(64, 64, 10000.0, None))
    torch.testing.assert_close(query.double(), expected_q, atol=1e-5, rtol=0)
    torch.testing.assert_close(key.double(), expected_k, atol=1e-5, rtol=0)


def test_rotary_embedding_rejects_bad_inputs_without_writing():
    query, key = torch.randn(2, 4, 64), torch.randn(2, 2, 64)
    cache = build_cos_sin_cache(64, 16, 10000.0, None)
    query_before = query.clone()
    with pytest.raises(IndexError):
        ops.rotary_embedding(torch.tensor([1, 16]), query, key, cache)
    assert torch.equal(query, query_before)
    with pytest.raises(KernelInputError, match="positions must be torch.int64"):
        ops.rotary_embedding(torch.tensor([1, 2], dtype=torch.int32), query, key, cache)
    with pytest.raises(KernelInputError, match="cos_sin_cache must be float32"):
        ops.rotary_embedding(torch.tensor([1, 2]), query, key, cache.double())


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


def test_get_ops_rejects_unknown_backend():
    with pytest.raises(ValueError, match="unknown kernel backend"):
        get_ops("cuda")
