"""Poisoned bodies sent together with ordinary requests, against the real engine (CPU, dummy
weights): every poisoned body gets a 400 in the OpenAI shape, every ordinary request gets the
same greedy output it gets alone, and nothing is left running or holding KV blocks."""

from __future__ import annotations

import asyncio
import itertools

from helpers import tiny_config
from server_utils import Harness, bounded, parse_sse, serve_engine
from test_serve_limits import assert_openai_error

from verifypd.config import CacheConfig
from verifypd.lanes.async_engine import AsyncEngine

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
VOCAB = 512  # dummy:tiny
ORDINARY = [
    (COMPLETIONS, {"prompt": "Hello there", "max_tokens": 8, "temperature": 0}),
    (COMPLETIONS, {"prompt": [5, 6, 7, 8, 9], "max_tokens": 6, "temperature": 0, "n": 2}),
    (CHAT, {"messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 8, "temperature": 0}),
    (COMPLETIONS, {"prompt": "Count: 1 2 3", "max_tokens": 8, "temperature": 0, "stream": True}),
]
# From issue 12: each of these failed every request that shared its step (500s).
ISSUE_BODIES = [
    {"prompt": "Hi", "max_tokens": 2, "temperature": 1, "top_k": 9223372036854775808},
    {"prompt": "Hi", "max_tokens": 2, "seed": 9223372036854775808, "n": 2},
    {"prompt": "Hi", "n": 16, "max_tokens": 1000, "ignore_eos": True},  # over its KV share
    {"prompt": "Hi", "max_tokens": 2, "priority": 1e30},
    {"prompt": "Hi", "n": 64, "max_tokens": 10**9},
]
NUMERIC_FIELDS = ["max_tokens", "temperature", "top_p", "top_k", "n", "best_of", "seed",
                  "priority", "max_completion_tokens", "stop_token_ids", "prompt"]  # fmt: skip
EXTREMES = [2**63, 2**64, -(2**63) - 1, 10**30, 1e308, -1e308, float("nan"), float("inf"),
            float("-inf")]  # fmt: skip


def _extreme_bodies() -> list[tuple[str, dict, str]]:
    """Every numeric field at its type's extremes, on both endpoints (list fields hold it)."""
    bodies = []
    for field, value in itertools.product(NUMERIC_FIELDS, EXTREMES):
        value = [value] if field in ("stop_token_ids", "prompt") else value
        if field != "max_completion_tokens":
            bodies.append((COMPLETIONS, {"prompt": "Hi", "max_tokens": 2, field: value}, field))
        if field not in ("prompt", "best_of"):
            chat = {"messages": [{"role": "user", "content": "Hi"}], field: value}
            bodies.append((CHAT, chat, field))
    return bodies


def _poisoned() -> list[tuple[str, dict, str | None]]:
    return [(COMPLETIONS, b, None) for b in ISSUE_BODIES] + _extreme_bodies() + [
        (COMPLETIONS, {"prompt": [VOCAB], "max_tokens": 2}, "prompt"),
        (COMPLETIONS, {"prompt": "Hi", "max_tokens": 2, "stop_token_ids": [VOCAB]},
         "stop_token_ids"),
        (COMPLETIONS, {"prompt": "Hi", "max_tokens": 2, "top_k": VOCAB + 1}, "top_k"),
    ]  # fmt: skip


async def _send(h: Harness, path: str, body: dict) -> tuple[int, object]:
    """(status, the choices' (text or message, finish_reason)) or (status, error body)."""
    resp = await h.client.post(path, json=body)
    if resp.status == 200 and body.get("stream"):
        events = [e for e in parse_sse(await resp.text()) if isinstance(e, dict)]
        choices = [c for e in events for c in e["choices"]]
        text = "".join(c["text"] for c in choices)
        return 200, [(text, choices[-1]["finish_reason"])]
    payload = await resp.json()
    if resp.status == 200:  # ids and timestamps differ between runs: keep the choices
        choices = payload["choices"]
        return 200, [(c.get("text") or c.get("message"), c["finish_reason"]) for c in choices]
    return resp.status, payload


@bounded(120)
async def test_poisoned_bodies_never_touch_their_batch_mates() -> None:
    config = tiny_config(cache=CacheConfig(num_blocks=256))
    engine = AsyncEngine(config)
    async with serve_engine(engine) as h:
        alone = [await _send(h, path, body) for path, body in ORDINARY]
        assert all(status == 200 for status, _ in alone), alone
        poisoned = _poisoned()
        jobs = [_send(h, path, body) for path, body in ORDINARY]
        jobs += [_send(h, path, body) for path, body, _ in poisoned]
        results = await asyncio.gather(*jobs)
        together, refused = results[: len(ORDINARY)], results[len(ORDINARY) :]
        for (status, out), (_, ref) in zip(together, alone, strict=True):
            assert status == 200
            assert out == ref
        for (status, body), (path, sent, field) in zip(refused, poisoned, strict=True):
            assert_openai_error(status, body, 400, field), (path, sent)
        await h.wait_engine_idle()
        engine.check_integrity()
        assert engine.kv_usage == 0 and engine.num_running == engine.num_waiting == 0
