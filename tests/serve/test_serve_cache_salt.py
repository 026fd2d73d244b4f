"""vLLM's ``cache_salt`` over HTTP: a prompt cached under one salt is a prefix-cache hit only
for requests with the same salt (read off the engine's hit counter), and a salt that is not a
non-empty string is a 400 naming the field."""

from __future__ import annotations

import pytest
from helpers import bounded, tiny_config
from server_utils import serve_engine

from verifypd.config import CacheConfig
from verifypd.lanes.async_engine import AsyncEngine

PROMPT = list(range(1, 41))  # two full blocks of 16 tokens and a partial one


@bounded(120)
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_bad_salt_is_a_400_naming_the_field(path: str) -> None:
    engine = AsyncEngine(tiny_config(cache=CacheConfig(num_blocks=64)))
    body = {"max_tokens": 2}
    body |= {"prompt": "hi"} if "chat" not in path else {
        "messages": [{"role": "user", "content": "hi"}]
    }  # fmt: skip
    async with serve_engine(engine) as h:
        for salt in ("", 5, ["a"]):
            resp = await h.client.post(path, json={**body, "cache_salt": salt})
            payload = await resp.json()
            assert resp.status == 400, payload
            assert payload["error"]["param"] == "cache_salt", payload
        resp = await h.client.post(path, json={**body, "cache_salt": "tenant"})
        assert resp.status == 200, await resp.text()
        await h.wait_engine_idle()
        assert engine.kv_usage == 0


@bounded(120)
async def test_a_prompt_hits_only_under_its_own_salt() -> None:
    engine = AsyncEngine(tiny_config(cache=CacheConfig(num_blocks=64)))
    kv = engine.core.kv
    body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    hits = []
    async with serve_engine(engine) as h:
        for salt in ("a", "b", "a", None, None, "b"):
            sent = body if salt is None else {**body, "cache_salt": salt}
            before = kv.num_prefix_hit_tokens
            resp = await h.client.post("/v1/completions", json=sent)
            assert resp.status == 200, await resp.text()
            await h.wait_engine_idle()
            hits.append(kv.num_prefix_hit_tokens - before)
        assert engine.kv_usage == 0
    assert hits == [0, 0, 32, 0, 32, 32]
