"""What the server refuses before any work (ServeLimits), against the FakeEngine: huge bodies
and prompts, slow clients, out-of-range fields, protocol errors, all in the OpenAI error shape
and fast."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import pytest
from fake_engine import FakeEngine
from server_utils import Harness, bounded, serve_engine, wait_until

from verifypd.serve.errors import APIError
from verifypd.serve.limits import ServeLimits, check_request
from verifypd.serve.schemas import CompletionRequest

MiB = 1 << 20


def assert_openai_error(status: int, body: dict, expected_status: int, param=None) -> None:
    assert status == expected_status, body
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    if param is not None:
        assert body["error"]["param"] == param, body


async def _post(harness: Harness, path: str, payload: dict) -> tuple[int, dict]:
    resp = await harness.client.post(path, json=payload)
    return resp.status, await resp.json()


def _count_encodes(engine: FakeEngine) -> list[int]:
    """Records the length of every text the engine's tokenizer encodes."""
    calls: list[int] = []
    encode = engine.tokenizer.encode

    def counting(text: str, add_special_tokens: bool = False) -> list[int]:
        calls.append(len(text))
        return encode(text, add_special_tokens)

    engine.tokenizer.encode = counting
    return calls


async def _raw(harness: Harness, data: bytes, read_timeout: float = 5.0) -> tuple[bytes, float]:
    """Send raw bytes on a new connection; returns everything read until the server closes
    the connection, and the seconds that took."""
    server = harness.client.server
    reader, writer = await asyncio.open_connection(server.host, server.port)
    start = time.monotonic()
    writer.write(data)
    await writer.drain()
    try:
        received = await asyncio.wait_for(reader.read(), read_timeout)
    finally:
        writer.close()
    return received, time.monotonic() - start


def _json_of(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


# -- field bounds ---------------------------------------------------------------------------


@bounded(10)
async def test_priority_needs_the_operator(harness: Harness) -> None:
    base = {"prompt": "hi", "max_tokens": 2}
    for priority in (1, -1, 2**63, 10**30):
        status, body = await _post(harness, "/v1/completions", {**base, "priority": priority})
        assert_openai_error(status, body, 400, "priority")
    status, body = await _post(harness, "/v1/completions", {**base, "priority": 1e30})
    assert_openai_error(status, body, 400, "priority")  # a float is not an integer
    async with serve_engine(FakeEngine(), limits=ServeLimits(max_priority=5)) as h:
        status, _ = await _post(h, "/v1/completions", {**base, "priority": -5})
        assert status == 200 and h.engine.calls[-1][2].priority == -5
        status, body = await _post(h, "/v1/completions", {**base, "priority": 6})
        assert_openai_error(status, body, 400, "priority")


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("top_k", 0x110000 + 1), ("top_k", 2**63), ("top_k", -2),
        ("n", 17), ("n", 10**18), ("best_of", 17),
        ("stop_token_ids", [0x110000]), ("stop_token_ids", [2**63]), ("stop_token_ids", [-1]),
        ("prompt", [0x110000]), ("prompt", [2**64]), ("prompt", [1] * 512),
        ("seed", 2**63), ("seed", -(2**63) - 1),
        ("temperature", float("nan")), ("top_p", float("inf")), ("temperature", 1e308),
    ],
)  # fmt: skip
@bounded(10)
async def test_out_of_range_field_is_a_400_naming_it(harness: Harness, field, value) -> None:
    payload = {"prompt": "hi", "max_tokens": 2, field: value}
    status, body = await _post(harness, "/v1/completions", payload)
    assert_openai_error(status, body, 400, field)
    assert harness.engine.calls == []  # nothing reached the engine


@bounded(10)
async def test_top_k_and_seed_at_their_valid_extremes_pass(harness: Harness) -> None:
    for extra in ({"top_k": 0x110000}, {"top_k": -1}, {"top_k": 0}, {"seed": -(2**63)},
                  {"seed": 2**63 - 1, "n": 16}):  # fmt: skip
        payload = {"prompt": "hi", "max_tokens": 2, "temperature": 1, **extra}
        status, body = await _post(harness, "/v1/completions", payload)
        assert status == 200, (extra, body)


# -- limits before work ---------------------------------------------------------------------


@bounded(20)
async def test_huge_prompt_is_refused_before_tokenizing() -> None:
    engine = FakeEngine()
    encodes = _count_encodes(engine)
    prompt = "a" * (10 * MiB)
    async with serve_engine(engine, limits=ServeLimits(max_request_bytes=64 * MiB)) as h:
        start = time.monotonic()
        status, body = await _post(h, "/v1/completions", {"prompt": prompt, "max_tokens": 1})
        assert time.monotonic() - start < 1.0
        assert_openai_error(status, body, 400, "prompt")
        chat = {"messages": [{"role": "user", "content": prompt}]}
        status, body = await _post(h, "/v1/chat/completions", chat)
        assert_openai_error(status, body, 400, "messages")
    assert encodes == []
    async with serve_engine(FakeEngine()) as h:  # the default body bound refuses it first
        status, body = await _post(h, "/v1/completions", {"prompt": prompt, "max_tokens": 1})
        assert_openai_error(status, body, 413)


@bounded(10)
async def test_n64_with_a_billion_tokens_is_refused_at_once(harness: Harness) -> None:
    start = time.monotonic()
    payload = {"prompt": "hi", "n": 64, "max_tokens": 10**9}
    status, body = await _post(harness, "/v1/completions", payload)
    assert time.monotonic() - start < 0.5
    assert_openai_error(status, body, 400, "n")
    status, body = await _post(harness, "/v1/completions", {**payload, "n": 2})
    assert_openai_error(status, body, 400, "max_tokens")


@bounded(20)
async def test_full_queue_answers_429_before_tokenizing() -> None:
    engine = FakeEngine(step_s=0.05)
    limits = ServeLimits(max_prompt_chars=4 * MiB)
    async with serve_engine(engine, max_queue=1, limits=limits) as h:
        busy = asyncio.create_task(_post(h, "/v1/completions", {"prompt": "x", "max_tokens": 50}))
        await wait_until(lambda: h.state.inflight)
        encodes = _count_encodes(engine)
        big = {"prompt": "b" * (2 * MiB), "max_tokens": 1}
        status, body = await _post(h, "/v1/completions", big)
        assert_openai_error(status, body, 429)
        assert encodes == []
        assert (await busy)[0] == 200


@bounded(10)
async def test_content_length_over_the_limit_is_refused_before_the_body(harness) -> None:
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 100000000\r\n\r\n"
    )
    raw, seconds = await _raw(harness, head)  # not a byte of the body is ever sent
    status, body = _json_of(raw)
    assert_openai_error(status, body, 413)
    assert seconds < 1.0  # and the server closed the connection (read() returned)


@bounded(10)
async def test_slow_clients_are_cut_off_by_the_read_timeout() -> None:
    limits = ServeLimits(request_read_timeout_s=0.5)
    async with serve_engine(FakeEngine(), limits=limits) as h:
        server = h.client.server
        # Slowloris: headers that never end, one byte at a time.
        reader, writer = await asyncio.open_connection(server.host, server.port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        start = time.monotonic()
        received = None
        while received is None and time.monotonic() - start < 5:
            writer.write(b"X")
            with contextlib.suppress(TimeoutError):
                received = await asyncio.wait_for(reader.read(1), 0.1)
        assert received == b"" and time.monotonic() - start < 2.0  # closed, nothing sent
        writer.close()
        # A body that stops halfway: 408 once the timeout passes.
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"
        raw, seconds = await _raw(h, head)
        status, body = _json_of(raw)
        assert_openai_error(status, body, 408)
        assert 0.4 < seconds < 2.0


# -- every error in the OpenAI shape ---------------------------------------------------------


@bounded(10)
async def test_protocol_and_routing_errors_use_the_openai_shape(harness: Harness) -> None:
    for data in (b"GARBAGE\r\n\r\n", b"GET / HTTP/1.1\r\nBad Header\r\n\r\n"):
        status, body = _json_of((await _raw(harness, data))[0])
        assert_openai_error(status, body, 400)
    resp = await harness.client.get("/v1/nowhere")
    assert_openai_error(resp.status, await resp.json(), 404)
    resp = await harness.client.get("/v1/completions")
    assert_openai_error(resp.status, await resp.json(), 405)


@bounded(10)
async def test_bearer_scheme_is_case_insensitive() -> None:
    async with serve_engine(FakeEngine(), api_key="sk-1") as h:
        for header, status in (("bearer sk-1", 200), ("BEARER sk-1", 200),
                               ("Basic sk-1", 401), ("bearer sk-2", 401)):  # fmt: skip
            resp = await h.client.get("/v1/models", headers={"Authorization": header})
            assert resp.status == status, header


@pytest.mark.parametrize("bias", [{"512": 1.0}, {"-1": 2.0}])
def test_logit_bias_keys_are_checked_against_the_vocabulary(bias) -> None:
    # (logit_bias itself is refused by this tree's schema; the bound is ready for it.)
    body = CompletionRequest.model_validate_json(json.dumps({"prompt": "x", "logit_bias": bias}))
    with pytest.raises(APIError) as err:
        check_request(body, ServeLimits(), vocab_size=512, max_model_len=256)
    assert (err.value.status, err.value.param) == (400, "logit_bias")
    ok = CompletionRequest.model_validate_json(json.dumps({"prompt": "x", "logit_bias": {"3": 1}}))
    check_request(ok, ServeLimits(), vocab_size=512, max_model_len=256)
