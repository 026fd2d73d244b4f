"""Several prompts in one /v1/completions request (FakeEngine): all added to the engine before
any of them produces output, choices indexed prompt * n + choice as vLLM does, usage summed,
one bad prompt fails the request cleanly, a disconnect aborts every prompt."""

from __future__ import annotations

from fake_engine import FakeEngine
from server_utils import Harness, bounded, parse_sse, serve_engine


class CountingEngine(FakeEngine):
    """Records, for every ``generate`` call, how many deltas the engine had produced before."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.num_deltas = 0
        self.deltas_before_call: list[int] = []

    async def generate(self, request_id, prompt_token_ids, params):
        self.deltas_before_call.append(self.num_deltas)
        async for out in super().generate(request_id, prompt_token_ids, params):
            yield out

    def _delta(self, *args, **kwargs):
        self.num_deltas += 1
        return super()._delta(*args, **kwargs)


PROMPTS = ["ab", "cde", "f"]
SAMPLED = {"temperature": 1.0, "seed": 11, "max_tokens": 5, "n": 2}


@bounded(20)
async def test_batched_prompts_are_added_together_and_indexed_like_vllm() -> None:
    async with serve_engine(CountingEngine(step_s=0.01)) as h:
        body = await _complete(h, {"prompt": PROMPTS, **SAMPLED})
        assert h.engine.deltas_before_call == [0, 0, 0]  # none waited for another's output
        calls = {rid: ids for rid, ids, _ in h.engine.calls}
        assert calls == {f"{body['id']}-{i}": [ord(c) for c in p] for i, p in enumerate(PROMPTS)}
        assert [c["index"] for c in body["choices"]] == list(range(6))
        # Each (prompt, choice) gets what a request of its own gets at that choice index.
        for p, prompt in enumerate(PROMPTS):
            alone = await _complete(h, {"prompt": prompt, **SAMPLED})
            for c in range(2):
                assert body["choices"][p * 2 + c]["text"] == alone["choices"][c]["text"]
        usage = body["usage"]
        assert usage["prompt_tokens"] == sum(map(len, PROMPTS))
        assert usage["completion_tokens"] == 6 * 5
        assert usage["total_tokens"] == usage["prompt_tokens"] + 30
        await h.wait_engine_idle()
        h.engine.check_integrity()


@bounded(20)
async def test_token_id_prompts_single_and_batched(harness: Harness) -> None:
    one = await _complete(harness, {"prompt": [97, 98], "max_tokens": 3, "temperature": 0})
    assert len(one["choices"]) == 1 and one["usage"]["prompt_tokens"] == 2
    many = await _complete(
        harness, {"prompt": [[97, 98], [99], [100, 101, 102]], "max_tokens": 3, "temperature": 0}
    )
    assert [c["index"] for c in many["choices"]] == [0, 1, 2]
    assert many["usage"]["prompt_tokens"] == 6
    assert [ids for _, ids, _ in harness.engine.calls[1:]] == [[97, 98], [99], [100, 101, 102]]


@bounded(20)
async def test_batched_stream_carries_every_choice_and_summed_usage(harness: Harness) -> None:
    payload = {"prompt": PROMPTS, **SAMPLED, "stream": True}
    payload["stream_options"] = {"include_usage": True}
    resp = await harness.client.post("/v1/completions", json=payload)
    assert resp.status == 200
    events = parse_sse(await resp.text())
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    finished = {c["choices"][0]["index"] for c in chunks if c["choices"] and
                c["choices"][0]["finish_reason"]}  # fmt: skip
    assert finished == set(range(6))
    texts = ["".join(c["choices"][0]["text"] for c in chunks if c["choices"] and
                     c["choices"][0]["index"] == i) for i in range(6)]  # fmt: skip
    plain = await _complete(harness, {"prompt": PROMPTS, **SAMPLED})
    assert texts == [c["text"] for c in plain["choices"]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == plain["usage"]


@bounded(20)
async def test_one_bad_prompt_fails_the_request_and_frees_the_others() -> None:
    """The middle prompt fits the context but never the fake's 8-block KV cache: the engine
    refuses it after the first prompt was added, which must then be aborted."""
    async with serve_engine(FakeEngine(num_blocks=8, step_s=0.05)) as h:
        payload = {"prompt": ["ab", "x" * 200, "cd"], "max_tokens": 4}
        resp = await h.client.post("/v1/completions", json=payload)
        assert resp.status == 400
        assert (await resp.json())["error"]["param"] == "max_tokens"  # the KV-share refusal
        await h.wait_engine_idle()
        assert h.engine.aborted and h.engine.aborted[0].endswith("-0")
        h.engine.check_integrity()
        assert h.engine.kv_usage == 0
        ok = await _complete(h, {"prompt": ["ab", "cd"], "max_tokens": 2})
        assert len(ok["choices"]) == 2


@bounded(20)
async def test_disconnect_aborts_every_prompt() -> None:
    async with serve_engine(FakeEngine(step_s=0.05)) as h:
        payload = {"prompt": PROMPTS, "max_tokens": 200, "stream": True}
        resp = await h.client.post("/v1/completions", json=payload)
        await resp.content.readline()  # the stream is running
        resp.close()
        await h.wait_engine_idle(timeout=10)
        assert len(set(h.engine.aborted)) == len(PROMPTS)
        h.engine.check_integrity()
        assert h.engine.kv_usage == 0


async def _complete(h: Harness, payload: dict) -> dict:
    resp = await h.client.post("/v1/completions", json=payload)
    assert resp.status == 200, await resp.text()
    return await resp.json()
