"""The engine: a scheduler, an executor (the model runner, on every rank) and the three-call step
between them.

    batch   = scheduler.schedule()         # which tokens of which requests run now
    sampled = executor.execute(batch)      # one ragged forward + sampling
    done    = scheduler.update(batch, ...) # append tokens, finish, free blocks

Not thread-safe: one thread (the server's engine thread, or ``LLM.generate``) calls every method.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.config import DEFAULT_MODEL, DEFAULT_SCHEDULER_STEPS, EngineConfig
from engine.device import (
    resolve_attention_backend,
    resolve_device,
    resolve_dtype,
    resolve_kv_cache_dtype,
)
from engine.executor import ExecutorFailedError, start_executor
from engine.model_config import ModelConfig
from engine.model_resolver import resolve_model
from engine.outputs import RequestOutput
from engine.quantization import resolve_quantization
from engine.step_timings import StepTimings
from engine.structured_output import GrammarTokenizer
from engine.tensor_parallel.sharding import check_tensor_parallel
from engine.tokenizer import load_tokenizer
from kv_cache import KVCacheManager
from scheduler.batch import BatchRow, ScheduledBatch
from scheduler.request import Request, RequestStatus
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of blocks held by requests
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache (total)
    prefix_cache_hits: int  # of those, tokens found (total)
    num_preemptions: int  # total
    last_step_num_tokens: int  # of each of its decode steps
    last_step_seconds: float
    last_step_num_steps: int = 1  # decode steps the last engine step ran (a pass of several)


@dataclass(frozen=True)
class ModelInMemory:
    """A model already built in this process (``engine.inference``), run instead of
    ``config.model``'s folder: nothing is read from disk. Such an engine has no tokenizer: it
    runs token ids (no structured outputs), and its EOS ids are the model config's."""

    name: str
    model_config: ModelConfig
    state_dict: Mapping[str, torch.Tensor]  # by Hugging Face name


class LLMEngine:
    """Loads the model, its tokenizer and KV cache; runs requests step by step."""

    def __init__(self, config: EngineConfig, in_memory: ModelInMemory | None = None) -> None:
        """``in_memory``: the model to run instead of ``config.model`` and ``config.tokenizer``."""
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        device = resolve_device(config.device)
        dtype = resolve_dtype(config.dtype, device)
        backend = resolve_attention_backend(config.attention_backend, device)
        quantization = resolve_quantization(config.quantization, device)
        kv_cache_dtype = resolve_kv_cache_dtype(
            config.kv_cache_dtype, dtype, device, backend, bool(quantization.bits)
        )
        if in_memory is None:
            model_dir: Path | None = resolve_model(config.model)
            model_config = ModelConfig.from_dir(model_dir)
            model_name = DEFAULT_MODEL if config.model == DEFAULT_MODEL else model_dir.name
            tokenizer = load_tokenizer(config.tokenizer or model_dir)
        else:
            model_dir = None
            model_config = in_memory.model_config
            model_name = in_memory.name
            tokenizer = None
        check_tensor_parallel(model_config, config.tensor_parallel_size)
        if model_config.num_experts and quantization.bits:
            raise ValueError(
                f"quantization {config.quantization.method!r} is not supported for "
                f"mixture-of-experts models ({model_config.architecture}): their experts are not "
                "quantized; set quantization to none"
            )
        if model_config.num_experts and config.deterministic:
            raise ValueError(
                f"deterministic mode is not supported for mixture-of-experts models "
                f"({model_config.architecture}): an expert's products run on as many rows as the "
                "routing sends it, which the batch decides; set deterministic to false"
            )
        max_model_len = config.max_model_len or model_config.max_context_len
        if max_model_len > model_config.max_context_len:
            raise ValueError(
                f"max_model_len {max_model_len} exceeds the model's context of "
                f"{model_config.max_context_len} tokens (max_position_embeddings, or the "
                "sliding window, which this engine does not apply)"
            )
        self.config = config.model_copy(
            update={
                "model": model_name if model_dir is None else str(model_dir),
                "dtype": str(dtype).removeprefix("torch."),
                "kv_cache_dtype": str(kv_cache_dtype).removeprefix("torch."),
                "device": device.type,
                "attention_backend": backend,
                "max_model_len": max_model_len,
                "quantization": quantization,
            }
        )
        self.model_config = model_config
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer
        eos_id = None if tokenizer is None else tokenizer.eos_token_id
        tokenizer_eos = (eos_id,) if eos_id is not None else ()
        self.eos_token_ids: tuple[int, ...] = tuple(
            dict.fromkeys(model_config.eos_token_ids + tokenizer_eos)
        )
        # Structured outputs' grammars read the tokenizer's tokens as llguidance sees them.
        self.grammar_tokenizer = (
            None
            if tokenizer is None
            else GrammarTokenizer(tokenizer, model_config.vocab_size, self.eos_token_ids)
        )
        blocks_per_seq = -(-max_model_len // config.block_size)
        runner_kwargs = dict(
            model_dir=model_dir,
            model_config=model_config,
            dtype=dtype,
            kv_cache_dtype=kv_cache_dtype,
            device=device,
            attention_backend=backend,
            block_size=config.block_size,
            max_model_len=max_model_len,
            kv_cache_memory=config.kv_cache_memory,
            num_kv_blocks=config.num_kv_blocks,
            max_useful_blocks=config.max_batch_seqs * blocks_per_seq,
            seed=config.seed,
            compile=config.compile,
            quantization=quantization,
            state_dict=None if in_memory is None else in_memory.state_dict,
            deterministic=config.deterministic,
            # a decode step has a token per row, within both step limits
            max_decode_rows=min(config.max_batch_seqs, config.max_batch_tokens),
            max_step_tokens=config.max_batch_tokens,
        )
        self.executor = start_executor(
            config.tensor_parallel_size, runner_kwargs, config.num_threads
        )
        self.runner = self.executor.runner
        if self.grammar_tokenizer is not None:
            self.runner.sampler.enable_structured_output(self.grammar_tokenizer)  # rank 0 samples
        self.num_kv_blocks = self.runner.num_kv_blocks
        self.kv_manager = KVCacheManager(
            self.num_kv_blocks,
            config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
            generated_apart=self.runner.prompt_tiles,
        )
        # several decode steps per pass where the runner can take them (the decode stack)
        decode_rows = self.runner.max_decode_ahead_rows
        num_steps = config.num_scheduler_steps
        if num_steps is None:
            num_steps = DEFAULT_SCHEDULER_STEPS if decode_rows else 1
        elif num_steps > 1 and not decode_rows:
            self.executor.shutdown()
            raise ValueError(
                f"num_scheduler_steps {num_steps} needs the CPU decode stack with an 8-bit LM "
                "head (one process, 4-bit products or bfloat16 with AVX-512 BF16, embeddings "
                "int8, not deterministic); this engine has none: set it to 1"
            )
        self.num_scheduler_steps = num_steps
        self.scheduler = Scheduler(
            config.max_batch_tokens,
            config.max_batch_seqs,
            max_model_len,
            self.kv_manager,
            policy=config.scheduling_policy,
            fair_share=config.fair_share,
            max_decode_steps=num_steps,
            max_decode_rows=decode_rows,
        )
        self._last_step_num_tokens = 0
        self._last_step_num_steps = 1
        self._last_step_seconds = 0.0
        self.timings: StepTimings | None = None  # see profile()

    def profile(self, enabled: bool) -> StepTimings | None:
        """Starts (afresh) or stops timing each step's phases: forward passes and sampling on
        rank 0's runner, scheduling here (``engine/step_timings.py``). Returns the timings being
        recorded (None once stopped)."""
        self.timings = StepTimings(self.runner.device) if enabled else None
        self.runner.timings = self.timings
        return self.timings

    def _timed_scheduling(self) -> contextlib.AbstractContextManager[None]:
        if self.timings is None:
            return contextlib.nullcontext()
        return self.timings.measure("scheduling")

    # -- requests ---------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        group_id: str | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        tenant: str = "",
        streamed: bool = False,
    ) -> None:
        """Queues a request (``priority``: lower first under the ``priority`` policy; ``tenant``:
        whose share of the prompt budget it takes under ``fair_share``; ``streamed``: its tokens
        are sent as they come, so its batches run one decode step per pass). Raises ValueError
        (changing nothing) on an empty prompt, a token id outside the vocabulary, a prompt too
        long for max_model_len, an id in use, or a structured output the engine cannot run
        (GrammarError)."""
        if not isinstance(sampling_params, SamplingParams):
            raise ValueError("sampling_params must be a SamplingParams")
        if not prompt_token_ids:
            raise ValueError("the prompt must hold at least one token")
        vocab_size = self.model_config.vocab_size
        bad = [t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt token ids outside [0, {vocab_size}): {bad[:5]}")
        for name, token_ids in (
            ("stop_token_ids", sampling_params.stop_token_ids),
            ("logit_bias", tuple(sampling_params.logit_bias)),
        ):
            if any(t >= vocab_size for t in token_ids):
                raise ValueError(f"{name} holds token ids >= the vocabulary size {vocab_size}")
        if sampling_params.structured is not None:
            if self.grammar_tokenizer is None:
                raise ValueError("structured outputs need a tokenizer; this engine has none")
            self.grammar_tokenizer.check(sampling_params.structured)
        request = Request(
            request_id,
            list(prompt_token_ids),
            sampling_params,
            eos_token_ids=self.eos_token_ids,
            arrival_time=arrival_time,
            group_id=group_id,
            priority=priority,
            tenant=tenant,
            streamed=streamed,
        )
        self.scheduler.add_request(request)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Ends a waiting or running request; None when it is unknown or already finished."""
        request = self.scheduler.abort(request_id)
        if request is None:
            return None
        self.executor.drop_requests([request_id])
        return _output(request, [], None)

    def wait_until_compiled(self, timeout: float | None = None) -> bool:
        """Blocks until the step graphs are compiled (or failed to: steps stay eager), at most
        ``timeout`` seconds; True when compiling is over. Steps run meanwhile, eagerly."""
        return self.runner.graphs.wait(timeout)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the step ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One schedule / execute / update. Returns a delta per request that got a token or
        ended; [] when idle. A forward pass that raises is re-run in halves of its rows until the
        failure is pinned to the requests that cause it: those fail (with a generic message and an
        error id; the exception is logged), their neighbours go on."""
        start = time.perf_counter()
        with self._timed_scheduling():
            batch = self.scheduler.schedule()
        if batch.is_empty:
            self.executor.drop_requests(list(batch.finished_request_ids))
            return []
        failed: list[RequestOutput] = []
        try:
            sampled = self.executor.execute(batch)
            token_ids, logprobs = sampled.token_ids, sampled.logprobs
            dead_ends = {
                batch.sample_request_ids[row]: message for row, message in sampled.dead_ends.items()
            }
        except ExecutorFailedError:
            raise  # e.g. a tensor-parallel rank is gone: no later step can run
        except Exception:  # noqa: BLE001 - the step must survive and report it
            token_ids, logprobs, failed, dead_ends = self._isolate_failures(batch)
        for request_id, message in dead_ends.items():
            # its token is not appended: update() skips aborted requests
            request = self.scheduler.abort(request_id, RequestStatus.FINISHED_GRAMMAR_ERROR)
            if request is not None:
                failed.append(_output(request, [], None, error=message))
        self.executor.drop_requests(list(dead_ends))
        with self._timed_scheduling():
            requests = self.scheduler.update(batch, token_ids)
        outputs = failed
        if batch.num_steps > 1:  # each request's tokens past its row's first position
            starts = {row.request_id: row.start_pos + 1 for row in batch.rows}
            for request in requests:
                outputs.append(
                    _output(request, request.token_ids[starts[request.request_id] :], None)
                )
        else:
            # update() skips requests aborted since schedule(), so pair tokens by request id.
            by_id = dict(zip(batch.sample_request_ids, range(len(token_ids)), strict=True))
            for request in requests:
                index = by_id[request.request_id]
                logprob = logprobs[index]
                outputs.append(
                    _output(request, [token_ids[index]], None if logprob is None else [logprob])
                )
        self._last_step_num_tokens = batch.num_tokens
        self._last_step_num_steps = batch.num_steps
        self._last_step_seconds = time.perf_counter() - start
        return outputs

    def _isolate_failures(
        self, batch: ScheduledBatch
    ) -> tuple[list[int], list, list[RequestOutput], dict[str, str]]:
        """After ``batch`` failed: re-runs its rows in halves, splitting every part that fails
        again, until each failure is one row. Returns a token and logprob per sampling row (-1 and
        None for failed rows), the failed requests' final outputs (they are aborted, so
        ``update`` skips them) and the dead ends of structured outputs met in the parts. A
        failure that is no request's (every row fails alone) fails all."""
        error_id = uuid.uuid4().hex[:12]
        logger.exception(
            "a step of %d tokens (%d requests) failed (error id %s); re-running its rows in "
            "parts to find the requests that cause it",
            batch.num_tokens,
            batch.num_rows,
            error_id,
        )
        new_requests = {data.request_id: data for data in batch.new_requests}
        # the failed pass may have set up some new requests' sampling state: start them afresh
        self.executor.drop_requests(list(new_requests))
        sampled: dict[str, tuple[int, object]] = {}
        dead_ends: dict[str, str] = {}
        culprits: list[str] = []
        # one row: the failed pass was already its own
        parts = _halves(batch.rows) if batch.num_rows > 1 else []
        if not parts:
            culprits.append(batch.rows[0].request_id)
        while parts:
            rows = parts.pop()
            part = ScheduledBatch(
                rows=rows,
                new_requests=tuple(
                    new_requests[row.request_id] for row in rows if row.request_id in new_requests
                ),
                num_steps=batch.num_steps,
            )
            try:
                result = self.executor.execute(part)
            except ExecutorFailedError:
                raise
            except Exception as error:  # noqa: BLE001 - pinning the failure down
                self.executor.drop_requests([data.request_id for data in part.new_requests])
                if len(rows) > 1:
                    parts.extend(_halves(rows))
                    continue
                culprits.append(rows[0].request_id)
                logger.error(
                    "error id %s: request %s fails alone: %s: %s",
                    error_id,
                    rows[0].request_id,
                    type(error).__name__,
                    error,
                )
                continue
            for request_id, token_id, logprob in zip(
                part.sample_request_ids, result.token_ids, result.logprobs, strict=True
            ):
                sampled[request_id] = (token_id, logprob)
            for row, why in result.dead_ends.items():
                dead_ends[part.sample_request_ids[row]] = why
        message = f"the engine failed on this request (error id {error_id})"
        failed = []
        for request_id in culprits:
            request = self.scheduler.abort(request_id, RequestStatus.FINISHED_ERROR)
            if request is not None:
                failed.append(_output(request, [], None, error=message))
        self.executor.drop_requests(culprits)
        if culprits:
            logger.error("error id %s: failed requests %s", error_id, ", ".join(culprits))
        missing = -1 if batch.num_steps == 1 else [-1] * batch.num_steps  # (aborted: unused)
        results = [sampled.get(i, (missing, None)) for i in batch.sample_request_ids]
        token_ids = [token_id for token_id, _ in results]
        return token_ids, [logprob for _, logprob in results], failed, dead_ends

    def add_fatal_listener(self, listener: Callable[[str], None]) -> None:
        """``listener(message)`` is called (from another thread) if the engine can no longer run,
        such as when a tensor-parallel worker dies; later steps raise."""
        self.executor.add_failure_listener(listener)

    def shutdown(self) -> None:
        """Stops the tensor-parallel workers, if any. Idempotent."""
        self.executor.shutdown()

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_cache_usage=self.kv_manager.usage,
            prefix_cache_queries=self.kv_manager.prefix_cache_queries,
            prefix_cache_hits=self.kv_manager.prefix_cache_hits,
            num_preemptions=self.scheduler.num_preemptions,
            last_step_num_tokens=self._last_step_num_tokens,
            last_step_seconds=self._last_step_seconds,
            last_step_num_steps=self._last_step_num_steps,
        )


def _halves(rows: tuple[BatchRow, ...]) -> list[tuple[BatchRow, ...]]:
    middle = len(rows) // 2
    return [rows[:middle], rows[middle:]]


def _output(
    request: Request, new_token_ids: list[int], new_logprobs: list | None, error: str | None = None
) -> RequestOutput:
    return RequestOutput(
        request_id=request.request_id,
        new_token_ids=new_token_ids,
        new_logprobs=new_logprobs,
        finish_reason=request.finish_reason,
        num_prompt_tokens=request.num_prompt_tokens,
        num_cached_tokens=request.num_cached_tokens,
        num_output_tokens=request.num_output_tokens,
        stop_token_id=request.stop_token_id,
        error=error,
        queue_seconds=None
        if request.first_scheduled_time is None
        else request.first_scheduled_time - request.arrival_time,
    )
