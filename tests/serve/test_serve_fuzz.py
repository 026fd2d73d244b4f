"""Hypothesis fuzz of /v1/completions and /v1/chat/completions: bodies of valid, extreme and
wrong-typed fields (and bodies that are not JSON objects at all). Every answer is a 2xx or a 4xx;
every 4xx is in the OpenAI error shape; a 200 stream carries no error event; afterwards nothing
runs or waits and every KV block is free. Against the FakeEngine (a few thousand bodies) and
the real engine with dummy weights (a few hundred)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import pytest
from fake_engine import FakeEngine
from helpers import tiny_config
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_utils import Harness, parse_sse, serve_engine

from verifypd.config import CacheConfig, SchedulerConfig
from verifypd.lanes.async_engine import AsyncEngine

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
TEXT = st.text(min_size=1, max_size=12)
# Valid values (kept small: a fuzz of limits, not of throughput)...
VALID = {
    "max_tokens": st.integers(1, 6),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(-1, 100),
    "n": st.integers(1, 3),
    "seed": st.integers(-(2**63), 2**63 - 1),
    "stop": st.one_of(TEXT, st.lists(TEXT, max_size=4)),
    "stop_token_ids": st.lists(st.integers(0, 300), max_size=3),
    "stream": st.booleans(),
    "ignore_eos": st.booleans(),
}
PROMPT = st.one_of(st.text(min_size=1, max_size=20), st.lists(st.integers(1, 300), min_size=1))
MESSAGES = st.lists(st.fixed_dictionaries({"role": st.just("user"), "content": TEXT}), min_size=1)
# ... and wild ones: a type's extremes, wrong types, anything.
EXTREME_NUMBERS = st.sampled_from(
    [
        2**63,
        2**64,
        -(2**63) - 1,
        10**30,
        1e308,
        -1e308,
        float("nan"),
        float("inf"),
        [2**63],
        [-1],
        [10**30],
    ]
)
WILD = st.one_of(
    EXTREME_NUMBERS,
    st.sampled_from([-1, 0, 1.5, "7", True, None, [], {}]),
    st.integers(),
    st.floats(),
    st.text(max_size=5),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
WILD_FIELDS = [
    *VALID,
    "model",
    "priority",
    "stream_options",
    "logit_bias",
    "presence_penalty",
    "best_of",
    "echo",
    "logprobs",
    "top_logprobs",
    "max_completion_tokens",
    "tools",
    "prompt",
    "messages",
]
NUMERIC_FIELDS = ["max_tokens", "top_p", "top_k", "n", "seed", "priority", "best_of",
                  "stop_token_ids", "max_completion_tokens"]  # fmt: skip


def _bodies(prompt_field: str, prompt: st.SearchStrategy) -> st.SearchStrategy[dict]:
    """A valid body with up to two fields set to wild values; or a sampled (not greedy) one,
    so that the sampler sees its values, with one or two numeric fields at their extremes."""
    valid = st.fixed_dictionaries({prompt_field: prompt}, optional=VALID)
    wild = st.dictionaries(st.sampled_from(WILD_FIELDS), WILD, max_size=2)
    sampled = st.fixed_dictionaries({prompt_field: prompt, "temperature": st.floats(0.5, 1.5)})
    extreme = st.dictionaries(st.sampled_from(NUMERIC_FIELDS), EXTREME_NUMBERS, min_size=1,
                              max_size=2)  # fmt: skip
    merged = st.one_of(st.tuples(valid, wild), st.tuples(sampled, extreme))
    return merged.map(lambda pair: {**pair[0], **pair[1]})


BODIES = {COMPLETIONS: _bodies("prompt", PROMPT), CHAT: _bodies("messages", MESSAGES)}
NOT_OBJECTS = st.one_of(st.binary(max_size=20), st.just(b"[1, 2]"), st.just(b'"x"'))


def _case(path: str) -> st.SearchStrategy[tuple[str, bytes]]:
    bodies = BODIES[path].map(lambda b: _bounded(b).encode())
    body = st.integers(0, 9).flatmap(lambda k: NOT_OBJECTS if k == 0 else bodies)
    return st.tuples(st.just(path), body)


def _bounded(body: dict) -> str:
    """Keeps valid requests short (a fuzz of limits, not of throughput): no default
    max_tokens (the rest of the context), and none in (6, 10_000) (larger ones never fit)."""
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = 6
    for field in ("max_tokens", "max_completion_tokens"):
        value = body.get(field)
        if type(value) is int and 6 < value < 10_000:
            body[field] = 6
    return json.dumps(body)


async def _check(h: Harness, path: str, data: bytes) -> None:
    resp = await h.client.post(path, data=data, headers={"Content-Type": "application/json"})
    text = await resp.text()
    assert resp.status < 500, (resp.status, data, text)
    if resp.status >= 400:
        error = json.loads(text)["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], text
    elif resp.content_type == "text/event-stream":
        events = parse_sse(text)
        assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1]), text
    else:
        assert json.loads(text)["choices"], text


async def _check_all(h: Harness, cases: list[tuple[str, bytes]]) -> None:
    await asyncio.gather(*(_check(h, path, data) for path, data in cases))


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def _fuzz(loop: asyncio.AbstractEventLoop, engine: Any, num_batches: int, batch: int) -> None:
    """``num_batches`` examples of ``batch`` bodies each, sent together (batch-mates)."""
    serving = serve_engine(engine)
    h = loop.run_until_complete(serving.__aenter__())
    try:

        @settings(
            max_examples=num_batches,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(st.lists(st.one_of(_case(COMPLETIONS), _case(CHAT)), min_size=batch, max_size=batch))
        def together(cases: list[tuple[str, bytes]]) -> None:
            loop.run_until_complete(_check_all(h, cases))

        together()
        loop.run_until_complete(h.wait_engine_idle(timeout=10))
        engine.check_integrity()
        assert engine.num_running == engine.num_waiting == 0 and engine.kv_usage == 0
    finally:
        loop.run_until_complete(serving.__aexit__(None, None, None))


def test_fuzz_both_endpoints_on_the_fake_engine(loop: asyncio.AbstractEventLoop) -> None:
    _fuzz(loop, FakeEngine(step_s=0, max_num_seqs=64), num_batches=120, batch=20)


def test_fuzz_both_endpoints_on_the_real_engine(loop: asyncio.AbstractEventLoop) -> None:
    config = tiny_config(
        cache=CacheConfig(num_blocks=64), scheduler=SchedulerConfig(max_model_len=256)
    )
    _fuzz(loop, AsyncEngine(config), num_batches=30, batch=10)
