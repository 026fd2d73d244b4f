"""Structured-output request fields, vLLM's shapes: ``response_format`` (``json_object``,
``json_schema``), ``structured_outputs`` (``json``, ``regex``, ``choice``, ``grammar``) and the
older top-level ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``.

Each becomes one engine ``StructuredOutput``; the engine compiles it (xgrammar) and answers an
invalid schema, regex or grammar with a 400 naming the field it came from.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from verifypd.serve.errors import invalid_request
from verifypd.types import StructuredOutput


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)


class JsonSchemaSpec(_Strict):
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None  # the grammar always enforces the schema


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None


class StructuredOutputs(_Strict):
    """vLLM's ``structured_outputs`` extra: exactly one of these."""

    json_schema: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class StructuredFields(_Strict):
    """Mixed into the request models of both endpoints."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


def structured_output(request: StructuredFields) -> StructuredOutput | None:
    """The request's one output constraint, or None; two at once is a 400."""
    found = [
        so
        for so in (
            _from_response_format(request.response_format),
            _from_structured_outputs(request.structured_outputs, "structured_outputs"),
            _from_guided(request),
        )
        if so is not None
    ]
    if len(found) > 1:
        raise invalid_request(
            "Give at most one of 'response_format', 'structured_outputs' and 'guided_*'",
            found[1].param,
        )
    return found[0] if found else None


def _from_response_format(rf: ResponseFormat | None) -> StructuredOutput | None:
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return StructuredOutput("json_object", "", "response_format")
    if rf.json_schema is None or rf.json_schema.json_schema is None:
        raise invalid_request(
            "'response_format' of type 'json_schema' needs 'json_schema.schema'", "response_format"
        )
    return json_schema_output(rf.json_schema.json_schema, "response_format")


def json_schema_output(schema: dict | bool | str, param: str) -> StructuredOutput:
    text = schema if isinstance(schema, str) else json.dumps(schema)
    return StructuredOutput("json", text, param)


def _from_structured_outputs(so: StructuredOutputs | None, param: str) -> StructuredOutput | None:
    if so is None:
        return None
    given = [
        (kind, value)
        for kind, value in (
            ("json", so.json_schema),
            ("regex", so.regex),
            ("choice", so.choice),
            ("grammar", so.grammar),
            ("json_object", so.json_object or None),
        )
        if value is not None
    ]
    if len(given) != 1:
        raise invalid_request(
            f"'{param}' needs exactly one of json, regex, choice, grammar, json_object", param
        )
    kind, value = given[0]
    if kind == "json":
        return json_schema_output(value, param)
    if kind == "choice":
        if not value or not all(value):
            raise invalid_request(f"'{param}' choice must be a list of non-empty strings", param)
        return StructuredOutput("choice", json.dumps(value), param)
    return StructuredOutput(kind, "" if kind == "json_object" else value, param)


def _from_guided(request: StructuredFields) -> StructuredOutput | None:
    fields = {
        "guided_json": ("json", request.guided_json),
        "guided_regex": ("regex", request.guided_regex),
        "guided_choice": ("choice", request.guided_choice),
        "guided_grammar": ("grammar", request.guided_grammar),
    }
    given = [(name, kind, v) for name, (kind, v) in fields.items() if v is not None]
    if not given:
        return None
    if len(given) > 1:
        raise invalid_request("Give at most one 'guided_*' field", given[1][0])
    name, kind, value = given[0]
    extra = StructuredOutputs.model_validate({kind: value})
    return _from_structured_outputs(extra, name)
