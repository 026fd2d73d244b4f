"""OpenAI response bodies and SSE chunk shapes, built from engine RequestOutput deltas.

Completions stream ``text_completion`` chunks; chat streams ``chat.completion.chunk`` chunks
(a role delta first, content deltas, then an empty delta carrying finish_reason). With
``stream_options.include_usage`` every chunk carries ``"usage": null`` and one last chunk
with ``"choices": []`` carries the usage.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from verifypd.serve.logprobs import ChoiceExtras, ChoiceLogprobs
from verifypd.types import RequestOutput, RequestTiming

Kind = Literal["completion", "chat"]
OBJECTS = {"completion": "text_completion", "chat": "chat.completion"}
CHUNK_OBJECTS = {"completion": "text_completion", "chat": "chat.completion.chunk"}
ID_PREFIXES = {"completion": "cmpl", "chat": "chatcmpl"}


@dataclass(frozen=True)
class ResponseMeta:
    """What every chunk of one response shares: id, created, model."""

    kind: Kind
    model: str
    id: str = ""
    created: int = 0
    include_usage: bool = False
    extras: ChoiceExtras | None = field(default=None, compare=False)  # echo, log-probs
    tools: Any = None  # a ``serve.tools.ToolPlan`` whose output is parsed for tool calls
    # ``return_token_ids``: the request's prompts (choice i's is prompts[i // n_per_prompt]);
    # None: token ids not asked for
    prompts: list[list[int]] | None = field(default=None, compare=False)
    n_per_prompt: int = 1
    timing: RequestTiming | None = field(default=None, compare=False)  # --log-request-timing

    @classmethod
    def new(
        cls,
        kind: Kind,
        model: str,
        include_usage: bool = False,
        extras: ChoiceExtras | None = None,
        tools: Any = None,
        prompts: list[list[int]] | None = None,
        n_per_prompt: int = 1,
    ) -> ResponseMeta:
        rid = f"{ID_PREFIXES[kind]}-{uuid.uuid4().hex}"
        return cls(
            kind, model, rid, int(time.time()), include_usage, extras, tools, prompts, n_per_prompt
        )

    def prompt_ids(self, index: int) -> list[int]:
        assert self.prompts is not None
        return self.prompts[index // self.n_per_prompt]

    def head(self, chunk: bool) -> dict:
        obj = (CHUNK_OBJECTS if chunk else OBJECTS)[self.kind]
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}


@dataclass
class OutputCollector:
    """Accumulates deltas of all ``n`` choices of one request (of every prompt of it, with
    ``n_per_prompt`` choices each: prompt tokens are counted once per prompt)."""

    n: int
    texts: list[list[str]] = field(default_factory=list)
    finish_reasons: list[str | None] = field(default_factory=list)
    num_output_tokens: list[int] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    n_per_prompt: int = 0  # 0: n (one prompt)
    logprobs: list[ChoiceLogprobs] = field(default_factory=list)
    token_ids: list[list[int]] = field(default_factory=list)
    _prompt_tokens: dict[int, tuple[int, int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.texts = [[] for _ in range(self.n)]
        self.token_ids = [[] for _ in range(self.n)]
        self.finish_reasons = [None] * self.n
        self.num_output_tokens = [0] * self.n
        self.logprobs = [ChoiceLogprobs() for _ in range(self.n)]
        self.n_per_prompt = self.n_per_prompt or self.n

    def add(self, out: RequestOutput) -> None:
        self.texts[out.index].append(out.new_text)
        self.token_ids[out.index].extend(out.new_token_ids)
        self.logprobs[out.index].add(out)
        self.num_output_tokens[out.index] = max(
            self.num_output_tokens[out.index], out.num_output_tokens
        )
        prompt = out.index // self.n_per_prompt
        old = self._prompt_tokens.get(prompt, (0, 0))
        self._prompt_tokens[prompt] = (
            max(old[0], out.num_prompt_tokens),
            max(old[1], out.num_cached_tokens),
        )
        self.num_prompt_tokens = sum(p for p, _ in self._prompt_tokens.values())
        self.num_cached_tokens = sum(c for _, c in self._prompt_tokens.values())
        if out.finished:
            self.finish_reasons[out.index] = out.finish_reason or "stop"

    @property
    def all_finished(self) -> bool:
        return all(reason is not None for reason in self.finish_reasons)

    def text(self, index: int) -> str:
        return "".join(self.texts[index])

    def usage(self) -> dict:
        completion = sum(self.num_output_tokens)
        return {
            "prompt_tokens": self.num_prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.num_prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": self.num_cached_tokens},
        }


def _chunk(meta: ResponseMeta, choices: list[dict]) -> dict:
    body = {**meta.head(chunk=True), "choices": choices}
    if meta.include_usage:
        body["usage"] = None
    return body


def text_chunk(meta: ResponseMeta, index: int, text: str) -> dict:
    """A content delta (finish_reason null)."""
    if meta.kind == "chat":
        return _chunk(meta, [_chat_choice(index, {"content": text}, None)])
    return _chunk(meta, [_completion_choice(index, text, None)])


def delta_chunk(meta: ResponseMeta, out: RequestOutput, sent_chars: int | None) -> dict | None:
    """A delta's chunk with its echo and log-probs (``meta.extras``) and, when asked for, its
    token ids; ``sent_chars``: the characters of this choice already sent (None: nothing yet,
    this is its first chunk). None when the delta has nothing to send."""
    chunk = _delta_chunk(meta, out, sent_chars)
    if meta.prompts is None:
        return chunk
    if chunk is None:
        if not out.new_token_ids:
            return None
        chunk = text_chunk(meta, out.index, "")  # tokens whose text is held back
    return with_token_ids(meta, chunk, out.index, out.new_token_ids, sent_chars is None)


def with_token_ids(
    meta: ResponseMeta, chunk: dict, index: int, token_ids: list[int], first: bool
) -> dict:
    """vLLM's ``return_token_ids`` fields on a chunk of choice ``index``: its ``token_ids``,
    and on the choice's first chunk the prompt's ids (on the choice for completions, on the
    chunk for chat, as vLLM places them)."""
    choice = chunk["choices"][0]
    choice["token_ids"] = list(token_ids)
    if first:
        if meta.kind == "chat":
            chunk["prompt_token_ids"] = meta.prompt_ids(index)
        else:
            choice["prompt_token_ids"] = meta.prompt_ids(index)
    return chunk


def _delta_chunk(meta: ResponseMeta, out: RequestOutput, sent_chars: int | None) -> dict | None:
    extras = meta.extras
    if extras is None:
        return text_chunk(meta, out.index, out.new_text) if out.new_text else None
    if meta.kind == "chat":
        logprobs = extras.chat_logprobs(out.logprobs or [])
        if not out.new_text and not (logprobs and logprobs["content"]):
            return None
        return _chunk(meta, [_chat_choice(out.index, {"content": out.new_text}, None, logprobs)])
    text = extras.completion_text(out.index, out.new_text, first=sent_chars is None)
    logprobs = extras.completion_logprobs(out.index, ChoiceLogprobs.of(out), sent_chars or 0)
    if not text and not (logprobs and logprobs["tokens"]):
        return None
    return _chunk(meta, [_completion_choice(out.index, text, None, logprobs)])


def finish_chunk(meta: ResponseMeta, index: int, finish_reason: str) -> dict:
    """The closing chunk of one choice: empty delta / empty text plus finish_reason."""
    if meta.kind == "chat":
        return _chunk(meta, [_chat_choice(index, {}, finish_reason)])
    return _chunk(meta, [_completion_choice(index, "", finish_reason)])


def role_chunk(meta: ResponseMeta, index: int) -> dict:
    """Chat only: the first chunk of each choice announces the assistant role."""
    return _chunk(meta, [_chat_choice(index, {"role": "assistant", "content": ""}, None)])


def tool_call_chunk(meta: ResponseMeta, index: int, calls: list[dict]) -> dict:
    """Chat only: one choice's tool calls as one ``delta.tool_calls`` chunk (each call whole,
    with its ``index`` among the choice's calls)."""
    delta = {"tool_calls": [{"index": i, **call} for i, call in enumerate(calls)]}
    return _chunk(meta, [_chat_choice(index, delta, None)])


def tool_finish_reason(reason: str, calls: list[dict]) -> str:
    """``tool_calls`` when the output was complete tool calls, else the engine's reason."""
    return "tool_calls" if calls and reason == "stop" else reason


def usage_chunk(meta: ResponseMeta, usage: dict) -> dict:
    return {**meta.head(chunk=True), "choices": [], "usage": usage}


def full_response(meta: ResponseMeta, collected: OutputCollector) -> dict:
    """The non-streaming body with every choice and the usage."""
    choices = [_full_choice(meta, i, collected) for i in range(collected.n)]
    body = {**meta.head(chunk=False), "choices": choices, "usage": collected.usage()}
    if meta.prompts is not None:  # vLLM's return_token_ids
        for i, choice in enumerate(choices):
            choice["token_ids"] = collected.token_ids[i]
            if meta.kind == "completion":
                choice["prompt_token_ids"] = meta.prompt_ids(i)
        if meta.kind == "chat":
            body["prompt_token_ids"] = meta.prompts[0]
    return body


def _full_choice(meta: ResponseMeta, index: int, collected: OutputCollector) -> dict:
    text, reason = collected.text(index), collected.finish_reasons[index]
    extras, logprobs = meta.extras, None
    if meta.kind == "chat":
        if extras is not None:
            logprobs = extras.chat_logprobs(collected.logprobs[index].logprobs)
        message: dict = {"role": "assistant", "content": text}
        if meta.tools is not None:
            content, calls = meta.tools.parse(text)
            message = {"role": "assistant", "content": content, "tool_calls": calls}
            reason = tool_finish_reason(reason, calls)
        return _chat_choice(index, message, reason, logprobs, key="message")
    if extras is not None:
        text = extras.completion_text(index, text, first=True)
        logprobs = extras.completion_logprobs(index, collected.logprobs[index], 0)
    return _completion_choice(index, text, reason, logprobs)


def _chat_choice(
    index: int, delta: dict, finish_reason: str | None, logprobs=None, key: str = "delta"
) -> dict:
    return {"index": index, key: delta, "logprobs": logprobs, "finish_reason": finish_reason}


def _completion_choice(index: int, text: str, finish_reason: str | None, logprobs=None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
