"""The model runner: loads the model and its KV cache, and runs one ``ScheduledBatch``.

``execute(batch)`` is the middle of the engine step: inputs -> one ragged forward -> sampling. It
never touches a ``Request``; what it needs arrives in the batch.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Mapping
from pathlib import Path

import torch

from engine.config import QuantizationConfig
from engine.cuda_graphs import DecodeGraphs, capture_sizes, cuda_graphs_unsupported
from engine.decode_stack import DecodeStack
from engine.deterministic_rows import PROBE_ROWS
from engine.device import release_free_memory
from engine.gguf_quantized import read_quantized_file
from engine.graph_build import GraphBuild
from engine.input_builder import (
    ModelInput,
    build_decode_steps,
    build_model_input,
    pad_to_two_tokens,
)
from engine.kv_cache_memory import (
    Float8RangeWatch,
    allocate_kv_cache,
    bytes_per_block,
    num_blocks_for_budget,
)
from engine.layers import MatmulLayer, ParallelLMHead
from engine.model_config import ModelConfig
from engine.models import MODEL_CLASSES
from engine.moe import StackedExperts
from engine.parallel import SINGLE_PROCESS, ParallelContext
from engine.quantization import quantize_model
from engine.sampler import Sampler, SamplerOutput
from engine.step_graphs import (
    COMPILED,
    StepGraphs,
    compile_unsupported,
    deterministic_compile_unsupported,
)
from engine.step_timings import Phase, StepTimings
from engine.tensor_parallel.sharding import shard_heads
from engine.weights import iterate_weights
from kernels import AttentionMetadata, get_backend
from kernels.cpu_ops import has_int4_tiles, int4_tile_rows
from scheduler.batch import ScheduledBatch

logger = logging.getLogger(__name__)


class ModelRunner:
    """Owns the model, the KV-cache tensor and the sampler of one process."""

    def __init__(
        self,
        model_dir: Path | None,
        model_config: ModelConfig,
        *,
        dtype: torch.dtype,
        device: torch.device,
        attention_backend: str,
        kv_cache_dtype: torch.dtype | None = None,
        block_size: int,
        max_model_len: int,
        kv_cache_memory: int | float,
        num_kv_blocks: int | None,
        max_useful_blocks: int,
        seed: int,
        parallel: ParallelContext = SINGLE_PROCESS,
        compile: bool = False,
        quantization: QuantizationConfig | None = None,
        state_dict: Mapping[str, torch.Tensor] | None = None,
        deterministic: bool = False,
        max_decode_rows: int = 1,
        max_step_tokens: int = PROBE_ROWS,
    ) -> None:
        """The weights come from ``model_dir``'s files or, for a model already in this process
        (``engine.inference``), from ``state_dict`` (tensors by Hugging Face name; ``model_dir``
        is then None). ``quantization``: resolved (none, int8 or int4; see
        ``resolve_quantization``); ``kv_cache_dtype``: the cache's (None: ``dtype``; another
        needs the torch backend, see ``resolve_kv_cache_dtype``); ``deterministic``: a
        request's logits do not depend on the batch (see README); ``compile``: compiled step
        graphs on a CPU, CUDA graphs of decode steps of up to ``max_decode_rows`` rows on a GPU;
        ``max_step_tokens``: the most tokens a step holds (deterministic mode measures its
        products' rows up to it)."""
        # this call's arguments, from which another process builds the same runner's graphs
        arguments = {name: value for name, value in locals().items() if name != "self"}
        if (model_dir is None) == (state_dict is None):
            raise ValueError("give the weights as model_dir or as state_dict, not both or neither")
        self.model_config = model_config
        self.dtype = dtype
        self.device = device
        self.block_size = block_size
        self.parallel = parallel
        start = time.perf_counter()
        model_class = MODEL_CLASSES[model_config.architecture]
        self.backend = get_backend(attention_backend, deterministic)
        self.max_position = max_model_len
        with torch.device(device):
            self.model = model_class(
                model_config,
                dtype=dtype,
                backend=self.backend,
                max_position=max_model_len,
                parallel=parallel,
            )
        self.model.load_weights(
            iterate_weights(model_dir) if state_dict is None else state_dict.items()
        )
        self.model.eval()
        self.quantization_counts: dict[str, int] = {}  # what quantize_model did, if it ran
        logger.info(
            "loaded %s (%s, %s) in %.1f s",
            "a model in memory" if model_dir is None else model_dir.name,
            model_config.architecture,
            str(dtype).removeprefix("torch."),
            time.perf_counter() - start,
        )
        if quantization is not None and quantization.bits:
            self._quantize(model_dir, quantization)

        num_kv_heads = shard_heads(
            model_config.num_heads, model_config.num_kv_heads, parallel.rank, parallel.world_size
        ).num_kv_heads
        kv_cache_dtype = dtype if kv_cache_dtype is None else kv_cache_dtype
        block_bytes = bytes_per_block(
            model_config.num_layers, block_size, num_kv_heads, model_config.head_dim, kv_cache_dtype
        )
        if num_kv_blocks is None:
            num_kv_blocks = num_blocks_for_budget(
                kv_cache_memory, block_bytes, device, max_useful_blocks
            )
        # Block ids are shared by every rank's cache: all ranks take the smallest count.
        num_kv_blocks = parallel.min_over_ranks(num_kv_blocks)
        self.num_kv_blocks = num_kv_blocks
        start = time.perf_counter()
        self.kv_cache = allocate_kv_cache(
            model_config.num_layers,
            num_kv_blocks,
            block_size,
            num_kv_heads,
            model_config.head_dim,
            kv_cache_dtype,
            device,
        )  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim], memory committed
        self.float8_watch = Float8RangeWatch(self.kv_cache)
        logger.info(
            "KV cache: %d blocks of %d tokens (%d tokens, %s, %.1f MiB, committed in %.1f s)",
            num_kv_blocks,
            block_size,
            num_kv_blocks * block_size,
            str(kv_cache_dtype).removeprefix("torch."),
            num_kv_blocks * block_bytes / 2**20,
            time.perf_counter() - start,
        )
        for module in self.model.modules():
            if isinstance(module, (MatmulLayer, StackedExperts)):
                module.pack_weights()  # on a CPU: oneDNN layout, once
                if deterministic and isinstance(module, MatmulLayer):  # MoE is refused
                    # the LM head multiplies the sampled rows alone: one a row at most
                    sampled = isinstance(module, ParallelLMHead)
                    module.set_deterministic(max_decode_rows if sampled else max_step_tokens)
        int4_products = any(
            isinstance(module, MatmulLayer) and module.int4_out_features
            for module in self.model.modules()
        )
        # a CPU with AMX multiplies the 4-bit products of prompt tokens on its tiles, those of
        # generated tokens as before (``kernels.cpu_ops.int4_tile_rows``; deterministic mode
        # splits products into tiles of rows of its own)
        self.prompt_tiles = (
            device.type == "cpu" and not deterministic and int4_products and has_int4_tiles()
        )
        # the forward's norms, rotary and SiLU are the decode stack's where their products are
        # the same kernels (4-bit weights): a decode token's bits then do not depend on which
        # of the two runs its step (``TorchBackend.row_ops``)
        if self.backend.name == "torch":
            self.backend.row_ops = int4_products  # type: ignore[attr-defined]
        # decode steps of a Llama stack with 4-bit or blocked bfloat16 weights on a CPU: one
        # C++ call (``engine/decode_stack.py``; None: the graphs run them)
        self.decode_stack = (
            DecodeStack.build(self.model, parallel, deterministic, self.kv_cache)
            if self.backend.name == "torch"
            else None
        )
        # whether a step of one token can reach the graphs: not where the decode stack takes
        # every one (without AMX prompt tiles no step's prompt tokens bypass it), so that their
        # graph is not compiled (the default model in int4 on 2 cores of an AVX2 CPU, cold
        # caches: ~110 s of a ~250 s compile)
        self.one_token_steps = self.decode_stack is None or self.prompt_tiles
        # the argmax of the last ``run``'s logits rows where the decode stack gave it, else None
        self.greedy_ids: torch.Tensor | None = None
        self.pad_single_token = False
        self.graphs: StepGraphs | DecodeGraphs
        if device.type == "cuda":
            self.graphs = DecodeGraphs(
                self.model,
                self.backend,
                self.kv_cache,
                capture_sizes(max_decode_rows),
                max_model_len,
                compile,
                cuda_graphs_unsupported(device, attention_backend, parallel.world_size),
            )
        else:
            unsupported = compile_unsupported(device, attention_backend, parallel.world_size)
            if deterministic and not unsupported:
                unsupported = deterministic_compile_unsupported(self.model.model)
            # Deterministic mode: inductor's graph of one token sums a row in another order
            # than the graph of two and up (whose order does not depend on the step's size), so
            # a one-token step runs padded to two; and every step runs the same code, so
            # requests wait for the graphs instead of running eagerly while they compile.
            self.pad_single_token = deterministic
            builder = None
            if model_dir is not None and not deterministic:
                # the same runner in another process, where the graphs compile (see
                # ``engine/graph_build.py``; used only where no graph needs the compiler to run):
                # this call's arguments but the process group, compile setting and weights
                child_kwargs = {
                    name: value
                    for name, value in arguments.items()
                    if name not in ("parallel", "compile", "state_dict")
                }
                builder = GraphBuild(child_kwargs, torch.get_num_threads())
            self.graphs = StepGraphs(
                self.model,
                compile,
                unsupported,
                single_token_graph=not deterministic,
                operator_step=self.backend.operator_step,
                builder=builder,
                one_token_steps=self.one_token_steps,
            )
        self.graphs.start(self._dummy_step, background=not deterministic)
        self.sampler = Sampler(model_config.vocab_size, device, seed=seed)
        # set while profiling: each forward pass and each sampling is timed into it
        self.timings: StepTimings | None = None

    def _timed(self, phase: Phase) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext() if self.timings is None else self.timings.measure(phase)

    def _quantize(self, model_dir: Path | None, quantization: QuantizationConfig) -> None:
        from kernels.cpu_ops import load as load_quantized_product

        start = time.perf_counter()
        kind = "triton" if self.device.type == "cuda" else load_quantized_product()
        self.quantization_counts = counts = quantize_model(
            self.model,
            quantization.bits,
            quantization.group_size,
            quantization.embeddings == "int8",
            {} if model_dir is None else read_quantized_file(model_dir),
        )
        release_free_memory()  # the float weights just given up
        logger.info(
            "weights in %s: %d as stored in the folder, %d quantized here, %d kept in %s "
            "(%.1f MiB quantized; products run with %s) in %.1f s",
            quantization.method,
            counts["stored"],
            counts["quantized"],
            counts["kept"],
            str(self.dtype).removeprefix("torch."),
            counts["bytes"] / 2**20,
            kind,
            time.perf_counter() - start,
        )

    def _dummy_step(self, num_tokens: int, decode: bool = False) -> tuple:
        """The forward's arguments for a step of ``num_tokens`` tokens over a scratch KV cache
        of a few blocks (compiling the graphs while requests run in the real one): one prompt,
        or with ``decode`` as many rows each decoding its second token."""
        device = self.device
        block_size = self.block_size
        positions = torch.arange(num_tokens, device=device)
        tokens = torch.zeros(num_tokens, dtype=torch.int64, device=device)
        if decode:
            # row r holds blocks 2r and 2r + 1 and stores position 1 in the first
            num_blocks = 2 * num_tokens
            tables = torch.arange(num_blocks, dtype=torch.int32, device=device).view(-1, 2).clone()
            slots = torch.arange(num_tokens, device=device) * 2 * block_size + 1
            positions = torch.ones(num_tokens, dtype=torch.int64, device=device)
            query_start = torch.arange(num_tokens + 1, dtype=torch.int32, device=device)
            context_lens = torch.full((num_tokens,), 2, dtype=torch.int32, device=device)
            max_query_len, max_context_len = 1, 2
        else:
            # two blocks at least: a graph traced over tables (or a cache) of one block would
            # specialize that dimension to 1
            num_blocks = max(2, -(-num_tokens // block_size))
            # not a view: a graph that takes the tables guards on a view's base
            tables = torch.arange(num_blocks, dtype=torch.int32, device=device)[None].clone()
            slots = positions.clone()
            query_start = torch.tensor([0, num_tokens], dtype=torch.int32, device=device)
            context_lens = torch.tensor([num_tokens], dtype=torch.int32, device=device)
            max_query_len = max_context_len = num_tokens
        scratch = torch.zeros_like(self.kv_cache[:, :, :num_blocks])  # [layers, 2, blocks, ...]
        metadata = AttentionMetadata(
            slot_mapping=slots,
            query_start=query_start,
            context_lens=context_lens,
            block_tables=tables,
            max_query_len=max_query_len,
            max_context_len=max_context_len,
        )
        plan = self.backend.plan(positions, metadata, scratch, self.max_position)
        sample_rows = torch.tensor([num_tokens - 1], device=device)
        return tokens, positions, plan, sample_rows

    @property
    def max_decode_ahead_rows(self) -> int:
        """The most rows of a batch of several decode steps (``ScheduledBatch.num_steps``) that
        ``execute`` takes; 0 where it takes none: only the decode stack that holds the LM head
        runs them (its argmax is each step's greedy token)."""
        stack = self.decode_stack
        return stack.max_tokens if stack is not None and stack.holds_head else 0

    def execute(self, batch: ScheduledBatch) -> SamplerOutput:
        """Runs the batch's forward pass and samples one token per sampling row (row order); a
        batch of several decode steps, its ``num_steps`` tokens per row."""
        self.sampler.remove_requests(batch.finished_request_ids)
        for new_request in batch.new_requests:
            self.sampler.add_request(new_request)
        if batch.is_empty:
            return SamplerOutput(token_ids=[], logprobs=[])
        if batch.num_steps > 1:
            return self._execute_steps(batch)
        # structured outputs: their grammar masks are filled while the forward pass runs
        self.sampler.start_masks(batch.sample_request_ids)
        logits = self.forward(batch)
        with self._timed("sampling"):
            return self.sampler.sample(logits, batch.sample_request_ids, self.greedy_ids)

    def _execute_steps(self, batch: ScheduledBatch) -> SamplerOutput:
        """A batch of several decode steps of plain greedy requests, in one pass of the decode
        stack (the sampler only counts the tokens)."""
        num_rows = batch.num_rows
        if not 0 < num_rows <= self.max_decode_ahead_rows:
            raise ValueError(
                f"a batch of {batch.num_steps} decode steps with {num_rows} rows: this runner "
                f"takes several steps for 1 to {self.max_decode_ahead_rows} rows"
            )
        request_ids = batch.sample_request_ids
        self.sampler.count_greedy_steps(request_ids, batch.num_steps)
        steps = build_decode_steps(batch, self.block_size, self.device)
        assert self.decode_stack is not None
        with self._timed("forward"), torch.inference_mode():
            sampled = self.decode_stack.run_ahead(steps, self.kv_cache)  # [num_steps, num_rows]
        return SamplerOutput(token_ids=sampled.t().tolist(), logprobs=[None] * num_rows)

    def forward(self, batch: ScheduledBatch) -> torch.Tensor:
        """The batch's logits for its sampling rows, float32 ``[num_sampled, vocab_size]``."""
        return self.run(
            build_model_input(batch, self.block_size, self.input_device(), self.prompt_tiles)
        )

    def input_device(self) -> torch.device:
        """Where a step's flat inputs are built for ``run``: on the host once CUDA graphs are
        captured (a step that replays one reaches the device in one copy), else the device."""
        on_host = isinstance(self.graphs, DecodeGraphs) and self.graphs.mode == COMPILED
        return torch.device("cpu") if on_host else self.device

    def run(self, inputs: ModelInput) -> torch.Tensor:
        """One forward pass over the flat inputs, on the device or, for CUDA graphs, on the host
        (a decode step there replays a graph: ``DecodeGraphs.replay``); on a CPU a decode step
        the decode stack takes runs there (leaving its rows' argmax in ``greedy_ids`` where it
        gives one); any other step plans its attention (checks, indices) on the device, then runs
        the model as ``self.graphs`` decides, its prompt tokens' 4-bit products on AMX tiles
        where ``prompt_tiles`` (from ``inputs.tile_from``: the decode stack takes no such step).
        A float8 cache's first tokens are then looked at (``Float8RangeWatch``)."""
        logits = self._run(inputs)
        if self.float8_watch.left > 0:
            self.float8_watch.check(self.kv_cache, inputs.metadata.slot_mapping)
        return logits

    def _run(self, inputs: ModelInput) -> torch.Tensor:
        self.greedy_ids = None
        with self._timed("forward"):
            if self.pad_single_token and inputs.num_tokens == 1 and self.graphs.mode == COMPILED:
                inputs = pad_to_two_tokens(inputs)
            if isinstance(self.graphs, DecodeGraphs) and inputs.input_ids.device.type == "cpu":
                with torch.inference_mode():
                    logits = self.graphs.replay(inputs)
                if logits is not None:
                    return logits
                inputs = inputs.to(self.device)
            if self.decode_stack is not None and inputs.tile_from is None:
                with torch.inference_mode():
                    stacked = self.decode_stack(
                        inputs.input_ids,
                        inputs.positions,
                        inputs.metadata,
                        self.kv_cache,
                        inputs.sample_rows,
                    )
                if stacked is not None:
                    logits, self.greedy_ids = stacked
                    return logits
            plan = self.backend.plan(
                inputs.positions, inputs.metadata, self.kv_cache, self.max_position
            )
            with torch.inference_mode(), int4_tile_rows(inputs.tile_from):
                return self.graphs(inputs.input_ids, inputs.positions, plan, inputs.sample_rows)

    def drop_requests(self, request_ids: list[str]) -> None:
        """Forgets sampling state (for requests that ended outside a batch: aborts, errors)."""
        self.sampler.remove_requests(request_ids)
