"""How the runner executes a decode step on a GPU: a CUDA graph replayed instead of ~10 kernel
launches a layer from Python.

A step in which every row decodes one token is padded to the next capture size and replays the
graph captured for that size; every other step (prompt chunks, mixes, more rows than the largest
size) runs the eager forward. The graphs are captured at start-up, largest first, in one memory
pool, over static input buffers that each step fills:

    capture sizes (max_batch_seqs 20): 1, 2, 4, 8, 16, 20   (then every 8 rows, at most 256)

    a decode step of 3 rows (tokens 50, 60, 70 at positions 5, 9, 2) replays the graph of 4:
    input_ids     [50, 60, 70, .]     .: what an earlier step left there (any valid id)
    positions     [5, 9, 2, .]
    slot_mapping  [s0, s1, s2, -1]    -1: the padding row stores no K/V
    query_start   [0, 1, 2, 3, 4]     one token a row, always (not rewritten)
    context_lens  [6, 10, 3, 1]       the padding row attends to one position of a valid block
    block_tables  [[..], [..], [..], [..]]  the step's tables in the first columns
    -> logits of the 4 rows; the step's sampling rows (``sample_rows``) are taken from them

The rewritten inputs are views into one byte buffer (``DecodeInputs``), laid out so that what a
step of ``size`` rows reads is a prefix of it; the runner builds a step's inputs on the host,
checks their values there (``DecodeGraphs.replay``), writes them into a host copy of that buffer
(pinned) and sends the prefix in one host-to-device copy before the replay.

The graph's kernels never read the step's sizes from the host: the attention plan of a capture
size declares the longest context the tables can hold (``max_model_len``), so its context splits
(flash-decoding, ``kernels/triton_attention.py``) are fixed at capture and cover every context
(splits past a row's context add nothing). Padding rows are independent rows: no kernel mixes
rows, so they change no real row's numbers beyond what the products' tile choices for another
row count do (deterministic mode's products run in fixed tiles: none).

Captured only with the Triton attention backend, in one process: tensor-parallel ranks run the
eager forward (their all-reduces would have to be captured on every rank alike).
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from engine.input_builder import ModelInput
from engine.step_graphs import COMPILED, EAGER
from kernels.checks import check_index_values, check_metadata
from kernels.metadata import AttentionMetadata

logger = logging.getLogger(__name__)

# the largest decode step replayed from a graph: bigger ones are bound by their arithmetic, where
# launch overhead no longer counts (vLLM captures up to 512; each size costs capture time and
# graph memory)
MAX_CAPTURE_ROWS = 256

# (forward, memory pool) -> (replay, the output tensor each replay rewrites)
Capture = Callable[[Callable[[], torch.Tensor], Any], tuple[Callable[[], None], torch.Tensor]]


def capture_sizes(max_rows: int) -> list[int]:
    """The row counts graphs are captured for: 1, 2, 4, 8, then every 8 rows, up to ``max_rows``
    (at most ``MAX_CAPTURE_ROWS``), which is always one. 20 -> [1, 2, 4, 8, 16, 20]."""
    if max_rows < 1:
        raise ValueError(f"max_rows must be at least 1, got {max_rows}")
    limit = min(max_rows, MAX_CAPTURE_ROWS)
    sizes = [size for size in (1, 2, 4) if size < limit] + list(range(8, limit, 8))
    return [*sizes, limit]


def cuda_graphs_unsupported(device: torch.device, attention_backend: str, world_size: int) -> str:
    """Why decode steps cannot replay CUDA graphs here ('' when they can)."""
    if device.type != "cuda":
        return "CUDA graphs are for CUDA devices"
    if attention_backend != "triton":
        return "CUDA graphs need the triton attention backend (the torch one plans on the host)"
    if world_size > 1:
        return "tensor-parallel ranks run the eager forward"
    return ""


def capture_cuda_graph(
    forward: Callable[[], torch.Tensor], pool: Any
) -> tuple[Callable[[], None], torch.Tensor]:
    """Runs ``forward`` once on a side stream (Triton compiles its kernels, cuBLAS picks its
    algorithms, the allocator warms up: none of that may happen during capture), then captures
    it into a graph that allocates from ``pool``."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        forward()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        output = forward()
    return graph.replay, output


class DecodeInputs:
    """The inputs a decode step rewrites, for up to ``max_rows`` rows, as views into one byte
    buffer. Every field starts at a multiple of 16 bytes (Triton specializes its kernels on
    pointers so aligned, as fresh allocations are), and the block tables come last, row-major, so
    that the first ``size`` rows of every field lie in the prefix ``num_bytes(size)``:

        max_rows 4, max_blocks 3 (byte offsets):
        [0, 32)    input_ids     int64 [4]
        [32, 64)   positions     int64 [4]
        [64, 96)   slot_mapping  int64 [4]
        [96, 128)  sample_rows   int64 [4]   the step's sampling rows (the first num_sampled)
        [128, 144) context_lens  int32 [4]
        [144, 192) block_tables  int32 [4, 3]
        num_bytes(2) = 144 + 2 * 3 * 4 = 168: rows 0-1 of the tables, all of the fields before

    Filled as a step of no rows would be: slot -1, context 1, everything else 0."""

    def __init__(
        self, max_rows: int, max_blocks: int, device: torch.device, pin_memory: bool = False
    ) -> None:
        """``pin_memory``: page-locked host memory, which a copy to a GPU reads asynchronously."""
        # room for a multiple of 4 rows: each field's bytes are then a multiple of 16
        rows = -(-max_rows // 4) * 4
        self.tables_offset = (4 * 8 + 4) * rows  # four int64 fields, one int32
        self.buffer = torch.zeros(
            self.tables_offset + max_rows * max_blocks * 4,
            dtype=torch.uint8,
            device=device,
            pin_memory=pin_memory,
        )
        longs = self.buffer[: 4 * 8 * rows].view(torch.int64).view(4, rows)[:, :max_rows]
        self.input_ids, self.positions, self.slot_mapping, self.sample_rows = longs
        ints = self.buffer[4 * 8 * rows : self.tables_offset].view(torch.int32)
        self.context_lens = ints[:max_rows]
        tables = self.buffer[self.tables_offset :].view(torch.int32)
        self.block_tables = tables.view(max_rows, max_blocks)
        self.slot_mapping.fill_(-1)
        self.context_lens.fill_(1)

    def num_bytes(self, size: int) -> int:
        """The length of the prefix holding the first ``size`` rows of every field."""
        return self.tables_offset + size * self.block_tables.shape[1] * 4

    def write(
        self,
        input_ids: torch.Tensor,  # [num_rows] int64
        positions: torch.Tensor,  # [num_rows] int64
        metadata: AttentionMetadata,  # of a decode step: one token a row
        sample_rows: torch.Tensor,  # [num_sampled] int64
        size: int,
    ) -> None:
        """A decode step's rows, then padding rows up to ``size`` (slot -1, context 1: an
        earlier, larger step's rows are there); a row's table columns past the step's keep
        what an earlier step left (valid block ids, never read past its context)."""
        num_rows, width = metadata.block_tables.shape
        self.input_ids[:num_rows].copy_(input_ids)
        self.positions[:num_rows].copy_(positions)
        self.slot_mapping[:num_rows].copy_(metadata.slot_mapping)
        self.slot_mapping[num_rows:size].fill_(-1)
        self.context_lens[:num_rows].copy_(metadata.context_lens)
        self.context_lens[num_rows:size].fill_(1)
        self.block_tables[:num_rows, :width].copy_(metadata.block_tables)
        self.sample_rows[: sample_rows.shape[0]].copy_(sample_rows)


class DecodeGraphs:
    """Runs ``model(input_ids, positions, plan, sample_rows)``, replaying a CUDA graph for a
    decode step once the graphs are captured (``start``); the same interface as
    ``engine.step_graphs.StepGraphs``, the CPU's compiled steps, plus ``replay`` for a step
    built on the host."""

    def __init__(
        self,
        model: nn.Module,
        backend: Any,
        kv_cache: torch.Tensor,  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
        sizes: list[int],
        max_position: int,
        enabled: bool,
        unsupported: str = "",
        capture: Capture = capture_cuda_graph,
    ) -> None:
        """``sizes``: the capture sizes, ascending (``capture_sizes``); ``max_position``: the
        longest context (``max_model_len``); ``capture``: how a forward becomes a replayable
        graph (tests on a CPU pass one that re-runs it)."""
        self.model = model
        self.backend = backend
        self.kv_cache = kv_cache
        self.sizes = list(sizes)
        self.max_position = max_position
        self.capture = capture
        self.mode = EAGER
        self.compile_seconds: float | None = None
        self.enabled = enabled and not unsupported
        if enabled and unsupported:
            logger.info("CUDA graphs: not used (%s)", unsupported)
        # size -> (replay, the logits of its rows, rewritten by each replay)
        self._graphs: dict[int, tuple[Callable[[], None], torch.Tensor]] = {}
        self.max_blocks = -(-max_position // kv_cache.shape[3])
        # the static inputs the graphs read, and their host copy that a step fills; ordinary
        # tensors, which steps rewrite in place with or without inference mode
        device, largest = kv_cache.device, self.sizes[-1] if self.enabled else 0
        self.inputs = DecodeInputs(largest, self.max_blocks, device)
        on_gpu = device.type == "cuda"
        host = torch.device("cpu")
        self.staging = DecodeInputs(largest, self.max_blocks, host, on_gpu and self.enabled)
        # recorded after each copy out of ``staging``: the next step waits on it before writing
        self._staging_read = torch.cuda.Event() if on_gpu else None
        self.query_start = torch.arange(largest + 1, dtype=torch.int32, device=device)
        self.all_rows = torch.arange(largest, dtype=torch.int64, device=device)

    def start(
        self, dummy_step: Callable[[int], tuple] | None = None, background: bool = False
    ) -> None:
        """Captures a graph per size, largest first, in one memory pool (a smaller graph reuses
        the larger ones' memory). At start-up, before any step runs: other work on the device
        during a capture would break it. ``dummy_step`` and ``background`` are the CPU graphs'
        arguments, unused here. A capture that fails leaves every step eager (logged)."""
        del dummy_step, background
        if not self.enabled:
            return
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle() if self.kv_cache.is_cuda else None
        with torch.inference_mode():
            try:
                for size in reversed(self.sizes):
                    self._graphs[size] = self.capture(self._forward(size), pool)
            except Exception:  # the eager forward still serves
                logger.exception("CUDA graphs: capture failed; every step runs eagerly")
                self._graphs.clear()
                return
        self.compile_seconds = time.perf_counter() - start
        self.mode = COMPILED
        logger.info(
            "CUDA graphs: %d decode sizes (1 to %d rows) captured in %.1f s",
            len(self.sizes),
            self.sizes[-1],
            self.compile_seconds,
        )

    def wait(self, timeout: float | None = None) -> bool:
        """Capturing is over once ``start`` returns."""
        return True

    def _forward(self, size: int) -> Callable[[], torch.Tensor]:
        """The forward of a decode step of ``size`` rows over the static inputs' first rows."""
        inputs = self.inputs
        metadata = AttentionMetadata(
            slot_mapping=inputs.slot_mapping[:size],
            query_start=self.query_start[: size + 1],
            context_lens=inputs.context_lens[:size],
            block_tables=inputs.block_tables[:size],
            max_query_len=1,
            # the tables' capacity: the attention's splits are chosen for any context
            max_context_len=self.max_position,
        )
        positions = inputs.positions[:size]
        plan = self.backend.plan(positions, metadata, self.kv_cache, self.max_position)
        input_ids, all_rows = inputs.input_ids[:size], self.all_rows[:size]
        return lambda: self.model(input_ids, positions, plan, all_rows)

    def graph_size(self, num_rows: int) -> int | None:
        """The capture size a decode step of ``num_rows`` rows replays (None: none fits)."""
        index = bisect.bisect_left(self.sizes, num_rows)
        return self.sizes[index] if index < len(self.sizes) else None

    def replay(self, inputs: ModelInput) -> torch.Tensor | None:
        """The logits of the sampling rows of a step whose inputs are on the host, float32
        ``[num_sampled, vocab_size]``, from a graph; None where the step runs eagerly (see
        ``_replay_size``). Checks the inputs as the attention backend's plan checks host
        tensors, raising KernelInputError before anything is written; then fills ``staging``
        and sends its prefix to the static inputs in one copy."""
        if self.mode != COMPILED:
            return None
        positions, metadata = inputs.positions, inputs.metadata
        check_metadata(positions, metadata, torch.device("cpu"))
        size = self._replay_size(inputs.num_tokens, metadata)
        if size is None:
            return None
        check_index_values(positions, metadata, self.kv_cache.shape, self.max_position)
        if self._staging_read is not None:
            self._staging_read.synchronize()  # the previous step's copy has read ``staging``
        self.staging.write(inputs.input_ids, positions, metadata, inputs.sample_rows, size)
        num_bytes = self.staging.num_bytes(size)
        self.inputs.buffer[:num_bytes].copy_(self.staging.buffer[:num_bytes], non_blocking=True)
        if self._staging_read is not None:
            self._staging_read.record()
        return self._replay(size, inputs.sample_rows.shape[0])

    def __call__(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        plan: Any,
        sample_rows: torch.Tensor,  # [num_sampled]
    ) -> torch.Tensor:
        """The forward of a step whose inputs are on the device (``ModelRunner.run`` called with
        inputs built there): a decode step replays after copies on the device, unchecked as
        the plan leaves device values; everything else runs eagerly."""
        metadata = getattr(plan, "metadata", None)
        if (
            self.mode != COMPILED
            or not isinstance(metadata, AttentionMetadata)
            or plan.kv_cache is not self.kv_cache
            or (size := self._replay_size(input_ids.shape[0], metadata)) is None
        ):
            return self.model(input_ids, positions, plan, sample_rows)
        self.inputs.write(input_ids, positions, metadata, sample_rows, size)
        return self._replay(size, sample_rows.shape[0])

    def _replay(self, size: int, num_sampled: int) -> torch.Tensor:
        """Replays the graph of ``size`` over the written static inputs."""
        replay, logits = self._graphs[size]
        replay()
        # [num_sampled, vocab_size], its own tensor: the next replay rewrites ``logits``
        return logits.index_select(0, self.inputs.sample_rows[:num_sampled])

    def _replay_size(self, num_tokens: int, metadata: AttentionMetadata) -> int | None:
        """The capture size a step replays, or None where it runs eagerly: not a decode step,
        more rows than the largest size, or wider tables than the captured ones."""
        # one token in every row: as many rows as tokens, none longer than one
        if metadata.max_query_len != 1 or metadata.context_lens.shape[0] != num_tokens:
            return None
        if num_tokens == 0 or metadata.block_tables.shape[1] > self.max_blocks:
            return None
        return self.graph_size(num_tokens)
