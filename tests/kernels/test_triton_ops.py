"""The Triton kernels against the PyTorch ops, under the interpreter on CPU (compiled on CUDA when
TRITON_INTERPRET is not "1"). Shapes are small: the interpreter is ~1000x slower than torch."""

from __future__ import annotations

import os

import pytest
import torch
from kernel_reference import make_ragged_batch, reference_attention

from kernels import KernelInputError, build_cos_sin_cache, get_ops
from kernels.triton_attention import choose_num_splits, launch_paged_attention

pytest.importorskip("triton")

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
if DEVICE == "cpu" and not INTERPRET:
    pytest.skip("Triton needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)

triton_ops = get_ops("triton")
torch_ops = get_ops("torch")

# Max abs difference between the two backends, outputs of magnitude ~1.
ATOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
RTOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}

# (num_cached_tokens, num_query_tokens) per row
BATCHES = {
    "mixed": [(0, 5), (16, 1), (0, 1), (7, 9), (31, 1)],
    "decode_only": [(15, 1), (16, 1), (0, 1), (47, 1)],
    "prompt_only": [(0, 16), (0, 3), (16, 16), (5, 11)],
    "single_token_prompts": [(0, 1), (0, 1), (0, 1)],
    "block_multiple": [(0, 32), (32, 1), (16, 16)],
    "long_context": [(90, 1), (75, 1), (64, 6)],
}


def _batch(rows, num_heads=9, num_kv_heads=3, head_dim=64, block_size=16, dtype=torch.float32,
           seed=0, **kwargs):  # fmt: skip
    return make_ragged_batch(
        rows, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        block_size=block_size, dtype=dtype, seed=seed, device=DEVICE, **kwargs,
    )  # fmt: skip


def _assert_attention_matches(batch, out, dtype):
    expected = torch_ops.paged_attention(*[_cpu(arg) for arg in batch.attention_args()])
    assert out.dtype == dtype and out.shape == batch.query.shape
    torch.testing.assert_close(out.cpu(), expected, atol=ATOL[dtype], rtol=RTOL[dtype])


def _cpu(arg):
    return arg.cpu() if isinstance(arg, torch.Tensor) else arg


@pytest.mark.parametrize("name", BATCHES)
def test_attention_batch_shapes(name):
    batch = _batch(BATCHES[name], seed=list(BATCHES).index(name))
    _assert_attention_matches(
        batch, triton_ops.paged_attention(*batch.attention_args()), batch.query.dtype
    )


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (9, 3), (16, 2)])
def test_attention_gqa_ratios(num_heads, num_kv_heads):
    batch = _batch(BATCHES["mixed"], num_heads=num_heads, num_kv_heads=num_kv_heads, seed=11)
    _assert_attention_matches(
        batch, triton_ops.paged_attention(*batch.attention_args()), torch.float32
    )


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", ["mixed", "decode_only"])
def test_attention_half_precision(name, dtype):
    batch = _batch(BATCHES[name], dtype=dtype, seed=21)
    _assert_attention_matches(batch, triton_ops.paged_attention(*batch.attention_args()), dtype)


@pytest.mark.parametrize(("head_dim", "block_size"), [(128, 32), (64, 128), (64, 64), (80, 16)])
def test_attention_head_dims_and_block_sizes(head_dim, block_size):
    rows = [(0, 6), (70, 1), (129, 1)]
    batch = _batch(rows, num_heads=4, num_kv_heads=2, head_dim=head_dim, block_size=block_size)
    _assert_attention_matches(
        batch, triton_ops.paged_attention(*batch.attention_args()), torch.float32
    )


@pytest.mark.parametrize(
    ("num_splits", "dtype"),
    [(2, torch.float32), (2, torch.bfloat16), (8, torch.float32)],
    ids=["2-float32", "2-bfloat16", "8-float32"],
)
def test_attention_split_context_matches(num_splits, dtype):
    """Flash-decoding path: with 8 splits and short rows, some splits are empty."""
    batch = _batch([(90, 1), (75, 1), (20, 3), (3, 1)], dtype=dtype, seed=31)
    out = torch.empty_like(batch.query)
    launch_paged_attention(*batch.attention_args(), out, num_splits=num_splits)
    _assert_attention_matches(batch, out, dtype)


def test_attention_fp32_matches_float64_reference():
    batch = _batch(BATCHES["mixed"], shuffle_blocks=False, seed=41)
    out = triton_ops.paged_attention(*batch.attention_args())
    torch.testing.assert_close(out.cpu().double(), reference_attention(batch), atol=2e-5, rtol=0)


def test_attention_strided_query_and_out_argument():
    batch = _batch([(10, 1), (0, 6)], num_heads=6, num_kv_heads=2, seed=9)
    fused = torch.randn(batch.query.shape[0], 10, 64, device=DEVICE)  # [tokens, q+k+v heads, d]
    fused[:, :6] = batch.query
    out = torch.full_like(batch.query, float("nan"))
    returned = triton_ops.paged_attention(fused[:, :6], *batch.attention_args()[1:], out=out)
    assert returned is out
    _assert_attention_matches(batch, out, torch.float32)


def test_attention_rejects_bad_inputs():
    batch = _batch([(3, 1), (0, 4)], num_heads=4, num_kv_heads=2)
    args = list(batch.attention_args())
    with pytest.raises(KernelInputError, match="block_tables must be torch.int32"):
        triton_ops.paged_attention(*args[:5], args[5].long(), *args[6:])
    if DEVICE == "cpu":
        with pytest.raises(KernelInputError, match="context_lens"):
            triton_ops.paged_attention(
                *args[:4], torch.tensor([1, 2], dtype=torch.int32), *args[5:]
            )
        with pytest.raises(KernelInputError, match="max_query_len"):
            triton_ops.paged_attention(*args[:7], 1, args[8])


def test_split_heuristic():
    cpu = torch.device("cpu")
    assert choose_num_splits(4, 3, 8192, cpu) == 1  # no multiprocessors to fill
    if torch.cuda.is_available():
        cuda = torch.device("cuda")
        assert choose_num_splits(1, 1, 8192, cuda) > 1  # one long decode
        assert choose_num_splits(1, 1, 256, cuda) == 1  # too short to split
        assert choose_num_splits(10_000, 8, 8192, cuda) == 1  # the batch fills the device


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_store_kv_matches(dtype):
    generator = torch.Generator().manual_seed(1)
    fused = torch.randn(7, 9, 64, generator=generator).to(device=DEVICE, dtype=dtype)
    key, value = fused[:, 0:3], fused[:, 3:6]  # strided views of a fused qkv
    caches = [torch.randn(5, 4, 3, 64, generator=generator).to(DEVICE, dtype) for _ in range(2)]
    expected = [cache.cpu() for cache in caches]
    slot_mapping = torch.tensor([19, 0, -1, 4, 7, -1, 12], device=DEVICE)
    torch_ops.store_kv(key.cpu(), value.cpu(), *expected, slot_mapping.cpu())
    triton_ops.store_kv(key, value, *caches, slot_mapping)
    assert torch.equal(caches[0].cpu(), expected[0])
    assert torch.equal(caches[1].cpu(), expected[1])


def test_store_kv_rejects_bad_slots_without_writing():
    key = torch.randn(2, 2, 16, device=DEVICE)
    caches = [torch.zeros(3, 4, 2, 16, device=DEVICE) for _ in range(2)]
    if DEVICE == "cpu":
        with pytest.raises(KernelInputError, match="slot_mapping"):
            triton_ops.store_kv(key, key, *caches, torch.tensor([1, 12]))
        with pytest.raises(KernelInputError, match="slot_mapping"):
            triton_ops.store_kv(key, key, *caches, torch.tensor([1, -2]))
    else:  # no host check on CUDA: the kernel writes nothing out of range
        triton_ops.store_kv(key, key, *caches, torch.tensor([12, -2], device=DEVICE))
    assert not caches[0].any() and not caches[1].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches(dtype, with_residual):
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(5, 96, generator=generator).to(dtype)
    weight = (1 + 0.1 * torch.randn(96, 2, generator=generator)).to(dtype)[:, 0]  # strided
    residual = torch.randn(5, 96, generator=generator).to(dtype) if with_residual else None
    expected = torch_ops.rms_norm(x, weight, 1e-5, residual)
    got = triton_ops.rms_norm(
        x.to(DEVICE), weight.to(DEVICE), 1e-5, residual.to(DEVICE) if with_residual else None
    )
    if with_residual:
        torch.testing.assert_close(got[0].cpu(), expected[0], atol=ATOL[dtype], rtol=RTOL[dtype])
        # bf16 differs by one rounding under the interpreter, which truncates float32 -> bf16
        torch.testing.assert_close(got[1].cpu(), expected[1], atol=ATOL[dtype], rtol=RTOL[dtype])
    else:
        assert got.dtype == dtype
        torch.testing.assert_close(got.cpu(), expected, atol=ATOL[dtype], rtol=RTOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rotary_embedding_matches(dtype, head_dim):
    generator = torch.Generator().manual_seed(4)
    num_heads, num_kv_heads = 6, 2
    fused = torch.randn(5, num_heads + 2 * num_kv_heads, head_dim, generator=generator).to(dtype)
    positions = torch.tensor([0, 3, 100, 7, 511])
    cache = build_cos_sin_cache(head_dim, 512, 10000.0, None)
    expected = fused.clone()
    torch_ops.rotary_embedding(
        positions, expected[:, :num_heads], expected[:, num_heads : num_heads + num_kv_heads], cache
    )
    fused = fused.to(DEVICE)
    triton_ops.rotary_embedding(
        positions.to(DEVICE), fused[:, :num_heads], fused[:, num_heads : num_heads + num_kv_heads],
        cache.to(DEVICE),
    )  # fmt: skip
    # The value heads (the rest of the fused tensor) stay untouched.
    torch.testing.assert_close(fused.cpu(), expected, atol=ATOL[dtype], rtol=RTOL[dtype])


def test_rotary_embedding_rejects_positions_out_of_the_table():
    query, key = torch.randn(2, 4, 64, device=DEVICE), torch.randn(2, 2, 64, device=DEVICE)
    before = query.clone()
    cache = build_cos_sin_cache(64, 16, 10000.0, None).to(DEVICE)
    if DEVICE == "cpu":
        with pytest.raises(KernelInputError, match="positions"):
            triton_ops.rotary_embedding(torch.tensor([1, 16]), query, key, cache)
        assert torch.equal(query, before)
