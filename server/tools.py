"""Tool calling: the request's ``tools`` / ``tool_choice`` (and the legacy ``functions`` /
``function_call``) resolved into a ``ToolPlan``: how the prompt shows the tools, which format
the output is parsed in (``server/tool_calls.py``), and the grammar that enforces a call when
``tool_choice`` is ``required`` or names a function.

Prompting: a chat template that renders ``tools`` and writes ``<tool_call>`` (Hermes, Qwen2/2.5)
gets them through ``tools=`` and the output is parsed in the ``hermes`` format. Any other template
gets the generic format: a system message listing the tools (GENERIC_TOOL_PROMPT) and asking for
``{"tool_calls": [{"name": ..., "arguments": {...}}]}`` as the whole answer; assistant calls and
tool results of earlier turns are written as that JSON and as user messages.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from engine.structured_output import GrammarTokenizer
from scheduler.sampling_params import StructuredOutput
from server.errors import APIError
from server.structured import check_grammar
from server.tool_calls import ToolCallEvent, ToolCallStream, parse_tool_calls

_NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"
MAX_TOOLS = 128

GENERIC_TOOL_PROMPT = """You can call the following tools. Each is a JSON object with the \
tool's name, what it does, and the JSON schema of its arguments.
<tools>
{tools}
</tools>
To call one or more tools, answer with only this JSON object and nothing else:
{{"tool_calls": [{{"name": "<tool name>", "arguments": {{<the arguments>}}}}]}}
To answer without a tool, write your answer as plain text."""


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FunctionDefinition(_Body):
    name: str = Field(pattern=_NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: FunctionName


class FunctionCall(_Body):
    name: str
    arguments: str


class ToolCall(_Body):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice
FunctionCallChoice = Literal["none", "auto"] | FunctionName


class ToolError(ValueError):
    """A tool field the server refuses; ``param`` names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolPlan:
    """``choice``: "auto", "required", or the one function's name. ``legacy``: the request used
    ``functions``; the reply then carries ``function_call`` (one call) instead of ``tool_calls``."""

    functions: tuple[FunctionDefinition, ...]
    choice: str
    parallel: bool
    tool_format: str  # "hermes" or "json" (server/tool_calls.py)
    legacy: bool = False

    @property
    def forced(self) -> tuple[FunctionDefinition, ...]:
        """The functions a call must name: all for ``required``, one for a named choice, none
        for ``auto``."""
        if self.choice == "auto":
            return ()
        if self.choice == "required":
            return self.functions
        return tuple(f for f in self.functions if f.name == self.choice)

    def structured_output(self) -> StructuredOutput | None:
        """The grammar that makes the output a valid call (``required`` or a named function),
        arguments validating against the function's schema; None for ``auto``."""
        forced = self.forced
        if not forced:
            return None
        call = {"anyOf": [_call_schema(f) for f in forced]} if len(forced) > 1 else None
        one_call = call or _call_schema(forced[0])
        if self.tool_format == "json":
            calls: dict[str, Any] = {"type": "array", "items": one_call, "minItems": 1}
            if not self.parallel:
                calls["maxItems"] = 1
            schema = {
                "type": "object",
                "properties": {"tool_calls": calls},
                "required": ["tool_calls"],
                "additionalProperties": False,
            }
            return StructuredOutput("json_schema", json.dumps(schema))
        options = {"x-guidance": {"whitespace_flexible": False, "item_separator": ", ",
                                  "key_separator": ": "}}  # fmt: skip
        lark = (
            f"start: call{'+' if self.parallel else ''}\n"
            f'call: "<tool_call>\\n" %json {json.dumps({**one_call, **options})} '
            '"\\n</tool_call>\\n"\n'
        )
        return StructuredOutput("grammar", lark)

    def tool_dicts(self) -> list[dict[str, Any]]:
        """The tools as chat templates take them (OpenAI's shape)."""
        return [{"type": "function", "function": _function_dict(f)} for f in self.functions]


def _function_dict(function: FunctionDefinition) -> dict[str, Any]:
    out: dict[str, Any] = {"name": function.name}
    if function.description:
        out["description"] = function.description
    out["parameters"] = function.parameters or {"type": "object", "properties": {}}
    return out


def _call_schema(function: FunctionDefinition) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            "name": {"const": function.name},
            "arguments": function.parameters or {"type": "object"},
        },
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def tool_plan(body: Any, chat_template: str | None) -> ToolPlan | None:
    """``resolve_tools`` of a chat body; ToolError as a 400 naming the param."""
    try:
        return resolve_tools(
            body.tools,
            body.tool_choice,
            body.parallel_tool_calls,
            body.functions,
            body.function_call,
            template_tool_format(chat_template),
        )
    except ToolError as error:
        raise APIError(400, str(error), param=error.param, code="invalid_value") from None


def resolve_tools(
    tools: list[Tool] | None,
    tool_choice: ToolChoice | None,
    parallel_tool_calls: bool | None,
    functions: list[FunctionDefinition] | None,
    function_call: FunctionCallChoice | None,
    tool_format: str,
) -> ToolPlan | None:
    """The plan of a request; None when no tool may be called (no tools, or ``none``). Raises
    ToolError naming the param."""
    legacy = functions is not None
    if legacy:
        if tools is not None or tool_choice is not None:
            raise ToolError("functions", "give tools and tool_choice, or functions, not both")
        tools = [Tool(type="function", function=f) for f in functions or []]
        tool_choice = (
            NamedToolChoice(type="function", function=function_call)
            if isinstance(function_call, FunctionName)
            else function_call
        )
        choice_param = "function_call"
    else:
        if function_call is not None:
            raise ToolError("function_call", "function_call needs functions")
        choice_param = "tool_choice"
    tools_param = "functions" if legacy else "tools"
    tools = tools or []
    if len(tools) > MAX_TOOLS:
        raise ToolError(tools_param, f"at most {MAX_TOOLS} tools, got {len(tools)}")
    names = [tool.function.name for tool in tools]
    if len(set(names)) != len(names):
        raise ToolError(tools_param, "tool names must be unique")
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if tool_choice == "none":
        return None
    if not tools:
        raise ToolError(choice_param, f"{choice_param} {_choice_text(tool_choice)} needs tools")
    choice = tool_choice.function.name if isinstance(tool_choice, NamedToolChoice) else tool_choice
    if choice not in ("auto", "required") and choice not in names:
        raise ToolError(choice_param, f"{choice_param} names {choice!r}, which is not a tool")
    return ToolPlan(
        functions=tuple(tool.function for tool in tools),
        choice=choice,
        parallel=(parallel_tool_calls is not False) and not legacy,
        tool_format=tool_format,
        legacy=legacy,
    )


def _choice_text(choice: Any) -> str:
    return repr(choice.function.name) if isinstance(choice, NamedToolChoice) else repr(choice)


def template_tool_format(chat_template: str | None) -> str:
    """``hermes`` when the model's template renders tools and writes <tool_call>, else
    ``json`` (the generic format)."""
    template = chat_template or ""
    return "hermes" if "tools" in template and "<tool_call>" in template else "json"


def generic_tool_prompt(plan: ToolPlan) -> str:
    tools = "\n".join(json.dumps(_function_dict(f)) for f in plan.functions)
    return GENERIC_TOOL_PROMPT.format(tools=tools)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parsed_arguments(arguments: str) -> Any:
    """A call's arguments as templates take them: the JSON object, or the text if it is not
    JSON."""
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def generic_call_text(calls: list[ToolCall]) -> str:
    """An earlier assistant turn's calls as the generic format writes them."""
    items = [
        {"name": call.function.name, "arguments": parsed_arguments(call.function.arguments)}
        for call in calls
    ]
    return json.dumps({"tool_calls": items})


def check_tool_schemas(
    tools: list[Tool] | None,
    functions: list[FunctionDefinition] | None,
    grammar_tokenizer: GrammarTokenizer | None,
) -> None:
    """400 naming the tool whose ``parameters`` the engine cannot enforce."""
    definitions = [(f"tools.{i}.function", t.function) for i, t in enumerate(tools or [])]
    definitions += [(f"functions.{i}", f) for i, f in enumerate(functions or [])]
    for where, function in definitions:
        if function.parameters is not None:
            schema = StructuredOutput("json_schema", json.dumps(function.parameters))
            check_grammar(grammar_tokenizer, schema, f"{where}.parameters")


def prompt_messages(
    plan: ToolPlan | None, messages: list[dict[str, Any]]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages and the ``tools`` argument for the chat template: the tools go to a
    template that renders them, else into the system message (the generic format)."""
    if plan is None:
        return messages, None
    if plan.tool_format == "hermes":
        return messages, plan.tool_dicts()
    prompt = generic_tool_prompt(plan)
    if messages and messages[0]["role"] == "system":
        first = dict(messages[0], content=f"{messages[0]['content']}\n\n{prompt}".lstrip())
        return [first, *messages[1:]], None
    return [{"role": "system", "content": prompt}, *messages], None


def reply_message(
    plan: ToolPlan, text: str, finish_reason: str | None
) -> tuple[dict[str, Any], str | None]:
    """A non-streamed choice's ``message`` and ``finish_reason``: calls found in the text become
    ``tool_calls`` (``function_call`` for legacy requests) with ``tool_calls`` (``function_call``)
    as the finish reason when the output ended on its own."""
    parsed = parse_tool_calls(plan.tool_format, text)
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content, "refusal": None}
    if not parsed.calls:
        message["content"] = text
        return message, finish_reason
    if plan.legacy:
        call = parsed.calls[0]
        message["function_call"] = {"name": call.name, "arguments": call.arguments}
        return message, "function_call" if finish_reason == "stop" else finish_reason
    message["tool_calls"] = [
        {"id": new_call_id(), "type": "function",
         "function": {"name": call.name, "arguments": call.arguments}}
        for call in parsed.calls
    ]  # fmt: skip
    return message, "tool_calls" if finish_reason == "stop" else finish_reason


class ToolDeltas:
    """A streamed choice's ``delta`` objects: content as it comes, each call's id and name
    first, then its arguments in fragments (OpenAI's shape; ``function_call`` for legacy
    requests)."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.stream = ToolCallStream(plan.tool_format)
        self.num_calls = 0

    def feed(self, text: str, finished: bool) -> list[dict[str, Any]]:
        events = self.stream.feed(text) if text else []
        if finished:
            events += self.stream.finish()
        return [self._delta(event) for event in events if self._wanted(event)]

    def finish_reason(self, finish_reason: str | None) -> str | None:
        if finish_reason != "stop" or not self.num_calls:
            return finish_reason
        return "function_call" if self.plan.legacy else "tool_calls"

    def _wanted(self, event: ToolCallEvent) -> bool:
        # a legacy reply carries one call
        return not (self.plan.legacy and event.kind != "content" and event.index > 0)

    def _delta(self, event: ToolCallEvent) -> dict[str, Any]:
        if event.kind == "content":
            return {"content": event.text}
        if event.kind == "name":
            self.num_calls += 1
            if self.plan.legacy:
                return {"function_call": {"name": event.text, "arguments": ""}}
            call = {"index": event.index, "id": new_call_id(), "type": "function",
                    "function": {"name": event.text, "arguments": ""}}  # fmt: skip
            return {"tool_calls": [call]}
        if self.plan.legacy:
            return {"function_call": {"arguments": event.text}}
        return {"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]}
