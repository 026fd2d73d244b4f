"""What the server refuses before any work: its limits (``ServeLimits``, a frozen config with
one CLI flag per field) and the checks that apply them.

Order of the checks on a generation request, cheapest first: the ``Content-Length`` header
(413, before the body is read), the body read itself (bounded in time: 408), the JSON schema
(400), the limits below (400, before tokenizing), the admission bound (429, before
tokenizing), then the token counts against the context and the KV pool (400).
"""

from __future__ import annotations

import argparse
import asyncio
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from verifypd.config import SchedulerConfig
from verifypd.engine import admission
from verifypd.serve.errors import APIError, Handler, invalid_request
from verifypd.types import ParamError

# A token of any real tokenizer spans far fewer characters than this (runs of spaces in code
# are the longest, a few dozen at most): a prompt longer than 32 characters per token of
# context can never fit, and is refused before it costs any tokenizing.
CHARS_PER_TOKEN_BOUND = 32


@dataclass(frozen=True)
class ServeLimits:
    """Per-request bounds the HTTP server enforces (see docs/api.md)."""

    max_request_bytes: int = 4 << 20  # body size; Content-Length above it: 413 at once
    request_read_timeout_s: float = 30.0  # headers, and then the body, must arrive within it
    max_prompt_chars: int | None = None  # None: CHARS_PER_TOKEN_BOUND x the context length
    max_n: int = 16  # n and best_of
    max_priority: int = 0  # priority must lie in [-max_priority, max_priority]

    def __post_init__(self) -> None:
        if self.max_request_bytes < 1 or self.max_n < 1 or self.max_priority < 0:
            raise ValueError("need max_request_bytes >= 1, max_n >= 1 and max_priority >= 0")
        if not self.request_read_timeout_s > 0:
            raise ValueError("request_read_timeout_s must be positive")
        if self.max_prompt_chars is not None and self.max_prompt_chars < 1:
            raise ValueError("max_prompt_chars must be positive")

    def prompt_chars(self, max_model_len: int) -> int:
        if self.max_prompt_chars is not None:
            return self.max_prompt_chars
        return CHARS_PER_TOKEN_BOUND * max_model_len


def check_request(
    body: Any, limits: ServeLimits, vocab_size: int | None, max_model_len: int
) -> None:
    """400 naming the field for any value outside the server's limits (no tokenizing)."""
    for name in ("n", "best_of"):
        value = getattr(body, name, None)
        if value is not None and value > limits.max_n:
            raise invalid_request(f"'{name}' must be at most {limits.max_n} (--max-n)", name)
    priority = body.priority or 0
    if abs(priority) > limits.max_priority:
        bound = limits.max_priority
        raise invalid_request(
            f"'priority' must lie in [-{bound}, {bound}] on this server (--max-priority)",
            "priority",
        )
    if vocab_size is not None:
        _check_vocab(body, vocab_size)
    _check_prompt_size(body, limits.prompt_chars(max_model_len), max_model_len)


def resolve_max_tokens(
    num_prompt: int,
    requested: int | None,
    max_model_len: int,
    param: str,
    max_tokens_param: str = "max_tokens",
) -> int:
    """max_tokens to use (None: the rest of the context); 400 when the request cannot fit:
    the engine's own rule (``admission.resolve_max_tokens``), answered before admission."""
    try:
        return admission.resolve_max_tokens(
            num_prompt, requested, max_model_len, param, max_tokens_param
        )
    except ParamError as err:
        raise invalid_request(str(err), err.param) from None


def _check_vocab(body: Any, vocab_size: int) -> None:
    if body.top_k is not None and body.top_k > vocab_size:
        raise invalid_request(
            f"'top_k' must be -1, 0 (off) or in [1, {vocab_size}] (the vocabulary)", "top_k"
        )
    checked = [("stop_token_ids", body.stop_token_ids), ("prompt", _prompt_ids(body)),
               ("logit_bias", _bias_ids(body))]  # fmt: skip
    for name, ids in checked:
        if ids and not 0 <= min(ids) <= max(ids) < vocab_size:
            raise invalid_request(f"'{name}' must hold token ids in [0, {vocab_size})", name)


def _bias_ids(body: Any) -> list[int]:
    """The token ids that ``logit_bias`` keys name (JSON object keys are strings)."""
    bias = getattr(body, "logit_bias", None)
    if not isinstance(bias, dict):
        return []
    return [int(k) for k in bias if isinstance(k, str) and k.lstrip("-").isdigit()]


def _prompt_ids(body: Any) -> list[int]:
    prompt = getattr(body, "prompt", None)
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        return prompt
    return []


def _check_prompt_size(body: Any, max_chars: int, max_model_len: int) -> None:
    """Text longer than ``max_chars`` (or more token ids than the context) is a 400 now,
    before tokenizing it would cost seconds of CPU."""
    num_ids = len(_prompt_ids(body))
    if num_ids:  # token ids: the context rule applies already (text: after tokenizing)
        resolve_max_tokens(num_ids, None, max_model_len, "prompt")
    param = "messages" if hasattr(body, "messages") else "prompt"
    if _num_chars(body) > max_chars:
        raise invalid_request(
            f"The prompt is longer than {max_chars} characters, more than the context of "
            f"{max_model_len} tokens can hold (--max-prompt-chars).",
            param,
        )


def _num_chars(body: Any) -> int:
    prompt = getattr(body, "prompt", None)
    if isinstance(prompt, str):
        return len(prompt)
    if isinstance(prompt, list):
        return sum(len(p) for p in prompt if isinstance(p, str))
    total = 0
    for message in getattr(body, "messages", None) or []:
        content = message.content
        parts = [content] if isinstance(content, str) else content or []
        total += sum(len(p if isinstance(p, str) else p.text or "") for p in parts)
    return total


async def read_body(request: web.Request, timeout_s: float) -> bytes:
    """The request body, or 408 when it does not arrive within ``timeout_s`` (slow clients)."""
    try:
        async with asyncio.timeout(timeout_s):
            return await request.read()
    except TimeoutError:
        raise APIError(
            408, f"The request body did not arrive within {timeout_s:g} s.", code="timeout"
        ) from None


def body_size_middleware(max_bytes: int) -> Any:
    """413 from the ``Content-Length`` header alone, before a byte of the body is read.
    (Chunked bodies are bounded while they are read: aiohttp's ``client_max_size``.)"""

    @web.middleware
    async def check_size(request: web.Request, handler: Handler) -> web.StreamResponse:
        length = request.content_length
        if length is not None and length > max_bytes:
            raise request_too_large(length, max_bytes)
        return await handler(request)

    return check_size


def request_too_large(size: int | None, max_bytes: int) -> APIError:
    given = "" if size is None else f" ({size} bytes)"
    message = f"The request body{given} is larger than {max_bytes} bytes (--max-request-bytes)."
    return APIError(413, message, code="request_too_large")


# flag, ServeLimits field, type, help (docs/api.md, "What the server refuses")
LIMIT_FLAGS = (
    ("--max-request-bytes", "max_request_bytes", int,
     "largest request body; a larger Content-Length gets 413 before the body is read"),
    ("--request-read-timeout", "request_read_timeout_s", float,
     "seconds a client has to send the headers, and then the body (slow clients)"),
    ("--max-prompt-chars", "max_prompt_chars", int,
     "longest prompt text, checked before tokenizing (default: 32 x context length)"),
    ("--max-n", "max_n", int, "largest n and best_of"),
    ("--max-priority", "max_priority", int,
     "allowed priorities: -N..N (default 0: clients cannot outrank each other)"),
)  # fmt: skip


def add_limit_args(parser: argparse.ArgumentParser) -> None:
    """What one request may send and take."""
    defaults = ServeLimits()
    for flag, name, kind, text in LIMIT_FLAGS:
        parser.add_argument(flag, type=kind, default=getattr(defaults, name), help=text)
    parser.add_argument(
        "--max-request-kv-share",
        type=float,
        default=SchedulerConfig.max_request_kv_share,
        help="the most of the KV pool one request may need (n x (prompt + max_tokens))",
    )


def limits_from_args(args: argparse.Namespace) -> ServeLimits:
    """Build the ServeLimits; raises ValueError on bad values."""
    values = {name: getattr(args, flag[2:].replace("-", "_")) for flag, name, _, _ in LIMIT_FLAGS}
    return ServeLimits(**values)
