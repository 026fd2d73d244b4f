"""Pydantic v2 models of the OpenAI request bodies, and their translation to SamplingParams.

Validation is strict (no "1" -> 1 coercion): a wrong type or an out-of-range value is a 400
whose ``param`` names the field. Unknown fields are ignored; known OpenAI features that
verifypd does not implement (legacy `functions`, ...) are accepted only at their defaults
and rejected with a 400 otherwise, never silently ignored.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from verifypd.sampling_params import INT64_MAX, INT64_MIN
from verifypd.serve.errors import APIError, invalid_request
from verifypd.serve.structured import StructuredFields, structured_output
from verifypd.serve.tools import ToolChoice, ToolDef, ToolPlan, tool_plan
from verifypd.types import ParamError, SamplingParams, StructuredOutput

MAX_STOP = 4
MAX_TOP_LOGPROBS = 20  # OpenAI's bound for chat top_logprobs
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions

TokenId = Annotated[int, Field(ge=0)]
StopList = Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=MAX_STOP)]

# How a field should look, appended to type errors of fields with union types.
FIELD_HINTS = {
    "prompt": "a string, a list of strings, a list of token ids or a list of token-id lists",
    "stop": f"a non-empty string or a list of at most {MAX_STOP} non-empty strings",
    "messages": "a non-empty list of {role, content} objects with text content",
}


class _Strict(BaseModel):
    # No NaN/Infinity (JSON has neither; a lenient parser would let them past the bounds).
    model_config = ConfigDict(
        strict=True, extra="ignore", populate_by_name=True, allow_inf_nan=False
    )


class StreamOptions(_Strict):
    include_usage: bool | None = None


class _SamplingFields(StructuredFields):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    # Fields that are only accepted at one of these (default) values.
    UNSUPPORTED: ClassVar[dict[str, tuple[Any, ...]]] = {}

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)
    n: int | None = Field(default=None, ge=1)  # at most ServeLimits.max_n (serve/limits.py)
    stop: Annotated[str, Field(min_length=1)] | StopList | None = None
    stop_token_ids: list[TokenId] | None = None
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    priority: int | None = None  # verifypd extension: higher first; ServeLimits.max_priority
    ignore_eos: bool | None = None
    user: str | None = None  # accepted and ignored
    # Sampling controls (OpenAI's, and vLLM's extra ones).
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    repetition_penalty: float | None = Field(default=None, gt=0)
    min_tokens: int | None = Field(default=None, ge=0)
    bad_words: list[str] | None = None
    include_stop_str_in_output: bool | None = None
    # vLLM's extension: the output's token ids beside its text (``token_ids`` per choice, per
    # chunk when streaming) and the prompt's (``prompt_token_ids``, once per choice)
    return_token_ids: bool | None = None
    # verifypd extension, benchmark only: this request's synthetic acceptance alpha (400 on a
    # server not started with --synthetic-acceptance).
    synthetic_acceptance: float | None = Field(default=None, ge=0, le=1)
    # vLLM's extension: prefix-cache blocks are shared only between requests with this salt
    cache_salt: str | None = None

    @property
    def is_stream(self) -> bool:
        return bool(self.stream)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens


class CompletionRequest(_SamplingFields):
    UNSUPPORTED: ClassVar[dict[str, tuple[Any, ...]]] = {
        **_SamplingFields.UNSUPPORTED,
        "suffix": (None, ""),
    }

    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    max_tokens: int | None = Field(default=None, ge=0)  # 0 only with echo (scoring)
    logprobs: int | None = Field(default=None, ge=0)  # top-N; the max is the server's
    echo: bool | None = None
    suffix: Any = None
    best_of: int | None = Field(default=None, ge=1)


class ContentPart(_Strict):
    type: str
    text: str | None = None


class FunctionCall(_Strict):
    name: str
    arguments: str


class ToolCallMessage(_Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallMessage] | None = None  # assistant turns that called tools
    tool_call_id: str | None = None  # tool results


class ChatCompletionRequest(_SamplingFields):
    UNSUPPORTED: ClassVar[dict[str, tuple[Any, ...]]] = {
        **_SamplingFields.UNSUPPORTED,
        "functions": (None, []),
        "function_call": (None, "none", "auto"),
    }

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None
    functions: Any = None
    function_call: Any = None
    parallel_tool_calls: bool | None = None  # accepted and ignored

    @property
    def requested_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens


def parse_request(model_cls: type[_SamplingFields], body: bytes) -> Any:
    """Validate a raw JSON body into ``model_cls``; any problem becomes a 400 APIError."""
    try:
        request = model_cls.model_validate_json(body)
    except ValidationError as exc:
        raise _to_api_error(exc) from None
    check_unsupported(request)
    _check_cross_fields(request)
    return request


def _to_api_error(exc: ValidationError) -> APIError:
    errors = exc.errors()
    first = errors[0]
    if first["type"] == "json_invalid":
        return invalid_request(f"Malformed JSON body: {first['msg']}")
    if not first["loc"]:
        return invalid_request(f"Request body must be a JSON object: {first['msg']}")
    param = str(first["loc"][0])
    same_field = [e for e in errors if e["loc"] and str(e["loc"][0]) == param]
    # Prefer a value error (too long, out of range) over "wrong union member" type errors.
    best = next((e for e in same_field if not e["type"].endswith("_type")), same_field[0])
    message = f"Invalid value for '{_location(best['loc'])}': {best['msg']}"
    if param in FIELD_HINTS:
        message += f" (expected {FIELD_HINTS[param]})"
    return invalid_request(message, param)


def _location(loc: tuple) -> str:
    """('messages', 0, 'role') -> "messages[0].role"; union member tags are left out."""
    parts = [str(loc[0])]
    for part in loc[1:]:
        if isinstance(part, int):
            parts.append(f"[{part}]")
        elif part.isidentifier() and part not in _TYPE_TAGS and not part[0].isupper():
            parts.append(f".{part}")
    return "".join(parts)


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def check_unsupported(request: _SamplingFields) -> None:
    """Reject non-default values of OpenAI features that verifypd does not implement."""
    for name, allowed in request.UNSUPPORTED.items():
        if not _is_allowed(getattr(request, name), allowed):
            raise invalid_request(f"'{name}' is not supported by this server", name)


def _is_allowed(value: Any, allowed: tuple[Any, ...]) -> bool:
    # bool is an int subclass: keep `false` and `0` apart.
    return any(value == ok and isinstance(value, bool) == isinstance(ok, bool) for ok in allowed)


def _check_cross_fields(request: _SamplingFields) -> None:
    if request.stream_options is not None and not request.stream:
        raise invalid_request(
            "'stream_options' is only allowed when 'stream' is true", "stream_options"
        )
    _check_logprob_fields(request)
    best_of = getattr(request, "best_of", None)
    if best_of is not None and best_of != (request.n or 1):
        raise invalid_request("'best_of' other than n is not supported by this server", "best_of")


def _check_logprob_fields(request: _SamplingFields) -> None:
    if isinstance(request, CompletionRequest) and request.max_tokens == 0 and not request.echo:
        raise invalid_request("'max_tokens' may be 0 only with 'echo' (scoring)", "max_tokens")
    if isinstance(request, ChatCompletionRequest) and request.top_logprobs and not request.logprobs:
        raise invalid_request("'top_logprobs' needs 'logprobs' set to true", "top_logprobs")


def completion_prompts(request: CompletionRequest) -> list[str | list[int]]:
    """The prompts of a completion request, each text or token ids."""
    prompt = request.prompt
    if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
        prompts = [prompt]
    else:
        prompts = list(prompt)
    if any(len(p) == 0 for p in prompts):
        raise invalid_request("'prompt' must not be empty", "prompt")
    return prompts


def chat_messages(request: ChatCompletionRequest) -> list[dict[str, Any]]:
    """Messages as {role, content} dicts for ``tokenizer.apply_chat_template`` (with
    ``tool_calls``, ``tool_call_id`` and ``name`` where given, in the shape HF templates read:
    arguments as a dict)."""
    return [_template_message(m) for m in request.messages]


def _template_message(m: ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"role": _template_role(m.role), "content": _message_text(m)}
    if m.tool_calls:
        out["tool_calls"] = [
            {"id": c.id, "type": "function",
             "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
            for c in m.tool_calls
        ]  # fmt: skip
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.name is not None and m.role == "tool":
        out["name"] = m.name
    return out


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def chat_tool_plan(request: ChatCompletionRequest) -> ToolPlan:
    return tool_plan(request.tools, request.tool_choice)


def output_constraint(request: _SamplingFields, tools: ToolPlan | None) -> StructuredOutput | None:
    """The grammar of the request's output: a forced tool call's, or its structured output."""
    structured = structured_output(request)
    forced = tools.constraint() if tools is not None else None
    if forced is not None and structured is not None:
        raise invalid_request(
            f"'{structured.param}' cannot be combined with tool_choice '{tools.mode}'",
            structured.param,
        )
    return forced or structured


def _template_role(role: str) -> str:
    return "system" if role == "developer" else role


def _message_text(message: ChatMessage) -> str:
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        return message.content
    for part in message.content:
        if part.type != "text" or part.text is None:
            raise invalid_request(
                f"Content parts of type '{part.type}' are not supported (text only)", "messages"
            )
    return "".join(part.text or "" for part in message.content)


def to_sampling_params(
    request: _SamplingFields, max_tokens: int, structured: StructuredOutput | None = None
) -> SamplingParams:
    """Build engine SamplingParams; a ParamError from its own checks becomes a 400."""
    stop = (
        request.stop if isinstance(request.stop, list) else [request.stop] if request.stop else []
    )
    kwargs: dict[str, Any] = {
        "max_tokens": max_tokens,
        "temperature": 1.0 if request.temperature is None else request.temperature,
        "top_p": 1.0 if request.top_p is None else request.top_p,
        "top_k": request.top_k or 0,
        "seed": request.seed,
        "stop": list(stop),
        "stop_token_ids": list(request.stop_token_ids or []),
        "ignore_eos": bool(request.ignore_eos),
        "n": request.n or 1,
        "priority": request.priority or 0,
        "synthetic_acceptance": request.synthetic_acceptance,
        "cache_salt": request.cache_salt,
        **_sampling_controls(request),
        **_logprob_kwargs(request),
        "structured": structured,
    }
    try:
        return SamplingParams(**kwargs)
    except ParamError as err:
        raise invalid_request(str(err), err.param) from None


def _sampling_controls(request: _SamplingFields) -> dict[str, Any]:
    """Penalties, logit_bias, min_tokens, bad_words and include_stop_str_in_output, where set."""
    names = ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens",
             "bad_words", "include_stop_str_in_output")  # fmt: skip
    controls = {name: getattr(request, name) for name in names}
    controls["logit_bias"] = _logit_bias(request.logit_bias)
    return {name: value for name, value in controls.items() if value is not None}


def _logit_bias(logit_bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI sends token ids as JSON object keys (strings)."""
    if not logit_bias:
        return None
    try:
        return {int(token): bias for token, bias in logit_bias.items()}
    except ValueError:
        raise invalid_request("'logit_bias' keys must be token ids", "logit_bias") from None


def _logprob_kwargs(request: _SamplingFields) -> dict[str, int | None]:
    """Completions: ``logprobs`` N for the output (and the prompt with ``echo``); chat:
    ``logprobs`` true with ``top_logprobs`` N."""
    if isinstance(request, ChatCompletionRequest):
        return {"logprobs": (request.top_logprobs or 0) if request.logprobs else None}
    if isinstance(request, CompletionRequest):
        n = request.logprobs
        return {"logprobs": n, "prompt_logprobs": n if request.echo else None}
    return {}
