"""vLLM's extra endpoints (/tokenize, /detokenize, /version, /v1/models fields), the usage chunk
of streams that end early, and CORS, against the FakeEngine (one token per character)."""

from __future__ import annotations

import asyncio

import pytest
from fake_engine import FakeEngine
from server_utils import Harness, bounded, parse_sse, serve_engine, wait_until
from test_serve_engine_failures import ExplodingEngine

import verifypd
from verifypd.serve.cors import CorsConfig, parse_list
from verifypd.serve.lifecycle import drain

USAGE_KEYS = {"prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details"}


@bounded(10)
async def test_tokenize_prompt_and_messages(harness: Harness) -> None:
    resp = await harness.client.post("/tokenize", json={"model": "fake-model", "prompt": "abc"})
    assert resp.status == 200
    assert await resp.json() == {
        "count": 3, "max_model_len": 512, "tokens": [97, 98, 99], "token_strs": None,
    }  # fmt: skip
    chat = {"messages": [{"role": "user", "content": "hi"}], "return_token_strs": True}
    body = await (await harness.client.post("/tokenize", json=chat)).json()
    assert "".join(map(chr, body["tokens"])) == "<user>hi\n<assistant>"
    assert body["token_strs"] == list("<user>hi\n<assistant>") and body["count"] == 20
    chat["add_generation_prompt"] = False
    body = await (await harness.client.post("/tokenize", json=chat)).json()
    assert "".join(map(chr, body["tokens"])) == "<user>hi\n"


@bounded(10)
async def test_detokenize_round_trip_and_bad_ids(harness: Harness) -> None:
    resp = await harness.client.post("/detokenize", json={"tokens": [104, 105]})
    assert resp.status == 200 and await resp.json() == {"prompt": "hi"}
    for bad in ([-1], ["a"], [0x110000], None):
        resp = await harness.client.post("/detokenize", json={"tokens": bad})
        assert resp.status == 400, bad
        assert (await resp.json())["error"]["param"] == "tokens"


@bounded(10)
async def test_tokenize_errors(harness: Harness) -> None:
    for body in ({}, {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}):
        resp = await harness.client.post("/tokenize", json=body)
        assert resp.status == 400 and (await resp.json())["error"]["param"] == "prompt"
    resp = await harness.client.post("/tokenize", json={"prompt": 3})
    assert resp.status == 400 and (await resp.json())["error"]["param"] == "prompt"
    resp = await harness.client.post("/tokenize", json={"model": "other", "prompt": "a"})
    assert resp.status == 404


@bounded(10)
async def test_version_and_model_card(harness: Harness) -> None:
    assert await (await harness.client.get("/version")).json() == {"version": verifypd.__version__}
    [card] = (await (await harness.client.get("/v1/models")).json())["data"]
    assert card["max_model_len"] == 512 and card["owned_by"] == "verifypd"
    assert card["root"] == "fake-model" and isinstance(card["created"], int)
    info = await (await harness.client.get("/tokenizer_info")).json()
    assert info["tokenizer_class"] == "FakeTokenizer" and info["model_max_length"] == 512
    assert info["eos_token"] is None and "chat_template" in info


STREAM = {"prompt": "x", "max_tokens": 10, "stream": True}
WITH_USAGE = {**STREAM, "stream_options": {"include_usage": True}}


def _usage_then_error(events: list) -> dict:
    """The tail of a stream that ended early: usage chunk, error event, [DONE]."""
    assert events[-1] == "[DONE]" and "error" in events[-2]
    usage_chunk = events[-3]
    assert usage_chunk["choices"] == [] and set(usage_chunk["usage"]) == USAGE_KEYS
    return usage_chunk["usage"]


@bounded(10)
async def test_usage_chunk_after_engine_error_finish() -> None:
    async with serve_engine(FakeEngine(fail_after=3)) as h:
        events = parse_sse(await (await h.client.post("/v1/completions", json=WITH_USAGE)).text())
        usage = _usage_then_error(events)
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (1, 3)
        events = parse_sse(await (await h.client.post("/v1/completions", json=STREAM)).text())
        assert not any("usage" in e for e in events[:-1])  # not asked for: none


@bounded(10)
async def test_usage_chunk_after_engine_exception() -> None:
    async with serve_engine(ExplodingEngine()) as h:
        events = parse_sse(await (await h.client.post("/v1/completions", json=WITH_USAGE)).text())
        usage = _usage_then_error(events)
        assert usage["prompt_tokens"] == 1 and usage["completion_tokens"] == 1


@bounded(15)
async def test_usage_chunk_after_drain_abort() -> None:
    async with serve_engine(FakeEngine(step_s=0.01)) as h:
        payload = {
            "messages": [{"role": "user", "content": "x"}], "max_tokens": 400, "stream": True,
            "stream_options": {"include_usage": True},
        }  # fmt: skip
        stream = asyncio.create_task(h.client.post("/v1/chat/completions", json=payload))
        await wait_until(lambda: h.state.inflight)
        await asyncio.sleep(0.1)
        assert await drain(h.state, timeout=0.2, grace=3) is False
        events = parse_sse(await (await stream).text())
        usage = _usage_then_error(events)
        assert "shutting down" in events[-2]["error"]["message"]
        assert 0 < usage["completion_tokens"] < 400


@bounded(15)
async def test_usage_chunk_after_engine_stop() -> None:
    async with serve_engine(FakeEngine(step_s=0.01)) as h:
        payload = {**WITH_USAGE, "max_tokens": 400}
        stream = asyncio.create_task(h.client.post("/v1/completions", json=payload))
        await wait_until(lambda: h.engine.num_running)
        await asyncio.sleep(0.1)
        await h.engine.stop()  # aborts every request
        usage = _usage_then_error(parse_sse(await (await stream).text()))
        assert 0 < usage["completion_tokens"] < 400


# -- CORS ------------------------------------------------------------------------------------

PREFLIGHT = {
    "Origin": "http://app.example", "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": "content-type, authorization",
}  # fmt: skip


@bounded(10)
async def test_no_cors_headers_by_default(harness: Harness) -> None:
    resp = await harness.client.get("/v1/models", headers={"Origin": "http://app.example"})
    assert resp.status == 200 and "Access-Control-Allow-Origin" not in resp.headers
    resp = await harness.client.options("/v1/completions", headers=PREFLIGHT)
    assert resp.status == 405 and "Access-Control-Allow-Origin" not in resp.headers


@bounded(10)
async def test_cors_preflight_and_stream_headers() -> None:
    cors = CorsConfig(allowed_origins=("http://app.example",))
    async with serve_engine(FakeEngine(), cors=cors, api_key="k") as h:
        resp = await h.client.options("/v1/completions", headers=PREFLIGHT)
        assert resp.status == 204  # answered before authentication
        assert resp.headers["Access-Control-Allow-Origin"] == "http://app.example"
        assert resp.headers["Access-Control-Allow-Methods"] == "POST"
        assert resp.headers["Access-Control-Allow-Headers"] == "content-type, authorization"
        headers = {"Origin": "http://app.example", "Authorization": "Bearer k"}
        resp = await h.client.post("/v1/completions", json=STREAM, headers=headers)
        assert resp.headers["Access-Control-Allow-Origin"] == "http://app.example"
        assert parse_sse(await resp.text())[-1] == "[DONE]"
        resp = await h.client.post(
            "/v1/completions", json=STREAM, headers={"Origin": "http://app.example"}
        )
        assert resp.status == 401 and resp.headers["Access-Control-Allow-Origin"]  # errors too
        evil = {**PREFLIGHT, "Origin": "http://evil.example"}
        resp = await h.client.options("/v1/completions", headers=evil)
        assert resp.status == 403 and "Access-Control-Allow-Origin" not in resp.headers
        resp = await h.client.get("/health", headers={"Origin": "http://evil.example"})
        assert resp.status == 200 and "Access-Control-Allow-Origin" not in resp.headers


@bounded(10)
async def test_cors_wildcard_and_restricted_methods() -> None:
    cors = CorsConfig(("*",), allowed_methods=("GET", "POST"), allowed_headers=("content-type",))
    async with serve_engine(FakeEngine(), cors=cors) as h:
        resp = await h.client.options("/tokenize", headers=PREFLIGHT)
        assert resp.headers["Access-Control-Allow-Origin"] == "*"
        assert resp.headers["Access-Control-Allow-Methods"] == "GET, POST"
        assert resp.headers["Access-Control-Allow-Headers"] == "content-type"


def test_parse_list() -> None:
    assert parse_list('["http://a", "http://b"]') == ("http://a", "http://b")
    assert parse_list("http://a, http://b") == ("http://a", "http://b")
    assert parse_list("*") == ("*",)
    with pytest.raises(ValueError):
        parse_list('["a", 1]')


# -- return_token_ids (vLLM's field) -----------------------------------------------------


def _content(events: list) -> list[dict]:
    return [e for e in events[:-1] if e["choices"]]


@bounded(10)
async def test_return_token_ids_stream_completion(harness: Harness) -> None:
    body = {**WITH_USAGE, "prompt": "ab", "return_token_ids": True}
    events = parse_sse(await (await harness.client.post("/v1/completions", json=body)).text())
    chunks = _content(events)
    ids = [t for c in chunks for t in c["choices"][0].get("token_ids", [])]
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert ids == [ord(ch) for ch in text] and len(ids) == events[-2]["usage"]["completion_tokens"]
    assert chunks[0]["choices"][0]["prompt_token_ids"] == [97, 98]  # the first chunk only
    assert not any("prompt_token_ids" in c["choices"][0] for c in chunks[1:])
    plain = parse_sse(await (await harness.client.post("/v1/completions", json=STREAM)).text())
    assert not any("token_ids" in c["choices"][0] for c in _content(plain))  # not asked for


@bounded(10)
async def test_return_token_ids_full_completion_per_prompt_and_choice(harness: Harness) -> None:
    body = {"prompt": ["ab", "c"], "n": 2, "max_tokens": 5, "return_token_ids": True}
    resp = await (await harness.client.post("/v1/completions", json=body)).json()
    assert len(resp["choices"]) == 4
    for choice in resp["choices"]:
        want = [97, 98] if choice["index"] < 2 else [99]
        assert choice["prompt_token_ids"] == want
        assert choice["token_ids"] == [ord(ch) for ch in choice["text"]] and choice["text"]


@bounded(10)
async def test_return_token_ids_chat(harness: Harness) -> None:
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6,
            "return_token_ids": True}  # fmt: skip
    prompt = [ord(ch) for ch in "<user>hi\n<assistant>"]
    full = await (await harness.client.post("/v1/chat/completions", json=chat)).json()
    assert full["prompt_token_ids"] == prompt
    message = full["choices"][0]["message"]["content"]
    assert full["choices"][0]["token_ids"] == [ord(ch) for ch in message]
    resp = await harness.client.post("/v1/chat/completions", json={**chat, "stream": True})
    chunks = _content(parse_sse(await resp.text()))
    with_ids = [c for c in chunks if "token_ids" in c["choices"][0]]
    assert with_ids[0]["prompt_token_ids"] == prompt
    assert not any("prompt_token_ids" in c for c in with_ids[1:])
    ids = [t for c in with_ids for t in c["choices"][0]["token_ids"]]
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert ids == [ord(ch) for ch in streamed] and len(ids) == 6


@bounded(10)
async def test_return_token_ids_must_be_a_bool(harness: Harness) -> None:
    body = {"prompt": "a", "max_tokens": 2, "return_token_ids": "yes"}
    resp = await harness.client.post("/v1/completions", json=body)
    assert resp.status == 400 and (await resp.json())["error"]["param"] == "return_token_ids"


@bounded(10)
async def test_return_token_ids_stream_with_tools(harness: Harness) -> None:
    """Output of a request with tools is held back until its choice ends: its token ids all
    come with the first chunk sent then."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 7, "stream": True,
            "tools": [tool], "return_token_ids": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    events = parse_sse(await (await harness.client.post("/v1/chat/completions", json=chat)).text())
    with_ids = [c for c in _content(events) if "token_ids" in c["choices"][0]]
    assert len(with_ids) == 1 and len(with_ids[0]["choices"][0]["token_ids"]) == 7
    assert with_ids[0]["prompt_token_ids"] and events[-2]["usage"]["completion_tokens"] == 7
