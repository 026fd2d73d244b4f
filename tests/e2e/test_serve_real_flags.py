"""The server against the REAL engine (``verifypd serve --model default --device cpu``:
SmolLM2-135M, fp32, in a subprocess) started with the flags the shared server of
test_serve_real_api.py cannot have: decode-ahead (the disconnect storm under steps launched
ahead), the engine in its own process, prompts inside decode steps, a queue of 2 then a graceful
SIGTERM (one server, one test), a SIGTERM past a 2 s drain with one sequence at a time, and
n-gram speculation. Where a test compares text, the reference is the plain module server (the
``server`` fixture of conftest.py). A start-up costs a Python start and a model load, so tests
share servers where their flags allow. Every test is bounded in time; the engine runs at some
tens of tokens per second on 2 shared cores, so completions stay short.
"""

from __future__ import annotations

import asyncio
import signal
import time

import aiohttp
import pytest
from helpers import ServerProcess, bounded, parse_sse, read_event, smollm_server
from serve_real_helpers import (
    FRANCE,
    MAIN_ARGS,
    MAX_MODEL_LEN,
    MODEL,
    STORY,
    TIMEOUT,
    client_for,
    complete,
    disconnect_storm,
    metrics,
    story,
    wait_idle,
)

pytestmark = pytest.mark.slow


@bounded(180)
async def test_disconnect_storm_with_decode_ahead_frees_every_block() -> None:
    """The disconnect storm of test_serve_real_api.py with decode-ahead on (a GPU default; here
    every other decode step runs ahead): aborts and preemptions under steps launched ahead lose
    and leak nothing."""
    env = {"VERIFYPD_DECODE_AHEAD": "1"}
    with smollm_server(*MAIN_ARGS, env=env) as proc:
        await disconnect_storm(proc)
        async with aiohttp.ClientSession(proc.url, timeout=TIMEOUT) as session:
            assert (await metrics(session))["verifypd_decode_ahead_steps_total"] > 0
        assert proc.stop(timeout=30) == 0


@bounded(240)
async def test_engine_process_serves_the_same_text_and_survives_the_storm(
    server: ServerProcess,
) -> None:
    """``--engine-process`` on the real model (its Hugging Face tokenizer crosses to the front
    once): the module server's greedy answer word for word, then the disconnect storm (aborts,
    preemptions, prefix-cache reuse) leaves every block free, then SIGTERM exits 0."""
    async with aiohttp.ClientSession(server.url, timeout=TIMEOUT) as session:
        expected = await complete(session, story(99))
    with smollm_server(*MAIN_ARGS, "--engine-process") as proc:
        async with aiohttp.ClientSession(proc.url, timeout=TIMEOUT) as session:
            got = await complete(session, story(99))
            assert got["choices"][0]["text"] == expected["choices"][0]["text"]
            await wait_idle(session)
        await disconnect_storm(proc)
        async with aiohttp.ClientSession(proc.url, timeout=TIMEOUT) as session:
            assert (await metrics(session))["verifypd_engine_loop_lag_seconds_count"] > 0
        assert proc.stop(timeout=30) == 0


@bounded(240)
async def test_prompts_inside_decode_steps_through_the_server(server: ServerProcess) -> None:
    """Prompts riding in decode steps (a GPU default; here their steps run eagerly,
    ``VERIFYPD_PROMPT_IN_DECODE_EAGER``) with decode-ahead: the storm's aborts and preemptions
    lose and leak nothing (whether a storm prompt rides depends on the machine's speed; the
    engine tests abort one inside a step), and greedy requests asking for log-probs, arriving
    while a long stream decodes, ride in its steps and get the tokens and log-probs the
    module's server gives them one at a time."""
    env = {"VERIFYPD_DECODE_AHEAD": "1", "VERIFYPD_PROMPT_IN_DECODE_EAGER": "1"}
    payloads = [{**story(i), "max_tokens": 12, "logprobs": 2} for i in range(6)]
    sizes = ("--prompt-in-decode-tokens", "64,96,128,160,192,224,256")
    with smollm_server(*MAIN_ARGS, *sizes, env=env) as proc:
        await disconnect_storm(proc)
        async with aiohttp.ClientSession(proc.url, timeout=TIMEOUT) as session:
            before = (await metrics(session))["verifypd_prompts_in_decode_total"]
            got = await beside_a_long_stream(session, payloads)
            assert (await metrics(session))["verifypd_prompts_in_decode_total"] > before
            await wait_idle(session)  # the long stream, dropped, freed its blocks
        assert proc.stop(timeout=30) == 0
    async with aiohttp.ClientSession(server.url, timeout=TIMEOUT) as session:
        want = [await complete(session, payload) for payload in payloads]
    for a, b in zip(got, want, strict=True):
        a, b = a["choices"][0], b["choices"][0]
        assert a["text"] == b["text"] and a["logprobs"]["tokens"] == b["logprobs"]["tokens"]
        assert a["logprobs"]["token_logprobs"] == pytest.approx(b["logprobs"]["token_logprobs"],
                                                                abs=1e-3)  # fmt: skip


async def beside_a_long_stream(session: aiohttp.ClientSession, payloads: list[dict]) -> list:
    """Completes ``payloads`` (0.1 s apart) while a long stream decodes, so each arrives
    beside a decode step whichever the machine's speed; the stream is then dropped."""
    long = {"prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True, "stream": True}
    resp = await session.post("/v1/completions", json=long)
    try:
        assert resp.status == 200 and (await read_event(resp)).startswith(b"data: ")
        tasks = []
        for payload in payloads:
            tasks.append(asyncio.create_task(complete(session, payload)))
            await asyncio.sleep(0.1)
        got = await asyncio.gather(*tasks)  # 72 tokens, well within the stream's 200
    finally:
        resp.close()
    return got


@bounded(180)
async def test_overload_429_then_recovers_then_sigterm_drains_in_flight_stream() -> None:
    """One server (a start-up is a model load) for both: a queue of 2 answers the third
    request 429 and recovers; then SIGTERM drains the stream in flight and refuses new work."""
    with smollm_server("--max-queue", "2", "--drain-timeout", "30") as proc:
        async with aiohttp.ClientSession(proc.url, timeout=TIMEOUT) as session:
            await assert_overload_429_then_recovers(session)
            await assert_sigterm_drains_in_flight_stream(session, proc)


async def assert_overload_429_then_recovers(session: aiohttp.ClientSession) -> None:
    slow = {"prompt": "Once upon a time", "max_tokens": 32, "stream": True, "ignore_eos": True}
    streams = [await session.post("/v1/completions", json=slow) for _ in range(2)]
    for resp in streams:
        assert resp.status == 200 and (await read_event(resp)).startswith(b"data: ")
    for path, body in (
        ("/v1/completions", {"prompt": "x", "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": FRANCE, "max_tokens": 2}),
        ("/v1/completions", {"prompt": "x", "max_tokens": 2, "stream": True}),
    ):
        async with session.post(path, json=body) as resp:
            assert resp.status == 429 and resp.headers["Retry-After"] == "1"
            assert (await resp.json())["error"]["type"] == "rate_limit_error"
    async with session.get("/health") as resp:
        assert resp.status == 200
    for resp in streams:
        events = parse_sse((await resp.read()).decode())
        assert events[-1] == "[DONE]"
        assert events[-2]["choices"][0]["finish_reason"] == "length"
    async with session.post("/v1/completions", json={"prompt": "x", "max_tokens": 3}) as r:
        assert r.status == 200
        assert (await r.json())["usage"]["completion_tokens"] <= 3


async def assert_sigterm_drains_in_flight_stream(
    session: aiohttp.ClientSession, proc: ServerProcess
) -> None:
    payload = {"messages": STORY, "max_tokens": 48, "stream": True, "ignore_eos": True}
    resp = await session.post("/v1/chat/completions", json=payload)
    first = await read_event(resp)
    proc.proc.send_signal(signal.SIGTERM)
    started = time.monotonic()
    await asyncio.sleep(0.2)
    async with session.get("/health") as health:
        assert health.status == 503 and (await health.json())["status"] == "draining"
    async with session.post("/v1/completions", json={"prompt": "x"}) as refused:
        assert refused.status == 503 and "Retry-After" in refused.headers
    events = parse_sse((first + await resp.read()).decode())
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
    rc = await asyncio.to_thread(proc.proc.wait, 30)
    assert rc == 0 and time.monotonic() - started < 30


@bounded(90)
async def test_sigterm_past_drain_timeout_aborts_cleanly() -> None:
    with smollm_server("--drain-timeout", "2", "--max-num-seqs", "1") as proc:
        async with aiohttp.ClientSession(proc.url, timeout=TIMEOUT) as session:
            long = {"prompt": "Once upon a time", "max_tokens": 4000, "stream": True,
                    "ignore_eos": True}  # fmt: skip
            resp = await session.post("/v1/completions", json=long)
            first = await read_event(resp)
            queued = asyncio.create_task(  # waits in the engine behind the long stream
                session.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4000})
            )
            await asyncio.sleep(0.5)
            proc.proc.send_signal(signal.SIGTERM)
            started = time.monotonic()
            events = parse_sse((first + await resp.read()).decode())
            assert events[-1] == "[DONE]" and events[-2]["error"]["type"] == "server_error"
            assert "shutting down" in events[-2]["error"]["message"]
            refused = await queued
            assert refused.status == 503 and "Retry-After" in refused.headers
            refused.close()
        rc = await asyncio.to_thread(proc.proc.wait, 30)
        assert rc == 0 and time.monotonic() - started < 2 + 5 + 3


@bounded(90)
async def test_ngram_speculation_through_the_server_is_lossless(server: ServerProcess) -> None:
    prompts = [
        "Repeat exactly: the cat sat on the mat, the cat sat on the mat, the cat sat on the mat",
        "List the numbers from 1 to 20, separated by commas.",
    ]
    requests = [
        {"model": MODEL, "temperature": 0, "max_tokens": 40,
         "messages": [{"role": "user", "content": prompt}]}
        for prompt in prompts
    ]  # fmt: skip
    plain = client_for(server)
    wanted = [
        (await plain.chat.completions.create(**r)).choices[0].message.content for r in requests
    ]
    await plain.close()
    # A fixed L: how long the controller keeps speculation on depends on measured step times.
    spec = ("--spec", "ngram", "--draft-len", "3")
    with smollm_server(*spec, "--max-model-len", str(MAX_MODEL_LEN)) as proc:
        client = client_for(proc)
        async with aiohttp.ClientSession(proc.url, timeout=TIMEOUT) as session:
            # A long neighbour decodes alongside (plainly whenever it has no n-gram match):
            # drafted sequences must not wait behind it (see test_dispatcher for the exact case).
            story = {"messages": STORY, "max_tokens": 200, "stream": True, "ignore_eos": True}
            neighbour = await session.post("/v1/chat/completions", json=story)
            await read_event(neighbour)
            for request, want in zip(requests, wanted, strict=True):
                got = await client.chat.completions.create(**request)
                assert got.choices[0].message.content == want
                stream = await client.chat.completions.create(**request, stream=True)
                assert "".join([c.choices[0].delta.content or "" async for c in stream]) == want
            assert not neighbour.content.at_eof()  # done while the neighbour still decodes
            neighbour.close()
            m = await metrics(session)
        assert m["verifypd_spec_accepted_tokens_total"] > 0
        assert m['verifypd_lane_step_seconds_count{lane="verify"}'] > 0
        await client.close()
        assert proc.stop(timeout=30) == 0
