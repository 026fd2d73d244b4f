"""vLLM's extra endpoints: POST /tokenize, POST /detokenize, GET /tokenizer_info, GET /version.

Shapes follow vLLM so that clients written for it (lm-eval, guidellm, aiperf) discover the
tokenizer offline: ``/tokenize`` takes ``{model?, prompt}`` or ``{model?, messages,
add_generation_prompt?}`` (plus ``add_special_tokens``, ``return_token_strs``) and answers
``{count, max_model_len, tokens, token_strs}``; ``/detokenize`` takes ``{model?, tokens}`` and
answers ``{prompt}``; ``/tokenizer_info`` gives the special tokens and the chat template
(lm-eval's ``remote`` tokenizer backend reads it).
"""

from __future__ import annotations

from typing import Annotated, Any

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError

import verifypd
from verifypd.serve.errors import invalid_request
from verifypd.serve.openai_api import STATE_KEY, encode
from verifypd.serve.schemas import ChatMessage, _to_api_error, chat_messages

TokenId = Annotated[int, Field(ge=0)]


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None


class TokenizeRequest(_Body):
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_generation_prompt: bool = True
    add_special_tokens: bool | None = None  # vLLM: True for a prompt, False for messages
    return_token_strs: bool = False


class DetokenizeRequest(_Body):
    tokens: list[TokenId]


def add_tokenize_routes(app: web.Application) -> None:
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/tokenizer_info", tokenizer_info)
    app.router.add_get("/version", version)


def _parse(model_cls: type[_Body], body: bytes) -> Any:
    try:
        return model_cls.model_validate_json(body)
    except ValidationError as exc:
        raise _to_api_error(exc) from None


async def _accept(request: web.Request, model_cls: type[_Body]) -> tuple[Any, Any]:
    """The validated body and the engine's tokenizer (503 while starting, 404 unknown model)."""
    state = request.app[STATE_KEY]
    state.check_accepting()
    body = _parse(model_cls, await request.read())
    state.check_model(body.model)
    return body, state.engine.tokenizer


async def tokenize(request: web.Request) -> web.Response:
    body, tokenizer = await _accept(request, TokenizeRequest)
    ids = await _tokenize_body(tokenizer, body)
    answer = {
        "count": len(ids),
        "max_model_len": request.app[STATE_KEY].engine.max_model_len,
        "tokens": ids,
        "token_strs": _token_strs(tokenizer, ids) if body.return_token_strs else None,
    }
    return web.json_response(answer)


async def _tokenize_body(tokenizer: Any, body: TokenizeRequest) -> list[int]:
    if (body.prompt is None) == (body.messages is None):
        raise invalid_request("Give exactly one of 'prompt' and 'messages'", "prompt")
    if body.prompt is not None:
        special = True if body.add_special_tokens is None else body.add_special_tokens
        return await encode(tokenizer, body.prompt, special)
    text = _render_chat(tokenizer, body)
    return await encode(tokenizer, text, bool(body.add_special_tokens))


def _render_chat(tokenizer: Any, body: TokenizeRequest) -> str:
    messages = chat_messages(body)  # type: ignore[arg-type]  # only reads .messages
    try:
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=body.add_generation_prompt
        )
    except Exception as exc:  # template errors (e.g. role order) are the client's input
        raise invalid_request(f"Could not apply the chat template: {exc}", "messages") from None


def _token_strs(tokenizer: Any, ids: list[int]) -> list[str]:
    convert = getattr(tokenizer, "convert_ids_to_tokens", None)
    if convert is not None:
        return list(convert(ids))
    return [tokenizer.decode([i]) for i in ids]


async def detokenize(request: web.Request) -> web.Response:
    body, tokenizer = await _accept(request, DetokenizeRequest)
    _check_in_vocab(tokenizer, body.tokens)
    try:
        text = tokenizer.decode(body.tokens)
    except Exception as exc:  # a tokenizer that refuses an id: the client's input
        raise invalid_request(f"Could not decode 'tokens': {exc}", "tokens") from None
    return web.json_response({"prompt": text})


def _check_in_vocab(tokenizer: Any, ids: list[int]) -> None:
    vocab_size = len(tokenizer) if hasattr(tokenizer, "__len__") else None
    bad = [i for i in ids if vocab_size is not None and i >= vocab_size]
    if bad:
        raise invalid_request(
            f"Token id {bad[0]} is out of vocabulary (ids must be in [0, {vocab_size}))",
            "tokens",
        )


async def tokenizer_info(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    state.check_accepting()
    tokenizer = state.engine.tokenizer
    info = {key: _text_or_none(getattr(tokenizer, key, None)) for key in TOKENIZER_INFO_KEYS}
    info["tokenizer_class"] = type(tokenizer).__name__
    info["model_max_length"] = state.engine.max_model_len
    return web.json_response(info)


TOKENIZER_INFO_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token", "chat_template")


def _text_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) else None


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": verifypd.__version__})
