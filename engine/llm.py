"""Offline generation: ``LLM(model=...).generate(prompts, sampling_params)``.

Runs every prompt through one ``LLMEngine`` with continuous batching and returns one result per
prompt, in order. Text is detokenized incrementally and stop strings are matched as the server
does it (``engine.detokenizer``): a request whose text reaches one is aborted and its text cut
before the stop string.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.config import EngineConfig
from engine.detokenizer import SequenceText, StopStrings
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput, TokenLogprob
from scheduler.sampling_params import SamplingParams


@dataclass
class CompletionOutput:
    """One generated sequence."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None
    error: str | None = None


@dataclass
class GenerationResult:
    """A prompt and its ``n`` completions; ``text``, ``token_ids``, ``finish_reason`` and
    ``logprobs`` are those of the first completion."""

    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def logprobs(self) -> list[TokenLogprob] | None:
        return self.outputs[0].logprobs


class LLM:
    """``LLM(model="SmolLM2-135M-Instruct", dtype="float32", ...)``: keyword arguments are
    ``EngineConfig`` fields (aliases accepted)."""

    def __init__(self, model: str | None = None, **config: Any) -> None:
        if model is not None:
            config["model"] = model
        self.engine = LLMEngine(EngineConfig(**config))
        self.engine.wait_until_compiled()  # offline: every step runs the graphs, if asked for
        self.tokenizer = self.engine.tokenizer
        self._next_id = 0

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[GenerationResult]:
        """Generates for each prompt (text, or a list of token ids). ``sampling_params``: one for
        all prompts or one per prompt (default: ``SamplingParams()``)."""
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(
                    f"{len(params_list)} sampling params for {len(prompt_list)} prompts"
                )
        if self.engine.has_unfinished_requests():
            raise RuntimeError("the engine still has requests of an interrupted generate()")

        results: list[GenerationResult] = []
        # request id -> (result index, completion index)
        owners: dict[str, tuple[int, int]] = {}
        texts: dict[str, SequenceText] = {}
        try:
            for index, (prompt, params) in enumerate(zip(prompt_list, params_list, strict=True)):
                text = prompt if isinstance(prompt, str) else None
                token_ids = (
                    self.tokenizer.encode(prompt, add_special_tokens=True)
                    if isinstance(prompt, str)
                    else list(prompt)
                )
                results.append(GenerationResult(text, token_ids, []))
                group_id = f"llm-{self._next_id}" if params.n > 1 else None
                stops = StopStrings(params.stop)
                for sequence in range(params.n):
                    request_id = f"llm-{self._next_id}-{sequence}"
                    self.engine.add_request(request_id, token_ids, params, group_id=group_id)
                    owners[request_id] = (index, sequence)
                    texts[request_id] = SequenceText(self.tokenizer, token_ids, stops)
                    results[index].outputs.append(
                        CompletionOutput(logprobs=[] if params.logprobs is not None else None)
                    )
                self._next_id += 1
            self._run(results, owners, texts)
        finally:
            for request_id in owners:
                self.engine.abort_request(request_id)
        return results

    def _run(
        self,
        results: list[GenerationResult],
        owners: dict[str, tuple[int, int]],
        texts: dict[str, SequenceText],
    ) -> None:
        while self.engine.has_unfinished_requests():
            for delta in self.engine.step():
                index, sequence = owners[delta.request_id]
                completion = results[index].outputs[sequence]
                self._apply(delta, completion, texts[delta.request_id])

    def _apply(
        self, delta: RequestOutput, completion: CompletionOutput, text: SequenceText
    ) -> None:
        if completion.finish_reason is not None:
            return  # already stopped by a stop string
        completion.token_ids.extend(delta.new_token_ids)
        if completion.logprobs is not None and delta.new_logprobs:
            completion.logprobs.extend(delta.new_logprobs)
        completion.error = delta.error
        text.add(list(delta.new_token_ids), finished=delta.finished)
        completion.finish_reason = delta.finish_reason
        if text.stopped:
            completion.finish_reason = "stop"
            if not delta.finished:
                self.engine.abort_request(delta.request_id)
        if completion.finish_reason is not None:
            completion.text = text.text


def _as_prompt_list(prompts: Any) -> list[str | list[int]]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if not prompts:
        raise ValueError("no prompts given")
    if all(isinstance(token, int) for token in prompts):
        return [list(prompts)]
    for prompt in prompts:
        if not isinstance(prompt, str) and not (
            isinstance(prompt, Sequence) and all(isinstance(t, int) for t in prompt)
        ):
            raise ValueError("each prompt must be a string or a list of token ids")
    return [p if isinstance(p, str) else list(p) for p in prompts]
