"""``POST /v1/completions``: a prompt (string, strings, token ids or lists of them) -> text."""

from __future__ import annotations

import time
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from engine.outputs import TokenLogprob
from server.errors import APIError
from server.generation import ChoiceDelta
from server.protocol import CompletionRequest
from server.serving import (
    ServerState,
    build_params,
    collect,
    finish_reason_of,
    finite_logprob,
    read_body,
    streaming_response,
    usage,
)
from server.structured import requested_structured_output, with_finish_message
from server.tokens import TokenText


def _prompts(body: CompletionRequest, token_text: TokenText) -> tuple[list[list[int]], list[str]]:
    """Token ids and text of each prompt (the text of token-id prompts only for echo: decoding a
    long one takes tens of milliseconds)."""
    prompt = body.prompt
    if isinstance(prompt, str):
        texts = [prompt]
    elif all(isinstance(item, str) for item in prompt):
        texts = list(prompt)  # type: ignore[arg-type]
    else:
        texts = []
    if texts:
        return [token_text.encode(text) for text in texts], texts
    id_lists = [prompt] if isinstance(prompt[0], int) else prompt
    for ids in id_lists:
        for token_id in ids:  # type: ignore[union-attr]
            if not 0 <= token_id < token_text.vocab_size:  # type: ignore[operator]
                raise APIError(
                    400,
                    f"prompt holds token id {token_id}, outside [0, {token_text.vocab_size})",
                    param="prompt",
                    code="invalid_value",
                )
    id_lists = [list(ids) for ids in id_lists]  # type: ignore[union-attr, arg-type]
    if not body.echo:
        return id_lists, [""] * len(id_lists)  # type: ignore[return-value]
    max_model_len = token_text.max_model_len
    texts = [
        "" if max_model_len is not None and len(ids) > max_model_len else token_text.decode(ids)
        for ids in id_lists  # too long: refused next, not decoded
    ]
    return id_lists, texts  # type: ignore[return-value]


class _LogprobsBuilder:
    """OpenAI's completion logprobs: tokens, token_logprobs, top_logprobs, text_offset."""

    def __init__(self, token_text: TokenText, offset: int) -> None:
        self._token_text = token_text
        self._offset = offset

    def build(self, logprobs: list[TokenLogprob]) -> dict[str, Any]:
        text = self._token_text.text
        out: dict[str, Any] = {
            "tokens": [],
            "token_logprobs": [],
            "top_logprobs": [],
            "text_offset": [],
        }
        for item in logprobs:
            token = text(item.token_id)
            out["tokens"].append(token)
            out["token_logprobs"].append(finite_logprob(item.logprob))
            top = {text(token_id): finite_logprob(lp) for token_id, lp in item.top}
            top.setdefault(token, finite_logprob(item.logprob))
            out["top_logprobs"].append(top)
            out["text_offset"].append(self._offset)
            self._offset += len(token)
        return out


async def create_completion(request: Request) -> Response:
    state: ServerState = request.app.state.server
    body = await read_body(request, CompletionRequest)
    token_text = state.check_accepting()
    state.check_model(body.model)
    state.check_num_sequences(body.num_prompts, body.n)  # before tokenizing the prompts
    prompts, prompt_texts = await state.off_loop(_prompts, body, token_text)
    structured = await state.off_loop(requested_structured_output, body, state.grammar_tokenizer)
    max_tokens = body.max_tokens or 16
    for ids in prompts:
        state.check_context(len(ids), max_tokens, param="max_tokens")
    params = build_params(
        lambda: body.sampling_params(max_tokens, body.logprobs, token_text.vocab_size, structured)
    )
    generation, first = await state.start(
        request, "cmpl", prompts, body.n, params, stream=bool(body.stream)
    )
    created = int(time.time())
    base = {"id": generation.request_id, "object": "text_completion", "created": created,
            "model": state.model_name}  # fmt: skip
    num_choices = len(prompts) * body.n
    echo_texts = {
        index: prompt_texts[index // body.n] if body.echo else "" for index in range(num_choices)
    }
    builders = {
        index: _LogprobsBuilder(token_text, len(echo_texts[index])) for index in range(num_choices)
    }

    def logprobs_of(delta: ChoiceDelta) -> dict[str, Any] | None:
        if body.logprobs is None or delta.logprobs is None:
            return None
        return builders[delta.index].build(delta.logprobs)

    if not body.stream:
        by_choice = await collect(request, generation, first)
        choices = []
        for index in range(num_choices):
            deltas = by_choice.get(index, [])
            logprobs = None
            if body.logprobs is not None:
                merged = [lp for d in deltas for lp in (d.logprobs or [])]
                logprobs = builders[index].build(merged)
            choice = {
                "index": index,
                "text": echo_texts[index] + "".join(d.text for d in deltas),
                "logprobs": logprobs,
                "finish_reason": finish_reason_of(deltas),
            }
            choices.append(with_finish_message(choice, deltas))
        payload = {
            **base,
            "choices": choices,
            "usage": usage(generation.num_prompt_tokens, generation.num_output_tokens),
            "system_fingerprint": None,
        }
        return JSONResponse(payload)

    include_usage = body.include_usage
    continuous = include_usage and body.stream_options.continuous_usage_stats  # type: ignore[union-attr]
    echoed: set[int] = set()

    def make_chunks(deltas: list[ChoiceDelta]) -> list[dict[str, Any]]:
        chunks = []
        for delta in deltas:
            text = delta.text
            if delta.index not in echoed:
                echoed.add(delta.index)
                text = echo_texts[delta.index] + text
            if not text and delta.finish_reason is None and body.logprobs is None:
                continue  # a character still incomplete
            choice = {
                "index": delta.index,
                "text": text,
                "logprobs": logprobs_of(delta),
                "finish_reason": delta.finish_reason,
            }
            chunk: dict[str, Any] = {**base, "choices": [with_finish_message(choice, [delta])]}
            if include_usage:
                chunk["usage"] = (
                    usage(generation.num_prompt_tokens, generation.num_output_tokens)
                    if continuous
                    else None
                )
            chunks.append(chunk)
        return chunks

    return streaming_response(generation, first, make_chunks, base if include_usage else None)
