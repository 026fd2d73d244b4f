"""Tool calling: ``tools`` + ``tool_choice`` (OpenAI / vLLM shapes).

- ``none``: tools are left out of the prompt; plain content.
- ``auto``: tools are rendered into the prompt (by the chat template when it knows tools, else
  as a Hermes-style system prompt, the format SmolLM2 and Qwen are trained on) and the output
  is parsed for ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks.
- a named function: the output is constrained to that function's parameter schema and is
  its ``arguments``.
- ``required``: the output is constrained to ``{"name": <one of the tools>, "arguments":
  <its parameter schema>}``.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from verifypd.serve.errors import invalid_request
from verifypd.serve.structured import json_schema_output
from verifypd.types import StructuredOutput

ANY_OBJECT = {"type": "object"}
_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)


class FunctionDef(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(_Strict):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


@dataclass(frozen=True)
class ToolPlan:
    """How one chat request uses its tools: the mode, the named function, the tools."""

    mode: Literal["none", "auto", "required", "named"]
    tools: tuple[ToolDef, ...]
    name: str | None = None

    @property
    def renders_tools(self) -> bool:
        return self.mode != "none" and bool(self.tools)

    def constraint(self) -> StructuredOutput | None:
        """The output grammar for ``named`` and ``required``; None otherwise."""
        if self.mode == "named":
            return json_schema_output(_parameters(self._tool(self.name)), "tool_choice")
        if self.mode == "required":
            options = [_call_schema(t) for t in self.tools]
            schema = options[0] if len(options) == 1 else {"anyOf": options}
            return json_schema_output(schema, "tool_choice")
        return None

    def _tool(self, name: str | None) -> ToolDef:
        return next(t for t in self.tools if t.function.name == name)

    def parse(self, text: str) -> tuple[str | None, list[dict]]:
        """(content, tool_calls) of a finished output; no calls -> (text, [])."""
        if self.mode == "named":
            return None, [tool_call(self.name or "", text)]
        if self.mode == "required":
            call = _loads(text)
            if isinstance(call, dict) and "name" in call:
                return None, [tool_call(call["name"], _dumps(call.get("arguments", {})))]
            return text, []
        if self.mode == "auto" and self.tools:
            return parse_hermes(text)
        return text, []


def tool_plan(tools: list[ToolDef] | None, choice: ToolChoice | None) -> ToolPlan:
    """Checks ``tool_choice`` against ``tools`` (a 400 naming the field when they disagree)."""
    tools = tuple(tools or ())
    if choice is None:
        choice = "auto" if tools else "none"
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if not any(t.function.name == name for t in tools):
            msg = f"tool_choice names '{name}', which is not in 'tools'"
            raise invalid_request(msg, "tool_choice")
        return ToolPlan("named", tools, name)
    if choice == "required" and not tools:
        raise invalid_request("tool_choice 'required' needs a non-empty 'tools'", "tool_choice")
    return ToolPlan(choice, tools)


def _parameters(tool: ToolDef) -> dict:
    return tool.function.parameters or ANY_OBJECT


def _call_schema(tool: ToolDef) -> dict:
    return {
        "type": "object",
        "properties": {"name": {"const": tool.function.name}, "arguments": _parameters(tool)},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def tool_call(name: str, arguments: str) -> dict:
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def parse_hermes(text: str) -> tuple[str | None, list[dict]]:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks; text outside them
    is the content (None when empty). A block that is not such JSON stays content."""
    calls, spans = [], []
    for m in _TOOL_CALL.finditer(text):
        call = _loads(m.group(1))
        if isinstance(call, dict) and isinstance(call.get("name"), str):
            args = call.get("arguments", call.get("parameters", {}))
            calls.append(tool_call(call["name"], _dumps(args)))
            spans.append(m.span())
    if not calls:
        return text, []
    starts = [0] + [end for _, end in spans]
    ends = [start for start, _ in spans] + [len(text)]
    content = "".join(text[a:b] for a, b in zip(starts, ends, strict=True))
    return content.strip() or None, calls


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _dumps(args: Any) -> str:
    return args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


# ----------------------------------------------------------------------------- prompt side
def tools_for_template(plan: ToolPlan) -> list[dict] | None:
    """The ``tools=`` argument of ``apply_chat_template``: OpenAI tool dicts."""
    if not plan.renders_tools:
        return None
    return [t.model_dump(exclude_none=True) for t in plan.tools]


def template_knows_tools(tokenizer: Any) -> bool:
    template = getattr(tokenizer, "chat_template", None) or ""
    return isinstance(template, str) and "tools" in template


def hermes_system_prompt(tools: list[dict]) -> str:
    """What Qwen2.5's template writes for tools, for templates that write nothing."""
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{lines}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments "
        "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def render_without_tool_support(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """Messages for a template that ignores tools and tool calls: the tools go into the system
    message, an assistant's tool calls into its content as ``<tool_call>`` blocks and a tool
    result into ``<tool_response>`` tags."""
    out = [_plain_message(m) for m in messages]
    if tools:
        prompt = hermes_system_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _plain_message(m: dict) -> dict:
    content = m.get("content") or ""
    if m.get("tool_calls"):
        blocks = [
            "<tool_call>\n"
            + json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]})
            + "\n</tool_call>"
            for c in m["tool_calls"]
        ]
        content = "\n".join([content, *blocks]).strip()
    if m["role"] == "tool":
        content = f"<tool_response>\n{content}\n</tool_response>"
    return {"role": m["role"], "content": content}
