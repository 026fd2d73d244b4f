"""Request translation of structured output and tools (serve.structured, serve.tools): which
engine constraint a request gets, tool-call parsing, the response shapes, and how tool
history renders through the chat template (the embedded SmolLM2 tokenizer, which knows no
tools, and a template that does)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from verifypd.engine.tokenizer import load_tokenizer
from verifypd.serve.errors import APIError
from verifypd.serve.openai_api import encode_chat
from verifypd.serve.protocol import OutputCollector, ResponseMeta, full_response, tool_call_chunk
from verifypd.serve.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_messages,
    chat_tool_plan,
    output_constraint,
    parse_request,
)
from verifypd.serve.tools import parse_hermes
from verifypd.types import RequestOutput

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}
USER = [{"role": "user", "content": "hi"}]


def _chat(**body) -> ChatCompletionRequest:
    return parse_request(ChatCompletionRequest, json.dumps({"messages": USER, **body}).encode())


def _constraint(**body):
    request = _chat(**body)
    return output_constraint(request, chat_tool_plan(request))


@pytest.mark.parametrize(
    ("body", "kind", "param"),
    [
        ({"response_format": {"type": "json_object"}}, "json_object", "response_format"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "object"}},
                }
            },
            "json",
            "response_format",
        ),  # noqa: E501
        ({"structured_outputs": {"regex": "a+"}}, "regex", "structured_outputs"),
        ({"structured_outputs": {"choice": ["a", "b"]}}, "choice", "structured_outputs"),
        ({"structured_outputs": {"grammar": 'root ::= "a"'}}, "grammar", "structured_outputs"),
        ({"structured_outputs": {"json": {"type": "string"}}}, "json", "structured_outputs"),
        ({"guided_json": {"type": "string"}}, "json", "guided_json"),
        ({"guided_choice": ["a"]}, "choice", "guided_choice"),
        ({"tools": [WEATHER], "tool_choice": "required"}, "json", "tool_choice"),
        (
            {
                "tools": [WEATHER],
                "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            },
            "json",
            "tool_choice",
        ),  # noqa: E501
    ],
)
def test_each_field_becomes_one_engine_constraint(body, kind, param):
    so = _constraint(**body)
    assert (so.kind, so.param) == (kind, param)


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"response_format": {"type": "text"}},
        {"tools": [WEATHER]},
        {"tools": [WEATHER], "tool_choice": "none"},
        {"tools": [WEATHER], "tool_choice": "auto"},
    ],
)
def test_no_constraint_without_a_structured_field_or_forced_tool(body):
    assert _constraint(**body) is None


def test_required_tool_schema_accepts_exactly_the_tools_calls():
    schema = json.loads(_constraint(tools=[WEATHER, TIME], tool_choice="required").spec)
    jsonschema.validate({"name": "get_weather", "arguments": {"city": "Rome"}}, schema)
    jsonschema.validate({"name": "get_time", "arguments": {}}, schema)
    for bad in ({"name": "get_weather", "arguments": {}}, {"name": "nope", "arguments": {}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


def test_two_constraints_at_once_is_a_400():
    with pytest.raises(APIError) as err:
        _constraint(
            tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}
        )
    assert err.value.param == "response_format"
    completion = parse_request(
        CompletionRequest,
        json.dumps(
            {"prompt": "x", "guided_regex": "a", "structured_outputs": {"regex": "b"}}
        ).encode(),
    )
    with pytest.raises(APIError):
        output_constraint(completion, None)


def test_parse_hermes_tool_calls_and_content():
    text = (
        'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    )
    content, calls = parse_hermes(text)
    assert content == "Sure."
    assert [c["function"] for c in calls] == [
        {"name": "get_weather", "arguments": '{"city": "Rome"}'}
    ]
    assert parse_hermes("no calls <tool_call>not json</tool_call>") == (
        "no calls <tool_call>not json</tool_call>",
        [],
    )
    _, two = parse_hermes(
        '<tool_call>{"name": "a", "arguments": {}}</tool_call>'
        '<tool_call>{"name": "b", "parameters": {"x": 1}}'
    )
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in two] == [
        ("a", "{}"),
        ("b", '{"x": 1}'),
    ]


def _response(plan, text: str, reason: str = "stop") -> dict:
    meta = ResponseMeta.new("chat", "m", tools=plan)
    collected = OutputCollector(1)
    collected.add(RequestOutput("r", 0, [1], text, finished=True, finish_reason=reason))
    return full_response(meta, collected)["choices"][0]


def test_forced_tool_call_response_shape():
    named = chat_tool_plan(
        _chat(
            tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}
        )
    )
    choice = _response(named, '{"city": "Rome"}')
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Rome"}'}
    required = chat_tool_plan(_chat(tools=[WEATHER, TIME], tool_choice="required"))
    choice = _response(required, '{"name": "get_time", "arguments": {}}', "stop")
    assert choice["message"]["tool_calls"][0]["function"] == {"name": "get_time", "arguments": "{}"}
    auto = chat_tool_plan(_chat(tools=[WEATHER]))
    choice = _response(auto, "Just text.", "length")
    assert choice["message"] == {"role": "assistant", "content": "Just text.", "tool_calls": []}
    assert choice["finish_reason"] == "length"
    chunk = tool_call_chunk(
        ResponseMeta.new("chat", "m"), 0, [{"id": "c", "type": "function", "function": {}}]
    )
    assert chunk["choices"][0]["delta"]["tool_calls"][0]["index"] == 0


HISTORY = [
    {"role": "user", "content": "Weather in Rome?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
]


async def test_tool_history_renders_through_a_template_without_tools():
    tok = load_tokenizer("default")
    request = _chat(messages=HISTORY, tools=[WEATHER])
    ids = await encode_chat(tok, chat_messages(request), chat_tool_plan(request))
    text = tok.decode(ids)
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in text
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>' in text
    )
    assert "<|im_start|>tool\n<tool_response>\n21 C\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    none = _chat(messages=HISTORY, tools=[WEATHER], tool_choice="none")
    text = tok.decode(await encode_chat(tok, chat_messages(none), chat_tool_plan(none)))
    assert "<tools>" not in text and "<tool_call>" in text


class ToolTemplateTokenizer:
    """A tokenizer whose template renders tools itself: it must get them as ``tools=``."""

    chat_template = "{% for t in tools %}...{% endfor %}"

    def __init__(self) -> None:
        self.calls: list[tuple[list, dict]] = []

    def apply_chat_template(self, messages, **kw):
        self.calls.append((messages, kw))
        return "x"

    def encode(self, text, add_special_tokens=False):
        return [1]


async def test_a_template_that_knows_tools_gets_them_and_the_raw_history():
    tok = ToolTemplateTokenizer()
    request = _chat(messages=HISTORY, tools=[WEATHER])
    await encode_chat(tok, chat_messages(request), chat_tool_plan(request))
    ((messages, kw),) = tok.calls
    assert kw["tools"] == [WEATHER]
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Rome"}
    assert messages[2]["tool_call_id"] == "call_1"
