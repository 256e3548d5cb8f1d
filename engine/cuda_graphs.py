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
    query_start   [0, 1, 2, 3, 4]     one token a row, always
    context_lens  [6, 10, 3, 1]       the padding row attends to one position of a valid block
    block_tables  [[..], [..], [..], [..]]  the step's tables in the first columns
    -> logits of the 4 rows; the step's sampling rows are taken from them

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

from engine.step_graphs import COMPILED, EAGER
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


class DecodeGraphs:
    """Runs ``model(input_ids, positions, plan, sample_rows)``, replaying a CUDA graph for a
    decode step once the graphs are captured (``start``); the same interface as
    ``engine.step_graphs.StepGraphs``, the CPU's compiled steps."""

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
        # the static inputs, padded as a step of no rows would be (see the module docstring);
        # ordinary tensors, which steps rewrite in place with or without inference mode
        device, largest = kv_cache.device, self.sizes[-1] if self.enabled else 0
        self.input_ids = torch.zeros(largest, dtype=torch.int64, device=device)
        self.positions = torch.zeros(largest, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((largest,), -1, dtype=torch.int64, device=device)
        self.query_start = torch.arange(largest + 1, dtype=torch.int32, device=device)
        self.context_lens = torch.ones(largest, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(largest, self.max_blocks, dtype=torch.int32, device=device)
        self.sample_rows = torch.arange(largest, dtype=torch.int64, device=device)

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
        metadata = AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            query_start=self.query_start[: size + 1],
            context_lens=self.context_lens[:size],
            block_tables=self.block_tables[:size],
            max_query_len=1,
            # the tables' capacity: the attention's splits are chosen for any context
            max_context_len=self.max_position,
        )
        positions = self.positions[:size]
        plan = self.backend.plan(positions, metadata, self.kv_cache, self.max_position)
        input_ids, sample_rows = self.input_ids[:size], self.sample_rows[:size]
        return lambda: self.model(input_ids, positions, plan, sample_rows)

    def graph_size(self, num_rows: int) -> int | None:
        """The capture size a decode step of ``num_rows`` rows replays (None: none fits)."""
        index = bisect.bisect_left(self.sizes, num_rows)
        return self.sizes[index] if index < len(self.sizes) else None

    def __call__(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        plan: Any,
        sample_rows: torch.Tensor,  # [num_sampled]
    ) -> torch.Tensor:
        size = self._replayable(input_ids, plan)
        if size is None:
            return self.model(input_ids, positions, plan, sample_rows)
        metadata: AttentionMetadata = plan.metadata
        num_rows, width = metadata.block_tables.shape
        self.input_ids[:num_rows].copy_(input_ids)
        self.positions[:num_rows].copy_(positions)
        self.slot_mapping[:num_rows].copy_(metadata.slot_mapping)
        self.slot_mapping[num_rows:size].fill_(-1)  # an earlier, larger step's slots are there
        self.context_lens[:num_rows].copy_(metadata.context_lens)
        self.context_lens[num_rows:size].fill_(1)
        self.block_tables[:num_rows, :width].copy_(metadata.block_tables)
        replay, logits = self._graphs[size]
        replay()
        # [num_sampled, vocab_size], its own tensor: the next replay rewrites ``logits``
        return logits.index_select(0, sample_rows)

    def _replayable(self, input_ids: torch.Tensor, plan: Any) -> int | None:
        """The capture size this step replays, or None where it runs eagerly: not captured (yet),
        not a decode step, more rows than the largest size or wider tables, or another cache."""
        if self.mode != COMPILED:
            return None
        metadata = getattr(plan, "metadata", None)
        if not isinstance(metadata, AttentionMetadata) or plan.kv_cache is not self.kv_cache:
            return None
        num_tokens = input_ids.shape[0]
        # one token in every row: as many rows as tokens, none longer than one
        if metadata.max_query_len != 1 or metadata.context_lens.shape[0] != num_tokens:
            return None
        if metadata.block_tables.shape[1] > self.max_blocks:
            return None
        return self.graph_size(num_tokens)
