"""What the real-server tests share (tests/e2e/test_serve_real_*.py and the ``server`` fixture of
conftest.py): the module server's arguments and the API's constants, an ``openai`` client for a
server, its ``verifypd_*`` metrics, waiting until it is idle with every KV block free, the greedy
story completions, and the disconnect storm (clients reading their whole streams beside clients
that go away at different moments) with its checks."""

from __future__ import annotations

import asyncio
import random
import re
import time

import aiohttp
import openai
from helpers import ServerProcess, parse_sse, read_event

MAX_MODEL_LEN = 256
NUM_KV_BLOCKS = 48  # 768 tokens: the disconnect storm needs more, so the engine preempts
MAIN_ARGS = ("--max-model-len", str(MAX_MODEL_LEN), "--num-kv-blocks", str(NUM_KV_BLOCKS),
             "--max-queue", "64")  # fmt: skip
MODEL = "SmolLM2-135M-Instruct"
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
STORY = [{"role": "user", "content": "Tell me a long story about a dragon."}]
TIMEOUT = aiohttp.ClientTimeout(total=60)
ABORTED = 'verifypd_requests_finished_total{reason="abort"}'


def client_for(server: ServerProcess) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60
    )


async def metrics(session: aiohttp.ClientSession) -> dict[str, float]:
    """``verifypd_*`` samples of /metrics keyed by name plus labels other than ``model``."""
    async with session.get("/metrics") as resp:
        text = await resp.text()
    samples = {}
    for line in text.splitlines():
        match = re.match(r"^(verifypd_\w+)(?:\{(.*)\})? (\S+)$", line)
        if match:
            labels = ",".join(p for p in (match[2] or "").split(",") if not p.startswith("model="))
            samples[match[1] + (f"{{{labels}}}" if labels else "")] = float(match[3])
    return samples


async def wait_idle(session: aiohttp.ClientSession, timeout: float = 30) -> dict:
    """Poll /metrics until nothing runs or waits and every KV block of the module's server is
    free again (prefix-cached blocks count as free: they are evictable)."""
    deadline = time.monotonic() + timeout
    while True:
        m = await metrics(session)
        idle = m["verifypd_num_requests_running"] == m["verifypd_num_requests_waiting"] == 0
        all_free = m["verifypd_kv_blocks_free"] == NUM_KV_BLOCKS
        if idle and all_free and m["verifypd_kv_cache_usage_ratio"] == 0:
            return m
        assert time.monotonic() < deadline, f"engine did not settle: {m}"
        await asyncio.sleep(0.2)


def story(i: int) -> dict:
    """A greedy completion that runs to max_tokens: its text is a function of its prompt."""
    prompt = (
        f"Story number {i}. Once upon a time, in a small village at the edge of a great "
        "forest, there lived an old clockmaker and his"
    )  # > 2 KV blocks of 16 tokens
    return {"prompt": prompt, "max_tokens": 40, "temperature": 0, "ignore_eos": True}


async def full_stream(session: aiohttp.ClientSession, i: int) -> str:
    """A client that reads its whole stream; returns the text."""
    async with session.post("/v1/completions", json={**story(i), "stream": True}) as resp:
        assert resp.status == 200
        events = parse_sse(await resp.text())
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
    return "".join(e["choices"][0]["text"] for e in events[:-1])


async def dropped(session: aiohttp.ClientSession, i: int, rng: random.Random) -> str:
    """A client that goes away: before its first token, mid-stream, or while a non-streamed
    request runs (n = 2 for a third of them)."""
    payload = {
        "messages": [{"role": "user", "content": f"Count to {100 + i}."}], "max_tokens": 64,
        "ignore_eos": True, "n": 2 if i % 3 == 2 else 1, "stream": i % 4 != 3,
    }  # fmt: skip
    if i % 4 in (1, 3):  # cancel the request itself: before headers, or non-streamed
        task = asyncio.create_task(session.post("/v1/chat/completions", json=payload))
        await asyncio.sleep(rng.uniform(0.0, 0.3) if i % 4 == 1 else rng.uniform(0.3, 1.5))
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        if not task.cancelled():  # it got its answer first
            task.result().close()
            return "answered"
        return "before first token" if payload["stream"] else "non-streamed"
    resp = await session.post("/v1/chat/completions", json=payload)
    for _ in range(rng.randint(2, 12)):
        await read_event(resp)
    resp.close()
    return "mid-stream"


async def disconnect_storm(server: ServerProcess) -> None:
    rng = random.Random(0)
    async with aiohttp.ClientSession(server.url, timeout=TIMEOUT) as session:
        start = await wait_idle(session)
        kept = [asyncio.create_task(full_stream(session, i)) for i in range(12)]
        moments = await asyncio.gather(*(dropped(session, i, rng) for i in range(12)))
        texts = await asyncio.gather(*kept)
        assert {"mid-stream", "before first token", "non-streamed"} <= set(moments)
        end = await wait_idle(session)
        num_aborted = end[ABORTED] - start[ABORTED]
        assert 4 <= num_aborted <= 12 + 4  # the mid-stream ones surely; at most every choice
        assert end['verifypd_requests_finished_total{reason="error"}'] == 0
        assert end["verifypd_preemptions_total"] > start["verifypd_preemptions_total"]
        # The KV blocks that the aborted requests gave back were reused by the kept streams
        # and are now prefix-cached: the same prompts again (cache hits) give the same text.
        again = await asyncio.gather(*(complete(session, story(i)) for i in range(12)))
        assert [body["choices"][0]["text"] for body in again] == texts
        assert sum(body["usage"]["prompt_tokens_details"]["cached_tokens"] for body in again)
        await wait_idle(session)


async def complete(session: aiohttp.ClientSession, payload: dict) -> dict:
    async with session.post("/v1/completions", json=payload) as resp:
        assert resp.status == 200
        return await resp.json()
