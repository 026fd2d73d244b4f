"""The server against the REAL engine: ``python -m verifypd serve --model default --device cpu``
(SmolLM2-135M, fp32) in a subprocess, driven by the official ``openai`` client and raw aiohttp.

One server per module (``--max-model-len 256``, the ``server`` fixture of conftest.py) serves
these tests: the API through the ``openai`` client (greedy, max_tokens, stop strings, seeds,
usage, n choices), its errors, client disconnects (a storm of them, a lone one) that leave every
KV block free, a huge prompt that stalls no other stream, and the metrics of each request. The
servers with flags it cannot have are test_serve_real_flags.py's. Every test is bounded in time;
the engine runs at some tens of tokens per second on 2 shared cores, so completions stay short.
"""

from __future__ import annotations

import asyncio
import re
import time

import aiohttp
import openai
import pytest
from helpers import ServerProcess, bounded, read_event
from serve_real_helpers import (
    FRANCE,
    MAX_MODEL_LEN,
    MODEL,
    STORY,
    TIMEOUT,
    client_for,
    disconnect_storm,
    metrics,
    wait_idle,
)

pytestmark = pytest.mark.slow


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


# -- disconnects, a huge prompt, metrics (raw aiohttp) -------------------------------------


@bounded(120)
async def test_disconnect_storm_frees_every_block(server: ServerProcess) -> None:
    await disconnect_storm(server)


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
