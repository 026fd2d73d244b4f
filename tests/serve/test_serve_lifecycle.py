"""Server lifecycle: starting (503), ready, graceful drain on SIGTERM (in-process and real)."""

from __future__ import annotations

import asyncio
import signal

import aiohttp
from aiohttp.test_utils import TestClient, TestServer
from fake_engine import FakeEngine
from server_utils import (
    Harness,
    bounded,
    fake_server_command,
    parse_sse,
    read_event,
    serve_engine,
    start_server_process,
)

from verifypd.serve.app import attach_engine, build_app, ready_line
from verifypd.serve.lifecycle import drain
from verifypd.serve.openai_api import STATE_KEY


@bounded(10)
async def test_starting_then_ready() -> None:
    app = build_app(None, max_queue=4)
    client = TestClient(TestServer(app))
    await client.start_server()
    engine = FakeEngine(observer=app[STATE_KEY].observer)
    try:
        resp = await client.get("/health")
        assert resp.status == 503 and (await resp.json()) == {"status": "starting"}
        assert resp.headers["Retry-After"] == "5"
        resp = await client.post("/v1/completions", json={"prompt": "x"})
        assert resp.status == 503 and resp.headers["Retry-After"] == "5"
        assert (await resp.json())["error"]["type"] == "server_error"
        assert (await client.get("/v1/models")).status == 503
        assert (await client.get("/metrics")).status == 200
        await engine.start()
        attach_engine(app, engine)
        assert (await client.get("/health")).status == 200
        resp = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert resp.status == 200 and (await resp.json())["model"] == "fake-model"
        metrics = await (await client.get("/metrics")).text()
        assert 'verifypd_generation_tokens_total{model="fake-model"} 2.0' in metrics
    finally:
        await client.close()
        await engine.stop()


@bounded(15)
async def test_drain_lets_streams_finish(harness: Harness) -> None:
    payload = {"prompt": "x", "max_tokens": 80, "stream": True, "temperature": 0}
    stream = await harness.client.post("/v1/completions", json=payload)
    first = await read_event(stream)
    drained = asyncio.create_task(drain(harness.state, timeout=10))
    await asyncio.sleep(0.05)
    health = await harness.client.get("/health")
    assert health.status == 503 and (await health.json()) == {"status": "draining"}
    resp = await harness.client.post("/v1/completions", json={"prompt": "x"})
    assert resp.status == 503 and resp.headers["Retry-After"] == "5"
    events = parse_sse(first.decode() + await stream.text())
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
    assert len("".join(e["choices"][0]["text"] for e in events[:-1])) == 80
    assert await drained is True
    assert not harness.engine.aborted


@bounded(15)
async def test_drain_timeout_ends_streams_cleanly() -> None:
    async with serve_engine(FakeEngine(step_s=0.01)) as h:
        stream = await h.client.post(
            "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": "x"}],
                "max_tokens": 400,
                "stream": True,
            },
        )
        first = await read_event(stream)
        blocking = asyncio.create_task(
            h.client.post("/v1/completions", json={"prompt": "y", "max_tokens": 400})
        )
        async with asyncio.timeout(5):
            while len(h.state.inflight) < 2:
                await asyncio.sleep(0.01)
        assert await drain(h.state, timeout=0.3, grace=3) is False
        events = parse_sse(first.decode() + await stream.text())
        assert events[-1] == "[DONE]"
        assert events[-2]["error"]["type"] == "server_error"
        assert "shutting down" in events[-2]["error"]["message"]
        resp = await blocking
        assert resp.status == 503 and "shutting down" in (await resp.json())["error"]["message"]
        assert not h.state.inflight and h.engine.kv_usage == 0
        h.engine.check_integrity()


def test_ready_line_format() -> None:
    assert ready_line("m", "127.0.0.1", 8000) == "verifypd serving m at http://127.0.0.1:8000"
    assert ready_line("m", "::1", 80) == "verifypd serving m at http://[::1]:80"


@bounded(30)
async def test_sigterm_drains_real_server() -> None:
    cmd = fake_server_command("--drain-timeout", "20", "--step-s", "0.01")
    server = await asyncio.to_thread(start_server_process, cmd, 20)
    with server:
        assert server.model == "fake-model" and server.url.startswith("http://127.0.0.1:")
        async with aiohttp.ClientSession(server.url) as session:
            assert (await session.get("/health")).status == 200
            payload = {"prompt": "x", "max_tokens": 120, "stream": True}
            stream = await session.post("/v1/completions", json=payload)
            first = await read_event(stream)
            server.proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.3)
            async with aiohttp.ClientSession(server.url) as fresh:  # a new connection
                health = await fresh.get("/health")
                assert health.status == 503 and (await health.json()) == {"status": "draining"}
                resp = await fresh.post("/v1/completions", json={"prompt": "x"})
                assert resp.status == 503 and "Retry-After" in resp.headers
            events = parse_sse(first.decode() + await stream.text())
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
        assert await asyncio.to_thread(server.proc.wait, 10) == 0
    assert server.stdout == [ready_line("fake-model", "127.0.0.1", int(server.url.split(":")[-1]))]


@bounded(30)
async def test_drain_timeout_real_server() -> None:
    cmd = fake_server_command("--drain-timeout", "0.5", "--step-s", "0.01")
    server = await asyncio.to_thread(start_server_process, cmd, 20)
    with server:
        async with aiohttp.ClientSession(server.url) as session:
            payload = {"prompt": "x", "max_tokens": 500, "stream": True}  # 5 s of tokens
            stream = await session.post("/v1/completions", json=payload)
            first = await read_event(stream)
            server.proc.send_signal(signal.SIGTERM)
            async with asyncio.timeout(4):
                events = parse_sse(first.decode() + await stream.text())
        assert events[-1] == "[DONE]" and "error" in events[-2]
        assert await asyncio.to_thread(server.proc.wait, 10) == 0
