"""The Triton backend against the PyTorch backend, under the interpreter on CPU (compiled on CUDA
when TRITON_INTERPRET is not "1"). Shapes are small: the interpreter is ~1000x slower than torch."""

from __future__ import annotations

import os
from dataclasses import fields, is_dataclass, replace

import pytest
import torch
from kernel_reference import (
    make_ragged_batch,
    reference_attention,
    run_attention,
    step_inputs,
)

from kernels import AttentionMetadata, KernelInputError, build_cos_sin_cache, get_backend

pytest.importorskip("triton")


from kernels.triton_attention import choose_num_splits  # noqa: E402
from kernels.triton_rotary import launch_rotary_embedding  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
if DEVICE == "cpu" and not INTERPRET:
    pytest.skip("Triton needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)

triton_backend = get_backend("triton")
torch_backend = get_backend("torch")

# Max abs difference between the two backends, outputs of magnitude ~1.
ATOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
RTOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]

# (num_cached_tokens, num_query_tokens) per row
BATCHES = {
    "mixed": [(0, 5), (16, 1), (0, 1), (7, 9), (31, 1)],
    "decode_only": [(15, 1), (16, 1), (0, 1), (47, 1)],
    "prompt_only": [(0, 16), (0, 3), (16, 16), (5, 11)],
    "single_token_prompts": [(0, 1), (0, 1), (0, 1)],
    "block_multiple": [(0, 32), (32, 1), (16, 16)],
    "rows_without_queries": [(5, 0), (3, 1), (0, 4), (2, 0)],
    "long_context": [(90, 1), (75, 1), (64, 6)],
    # chunks of 3, 5 and 17 tokens: two prompt groups of two rows in the torch backend
    "prompt_groups": [(0, 3), (13, 5), (2, 17), (9, 3), (4, 1)],
}


def _batch(rows, num_heads=9, num_kv_heads=3, head_dim=64, block_size=16, dtype=torch.float32,
           seed=0, **kwargs):  # fmt: skip
    return make_ragged_batch(
        rows, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        block_size=block_size, dtype=dtype, seed=seed, device=DEVICE, **kwargs,
    )  # fmt: skip


def _on(value, device):
    """``value`` with its tensors (and its fields' tensors, for a dataclass) on ``device``."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if not is_dataclass(value):
        return value
    return replace(
        value, **{field.name: _on(getattr(value, field.name), device) for field in fields(value)}
    )


def _assert_attention_matches(batch, out, dtype):
    expected = run_attention(torch_backend, _on(batch, "cpu"))
    assert out.dtype == dtype and out.shape == batch.query.shape
    torch.testing.assert_close(out.cpu(), expected, atol=ATOL[dtype], rtol=RTOL[dtype])


def _assert_same(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal, NaN (unused cache slots) included."""
    torch.testing.assert_close(actual.cpu(), expected.cpu(), atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("name", BATCHES)
def test_attention_batch_shapes(name):
    batch = _batch(BATCHES[name], seed=list(BATCHES).index(name))
    _assert_attention_matches(batch, run_attention(triton_backend, batch), batch.query.dtype)


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (9, 3), (16, 2)])
def test_attention_gqa_ratios(num_heads, num_kv_heads):
    batch = _batch(BATCHES["mixed"], num_heads=num_heads, num_kv_heads=num_kv_heads, seed=11)
    _assert_attention_matches(batch, run_attention(triton_backend, batch), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", ["mixed", "decode_only"])
def test_attention_half_precision(name, dtype):
    batch = _batch(BATCHES[name], dtype=dtype, seed=21)
    _assert_attention_matches(batch, run_attention(triton_backend, batch), dtype)


@pytest.mark.parametrize(("head_dim", "block_size"), [(128, 32), (64, 128), (64, 64), (80, 16)])
def test_attention_head_dims_and_block_sizes(head_dim, block_size):
    rows = [(0, 6), (70, 1), (129, 1)]
    batch = _batch(rows, num_heads=4, num_kv_heads=2, head_dim=head_dim, block_size=block_size)
    _assert_attention_matches(batch, run_attention(triton_backend, batch), torch.float32)


@pytest.mark.parametrize(
    ("num_splits", "dtype"),
    [(2, torch.float32), (2, torch.bfloat16), (8, torch.float32)],
    ids=["2-float32", "2-bfloat16", "8-float32"],
)
def test_attention_split_context_matches(num_splits, dtype):
    """Flash-decoding path: with 8 splits and short rows, some splits are empty."""
    batch = _batch([(90, 1), (75, 1), (20, 3), (3, 1)], dtype=dtype, seed=31)
    out = run_attention(triton_backend, batch, num_splits=num_splits)
    _assert_attention_matches(batch, out, dtype)


def test_attention_fp32_matches_float64_reference():
    batch = _batch(BATCHES["mixed"], shuffle_blocks=False, seed=41)
    out = run_attention(triton_backend, batch)
    torch.testing.assert_close(out.cpu().double(), reference_attention(batch), atol=2e-5, rtol=0)


def test_attention_strided_query_and_out_argument():
    batch = _batch([(10, 1), (0, 6)], num_heads=6, num_kv_heads=2, seed=9)
    fused = torch.randn(batch.query.shape[0], 10, 64, device=DEVICE)  # [tokens, q+k+v heads, d]
    fused[:, :6] = batch.query
    out = torch.full_like(batch.query, float("nan"))
    returned = run_attention(triton_backend, batch, query=fused[:, :6], out=out)
    assert returned is out
    _assert_attention_matches(batch, out, torch.float32)


def test_plan_rejects_bad_metadata():
    batch = _batch([(3, 1), (0, 4)], num_heads=4, num_kv_heads=2)
    positions, metadata, kv_cache = step_inputs(batch)

    def plan(**changes):
        return triton_backend.plan(positions, replace(metadata, **changes), kv_cache, 64)

    with pytest.raises(KernelInputError, match="block_tables must be torch.int32"):
        plan(block_tables=metadata.block_tables.long())
    with pytest.raises(KernelInputError, match="capacity"):
        plan(max_context_len=10_000)
    with pytest.raises(KernelInputError, match="kv_cache must be contiguous"):
        triton_backend.plan(positions, metadata, kv_cache.transpose(-1, -2), 64)
    if DEVICE == "cpu":  # values are checked on host tensors only
        with pytest.raises(KernelInputError, match="context_lens"):
            plan(context_lens=torch.tensor([1, 2], dtype=torch.int32))
        with pytest.raises(KernelInputError, match="max_query_len"):
            plan(max_query_len=1)
        with pytest.raises(KernelInputError, match="query_start must run from 0"):
            plan(query_start=torch.tensor([0, 1, 4], dtype=torch.int32))
        with pytest.raises(KernelInputError, match="positions must be in"):
            triton_backend.plan(positions, metadata, kv_cache, 3)


def test_attention_rejects_bad_tensors_without_writing():
    batch = _batch([(3, 1), (0, 4)], num_heads=4, num_kv_heads=2)
    positions, metadata, kv_cache = step_inputs(batch)
    plan = triton_backend.plan(positions, metadata, kv_cache, 64)
    key_cache, value_cache = kv_cache[0]
    query, scale = batch.query, batch.scale
    out = torch.zeros_like(query)
    with pytest.raises(KernelInputError, match="query is torch.float16"):
        triton_backend.paged_attention(query.half(), key_cache, value_cache, plan, scale, out)
    with pytest.raises(KernelInputError, match="not a multiple of num_kv_heads"):
        triton_backend.paged_attention(query[:, :3], key_cache, value_cache, plan, scale)
    with pytest.raises(KernelInputError, match="does not match the step's plan"):
        triton_backend.paged_attention(query[:4], key_cache, value_cache, plan, scale)
    with pytest.raises(KernelInputError, match="out must be"):
        triton_backend.paged_attention(query, key_cache, value_cache, plan, scale, out[:4])
    assert not out.any()


def test_split_heuristic():
    cpu = torch.device("cpu")
    assert choose_num_splits(4, 3, 8192, cpu) == 1  # no multiprocessors to fill
    if torch.cuda.is_available():
        cuda = torch.device("cuda")
        assert choose_num_splits(1, 1, 8192, cuda) > 1  # one long decode
        assert choose_num_splits(1, 1, 256, cuda) == 1  # too short to split
        assert choose_num_splits(10_000, 8, 8192, cuda) == 1  # the batch fills the device


def _store_step(slot_mapping: list[int], num_blocks: int):
    """(positions, metadata) on the CPU of one row of ``len(slot_mapping)`` tokens whose block
    table holds ``num_blocks`` blocks."""
    num_tokens = len(slot_mapping)
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor(slot_mapping),
        query_start=torch.tensor([0, num_tokens], dtype=torch.int32),
        context_lens=torch.tensor([num_tokens], dtype=torch.int32),
        block_tables=torch.arange(num_blocks, dtype=torch.int32)[None],
        max_query_len=num_tokens,
        max_context_len=num_tokens,
    )
    return torch.arange(num_tokens), metadata


def _triton_plan(positions, metadata, kv_cache):
    return triton_backend.plan(_on(positions, DEVICE), _on(metadata, DEVICE), kv_cache, 64)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_store_kv_matches(dtype):
    generator = torch.Generator().manual_seed(1)
    fused = torch.randn(7, 9, 64, generator=generator).to(device=DEVICE, dtype=dtype)
    key, value = fused[:, 0:3], fused[:, 3:6]  # strided views of a fused qkv
    kv_cache = torch.randn(1, 2, 5, 4, 3, 64, generator=generator).to(DEVICE, dtype)
    expected = kv_cache.cpu()
    positions, metadata = _store_step([19, 0, -1, 4, 7, -1, 12], num_blocks=5)
    torch_plan = torch_backend.plan(positions, metadata, expected, 64)
    torch_backend.store_kv(key.cpu(), value.cpu(), *expected[0], torch_plan)
    triton_backend.store_kv(key, value, *kv_cache[0], _triton_plan(positions, metadata, kv_cache))
    assert torch.equal(kv_cache.cpu(), expected)


def test_store_kv_rejects_bad_inputs_without_writing():
    key = torch.randn(2, 2, 16, device=DEVICE)
    kv_cache = torch.zeros(1, 2, 3, 4, 2, 16, device=DEVICE)
    if DEVICE == "cpu":
        for bad_slots in ([1, 12], [1, -2]):
            with pytest.raises(KernelInputError, match="slot_mapping"):
                _triton_plan(*_store_step(bad_slots, num_blocks=3), kv_cache)
    else:  # no host check on CUDA: the kernel writes nothing out of range
        plan = _triton_plan(*_store_step([12, -2], num_blocks=3), kv_cache)
        triton_backend.store_kv(key, key, *kv_cache[0], plan)
    plan = _triton_plan(*_store_step([1, 2], num_blocks=3), kv_cache)
    with pytest.raises(KernelInputError, match="key is torch.float16"):
        triton_backend.store_kv(key.half(), key.half(), *kv_cache[0], plan)
    with pytest.raises(KernelInputError, match="key must be"):
        triton_backend.store_kv(key[:, :1], key[:, :1], *kv_cache[0], plan)
    with pytest.raises(KernelInputError, match="do not match the step's plan"):
        triton_backend.store_kv(key[:1], key[:1], *kv_cache[0], plan)
    assert not kv_cache.any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_attend_matches_the_torch_backend(dtype):
    """Both backends' plan and ``attend`` over the same two-layer step: the same caches (a token
    whose slot is -1 not stored) and outputs."""
    batch = _batch(BATCHES["mixed"], num_heads=4, num_kv_heads=2, head_dim=32, dtype=dtype, seed=51)
    positions, metadata, one_layer = step_inputs(batch)
    slot_mapping = metadata.slot_mapping.clone()
    padding_slot = int(slot_mapping[5])
    slot_mapping[5] = -1  # row 1's decode token: attends over the K/V already cached there
    metadata = replace(metadata, slot_mapping=slot_mapping)
    kv_cache = torch.cat((one_layer, one_layer.flip(-1)))  # two layers
    before, expected_cache = kv_cache.clone(), kv_cache.cpu()
    triton_plan = triton_backend.plan(positions, metadata, kv_cache, batch.max_position)
    torch_plan = torch_backend.plan(
        _on(positions, "cpu"), _on(metadata, "cpu"), expected_cache, batch.max_position
    )
    generator = torch.Generator().manual_seed(52)
    for layer in (1, 0):
        query, key, value = (
            torch.randn(batch.query.shape[0], heads, 32, generator=generator).to(dtype)
            for heads in (4, 2, 2)
        )
        expected = torch_backend.attend(query, key, value, torch_plan, layer, batch.scale)
        query, key, value = (tensor.to(DEVICE) for tensor in (query, key, value))
        out = triton_backend.attend(query, key, value, triton_plan, layer, batch.scale)
        torch.testing.assert_close(out.cpu(), expected, atol=ATOL[dtype], rtol=RTOL[dtype])
    _assert_same(kv_cache, expected_cache)
    block, offset = divmod(padding_slot, batch.key_cache.shape[1])
    assert torch.equal(kv_cache[:, :, block, offset], before[:, :, block, offset])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches(dtype, with_residual):
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(5, 96, generator=generator).to(dtype)
    weight = (1 + 0.1 * torch.randn(96, 2, generator=generator)).to(dtype)[:, 0]  # strided
    residual = torch.randn(5, 96, generator=generator).to(dtype) if with_residual else None
    expected = torch_backend.rms_norm(x, weight, 1e-5, residual)
    normed, summed = triton_backend.rms_norm(
        x.to(DEVICE), weight.to(DEVICE), 1e-5, residual.to(DEVICE) if with_residual else None
    )
    assert normed.dtype == dtype
    torch.testing.assert_close(normed.cpu(), expected[0], atol=ATOL[dtype], rtol=RTOL[dtype])
    # bf16 differs by one rounding under the interpreter, which truncates float32 -> bf16
    torch.testing.assert_close(summed.cpu(), expected[1], atol=ATOL[dtype], rtol=RTOL[dtype])


def test_rms_norm_rejects_bad_inputs():
    x = torch.randn(3, 8, device=DEVICE)
    with pytest.raises(KernelInputError, match="weight must be"):
        triton_backend.rms_norm(x, torch.ones(7, device=DEVICE), 1e-6)
    with pytest.raises(KernelInputError, match="residual must be"):
        residual = torch.randn(3, 8, dtype=torch.float64, device=DEVICE)
        triton_backend.rms_norm(x, torch.ones(8, device=DEVICE), 1e-6, residual)
    with pytest.raises(KernelInputError, match="eps"):
        triton_backend.rms_norm(x, torch.ones(8, device=DEVICE), 0.0)


def _rotary_inputs(dtype, head_dim, num_heads=6, num_kv_heads=2):
    """(fused qkv [5, q + k + v heads, head_dim], positions, cos_sin_cache of 512 positions)."""
    generator = torch.Generator().manual_seed(4)
    fused = torch.randn(5, num_heads + 2 * num_kv_heads, head_dim, generator=generator).to(dtype)
    return fused, torch.tensor([0, 3, 100, 7, 511]), build_cos_sin_cache(head_dim, 512, 1e4, None)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rotary_kernel_matches(dtype, head_dim):
    fused, positions, cache = _rotary_inputs(dtype, head_dim)
    expected = fused.clone()
    expected[:, :8] = torch_backend.rotary(fused[:, :8], torch_backend.rope(positions, cache))
    fused = fused.to(DEVICE)
    launch_rotary_embedding(positions.to(DEVICE), fused[:, :6], fused[:, 6:8], cache.to(DEVICE))
    # The value heads (the rest of the fused tensor) stay untouched.
    torch.testing.assert_close(fused.cpu(), expected, atol=ATOL[dtype], rtol=RTOL[dtype])


def test_backend_rotary_matches():
    fused, positions, cache = _rotary_inputs(torch.float32, 64)
    rope = torch_backend.rope(positions, cache)
    expected = torch_backend.rotary(fused[:, :8], rope)
    fused = fused.to(DEVICE)
    rotated = triton_backend.rotary(
        fused[:, :8], triton_backend.rope(positions.to(DEVICE), cache.to(DEVICE))
    )
    torch.testing.assert_close(rotated.cpu(), expected, atol=1e-5, rtol=1e-5)


def test_rotary_kernel_leaves_positions_out_of_the_table_unrotated():
    query, key = torch.randn(2, 4, 64, device=DEVICE), torch.randn(2, 2, 64, device=DEVICE)
    before = query.clone(), key.clone()
    cache = build_cos_sin_cache(64, 16, 10000.0, None).to(DEVICE)
    launch_rotary_embedding(torch.tensor([16, -1], device=DEVICE), query, key, cache)
    assert torch.equal(query, before[0]) and torch.equal(key, before[1])
