"""The model runner: loads the model and its KV cache, and runs one ``ScheduledBatch``.

``execute(batch)`` is the middle of the engine step: inputs -> one ragged forward -> sampling. It
never touches a ``Request``; what it needs arrives in the batch.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from engine.compiled_forward import compile_unsupported
from engine.input_builder import AttentionMetadata, build_model_input
from engine.kv_cache_memory import (
    allocate_kv_cache,
    bytes_per_block,
    num_blocks_for_budget,
)
from engine.layers import MatmulLayer
from engine.model_config import ModelConfig
from engine.models import MODEL_CLASSES
from engine.parallel import SINGLE_PROCESS, ParallelContext
from engine.sampler import Sampler, SamplerOutput
from engine.tp_sharding import shard_heads
from engine.weights import iterate_weights
from kernels import get_ops
from scheduler.batch import ScheduledBatch

logger = logging.getLogger(__name__)


class ModelRunner:
    """Owns the model, the KV-cache tensor and the sampler of one process."""

    def __init__(
        self,
        model_dir: Path,
        model_config: ModelConfig,
        *,
        dtype: torch.dtype,
        device: torch.device,
        attention_backend: str,
        block_size: int,
        max_model_len: int,
        kv_cache_memory: int | float,
        num_kv_blocks: int | None,
        max_useful_blocks: int,
        seed: int,
        parallel: ParallelContext = SINGLE_PROCESS,
        compile: bool = False,
    ) -> None:
        self.model_config = model_config
        self.dtype = dtype
        self.device = device
        self.block_size = block_size
        self.parallel = parallel
        start = time.perf_counter()
        model_class = MODEL_CLASSES[model_config.architecture]
        with torch.device(device):
            self.model = model_class(
                model_config,
                dtype=dtype,
                ops=get_ops(attention_backend),
                max_position=max_model_len,
                parallel=parallel,
            )
        self.model.load_weights(iterate_weights(model_dir))
        self.model.eval()
        logger.info(
            "loaded %s (%s, %s) in %.1f s",
            model_dir.name,
            model_config.architecture,
            str(dtype).removeprefix("torch."),
            time.perf_counter() - start,
        )

        num_kv_heads = shard_heads(
            model_config.num_heads, model_config.num_kv_heads, parallel.rank, parallel.world_size
        ).num_kv_heads
        block_bytes = bytes_per_block(
            model_config.num_layers, block_size, num_kv_heads, model_config.head_dim, dtype
        )
        if num_kv_blocks is None:
            num_kv_blocks = num_blocks_for_budget(
                kv_cache_memory, block_bytes, device, max_useful_blocks
            )
        # Block ids are shared by every rank's cache: all ranks take the smallest count.
        num_kv_blocks = parallel.min_over_ranks(num_kv_blocks)
        self.num_kv_blocks = num_kv_blocks
        self.kv_cache = allocate_kv_cache(
            model_config.num_layers,
            num_kv_blocks,
            block_size,
            num_kv_heads,
            model_config.head_dim,
            dtype,
            device,
        )  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
        logger.info(
            "KV cache: %d blocks of %d tokens (%d tokens, %.1f MiB)",
            num_kv_blocks,
            block_size,
            num_kv_blocks * block_size,
            num_kv_blocks * block_bytes / 2**20,
        )
        if compile:
            self._compile_one_token(attention_backend)
        for module in self.model.modules():
            if isinstance(module, MatmulLayer):
                module.pack_weights()  # bfloat16 on a CPU: oneDNN layout, once
        self.sampler = Sampler(model_config.vocab_size, device, seed=seed)

    def _compile_one_token(self, attention_backend: str) -> None:
        """Compiles the one-token forward (``engine/compiled_forward.py``) by running it once on
        a dummy decode at slot 0, before any request holds a block. Where it cannot run, or its
        compilation fails, the eager forward serves every step (logged)."""
        reason = compile_unsupported(self.device, attention_backend, self.parallel.world_size)
        if reason:
            logger.info("compile: not used (%s)", reason)
            return
        start = time.perf_counter()
        self.model.compile_one_token()
        device = self.device
        dummy = torch.zeros(1, dtype=torch.int64, device=device)
        metadata = AttentionMetadata(
            slot_mapping=dummy,
            query_start=torch.tensor([0, 1], dtype=torch.int32, device=device),
            context_lens=torch.ones(1, dtype=torch.int32, device=device),
            block_tables=torch.zeros(1, 1, dtype=torch.int32, device=device),
            max_query_len=1,
            max_context_len=1,
        )
        try:
            self.model(dummy, dummy, metadata, self.kv_cache, dummy)
        except Exception:  # a compiler failure must not take serving down: eager still works
            logger.exception("compile: the one-token forward failed to compile; running eager")
            self.model.one_token_forward = None
            return
        logger.info("compile: one-token forward compiled in %.1f s", time.perf_counter() - start)

    def execute(self, batch: ScheduledBatch) -> SamplerOutput:
        """Runs the batch's forward pass and samples one token per sampling row (row order)."""
        self.sampler.remove_requests(batch.finished_request_ids)
        for new_request in batch.new_requests:
            self.sampler.add_request(new_request)
        if batch.is_empty:
            return SamplerOutput(token_ids=[], logprobs=[])
        logits = self.forward(batch)
        return self.sampler.sample(logits, batch.sample_request_ids)

    def forward(self, batch: ScheduledBatch) -> torch.Tensor:
        """The batch's logits for its sampling rows, float32 ``[num_sampled, vocab_size]``."""
        inputs = build_model_input(batch, self.block_size, self.device)
        return self.model(
            inputs.input_ids, inputs.positions, inputs.metadata, self.kv_cache, inputs.sample_rows
        )

    def drop_requests(self, request_ids: list[str]) -> None:
        """Forgets sampling state (for requests that ended outside a batch: aborts, errors)."""
        self.sampler.remove_requests(request_ids)
