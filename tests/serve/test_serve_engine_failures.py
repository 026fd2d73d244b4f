"""Engine-side failures: error finishes and exceptions end requests cleanly (500 / error event)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fake_engine import FakeEngine
from server_utils import bounded, parse_sse, serve_engine

from verifypd.types import RequestOutput, SamplingParams


class ExplodingEngine(FakeEngine):
    """Raises after the first delta, like an engine whose step loop crashed."""

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        outputs = super().generate(request_id, prompt_token_ids, params)
        try:
            yield await outputs.__anext__()
            raise RuntimeError("engine step failed")
        finally:
            await outputs.aclose()


class CoroutineEngine(FakeEngine):
    """``generate`` as a coroutine that returns the iterator (also accepted)."""

    async def generate(self, request_id, prompt_token_ids, params):  # type: ignore[override]
        return super().generate(request_id, prompt_token_ids, params)


@bounded(10)
async def test_error_finish_reason() -> None:
    async with serve_engine(FakeEngine(fail_after=3)) as h:
        resp = await h.client.post("/v1/completions", json={"prompt": "x", "max_tokens": 10})
        assert resp.status == 500
        assert (await resp.json())["error"]["type"] == "server_error"
        payload = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 10, "stream": True}
        events = parse_sse(await (await h.client.post("/v1/chat/completions", json=payload)).text())
        assert events[-1] == "[DONE]" and events[-2]["error"]["type"] == "server_error"
        await h.wait_engine_idle()
        assert h.engine.kv_usage == 0


@bounded(10)
async def test_engine_exception_mid_stream_ends_cleanly() -> None:
    async with serve_engine(ExplodingEngine()) as h:
        payload = {"prompt": "x", "max_tokens": 10, "stream": True}
        resp = await h.client.post("/v1/completions", json=payload)
        assert resp.status == 200
        events = parse_sse(await resp.text())
        assert events[-1] == "[DONE]" and events[-2]["error"]["type"] == "server_error"
        resp = await h.client.post("/v1/completions", json={"prompt": "x", "max_tokens": 10})
        assert resp.status == 500
        await h.wait_engine_idle()
        assert h.engine.kv_usage == 0 and len(h.engine.aborted) == 2
        h.engine.check_integrity()


@bounded(10)
async def test_generate_may_be_a_coroutine() -> None:
    async with serve_engine(CoroutineEngine()) as h:
        resp = await h.client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3})
        assert resp.status == 200 and len((await resp.json())["choices"][0]["text"]) == 3
