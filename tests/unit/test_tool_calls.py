"""Tool-call parsing (server/tool_calls.py): both formats, text that is not a call, malformed calls,
and streamed events that reassemble to the whole-text result however the text is cut."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.structured_output import GrammarTokenizer
from server.tool_calls import ToolCallStream, assemble, parse_tool_calls
from server.tools import (
    FunctionName,
    Tool,
    prompt_messages,
    reply_message,
    resolve_tools,
    template_tool_format,
)


@pytest.fixture(scope="module")
def grammar_tokenizer(tiny_llama_dir) -> GrammarTokenizer:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    return GrammarTokenizer(tokenizer, len(tokenizer), (tokenizer.eos_token_id,))


JSON_CALLS = (
    '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}, '
    '{"name": "get_time", "arguments": {"tz": "a \\"quoted\\" }{ zone"}}]}'
)
HERMES_CALLS = (
    "Let me check.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "n": 3}}\n</tool_call>\n'
    '<tool_call>\n{"arguments": {"x": "<tool_call>"}, "name": "f"}\n</tool_call>'
)


def test_json_calls() -> None:
    parsed = parse_tool_calls("json", JSON_CALLS)
    assert parsed.content is None
    assert [call.name for call in parsed.calls] == ["get_weather", "get_time"]
    assert json.loads(parsed.calls[0].arguments) == {"city": "Paris", "days": [1, 2]}
    assert json.loads(parsed.calls[1].arguments) == {"tz": 'a "quoted" }{ zone'}


def test_hermes_calls_and_leading_text() -> None:
    parsed = parse_tool_calls("hermes", HERMES_CALLS)
    assert parsed.content == "Let me check.\n"
    assert [call.name for call in parsed.calls] == ["get_weather", "f"]
    assert json.loads(parsed.calls[0].arguments) == {"city": "Paris", "n": 3}
    assert json.loads(parsed.calls[1].arguments) == {"x": "<tool_call>"}


@pytest.mark.parametrize("tool_format", ["json", "hermes"])
@pytest.mark.parametrize(
    "text", ["Hello there.", "  spaced {not json", "a < b, and <tool_ ends here", ""]
)
def test_text_is_content(tool_format: str, text: str) -> None:
    parsed = parse_tool_calls(tool_format, text)
    assert parsed.calls == []
    assert parsed.content == (text or None)


@pytest.mark.parametrize(
    ("tool_format", "text"),
    [
        ("json", '{"tool_calls": [{"name": "f", "arguments": {"a": 1'),
        ("json", '{"answer": 42}'),
        ("json", '{"tool_calls": [{"name": "f", "arguments": "not an object"}]}'),
        ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": }\n</tool_call>'),
    ],
)
def test_malformed_calls_end_as_content(tool_format: str, text: str) -> None:
    parsed = parse_tool_calls(tool_format, text)
    assert parsed.content is not None
    assert parsed.content in text


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    tool_format=st.sampled_from(["json", "hermes"]),
    cuts=st.lists(st.integers(min_value=1, max_value=7), min_size=1, max_size=200),
)
def test_streamed_events_reassemble_to_the_whole(tool_format: str, cuts: list[int]) -> None:
    text = JSON_CALLS if tool_format == "json" else HERMES_CALLS
    stream = ToolCallStream(tool_format)
    events = []
    position = 0
    for size in cuts:
        events += stream.feed(text[position : position + size])
        position += size
    events += stream.feed(text[position:])
    events += stream.finish()
    assert assemble(events) == parse_tool_calls(tool_format, text)
    names = [event for event in events if event.kind == "name"]
    first_arguments = {}
    for number, event in enumerate(events):
        if event.kind == "arguments":
            first_arguments.setdefault(event.index, number)
    # each call's name comes before any of its arguments
    for index, number in first_arguments.items():
        assert events.index(names[index]) < number


def test_arguments_arrive_in_fragments() -> None:
    stream = ToolCallStream("json")
    events = []
    for char in JSON_CALLS:
        events += stream.feed(char)
    fragments = [event for event in events if event.kind == "arguments" and event.index == 0]
    assert len(fragments) > 10


def _tools(*names: str) -> list[Tool]:
    parameters = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    return [Tool(type="function", function={"name": n, "parameters": parameters}) for n in names]


@pytest.mark.parametrize("tool_format", ["json", "hermes"])
def test_required_grammar_admits_parallel_calls_and_validates(
    grammar_tokenizer, tool_format: str
) -> None:
    plan = resolve_tools(_tools("f", "g"), "required", None, None, None, tool_format)
    calls = [{"name": "f", "arguments": {"x": 1}}, {"name": "g", "arguments": {"x": 2}}]
    if tool_format == "json":
        text = json.dumps({"tool_calls": calls})
    else:
        text = "".join(f"<tool_call>\n{json.dumps(c)}\n</tool_call>\n" for c in calls)
    matcher = grammar_tokenizer.matcher(plan.structured_output())
    assert matcher.consume_tokens(grammar_tokenizer.llg.tokenize_str(text))
    assert matcher.is_accepting()
    message, finish_reason = reply_message(plan, text, "stop")
    assert finish_reason == "tool_calls"
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["f", "g"]
    single = resolve_tools(_tools("f", "g"), "required", False, None, None, tool_format)
    matcher = grammar_tokenizer.matcher(single.structured_output())
    assert not matcher.consume_tokens(grammar_tokenizer.llg.tokenize_str(text))
    wrong = text.replace('"x": 1', '"x": "one"')
    matcher = grammar_tokenizer.matcher(plan.structured_output())
    assert not matcher.consume_tokens(grammar_tokenizer.llg.tokenize_str(wrong))


def test_legacy_functions_map_onto_tools() -> None:
    functions = [tool.function for tool in _tools("f")]
    plan = resolve_tools(None, None, None, functions, FunctionName(name="f"), "json")
    assert plan.legacy and plan.choice == "f" and not plan.parallel
    message, finish_reason = reply_message(
        plan, '{"tool_calls": [{"name": "f", "arguments": {"x": 3}}]}', "stop"
    )
    assert finish_reason == "function_call"
    assert message["function_call"] == {"name": "f", "arguments": '{"x": 3}'}
    assert resolve_tools(None, None, None, functions, "none", "json") is None


def test_tool_prompts() -> None:
    plan = resolve_tools(_tools("f"), None, None, None, None, "json")
    messages, tools = prompt_messages(plan, [{"role": "user", "content": "hi"}])
    assert (
        tools is None
        and messages[0]["role"] == "system"
        and '"name": "f"' in messages[0]["content"]
    )
    hermes = resolve_tools(_tools("f"), None, None, None, None, "hermes")
    messages, tools = prompt_messages(hermes, [{"role": "user", "content": "hi"}])
    assert tools == hermes.tool_dicts() and len(messages) == 1
    assert template_tool_format("{% for t in tools %}<tool_call>{% endfor %}") == "hermes"
    assert template_tool_format("{{ messages }}") == "json"
