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
from server.structured import requested_structured_output, with_finish_message
from server.tokens import TokenText
from server.tools import ToolDeltas, check_tool_schemas, prompt_messages, reply_message, tool_plan


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
    plan = tool_plan(body, getattr(token_text.tokenizer, "chat_template", None))
    structured = await state.off_loop(_check_structured, body, plan, state)
    messages, tools = prompt_messages(
        plan, body.template_messages(plan.tool_format if plan else "json")
    )
    try:
        prompt_ids = await state.off_loop(
            token_text.apply_chat_template,
            messages,
            body.add_generation_prompt,
            body.continue_final_message,
            tools,
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
        lambda: body.sampling_params(max_tokens, num_logprobs, token_text.vocab_size, structured)
    )
    generation, first = await state.start(
        request, "chatcmpl", [prompt_ids], body.n, params, stream=bool(body.stream)
    )
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
            text = "".join(d.text for d in deltas)
            finish_reason = finish_reason_of(deltas)
            message = {"role": "assistant", "content": text, "refusal": None}
            if plan is not None:
                message, finish_reason = reply_message(plan, text, finish_reason)
            choice = {"index": index, "message": message, "logprobs": logprobs,
                      "finish_reason": finish_reason}  # fmt: skip
            choices.append(with_finish_message(choice, deltas))
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

    tool_deltas = {i: ToolDeltas(plan) for i in range(body.n)} if plan is not None else {}

    def make_chunks(deltas: list[ChoiceDelta]) -> list[dict[str, Any]]:
        chunks = []
        while role_chunks:
            chunks.append(role_chunks.pop(0))
        for delta in deltas:
            if tool_deltas:
                chunks += tool_chunks(delta)
                continue
            if not delta.text and delta.finish_reason is None and num_logprobs is None:
                continue  # a character still incomplete
            logprobs = None
            if num_logprobs is not None and delta.logprobs is not None:
                logprobs = {"content": chat_logprobs(token_text, delta.logprobs), "refusal": None}
            content = {"content": delta.text} if delta.text or delta.finish_reason is None else {}
            choice = {"index": delta.index, "delta": content, "logprobs": logprobs,
                      "finish_reason": delta.finish_reason}  # fmt: skip
            chunks.append(chunk(with_finish_message(choice, [delta])))
        return chunks

    def tool_chunks(delta: ChoiceDelta) -> list[dict[str, Any]]:
        """The delta through its choice's tool-call parser: content, call names and argument
        fragments; the last chunk carries the finish reason (and the logprobs, if asked)."""
        parser = tool_deltas[delta.index]
        pieces = parser.feed(delta.text, delta.finish_reason is not None)
        logprobs = None
        if num_logprobs is not None and delta.logprobs is not None:
            logprobs = {"content": chat_logprobs(token_text, delta.logprobs), "refusal": None}
        if not pieces and delta.finish_reason is None and logprobs is None:
            return []
        pieces = pieces or [{}]
        out = []
        for number, piece in enumerate(pieces):
            last = number == len(pieces) - 1
            choice = {"index": delta.index, "delta": piece, "logprobs": None,
                      "finish_reason": None}  # fmt: skip
            if last:
                choice["logprobs"] = logprobs
                choice["finish_reason"] = parser.finish_reason(delta.finish_reason)
                choice = with_finish_message(choice, [delta])
            out.append(chunk(choice))
        return out

    return streaming_response(generation, first, make_chunks, chunk_base if include_usage else None)


def _check_structured(body: ChatCompletionRequest, plan: Any, state: ServerState) -> Any:
    """The structured output the reply must follow (a forced tool call's, or the body's), each
    grammar checked: a 400 naming the param otherwise. On a preparation thread."""
    check_tool_schemas(body.tools, body.functions, state.grammar_tokenizer)
    requested = requested_structured_output(body, state.grammar_tokenizer)
    forced = plan.structured_output() if plan is not None else None
    if forced is None:
        return requested
    if requested is not None:
        raise APIError(
            400,
            "a structured output cannot be combined with a tool_choice that forces a call",
            param="response_format",
            code="invalid_value",
        )
    return forced
