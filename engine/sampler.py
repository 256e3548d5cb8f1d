"""Turns the sampling rows' logits into next tokens, with per-request state.

For the rows that need each step (the other rows pass through untouched), in this order:

    grammar mask -> logit_bias -> min_tokens mask -> penalties -> temperature -> top-k -> top-p
    -> min-p -> sample -> the grammar consumes the token

The grammar mask is that of a request's structured output (``engine/structured_output.py``):
``start_masks`` begins filling the masks before the forward pass, ``sample`` applies them.

Greedy rows (temperature 0) take the argmax after bias, mask and penalties; a batch of plain greedy
rows is a single argmax (``greedy_argmax``: torch's indices, one C++ call on a CPU).
Random rows sample by inverse CDF with one uniform number per row and token: a seeded request draws
its number from its own generator, so its tokens depend on its seed and its logits alone, not on
which other requests share the batch; unseeded rows share the sampler's generator. Top-k and top-p
rank their rows once: a ``topk`` for rows with a top-k; for a top-p alone, the 1024 most likely
tokens on a CPU when they hold top_p, else a sort. Logprobs are of the raw logits. Each
``sample`` call makes exactly one device-to-host transfer.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from engine.logits_processors import (
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
    sample_from_probs,
)
from engine.outputs import TokenLogprob
from engine.structured_output import GrammarTokenizer, Matchers, apply_bitmask
from scheduler.batch import NewRequestData
from scheduler.sampling_params import SamplingParams

# Temperatures below this sample as greedy: dividing by them would overflow the logits.
MIN_TEMPERATURE = 1e-5


class SamplerError(Exception):
    """Misuse of the sampler. The call that raised it changed nothing."""


class DuplicateRequestError(SamplerError):
    """``add_request`` for a request id the sampler already holds."""


class UnknownRequestError(SamplerError):
    """``sample`` for a request id that was never added or was already removed."""


class InvalidTokenIdError(SamplerError, ValueError):
    """A token id in the request's data lies outside ``[0, vocab_size)``."""


@dataclass
class SamplerOutput:
    token_ids: list  # one int per row (a batch of several decode steps: a list of ids per row)
    logprobs: list[TokenLogprob | None]  # None where the request asked for no logprobs
    # Rows whose structured output reached a dead end -> why; their token is not to be used.
    dead_ends: dict[int, str] = field(default_factory=dict)


NATIVE_ARGMAX_MAX = 1 << 20  # the longest rows the C++ argmax takes


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` for [num_rows, vocab_size], the same indices (the first of
    equal maxima, NaN the largest): on a CPU with the C++ operators built, one call of
    ``splitfuse_cpu::greedy_argmax`` (``kernels/cpu/greedy_argmax.cpp``; a few microseconds a
    row, against ~1 ns a value for torch's)."""
    cpu = logits.device.type == "cpu" and logits.dtype == torch.float32
    if cpu and 0 < logits.shape[-1] <= NATIVE_ARGMAX_MAX and _native_argmax():
        return torch.ops.splitfuse_cpu.greedy_argmax(logits.contiguous())
    return logits.argmax(dim=-1)


@functools.cache  # (asked once: a step's Python after the weights' stream runs on cold caches)
def _native_argmax() -> bool:
    from kernels.cpu_ops import load

    return load() != "torch"


def validate_token_ids(data: NewRequestData, vocab_size: int) -> None:
    """Raise ``InvalidTokenIdError`` unless every token id the sampler will index with (prompt,
    EOS, stop_token_ids, logit_bias keys) is in ``[0, vocab_size)``."""
    params = data.sampling_params
    fields = {
        "prompt_token_ids": data.prompt_token_ids,
        "eos_token_ids": data.eos_token_ids,
        "stop_token_ids": params.stop_token_ids,
        "logit_bias": tuple(params.logit_bias),
    }
    for name, token_ids in fields.items():
        if not token_ids or (min(token_ids) >= 0 and max(token_ids) < vocab_size):
            continue
        bad = [t for t in token_ids if not 0 <= t < vocab_size]
        if bad:
            raise InvalidTokenIdError(
                f"request {data.request_id!r}: {name} has token ids outside the vocabulary "
                f"[0, {vocab_size}): {bad[:8]}"
            )


@dataclass
class _RequestState:
    """A request's sampling state. The sparse per-token parameters are device tensors built once
    in ``add_request``, so that a step only concatenates them."""

    params: SamplingParams
    greedy: bool
    # logit_bias: token ids [num_bias] int64 and the biases [num_bias] float32; None without one.
    bias_ids: torch.Tensor | None
    bias_values: torch.Tensor | None
    # Masked to -inf while num_output_tokens < min_tokens: the EOS ids and stop_token_ids,
    # [num_ids] int64; None when min_tokens is 0 or there are no such ids.
    min_tokens_ids: torch.Tensor | None
    generator: torch.Generator | None  # the request's own, when it has a seed
    penalty_slot: int | None  # its row in _PenaltyTables, when it has penalties
    num_output_tokens: int = 0

    @property
    def masks_stop_ids(self) -> bool:
        return self.min_tokens_ids is not None and self.num_output_tokens < self.params.min_tokens

    @property
    def plain_greedy(self) -> bool:
        return (
            self.greedy
            and self.bias_ids is None
            and self.penalty_slot is None
            and not self.masks_stop_ids
        )


class _PenaltyTables:
    """Token statistics on the device, one row (slot) per request with penalties:

    output_counts [capacity, vocab_size] float32: times each token was sampled.
    prompt_mask   [capacity, vocab_size] bool: the token occurs in the prompt (filled only when
                  the request has a repetition penalty, the one penalty that reads the prompt).

    Slots of removed requests are reused; the capacity doubles when all are taken.
    """

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.output_counts = torch.zeros(0, vocab_size, dtype=torch.float32, device=device)
        self.prompt_mask = torch.zeros(0, vocab_size, dtype=torch.bool, device=device)
        self.free_slots: list[int] = []

    def allocate(self, prompt_token_ids: Sequence[int]) -> int:
        if not self.free_slots:
            self._grow()
        slot = self.free_slots.pop()
        self.output_counts[slot] = 0
        self.prompt_mask[slot] = False
        if prompt_token_ids:
            ids = torch.tensor(prompt_token_ids, dtype=torch.int64, device=self.device)
            self.prompt_mask[slot, ids] = True
        return slot

    def free(self, slot: int) -> None:
        self.free_slots.append(slot)

    def record(self, slots: torch.Tensor, token_ids: torch.Tensor) -> None:
        """Count one sampled token per slot. slots, token_ids [num_rows] int64."""
        ones = torch.ones(len(slots), dtype=torch.float32, device=self.device)
        self.output_counts.index_put_((slots, token_ids), ones, accumulate=True)

    def _grow(self) -> None:
        old_capacity = self.output_counts.shape[0]
        new_capacity = max(4, 2 * old_capacity)
        extra = new_capacity - old_capacity
        self.output_counts = torch.cat(
            [self.output_counts, self.output_counts.new_zeros(extra, self.vocab_size)]
        )
        self.prompt_mask = torch.cat(
            [self.prompt_mask, self.prompt_mask.new_zeros(extra, self.vocab_size)]
        )
        self.free_slots.extend(range(new_capacity - 1, old_capacity - 1, -1))


class Sampler:
    """Samples one token per row. Not thread-safe: one thread calls it (the engine's).

    ``seed`` seeds the generator shared by unseeded rows; None uses torch's default generator
    (so ``torch.manual_seed`` governs it).
    """

    def __init__(self, vocab_size: int, device: torch.device, seed: int | None = None) -> None:
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.generator: torch.Generator | None = None
        if seed is not None:
            self.generator = torch.Generator(device=self.device)
            self.generator.manual_seed(seed)
        self._requests: dict[str, _RequestState] = {}
        self._penalties = _PenaltyTables(vocab_size, self.device)
        self.matchers: Matchers | None = None  # set by enable_structured_output

    def enable_structured_output(self, tokenizer: GrammarTokenizer) -> None:
        """Lets requests with a structured output be added (the tokenizer's vocabulary is the
        logits')."""
        if tokenizer.vocab_size != self.vocab_size:
            raise ValueError(
                f"the grammar tokenizer has {tokenizer.vocab_size} tokens, the logits "
                f"{self.vocab_size}"
            )
        self.matchers = Matchers(tokenizer)

    def __len__(self) -> int:
        return len(self._requests)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._requests

    def add_request(self, data: NewRequestData) -> None:
        if data.request_id in self._requests:
            raise DuplicateRequestError(f"request {data.request_id!r} was already added")
        validate_token_ids(data, self.vocab_size)
        params = data.sampling_params
        if params.structured is not None:
            if self.matchers is None:
                raise SamplerError("structured outputs are not enabled on this sampler")
            self.matchers.add(data.request_id, params.structured)  # GrammarError: nothing added
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(params.seed)
        penalty_slot = None
        if params.has_penalties:
            prompt_ids = data.prompt_token_ids if params.repetition_penalty != 1.0 else ()
            penalty_slot = self._penalties.allocate(prompt_ids)
        bias_ids = bias_values = min_tokens_ids = None
        if params.logit_bias:
            bias_ids = self._ids(list(params.logit_bias))
            bias_values = self._floats(list(params.logit_bias.values()))
        stop_ids = tuple(dict.fromkeys(data.eos_token_ids + params.stop_token_ids))
        if params.min_tokens > 0 and stop_ids:
            min_tokens_ids = self._ids(stop_ids)
        self._requests[data.request_id] = _RequestState(
            params=params,
            greedy=params.temperature < MIN_TEMPERATURE,
            bias_ids=bias_ids,
            bias_values=bias_values,
            min_tokens_ids=min_tokens_ids,
            generator=generator,
            penalty_slot=penalty_slot,
        )

    def remove_requests(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            state = self._requests.pop(request_id, None)
            if state is not None and state.penalty_slot is not None:
                self._penalties.free(state.penalty_slot)
            if self.matchers is not None:
                self.matchers.remove(request_id)

    def count_greedy_steps(self, request_ids: list[str], num_steps: int) -> None:
        """Counts ``num_steps`` tokens for each request, sampled outside ``sample`` (several
        decode steps in one pass take the argmax of each step's logits). Raises SamplerError,
        changing nothing, unless every request is plain greedy (``SamplingParams.plain_greedy``)
        and past its ``min_tokens``."""
        states = [self._requests.get(request_id) for request_id in request_ids]
        for request_id, state in zip(request_ids, states, strict=True):
            if state is None:
                raise UnknownRequestError(f"unknown request id: {request_id!r}")
            if not state.params.plain_greedy or state.masks_stop_ids:
                raise SamplerError(f"request {request_id!r} does not sample by the argmax alone")
        for state in states:
            state.num_output_tokens += num_steps  # type: ignore[union-attr]

    def start_masks(self, request_ids: list[str]) -> None:
        """Begins filling the grammar masks of the rows that have a structured output (they are
        computed while the caller runs the forward pass); a no-op when none has."""
        if self.matchers:
            self.matchers.start(request_ids)

    def sample(
        self,
        logits: torch.Tensor,
        request_ids: list[str],
        greedy_ids: torch.Tensor | None = None,
    ) -> SamplerOutput:
        """logits [num_rows, vocab_size], row i for ``request_ids[i]``; returns a token per row.
        ``greedy_ids``: each row's argmax where the caller has it (the decode stack's LM head
        takes it while its logits are in the threads' caches): the token of plain greedy rows
        when no grammar masks them."""
        states = self._lookup(logits, request_ids)
        if not states:
            return SamplerOutput(token_ids=[], logprobs=[])
        logits = logits.float()
        masks = self.matchers.finish(request_ids) if self.matchers else None
        allowed = logits  # logprobs stay those of the raw logits
        if masks is not None:
            allowed = logits.clone()
            rows = self._rows(masks.rows, states)
            apply_bitmask(allowed, rows, masks.bitmask)
        if all(state.plain_greedy for state in states):
            given = greedy_ids is not None and masks is None
            token_ids = greedy_ids if given else greedy_argmax(allowed)  # [num_rows]
        else:
            token_ids = self._sample_processed(allowed, states)
        penalty_rows = [i for i, state in enumerate(states) if state.penalty_slot is not None]
        if penalty_rows:
            slots = [states[i].penalty_slot for i in penalty_rows]
            self._penalties.record(self._ids(slots), token_ids[self._rows(penalty_rows, states)])
        output = self._to_host(logits, token_ids, states)
        if masks is not None:
            output.dead_ends = masks.dead_ends
            assert self.matchers is not None
            for row in masks.rows:
                if row not in masks.dead_ends:
                    error = self.matchers.accept(request_ids[row], output.token_ids[row])
                    if error is not None:
                        output.dead_ends[row] = error
        for state in states:
            state.num_output_tokens += 1
        return output

    def _lookup(self, logits: torch.Tensor, request_ids: list[str]) -> list[_RequestState]:
        expected = (len(request_ids), self.vocab_size)
        if logits.dim() != 2 or tuple(logits.shape) != expected:
            raise SamplerError(f"logits must have shape {expected}, got {tuple(logits.shape)}")
        if not logits.is_floating_point():
            raise SamplerError(f"logits must be floating point, got {logits.dtype}")
        if logits.device.type != self.device.type:
            raise SamplerError(f"logits are on {logits.device}, the sampler on {self.device}")
        unknown = [request_id for request_id in request_ids if request_id not in self._requests]
        if unknown:
            raise UnknownRequestError(f"unknown request ids: {unknown[:8]}")
        if len(set(request_ids)) != len(request_ids):
            raise SamplerError("a request id appears more than once in one sample call")
        return [self._requests[request_id] for request_id in request_ids]

    def _sample_processed(self, logits: torch.Tensor, states: list[_RequestState]) -> torch.Tensor:
        """The general path: bias, mask and penalties on every row that has them, then greedy
        rows take the argmax and the others sample. Returns [num_rows] int64."""
        processed = logits.clone()  # [num_rows, vocab_size]
        self._apply_bias_and_mask(processed, states)
        penalty_rows = [i for i, state in enumerate(states) if state.penalty_slot is not None]
        if penalty_rows:
            rows = self._rows(penalty_rows, states)
            penalised = [states[i] for i in penalty_rows]
            slots = self._ids([state.penalty_slot for state in penalised])
            presence = [state.params.presence_penalty for state in penalised]
            frequency = [state.params.frequency_penalty for state in penalised]
            repetition = [state.params.repetition_penalty for state in penalised]
            has_repetition = any(value != 1.0 for value in repetition)
            processed[rows] = apply_penalties(
                processed[rows],
                self._penalties.output_counts[slots],
                self._penalties.prompt_mask[slots] if has_repetition else None,
                self._floats(presence) if any(presence) else None,
                self._floats(frequency) if any(frequency) else None,
                self._floats(repetition) if has_repetition else None,
            )
        greedy_rows = [i for i, state in enumerate(states) if state.greedy]
        if len(greedy_rows) == len(states):
            return greedy_argmax(processed)
        random_rows = [i for i, state in enumerate(states) if not state.greedy]
        token_ids = torch.empty(len(states), dtype=torch.int64, device=self.device)
        if greedy_rows:
            rows = self._rows(greedy_rows, states)
            token_ids[rows] = greedy_argmax(processed[rows])
        rows = self._rows(random_rows, states)
        token_ids[rows] = self._sample_random(processed[rows], [states[i] for i in random_rows])
        return token_ids

    def _apply_bias_and_mask(self, logits: torch.Tensor, states: list[_RequestState]) -> None:
        """In place: add each row's logit_bias, then set the EOS and stop ids of rows still short
        of min_tokens to -inf. Both are sparse: one index_put_ each, of the rows' precomputed
        ids concatenated."""
        bias_rows = [row for row, state in enumerate(states) if state.bias_ids is not None]
        if bias_rows:
            bias_ids = [states[row].bias_ids for row in bias_rows]
            bias_values = [states[row].bias_values for row in bias_rows]
            index = (self._repeat_rows(bias_rows, bias_ids), torch.cat(bias_ids))
            logits.index_put_(index, torch.cat(bias_values), accumulate=True)
        mask_rows = [row for row, state in enumerate(states) if state.masks_stop_ids]
        if mask_rows:
            mask_ids = [states[row].min_tokens_ids for row in mask_rows]
            index = (self._repeat_rows(mask_rows, mask_ids), torch.cat(mask_ids))
            logits.index_put_(index, torch.tensor(float("-inf"), device=self.device))

    def _repeat_rows(self, rows: list[int], ids: list[torch.Tensor]) -> torch.Tensor:
        """Each row index once per id of that row: rows [0, 2], ids of sizes [3, 1] ->
        [0, 0, 0, 2]. The output size is given, so the device is not asked for it."""
        sizes = [len(row_ids) for row_ids in ids]
        return torch.repeat_interleave(self._ids(rows), self._ids(sizes), output_size=sum(sizes))

    def _sample_random(self, logits: torch.Tensor, states: list[_RequestState]) -> torch.Tensor:
        """Temperature, top-k, top-p, min-p, then one draw per row.
        logits [num_random_rows, vocab_size]; returns [num_random_rows] int64."""
        temperatures = self._floats([state.params.temperature for state in states])
        logits = logits / temperatures.unsqueeze(1)
        # Rows with a top-k (and maybe a top-p) are ranked by one topk, top-p-only rows apart.
        top_k_rows = [
            i for i, state in enumerate(states) if 0 < state.params.top_k < self.vocab_size
        ]
        if top_k_rows:
            rows = self._rows(top_k_rows, states)
            ranked = [states[i].params for i in top_k_rows]
            top_k = [params.top_k for params in ranked]
            top_p = None
            if any(params.top_p < 1.0 for params in ranked):
                top_p = self._floats([params.top_p for params in ranked])
            logits[rows] = apply_top_k_top_p(logits[rows], self._ids(top_k), max(top_k), top_p)
        has_top_k = set(top_k_rows)
        top_p_rows = [
            i for i, state in enumerate(states) if state.params.top_p < 1.0 and i not in has_top_k
        ]
        if top_p_rows:
            rows = self._rows(top_p_rows, states)
            top_p = self._floats([states[i].params.top_p for i in top_p_rows])
            logits[rows] = apply_top_k_top_p(logits[rows], None, self.vocab_size, top_p)
        min_p_rows = [i for i, state in enumerate(states) if state.params.min_p > 0.0]
        if min_p_rows:
            rows = self._rows(min_p_rows, states)
            min_p = self._floats([states[i].params.min_p for i in min_p_rows])
            logits[rows] = apply_min_p(logits[rows], min_p)
        probs = logits.softmax(dim=-1)  # [num_random_rows, vocab_size]
        return sample_from_probs(probs, self._uniform(states))

    def _uniform(self, states: list[_RequestState]) -> torch.Tensor:
        """One uniform number in [0, 1) per row, float64 [num_rows]. A seeded request draws its
        own from its generator, so its tokens do not depend on the other rows; the unseeded rows
        draw together from the sampler's generator."""
        shared_rows = [i for i, state in enumerate(states) if state.generator is None]
        if len(shared_rows) == len(states):
            return self._draw(len(states), self.generator)
        uniform = torch.empty(len(states), dtype=torch.float64, device=self.device)
        if shared_rows:
            uniform[self._ids(shared_rows)] = self._draw(len(shared_rows), self.generator)
        for i, state in enumerate(states):
            if state.generator is not None:
                uniform[i : i + 1] = self._draw(1, state.generator)
        return uniform

    def _draw(self, num: int, generator: torch.Generator | None) -> torch.Tensor:
        return torch.rand(num, generator=generator, dtype=torch.float64, device=self.device)

    def _to_host(
        self, logits: torch.Tensor, token_ids: torch.Tensor, states: list[_RequestState]
    ) -> SamplerOutput:
        """The one device-to-host transfer: token ids and, for rows that asked, logprobs of the
        raw logits, packed into one float64 tensor (exact for int ids below 2**53 and for float32
        logprobs). Layout: token_ids [num_rows], then for the L logprob rows sampled logprobs [L],
        top logprobs [L, max_k] and their token ids [L, max_k]."""
        logprob_rows = [i for i, state in enumerate(states) if state.params.logprobs is not None]
        if not logprob_rows:  # the ids alone
            return SamplerOutput(token_ids=token_ids.tolist(), logprobs=[None] * len(states))
        rows = self._rows(logprob_rows, states)
        raw_logprobs = torch.log_softmax(logits[rows], dim=-1)  # [L, vocab_size]
        sampled = raw_logprobs.gather(1, token_ids[rows].unsqueeze(1)).squeeze(1)  # [L]
        parts = [token_ids.to(torch.float64), sampled.to(torch.float64)]
        max_k = min(self.vocab_size, max(states[i].params.logprobs or 0 for i in logprob_rows))
        if max_k > 0:
            top_logprobs, top_ids = raw_logprobs.topk(max_k, dim=-1)  # [L, max_k] each
            parts.append(top_logprobs.flatten().to(torch.float64))
            parts.append(top_ids.flatten().to(torch.float64))
        host = torch.cat(parts).tolist()

        num_rows, num_logprob_rows = len(states), len(logprob_rows)
        sampled_ids = [int(t) for t in host[:num_rows]]
        logprobs: list[TokenLogprob | None] = [None] * num_rows
        top_start = num_rows + num_logprob_rows
        ids_start = top_start + num_logprob_rows * max_k
        for j, row in enumerate(logprob_rows):
            k = min(max_k, states[row].params.logprobs or 0)
            top_logprobs_row = host[top_start + j * max_k : top_start + j * max_k + k]
            top_ids_row = host[ids_start + j * max_k : ids_start + j * max_k + k]
            logprobs[row] = TokenLogprob(
                token_id=sampled_ids[row],
                logprob=host[num_rows + j],
                top=tuple(zip((int(t) for t in top_ids_row), top_logprobs_row, strict=True)),
            )
        return SamplerOutput(token_ids=sampled_ids, logprobs=logprobs)

    def _rows(self, rows: list[int], states: list[_RequestState]) -> slice | torch.Tensor:
        """Index of a subset of rows: a full slice (a view, no copy) when it is every row."""
        return slice(None) if len(rows) == len(states) else self._ids(rows)

    def _ids(self, values: Sequence[int | None]) -> torch.Tensor:
        """Row indices, slots or token ids as an int64 tensor on the device."""
        return torch.tensor(values, dtype=torch.int64, device=self.device)

    def _floats(self, values: Sequence[float]) -> torch.Tensor:
        """Per-row parameters as a float32 tensor on the device."""
        return torch.tensor(values, dtype=torch.float32, device=self.device)
