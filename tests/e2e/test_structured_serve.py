"""Structured output and tools over HTTP against the REAL engine (``verifypd serve --model
default --spec ngram``, CPU) with the official ``openai`` client and LangChain's ``ChatOpenAI``:
JSON schemas validate, bad schemas are 400s naming their field, forced tool calls (named and
``required``, streamed and not) carry arguments that validate against the tool's parameters."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

sys.path.insert(0, str(Path(__file__).parents[1] / "serve"))

from server_utils import ServerProcess, start_server_process, verifypd_serve_command  # noqa: E402

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
CITY_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "population": {"type": "integer", "minimum": 0, "maximum": 100},
    },
    "required": ["city", "population"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 16},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Current time in a timezone",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}},
            "required": ["zone"],
        },
    },
}
TOOLS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    cmd = verifypd_serve_command(
        "--model", "default", "--device", "cpu", "--spec", "ngram", "--max-model-len", "1024"
    )
    with start_server_process(cmd, timeout=180) as proc:
        yield proc
        assert proc.stop(timeout=30) == 0


@pytest.fixture
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def _chat(client: openai.OpenAI, **kw):
    return client.chat.completions.create(
        **{"model": MODEL, "temperature": 0, "max_tokens": 60, **kw}
    )


def _validate_call(name: str, arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), TOOLS[name]["function"]["parameters"])


def test_response_format_json_schema_validates(client):
    rf = {
        "type": "json_schema",
        "json_schema": {"name": "city", "schema": CITY_SCHEMA, "strict": True},
    }
    resp = _chat(client, messages=ASK, response_format=rf)
    jsonschema.validate(json.loads(resp.choices[0].message.content), CITY_SCHEMA)
    assert resp.choices[0].finish_reason == "stop"
    stream = _chat(client, messages=ASK, response_format=rf, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == resp.choices[0].message.content  # greedy: the same output streamed


def test_completions_structured_outputs_regex(client):
    resp = client.completions.create(
        model=MODEL,
        prompt="My phone number is",
        max_tokens=20,
        temperature=0,
        extra_body={"structured_outputs": {"regex": r"\+33 [0-9]{2} [0-9]{2}"}},
    )
    assert resp.choices[0].text.startswith("+33 ") and len(resp.choices[0].text) == 9


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "wizard"}},
                }
            },
            "response_format",
        ),  # noqa: E501
        ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs"),
        ({"structured_outputs": {"grammar": "root ::= "}}, "structured_outputs"),
        ({"guided_json": '{"type": '}, "guided_json"),
    ],
)
def test_invalid_constraint_is_a_400_naming_the_field(client, body, param):
    with pytest.raises(openai.BadRequestError) as err:
        _chat(client, messages=ASK, extra_body=body)
    assert err.value.body["param"] == param
    assert _chat(client, messages=ASK, max_completion_tokens=2).choices  # still serving


def _stream_tool_calls(client, **kw) -> tuple[list[dict], str]:
    calls: dict[int, dict] = {}
    reason = None
    for chunk in _chat(client, stream=True, **kw):
        for choice in chunk.choices:
            for d in choice.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"name": "", "arguments": "", "id": None})
                call["id"] = call["id"] or d.id
                call["name"] += d.function.name or ""
                call["arguments"] += d.function.arguments or ""
            reason = choice.finish_reason or reason
    return [calls[i] for i in sorted(calls)], reason


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["named", "required"])
def test_forced_tool_calls_validate(client, choice, stream):
    tool_choice = (
        {"type": "function", "function": {"name": "get_weather"}} if choice == "named" else choice
    )
    kw = {"messages": ASK, "tools": [WEATHER, TIME], "tool_choice": tool_choice}
    if stream:
        calls, reason = _stream_tool_calls(client, **kw)
    else:
        resp = _chat(client, **kw)
        msg, reason = resp.choices[0].message, resp.choices[0].finish_reason
        assert msg.content is None
        calls = [
            {"name": c.function.name, "arguments": c.function.arguments, "id": c.id}
            for c in msg.tool_calls
        ]
    assert reason == "tool_calls" and len(calls) == 1
    assert calls[0]["id"].startswith("call_")
    if choice == "named":
        assert calls[0]["name"] == "get_weather"
    _validate_call(calls[0]["name"], calls[0]["arguments"])


def test_history_with_tool_messages_is_served(client):
    """The tool call and its result reach the prompt; with tools "auto" the tools do too."""
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
    }
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    ]
    plain = _chat(client, messages=ASK, max_tokens=1).usage.prompt_tokens
    history = _chat(client, messages=messages, tools=[WEATHER], tool_choice="none", max_tokens=1)
    with_tools = _chat(client, messages=messages, tools=[WEATHER], max_tokens=1)
    assert history.choices[0].finish_reason == "length"
    assert history.usage.prompt_tokens > plain + 30  # the call and the result
    assert with_tools.usage.prompt_tokens > history.usage.prompt_tokens + 60  # the tools


# -- LangChain ------------------------------------------------------------------------------
class City(BaseModel):
    """A city and its population in millions."""

    city: str = Field(max_length=12)
    population: int = Field(ge=0, le=100)


def _langchain(server: ServerProcess):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(
        base_url=server.url + "/v1",
        api_key="unused",
        model=MODEL,
        temperature=0,
        max_tokens=60,
        max_retries=0,
        timeout=300,
    )


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output(server, method):
    llm = _langchain(server).with_structured_output(City, method=method)
    city = llm.invoke("Name a big city and its population in millions.")
    assert isinstance(city, City)


def test_langchain_bind_tools_with_tool_choice(server):
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str, unit: str) -> str:
        """Current weather in a city; unit is celsius or fahrenheit."""
        return "sunny"

    llm = _langchain(server).bind_tools([get_weather], tool_choice="get_weather")
    msg = llm.invoke("What is the weather in Paris?")
    assert [c["name"] for c in msg.tool_calls] == ["get_weather"]
    assert set(msg.tool_calls[0]["args"]) == {"city", "unit"}
    chunks = list(llm.stream("What is the weather in Rome?"))
    merged = chunks[0]
    for c in chunks[1:]:
        merged += c
    assert [c["name"] for c in merged.tool_calls] == ["get_weather"]
