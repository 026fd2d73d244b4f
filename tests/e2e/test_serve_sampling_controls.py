"""Sampling controls through the HTTP API on the REAL engine (embedded SmolLM2, CPU), in
process: min_tokens on both endpoints (streamed too), include_stop_str_in_output both ways,
bad_words under sampling, and token ids outside the vocabulary as 400s naming the field."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "serve"))

from server_utils import bounded, parse_sse, serve_engine  # noqa: E402

from verifypd.config import EngineConfig  # noqa: E402
from verifypd.lanes.async_engine import AsyncEngine  # noqa: E402

pytestmark = pytest.mark.slow

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"max_tokens": 16, "temperature": 0}
PARIS, PERIOD = 7042, 30  # " Paris", "."


async def _post(client, path: str, payload: dict) -> dict:
    resp = await client.post(path, json=payload)
    assert resp.status == 200, await resp.text()
    return await resp.json()


@bounded(900)
async def test_sampling_controls_over_http() -> None:
    engine = AsyncEngine(EngineConfig(model="default", device="cpu"))
    tok = engine.tokenizer
    text = tok.apply_chat_template(FRANCE, tokenize=False, add_generation_prompt=True)
    chat_ids = tok.encode(text, add_special_tokens=False)  # the chat prompt, for completions
    async with serve_engine(engine) as h:
        c = h.client
        await _check_min_tokens(c, chat_ids)
        await _check_include_stop_str(c)
        await _check_bad_words_under_sampling(c)
        await _check_vocabulary_errors(c)
        await h.wait_engine_idle(30)
        assert engine.kv_usage == 0


async def _check_min_tokens(c, chat_ids: list[int]) -> None:
    """The greedy answer ends (EOS) before 12 tokens; with min_tokens 12 it may not."""
    chat = {"messages": FRANCE, **GREEDY}
    completion = {"prompt": chat_ids, **GREEDY}
    for path, payload in (("/v1/chat/completions", chat), ("/v1/completions", completion)):
        free = await _post(c, path, payload)
        assert free["usage"]["completion_tokens"] < 12, path
        held = await _post(c, path, {**payload, "min_tokens": 12})
        assert held["usage"]["completion_tokens"] >= 12, path
    resp = await c.post(
        "/v1/chat/completions",
        json={**chat, "min_tokens": 12, "stream": True, "stream_options": {"include_usage": True}},
    )
    events = parse_sse(await resp.text())
    assert events[-2]["usage"]["completion_tokens"] >= 12


async def _check_include_stop_str(c) -> None:
    """A stop string's and a stop token's text: left out by default, kept when asked."""
    prompt = {"prompt": "The capital of France is", **GREEDY}
    cases = [({"stop": [" Paris"]}, "", " Paris"), ({"stop_token_ids": [PERIOD]}, " Paris", ".")]
    for stop, before, kept in cases:
        for path, body in (("/v1/completions", prompt),
                           ("/v1/chat/completions", {"messages": FRANCE, **GREEDY})):  # fmt: skip
            left_out = await _post(c, path, {**body, **stop})
            included = await _post(c, path, {**body, **stop, "include_stop_str_in_output": True})
            cut, full = _text(left_out), _text(included)
            assert left_out["choices"][0]["finish_reason"] == "stop", (path, stop)
            assert full == cut + kept and not cut.endswith(kept), (path, stop, cut, full)
            if path == "/v1/completions":
                assert cut.endswith(before), cut


def _text(body: dict) -> str:
    choice = body["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


async def _check_bad_words_under_sampling(c) -> None:
    """A +8 bias makes " Paris" near certain; as a bad word it never appears."""
    payload = {"prompt": "The capital of France is", "max_tokens": 6, "temperature": 1.0,
               "n": 4, "seed": 11, "logit_bias": {str(PARIS): 8}}  # fmt: skip
    biased = await _post(c, "/v1/completions", payload)
    assert all("Paris" in ch["text"] for ch in biased["choices"])
    banned = await _post(c, "/v1/completions", {**payload, "bad_words": ["Paris"]})
    assert not any("Paris" in ch["text"] for ch in banned["choices"])


async def _check_vocabulary_errors(c) -> None:
    for field, value in (("logit_bias", {"49152": 1}), ("logit_bias", {"-1": 1}),
                         ("stop_token_ids", [10**6])):  # fmt: skip
        for path, body in (("/v1/completions", {"prompt": "x"}),
                           ("/v1/chat/completions", {"messages": FRANCE})):  # fmt: skip
            resp = await c.post(path, json={**body, field: value})
            assert resp.status == 400, (path, field, await resp.text())
            assert (await resp.json())["error"]["param"] == field
