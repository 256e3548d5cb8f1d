"""Matrix products on CPUs with the weight packed once into oneDNN's blocked layout.

``F.linear`` on a CPU reorders a bfloat16 weight into that layout at every call, and runs a
float32 one through MKL, whose kernels are slow on AMD CPUs. Packed once at load time:
- bfloat16, decode-sized products run about twice as fast (measured on a 2-core AVX-512 BF16
  machine: the 3072x576 gate/up product 0.22 -> 0.11 ms, the 49152x576 LM head 4.1 -> 1.6 ms),
  with bit-identical results. oneDNN packs bfloat16 only on CPUs with bfloat16 hardware
  (AVX-512 BF16 or AMX); elsewhere a bfloat16 layer keeps ``F.linear``.
- float32, every row count runs about twice as fast as MKL on an AMD EPYC (2 cores, 2026-11-23:
  the 3072x576 product 0.12 -> 0.08 ms for 1 row, 9.7 -> 4.6 ms for 512 rows; the LM head 7.2 ->
  3.2 ms for 1 row), agreeing with ``F.linear`` to float32 rounding (another summation order).
Other dtypes and devices keep ``F.linear``.

The product is the custom operator ``splitfuse::packed_linear``, and the packed weight a
reference-type opaque object, so a compiled graph calls it as it is (no copy of the weight).
"""

from __future__ import annotations

import torch
from torch._library.opaque_object import register_opaque_type
from torch._opaque_base import OpaqueBase

from engine.device import cpu_runs_bf16


def can_pack(weight: torch.Tensor) -> bool:
    if weight.device.type != "cpu" or weight.dim() != 2 or not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.float32:
        return True
    return weight.dtype == torch.bfloat16 and cpu_runs_bf16()


class PackedWeight(OpaqueBase):
    """``weight`` [out_features, in_features] as an opaque oneDNN tensor. (A graph holding one
    bypasses the compiler's on-disk cache: oneDNN tensors cannot be pickled for its key.)"""

    def __init__(self, weight: torch.Tensor) -> None:
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), 1)


register_opaque_type(PackedWeight, typ="reference")


def padded_rows(num_rows: int) -> int:
    """The row count a product runs with: up to 16 as it is, above that rounded up to a multiple
    of 1/8 of the power of two below it (2 for 17-31 rows, 4 for 32-63, ..., 32 for 256-511), so
    at most 1/8 more rows. oneDNN builds and caches a kernel per shape (1,024 in each of two
    caches), so one shape per prompt-chunk length would fill resident memory with kernels each
    run once (+512 MiB over a 10,000-request soak); padded, a weight has 57 shapes up to 512
    rows. Extra rows cost little: a product of fewer than ~100 rows is bound by reading the
    weight."""
    if num_rows <= 16:
        return num_rows
    step = 1 << (num_rows.bit_length() - 4)
    return -(-num_rows // step) * step


def packed_linear(
    x: torch.Tensor, weight: PackedWeight, out_features: int, bias: torch.Tensor | None
) -> torch.Tensor:
    """``x W^T + b``: [num_rows, in_features] -> [num_rows, out_features] (run on
    ``padded_rows(num_rows)`` rows)."""
    num_rows = x.shape[0]
    padded = padded_rows(num_rows)
    if padded == num_rows:
        return torch.ops.mkldnn._linear_pointwise(x, weight.packed, bias, "none", [], "")
    x = torch.nn.functional.pad(x, (0, 0, 0, padded - num_rows))
    out = torch.ops.mkldnn._linear_pointwise(x, weight.packed, bias, "none", [], "")
    return out[:num_rows]


def _packed_linear_shape(
    x: torch.Tensor, weight: PackedWeight, out_features: int, bias: torch.Tensor | None
) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


_LIBRARY = torch.library.Library("splitfuse", "FRAGMENT")
_LIBRARY.define(
    "packed_linear(Tensor x, engine.packed_linear.PackedWeight weight, int out_features, "
    "Tensor? bias) -> Tensor"
)
_LIBRARY.impl("packed_linear", packed_linear, "CPU")
_LIBRARY.impl("packed_linear", _packed_linear_shape, "Meta")
