"""Error handling: every bad input is a 400 (or 404/401) with the OpenAI error body."""

from __future__ import annotations

import pytest
from fake_engine import FakeEngine
from server_utils import Harness, bounded, serve_engine

CHAT = [{"role": "user", "content": "hi"}]
BASE = {"/v1/completions": {"prompt": "hi"}, "/v1/chat/completions": {"messages": CHAT}}

# (field, bad value) -> the offending param is the field itself; both endpoints.
COMMON_BAD = [
    ("max_tokens", 0), ("max_tokens", "5"), ("max_tokens", 1.5), ("max_tokens", True),
    ("temperature", -0.1), ("temperature", 2.5), ("temperature", "hot"),
    ("top_p", 0), ("top_p", 1.5), ("top_p", "1"),
    ("top_k", -2), ("top_k", 1.5),
    ("n", 0), ("n", 100), ("n", "2"),
    ("stop", ["a", "b", "c", "d", "e"]), ("stop", 5), ("stop", [""]), ("stop", ""),
    ("stop", [1]),
    ("seed", "x"), ("seed", 2**64), ("seed", 1.5),
    ("stream", "yes"), ("stream", 1),
    ("stream_options", {"include_usage": True}),  # without stream: true
    ("priority", "high"), ("ignore_eos", 1),
    ("model", 5),
    ("stop_token_ids", [-1]),
    ("presence_penalty", 2.5), ("presence_penalty", -2.1), ("presence_penalty", "1"),
    ("frequency_penalty", 3), ("frequency_penalty", -2.5), ("frequency_penalty", "x"),
    ("repetition_penalty", 0), ("repetition_penalty", -1.0), ("repetition_penalty", "1.2"),
    ("logit_bias", {"1": 101}), ("logit_bias", {"1": -100.5}), ("logit_bias", {"x": 1}),
    ("logit_bias", {"1": "a"}), ("logit_bias", [1, 2]), ("logit_bias", {"1.5": 1}),
    ("min_tokens", -1), ("min_tokens", 1.5), ("min_tokens", "3"),
    ("bad_words", "x"), ("bad_words", [1]), ("include_stop_str_in_output", "yes"),
]  # fmt: skip
COMPLETION_BAD = [
    ("prompt", 5), ("prompt", ["a", ""]), ("prompt", []), ("prompt", ""), ("prompt", [[1, -2]]),
    ("prompt", [-1]), ("prompt", [1, "a"]), ("prompt", None), ("prompt", [[1], []]),
    ("prompt", [[1], "a"]), ("logprobs", 21), ("logprobs", -1), ("logprobs", True),
    ("echo", "yes"), ("suffix", "x"), ("best_of", 3),
    ("min_tokens", 17),  # above the default max_tokens of 16
]  # fmt: skip
CHAT_BAD = [
    ("messages", []), ("messages", "hi"), ("messages", None),
    ("messages", [{"role": "wizard", "content": "x"}]),
    ("messages", [{"content": "x"}]),
    ("messages", [{"role": "user", "content": 5}]),
    ("messages", [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
    ("max_completion_tokens", 0), ("max_completion_tokens", "3"),
    ("min_tokens", 10**9),  # above max_tokens (the rest of the context)
    ("logprobs", 1), ("top_logprobs", 2), ("top_logprobs", 21), ("top_logprobs", -1),
    ("tools", [{"type": "function"}]),
    ("tool_choice", "required"), ("response_format", {"type": "xml"}),
    ("response_format", {"type": "json_schema"}),
    ("structured_outputs", {"regex": "a", "choice": ["b"]}),
    ("tool_choice", {"type": "function", "function": {"name": "nope"}}), ("guided_choice", []),
]  # fmt: skip
CASES = [("/v1/completions", f, v) for f, v in COMMON_BAD + COMPLETION_BAD] + [
    ("/v1/chat/completions", f, v) for f, v in COMMON_BAD + CHAT_BAD
]


async def expect_error(resp, status: int, type_: str, param: str | None) -> dict:
    assert resp.status == status, await resp.text()
    body = await resp.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == type_ and error["param"] == param and error["message"]
    return error


@pytest.mark.parametrize(("path", "field", "value"), CASES)
@bounded(10)
async def test_bad_field_is_400_with_param(harness: Harness, path: str, field: str, value) -> None:
    payload = {**BASE[path], field: value}
    resp = await harness.client.post(path, json=payload)
    error = await expect_error(resp, 400, "invalid_request_error", field)
    assert error["code"] is None
    assert not harness.engine.calls and not harness.state.inflight


@pytest.mark.parametrize("path", list(BASE))
@pytest.mark.parametrize("raw", [b"{not json", b"", b"[1, 2]", b'"text"', b"{'a': 1}"])
@bounded(10)
async def test_malformed_json_is_400(harness: Harness, path: str, raw: bytes) -> None:
    resp = await harness.client.post(path, data=raw, headers={"Content-Type": "application/json"})
    await expect_error(resp, 400, "invalid_request_error", None)


@pytest.mark.parametrize("path", list(BASE))
@bounded(10)
async def test_unknown_model_is_404(harness: Harness, path: str) -> None:
    resp = await harness.client.post(path, json={**BASE[path], "model": "gpt-9"})
    error = await expect_error(resp, 404, "not_found_error", "model")
    assert error["code"] == "model_not_found" and "gpt-9" in error["message"]


@bounded(10)
async def test_prompt_too_long_is_400_with_limits(harness: Harness) -> None:
    payload = {"prompt": "a" * 500, "max_tokens": 100}
    error = await expect_error(
        await harness.client.post("/v1/completions", json=payload), 400, "invalid_request_error",
        "prompt",
    )  # fmt: skip
    for number in ("500", "100", "512", "600"):
        assert number in error["message"]
    assert "max_model_len" in error["message"] and "max_tokens" in error["message"]
    only_prompt = {"prompt": "a" * 512}
    error = await expect_error(
        await harness.client.post("/v1/completions", json=only_prompt), 400,
        "invalid_request_error", "prompt",
    )  # fmt: skip
    assert "512" in error["message"]


@bounded(10)
async def test_chat_too_long_is_400_on_messages(harness: Harness) -> None:
    payload = {"messages": [{"role": "user", "content": "a" * 600}]}
    resp = await harness.client.post("/v1/chat/completions", json=payload)
    await expect_error(resp, 400, "invalid_request_error", "messages")
    payload = {"messages": [{"role": "user", "content": "a" * 400}], "max_tokens": 200}
    resp = await harness.client.post("/v1/chat/completions", json=payload)
    await expect_error(resp, 400, "invalid_request_error", "messages")


@bounded(10)
async def test_engine_param_error_maps_to_400() -> None:
    # The engine's RequestLimits reject requests that can never fit its 4 KV blocks (64 tokens).
    async with serve_engine(FakeEngine(num_blocks=4)) as h:
        resp = await h.client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 100})
        error = await expect_error(resp, 400, "invalid_request_error", "max_tokens")
        assert "KV cache" in error["message"]
        payload = {"messages": CHAT, "max_tokens": 100, "stream": True}
        resp = await h.client.post("/v1/chat/completions", json=payload)
        await expect_error(resp, 400, "invalid_request_error", "max_tokens")
        assert not h.state.inflight and h.engine.kv_usage == 0


@bounded(10)
async def test_unknown_route_and_method(harness: Harness) -> None:
    await expect_error(await harness.client.get("/v1/nope"), 404, "not_found_error", None)
    resp = await harness.client.get("/v1/completions")
    await expect_error(resp, 405, "invalid_request_error", None)


@bounded(10)
async def test_api_key() -> None:
    async with serve_engine(FakeEngine(), api_key="sekret") as h:
        resp = await h.client.post("/v1/completions", json={"prompt": "hi"})
        error = await expect_error(resp, 401, "authentication_error", None)
        assert error["code"] == "invalid_api_key"
        bad = {"Authorization": "Bearer nope"}
        resp = await h.client.get("/v1/models", headers=bad)
        assert resp.status == 401
        good = {"Authorization": "Bearer sekret"}
        resp = await h.client.post("/v1/completions", json={"prompt": "hi"}, headers=good)
        assert resp.status == 200
        assert (await h.client.get("/health")).status == 200  # health needs no key
        assert (await h.client.get("/metrics")).status == 200
        # the server's settings are the operator's: behind the key
        assert (await h.client.get("/server_info")).status == 401
        info = await (await h.client.get("/server_info", headers=good)).json()
        assert info["engine_client"] == "FakeEngine" and info["limits"]["max_n"] > 0
