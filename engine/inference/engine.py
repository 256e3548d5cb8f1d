"""``init_inference``: a loaded transformers model, run on this engine (DeepSpeed-Inference's door).

    engine = init_inference(model, tensor_parallel={"tp_size": 2}, dtype=torch.float32)
    logits = engine(input_ids, attention_mask).logits      # [batch, seq, vocab], float32
    sequences = engine.generate(input_ids, max_new_tokens=32)

"Kernel injection": the model's tensors (``state_dict()``, Hugging Face names) are copied into
this engine's layers for its architecture (``engine/models``), which run the ragged forward over
the paged KV cache with our kernels; nothing is read from disk, and the transformers model is left
as it was. Under tensor parallelism the ranks are processes started here, which read the tensors
from shared memory (``engine/tensor_parallel/group.py``).

A row of ``input_ids`` is its tokens where ``attention_mask`` is 1, which must be one run (left or
right padding): it runs as its own sequence from position 0, as transformers' ``generate`` runs a
padded row.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers.modeling_outputs import CausalLMOutput

from engine.inference.config import InferenceConfig
from engine.input_builder import build_model_input
from engine.llm_engine import LLMEngine, ModelInMemory
from engine.model_config import ModelConfig
from engine.step_timings import StepTimings
from scheduler.batch import BatchRow, ScheduledBatch
from scheduler.sampling_params import SamplingParams


def init_inference(
    model: Any,
    config: InferenceConfig | dict[str, Any] | str | Path | None = None,
    **kwargs: Any,
) -> InferenceEngine:
    """Runs ``model`` (a transformers causal LM of an architecture in ``engine.models``) on this
    engine. ``config`` (a dict, an ``InferenceConfig``, or a JSON file's path, as DeepSpeed takes
    it) and ``kwargs`` are ``InferenceConfig`` fields, DeepSpeed's names accepted; a field given
    in both must agree. Raises ValueError (pydantic's ValidationError) naming the field on a bad
    configuration, and ModelConfigError for an unsupported model."""
    if isinstance(config, InferenceConfig):
        given = config.model_dump(exclude_unset=True)
    elif config is None:
        given = {}
    elif isinstance(config, dict):
        given = dict(config)
    elif isinstance(config, (str, Path)):
        given = json.loads(Path(config).read_text())
        if not isinstance(given, dict):
            raise ValueError(f"{config}: the configuration must be a JSON object")
    else:
        raise TypeError(
            f"config must be an InferenceConfig, a dict or a JSON file, not {type(config).__name__}"
        )
    for name, value in kwargs.items():
        if name in given and given[name] != value:
            raise ValueError(
                f"conflicting {name!r}: {given[name]!r} in config, {value!r} in the arguments"
            )
    return InferenceEngine(model, InferenceConfig(**{**given, **kwargs}))


class InferenceEngine:
    """A transformers model running on ``LLMEngine`` (``llm_engine``), the continuous-batching
    engine over the paged KV cache. ``module`` is the transformers model given."""

    def __init__(self, model: Any, config: InferenceConfig) -> None:
        hf_config = getattr(model, "config", None)
        if hf_config is None or not hasattr(model, "state_dict"):
            raise TypeError(f"expected a transformers model, got {type(model).__name__}")
        raw = {**hf_config.to_dict(), "architectures": [type(model).__name__]}
        generation_config = getattr(model, "generation_config", None)
        self.model_config = ModelConfig.from_dict(
            raw, None if generation_config is None else generation_config.to_dict()
        )
        _check_moe(config, raw)
        model_dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
        name = getattr(model, "name_or_path", "") or type(model).__name__
        self.module = model
        self.config = config
        self.llm_engine = LLMEngine(
            config.engine_config(model_dtype),
            ModelInMemory(name, self.model_config, model.state_dict()),
        )
        self.llm_engine.wait_until_compiled()  # every forward runs the graphs, if asked for
        self._generation = generation_config
        self._next_id = 0

    # -- forward ----------------------------------------------------------------------------

    def __call__(self, input_ids: Any, attention_mask: Any | None = None) -> CausalLMOutput:
        """Every position's logits, float32 ``[batch, seq, vocab_size]`` on the engine's device,
        in ``.logits`` (like the model's forward; no cache is returned). Padded positions' logits
        are 0. Rows run in as few
        forward passes as the step budget (``max_batch_tokens``) and the free KV blocks allow."""
        token_ids, rows = self._rows(input_ids, attention_mask)
        engine = self.llm_engine
        if engine.has_unfinished_requests():
            raise RuntimeError("the engine still has requests of an interrupted generate()")
        vocab_size = self.model_config.vocab_size
        device = engine.runner.device
        logits = torch.zeros(*token_ids.shape, vocab_size, device=device)  # [batch, seq, vocab]
        for index, offset, chunk_logits in self._forward_rows([tokens for _, tokens in rows]):
            start = rows[index][0] + offset
            logits[index, start : start + chunk_logits.shape[0]] = chunk_logits
        return CausalLMOutput(logits=logits)

    forward = __call__

    def _forward_rows(self, rows: list[list[int]]) -> Iterator[tuple[int, int, torch.Tensor]]:
        """Yields ``(row index, first token's index in the row, logits [tokens, vocab])`` per
        chunk of each row: rows whose blocks
        fit run together, in steps of at most ``max_batch_tokens`` tokens (a long row in several
        chunks, each attending to the K/V of the ones before). Their blocks are free again
        afterwards; they were never in the prefix cache."""
        engine = self.llm_engine
        runner = engine.runner
        pool = engine.kv_manager.pool
        block_size = engine.config.block_size
        budget = engine.config.max_batch_tokens
        blocks_needed = [-(-len(tokens) // block_size) for tokens in rows]
        next_row = 0
        while next_row < len(rows):
            group: list[int] = []
            free = pool.num_free_blocks
            while next_row < len(rows) and blocks_needed[next_row] <= free:
                free -= blocks_needed[next_row]
                group.append(next_row)
                next_row += 1
            if not group:  # every row fits the whole cache (_rows): blocks are held elsewhere
                raise RuntimeError("the KV cache has no room: are requests still running?")
            tables = {index: tuple(pool.allocate(blocks_needed[index])) for index in group}
            try:
                done = dict.fromkeys(group, 0)  # row -> tokens computed
                while any(done[index] < len(rows[index]) for index in group):
                    batch_rows: list[BatchRow] = []
                    room = budget
                    for index in group:
                        take = min(len(rows[index]) - done[index], room)
                        if take <= 0:
                            continue
                        chunk = tuple(rows[index][done[index] : done[index] + take])
                        batch_rows.append(  # (prompt tokens, as a prompt's forward takes them)
                            BatchRow(
                                str(index),
                                chunk,
                                done[index],
                                tables[index],
                                True,
                                len(rows[index]),
                            )
                        )
                        done[index] += take
                        room -= take
                    inputs = build_model_input(
                        ScheduledBatch(rows=tuple(batch_rows)),
                        block_size,
                        runner.device,
                        runner.prompt_tiles,
                    )
                    all_rows = torch.arange(inputs.num_tokens, device=runner.device)
                    step_logits = runner.run(dataclasses.replace(inputs, sample_rows=all_rows))
                    offset = 0
                    for row in batch_rows:
                        chunk_logits = step_logits[offset : offset + row.num_tokens]
                        yield int(row.request_id), row.start_pos, chunk_logits
                        offset += row.num_tokens
            finally:
                pool.free([block for index in group for block in tables[index]])

    def _rows(
        self, input_ids: Any, attention_mask: Any | None
    ) -> tuple[torch.Tensor, list[tuple[int, list[int]]]]:
        """``input_ids`` as a ``[batch, seq]`` tensor, and each row's (first position, tokens)
        where the mask is 1. Raises ValueError on a bad shape, an empty or non-contiguous row, a
        token outside the vocabulary or a row too long for the engine."""
        token_ids = torch.as_tensor(input_ids)
        if token_ids.dim() != 2 or token_ids.dtype.is_floating_point or token_ids.numel() == 0:
            raise ValueError(
                f"input_ids must be integer token ids shaped [batch, seq], got "
                f"{tuple(token_ids.shape)} {token_ids.dtype}"
            )
        token_ids = token_ids.cpu()
        if attention_mask is None:
            mask = torch.ones_like(token_ids, dtype=torch.bool)
        else:
            mask = torch.as_tensor(attention_mask).cpu()
            if mask.shape != token_ids.shape:
                raise ValueError(
                    f"attention_mask is shaped {tuple(mask.shape)}, input_ids "
                    f"{tuple(token_ids.shape)}"
                )
            if not bool(((mask == 0) | (mask == 1)).all()):
                raise ValueError("attention_mask must hold 0 and 1 only")
            mask = mask.bool()
        vocab_size = self.model_config.vocab_size
        engine = self.llm_engine
        max_blocks = engine.num_kv_blocks
        block_size = engine.config.block_size
        rows = []
        for index, (row, row_mask) in enumerate(zip(token_ids, mask, strict=True)):
            positions = row_mask.nonzero().flatten().tolist()
            if not positions:
                raise ValueError(f"row {index} has no tokens (its attention_mask is all 0)")
            start, end = positions[0], positions[-1] + 1
            if len(positions) != end - start:
                raise ValueError(
                    f"row {index}'s attention_mask has holes: only left or right padding is "
                    "supported"
                )
            tokens = row[start:end].tolist()
            bad = [t for t in tokens if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"row {index}: token ids outside [0, {vocab_size}): {bad[:5]}")
            if len(tokens) > engine.max_model_len or -(-len(tokens) // block_size) > max_blocks:
                raise ValueError(
                    f"row {index} has {len(tokens)} tokens; the engine runs at most "
                    f"{min(engine.max_model_len, max_blocks * block_size)} (max_out_tokens, "
                    "engine.num_kv_blocks)"
                )
            rows.append((start, tokens))
        return token_ids, rows

    # -- generation -------------------------------------------------------------------------

    def generate(
        self,
        input_ids: Any,
        attention_mask: Any | None = None,
        *,
        max_new_tokens: int | None = None,
        max_length: int | None = None,
        do_sample: bool | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        eos_token_id: int | Sequence[int] | None = None,
        pad_token_id: int | None = None,
        num_beams: int = 1,
        seed: int | None = None,
    ) -> torch.Tensor:
        """Continues each row of ``input_ids`` (a request each, all run together by the
        continuous-batching engine) and returns ``[batch, seq + new]`` sequences as transformers'
        ``generate`` does: each input row as given, then its new tokens, rows that stopped early
        (at an ``eos_token_id``) filled with ``pad_token_id``. Arguments left None take the
        model's ``generation_config`` values, as in transformers; ``seed`` makes sampling
        repeatable. Beam search (``num_beams > 1``) is refused."""
        if num_beams != 1:
            raise ValueError(
                f"num_beams {num_beams}: beam search is not supported; the engine samples one "
                "sequence per row (greedy, or do_sample=True)"
            )
        token_ids, rows = self._rows(input_ids, attention_mask)
        defaults = self._generation
        if max_new_tokens is None and max_length is None:
            max_new_tokens = _default(defaults, "max_new_tokens")
        if max_new_tokens is None:
            max_length = _pick(max_length, defaults, "max_length", 20)
            max_new_tokens = max_length - token_ids.shape[1]
        if max_new_tokens < 1:
            raise ValueError(
                f"nothing to generate: max_new_tokens {max_new_tokens} (max_length {max_length} "
                f"for inputs of {token_ids.shape[1]} tokens)"
            )
        eos = eos_token_id if eos_token_id is not None else _default(defaults, "eos_token_id")
        eos_ids = () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)
        sample = bool(do_sample if do_sample is not None else _default(defaults, "do_sample"))
        params = SamplingParams(
            max_tokens=max_new_tokens,
            temperature=(_pick(temperature, defaults, "temperature", 1.0) if sample else 0.0),
            top_p=_pick(top_p, defaults, "top_p", 1.0) if sample else 1.0,
            top_k=_pick(top_k, defaults, "top_k", 0) if sample else 0,
            seed=seed,
            # transformers stops at the given (or the generation config's) EOS ids only
            stop_token_ids=eos_ids,
            ignore_eos=True,
        )
        outputs = self._run([tokens for _, tokens in rows], params)
        width = max(len(output) for output in outputs)
        pad = pad_token_id if pad_token_id is not None else _default(defaults, "pad_token_id")
        pad = pad if pad is not None else (eos_ids[0] if eos_ids else None)
        if pad is None and any(len(output) < width for output in outputs):
            raise ValueError("rows stopped at different lengths: give a pad_token_id")
        new = torch.full((len(outputs), width), pad if pad is not None else 0, dtype=torch.long)
        for index, output in enumerate(outputs):
            new[index, : len(output)] = torch.tensor(output, dtype=torch.long)
        return torch.cat([token_ids.long(), new], dim=1)

    def _run(self, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
        engine = self.llm_engine
        if engine.has_unfinished_requests():
            raise RuntimeError("the engine still has requests of an interrupted generate()")
        request_ids = [f"generate-{self._next_id}-{index}" for index in range(len(prompts))]
        self._next_id += 1
        outputs: dict[str, list[int]] = {request_id: [] for request_id in request_ids}
        try:
            for request_id, prompt in zip(request_ids, prompts, strict=True):
                engine.add_request(request_id, prompt, params)
            while engine.has_unfinished_requests():
                for delta in engine.step():
                    if delta.error is not None:
                        raise RuntimeError(f"generation failed: {delta.error}")
                    outputs[delta.request_id].extend(delta.new_token_ids)
        finally:
            for request_id in request_ids:
                engine.abort_request(request_id)
        return [outputs[request_id] for request_id in request_ids]

    # -- profiling --------------------------------------------------------------------------

    def profile_model_time(self) -> None:
        """Starts timing every forward pass (``model_times``); the device is synchronized around
        each, which slows it on a GPU."""
        self.llm_engine.profile(True)

    def model_times(self) -> list[float]:
        """The forward passes' times since the last call, in milliseconds (a ``__call__`` runs one
        per step of its rows; ``generate`` one per engine step); clears them."""
        timings: StepTimings | None = self.llm_engine.timings
        if timings is None:
            raise RuntimeError("model profiling is not enabled: call profile_model_time() first")
        times = [1e3 * seconds for seconds in timings.forward]
        timings.clear()
        return times

    def shutdown(self) -> None:
        """Stops the tensor-parallel workers, if any. Idempotent."""
        self.llm_engine.shutdown()


def _default(generation_config: Any, name: str) -> Any:
    return None if generation_config is None else getattr(generation_config, name, None)


def _pick(value: Any, generation_config: Any, name: str, fallback: Any) -> Any:
    if value is not None:
        return value
    default = _default(generation_config, name)
    return fallback if default is None else default


def _check_moe(config: InferenceConfig, raw: dict[str, Any]) -> None:
    """``moe`` must describe the model: enabled only for a model with experts, and
    ``moe_experts`` its expert count."""
    num_experts = raw.get("num_local_experts") or raw.get("num_experts")
    if not config.moe.enabled:
        return
    if not num_experts:
        raise ValueError(f"moe is enabled, but {raw['architectures'][0]} has no experts")
    wrong = [count for count in config.moe.moe_experts or () if count != num_experts]
    if wrong:
        raise ValueError(
            f"moe.moe_experts {config.moe.moe_experts}: the model has {num_experts} experts "
            "per layer"
        )
