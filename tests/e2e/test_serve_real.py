"""The server against the REAL engine: ``python -m verifypd serve --model default --device cpu``
(SmolLM2-135M, fp32) in a subprocess, driven by the official ``openai`` client and raw aiohttp.

One server per module serves the API tests (``--max-model-len 256``); more start for the flags
it cannot have: a queue of 2 then a graceful SIGTERM (one server, one test), a SIGTERM past a
2 s drain with one sequence at a time, n-gram speculation, decode-ahead, prompts inside decode
steps and the engine in its own process. A start-up costs
a Python start and a model load, so tests share servers where their flags allow. Every test is
bounded in time; the engine runs at some tens of tokens per second on 2 shared cores, so
completions stay short.
"""

from __future__ import annotations

import asyncio
import random
import re
import signal
import time
from collections.abc import Iterator

import aiohttp
import openai
import pytest
from helpers import ServerProcess, bounded, parse_sse, read_event, smollm_server

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 256
NUM_KV_BLOCKS = 48  # 768 tokens: the disconnect storm needs more, so the engine preempts
MAIN_ARGS = ("--max-model-len", str(MAX_MODEL_LEN), "--num-kv-blocks", str(NUM_KV_BLOCKS),
             "--max-queue", "64")  # fmt: skip
MODEL = "SmolLM2-135M-Instruct"
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
STORY = [{"role": "user", "content": "Tell me a long story about a dragon."}]
TIMEOUT = aiohttp.ClientTimeout(total=60)
ABORTED = 'verifypd_requests_finished_total{reason="abort"}'


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with smollm_server(*MAIN_ARGS) as proc:
        yield proc
        assert proc.stop(timeout=30) == 0


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


# -- the openai client ---------------------------------------------------------------------


@bounded(60)
async def test_capital_of_france_greedy_stream_and_not(server: ServerProcess) -> None:
    client = client_for(server)
    chat = await client.chat.completions.create(
        model=MODEL, messages=FRANCE, temperature=0, max_tokens=24
    )
    text = chat.choices[0].message.content
    assert "Paris" in text and chat.choices[0].finish_reason == "stop"
    assert chat.model == MODEL and chat.choices[0].message.role == "assistant"
    stream = await client.chat.completions.create(
        model=MODEL, messages=FRANCE, temperature=0, max_tokens=24, stream=True
    )
    chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert [c.choices[0].finish_reason for c in chunks][-1] == "stop"
    await client.close()


@bounded(60)
async def test_completions_max_tokens_is_length(server: ServerProcess) -> None:
    client = client_for(server)
    kwargs = {"model": MODEL, "prompt": "Once upon a time", "temperature": 0, "max_tokens": 9}
    done = await client.completions.create(**kwargs)
    assert done.choices[0].finish_reason == "length" and done.usage.completion_tokens == 9
    assert done.usage.prompt_tokens == 4 and done.usage.total_tokens == 13
    stream = await client.completions.create(**kwargs, stream=True)
    chunks = [chunk async for chunk in stream]
    assert "".join(c.choices[0].text for c in chunks) == done.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"
    chat = await client.chat.completions.create(
        model=MODEL, messages=STORY, temperature=0, max_tokens=7
    )
    assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 7
    await client.close()


@bounded(60)
async def test_stop_strings_are_cut_and_never_streamed(server: ServerProcess) -> None:
    client = client_for(server)
    greedy = await client.chat.completions.create(
        model=MODEL, messages=FRANCE, temperature=0, max_tokens=24
    )
    full = greedy.choices[0].message.content
    assert "France is" in full  # "The capital of France is Paris."
    for stop in (["France is"], ["xyz", "Paris"]):
        cut = full[: min(full.index(s) for s in stop if s in full)]
        chat = await client.chat.completions.create(
            model=MODEL, messages=FRANCE, temperature=0, max_tokens=24, stop=stop
        )
        assert chat.choices[0].message.content == cut
        assert chat.choices[0].finish_reason == "stop"
        stream = await client.chat.completions.create(
            model=MODEL, messages=FRANCE, temperature=0, max_tokens=24, stop=stop, stream=True
        )
        chunks = [chunk async for chunk in stream]
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == cut
        assert chunks[-1].choices[0].finish_reason == "stop"
    await client.close()


@bounded(90)
async def test_seed_reproducible_and_independent_of_batch_mates(server: ServerProcess) -> None:
    client = client_for(server)

    async def sample(seed: int) -> str:
        done = await client.completions.create(
            model=MODEL, prompt="My favourite animal is", temperature=0.8, seed=seed,
            max_tokens=16,
        )  # fmt: skip
        return done.choices[0].text

    alone = await sample(1234)
    together = await asyncio.gather(sample(1234), *(sample(s) for s in range(1, 5)))
    assert together[0] == alone
    assert len(set(together)) >= 3  # different seeds -> (almost always) different text
    await client.close()


@bounded(60)
async def test_include_usage_matches_non_streamed_usage(server: ServerProcess) -> None:
    client = client_for(server)
    kwargs = {"model": MODEL, "messages": FRANCE, "temperature": 0, "max_tokens": 24}
    done = await client.chat.completions.create(**kwargs)
    stream = await client.chat.completions.create(
        **kwargs, stream=True, stream_options={"include_usage": True}
    )
    chunks = [chunk async for chunk in stream]
    assert all(c.usage is None for c in chunks[:-1])
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.prompt_tokens == done.usage.prompt_tokens
    assert last.usage.completion_tokens == done.usage.completion_tokens
    assert last.usage.total_tokens == done.usage.total_tokens
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == done.choices[0].message.content
    await client.close()


@bounded(60)
async def test_n_choices(server: ServerProcess) -> None:
    client = client_for(server)
    chat = await client.chat.completions.create(
        model=MODEL, messages=STORY, temperature=0.8, seed=7, max_tokens=8, n=3
    )
    assert [c.index for c in chat.choices] == [0, 1, 2]
    assert all(c.finish_reason == "length" for c in chat.choices)
    assert chat.usage.completion_tokens == 24
    assert len({c.message.content for c in chat.choices}) >= 2
    stream = await client.completions.create(
        model=MODEL, prompt="Once upon a time", temperature=0.8, max_tokens=6, n=2, stream=True
    )
    finished = {}
    async for chunk in stream:
        for choice in chunk.choices:
            assert choice.index in (0, 1)
            if choice.finish_reason is not None:
                finished[choice.index] = choice.finish_reason
    assert finished == {0: "length", 1: "length"}
    await client.close()


# -- errors --------------------------------------------------------------------------------


@bounded(30)
async def test_errors(server: ServerProcess) -> None:
    client = client_for(server)
    with pytest.raises(openai.BadRequestError) as too_long:
        await client.completions.create(model=MODEL, prompt="hello " * 300, max_tokens=5)
    assert too_long.value.param == "prompt" and str(MAX_MODEL_LEN) in too_long.value.message
    assert int(re.search(r"prompt has (\d+) tokens", too_long.value.message)[1]) > 300
    with pytest.raises(openai.BadRequestError) as chat_too_long:
        await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hello " * 300}]
        )
    assert chat_too_long.value.param == "messages"
    with pytest.raises(openai.BadRequestError) as too_many:
        await client.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=1000)
    assert str(MAX_MODEL_LEN) in too_many.value.message and "1000" in too_many.value.message
    with pytest.raises(openai.NotFoundError) as missing:
        await client.completions.create(model="gpt-9", prompt="x")
    assert missing.value.code == "model_not_found" and missing.value.param == "model"
    bad_values = {"temperature": "hot", "max_tokens": "5", "n": 0, "stop": 3, "seed": 1.5}
    for field, value in bad_values.items():
        with pytest.raises(openai.BadRequestError) as bad:
            await client.completions.create(model=MODEL, prompt="x", extra_body={field: value})
        assert bad.value.param == field and bad.value.type == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as bad:
        await client.chat.completions.create(model=MODEL, messages="hi")
    assert bad.value.param == "messages"
    ok = await client.completions.create(model=MODEL, prompt="x", max_tokens=2)
    assert ok.usage.completion_tokens <= 2
    await client.close()


# -- disconnects, overload, shutdown (raw aiohttp) --------------------------------------------


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


@bounded(120)
async def test_disconnect_storm_frees_every_block(server: ServerProcess) -> None:
    await disconnect_storm(server)


@bounded(180)
async def test_disconnect_storm_with_decode_ahead_frees_every_block() -> None:
    """The same storm with decode-ahead on (a GPU default; here every other decode step runs
    ahead): aborts and preemptions under steps launched ahead lose and leak nothing."""
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


@bounded(60)
async def test_lone_disconnect_frees_blocks_in_metrics(server: ServerProcess) -> None:
    # No step runs after the abort: /metrics must still show the blocks back at once.
    async with aiohttp.ClientSession(server.url, timeout=TIMEOUT) as session:
        start = await wait_idle(session)
        payload = {"messages": STORY, "max_tokens": 200, "stream": True, "ignore_eos": True}
        resp = await session.post("/v1/chat/completions", json=payload)
        for _ in range(4):
            await read_event(resp)
        busy = await metrics(session)
        assert busy["verifypd_kv_blocks_free"] < start["verifypd_kv_blocks_free"]
        assert busy["verifypd_kv_cache_usage_ratio"] > 0
        resp.close()
        await wait_idle(session, 5)  # at once: no step follows the abort


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


@bounded(90)
async def test_huge_prompt_does_not_stall_other_streams(server: ServerProcess) -> None:
    async with aiohttp.ClientSession(server.url, timeout=TIMEOUT) as session:
        story = {"messages": STORY, "max_tokens": 200, "stream": True, "ignore_eos": True}
        resp = await session.post("/v1/chat/completions", json=story)
        await read_event(resp)
        huge = {"prompt": "hello world, this is a test. " * 100_000, "max_tokens": 5}  # 2.9 MB
        started = time.monotonic()
        task = asyncio.create_task(session.post("/v1/completions", json=huge))
        gaps, last = [], time.monotonic()
        # Refused before tokenizing (--max-prompt-chars); whatever it takes, tokens keep
        # streaming meanwhile.
        while not task.done():
            await read_event(resp)
            gaps.append(time.monotonic() - last)
            last = time.monotonic()
        took = time.monotonic() - started
        rejected = task.result()
        assert rejected.status == 400 and (await rejected.json())["error"]["param"] == "prompt"
        resp.close()
        longest = max(gaps, default=0.0)
        assert longest < 1.0, f"a stream stalled for {longest:.2f}s (request took {took:.2f}s)"


@bounded(60)
async def test_metrics_account_for_each_request(server: ServerProcess) -> None:
    client = client_for(server)
    assert [(m.id, m.max_model_len) for m in (await client.models.list()).data] == [
        (MODEL, MAX_MODEL_LEN)
    ]
    async with aiohttp.ClientSession(server.url, timeout=TIMEOUT) as session:
        before = await wait_idle(session)  # earlier tests' aborted requests are accounted
        done = await client.chat.completions.create(
            model=MODEL, messages=STORY, temperature=0, max_tokens=12, n=2
        )
        after = await metrics(session)
    delta = {k: after[k] - before.get(k, 0) for k in after}
    assert delta["verifypd_generation_tokens_total"] == done.usage.completion_tokens == 24
    assert delta["verifypd_prompt_tokens_total"] == 2 * done.usage.prompt_tokens  # per choice
    assert delta['verifypd_requests_finished_total{reason="length"}'] == 2
    assert delta["verifypd_time_to_first_token_seconds_count"] == 2
    assert delta["verifypd_e2e_request_latency_seconds_count"] == 2
    assert delta["verifypd_inter_token_latency_seconds_count"] == 2 * 11
    assert delta['verifypd_lane_step_seconds_count{lane="decode"}'] >= 11
    assert delta["verifypd_prefix_cache_queries_total"] >= done.usage.prompt_tokens
    await client.close()
