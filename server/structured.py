"""The request fields that ask for a structured output, and the one ``StructuredOutput`` they
name.

    response_format: {"type": "text" | "json_object" | "json_schema", "json_schema": {...}}
    structured_outputs: {"json" | "regex" | "choice" | "grammar": ...}       (vLLM's)
    guided_json, guided_regex, guided_choice, guided_grammar                 (vLLM's older ones)

A request gives at most one of them (``text`` counts as none).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from engine.structured_output import GrammarError, GrammarTokenizer
from scheduler.sampling_params import StructuredOutput
from server.errors import APIError

# The first characters of a grammar error that a 400 message quotes.
_MAX_MESSAGE_CHARS = 600


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class JsonSchemaFormat(_Body):
    name: str = Field("response", pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _check_schema(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("json_schema is required when type is 'json_schema'")
        if self.type != "json_schema" and self.json_schema is not None:
            raise ValueError("json_schema is only allowed when type is 'json_schema'")
        return self


class StructuredOutputsField(_Body):
    json_: dict[str, Any] | bool | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    @model_validator(mode="after")
    def _one(self) -> StructuredOutputsField:
        given = [n for n in ("json_", "regex", "choice", "grammar") if getattr(self, n) is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of json, regex, choice or grammar")
        return self


class StructuredFields(BaseModel):
    """Mixed into both endpoints' bodies."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def structured_output(self) -> tuple[StructuredOutput, str] | None:
        """The requested structured output and the param that asked for it; None for none.
        Raises StructuredOutputError naming the param."""
        found: list[tuple[StructuredOutput, str]] = []
        response_format = self.response_format
        if response_format is not None and response_format.type == "json_object":
            found.append((_json_schema({"type": "object"}), "response_format"))
        elif response_format is not None and response_format.json_schema is not None:
            schema = response_format.json_schema.schema_
            found.append(
                (
                    _json_schema({} if schema is None else schema),
                    "response_format.json_schema.schema",
                )
            )
        fields = self.structured_outputs
        if fields is not None:
            prefix = "structured_outputs."
            if fields.json_ is not None:
                found.append((_json_schema(fields.json_, prefix + "json"), prefix + "json"))
            elif fields.regex is not None:
                found.append((StructuredOutput("regex", fields.regex), prefix + "regex"))
            elif fields.choice is not None:
                found.append((_choice(fields.choice, prefix + "choice"), prefix + "choice"))
            elif fields.grammar is not None:
                found.append((StructuredOutput("grammar", fields.grammar), prefix + "grammar"))
        if self.guided_json is not None:
            found.append((_json_schema(self.guided_json, "guided_json"), "guided_json"))
        if self.guided_regex is not None:
            found.append((_nonempty("regex", self.guided_regex, "guided_regex"), "guided_regex"))
        if self.guided_choice is not None:
            found.append((_choice(self.guided_choice, "guided_choice"), "guided_choice"))
        if self.guided_grammar is not None:
            found.append(
                (_nonempty("grammar", self.guided_grammar, "guided_grammar"), "guided_grammar")
            )
        if len(found) > 1:
            raise StructuredOutputError(
                found[1][1],
                f"give one structured output, not both {found[0][1]} and {found[1][1]}",
            )
        return found[0] if found else None


class StructuredOutputError(ValueError):
    """A structured-output field the server refuses; ``param`` names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message[:_MAX_MESSAGE_CHARS])
        self.param = param


def _json_schema(schema: Any, param: str = "response_format") -> StructuredOutput:
    """A schema given as an object, a boolean or JSON text."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as error:
            raise StructuredOutputError(param, f"{param} is not JSON: {error}") from None
    if not isinstance(schema, dict | bool):
        raise StructuredOutputError(param, f"{param} must be a JSON schema (an object)")
    return StructuredOutput("json_schema", json.dumps(schema))


def _choice(choices: list[str], param: str) -> StructuredOutput:
    if not choices or not all(choices):
        raise StructuredOutputError(param, f"{param} must be a list of non-empty strings")
    return StructuredOutput("choice", json.dumps(choices))


def _nonempty(kind: str, spec: str, param: str) -> StructuredOutput:
    if not spec:
        raise StructuredOutputError(param, f"{param} must not be empty")
    return StructuredOutput(kind, spec)


def check_grammar(
    grammar_tokenizer: GrammarTokenizer | None, structured: StructuredOutput, param: str
) -> None:
    """400 naming ``param`` unless the engine can run this structured output (compiled and a
    matcher built: ~2 ms for a new JSON schema, nothing for one seen recently)."""
    if grammar_tokenizer is None:
        raise APIError(503, "the model is loading", code="loading", headers={"Retry-After": "5"})
    try:
        grammar_tokenizer.check(structured)
    except GrammarError as error:
        raise APIError(
            400, f"{param}: {str(error)[:_MAX_MESSAGE_CHARS]}", param=param, code="invalid_value"
        ) from None


def requested_structured_output(
    body: StructuredFields, grammar_tokenizer: GrammarTokenizer | None
) -> StructuredOutput | None:
    """The body's structured output, checked; a 400 naming the param otherwise."""
    try:
        found = body.structured_output()
    except StructuredOutputError as error:
        raise APIError(400, str(error), param=error.param, code="invalid_value") from None
    if found is None:
        return None
    structured, param = found
    check_grammar(grammar_tokenizer, structured, param)
    return structured


def with_finish_message(choice: dict[str, Any], deltas: list[Any]) -> dict[str, Any]:
    """A choice that ended on a dead end of its grammar (finish_reason ``grammar_error``) also
    carries ``finish_message``: what the grammar could not do."""
    for delta in reversed(deltas):
        if delta.finish_message is not None:
            return {**choice, "finish_message": delta.finish_message}
    return choice
