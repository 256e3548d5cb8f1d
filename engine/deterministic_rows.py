"""Matrix products whose result for a row does not depend on the other rows of the call.

A library product picks its kernel, and with it the order in which a row's sums are added, from
the call's shape: the same row multiplied alone and among others can round differently. Measured
with ``torch.equal`` on random rows at random positions (AMD EPYC with AVX-512, 1 and 2 threads,
float32 and bfloat16, every shape of the default model; ``tests/kernels/
test_deterministic_kernels.py``):

    ``blocked_linear`` on a packed weight (bfloat16)            equal for every count
    oneDNN with a packed weight (``engine/packed_linear.py``)   equal for every count >= 2
    the quantized C++ product (``kernels/cpu/``)                 equal for every count >= 2
    MKL (``F.linear``, float32)                                  equal for 4, 8 and >= 12 rows

so a packed weight runs one of the first two for every row count (``PackedWeight.one_kernel``),
the packed and quantized products run a single row as two (the second a copy of the first), and
every other product runs as separate calls of ``TILE_ROWS`` rows (padded): each call then has one
shape, the one rule that holds whatever the library.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

# rows of every call of ``fixed_tiles``: a decode step pays a product of this many rows
TILE_ROWS = 16

Product = Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]


def at_least_two_rows(product: Product, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``product(x, bias)`` for x [num_rows, in_features], a single row run as two."""
    if x.shape[0] != 1:
        return product(x, bias)
    return product(x.expand(2, -1).contiguous(), bias)[:1]


def fixed_tiles(product: Product, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``product(x, bias)`` as calls of exactly ``TILE_ROWS`` rows each (the last one padded
    with zero rows): 35 rows -> calls on rows 0-15, 16-31, 32-34 + 13 zero rows."""
    num_rows = x.shape[0]
    padded = -(-max(num_rows, 1) // TILE_ROWS) * TILE_ROWS
    x = F.pad(x, (0, 0, 0, padded - num_rows))
    tiles = [product(tile, bias) for tile in x.split(TILE_ROWS)]
    return torch.cat(tiles)[:num_rows]
