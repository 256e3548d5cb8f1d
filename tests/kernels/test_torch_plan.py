"""The per-step path (plan once, lean ops per layer) against the checked ops and the references."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from kernel_reference import make_ragged_batch, reference_attention
from test_torch_ops import ATTENTION_ATOL, BATCHES

from kernels import KernelInputError, build_cos_sin_cache, get_ops
from kernels.torch_attention import paged_attention_planned, plan_paged_attention

ops = get_ops("torch")

PLANNED_BATCHES = ["decode_only", "prompt_only", "mixed", "varied_decodes", "long_context"]


def _plan(batch):
    return plan_paged_attention(
        batch.query_start,
        batch.context_lens,
        batch.block_tables,
        block_size=batch.key_cache.shape[1],
        num_kv_heads=batch.key_cache.shape[2],
        num_tokens=batch.query.shape[0],
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", PLANNED_BATCHES)
def test_planned_attention_equals_the_checked_op_for_every_layer(name, dtype):
    """One plan serves several layers (caches) and equals the one-call op on each."""
    first = make_ragged_batch(
        BATCHES[name], num_heads=9, num_kv_heads=3, head_dim=64, block_size=16, dtype=dtype,
        seed=11,
    )  # fmt: skip
    # another layer: the same metadata over other K/V and queries (NaN stays where nothing is)
    second = replace(
        first,
        query=torch.randn(first.query.shape).to(dtype),
        key_cache=-first.key_cache,
        value_cache=first.value_cache.flip(-1),
    )
    layers = [first, second]
    plan = _plan(layers[0])
    for batch in layers:
        planned = paged_attention_planned(
            batch.query, batch.key_cache, batch.value_cache, plan, batch.scale
        )
        assert torch.equal(planned, ops.paged_attention(*batch.attention_args()))
        expected = reference_attention(batch)
        torch.testing.assert_close(planned.double(), expected, atol=ATTENTION_ATOL[dtype], rtol=0)


def test_plan_rows_and_length_groups():
    batch = make_ragged_batch(
        BATCHES["varied_decodes"], num_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
        dtype=torch.float32, seed=8,
    )  # fmt: skip
    plan = _plan(batch)
    # 1, 2, 19 and 63 blocks: groups of block counts 1, 2, 17-32, 33-64; one prompt row
    assert sorted(group.num_rows for group in plan.decode_groups) == [1, 1, 2, 2]
    assert [(row.start, row.end, row.ctx_len) for row in plan.prompt_rows] == [(6, 10, 4)]
    decode_only = make_ragged_batch(
        BATCHES["decode_only"], num_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
        dtype=torch.float32, seed=8,
    )  # fmt: skip
    plan = _plan(decode_only)
    (group,) = plan.decode_groups
    assert group.tokens == slice(0, 5) and group.padded_len == 48 and not plan.prompt_rows
    assert group.mask is not None and group.mask.sum() == int(decode_only.context_lens.sum())
    # every (slot, head) row read is inside the cache
    num_rows = decode_only.key_cache.numel() // 64
    assert group.kv_rows.shape == (5 * 2 * 48,) and int(group.kv_rows.max()) < num_rows


def test_plan_rejects_bad_metadata_and_mismatched_tensors():
    batch = make_ragged_batch(
        [(3, 1), (0, 4)], num_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
        dtype=torch.float32, seed=5,
    )  # fmt: skip
    too_short = batch.context_lens.clone()
    too_short[1] = 3
    with pytest.raises(KernelInputError, match="row 1 of 4 query tokens has context_len 3"):
        plan_paged_attention(
            batch.query_start, too_short, batch.block_tables, block_size=16, num_kv_heads=2,
            num_tokens=5,
        )  # fmt: skip
    with pytest.raises(KernelInputError, match="query_start must run from 0 to num_tokens 6"):
        plan_paged_attention(
            batch.query_start, batch.context_lens, batch.block_tables, block_size=16,
            num_kv_heads=2, num_tokens=6,
        )  # fmt: skip
    plan = _plan(batch)
    with pytest.raises(KernelInputError, match="the plan is for 5 tokens"):
        paged_attention_planned(batch.query[:4], batch.key_cache, batch.value_cache, plan, 0.1)


def _step(slot_mapping, positions, max_position=64, num_slots=20):
    query_start = torch.tensor([0, len(positions)], dtype=torch.int32)
    return ops.plan_step(
        torch.tensor(positions),
        torch.tensor(slot_mapping),
        query_start,
        torch.tensor([len(positions)], dtype=torch.int32),
        torch.tensor([[0, 1, 2, 3, 4]], dtype=torch.int32),
        build_cos_sin_cache(64, max_position, 10000.0, None),
        block_size=4,
        num_kv_heads=3,
        num_slots=num_slots,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_planned_store_and_rotary_equal_the_checked_ops(dtype):
    generator = torch.Generator().manual_seed(1)
    num_tokens, num_heads, num_kv_heads = 7, 6, 3
    positions = [0, 1, 2, 3, 4, 5, 63]
    slot_mapping = [19, 0, -1, 4, 7, -1, 12]
    plan = _step(slot_mapping, positions)
    fused = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, 64, generator=generator)
    fused = fused.to(dtype)  # [num_tokens, q + k + v heads, head_dim]
    expected = fused.clone()
    query, key = expected[:, :num_heads], expected[:, num_heads : num_heads + num_kv_heads]
    cache = build_cos_sin_cache(64, 64, 10000.0, None)
    ops.rotary_embedding(torch.tensor(positions), query, key, cache)
    ops.rotary_embedding_planned(fused[:, : num_heads + num_kv_heads], plan)
    assert torch.equal(fused, expected)

    caches = [torch.randn(5, 4, num_kv_heads, 64, generator=generator).to(dtype) for _ in "kv"]
    expected_caches = [cache.clone() for cache in caches]
    key, value = fused[:, num_heads : num_heads + 3], fused[:, num_heads + 3 :]
    ops.store_kv(key, value, *expected_caches, torch.tensor(slot_mapping))
    ops.store_kv_planned(key, value, *caches, plan)
    assert all(torch.equal(a, b) for a, b in zip(caches, expected_caches, strict=True))


def test_plan_step_rejects_slots_and_positions_out_of_range():
    with pytest.raises(KernelInputError, match="slot_mapping must hold -1 or slots in"):
        _step([0, 20], [0, 1])
    with pytest.raises(KernelInputError, match="slot_mapping must hold -1 or slots in"):
        _step([-2, 1], [0, 1])
    with pytest.raises(KernelInputError, match="positions must be in"):
        _step([0, 1], [0, 64])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_add_rms_norm_equals_rms_norm(dtype):
    generator = torch.Generator().manual_seed(2)
    x, residual = (torch.randn(5, 96, generator=generator).to(dtype) for _ in range(2))
    weight = (1 + 0.1 * torch.randn(96, generator=generator)).to(dtype)
    normed, summed = ops.add_rms_norm(x, residual, weight, 1e-6)
    expected_normed, expected_summed = ops.rms_norm(x, weight, 1e-6, residual)
    assert torch.equal(normed, expected_normed) and torch.equal(summed, expected_summed)
    normed, summed = ops.add_rms_norm(x, None, weight, 1e-6)
    assert torch.equal(normed, ops.rms_norm(x, weight, 1e-6)) and summed is x
    with pytest.raises(KernelInputError, match="residual"):
        ops.add_rms_norm(x, residual[:2], weight, 1e-6)
