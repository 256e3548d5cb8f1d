"""Structured outputs and tool calls with the official openai client against the default model
(SmolLM2-135M-Instruct, whose template has no tools: the generic tool format). Every schema bounds
its sizes, so the grammar completes each output within max_tokens."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from server.app import create_app
from server.config import ServerConfig
from server.runner import ServerThread

MODEL = "SmolLM2-135M-Instruct"
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "address"],
    "additionalProperties": False,
}
ORDER = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "items": {"type": "string", "enum": ["apple", "bread", "milk", "eggs"]},
            "minItems": 1,
            "maxItems": 3,
        },
        "priority": {"enum": ["low", "normal", "high"]},
        "gift": {"type": "boolean"},
    },
    "required": ["items", "priority"],
    "additionalProperties": False,
}
READING = {
    "type": "object",
    "properties": {
        "sensor": {"type": "string", "enum": ["t1", "t2", "h1"]},
        "value": {"type": "number", "minimum": -40, "maximum": 60},
        "level": {"type": "integer", "minimum": 1, "maximum": 5},
        "ok": {"type": "boolean"},
    },
    "required": ["sensor", "value", "level", "ok"],
    "additionalProperties": False,
}
SCHEMAS = {"person": (PERSON, 70), "order": (ORDER, 40), "reading": (READING, 40)}
PROMPTS = [
    f"{subject} Answer in JSON."
    for subject in (
        "Describe a friend.",
        "Tell me about a customer.",
        "Write a record for a new employee.",
        "Make up an example.",
        "Give me sample data.",
        "Fill in the form.",
        "What would a typical entry look like?",
        "Create a test record.",
        "Invent something plausible.",
        "Produce one item for a database.",
        "Give a realistic example.",
        "Write one entry for a spreadsheet.",
        "Describe a reading from a weather station.",
        "Describe a grocery order.",
        "Describe a person who lives in Paris.",
        "Give me a quick example, please.",
        "Show an example for the documentation.",
        "Write a value for a unit test.",
        "Make an entry with small numbers.",
        "Write one more example.",
    )
]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "minLength": 1, "maxLength": 16},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Get the local time in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 16}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
ASK_WEATHER = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def server(default_model_dir: Path) -> Iterator[ServerThread]:
    config = ServerConfig(engine={"model": MODEL, "kv_cache_memory": "256MiB", "compile": False})
    with ServerThread(create_app(config)) as server:
        server.wait_ready(timeout=300)
        yield server


@pytest.fixture(scope="module")
def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def _json_schema_format(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def _chat(client: openai.OpenAI, **kwargs: Any) -> Any:
    kwargs.setdefault("temperature", 0.7)
    return client.chat.completions.create(model=MODEL, seed=1, **kwargs)


def test_json_schema_outputs_validate(client: openai.OpenAI) -> None:
    """20 prompts x 3 schemas, all 60 in flight at once (one batch decodes them together)."""
    asks = [(name, prompt) for name in SCHEMAS for prompt in PROMPTS]

    def ask(name_prompt: tuple[str, str]) -> Any:
        name, prompt = name_prompt
        schema, max_tokens = SCHEMAS[name]
        return _chat(
            client,
            messages=[{"role": "user", "content": prompt}],
            response_format=_json_schema_format(name, schema),
            max_tokens=max_tokens,
        ).choices[0]

    with ThreadPoolExecutor(len(asks)) as pool:
        choices = list(pool.map(ask, asks))
    for (name, _), choice in zip(asks, choices, strict=True):
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), SCHEMAS[name][0])


class Reading(BaseModel):
    sensor: str = Field(max_length=4)
    level: int = Field(ge=1, le=5)
    ok: bool


def test_parse_with_a_pydantic_model_and_n(client: openai.OpenAI) -> None:
    completion = client.chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": "Report the status of sensor t1."}],
        response_format=Reading,
        max_tokens=40,
        n=3,
        temperature=0.8,
        seed=3,
        logprobs=True,
    )
    assert len(completion.choices) == 3
    for choice in completion.choices:
        assert isinstance(choice.message.parsed, Reading)
        assert choice.logprobs.content


def test_streamed_json_schema_with_n(client: openai.OpenAI) -> None:
    stream = _chat(
        client,
        messages=[{"role": "user", "content": PROMPTS[0]}],
        response_format=_json_schema_format("reading", READING),
        max_tokens=40,
        n=3,
        stream=True,
    )
    texts = ["", "", ""]
    reasons: list[str | None] = [None, None, None]
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            reasons[choice.index] = choice.finish_reason or reasons[choice.index]
    assert reasons == ["stop"] * 3
    for text in texts:
        jsonschema.validate(json.loads(text), READING)


def test_regex_choice_and_json_object(client: openai.OpenAI, server: ServerThread) -> None:
    prompts = ["My phone number is", "Call me at", "The code is", "Dial"]
    regex = r"[0-9]{3}-[0-9]{4}"
    completion = client.completions.create(
        model=MODEL,
        prompt=prompts,
        max_tokens=12,
        temperature=1.0,
        stop=["-99"],  # a stop string beside the grammar: outputs it would cut do not occur
        extra_body={"structured_outputs": {"regex": regex}},
    )
    assert len(completion.choices) == 4
    for choice in completion.choices:
        assert re.fullmatch(regex, choice.text), choice.text
    answers = [
        _chat(
            client,
            messages=[{"role": "user", "content": f"Is {thing} a fruit? Answer yes or no."}],
            max_tokens=4,
            extra_body={"guided_choice": ["yes", "no"]},
        ).choices[0]
        for thing in ("an apple", "a car")
    ]
    assert all(a.message.content in ("yes", "no") and a.finish_reason == "stop" for a in answers)
    for prompt in ('Give the JSON {"ok": true}.', 'Give the JSON {"a": 1}.'):
        reply = _chat(
            client,
            messages=[{"role": "user", "content": prompt}],
            response_format={"type": "json_object"},
            max_tokens=30,
            temperature=0.0,
        ).choices[0]
        assert reply.finish_reason == "stop", reply.message.content
        assert isinstance(json.loads(reply.message.content), dict)


def _validate_calls(calls: list[Any], names: set[str]) -> None:
    schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in (WEATHER, TIME)}
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_required_and_named_tool_choice(client: openai.OpenAI) -> None:
    required = _chat(
        client, messages=ASK_WEATHER, tools=[WEATHER, TIME], tool_choice="required", max_tokens=60
    ).choices[0]
    assert required.finish_reason == "tool_calls"
    _validate_calls(required.message.tool_calls, {"get_weather", "get_time"})
    named = _chat(
        client,
        messages=ASK_WEATHER,
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        parallel_tool_calls=False,
        max_tokens=40,
    ).choices[0]
    assert named.finish_reason == "tool_calls"
    assert len(named.message.tool_calls) == 1
    _validate_calls(named.message.tool_calls, {"get_time"})


def test_parallel_calls(client: openai.OpenAI) -> None:
    """Two cities asked for, parallel calls allowed: the model calls the tool once per city (a
    reply cut by max_tokens may end in a call whose arguments it could not finish)."""
    reply = _chat(
        client,
        messages=[
            {
                "role": "user",
                "content": "Call get_weather twice: once for Paris, then once for Tokyo.",
            }
        ],
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=True,
        max_tokens=90,
        temperature=0.0,
    ).choices[0]
    calls = reply.message.tool_calls
    complete = calls if reply.finish_reason == "tool_calls" else calls[:-1]
    assert len(complete) >= 2, reply
    _validate_calls(complete, {"get_weather"})
    cities = [json.loads(call.function.arguments)["city"] for call in complete[:2]]
    assert cities == ["Paris", "Tokyo"]


def test_auto_without_need_answers_in_text(client: openai.OpenAI) -> None:
    reply = _chat(
        client,
        messages=[{"role": "user", "content": "Say hello to me."}],
        tools=[WEATHER],
        max_tokens=8,
        temperature=0.0,
    ).choices[0]
    assert reply.message.tool_calls is None
    assert reply.message.content


def test_round_trip_and_streamed_calls(client: openai.OpenAI) -> None:
    kwargs = dict(
        model=MODEL, messages=ASK_WEATHER, tools=[WEATHER], tool_choice="required",
        max_tokens=60, temperature=0.0,
    )  # fmt: skip
    whole = client.chat.completions.create(**kwargs).choices[0]
    streamed: dict[int, dict[str, str]] = {}
    finish_reason = None
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        delta = chunk.choices[0].delta
        finish_reason = chunk.choices[0].finish_reason or finish_reason
        for call in delta.tool_calls or []:
            entry = streamed.setdefault(call.index, {"name": "", "arguments": ""})
            if call.id:
                assert call.function.name and not entry["name"]  # id and name come first
                entry["name"] = call.function.name
            entry["arguments"] += call.function.arguments or ""
    assert finish_reason == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in streamed.values()] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls
    ]
    call = whole.message.tool_calls[0]
    messages = [
        *ASK_WEATHER,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 24 degrees."},
    ]
    answer = _chat(
        client, messages=messages, tools=[WEATHER], tool_choice="none", max_tokens=8
    ).choices[0]
    assert answer.message.content and answer.message.tool_calls is None


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"response_format": _json_schema_format("x", {"type": "string", "pattern": "(?=a)"})},
         "response_format.json_schema.schema"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_regex": "[0-9]", "guided_json": {}}, "guided_regex"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]},
         "tools.0.function.name"),
        ({"functions": [WEATHER["function"]], "tools": [WEATHER]}, "functions"),
        ({"tools": [WEATHER], "tool_choice": "required",
          "response_format": {"type": "json_object"}}, "response_format"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0.tool_call_id"),
        ({"min_tokens": 2, "guided_regex": "a+"}, "min_tokens"),
    ],
)  # fmt: skip
def test_invalid_structured_outputs_and_tools_are_400s(
    server: ServerThread, body: dict[str, Any], param: str
) -> None:
    response = httpx.post(
        server.url + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **body},
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
