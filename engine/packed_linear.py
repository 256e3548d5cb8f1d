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

A product of a few bfloat16 rows (a decode step) reads that packed buffer through our own kernel
instead, ``splitfuse_cpu::blocked_linear`` (``kernels/cpu/blocked_linear.cpp``): oneDNN's kernels
for one to a few rows read the weights at about half of the machine's read bandwidth, ours at
about 80%, and it stays faster up to some 100 rows (``BLOCKED_ROWS``). It needs the buffer's
layout, which oneDNN does not publish: at packing time the buffer is compared, bit for bit, with
the weight in the layout the kernel reads (``[N / 64, K / 2, 64, 2]``, what oneDNN picks for
AVX-512 BF16), and a weight whose buffer holds anything else keeps oneDNN for every row count.

The product is the custom operator ``splitfuse::packed_linear``, and the packed weight a
reference-type opaque object, so a compiled graph calls it as it is (no copy of the weight).
"""

from __future__ import annotations

import ctypes
import sys

import torch
from torch._library.opaque_object import register_opaque_type
from torch._opaque_base import OpaqueBase

from engine.device import cpu_flags, cpu_runs_bf16


def can_pack(weight: torch.Tensor) -> bool:
    if weight.device.type != "cpu" or weight.dim() != 2 or not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.float32:
        return True
    return weight.dtype == torch.bfloat16 and cpu_runs_bf16()


# Rows up to which a bfloat16 product runs ``blocked_linear`` on the packed buffer. Measured on
# the default model's 121 products in turn (2 threads, AMD EPYC with AVX-512 BF16, no AMX), time
# for all of them, oneDNN -> blocked_linear: 1 row 16.7 -> 11.0 ms, 4 rows 15.9 -> 10.3 ms, 8
# rows 16.9 -> 11.2 ms, 32 rows 31.0 -> 26.2 ms, 64 rows 54.7 -> 47.5 ms, 128 rows 95.7 -> 91.2
# ms; even from there on. With AMX tiles ``blocked_linear`` runs every row count: up to 4 rows
# with VDPBF16PS as elsewhere (steps bound by reading the weights), more on the tiles, reading
# the same buffer in place. The default model's 4 products of a layer (2 threads, Intel Xeon
# with AMX, oneDNN -> tiles, best of 20, alternating): 16 rows 0.22 -> 0.16 ms, 64 rows 0.36-0.37
# -> 0.27-0.28 ms, 256 rows 0.86-0.88 -> 0.72-0.73 ms, 512 rows 1.57 -> 1.49-1.50 ms.
BLOCKED_ROWS = 64
# Tokens up to which a decode step of bfloat16 weights runs the C++ decode stack on a CPU with
# AMX (``engine/decode_stack.py``), whose products are VDPBF16PS's: more run on the tiles.
BLOCKED_ROWS_AMX = 4

# output columns per block of the layout ``blocked_linear`` reads
_BLOCK = 64


class PackedWeight(OpaqueBase):
    """``weight`` [out_features, in_features] as an opaque oneDNN tensor. (A graph holding one
    bypasses the compiler's on-disk cache: oneDNN tensors cannot be pickled for its key.)

    ``blocked``: the same bytes as a plain tensor [N / 64, K / 2, 64, 2] when they are laid out
    so (checked bit for bit), for ``blocked_linear``; None otherwise."""

    def __init__(self, weight: torch.Tensor) -> None:
        weight = weight.detach().contiguous()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
        self.blocked = _blocked_view(self.packed, weight)
        from kernels.cpu_ops import has_int4_tiles

        # AMX: blocked_linear multiplies every row count, more than 4 rows on the tiles (where
        # they run: the OS lends them and SPLITFUSE_CPU_ISA leaves them in)
        self.tiles = self.blocked is not None and has_int4_tiles()
        self.blocked_rows = sys.maxsize if self.tiles else BLOCKED_ROWS

    def one_kernel(self) -> None:
        """From now on one kernel runs every product, so that a row's sums run in one order
        whatever the row count (deterministic mode): ``blocked_linear`` where it reads this
        weight and the CPU has no AMX (as fast as oneDNN at every row count there, measured
        above), oneDNN otherwise."""
        if self.blocked is not None and not _has_amx():
            self.blocked_rows = sys.maxsize
        else:
            self.blocked = None
            self.blocked_rows = 0
            self.tiles = False


register_opaque_type(PackedWeight, typ="reference")


def _has_amx() -> bool:
    return "amx_bf16" in cpu_flags()


def _blocked_view(packed: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """The packed buffer as a bfloat16 tensor [N / 64, K / 2, 64, 2] (sharing its memory: it
    lives as long as ``packed``), if that is its layout and ``blocked_linear`` runs here."""
    from kernels.cpu_ops import has_blocked_linear

    out_features, in_features = weight.shape
    if (
        weight.dtype != torch.bfloat16
        or out_features % _BLOCK
        or in_features % 2
        or torch.ops.mkldnn._nbytes(packed) != weight.numel() * weight.element_size()
        or not has_blocked_linear()
    ):
        return None
    address = torch.ops.mkldnn.data_ptr(packed)
    buffer = (ctypes.c_int16 * weight.numel()).from_address(address)
    blocked = torch.frombuffer(buffer, dtype=torch.int16)
    blocked = blocked.view(out_features // _BLOCK, in_features // 2, _BLOCK, 2)
    expected = weight.view(torch.int16).view(out_features // _BLOCK, _BLOCK, in_features // 2, 2)
    if not torch.equal(blocked, expected.transpose(1, 2)):
        return None
    return blocked.view(torch.bfloat16)


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
    if (
        weight.blocked is not None
        and num_rows <= weight.blocked_rows
        and x.dtype == torch.bfloat16
        and (bias is None or bias.dtype == torch.bfloat16)
    ):
        return torch.ops.splitfuse_cpu.blocked_linear(x.contiguous(), weight.blocked, bias)
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
