"""Weight-only quantized weights: the layouts, quantizing float weights, and the PyTorch
reference for dequantizing them.

A weight [N, K] is cut into groups of ``group_size`` values along K (32, 64, 128, or K itself:
one group per output channel). Per group, float16 ``scales`` (and for 4 bits ``mins``), both
[N, K / group_size]:

    4 bits, asymmetric: q in [0, 15],     w = scale * q + min   (GGUF Q4_1; Q4_0: min = -8 scale)
    8 bits, symmetric:  q in [-127, 127], w = scale * q         (GGUF Q8_0)

4-bit values are packed two per byte, 16 bytes per run of 32 values, as GGUF stores them: byte
j of a run holds value j in its low nibble and value j + 16 in its high nibble.

    run values  0  1 ... 15 | 16 17 ... 31
    byte j      low nibble  | high nibble     ->  qweight [N, K / 2] uint8
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from engine.config import QuantizationConfig

RUN = 32  # values per packed run; every group is a whole number of runs


def pack_4bit(q: torch.Tensor) -> torch.Tensor:
    """[N, K] integers in [0, 15] -> [N, K / 2] uint8 in the run layout above."""
    num_rows, num_cols = q.shape
    runs = q.to(torch.uint8).reshape(num_rows, num_cols // RUN, 2, RUN // 2)
    return (runs[:, :, 0] | (runs[:, :, 1] << 4)).reshape(num_rows, num_cols // 2)


def unpack_4bit(qweight: torch.Tensor) -> torch.Tensor:
    """[N, K / 2] uint8 -> [N, K] uint8 values in [0, 15] (inverse of ``pack_4bit``)."""
    num_rows, num_bytes = qweight.shape
    runs = qweight.reshape(num_rows, num_bytes // (RUN // 2), 1, RUN // 2)
    return torch.cat([runs & 15, runs >> 4], dim=2).reshape(num_rows, num_bytes * 2)


def dequantize_groups(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor | None,
    bits: int,
    group_size: int,
) -> torch.Tensor:
    """The float32 weight [N, K] the quantized one stands for (the reference every kernel is tested
    against)."""
    q = unpack_4bit(qweight) if bits == 4 else qweight
    num_rows, num_cols = q.shape
    grouped = q.float().reshape(num_rows, num_cols // group_size, group_size)
    weight = grouped * scales.float()[:, :, None]
    if mins is not None:
        weight = weight + mins.float()[:, :, None]
    return weight.reshape(num_rows, num_cols)


@dataclass
class QuantizedTensor:
    """A quantized weight [N, K]. Indexing keeps it quantized: ``t[a:b]`` takes output rows,
    ``t[:, a:b]`` input columns on group boundaries (tensor-parallel shards: a group never
    straddles two ranks)."""

    qweight: torch.Tensor  # [N, K / 2] uint8 (4 bits) or [N, K] int8 (8 bits)
    scales: torch.Tensor  # [N, K / group_size] float16
    mins: torch.Tensor | None  # [N, K / group_size] float16, 4 bits only
    bits: int
    group_size: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.qweight.shape[0], self.qweight.shape[1] * (8 // self.bits)

    def get_shape(self) -> tuple[int, int]:
        return self.shape

    @property
    def nbytes(self) -> int:
        tensors = [self.qweight, self.scales] + ([self.mins] if self.mins is not None else [])
        return sum(t.numel() * t.element_size() for t in tensors)

    def __getitem__(self, index: object) -> QuantizedTensor:
        if isinstance(index, slice):
            return self._map(lambda t: t[index])
        if (
            isinstance(index, tuple)
            and len(index) == 2
            and index[0] == slice(None)
            and isinstance(index[1], slice)
        ):
            start, stop, step = index[1].indices(self.shape[1])
            if step != 1 or start % self.group_size or (stop - start) % self.group_size:
                raise ValueError(
                    f"columns {start}:{stop} cut a group of {self.group_size}: a shard of a "
                    "quantized weight must hold whole groups"
                )
            per_byte = 8 // self.bits
            groups = slice(start // self.group_size, stop // self.group_size)
            return QuantizedTensor(
                self.qweight[:, start // per_byte : stop // per_byte],
                self.scales[:, groups],
                None if self.mins is None else self.mins[:, groups],
                self.bits,
                self.group_size,
            )
        raise TypeError(f"a QuantizedTensor is indexed by rows or by columns, not {index!r}")

    def _map(self, fn) -> QuantizedTensor:  # type: ignore[no-untyped-def]
        """``fn`` applied to each of the tensors (the same rows of each)."""
        return QuantizedTensor(
            fn(self.qweight),
            fn(self.scales),
            None if self.mins is None else fn(self.mins),
            self.bits,
            self.group_size,
        )

    def take_rows(self, rows: torch.Tensor) -> QuantizedTensor:
        """The output rows ``rows`` (an index tensor), in that order."""
        return self._map(lambda t: t[rows])

    def contiguous(self) -> QuantizedTensor:
        return self._map(lambda t: t.contiguous())

    def copy_(self, other: QuantizedTensor) -> None:
        if (other.bits, other.group_size) != (self.bits, self.group_size):
            raise ValueError(
                f"a {other.bits}-bit weight in groups of {other.group_size} cannot fill a "
                f"{self.bits}-bit one in groups of {self.group_size}"
            )
        self.qweight.copy_(other.qweight)
        self.scales.copy_(other.scales)
        if self.mins is not None and other.mins is not None:
            self.mins.copy_(other.mins)

    def dequantize_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """The float32 rows ``rows`` [num_ids] of the weight -> [num_ids, K] (embedding lookups)."""
        mins = None if self.mins is None else self.mins[rows]
        return dequantize_groups(
            self.qweight[rows], self.scales[rows], mins, self.bits, self.group_size
        )

    def dequantize(self) -> torch.Tensor:
        return dequantize_groups(self.qweight, self.scales, self.mins, self.bits, self.group_size)

    @classmethod
    def empty(
        cls,
        num_rows: int,
        num_cols: int,
        bits: int,
        group_size: int,
        device: torch.device | None = None,
    ) -> QuantizedTensor:
        """A zero weight (each part to be filled by ``copy_``)."""
        check_group_size(num_cols, group_size)
        num_groups = num_cols // group_size
        qweight = torch.zeros(
            num_rows,
            num_cols * bits // 8,
            dtype=torch.uint8 if bits == 4 else torch.int8,
            device=device,
        )
        scales = torch.zeros(num_rows, num_groups, dtype=torch.float16, device=device)
        mins = torch.zeros_like(scales) if bits == 4 else None
        return cls(qweight, scales, mins, bits, group_size)


def check_group_size(num_cols: int, group_size: int) -> None:
    if group_size % RUN or num_cols % group_size:
        raise ValueError(
            f"a group of {group_size} values must be a multiple of {RUN} that divides the "
            f"{num_cols} input features"
        )


def _half_at_least(value: torch.Tensor) -> torch.Tensor:
    """The smallest float16 >= ``value`` (float32)."""
    half = value.to(torch.float16)
    below = half.float() < value
    return torch.where(below, torch.nextafter(half, half.new_full((), torch.inf)), half)


def _half_at_most(value: torch.Tensor) -> torch.Tensor:
    """The largest float16 <= ``value`` (float32)."""
    half = value.to(torch.float16)
    above = half.float() > value
    return torch.where(above, torch.nextafter(half, half.new_full((), -torch.inf)), half)


def quantize(weight: torch.Tensor, bits: int, group_size: int) -> QuantizedTensor:
    """Rounds a float weight [N, K] to the nearest value the layout holds: 8 bits symmetric
    (scale = max |w| / 127), 4 bits asymmetric (min = min w, scale = (max w - min w) / 15). The
    float16 scales are rounded up and the mins down, so every value stays within the group's
    range and is at most half a step from its weight; dequantizing gives back exactly what the
    values were rounded to."""
    num_rows, num_cols = weight.shape
    check_group_size(num_cols, group_size)
    grouped = weight.detach().float().reshape(num_rows, num_cols // group_size, group_size)
    smallest = 2.0**-24  # the smallest float16 (an all-zero group: any divisor gives q = 0)
    if bits == 8:
        scales = _half_at_least(grouped.abs().amax(dim=2) / 127)
        divisor = scales.float().clamp_min(smallest)[:, :, None]
        q = torch.round(grouped / divisor).clamp_(-127, 127).to(torch.int8)
        return QuantizedTensor(q.reshape(num_rows, num_cols), scales, None, 8, group_size)
    if bits == 4:
        mins = _half_at_most(grouped.amin(dim=2))
        scales = _half_at_least((grouped.amax(dim=2) - mins.float()) / 15)
        divisor = scales.float().clamp_min(smallest)[:, :, None]
        q = torch.round((grouped - mins.float()[:, :, None]) / divisor).clamp_(0, 15)
        packed = pack_4bit(q.reshape(num_rows, num_cols))
        return QuantizedTensor(packed, scales, mins, 4, group_size)
    raise ValueError(f"bits must be 4 or 8, got {bits}")


BLOCK_COLS = 16  # output columns per block of a weight packed for integer dot products


@dataclass
class PackedInt4:
    """A 4-bit weight [N, K] packed for ``splitfuse_cpu::int4_linear`` (CPUs): blocks of 16
    output columns (the last one padded with zero columns), each K / 8 steps of 64 bytes. Byte
    4 c + j of step s holds, for column c of the block, value 8 s + j in its low nibble and value
    8 s + 4 + j in its high nibble (j = 0..3), so one 64-byte load gives the 4 consecutive
    values of 16 columns that one VPDPBUSD multiplies with 4 int8 activations:

        packed  [ceil(N / 16), K * 8] uint8
        scales  [ceil(N / 16), K / group_size, 16] float16 (a block's 16 columns side by side)
        mins    [ceil(N / 16), K / group_size, 16] float16

    It holds the same numbers as the ``QuantizedTensor`` it came from (``unpack`` gives it back),
    in the same number of bytes, plus the padding."""

    packed: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor
    out_features: int
    group_size: int

    @classmethod
    def pack(cls, quantized: QuantizedTensor) -> PackedInt4:
        if quantized.bits != 4 or quantized.mins is None:
            raise ValueError("only 4-bit weights are packed for integer dot products")
        num_rows, num_cols = quantized.shape
        blocks = -(-num_rows // BLOCK_COLS)
        pad = blocks * BLOCK_COLS - num_rows
        values = F.pad(unpack_4bit(quantized.qweight), (0, 0, 0, pad))  # [N', K] in 0..15
        steps = values.reshape(blocks, BLOCK_COLS, num_cols // 8, 2, 4).permute(0, 2, 1, 3, 4)
        packed = (steps[:, :, :, 0] | (steps[:, :, :, 1] << 4)).reshape(blocks, num_cols * 8)

        def by_block(t: torch.Tensor) -> torch.Tensor:
            t = F.pad(t, (0, 0, 0, pad))
            return t.reshape(blocks, BLOCK_COLS, -1).transpose(1, 2).contiguous()

        return cls(
            packed.contiguous(),
            by_block(quantized.scales),
            by_block(quantized.mins),
            num_rows,
            quantized.group_size,
        )

    def unpack(self) -> QuantizedTensor:
        """The ``QuantizedTensor`` this was packed from."""
        blocks, step_bytes = self.packed.shape
        num_cols = step_bytes // 8
        steps = self.packed.reshape(blocks, num_cols // 8, BLOCK_COLS, 1, 4)
        values = torch.cat([steps & 15, steps >> 4], dim=3)  # [blocks, K / 8, 16, 2, 4]
        values = values.permute(0, 2, 1, 3, 4).reshape(blocks * BLOCK_COLS, num_cols)

        def by_row(t: torch.Tensor) -> torch.Tensor:
            return t.transpose(1, 2).reshape(blocks * BLOCK_COLS, -1)[: self.out_features]

        return QuantizedTensor(
            pack_4bit(values[: self.out_features]),
            by_row(self.scales).contiguous(),
            by_row(self.mins).contiguous(),
            4,
            self.group_size,
        )

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scales, self.mins))


@dataclass
class PackedInt8:
    """An 8-bit weight [N, K] packed for ``splitfuse_cpu::int8_linear`` (CPUs): the blocks of
    ``PackedInt4`` with one byte a value. Blocks of 16 output columns (the last one padded with
    zero columns), each K / 4 steps of 64 bytes; byte 4 c + j of step s holds value 4 s + j of
    column c of the block, as q + 128 (0..255: the unsigned operand of VPDPBUSD), so one 64-byte
    load gives the 4 consecutive values of 16 columns that one instruction multiplies with 4
    int8 activations:

        packed  [ceil(N / 16), K * 16] uint8
        scales  [ceil(N / 16), K / group_size, 16] float16

    A model whose products run ``int4_linear`` holds its 8-bit embedding and LM head so (one
    copy where they are tied): the head multiplies rows rounded to int8 as the 4-bit products
    do, and the embedding looks its rows up here (``dequantize_rows``)."""

    packed: torch.Tensor
    scales: torch.Tensor
    out_features: int
    group_size: int

    @classmethod
    def pack(cls, quantized: QuantizedTensor) -> PackedInt8:
        if quantized.bits != 8:
            raise ValueError("only 8-bit weights are packed as PackedInt8")
        num_rows, num_cols = quantized.shape
        if num_cols % 4:
            raise ValueError(f"an 8-bit weight of {num_cols} columns: not a multiple of 4")
        blocks = -(-num_rows // BLOCK_COLS)
        pad = blocks * BLOCK_COLS - num_rows
        values = F.pad(quantized.qweight, (0, 0, 0, pad))  # [N', K] int8: zero rows past N
        steps = values.reshape(blocks, BLOCK_COLS, num_cols // 4, 4).transpose(1, 2)
        packed = (steps.to(torch.int16) + 128).to(torch.uint8).reshape(blocks, num_cols * 16)
        scales = F.pad(quantized.scales, (0, 0, 0, pad))
        scales = scales.reshape(blocks, BLOCK_COLS, -1).transpose(1, 2)
        return cls(packed.contiguous(), scales.contiguous(), num_rows, quantized.group_size)

    def _values(self) -> torch.Tensor:
        """[blocks, K / 4, 16, 4] uint8: step, column, value of the step."""
        blocks, step_bytes = self.packed.shape
        return self.packed.view(blocks, step_bytes // 64, BLOCK_COLS, 4)

    def unpack(self) -> QuantizedTensor:
        """The ``QuantizedTensor`` this was packed from."""
        blocks, step_bytes = self.packed.shape
        num_cols = step_bytes // 16
        values = self._values().transpose(1, 2).reshape(blocks * BLOCK_COLS, num_cols)
        qweight = (values.to(torch.int16) - 128).to(torch.int8)[: self.out_features]
        scales = self.scales.transpose(1, 2).reshape(blocks * BLOCK_COLS, -1)
        return QuantizedTensor(
            qweight.contiguous(), scales[: self.out_features].contiguous(), None, 8, self.group_size
        )

    def dequantize_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows ``rows`` [R] (int64) of the weight as float32 [R, K]: an embedding's lookup."""
        block, column = rows // BLOCK_COLS, rows % BLOCK_COLS
        values = self._values()[block, :, column]  # [R, K / 4, 4]
        q = values.reshape(rows.shape[0], self.shape[1]).to(torch.float32) - 128
        scales = self.scales[block, :, column].float()  # [R, K / group_size]
        return q * scales.repeat_interleave(self.group_size, dim=1)

    @property
    def shape(self) -> tuple[int, int]:
        return self.out_features, self.packed.shape[1] // 16

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scales))


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (K a multiple of 32) as ``int4_linear`` multiplies it: per row and run of 32
    values, int8 ``q`` and a float32 scale ``d`` = max |x| / 127 (q = round(x / d), ties to even;
    an all-zero run: d = 0, q = 0). Returns q [M, K] int8 and d [M, K / 32] float32; x stands for
    q * d. Each element is off by at most d / 2, 1/254 of its run's largest magnitude."""
    num_rows, num_cols = x.shape
    runs = x.float().reshape(num_rows, num_cols // RUN, RUN)
    scale = runs.abs().amax(dim=2) / 127
    inverse = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    q = torch.round(runs * inverse[:, :, None]).to(torch.int8)
    return q.reshape(num_rows, num_cols), scale


def int4_linear_reference(x: torch.Tensor, weight: PackedInt4 | PackedInt8) -> torch.Tensor:
    """What ``int4_linear`` (``int8_linear`` for a ``PackedInt8``) computes, in float64: x
    quantized (``quantize_activations``) times the dequantized weight. -> [M, N] float32."""
    q, scale = quantize_activations(x)
    num_rows, num_cols = q.shape
    x_hat = q.double().reshape(num_rows, num_cols // RUN, RUN) * scale.double()[:, :, None]
    product = F.linear(x_hat.reshape(num_rows, num_cols), weight.unpack().dequantize().double())
    return product.float()


def int4_tiles_reference(x: torch.Tensor, weight: PackedInt4) -> torch.Tensor:
    """What ``int4_linear`` computes for a step's prompt rows on a CPU with AMX tiles
    (``kernels.cpu_ops.int4_tile_rows``), in float64: x rounded to bfloat16 times the dequantized
    weight rounded to bfloat16. -> [M, N] float32."""
    dequantized = weight.unpack().dequantize().bfloat16().double()
    return F.linear(x.bfloat16().double(), dequantized).float()


def quantize_model(
    model: torch.nn.Module,
    bits: int,
    group_size: int | None,
    embeddings: bool,
    stored: dict[str, QuantizedTensor],
) -> dict[str, int]:
    """Replaces the loaded model's linear weights by ``bits``-bit ones (groups of ``group_size``;
    None: one group per output channel), and with ``embeddings`` the token embedding and the LM
    head by 8-bit ones in groups of 32 (on a CPU with 4 bits, packed as ``PackedInt8``). A weight
    that ``stored`` (checkpoint name -> quantized tensor, e.g. a GGUF file's blocks) holds in that
    layout is taken from it, sharded like the float one; the others are quantized from the float
    weights. Returns counts: ``stored``, ``quantized``, ``kept`` (left in float: no group size
    fits them) and ``bytes``."""
    from engine.layers import (
        MatmulLayer,
        ParallelLMHead,
        QuantizableWeight,
        VocabParallelEmbedding,
    )

    def layout(module: QuantizableWeight) -> tuple[int, int] | None:
        num_cols = module.weight.shape[1]
        if isinstance(module, (VocabParallelEmbedding, ParallelLMHead)):
            return (8, RUN) if embeddings and num_cols % RUN == 0 else None
        size = group_size or num_cols
        if size % RUN or num_cols % size:
            return None
        return bits, size

    modules = {
        path: module
        for path, module in model.named_modules()
        if isinstance(module, (MatmulLayer, VocabParallelEmbedding))
    }
    layouts = {path: layout(module) for path, module in modules.items()}  # before any is freed
    # The stored weights, gathered per module (a fused layer takes several).
    holders: dict[str, QuantizedTensor] = {}
    parts: dict[str, set[int]] = {}
    for name, tensor in stored.items():
        target, shard_id = model.param_name(name)  # type: ignore[operator]
        if target is None or not target.endswith(".weight"):
            continue
        path = target.removesuffix(".weight")
        module = modules.get(path)
        if module is None or layouts[path] != (tensor.bits, tensor.group_size):
            continue
        if path not in holders:
            holders[path] = QuantizedTensor.empty(
                *module.weight.shape, tensor.bits, tensor.group_size, module.weight.device
            )
        with torch.no_grad():
            module.weight.weight_loader(holders[path], tensor, shard_id)  # type: ignore[operator]
        parts.setdefault(path, set()).add(shard_id)

    counts = {"stored": 0, "quantized": 0, "kept": 0, "bytes": 0}
    # weight storage -> its quantized form (tied weights)
    shared: dict[int, QuantizedTensor | PackedInt8] = {}
    # Embeddings first: a tied LM head then takes the same quantized tensors.
    ordered = sorted(
        modules.items(), key=lambda item: not isinstance(item[1], VocabParallelEmbedding)
    )
    for path, module in ordered:
        wanted = layouts[path]
        if wanted is None:
            counts["kept"] += 1
            continue
        key = id(module.weight)
        expected_parts = len(getattr(module, "output_sizes", [0]))
        if key in shared:
            quantized = shared[key]
        else:
            if path in holders and len(parts[path]) == expected_parts:
                quantized = holders[path]
                counts["stored"] += 1
            else:
                quantized = quantize(module.weight.data, *wanted)
                counts["quantized"] += 1
            if bits == 4 and quantized.bits == 8 and quantized.qweight.device.type == "cpu":
                # the embedding and the LM head of a 4-bit model: the head multiplies rows
                # rounded to int8 as the 4-bit products do (``PackedInt8``), one copy if tied
                quantized = PackedInt8.pack(quantized)
            counts["bytes"] += quantized.nbytes
        shared[key] = quantized
        module.set_quantized(quantized)
    return counts


def resolve_quantization(config: QuantizationConfig, device: torch.device) -> QuantizationConfig:
    """``auto`` -> int4 on a CPU where the quantized product is native code, whatever the
    engine's dtype; otherwise none. ``serve`` runs ``auto``: the fastest setting that meets the
    accuracy bar (README, "Quantization"). On the default model int4's perplexity is within 0.6%
    of float32's (bfloat16 weights: +0.5%), and against float32 weights it decodes faster at
    every concurrency; against bfloat16 weights multiplied in hardware (AVX-512 BF16) it decodes
    one stream in about half the time, 8 streams and prefill faster, 32 streams about even. Its
    greedy tokens part from float32's earlier than bfloat16's do (the activations' rounding to
    int8), which the bar does not count; ``quantization: none`` keeps the model's own weights.
    GPUs run int8 and int4 when asked for by name (the Triton product)."""
    method = config.method
    if method == "auto":
        from kernels.cpu_ops import load

        native = device.type == "cpu" and load() != "torch"
        method = "int4" if native else "none"
    if method == config.method:
        return config
    updates: dict[str, object] = {"method": method}
    updates["group_size"] = 32 if method == "int4" else None
    return config.model_copy(update=updates)
