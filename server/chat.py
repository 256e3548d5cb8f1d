"""``POST /v1/chat/completions``: messages through the model's chat template -> a reply."""

from __future__ import annotations

import time
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from engine.outputs import TokenLogprob
from server.errors import APIError
from server.generation import ChoiceDelta
from server.protocol import ChatCompletionRequest
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
from server.tokens import TokenText


def chat_logprobs(token_text: TokenText, logprobs: list[TokenLogprob]) -> list[dict[str, Any]]:
    """OpenAI's ``logprobs.content`` entries: token, logprob, bytes, top_logprobs."""
    content = []
    for item in logprobs:
        content.append(
            {
                "token": token_text.text(item.token_id),
                "logprob": finite_logprob(item.logprob),
                "bytes": token_text.bytes(item.token_id),
                "top_logprobs": [
                    {
                        "token": token_text.text(token_id),
                        "logprob": finite_logprob(logprob),
                        "bytes": token_text.bytes(token_id),
                    }
                    for token_id, logprob in item.top
                ],
            }
        )
    return content


async def create_chat_completion(request: Request) -> Response:
    state: ServerState = request.app.state.server
    body = await read_body(request, ChatCompletionRequest)
    token_text = state.check_accepting()
    state.check_model(body.model)
    state.check_num_sequences(1, body.n)
    try:
        prompt_ids = await state.off_loop(
            token_text.apply_chat_template,
            body.template_messages(),
            body.add_generation_prompt,
            body.continue_final_message,
        )
    except APIError:
        raise
    except Exception as error:  # the template's own errors (jinja raise_exception) are 400s
        raise APIError(
            400, f"the chat template failed: {error}", param="messages", code="invalid_value"
        ) from None
    max_tokens_param = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
    max_tokens = body.requested_max_tokens
    if max_tokens is None:
        max_tokens = state.max_model_len - len(prompt_ids)
        if max_tokens < 1:
            state.check_context(len(prompt_ids), 1, param="messages")
    state.check_context(len(prompt_ids), max_tokens, param=max_tokens_param)
    num_logprobs = body.num_logprobs
    params = build_params(
        lambda: body.sampling_params(max_tokens, num_logprobs, token_text.vocab_size)
    )
    generation, first = await state.start(request, "chatcmpl", [prompt_ids], body.n, params)
    base = {"id": generation.request_id, "created": int(time.time()), "model": state.model_name,
            "system_fingerprint": None}  # fmt: skip

    if not body.stream:
        by_choice = await collect(request, generation, first)
        choices = []
        for index in range(body.n):
            deltas = by_choice.get(index, [])
            logprobs = None
            if num_logprobs is not None:
                merged = [lp for d in deltas for lp in (d.logprobs or [])]
                logprobs = {"content": chat_logprobs(token_text, merged), "refusal": None}
            choices.append(
                {
                    "index": index,
                    "message": {
                        "role": "assistant",
                        "content": "".join(d.text for d in deltas),
                        "refusal": None,
                    },
                    "logprobs": logprobs,
                    "finish_reason": finish_reason_of(deltas),
                }
            )
        payload = {
            **base,
            "object": "chat.completion",
            "choices": choices,
            "usage": usage(generation.num_prompt_tokens, generation.num_output_tokens),
        }
        return JSONResponse(payload)

    include_usage = body.include_usage
    continuous = include_usage and body.stream_options.continuous_usage_stats  # type: ignore[union-attr]
    chunk_base = {**base, "object": "chat.completion.chunk"}

    def chunk(choice: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {**chunk_base, "choices": [choice]}
        if include_usage:
            out["usage"] = (
                usage(generation.num_prompt_tokens, generation.num_output_tokens)
                if continuous
                else None
            )
        return out

    # The first chunk of each choice carries the role, as OpenAI's do.
    role_chunks = [
        chunk(
            {
                "index": i,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
        )  # fmt: skip
        for i in range(body.n)
    ]

    def make_chunks(deltas: list[ChoiceDelta]) -> list[dict[str, Any]]:
        chunks = []
        while role_chunks:
            chunks.append(role_chunks.pop(0))
        for delta in deltas:
            if not delta.text and delta.finish_reason is None and num_logprobs is None:
                continue  # a character still incomplete
            logprobs = None
            if num_logprobs is not None and delta.logprobs is not None:
                logprobs = {"content": chat_logprobs(token_text, delta.logprobs), "refusal": None}
            content = {"content": delta.text} if delta.text or delta.finish_reason is None else {}
            chunks.append(
                chunk(
                    {
                        "index": delta.index,
                        "delta": content,
                        "logprobs": logprobs,
                        "finish_reason": delta.finish_reason,
                    }
                )
            )
        return chunks

    return streaming_response(generation, first, make_chunks, chunk_base if include_usage else None)
