"""OpenAI request bodies (validated) and the helpers that turn them into ``SamplingParams``.

Unknown fields are rejected (400 naming the field); fields of features we do not implement yet
(images, audio) are accepted by the schema only to be rejected with a message that says so, never
silently ignored. Structured outputs are ``server/structured.py``'s fields, tools
``server/tools.py``'s.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    TypeAdapter,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from scheduler.sampling_params import MAX_LOGPROBS, SamplingParams, StructuredOutput
from server.structured import StructuredFields
from server.tools import (
    FunctionCall,
    FunctionCallChoice,
    FunctionDefinition,
    Tool,
    ToolCall,
    ToolChoice,
    generic_call_text,
    parsed_arguments,
)


class UnsupportedFeature(ValueError):
    """A valid OpenAI field naming a feature this server does not have; ``param`` names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False


# Text that may begin a stop string is held back from the stream: at most this many - 1 characters.
MAX_STOP_STRING_CHARS = 256


class _SamplingFields(_Body, StructuredFields):
    """Fields shared by both endpoints."""

    model: str | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    n: int = Field(1, ge=1, le=128)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = Field(None, ge=0, lt=2**63)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, le=2)
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    user: str | None = None
    # Lower is served first under --scheduling-policy priority (vLLM's convention); an integer,
    # not a numeric string or a float.
    priority: StrictInt = Field(0, ge=-(2**31), lt=2**31)
    # true: this request needs bitwise-reproducible outputs; accepted only by a server in
    # deterministic mode (where every request has them), a 400 elsewhere
    deterministic: StrictBool | None = None

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else (value or [])
        if len(stops) > 16:
            raise ValueError("at most 16 stop strings")
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        if any(len(s) > MAX_STOP_STRING_CHARS for s in stops):
            raise ValueError(f"stop strings must be at most {MAX_STOP_STRING_CHARS} characters")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _check_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        # Canonical ASCII decimals of at most 18 digits ('01', ' 1', '²' refused): no two keys
        # name one token id.
        for key in value or {}:
            canonical = key == "0" or (key[:1] != "0" and key.isascii() and key.isdigit())
            if not canonical or len(key) > 18:
                raise ValueError(f"keys must be token ids such as '42', got {key[:24]!r}")
        return value

    @model_validator(mode="after")
    def _check_stream_options(self) -> _SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_params(
        self,
        max_tokens: int,
        logprobs: int | None,
        vocab_size: int,
        structured: StructuredOutput | None = None,
    ) -> SamplingParams:
        """Raises ValueError naming the field (SamplingParams' own checks)."""
        logit_bias = {int(k): v for k, v in (self.logit_bias or {}).items()}
        for token_id in list(logit_bias) + list(self.stop_token_ids or []):
            if not 0 <= token_id < vocab_size:
                field = "logit_bias" if token_id in logit_bias else "stop_token_ids"
                raise ValueError(f"{field} holds token id {token_id}, outside [0, {vocab_size})")
        stop = self.stop if isinstance(self.stop, list) else ([self.stop] if self.stop else [])
        return SamplingParams(
            n=1,  # the server adds n requests of one group
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            seed=self.seed,
            stop=tuple(stop),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=(
                1.0 if self.repetition_penalty is None else self.repetition_penalty
            ),
            logit_bias=logit_bias,
            logprobs=logprobs,
            structured=structured,
        )


# The most prompts one completions body may list, whatever the server's limit on prompts x n
# (max_sequences_per_request, at most this): a longer list is refused before its items are
# validated, which for 500,000 token-id lists takes pydantic a second.
MAX_PROMPTS = 4096


def _check_token_ids(token_ids: list[Any]) -> None:
    """In Python, not in pydantic: a long list is then checked in bytecode that gives the GIL
    up every few milliseconds (pydantic checks it in one call that holds it throughout)."""
    for token_id in token_ids:
        if type(token_id) is not int or token_id < 0:
            raise ValueError("token ids must be non-negative integers")


# What the API documents; the checks are _check_prompt's.
_PROMPT_SCHEMA = TypeAdapter(str | list[str] | list[int] | list[list[int]]).json_schema()
_TOKEN_IDS_SCHEMA = TypeAdapter(list[int]).json_schema()


class CompletionRequest(_SamplingFields):
    prompt: Annotated[str | list[Any], WithJsonSchema(_PROMPT_SCHEMA)]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, value: str | list[Any]) -> str | list[Any]:
        """A string, a list of strings, a list of token ids, or a list of lists of them."""
        if isinstance(value, str):
            return value
        if not value:
            raise ValueError("must not be empty")
        if type(value[0]) is int:  # one prompt of token ids, however long
            _check_token_ids(value)
            return value
        if len(value) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts, got {len(value)}")
        if isinstance(value[0], str):
            if not all(isinstance(item, str) for item in value):
                raise ValueError("a list of prompts holds strings only, or token id lists only")
            return value
        for item in value:
            if not isinstance(item, list):
                raise ValueError("a list of prompts holds strings only, or token id lists only")
            if not item:
                raise ValueError("token id lists must not be empty")
            _check_token_ids(item)
        return value

    @property
    def num_prompts(self) -> int:
        prompt = self.prompt
        return 1 if isinstance(prompt, str) or isinstance(prompt[0], int) else len(prompt)

    def check_supported(self) -> None:
        if self.suffix:
            raise UnsupportedFeature("suffix", "suffix (insertion) is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise UnsupportedFeature("best_of", "best_of other than n is not supported")
        if self.echo and self.logprobs is not None:
            raise UnsupportedFeature(
                "echo", "echo together with logprobs (prompt logprobs) is not supported"
            )


class TextPart(_Body):
    type: Literal["text"]
    text: str


class OtherPart(BaseModel):
    """A content part of a type we do not support (image_url, input_audio, file ...)."""

    model_config = ConfigDict(extra="allow")
    type: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[TextPart | OtherPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    function_call: FunctionCall | None = None
    refusal: str | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: list[FunctionDefinition] | None = None
    function_call: FunctionCallChoice | None = None
    modalities: list[str] | None = None
    audio: Any | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    @model_validator(mode="after")
    def _check_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def check_supported(self) -> None:
        if self.modalities not in (None, ["text"]) or self.audio is not None:
            raise UnsupportedFeature("modalities", "only text output is supported")
        for index, message in enumerate(self.messages):
            where = f"messages.{index}"
            if (message.tool_calls or message.function_call) and message.role != "assistant":
                raise UnsupportedFeature(
                    f"{where}.tool_calls", "only assistant messages carry tool calls"
                )
            if message.role == "tool" and not message.tool_call_id:
                raise UnsupportedFeature(
                    f"{where}.tool_call_id", "a tool message needs the tool_call_id it answers"
                )
            if message.role == "function" and not message.name:
                raise UnsupportedFeature(f"{where}.name", "a function message needs its name")
            if isinstance(message.content, list):
                for part in message.content:
                    if isinstance(part, OtherPart):
                        raise UnsupportedFeature(
                            f"{where}.content",
                            f"content parts of type {part.type!r} are not supported (only text)",
                        )
            if message.content is None and message.role != "assistant":
                raise UnsupportedFeature(f"{where}.content", "content is required")
        if self.add_generation_prompt and self.continue_final_message:
            raise UnsupportedFeature(
                "continue_final_message",
                "continue_final_message needs add_generation_prompt to be false",
            )

    def template_messages(self, tool_format: str = "json") -> list[dict[str, Any]]:
        return template_messages(self.messages, tool_format)


def template_messages(
    messages: list[ChatMessage], tool_format: str = "json"
) -> list[dict[str, Any]]:
    """Messages as chat-template dicts: text parts joined, ``developer`` as ``system``. Tool
    calls and results: as templates with tools take them (``hermes``), or in the generic format
    (``json``: calls as their JSON text, results as user messages; see server/tools.py)."""
    out: list[dict[str, Any]] = []
    call_names: dict[str, str] = {}  # tool_call_id -> function name, from earlier calls
    for message in messages:
        if isinstance(message.content, list):
            text = "".join(part.text for part in message.content if isinstance(part, TextPart))
        else:
            text = message.content or ""
        role = "system" if message.role == "developer" else message.role
        calls = list(message.tool_calls or [])
        if message.function_call is not None:
            calls.append(ToolCall(id=f"call_{len(call_names)}", function=message.function_call))
        for call in calls:
            call_names[call.id] = call.function.name
        item: dict[str, Any] = {"role": role, "content": text}
        if message.name:
            item["name"] = message.name
        if role in ("tool", "function"):
            name = (
                message.name if role == "function" else call_names.get(message.tool_call_id or "")
            )
            if tool_format == "hermes":
                item = {"role": "tool", "content": text, "tool_call_id": message.tool_call_id}
                if name:
                    item["name"] = name
            else:
                label = f"{message.tool_call_id} ({name})" if role == "tool" else f"({name})"
                item = {"role": "user", "content": f"Result of the tool call {label}:\n{text}"}
        elif calls and tool_format == "hermes":
            item["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {
                        "name": call.function.name,
                        "arguments": parsed_arguments(call.function.arguments),
                    },
                }
                for call in calls
            ]
        elif calls:
            item["content"] = (text + "\n" if text else "") + generic_call_text(calls)
        out.append(item)
    return out


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: Annotated[list[Any], WithJsonSchema(_TOKEN_IDS_SCHEMA)]

    @field_validator("tokens")
    @classmethod
    def _check_tokens(cls, value: list[Any]) -> list[Any]:
        _check_token_ids(value)
        return value
