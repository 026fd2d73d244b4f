"""Overload (429) and client disconnects: nothing hangs, nothing leaks."""

from __future__ import annotations

import asyncio
import random

from fake_engine import FakeEngine
from server_utils import Harness, bounded, parse_sse, read_event, serve_engine, wait_until

CHAT = [{"role": "user", "content": "hi"}]


async def assert_clean(h: Harness) -> None:
    """No request left anywhere, every KV block back in the pool, and the server still works."""
    await h.wait_engine_idle()
    assert h.engine.kv_usage == 0.0
    h.engine.check_integrity()
    resp = await h.client.post("/v1/completions", json={"prompt": "ok", "max_tokens": 3})
    assert resp.status == 200 and len((await resp.json())["choices"][0]["text"]) == 3


@bounded(15)
async def test_overload_429_with_retry_after() -> None:
    async with serve_engine(FakeEngine(step_s=0.01), max_queue=2) as h:
        payload = {"prompt": "x", "max_tokens": 300, "stream": True}
        streams = [await h.client.post("/v1/completions", json=payload) for _ in range(2)]
        for resp in streams:
            assert resp.status == 200 and (await read_event(resp)).startswith(b"data: ")
        for path, body in (
            ("/v1/completions", {"prompt": "x"}),
            ("/v1/chat/completions", {"messages": CHAT}),
        ):
            resp = await h.client.post(path, json=body)
            assert resp.status == 429
            assert resp.headers["Retry-After"] == "1"
            error = (await resp.json())["error"]
            assert error["type"] == "rate_limit_error" and "capacity" in error["message"]
        assert (await h.client.get("/health")).status == 200  # overload is not unhealthy
        for resp in streams:
            resp.close()
        await assert_clean(h)
        assert len(h.engine.calls) == 3  # the rejected requests never reached the engine


@bounded(20)
async def test_disconnect_storm_frees_everything() -> None:
    rng = random.Random(0)
    engine = FakeEngine(step_s=0.004, max_num_seqs=6, prefill_steps=3, num_blocks=256)
    async with serve_engine(engine, max_queue=100) as h:
        kept = [asyncio.create_task(_full_stream(h, i)) for i in range(0, 40, 2)]
        dropped = [asyncio.create_task(_dropped_stream(h, i, rng)) for i in range(1, 40, 2)]
        moments = await asyncio.gather(*dropped)
        texts = await asyncio.gather(*kept)
        assert all(len(t) == 40 for t in texts)
        assert {"queued", "streaming"} <= set(moments)
        await assert_clean(h)
        assert len(set(h.engine.aborted)) >= 10  # the dropped requests were aborted
        metrics = await (await h.client.get("/metrics")).text()
        assert 'verifypd_requests_finished_total{model="fake-model",reason="abort"}' in metrics


async def _full_stream(h: Harness, i: int) -> str:
    """A client that reads its whole stream; returns the text of choice 0."""
    if i % 4:
        payload = {"prompt": f"p{i}", "max_tokens": 40, "stream": True}
        events = parse_sse(await (await h.client.post("/v1/completions", json=payload)).text())
        return "".join(e["choices"][0]["text"] for e in events[:-1])
    payload = {"messages": CHAT, "max_tokens": 40, "n": 2, "stream": True}
    events = parse_sse(await (await h.client.post("/v1/chat/completions", json=payload)).text())
    assert events[-1] == "[DONE]"
    choices = [e["choices"][0] for e in events[:-1] if e["choices"][0]["index"] == 0]
    return "".join(c["delta"].get("content", "") for c in choices)


async def _dropped_stream(h: Harness, i: int, rng: random.Random) -> str:
    """A client that goes away before its first token or mid-stream."""
    payload = {"prompt": f"d{i}", "max_tokens": 200, "stream": True, "n": 1 + i % 3 // 2}
    if i % 3 == 0:  # give up while queued or in prefill: the response never started
        task = asyncio.create_task(h.client.post("/v1/completions", json=payload))
        await asyncio.sleep(rng.uniform(0.0, 0.02))
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return "queued"
    resp = await h.client.post("/v1/completions", json=payload)
    for _ in range(rng.randint(1, 12)):
        await read_event(resp)
    resp.close()
    return "streaming"


@bounded(10)
async def test_non_stream_disconnect_aborts(harness: Harness) -> None:
    payload = {"prompt": "x", "max_tokens": 400}
    task = asyncio.create_task(harness.client.post("/v1/completions", json=payload))
    await wait_until(lambda: harness.engine.num_running)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await assert_clean(harness)
    assert harness.engine.aborted == [harness.engine.calls[0][0]]


@bounded(10)
async def test_disconnect_while_waiting_in_engine_queue() -> None:
    async with serve_engine(FakeEngine(max_num_seqs=1, step_s=0.01)) as h:
        blocker = await h.client.post(
            "/v1/completions", json={"prompt": "b", "max_tokens": 300, "stream": True}
        )
        await read_event(blocker)
        waiting = asyncio.create_task(
            h.client.post("/v1/completions", json={"prompt": "w", "max_tokens": 5})
        )
        await wait_until(lambda: h.engine.num_waiting)
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        # at once: the blocker still holds the slot for 3 s
        await wait_until(lambda: not (h.engine.num_waiting or len(h.state.inflight) > 1), 0.5)
        assert h.engine.num_running == 1 and len(h.engine.aborted) == 1
        blocker.close()
        await assert_clean(h)


@bounded(10)
async def test_disconnect_during_prefill() -> None:
    async with serve_engine(FakeEngine(prefill_steps=200, step_s=0.005)) as h:  # 1 s prefill
        payload = {"prompt": "x", "max_tokens": 5, "stream": True}
        task = asyncio.create_task(h.client.post("/v1/completions", json=payload))
        await wait_until(lambda: h.engine.num_running)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await wait_until(lambda: not (h.engine.num_running or h.state.inflight), 0.5)
        assert h.engine.aborted == [h.engine.calls[0][0]]
        await assert_clean(h)
