"""Tool-call parsing (server/tool_calls.py): both formats, text that is not a call, malformed calls,
and streamed events that reassemble to the whole-text result however the text is cut."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from server.tool_calls import ToolCallStream, assemble, parse_tool_calls

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
