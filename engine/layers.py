"""Tensor-parallel building blocks: linear layers, vocabulary embedding and LM head.

Each parameter carries a ``weight_loader(param, loaded, shard_id)`` that copies this rank's part of
a checkpoint tensor into it. ``loaded`` is a safetensors slice (or a tensor): indexing it reads only
the rows or columns this rank keeps.

    ColumnParallelLinear, output_sizes [q, k, v] = [576, 192, 192], 3 ranks:
        rank 1 weight rows = q[192:384] ++ k[64:128] ++ v[64:128]      (local [320, hidden])
    RowParallelLinear, input 576, 3 ranks:
        rank 1 weight columns = [192:384], then the partial outputs are all-reduced
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.deterministic_rows import (
    PROBE_ROWS,
    at_least_two_rows,
    fixed_tiles,
    rows_independent,
)
from engine.packed_linear import PackedWeight, can_pack, packed_linear
from engine.parallel import SINGLE_PROCESS, ParallelContext
from engine.quantization import PackedInt4, PackedInt8, QuantizedTensor

logger = logging.getLogger(__name__)


def _shape(loaded: Any) -> tuple[int, ...]:
    return tuple(loaded.get_shape()) if hasattr(loaded, "get_shape") else tuple(loaded.shape)


class QuantizableWeight(nn.Module):
    """A module whose ``weight`` [rows, cols] ``set_quantized()`` can replace by a weight-only
    quantized one (``engine/quantization.py``): its tensors become the buffers ``qweight``,
    ``qscales`` and ``qmins`` (a 4-bit weight on a CPU packed as ``PackedInt4``; an 8-bit one
    given as a ``PackedInt8`` holds no mins), and the float parameter gives its storage up (a
    weight another module shares keeps it until that module is quantized too)."""

    weight: nn.Parameter
    # True where ``weight`` is another module's parameter too (an LM head tied to the embedding)
    shares_weight = False

    def __init__(self) -> None:
        super().__init__()
        self.quant_bits = 0  # 0: not quantized
        self.quant_group_size = 0
        # > 0: the 4-bit buffers hold a ``PackedInt4`` of this many output rows
        self.int4_out_features = 0
        # > 0: the 8-bit buffers hold a ``PackedInt8`` of this many output rows
        self.int8_out_features = 0
        # (out_features, in_features) of the weight once packed or quantized
        self.product_shape: tuple[int, int] = (0, 0)

    @property
    def quantized(self) -> QuantizedTensor | None:
        if not self.quant_bits:
            return None
        if self.int4_out_features:  # packed for the CPU's integer dot products
            packed = PackedInt4(
                self.qweight,
                self.qscales,
                self.qmins,
                self.int4_out_features,
                self.quant_group_size,
            )
            return packed.unpack()
        if self.int8_out_features:
            return self.packed_int8.unpack()
        return QuantizedTensor(
            self.qweight, self.qscales, self.qmins, self.quant_bits, self.quant_group_size
        )

    @property
    def packed_int8(self) -> PackedInt8:
        """The weight as the ``PackedInt8`` it was given as (``int8_out_features`` > 0)."""
        return PackedInt8(self.qweight, self.qscales, self.int8_out_features, self.quant_group_size)

    def set_quantized(self, quantized: QuantizedTensor | PackedInt8) -> None:
        # (a tied weight may have given its storage up already, quantized by its other module)
        if self.weight.numel() and quantized.shape != tuple(self.weight.shape):
            raise ValueError(
                f"a quantized weight of shape {quantized.shape} cannot replace one of "
                f"{tuple(self.weight.shape)}"
            )
        self.int4_out_features = self.int8_out_features = 0
        if isinstance(quantized, PackedInt8):
            self.register_buffer("qweight", quantized.packed, persistent=False)
            self.register_buffer("qscales", quantized.scales, persistent=False)
            self.register_buffer("qmins", None, persistent=False)
            self.int8_out_features = quantized.out_features
            self._quantized_as(8, quantized.group_size, quantized.shape)
            return
        tensors = quantized.qweight, quantized.scales, quantized.mins
        if quantized.bits == 4 and quantized.qweight.device.type == "cpu":
            # the layout the CPU's 4-bit product reads: the same bytes in another order
            packed = PackedInt4.pack(quantized)
            tensors = packed.packed, packed.scales, packed.mins
            self.int4_out_features = packed.out_features
        self.register_buffer("qweight", tensors[0], persistent=False)
        self.register_buffer("qscales", tensors[1], persistent=False)
        self.register_buffer("qmins", tensors[2], persistent=False)
        self._quantized_as(quantized.bits, quantized.group_size, quantized.shape)

    def _quantized_as(self, bits: int, group_size: int, shape: tuple[int, int]) -> None:
        self.quant_bits = bits
        self.quant_group_size = group_size
        self.product_shape = shape
        if not self.shares_weight:
            self.weight.data = self.weight.data.new_empty(0)


class MatmulLayer(QuantizableWeight):
    """A layer with a ``weight`` [out_features, in_features] that ``pack_weights()`` can replace
    by a packed copy once loaded (float32, and bfloat16 where the CPU has bfloat16 hardware; see
    ``engine/packed_linear.py``), or ``set_quantized()`` by a quantized one (CPUs: the operators
    ``splitfuse_cpu::int4_linear`` and ``quant_linear`` of ``kernels/cpu_ops.py``)."""

    # True: a CPU quantized product's float32 result is returned as it is, not rounded to x's
    # dtype (the LM head: the sampler reads float32 logits)
    float32_result = False

    def __init__(self) -> None:
        super().__init__()
        self.packed_weight: PackedWeight | None = None
        # the packed buffer as ``blocked_linear`` reads it (``PackedWeight.blocked``), a buffer
        # of the module so that a graph of a fixed row count passes it to the operator itself
        self.register_buffer("blocked_weight", None, persistent=False)
        self.blocked_rows = 0
        # whether products of more than a few rows multiply that buffer on AMX tiles
        # (``PackedWeight.tiles``: a graph reads no attribute of the opaque packed weight)
        self.blocked_tiles = False
        # deterministic mode (``set_deterministic``): a row's product never depends on the others;
        # in_tiles: the product runs as calls of TILE_ROWS rows (else whole, a single row as two)
        self.deterministic = False
        self.in_tiles = True

    def set_deterministic(self, max_rows: int = PROBE_ROWS) -> None:
        """From now on a row's result does not depend on how many rows share the product
        (``engine/deterministic_rows.py``); call after ``pack_weights``. A packed weight then
        runs one kernel for every row count (``PackedWeight.one_kernel``); a packed or quantized
        product on a CPU runs whole where that kernel's rows are independent here for calls of
        up to ``max_rows`` rows (a step's token budget), in fixed tiles otherwise."""
        self.deterministic = True
        if self.packed_weight is not None:
            self.packed_weight.one_kernel()
            self._share_blocked()
        cpu_quantized = bool(self.quant_bits) and self.qweight.device.type == "cpu"
        if self.packed_weight is not None or cpu_quantized:
            if self.packed_weight is not None:
                kind = "packed"
            else:  # (int8_linear and quant_linear multiply 8-bit weights differently)
                kind = "int8 packed" if self.int8_out_features else f"int{self.quant_bits}"
            out_features, in_features = self.product_shape
            key = (kind, out_features, in_features, self.weight.dtype)
            self.in_tiles = not rows_independent(
                self._product, in_features, self.weight.dtype, key, max_rows
            )
            if self.in_tiles:
                logger.info(
                    "deterministic mode: %s products of %dx%d run in fixed tiles (a row's sums "
                    "depend on the row count on this machine)",
                    kind,
                    out_features,
                    in_features,
                )

    def pack_weights(self) -> None:
        """Call once, after loading (and quantizing): the layer then multiplies with the packed
        copy, and the weight parameter gives its storage up (a weight another module shares keeps
        it). A quantized layer stays as it is."""
        if self.packed_weight is None and not self.quant_bits and can_pack(self.weight):
            self.product_shape = (self.weight.shape[0], self.weight.shape[1])
            self.packed_weight = PackedWeight(self.weight)
            self._share_blocked()
            if not self.shares_weight:
                self.weight.data = self.weight.data.new_empty(0)

    def _share_blocked(self) -> None:
        assert self.packed_weight is not None
        self.blocked_weight = self.packed_weight.blocked
        self.blocked_rows = self.packed_weight.blocked_rows
        self.blocked_tiles = self.packed_weight.tiles

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if not self.deterministic:
            return self._product(x, bias)
        if self.in_tiles:
            return fixed_tiles(self._product, x, bias)
        return at_least_two_rows(self._product, x, bias)

    def silu_mul_product(self, x: torch.Tensor, row_ops: bool = True) -> torch.Tensor | None:
        """SwiGLU's ``silu(gate) * up`` of this gate-and-up layer's product of x (the gate the
        first half of its outputs, the up the second), in x's dtype, in one C++ call, no bias,
        outside deterministic mode, None elsewhere:
        - 4-bit weights packed for the CPU's integer products, halves of whole 16-column
          blocks, where the forward runs the row operators (``row_ops``):
          ``splitfuse_cpu::int4_silu_mul``, the same bits as the product, its rounding to x's
          dtype and ``silu_mul_rows``;
        - bfloat16 weights and rows on a CPU with AMX, the weight's packed buffer in the layout
          ``blocked_linear`` reads (``blocked_tiles``), halves of whole 64-column blocks:
          ``splitfuse_cpu::blocked_silu_mul``, the same bits as ``blocked_linear`` then
          ``silu_mul_rows``; the [rows, 2 * intermediate] product never reaches memory."""
        if self.bias is not None or self.deterministic:
            return None
        if (
            self.blocked_tiles
            and self.blocked_weight is not None
            and x.dtype == torch.bfloat16
            and self.product_shape[0] % 128 == 0
        ):
            return torch.ops.splitfuse_cpu.blocked_silu_mul(
                x.contiguous(), self.blocked_weight, self.product_shape[0] // 2
            )
        half = self.int4_out_features // 2
        if not half or half % 16 or not row_ops:
            return None
        rows = x.contiguous() if x.dtype == torch.bfloat16 else x.float().contiguous()
        act = torch.ops.splitfuse_cpu.int4_silu_mul(
            rows, self.qweight, self.qscales, self.qmins, half, self.quant_group_size
        )
        return act.to(x.dtype)

    def _product(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.quant_bits:
            if x.is_cuda:  # Triton, in x's dtype with float32 sums
                from kernels.triton_quant_linear import triton_quant_linear

                out = triton_quant_linear(
                    x,
                    self.qweight,
                    self.qscales,
                    self.qmins,
                    self.quant_bits,
                    self.quant_group_size,
                )
            elif self.int4_out_features or self.int8_out_features:
                # x in int8 runs times the packed 4- or 8-bit values: int32 sums
                rows = x.contiguous() if x.dtype == torch.bfloat16 else x.float().contiguous()
                ops, size = torch.ops.splitfuse_cpu, self.quant_group_size
                if self.int4_out_features:  # rounded to x's dtype in the operator
                    out = ops.int4_linear(
                        rows,
                        self.qweight,
                        self.qscales,
                        self.qmins,
                        self.int4_out_features,
                        size,
                        not self.float32_result,
                    )
                else:
                    out = ops.int8_linear(
                        rows, self.qweight, self.qscales, self.int8_out_features, size
                    )
            else:  # 8 bits: float32 (or bfloat16) in, float32 out, float32 sums
                x_in = x if x.dtype == torch.bfloat16 else x.float()
                out = torch.ops.splitfuse_cpu.quant_linear(
                    x_in.contiguous(), self.qweight, self.qscales, self.quant_group_size
                )
            if not self.float32_result:  # (Triton's result is in x's dtype already)
                out = out.to(x.dtype)
            return out if bias is None else out + bias
        if self.packed_weight is None:
            return F.linear(x, self.weight, bias)
        if torch.compiler.is_compiling():  # the graph calls the operator (no copy of the weight)
            # imported here: sympy and the symbolic shapes are ~35 MiB an eager engine never uses
            from torch.fx.experimental.symbolic_shapes import statically_known_true

            # a graph of a fixed row count calls blocked_linear itself (one graph for every
            # row count keeps the operator that picks the kernel at each call)
            if (
                self.blocked_weight is not None
                and statically_known_true(x.shape[0] <= self.blocked_rows)
                and x.dtype == torch.bfloat16
                and (bias is None or bias.dtype == torch.bfloat16)
            ):
                return torch.ops.splitfuse_cpu.blocked_linear(
                    x.contiguous(), self.blocked_weight, bias
                )
            return torch.ops.splitfuse.packed_linear(
                x, self.packed_weight, self.product_shape[0], bias
            )
        return packed_linear(x, self.packed_weight, self.product_shape[0], bias)


def _copy_checked(param: torch.Tensor, value: torch.Tensor, name: str) -> None:
    if tuple(value.shape) != tuple(param.shape):
        raise ValueError(
            f"{name}: checkpoint shape {tuple(value.shape)} does not match {tuple(param.shape)}"
        )
    param.copy_(value)


class ColumnParallelLinear(MatmulLayer):
    """``y = x W^T (+ b)`` with W's output features split across ranks; no communication.

    ``output_sizes`` lists the fused parts (q/k/v, or gate/up), each split on its own so that a
    rank's output is the concatenation of its share of every part; ``shard_id`` in the loader is
    the part's index.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        *,
        bias: bool,
        dtype: torch.dtype,
        parallel: ParallelContext = SINGLE_PROCESS,
        shard_ranges: list[tuple[int, int]] | None = None,
    ) -> None:
        """``shard_ranges``: this rank's ``(start, size)`` of each part, for uneven splits
        (attention heads, see ``engine/tensor_parallel/sharding.py``); default: even shares in
        rank order."""
        super().__init__()
        self.parallel = parallel
        self.input_size = input_size
        self.output_sizes = list(output_sizes)
        if shard_ranges is None:
            self.local_sizes = [parallel.shard(size, "an output part") for size in output_sizes]
            self.local_starts = [parallel.rank * size for size in self.local_sizes]
        else:
            self.local_starts = [start for start, _ in shard_ranges]
            self.local_sizes = [size for _, size in shard_ranges]
        local_out = sum(self.local_sizes)
        self.weight = nn.Parameter(torch.empty(local_out, input_size, dtype=dtype), False)
        self.weight.weight_loader = self._load  # type: ignore[attr-defined]
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = nn.Parameter(torch.empty(local_out, dtype=dtype), False)
            self.bias.weight_loader = self._load  # type: ignore[attr-defined]

    @property
    def local_output_sizes(self) -> list[int]:
        return list(self.local_sizes)

    def _load(self, param: torch.Tensor, loaded: Any, shard_id: int = 0) -> None:
        full_size = self.output_sizes[shard_id]
        if _shape(loaded)[0] != full_size:
            raise ValueError(f"part {shard_id} has {_shape(loaded)[0]} rows, expected {full_size}")
        size = self.local_sizes[shard_id]
        start = self.local_starts[shard_id]
        offset = sum(self.local_sizes[:shard_id])
        _copy_checked(param[offset : offset + size], loaded[start : start + size], "column part")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(x, self.bias)


class RowParallelLinear(MatmulLayer):
    """``y = all_reduce(x_local W_local^T) (+ b)``: W's input features split across ranks; ``x``
    arrives already split (the output of a column-parallel layer)."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        bias: bool,
        dtype: torch.dtype,
        parallel: ParallelContext = SINGLE_PROCESS,
        input_range: tuple[int, int] | None = None,
    ) -> None:
        """``input_range``: this rank's ``(start, size)`` of the input features, for uneven
        splits; default: an even share in rank order."""
        super().__init__()
        self.parallel = parallel
        if input_range is None:
            self.local_input_size = parallel.shard(input_size, "the input features")
            self.local_input_start = parallel.rank * self.local_input_size
        else:
            self.local_input_start, self.local_input_size = input_range
        self.weight = nn.Parameter(
            torch.empty(output_size, self.local_input_size, dtype=dtype), False
        )
        self.weight.weight_loader = self._load_weight  # type: ignore[attr-defined]
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size, dtype=dtype), False)
            self.bias.weight_loader = _load_whole  # type: ignore[attr-defined]

    def _load_weight(self, param: torch.Tensor, loaded: Any, shard_id: int = 0) -> None:
        start = self.local_input_start
        _copy_checked(param, loaded[:, start : start + self.local_input_size], "row weight")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.parallel.all_reduce(self._matmul(x))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(QuantizableWeight):
    """Token embedding with the vocabulary split across ranks (padded to split evenly); a rank
    embeds the ids it owns, zeros the others, and the ranks' rows are summed. Quantized, it
    dequantizes only the rows it looks up."""

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        *,
        dtype: torch.dtype,
        parallel: ParallelContext = SINGLE_PROCESS,
    ) -> None:
        super().__init__()
        self.parallel = parallel
        self.vocab_size = vocab_size
        self.local_vocab_size = -(-vocab_size // parallel.world_size)
        self.vocab_start = parallel.rank * self.local_vocab_size
        self.weight = nn.Parameter(
            torch.zeros(self.local_vocab_size, hidden_size, dtype=dtype), False
        )
        self.weight.weight_loader = self._load  # type: ignore[attr-defined]

    def _load(self, param: torch.Tensor, loaded: Any, shard_id: int = 0) -> None:
        if _shape(loaded)[0] != self.vocab_size:
            raise ValueError(f"embedding has {_shape(loaded)[0]} rows, expected {self.vocab_size}")
        end = min(self.vocab_start + self.local_vocab_size, self.vocab_size)
        rows = loaded[self.vocab_start : end]
        _copy_checked(param[: end - self.vocab_start], rows, "embedding rows")

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.int8_out_features:
            return self.packed_int8.dequantize_rows(ids).to(self.weight.dtype)
        quantized = self.quantized
        if quantized is None:
            return F.embedding(ids, self.weight)
        return quantized.dequantize_rows(ids).to(self.weight.dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.parallel.world_size == 1:
            return self._lookup(input_ids)
        local_ids = input_ids - self.vocab_start
        outside = (local_ids < 0) | (local_ids >= self.local_vocab_size)
        embedded = self._lookup(local_ids.masked_fill(outside, 0))
        embedded.masked_fill_(outside[:, None], 0)
        return self.parallel.all_reduce(embedded)


class ParallelLMHead(MatmulLayer):
    """Logits over the vocabulary split across ranks, gathered to every rank. With tied
    embeddings the weight is the embedding's (same split)."""

    float32_result = True

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        *,
        dtype: torch.dtype,
        parallel: ParallelContext = SINGLE_PROCESS,
        tied_embedding: VocabParallelEmbedding | None = None,
    ) -> None:
        super().__init__()
        self.parallel = parallel
        self.vocab_size = vocab_size
        if tied_embedding is not None:
            self.weight = tied_embedding.weight
            self.shares_weight = True
        else:
            embedding = VocabParallelEmbedding(
                vocab_size, hidden_size, dtype=dtype, parallel=parallel
            )
            self.weight = embedding.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """[num_rows, hidden] -> [num_rows, vocab_size] logits (float32 where a CPU quantized
        product computes them: not rounded to the hidden's dtype and back)."""
        logits = self.parallel.all_gather(self._matmul(hidden))
        return logits if logits.shape[-1] == self.vocab_size else logits[:, : self.vocab_size]


def _load_whole(param: torch.Tensor, loaded: Any, shard_id: int = 0) -> None:
    _copy_checked(param, loaded[:], "weight")


def default_weight_loader(param: torch.Tensor, loaded: Any, shard_id: int = 0) -> None:
    """For parameters every rank holds whole (norm weights, replicated biases)."""
    _load_whole(param, loaded, shard_id)
