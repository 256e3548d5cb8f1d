"""Tool calls in a model's output, parsed as the text arrives: one ``ToolCallStream`` per choice.

Two formats:

- ``hermes`` (Hermes, Qwen2/2.5 templates): text, then calls, each
  ``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>``.
- ``json`` (the generic format of templates without tools, see ``server/tools.py``): the whole
  output is ``{"tool_calls": [{"name": "f", "arguments": {...}}, ...]}``, or text.

``feed(text)`` returns events as soon as they are known: content, a call's name (when its string
is complete), then its ``arguments`` in fragments (the raw JSON text of the object as it grows).
``finish()`` checks the whole output: calls that are not valid JSON objects become content. The
non-streamed result is the same stream run over the whole text (``parse_tool_calls``), so streamed
deltas always reassemble to it. Scanning is linear in the text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

TOOL_FORMATS = ("hermes", "json")
_OPEN = "<tool_call>"
_CLOSE = "</tool_call>"


@dataclass
class ToolCallEvent:
    """``kind``: "content" (``text``), "name" (call ``index`` named ``text``) or "arguments" (a
    fragment ``text`` of call ``index``'s arguments)."""

    kind: str
    text: str
    index: int = 0


@dataclass
class ParsedCall:
    name: str
    arguments: str  # JSON text of an object


@dataclass(eq=False)
class _Call:
    name: str | None = None
    args_start: int | None = None
    args_end: int | None = None
    end: int | None = None  # one past the call object's closing brace
    sent_name: bool = False
    sent_args: int = 0  # characters of the arguments already sent


class _JsonScan:
    """Incremental scan of JSON text for call objects, those whose keys sit at ``call_depth``
    (1: the text is one call; 3: calls are the items of a top-level object's array). Records each
    call's ``name`` and the span of its ``arguments`` value. ``feed(text)`` scans what the text
    gained since the last call; ``text`` always starts at the same place."""

    def __init__(self, call_depth: int) -> None:
        self.call_depth = call_depth
        self.calls: list[_Call] = []
        self.pos = 0
        self.depth = 0
        self.in_string = False
        self.escape = False
        self.string_start = 0
        self.expect_key = False
        self.expect_value = False
        self.key: str | None = None
        self.value_start: int | None = None
        self.broken = False  # not JSON as far as the scan can tell (the final check decides)

    @property
    def open_arguments(self) -> int | None:
        """Where an ``arguments`` value still being written starts, if one is."""
        if self.key == "arguments" and self.value_start is not None:
            return self.value_start
        return None

    def feed(self, text: str) -> None:
        at_calls = self.call_depth
        for i in range(self.pos, len(text)):
            c = text[i]
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif c == "\\":
                    self.escape = True
                elif c == '"':
                    self.in_string = False
                    if self.depth == at_calls:
                        if self.expect_key:
                            self.key = _loads_str(text[self.string_start : i + 1])
                            self.expect_key = False
                        elif self.value_start is not None and text[self.value_start] == '"':
                            self._value_end(text, i + 1)
                continue
            if c == '"':
                self.in_string = True
                self.string_start = i
                self._maybe_value_start(i)
            elif c in "{[":
                self._maybe_value_start(i)
                self.depth += 1
                if self.depth == at_calls and c == "{":
                    self.calls.append(_Call())
                    self.expect_key = True
            elif c in "}]":
                if self.depth == at_calls:
                    self._scalar_end(text, i)
                    if self.calls:
                        self.calls[-1].end = i + 1
                self.depth -= 1
                if self.depth < 0:
                    self.broken = True
                    self.depth = 0
                if self.depth == at_calls and self.value_start is not None:
                    self._value_end(text, i + 1)
            elif self.depth == at_calls and c == ":":
                self.expect_value = True
            elif self.depth == at_calls and c == ",":
                self._scalar_end(text, i)
                self.expect_key = True
            elif not c.isspace():
                self._maybe_value_start(i)
        self.pos = len(text)

    def _maybe_value_start(self, i: int) -> None:
        if self.depth == self.call_depth and self.expect_value:
            self.value_start = i
            self.expect_value = False

    def _scalar_end(self, text: str, i: int) -> None:
        """A number, true, false or null at the call's level ends before ``i``."""
        start = self.value_start
        if start is not None and text[start] not in '"{[':
            self._value_end(text, len(text[:i].rstrip()))

    def _value_end(self, text: str, end: int) -> None:
        start, self.value_start = self.value_start, None
        if start is None or not self.calls:
            return
        call = self.calls[-1]
        if self.key == "name":
            call.name = _loads_str(text[start:end])
        elif self.key == "arguments":
            call.args_start, call.args_end = start, end
        self.key = None


def _loads_str(text: str) -> str | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, str) else None


class ToolCallStream:
    """Events of one choice's output in tool format ``tool_format`` (see the module doc)."""

    def __init__(self, tool_format: str) -> None:
        if tool_format not in TOOL_FORMATS:
            raise ValueError(f"unknown tool format {tool_format!r}")
        self.format = tool_format
        self.text = ""
        self._sent_content = 0  # characters of self.text sent as content
        self._mode: str | None = None  # json: "content" or "calls" once the first char is seen
        self._segments: list[tuple[int, _JsonScan]] = []  # hermes: (start, scan) per <tool_call>
        self._scan = _JsonScan(3)  # json format
        self._search_from = 0  # hermes: where the next tag may begin
        self.calls: list[_Call] = []

    # -- feeding ------------------------------------------------------------------------------

    def feed(self, text: str) -> list[ToolCallEvent]:
        self.text += text
        if self.format == "json":
            return self._feed_json()
        return self._feed_hermes()

    def _feed_json(self) -> list[ToolCallEvent]:
        if self._mode is None:
            stripped = self.text.lstrip()
            if not stripped:
                return []
            self._mode = "calls" if stripped.startswith("{") else "content"
        if self._mode == "content":
            return self._content_up_to(len(self.text))
        self._scan.feed(self.text)
        return self._call_events(self.text, self._scan)

    def _feed_hermes(self) -> list[ToolCallEvent]:
        events: list[ToolCallEvent] = []
        text = self.text
        while True:
            if self._segments and not self._segment_closed():
                start, scan = self._segments[-1]
                body = text[start:]
                scan.feed(body)
                events += self._call_events(body, scan)
                if not self._segment_closed():
                    return events
            found = text.find(_OPEN, self._search_from)
            if found < 0:
                if not self._segments:
                    # hold back what may be the start of a tag
                    events += self._content_up_to(len(text) - _partial_tag(text, _OPEN))
                return events
            if not self._segments:
                events += self._content_up_to(found)
            start = found + len(_OPEN)
            self._segments.append((start, _JsonScan(1)))
            self._search_from = start

    def _segment_closed(self) -> bool:
        """Whether the last <tool_call> segment's object ended (the next tag is searched after
        it)."""
        start, scan = self._segments[-1]
        if scan.calls and scan.calls[0].end is not None:
            self._search_from = max(self._search_from, start + scan.calls[0].end)
            return True
        return False

    def _content_up_to(self, end: int) -> list[ToolCallEvent]:
        if end <= self._sent_content:
            return []
        piece = self.text[self._sent_content : end]
        self._sent_content = end
        return [ToolCallEvent("content", piece)]

    def _call_events(self, text: str, scan: _JsonScan) -> list[ToolCallEvent]:
        """Names once known, then the arguments' new characters, of the scan's calls (``text``
        is what the scan read)."""
        events = []
        calls = scan.calls[:1] if scan.call_depth == 1 else scan.calls
        for call in calls:
            if call.name is None:
                continue
            if call not in self.calls:
                self.calls.append(call)
            index = self.calls.index(call)
            if not call.sent_name:
                call.sent_name = True
                events.append(ToolCallEvent("name", call.name, index))
            start = call.args_start
            end = call.args_end
            if start is None and call is calls[-1] and scan.open_arguments is not None:
                start, end = scan.open_arguments, len(text)
            if start is None or end is None:
                continue
            fragment = text[start + call.sent_args : end]
            if fragment:
                call.sent_args += len(fragment)
                events.append(ToolCallEvent("arguments", fragment, index))
        return events

    # -- the end ------------------------------------------------------------------------------

    def finish(self) -> list[ToolCallEvent]:
        """The last events: what content was held back, or the text of calls that did not
        parse (as content)."""
        if self.format == "json":
            if self._mode != "calls":
                return self._content_up_to(len(self.text))
            if self._valid_json_calls():
                return []
            return self._unparsed_as_content()
        if not self._segments:
            return self._content_up_to(len(self.text))
        if all(self._valid_hermes_call(start, scan) for start, scan in self._segments):
            return []
        return self._unparsed_as_content()

    def _unparsed_as_content(self) -> list[ToolCallEvent]:
        """Output that looked like calls but is not valid: the calls announced so far stay (a
        stream cannot take them back), the text not yet sent becomes content."""
        return self._content_up_to(len(self.text))

    def _valid_json_calls(self) -> bool:
        try:
            document = json.loads(self.text)
        except ValueError:
            return False
        if not isinstance(document, dict) or set(document) != {"tool_calls"}:
            return False
        items = document["tool_calls"]
        return (
            isinstance(items, list)
            and len(items) == len(self._scan.calls) == len(self.calls)
            and all(_valid_call(item) for item in items)
        )

    def _valid_hermes_call(self, start: int, scan: _JsonScan) -> bool:
        if not scan.calls or scan.calls[0].end is None:
            return False
        body = self.text[start : start + scan.calls[0].end]
        try:
            return _valid_call(json.loads(body)) and scan.calls[0] in self.calls
        except ValueError:
            return False


def _valid_call(item: Any) -> bool:
    return (
        isinstance(item, dict)
        and set(item) == {"name", "arguments"}
        and isinstance(item["name"], str)
        and isinstance(item["arguments"], dict)
    )


def _partial_tag(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


@dataclass
class ParsedOutput:
    content: str | None
    calls: list[ParsedCall] = field(default_factory=list)


def assemble(events: list[ToolCallEvent]) -> ParsedOutput:
    """Content and calls from a stream's events (what a client reassembles from the deltas)."""
    content = "".join(event.text for event in events if event.kind == "content")
    calls: list[ParsedCall] = []
    for event in events:
        if event.kind == "name":
            calls.append(ParsedCall(event.text, ""))
        elif event.kind == "arguments":
            calls[event.index].arguments += event.text
    return ParsedOutput(content or None, calls)


def parse_tool_calls(tool_format: str, text: str) -> ParsedOutput:
    """The non-streamed result: the stream run over the whole text."""
    stream = ToolCallStream(tool_format)
    return assemble(stream.feed(text) + stream.finish())
