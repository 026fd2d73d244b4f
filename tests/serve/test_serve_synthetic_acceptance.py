"""Over HTTP, ``synthetic_acceptance`` (a verifypd benchmark-only body field) reaches the
engine on a server in synthetic mode and is a 400 naming the field elsewhere."""

from __future__ import annotations

import pytest
from helpers import bounded, tiny_config, tiny_draft_spec
from server_utils import parse_sse, serve_engine

from verifypd.config import CacheConfig
from verifypd.lanes.async_engine import AsyncEngine


@bounded(120)
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_http_400_names_the_field_when_not_synthetic(path: str) -> None:
    engine = AsyncEngine(tiny_config(cache=CacheConfig(num_blocks=64)))
    body = {"max_tokens": 2, "synthetic_acceptance": 0.5}
    body |= {"prompt": "hi"} if "chat" not in path else {
        "messages": [{"role": "user", "content": "hi"}]
    }  # fmt: skip
    async with serve_engine(engine) as h:
        for sent, why in ((body, "synthetic"), ({**body, "synthetic_acceptance": 1.5}, "")):
            resp = await h.client.post(path, json=sent)
            payload = await resp.json()
            assert resp.status == 400, payload
            assert payload["error"]["param"] == "synthetic_acceptance", payload
            assert why in payload["error"]["message"]
        resp = await h.client.post(
            path, json={k: v for k, v in body.items() if k != "synthetic_acceptance"}
        )
        assert resp.status == 200
        await h.wait_engine_idle()
        assert engine.kv_usage == 0


@bounded(120)
async def test_http_accepts_it_in_synthetic_mode() -> None:
    spec = tiny_draft_spec(max_draft_len=2, initial_draft_len=2, synthetic_acceptance=0.5)
    engine = AsyncEngine(tiny_config(spec=spec, cache=CacheConfig(num_blocks=128)))
    body = {"prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    async with serve_engine(engine) as h:
        for alpha in (0.0, 0.9):
            resp = await h.client.post(
                "/v1/completions", json={**body, "synthetic_acceptance": alpha}
            )
            payload = await resp.json()
            assert resp.status == 200, payload
            assert payload["usage"]["completion_tokens"] == 4


@bounded(120)
async def test_streamed_token_ids_count_every_token_of_a_verify_step() -> None:
    """With speculation a chunk can carry several tokens; return_token_ids lets an HTTP client
    count them exactly (the benchmarks' ITL per token depends on it)."""
    spec = tiny_draft_spec(
        max_draft_len=3, initial_draft_len=3, synthetic_acceptance=1.0, controller=False
    )
    engine = AsyncEngine(tiny_config(spec=spec, cache=CacheConfig(num_blocks=128)))
    body = {"prompt": [1, 2, 3], "max_tokens": 13, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}  # fmt: skip
    async with serve_engine(engine) as h:
        full = await (await h.client.post("/v1/completions", json=body)).json()
        stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
        events = parse_sse(await (await h.client.post("/v1/completions", json=stream)).text())
    per_chunk = [c["choices"][0]["token_ids"] for c in events[:-1] if c["choices"]
                 if "token_ids" in c["choices"][0]]  # fmt: skip
    assert max(map(len, per_chunk)) > 1  # a verify step's tokens in one chunk
    assert [t for ids in per_chunk for t in ids] == full["choices"][0]["token_ids"]
    assert len(full["choices"][0]["token_ids"]) == 13 == events[-2]["usage"]["completion_tokens"]
    assert full["choices"][0]["prompt_token_ids"] == [1, 2, 3]
