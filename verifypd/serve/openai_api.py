"""POST /v1/completions and /v1/chat/completions: validate, tokenize, generate, respond.

Cancellation contract: a client that disconnects cancels the handler task (the runner must
use ``handler_cancellation=True``); a failed write raises ConnectionResetError. Either way the
``finally`` closes the engine iterator, which makes the engine abort the request and free its
KV blocks, and releases the admission slot.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from aiohttp import web

from verifypd.serve.batch import merged_outputs, start_generate
from verifypd.serve.engine_client import EngineClient
from verifypd.serve.errors import APIError, invalid_request, server_error, unavailable
from verifypd.serve.limits import check_request, read_body, resolve_max_tokens
from verifypd.serve.logprobs import (
    chat_extras,
    check_logprobs_limit,
    completion_extras,
    max_logprobs,
)
from verifypd.serve.protocol import (
    OutputCollector,
    ResponseMeta,
    delta_chunk,
    finish_chunk,
    full_response,
    role_chunk,
    text_chunk,
    tool_call_chunk,
    tool_finish_reason,
    usage_chunk,
    with_token_ids,
)
from verifypd.serve.request_timing import log_timing, start_timing
from verifypd.serve.schemas import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    ChatCompletionRequest,
    CompletionRequest,
    chat_messages,
    chat_tool_plan,
    completion_prompts,
    output_constraint,
    parse_request,
    to_sampling_params,
)
from verifypd.serve.sse import SSEStream
from verifypd.serve.state import Phase, ServerState
from verifypd.serve.tools import (
    ToolPlan,
    render_without_tool_support,
    template_knows_tools,
    tools_for_template,
)
from verifypd.types import ParamError, RequestOutput, RequestTiming, SamplingParams

logger = logging.getLogger("verifypd.serve")
STATE_KEY: web.AppKey[ServerState] = web.AppKey("verifypd_state", ServerState)
FAILED_REASONS = ("abort", "error")
MAX_INLINE_ENCODE_CHARS = 32_768


async def create_completion(request: web.Request) -> web.StreamResponse:
    received = time.monotonic()
    state, body = await _accept(request, CompletionRequest)
    tokenizer = state.engine.tokenizer
    texts = completion_prompts(body)
    prompts = [p if isinstance(p, list) else await encode(tokenizer, p, True) for p in texts]
    echo_only = bool(body.echo) and body.max_tokens == 0  # scoring only: one token, dropped
    requested = 1 if echo_only else body.max_tokens or DEFAULT_COMPLETION_MAX_TOKENS
    for ids in prompts:
        resolve_max_tokens(len(ids), requested, state.engine.max_model_len, "prompt")
    check_logprobs_limit(body.logprobs, max_logprobs(state.engine), "logprobs")
    extras = completion_extras(body, tokenizer, prompts, texts, echo_only)
    params = to_sampling_params(body, requested, output_constraint(body, None))
    meta = ResponseMeta.new(
        "completion", state.model_name, body.include_usage, extras,
        prompts=prompts if body.return_token_ids else None, n_per_prompt=params.n,
    )  # fmt: skip
    return await generate_response(request, state, meta, prompts, params, body.is_stream, received)


async def create_chat_completion(request: web.Request) -> web.StreamResponse:
    received = time.monotonic()
    state, body = await _accept(request, ChatCompletionRequest)
    tools = chat_tool_plan(body)
    constraint = output_constraint(body, tools)
    ids = await encode_chat(state.engine.tokenizer, chat_messages(body), tools)
    limit = _context_limit(state.engine, body.n or 1, body.requested_max_tokens)
    which = "max_tokens" if body.max_completion_tokens is None else "max_completion_tokens"
    max_tokens = resolve_max_tokens(len(ids), body.requested_max_tokens, limit, "messages", which)
    check_logprobs_limit(body.top_logprobs, max_logprobs(state.engine), "top_logprobs")
    extras = chat_extras(body, state.engine.tokenizer)
    parsed = tools if tools.renders_tools else None
    params = to_sampling_params(body, max_tokens, constraint)
    meta = ResponseMeta.new(
        "chat", state.model_name, body.include_usage, extras, parsed,
        prompts=[ids] if body.return_token_ids else None, n_per_prompt=params.n,
    )  # fmt: skip
    return await generate_response(request, state, meta, [ids], params, body.is_stream, received)


async def _accept(
    request: web.Request, schema: type[CompletionRequest | ChatCompletionRequest]
) -> tuple[ServerState, Any]:
    """What a generation request passes before any tokenizing, cheapest first: the server's
    phase, the body (read in bounded time, then its schema), the model name, the limits."""
    state = request.app[STATE_KEY]
    state.check_accepting()
    body = parse_request(schema, await read_body(request, state.limits.request_read_timeout_s))
    state.check_model(body.model)
    check_before_tokenizing(state, body)
    return state, body


def check_before_tokenizing(state: ServerState, body: Any) -> None:
    """The server's limits (400) and the admission bound (429): nothing tokenized yet."""
    engine = state.engine
    check_request(body, state.limits, engine.vocab_size, engine.max_model_len)
    state.check_capacity()


def _context_limit(engine: EngineClient, n: int, requested: int | None) -> int:
    """What a default max_tokens fills up to: the context, or each choice's share of the
    KV pool when the engine bounds it (``max_choice_len``)."""
    if requested is not None:
        return engine.max_model_len
    return engine.max_choice_len(n)


async def encode_chat(
    tokenizer: Any, messages: list[dict[str, Any]], tools: ToolPlan | None = None
) -> list[int]:
    """Render the chat template (with the assistant generation prompt) and tokenize it. Tools
    and tool calls go through the template when it knows them, else into the messages
    (``serve.tools.render_without_tool_support``)."""
    tool_dicts = tools_for_template(tools) if tools is not None else None
    kwargs: dict[str, Any] = {"tokenize": False, "add_generation_prompt": True}
    if template_knows_tools(tokenizer):
        kwargs["tools"] = tool_dicts
    else:
        messages = render_without_tool_support(messages, tool_dicts)
    try:
        text = tokenizer.apply_chat_template(messages, **kwargs)
    except Exception as exc:  # template errors (e.g. role order) are the client's input
        raise invalid_request(f"Could not apply the chat template: {exc}", "messages") from None
    return await encode(tokenizer, text, False)


async def encode(tokenizer: Any, text: str, add_special_tokens: bool) -> list[int]:
    """Tokenize; long texts in a worker thread (1 MB takes ~0.5 s, and the fast tokenizer
    releases the GIL), so that one huge prompt does not stall every stream."""
    if len(text) < MAX_INLINE_ENCODE_CHARS:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)
    return await asyncio.to_thread(tokenizer.encode, text, add_special_tokens=add_special_tokens)


async def generate_response(
    request: web.Request,
    state: ServerState,
    meta: ResponseMeta,
    prompts: list[list[int]],
    params: SamplingParams,
    stream: bool,
    received: float | None = None,
) -> web.StreamResponse:
    """Admit, run the engine (every prompt at once), and answer with SSE or one JSON body.
    ``received``: when the handler began (``time.monotonic()``), for --log-request-timing."""
    param = "messages" if meta.kind == "chat" else "prompt"
    state.admit(meta.id)
    outputs: AsyncIterator[RequestOutput] | None = None
    collected = OutputCollector(len(prompts) * params.n, n_per_prompt=params.n)
    timing = start_timing(received, len(prompts))
    if timing is not None:
        meta = replace(meta, timing=timing)
    try:
        outputs = await _start(state.engine, meta.id, prompts, params, param, timing)
        first = await _first_output(outputs, param)  # engine input errors surface here
        if stream:
            return await _stream(request, state, meta, collected, first, outputs)
        return await _collect(state, meta, collected, first, outputs)
    finally:
        await _close(outputs)
        state.release(meta.id)
        if timing is not None:
            log_timing(request, meta.id, timing, collected)


async def _start(
    engine: EngineClient,
    request_id: str,
    prompts: list[list[int]],
    params: SamplingParams,
    param: str,
    timing: RequestTiming | None,
) -> AsyncIterator[RequestOutput]:
    """The engine's deltas: of its one request, or merged over several prompts."""
    if len(prompts) > 1:
        return merged_outputs(engine, request_id, prompts, params)
    try:
        return await start_generate(engine, request_id, prompts[0], params, timing)
    except ParamError as err:
        raise _param_error(err, param) from None


def _param_error(err: ParamError, param: str) -> APIError:
    """An engine ParamError as a 400; prompt problems name the endpoint's prompt field."""
    where = param if err.param in (None, "prompt", "messages") else err.param
    return invalid_request(str(err), where)


async def _first_output(outputs: AsyncIterator[RequestOutput], param: str) -> RequestOutput | None:
    try:
        return await _next(outputs)
    except ParamError as err:
        raise _param_error(err, param) from None


async def _next(outputs: AsyncIterator[RequestOutput]) -> RequestOutput | None:
    try:
        return await outputs.__anext__()
    except StopAsyncIteration:
        return None


async def _close(outputs: AsyncIterator[RequestOutput] | None) -> None:
    """Closing an unfinished engine iterator aborts the request and frees its KV blocks."""
    aclose = getattr(outputs, "aclose", None)
    if aclose is None:
        return
    try:
        await aclose()
    except Exception:  # never let engine cleanup errors leak the admission slot
        logger.exception("closing the engine iterator failed")


def _failure(state: ServerState, reason: str | None) -> APIError:
    if reason == "error":
        return server_error("The engine failed while generating this request.")
    if state.phase is Phase.DRAINING:
        return unavailable("shutting down; the request was aborted")
    return server_error("The request was aborted by the engine.")


async def _collect(
    state: ServerState,
    meta: ResponseMeta,
    collected: OutputCollector,
    out: RequestOutput | None,
    outputs: AsyncIterator[RequestOutput],
) -> web.Response:
    while out is not None:
        collected.add(out)
        out = await _next(outputs)
    for reason in collected.finish_reasons:
        if reason is None or reason in FAILED_REASONS:
            raise _failure(state, reason)
    return web.json_response(full_response(meta, collected))


async def _stream(
    request: web.Request,
    state: ServerState,
    meta: ResponseMeta,
    collected: OutputCollector,
    first: RequestOutput | None,
    outputs: AsyncIterator[RequestOutput],
) -> web.StreamResponse:
    sse = SSEStream(request)
    try:
        await sse.open()
        error = await _stream_events(sse, state, meta, collected, first, outputs)
        await _end_stream(sse, meta, collected, error)
    except ConnectionResetError:
        logger.debug("client of %s went away mid-stream", meta.id)
    except Exception:  # headers are out: end the stream with an error event, not a cut
        if not sse.response.prepared:
            raise
        logger.exception("engine failed mid-stream on %s", meta.id)
        error = server_error("Internal error while streaming.")
        try:
            await _end_stream(sse, meta, collected, error)
        except ConnectionResetError:
            pass
    return sse.response


async def _end_stream(
    sse: SSEStream, meta: ResponseMeta, collected: OutputCollector, error: APIError | None
) -> None:
    """The usage chunk (when asked for, also after an early end), the error if any, [DONE]."""
    if meta.include_usage:
        await sse.send(usage_chunk(meta, collected.usage()))
    if error is not None:
        await sse.send(error.body())
    await sse.finish()


async def _stream_events(
    sse: SSEStream,
    state: ServerState,
    meta: ResponseMeta,
    collected: OutputCollector,
    out: RequestOutput | None,
    outputs: AsyncIterator[RequestOutput],
) -> APIError | None:
    """Send the content chunks; returns the error that ended the stream early, if any."""
    if meta.kind == "chat":
        for index in range(collected.n):
            await sse.send(role_chunk(meta, index))
    sent: list[int | None] = [None] * collected.n  # characters sent per choice
    while out is not None:
        collected.add(out)
        if meta.tools is None:  # a request with tools is sent when its choice ends
            chunk = delta_chunk(meta, out, sent[out.index])
            if chunk is not None:
                if meta.timing is not None and meta.timing.first_sent is None:
                    meta.timing.first_sent = time.monotonic()
                await sse.send(chunk)
                sent[out.index] = (sent[out.index] or 0) + len(chunk["choices"][0].get("text", ""))
        if out.finished and out.finish_reason in FAILED_REASONS:
            return _failure(state, out.finish_reason)
        if out.finished:
            await _send_finish(sse, meta, collected, out.index, out.finish_reason or "stop")
        out = await _next(outputs)
    if not collected.all_finished:  # the engine ended the iterator early
        return _failure(state, "abort")
    return None


async def _send_finish(
    sse: SSEStream, meta: ResponseMeta, collected: OutputCollector, index: int, reason: str
) -> None:
    """A choice's closing chunk; with tools, its parsed output first (the text of a request
    with tools is held back until it ends, then sent as tool calls or as content)."""
    chunks = []
    if meta.tools is not None:
        content, calls = meta.tools.parse(collected.text(index))
        if calls:
            chunks.append(tool_call_chunk(meta, index, calls))
        elif content:
            chunks.append(text_chunk(meta, index, content))
        reason = tool_finish_reason(reason, calls)
    chunks.append(finish_chunk(meta, index, reason))
    if meta.tools is not None and meta.prompts is not None:  # the held-back tokens' ids
        with_token_ids(meta, chunks[0], index, collected.token_ids[index], True)
    for chunk in chunks:
        await sse.send(chunk)
