"""RMSNorm in Triton, with an optional fused residual add: one program per token."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_HIDDEN = 65536  # one row is one tile


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [num_tokens, hidden]
    residual_ptr,  # [num_tokens, hidden], read only when HAS_RESIDUAL
    weight_ptr,  # [hidden]
    out_ptr,  # [num_tokens, hidden], contiguous
    summed_ptr,  # [num_tokens, hidden], contiguous: x + residual, written when HAS_RESIDUAL
    hidden,
    eps,
    stride_x,
    stride_residual,
    stride_weight,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    x = tl.load(x_ptr + token * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + token * stride_residual + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x.dtype)  # rounded like torch's add
        tl.store(summed_ptr + token * hidden + offs, x, mask=mask)
    hidden_f32 = x.to(tl.float32)
    mean_square = tl.sum(hidden_f32 * hidden_f32, 0) / hidden
    normed = (hidden_f32 * tl.rsqrt(mean_square + eps)).to(x.dtype)
    weight = tl.load(weight_ptr + offs * stride_weight, mask=mask, other=0.0).to(x.dtype)
    result = normed.to(tl.float32) * weight.to(tl.float32)
    tl.store(out_ptr + token * hidden + offs, result.to(x.dtype), mask=mask)


def launch_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Run the kernel on checked inputs; allocates the outputs (and the new residual)."""
    num_tokens, hidden = x.shape
    if hidden > MAX_HIDDEN:
        raise ValueError(f"hidden {hidden} exceeds the kernel's {MAX_HIDDEN}")
    out = torch.empty(num_tokens, hidden, dtype=x.dtype, device=x.device)
    summed = torch.empty_like(out) if residual is not None else out
    if num_tokens:
        _rms_norm_kernel[(num_tokens,)](
            x, residual if residual is not None else x, weight, out, summed, hidden, eps,
            x.stride(0), residual.stride(0) if residual is not None else 0, weight.stride(0),
            HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(hidden),
        )  # fmt: skip
    return out if residual is None else (out, summed)
