"""The weight-only quantized product on GPUs (W4A16 / W8A16): x [M, K] (float16, bfloat16 or
float32) times a 4-bit or 8-bit weight [N, K] in the layouts of ``engine/quantization.py``.

Up to 16 rows (decode steps) one kernel: each program computes a [BLOCK_M, BLOCK_N] tile of the
output, reading [BLOCK_N, BLOCK_K] quantized values a step (each weight row's bytes contiguous),
dequantizing them in registers (scale * q + min, one scale and min per run of 32) to x's dtype and
accumulating ``tl.dot`` in float32; the weight never exists in float in memory. More rows (prompt
chunks, large batches): the weight dequantized to x's dtype by a kernel, then ``F.linear``.

4-bit values of a run of 32 sit two per byte: value k of row n is in byte
``n * K / 2 + (k // 32) * 16 + k % 16``, low nibble when ``k % 32 < 16``, high nibble otherwise. A
step takes each run as two halves (values 0-15, 16-31: the low and the high nibbles of its 16
bytes), each half one product with the matching x.

The fused product's step of K depends on K alone, so each output's sums run in one order whatever
the number of rows up to 16 (deterministic mode runs products in tiles of 16 rows).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.quantization import check_group_size


@triton.jit
def _weight_runs(
    q_ptr, scales_ptr, mins_ptr, offs_n, mask_n, k0, num_cols,
    BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """The weight's values ``k0 .. k0 + BLOCK_K`` of rows ``offs_n`` [BLOCK_N] in float32, per run
    of 32 as two halves [BLOCK_N, BLOCK_K / 32, 16]: values 0-15 of each run, then 16-31. Each run
    has one scale (and min): a group is whole runs."""
    RUNS: tl.constexpr = BLOCK_K // 32
    runs = k0 // 32 + tl.arange(0, RUNS)
    offs_j = tl.arange(0, 16)
    rows = offs_n.to(tl.int64)
    group_offs = rows[:, None] * (num_cols // GROUP) + (runs * 32 // GROUP)[None, :]
    scale = tl.load(scales_ptr + group_offs, mask=mask_n[:, None], other=0.0)
    scale = scale.to(tl.float32)[:, :, None]
    rows_3d = rows[:, None, None]
    mask_3d = mask_n[:, None, None]
    if BITS == 4:  # byte j of a run: value j in its low nibble, value 16 + j in its high one
        byte = rows_3d * (num_cols // 2) + (runs[None, :, None] * 16 + offs_j[None, None, :])
        packed = tl.load(q_ptr + byte, mask=mask_3d, other=0)
        low = tl.load(mins_ptr + group_offs, mask=mask_n[:, None], other=0.0)
        low = low.to(tl.float32)[:, :, None]
        first = (packed & 15).to(tl.float32) * scale + low
        second = (packed >> 4).to(tl.float32) * scale + low
    else:
        value = rows_3d * num_cols + (runs[None, :, None] * 32 + offs_j[None, None, :])
        first = tl.load(q_ptr + value, mask=mask_3d, other=0).to(tl.float32) * scale
        second = tl.load(q_ptr + value + 16, mask=mask_3d, other=0).to(tl.float32) * scale
    return first, second


@triton.jit
def _quant_linear_kernel(
    x_ptr,  # [num_rows, num_cols]
    q_ptr,  # [num_out, num_cols / 2] uint8 (4 bits) or [num_out, num_cols] int8 (8 bits)
    scales_ptr,  # [num_out, num_cols / GROUP] float16
    mins_ptr,  # [num_out, num_cols / GROUP] float16, read when BITS == 4
    out_ptr,  # [num_rows, num_out], contiguous
    num_rows,
    num_out,
    num_cols,  # a multiple of BLOCK_K
    stride_xm,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < num_rows
    mask_n = offs_n < num_out
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm  # [BLOCK_M, 1]
    offs_b = tl.arange(0, BLOCK_K // 2)
    first_in_step = (offs_b // 16) * 32 + offs_b % 16  # the first halves' values, run by run
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, num_cols, BLOCK_K):
        first, second = _weight_runs(
            q_ptr, scales_ptr, mins_ptr, offs_n, mask_n, k0, num_cols, BITS, GROUP, BLOCK_K
        )
        first = tl.reshape(first, (BLOCK_N, BLOCK_K // 2))
        second = tl.reshape(second, (BLOCK_N, BLOCK_K // 2))
        k = k0 + first_in_step
        x_first = tl.load(x_rows + k[None, :], mask=mask_m[:, None], other=0.0)
        x_second = tl.load(x_rows + (k + 16)[None, :], mask=mask_m[:, None], other=0.0)
        if x_first.dtype == tl.float32:  # float32: no TF32
            acc += tl.dot(x_first, tl.trans(first), input_precision="ieee")
            acc += tl.dot(x_second, tl.trans(second), input_precision="ieee")
        else:
            acc += tl.dot(x_first, tl.trans(first.to(x_first.dtype)))
            acc += tl.dot(x_second, tl.trans(second.to(x_second.dtype)))
    out = out_ptr + offs_m[:, None].to(tl.int64) * num_out + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _dequantize_kernel(
    q_ptr,
    scales_ptr,
    mins_ptr,
    out_ptr,  # [num_out, num_cols], contiguous
    num_out,
    num_cols,  # a multiple of BLOCK_K
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    mask_n = offs_n < num_out
    first, second = _weight_runs(
        q_ptr, scales_ptr, mins_ptr, offs_n, mask_n, k0, num_cols, BITS, GROUP, BLOCK_K
    )
    runs = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    value = offs_n.to(tl.int64)[:, None, None] * num_cols + (
        runs[None, :, None] * 32 + tl.arange(0, 16)[None, None, :]
    )
    dtype = out_ptr.dtype.element_ty
    tl.store(out_ptr + value, first.to(dtype), mask=mask_n[:, None, None])
    tl.store(out_ptr + value + 16, second.to(dtype), mask=mask_n[:, None, None])


FUSED_ROWS = 16  # products of up to this many rows dequantize in the product; more: apart
DEQUANTIZED_BYTES = 64 * 2**20  # at most this much of a weight dequantized at once


@dataclass(frozen=True)
class Tiles:
    """A fused product's tile sizes and warps."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


def tiles(num_cols: int, bits: int = 4) -> Tiles:
    """The fused product's tiles over ``num_cols`` inputs (whole runs of 32): 16 rows (a decode
    step's few, padded), 32 outputs (a layer's weight spread over many programs: each one's loop
    over K is latency-bound) and steps of 64 inputs for 4-bit weights, 128 for 8-bit ones (the
    largest of these that divides K, down to 32). Timed on an NVIDIA H200 against other tiles of
    16-64 outputs, steps of 64-256 and 2-8 warps: 4 bits, the fastest for 3 of 4 layer shapes;
    8 bits, steps of 128 the fastest or within 5% for every shape, and 1.2-1.6x faster than
    steps of 64 on the long-K down projections (README, "On a GPU")."""
    step = 128 if bits == 8 else 64
    while num_cols % step:
        step //= 2
    return Tiles(16, 32, step)


def dequantize_weight(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor | None,
    bits: int,
    group_size: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The weight [N, K] in ``dtype`` (exactly ``QuantizedTensor.dequantize`` rounded to it)."""
    num_out = qweight.shape[0]
    num_cols = qweight.shape[1] * (8 // bits)
    check_group_size(num_cols, group_size)
    out = torch.empty(num_out, num_cols, dtype=dtype, device=qweight.device)
    block_n, block_k = 32, next(size for size in (256, 128, 64, 32) if num_cols % size == 0)
    grid = (triton.cdiv(num_out, block_n), num_cols // block_k)
    _dequantize_kernel[grid](
        qweight,
        scales,
        mins if mins is not None else scales,
        out,
        num_out,
        num_cols,
        BITS=bits,
        GROUP=group_size,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )
    return out


def triton_quant_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor | None,
    bits: int,
    group_size: int,
    config: Tiles | None = None,
) -> torch.Tensor:
    """x [M, K] @ dequantized(weight [N, K])^T -> [M, N] in x's dtype. Up to ``FUSED_ROWS`` rows
    (or with ``config``, the fused product's tiles): one fused kernel, each row's sums in an order
    that depends on K alone; more rows: the weight dequantized to x's dtype, then ``F.linear``
    (the dequantizing repeated per tile of rows costs more than the bytes it saves there), a
    slice of ``DEQUANTIZED_BYTES`` at most at a time."""
    num_rows, num_cols = x.shape
    num_out = qweight.shape[0]
    check_group_size(num_cols, group_size)  # whole runs of 32: a run never straddles a step
    if config is None and num_rows > FUSED_ROWS:
        # a slice of the weight's rows at a time, so that a large LM head (128k x 4k: 1 GiB in
        # bfloat16) never exists whole in x's dtype
        rows = max(16, DEQUANTIZED_BYTES // (num_cols * x.element_size()) // 16 * 16)
        if rows >= num_out:
            weight = dequantize_weight(qweight, scales, mins, bits, group_size, x.dtype)
            return torch.nn.functional.linear(x, weight)
        out = torch.empty(num_rows, num_out, dtype=x.dtype, device=x.device)
        for n0 in range(0, num_out, rows):
            n1 = min(num_out, n0 + rows)
            low = None if mins is None else mins[n0:n1]
            weight = dequantize_weight(
                qweight[n0:n1], scales[n0:n1], low, bits, group_size, x.dtype
            )
            out[:, n0:n1] = torch.nn.functional.linear(x, weight)
        return out
    config = config or tiles(num_cols, bits)
    if num_cols % config.block_k:
        raise ValueError(f"a step of {config.block_k} inputs must divide the {num_cols} inputs")
    x = x.contiguous()
    out = torch.empty(num_rows, num_out, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(num_out, config.block_n), triton.cdiv(num_rows, config.block_m))
    _quant_linear_kernel[grid](
        x,
        qweight,
        scales,
        mins if mins is not None else scales,
        out,
        num_rows,
        num_out,
        num_cols,
        x.stride(0),
        BITS=bits,
        GROUP=group_size,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out
