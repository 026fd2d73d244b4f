"""OpenAI-compatible endpoints against the FakeEngine: shapes, streaming, parameters."""

from __future__ import annotations

from fake_engine import TEXT
from server_utils import Harness, bounded, parse_sse

CHAT = [{"role": "user", "content": "hello"}]
CHUNK_KEYS = {"id", "object", "created", "model", "choices"}


def fake_template(messages: list[dict]) -> str:
    return "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>"


@bounded(10)
async def test_health_and_models(harness: Harness) -> None:
    resp = await harness.client.get("/health")
    assert resp.status == 200 and (await resp.json()) == {"status": "ok"}
    body = await (await harness.client.get("/v1/models")).json()
    assert body["object"] == "list"
    [card] = body["data"]
    assert card["id"] == "fake-model" and card["object"] == "model"
    assert card["owned_by"] == "verifypd" and card["max_model_len"] == 512


@bounded(10)
async def test_completion_non_stream(harness: Harness) -> None:
    payload = {"model": "fake-model", "prompt": "abc", "max_tokens": 7, "temperature": 0}
    resp = await harness.client.post("/v1/completions", json=payload)
    assert resp.status == 200
    body = await resp.json()
    assert set(body) == {"id", "object", "created", "model", "choices", "usage"}
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["model"] == "fake-model"
    assert body["choices"] == [
        {"index": 0, "text": TEXT[:7], "logprobs": None, "finish_reason": "length"}
    ]
    usage = body["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (3, 7, 10)
    [(request_id, prompt_ids, params)] = harness.engine.calls
    assert request_id == body["id"] and prompt_ids == [ord(c) for c in "abc"]
    assert params.max_tokens == 7 and params.temperature == 0 and params.n == 1


@bounded(10)
async def test_completion_defaults(harness: Harness) -> None:
    resp = await harness.client.post("/v1/completions", json={"prompt": "abc"})
    assert resp.status == 200
    [(_, _, params)] = harness.engine.calls
    assert params.max_tokens == 16  # OpenAI's default for completions
    assert (params.temperature, params.top_p, params.top_k, params.n) == (1.0, 1.0, 0, 1)
    assert params.seed is None and params.stop == [] and not params.ignore_eos


@bounded(10)
async def test_completion_stream_shapes(harness: Harness) -> None:
    payload = {"prompt": "abc", "max_tokens": 9, "temperature": 0, "stream": True}
    resp = await harness.client.post("/v1/completions", json=payload)
    assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
    events = parse_sse(await resp.text())
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert {(c["id"], c["created"], c["model"], c["object"]) for c in chunks} == {
        (chunks[0]["id"], chunks[0]["created"], "fake-model", "text_completion")
    }
    for chunk in chunks:
        assert set(chunk) == CHUNK_KEYS  # no usage key without include_usage
        [choice] = chunk["choices"]
        assert set(choice) == {"index", "text", "logprobs", "finish_reason"}
        assert choice["logprobs"] is None and choice["index"] == 0
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"][0] == {
        "index": 0, "text": "", "logprobs": None, "finish_reason": "length"
    }  # fmt: skip
    assert "".join(c["choices"][0]["text"] for c in chunks) == TEXT[:9]


@bounded(10)
async def test_chat_stream_shapes_with_usage(harness: Harness) -> None:
    payload = {
        "model": "fake-model", "messages": CHAT, "max_tokens": 6, "temperature": 0,
        "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    resp = await harness.client.post("/v1/chat/completions", json=payload)
    assert resp.status == 200
    events = parse_sse(await resp.text())
    assert events[-1] == "[DONE]"
    *chunks, usage_chunk = events[:-1]
    ids = {(c["id"], c["created"], c["model"], c["object"]) for c in events[:-1]}
    assert len(ids) == 1 and ids.pop()[3] == "chat.completion.chunk"
    assert chunks[0]["choices"] == [
        {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
         "finish_reason": None}
    ]  # fmt: skip
    content = chunks[1:-1]
    assert content and all(set(c["choices"][0]["delta"]) == {"content"} for c in content)
    assert all(c["choices"][0]["finish_reason"] is None for c in content)
    assert "".join(c["choices"][0]["delta"]["content"] for c in content) == TEXT[:6]
    assert chunks[-1]["choices"] == [
        {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}
    ]
    assert all(c["usage"] is None for c in chunks)
    assert usage_chunk["choices"] == []
    prompt_len = len(fake_template(CHAT))
    assert usage_chunk["usage"]["prompt_tokens"] == prompt_len
    assert usage_chunk["usage"]["completion_tokens"] == 6
    assert usage_chunk["usage"]["total_tokens"] == prompt_len + 6


@bounded(10)
async def test_chat_non_stream(harness: Harness) -> None:
    messages = [{"role": "developer", "content": "be brief"}, *CHAT]
    payload = {"messages": messages, "max_completion_tokens": 4, "temperature": 0}
    resp = await harness.client.post("/v1/chat/completions", json=payload)
    assert resp.status == 200
    body = await resp.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["choices"] == [
        {"index": 0, "message": {"role": "assistant", "content": TEXT[:4]}, "logprobs": None,
         "finish_reason": "length"}
    ]  # fmt: skip
    [(_, prompt_ids, params)] = harness.engine.calls
    expected = fake_template([{"role": "system", "content": "be brief"}, *CHAT])
    assert "".join(map(chr, prompt_ids)) == expected  # developer -> system for the template
    assert params.max_tokens == 4
    assert body["usage"]["prompt_tokens"] == len(expected)


@bounded(10)
async def test_chat_content_parts_and_default_max_tokens(harness: Harness) -> None:
    parts = [{"type": "text", "text": "hel"}, {"type": "text", "text": "lo"}]
    payload = {"messages": [{"role": "user", "content": parts}], "stop": "z"}
    resp = await harness.client.post("/v1/chat/completions", json=payload)
    assert resp.status == 200, await resp.text()
    [(_, prompt_ids, params)] = harness.engine.calls
    assert "".join(map(chr, prompt_ids)) == fake_template(CHAT)
    assert params.max_tokens == 512 - len(prompt_ids)  # chat default: the rest of the context


@bounded(10)
async def test_n_choices_non_stream(harness: Harness) -> None:
    payload = {"prompt": "x", "max_tokens": 5, "n": 3, "seed": 7}
    body = await (await harness.client.post("/v1/completions", json=payload)).json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert all(len(c["text"]) == 5 and c["finish_reason"] == "length" for c in body["choices"])
    assert body["usage"]["completion_tokens"] == 15 and body["usage"]["prompt_tokens"] == 1


@bounded(10)
async def test_n_choices_stream(harness: Harness) -> None:
    payload = {"messages": CHAT, "max_tokens": 5, "n": 2, "stream": True, "temperature": 0}
    events = parse_sse(
        await (await harness.client.post("/v1/chat/completions", json=payload)).text()
    )
    chunks = events[:-1]
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert mine[-1] == {
            "index": index,
            "delta": {},
            "logprobs": None,
            "finish_reason": "length",
        }
        assert "".join(c["delta"].get("content", "") for c in mine) == TEXT[:5]


@bounded(10)
async def test_stop_strings_passed_through(harness: Harness) -> None:
    payload = {"prompt": "x", "max_tokens": 30, "temperature": 0, "stop": ["fox", "zzz"]}
    body = await (await harness.client.post("/v1/completions", json=payload)).json()
    assert body["choices"][0]["text"] == "the quick brown "
    assert body["choices"][0]["finish_reason"] == "stop"
    assert harness.engine.calls[0][2].stop == ["fox", "zzz"]
    stream = {**payload, "stop": "brown", "stream": True}
    events = parse_sse(await (await harness.client.post("/v1/completions", json=stream)).text())
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == "the quick "
    assert events[-2]["choices"][0]["finish_reason"] == "stop"
    assert harness.engine.calls[1][2].stop == ["brown"]


@bounded(10)
async def test_seed_and_sampling_params_passed_through(harness: Harness) -> None:
    payload = {
        "prompt": "x", "max_tokens": 8, "seed": 1234, "temperature": 0.7, "top_p": 0.9,
        "top_k": 40, "priority": 0, "ignore_eos": True, "stop_token_ids": [5, 6], "user": "u1",
        "presence_penalty": 0, "unknown_field": {"ignored": True},
    }  # fmt: skip
    first = await (await harness.client.post("/v1/completions", json=payload)).json()
    second = await (await harness.client.post("/v1/completions", json=payload)).json()
    assert first["choices"][0]["text"] == second["choices"][0]["text"]  # same seed, same text
    params = harness.engine.calls[0][2]
    assert params.seed == 1234 and params.temperature == 0.7 and params.top_p == 0.9
    assert params.top_k == 40 and params.priority == 0 and params.ignore_eos
    assert params.stop_token_ids == [5, 6]


@bounded(10)
async def test_prompt_forms(harness: Harness) -> None:
    for prompt in (["abc"], [97, 98, 99]):
        resp = await harness.client.post("/v1/completions", json={"prompt": prompt})
        assert resp.status == 200, await resp.text()
    assert harness.engine.calls[0][1] == harness.engine.calls[1][1] == [97, 98, 99]


@bounded(10)
async def test_eos_finishes_with_stop() -> None:
    from fake_engine import FakeEngine
    from server_utils import serve_engine

    async with serve_engine(FakeEngine(eos_after=3)) as h:
        payload = {"prompt": "x", "max_tokens": 10, "temperature": 0}
        body = await (await h.client.post("/v1/completions", json=payload)).json()
        assert body["choices"][0] == {
            "index": 0, "text": TEXT[:3], "logprobs": None, "finish_reason": "stop"
        }  # fmt: skip
        ignore = {**payload, "ignore_eos": True}
        body = await (await h.client.post("/v1/completions", json=ignore)).json()
        assert body["choices"][0]["text"] == TEXT[:10]


@bounded(10)
async def test_root_redirects_to_dashboard(harness: Harness) -> None:
    resp = await harness.client.get("/", allow_redirects=False)
    assert resp.status == 302 and resp.headers["Location"] == "/dashboard"
