"""The weight-only quantized product on GPUs (W4A16 / W8A16): x [M, K] (float16, bfloat16 or
float32) times a 4-bit or 8-bit weight [N, K] in the layouts of ``engine/quantization.py``. Each
program computes an [BLOCK_M, BLOCK_N] tile of the output: it reads a [BLOCK_K, BLOCK_N] tile of
quantized values, dequantizes it in registers (scale * q + min, scales and mins per group) to
x's dtype, and accumulates ``tl.dot`` in float32; the weight never exists in float in memory.

4-bit values of a run of 32 sit two per byte: value k of row n is in byte
``n * K / 2 + (k // 32) * 16 + k % 16``, low nibble when ``k % 32 < 16``, high nibble otherwise.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.quantization import check_group_size


@triton.jit
def _quant_linear_kernel(
    x_ptr,  # [num_rows, num_cols]
    q_ptr,  # [num_out, num_cols / 2] uint8 (4 bits) or [num_out, num_cols] int8 (8 bits)
    scales_ptr,  # [num_out, num_cols / GROUP] float16
    mins_ptr,  # [num_out, num_cols / GROUP] float16, read when BITS == 4
    out_ptr,  # [num_rows, num_out], contiguous
    num_rows,
    num_out,
    num_cols,
    stride_xm,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < num_rows
    mask_n = offs_n < num_out
    rows_n = offs_n.to(tl.int64)
    num_groups = num_cols // GROUP
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, num_cols, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)  # num_cols is a multiple of BLOCK_K (32)
        x = tl.load(
            x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :],
            mask=mask_m[:, None],
            other=0.0,
        )  # [BLOCK_M, BLOCK_K]
        if BITS == 4:
            byte = (offs_k // 32) * 16 + offs_k % 16
            shift = ((offs_k % 32) // 16) * 4
            packed = tl.load(
                q_ptr + rows_n[None, :] * (num_cols // 2) + byte[:, None],
                mask=mask_n[None, :],
                other=0,
            )  # [BLOCK_K, BLOCK_N] uint8
            q = ((packed >> shift[:, None].to(tl.uint8)) & 15).to(tl.float32)
        else:
            q = tl.load(
                q_ptr + rows_n[None, :] * num_cols + offs_k[:, None], mask=mask_n[None, :], other=0
            ).to(tl.float32)
        group = offs_k // GROUP
        scale_offs = rows_n[None, :] * num_groups + group[:, None]
        scale = tl.load(scales_ptr + scale_offs, mask=mask_n[None, :], other=0.0).to(tl.float32)
        weight = q * scale
        if BITS == 4:
            weight += tl.load(mins_ptr + scale_offs, mask=mask_n[None, :], other=0.0).to(tl.float32)
        acc += (
            tl.dot(x.to(tl.float32), weight, input_precision="ieee")  # float32: no TF32
            if x.dtype == tl.float32
            else tl.dot(x, weight.to(x.dtype))
        )
    out = out_ptr + offs_m[:, None].to(tl.int64) * num_out + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def triton_quant_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor | None,
    bits: int,
    group_size: int,
) -> torch.Tensor:
    """x [M, K] @ dequantized(weight [N, K])^T -> [M, N] in x's dtype."""
    num_rows, num_cols = x.shape
    num_out = qweight.shape[0]
    check_group_size(num_cols, group_size)  # whole runs of 32: BLOCK_K never straddles a group
    x = x.contiguous()
    out = torch.empty(num_rows, num_out, dtype=x.dtype, device=x.device)
    block_m = 16 if num_rows <= 16 else 32
    block_n = 64
    grid = (triton.cdiv(num_rows, block_m), triton.cdiv(num_out, block_n))
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
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=32,
    )
    return out
