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

The table holds where it was measured, not everywhere: on an Intel Xeon with AMX (16 cores,
torch 2.11) oneDNN's packed float32 products gave a row of 2 other bits than the same row among
300, at 2 and 16 threads, AMX on or off, and packed float32 and bfloat16 products a row among 100
other bits than among 300, which a probe of up to 33 rows against 48 had passed. So before a
packed or quantized product relies on it, ``rows_independent`` measures it on this machine, once
per kind and shape of product, up to the most rows a step multiplies (its token budget): random
rows at counts on both sides of the sizes where libraries change their blocking (powers of two,
their sums, multiples of 16) against one call of them all. One that fails runs in fixed tiles
like the others.
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


# the most rows a probe multiplies by default (the engine's default token budget), and the row
# counts it compares with them: those below the probe's own count are taken, and that count less
# one (~3,000 rows of products over the default 512, ~20-60 ms a shape of the default model)
PROBE_ROWS = 512
PROBE_COUNTS = (
    1, 2, 3, 4, 5, 7, 8, 12, 13, 16, 17, 31, 33, 47, 49, 63, 65, 95, 97, 100, 127, 129, 191, 193,
    255, 257, 300, 383, 385, 511, 513, 767, 1023, 1025, 2047, 4095,
)  # fmt: skip
_probed: dict[tuple[object, ...], bool] = {}


def rows_independent(
    product: Product,
    in_features: int,
    dtype: torch.dtype,
    key: tuple[object, ...],
    max_rows: int = PROBE_ROWS,
) -> bool:
    """Whether ``at_least_two_rows(product, x, None)`` gives each row of x the same bits whatever
    rows share its call, for calls of up to ``max_rows`` rows (at least 2), here: random rows at
    the ``PROBE_COUNTS`` below ``max_rows``, and ``max_rows - 1``, against one call of
    ``max_rows``. Measured once per ``key`` (the product's kind, shape and dtype: what a library
    picks its kernel from) and ``max_rows`` in a process."""
    max_rows = max(max_rows, 2)
    probed = (*key, max_rows)
    if probed not in _probed:
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(max_rows, in_features, generator=generator).to(dtype)
        full = at_least_two_rows(product, x, None)
        counts = sorted({count for count in PROBE_COUNTS if count < max_rows} | {max_rows - 1})
        _probed[probed] = all(
            torch.equal(at_least_two_rows(product, x[rows], None), full[rows])
            for rows in (torch.randperm(max_rows, generator=generator)[:count] for count in counts)
        )
    return _probed[probed]


def fixed_tiles(product: Product, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``product(x, bias)`` as calls of exactly ``TILE_ROWS`` rows each (the last one padded
    with zero rows): 35 rows -> calls on rows 0-15, 16-31, 32-34 + 13 zero rows."""
    num_rows = x.shape[0]
    padded = -(-max(num_rows, 1) // TILE_ROWS) * TILE_ROWS
    x = F.pad(x, (0, 0, 0, padded - num_rows))
    tiles = [product(tile, bias) for tile in x.split(TILE_ROWS)]
    return torch.cat(tiles)[:num_rows]
