"""The torch backend's step plan: checked once, reused by every layer, and its length groups."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from kernel_reference import (
    make_ragged_batch,
    reference_attention,
    reference_store_kv,
    run_attention,
    step_inputs,
)
from test_torch_ops import ATTENTION_ATOL, BATCHES

from kernels import KernelInputError, get_backend
from kernels.cpu_ops import has_fixed_order_attention
from kernels.torch_backend import TorchBackend

backend = get_backend("torch")
sdpa_backend = TorchBackend(cpu_kernel=False)  # decodes in length groups

PLANNED_BATCHES = ["decode_only", "prompt_only", "mixed", "varied_decodes", "prompt_groups"]


def _assert_same(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal, NaN (unused cache slots) included."""
    torch.testing.assert_close(actual, expected, atol=0, rtol=0, equal_nan=True)


def _token_indices(index: torch.Tensor | slice) -> list[int]:
    return list(range(index.start, index.stop)) if isinstance(index, slice) else index.tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", PLANNED_BATCHES)
def test_one_plan_serves_every_layer(name, dtype):
    """One plan over a two-layer cache equals a plan per layer, and the reference, on each."""
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
    kv_cache = torch.cat([batch.kv_cache() for batch in layers])  # [2, 2, blocks, ...]
    positions, metadata, _ = step_inputs(first)
    plan = backend.plan(positions, metadata, kv_cache, first.max_position)
    for layer, batch in enumerate(layers):
        key_cache, value_cache = kv_cache[layer]
        out = backend.paged_attention(batch.query, key_cache, value_cache, plan, batch.scale)
        assert torch.equal(out, run_attention(backend, batch))
        expected = reference_attention(batch)
        torch.testing.assert_close(out.double(), expected, atol=ATTENTION_ATOL[dtype], rtol=0)


def _plan(rows, block_size=16, seed=8, planner=sdpa_backend):
    batch = make_ragged_batch(
        rows, num_heads=4, num_kv_heads=2, head_dim=64, block_size=block_size,
        dtype=torch.float32, seed=seed,
    )  # fmt: skip
    positions, metadata, kv_cache = step_inputs(batch)
    return planner.plan(positions, metadata, kv_cache, batch.max_position).attention, batch


@pytest.mark.skipif(not has_fixed_order_attention(), reason="the C++ operators did not build")
def test_plan_gives_decodes_to_the_cpu_kernel():
    """Decode tokens go to ``splitfuse_cpu::fixed_order_attention`` (each sees its whole
    context); prompt chunks stay in groups; deterministic mode gives it every token."""
    plan, batch = _plan(BATCHES["mixed"], planner=backend)
    # rows (cached, query): (0, 5), (16, 1), (0, 1), (7, 9), (31, 1), (20, 12)
    kernel = plan.kernel_tokens
    assert not plan.decode_groups and _token_indices(kernel.tokens) == [5, 6, 16]
    assert kernel.rows.tolist() == [1, 2, 4] and kernel.lens.tolist() == [17, 1, 32]
    assert sorted(t for g in plan.prompt_groups for t in _token_indices(g.tokens)) == [
        *range(5),
        *range(7, 16),
        *range(17, 29),
    ]
    plan, _ = _plan(BATCHES["mixed"], planner=TorchBackend(deterministic=True))
    kernel = plan.kernel_tokens
    assert not plan.decode_groups and not plan.prompt_groups and kernel.tokens == slice(0, 29)
    assert kernel.lens.tolist()[:7] == [1, 2, 3, 4, 5, 17, 1]
    assert kernel.lens.tolist()[7:16] == list(range(8, 17))


def test_plan_decode_groups():
    plan, _ = _plan(BATCHES["varied_decodes"])
    # 1, 2, 19 and 63 blocks: groups of block counts 1, 2, 17-32, 33-64; one prompt row
    assert sorted(group.num_rows for group in plan.decode_groups) == [1, 1, 2, 2]
    (prompt,) = plan.prompt_groups
    assert (prompt.num_rows, prompt.padded_q, prompt.padded_len) == (1, 4, 4)
    assert prompt.tokens == slice(6, 10) and prompt.valid == slice(0, 4)
    assert prompt.mask is None  # a whole prompt: plain causal
    plan, decode_only = _plan(BATCHES["decode_only"])
    (group,) = plan.decode_groups
    assert group.tokens == slice(0, 5) and group.padded_len == 48 and not plan.prompt_groups
    assert group.mask is not None and group.mask.sum() == int(decode_only.context_lens.sum())
    # every (slot, head) row read is inside the cache
    num_rows = decode_only.key_cache.numel() // 64
    assert group.kv_rows.shape == (5 * 2 * 48,) and int(group.kv_rows.max()) < num_rows


def test_plan_prompt_groups_of_several_chunk_lengths():
    plan, batch = _plan(BATCHES["prompt_groups"])
    # prompt rows by block count: 1 (rows 0, 9), 2 (rows 1, 2, 8), 4 (rows 3, 4), 9 (row 5)
    shapes = [(group.num_rows, group.padded_q, group.padded_len) for group in plan.prompt_groups]
    assert shapes == [(2, 5, 5), (3, 17, 32), (2, 64, 64), (1, 64, 134)]
    assert all(group.mask is not None for group in plan.prompt_groups)
    assert plan.prompt_groups[3].tokens == slice(106, 170)
    assert _token_indices(plan.prompt_groups[0].tokens) == [0, 1, 2, 175, 176, 177, 178, 179]
    # every query token is computed once, by one decode or prompt group
    tokens = [
        token
        for group in (*plan.decode_groups, *plan.prompt_groups)
        for token in _token_indices(group.tokens)
    ]
    assert sorted(tokens) == list(range(batch.query.shape[0]))
    for group in plan.prompt_groups:
        assert len(_token_indices(group.valid)) == len(_token_indices(group.tokens))
        assert group.query_rows.shape == (group.num_rows * group.padded_q,)


def test_prompt_group_of_the_documented_example():
    """Two rows, (cached 2, query 2) and (cached 0, query 3), in one group (``PromptGroup``)."""
    plan, _ = _plan([(2, 2), (0, 3)], block_size=4)
    (group,) = plan.prompt_groups
    assert (group.num_rows, group.padded_q, group.padded_len) == (2, 3, 4)
    assert group.query_rows.tolist() == [0, 1, 1, 2, 3, 4]  # padding repeats a row's last token
    expected_mask = [
        [[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 1]],
        [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0]],
    ]
    assert group.mask is not None and group.mask[:, 0].int().tolist() == expected_mask
    assert _token_indices(group.valid) == [0, 1, 3, 4, 5] and group.tokens == slice(0, 5)


def _rejected_batch():
    """Rows (cached 3, query 1) and (cached 0, query 4): 5 tokens, block tables of 2 blocks of
    16 (capacity 32), 5 blocks of 16 slots in the cache."""
    return make_ragged_batch(
        [(3, 1), (0, 4)], num_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
        dtype=torch.float32, seed=5,
    )  # fmt: skip


def _int32(*values):
    return torch.tensor(values, dtype=torch.int32)


# name -> (changes to the metadata, or positions / kv_cache / max_position; the error's words)
BAD_STEPS = {
    "positions int32": ({"positions": torch.tensor([3, 0, 1, 2, 3], dtype=torch.int32)},
                        "positions must be torch.int64"),
    "position past the table": ({"max_position": 3}, r"positions must be in \[0, 3\)"),
    "negative position": ({"positions": torch.tensor([3, 0, 1, -1, 3])}, "positions must be in"),
    "slot_mapping int32": ({"slot_mapping": _int32(0, 1, 2, 3, 4)},
                           "slot_mapping must be torch.int64"),
    "slot_mapping short": ({"slot_mapping": torch.tensor([0, 1, 2, 3])},
                           "slot_mapping has 4 slots for 5 tokens"),
    "slot past the cache": ({"slot_mapping": torch.tensor([0, 1, 2, 3, 80])},
                            r"slot_mapping must hold -1 or slots in \[0, 80\)"),
    "slot below -1": ({"slot_mapping": torch.tensor([0, -2, 2, 3, 4])},
                      "slot_mapping must hold -1 or slots"),
    "query_start int64": ({"query_start": torch.tensor([0, 1, 5])},
                          "query_start must be torch.int32"),
    "query_start rows": ({"query_start": _int32(0, 5)}, "query_start has 2 entries for 2 rows"),
    "block_tables 1-D": ({"block_tables": _int32(0, 1)}, "block_tables must have 2 dimension"),
    "block_tables rows": ({"block_tables": _int32(0, 1)[None]}, "block_tables has 1 rows"),
    "max_query_len tensor": ({"max_query_len": torch.tensor(4)}, "must be Python ints"),
    "max_query_len too long": ({"max_query_len": 5, "max_context_len": 4},
                               "max_query_len 5 must be in"),
    "query_start short of the tokens": ({"query_start": _int32(0, 1, 4)},
                                        "query_start must run from 0 to num_tokens 5"),
    "query_start decreases": ({"query_start": _int32(0, 6, 5), "context_lens": _int32(10, 4)},
                              "query_start decreases at row 1: 6 -> 5"),
    "prompt context too short": ({"context_lens": _int32(4, 3)},
                                 "row 1 of 4 query tokens has context_len 3"),
    "prompt context past the table": ({"context_lens": _int32(4, 33)},
                                      r"context_len 33 \(must be in \[4, 32\]\)"),
    "decode context past the table": ({"context_lens": _int32(33, 4)},
                                      r"decode context_lens must be in \[1, 32\]"),
    "empty decode context": ({"context_lens": _int32(0, 4)}, "decode context_lens must be in"),
    "slot_mapping on another device": ({"slot_mapping": torch.zeros(5, dtype=torch.int64,
                                                                    device="meta")},
                                       "slot_mapping is on meta, expected cpu"),
    "kv_cache of one layer's caches": ({"kv_cache": torch.zeros(2, 4, 16, 2, 64)},
                                       "kv_cache must be"),
    "kv_cache not contiguous": ({"kv_cache": torch.zeros(1, 2, 4, 16, 64, 2).transpose(-1, -2)},
                                "kv_cache must be contiguous"),
    "kv_cache of integers": ({"kv_cache": torch.zeros(1, 2, 4, 16, 2, 64, dtype=torch.int32)},
                             "kv_cache must be floating"),
}  # fmt: skip


@pytest.mark.parametrize("name", BAD_STEPS)
def test_plan_rejects_bad_steps(name):
    changes, message = BAD_STEPS[name]
    changes = dict(changes)
    batch = _rejected_batch()
    positions = changes.pop("positions", batch.positions())
    kv_cache = changes.pop("kv_cache", batch.kv_cache())
    max_position = changes.pop("max_position", 64)
    metadata = batch.metadata(**changes)
    with pytest.raises(KernelInputError, match=message):
        backend.plan(positions, metadata, kv_cache, max_position)


def test_plan_accepts_the_unchanged_step():
    batch = _rejected_batch()
    assert backend.plan(*step_inputs(batch), 64).attention.num_tokens == 5


@pytest.mark.parametrize("layout", ["rows", "strided"])
@pytest.mark.parametrize("name", ["mixed", "decode_only"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_attend_stores_the_layer_then_attends(dtype, name, layout):
    """``attend`` equals ``store_kv`` then ``paged_attention`` on the plan's cache of the layer,
    skips the tokens whose slot is -1, leaves the other layers alone, and matches the reference.
    A step of decodes alone is one C++ call on CPUs (``store_and_attend_step``), which reads
    heads as contiguous rows; K/V laid out otherwise take the general path."""
    batch = make_ragged_batch(
        BATCHES[name], num_heads=9, num_kv_heads=3, head_dim=64, block_size=16, dtype=dtype,
        seed=12,
    )  # fmt: skip
    positions, metadata, one_layer = step_inputs(batch)
    slot_mapping = metadata.slot_mapping.clone()
    # a decode token that attends over the K/V already cached in its slot
    slot_mapping[{"mixed": 5, "decode_only": 1}[name]] = -1
    metadata = replace(metadata, slot_mapping=slot_mapping)
    kv_cache = torch.cat((one_layer, -one_layer))  # two layers
    num_tokens = batch.query.shape[0]
    generator = torch.Generator().manual_seed(13)
    key, value = (torch.randn(num_tokens, 3, 64, generator=generator).to(dtype) for _ in "kv")
    if layout == "strided":  # [kv heads, tokens, head_dim] storage: heads are not rows
        key, value = (t.transpose(0, 1).contiguous().transpose(0, 1) for t in (key, value))
    halves = kv_cache.clone()

    plan = backend.plan(positions, metadata, kv_cache, batch.max_position)
    out = backend.attend(batch.query, key, value, plan, 1, batch.scale)
    halves_plan = backend.plan(positions, metadata, halves, batch.max_position)
    backend.store_kv(key, value, halves[1, 0], halves[1, 1], halves_plan)
    expected = backend.paged_attention(batch.query, *halves[1], halves_plan, batch.scale)
    assert torch.equal(out, expected)
    _assert_same(kv_cache, halves)

    key_cache, value_cache = -batch.key_cache, -batch.value_cache
    reference_store_kv(key, value, key_cache, value_cache, slot_mapping)
    _assert_same(kv_cache[1], torch.stack((key_cache, value_cache)))
    _assert_same(kv_cache[0], one_layer[0])
    stored = replace(batch, key_cache=key_cache, value_cache=value_cache)
    torch.testing.assert_close(
        out.double(), reference_attention(stored), atol=ATTENTION_ATOL[dtype], rtol=0
    )
