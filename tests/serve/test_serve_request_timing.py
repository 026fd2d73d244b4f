"""``verifypd serve --log-request-timing``: one line per generation request with the stamps of
its first token's way (serve.request_timing), for the engine in process and in its own process.

Each stamp comes in order (received, handed to the engine, sent by the engine process, got by
the front, written, done), the client's ``X-Request-Id`` is carried, and with the flag off
nothing is logged and the engine is called as before (an engine client without ``timing``).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from typing import Any

import pytest
from helpers import bounded, parse_sse, tiny_config
from server_utils import serve_engine

from verifypd.lanes.async_engine import AsyncEngine
from verifypd.serve.cli import add_serve_args
from verifypd.serve.engine_process import RemoteEngine
from verifypd.serve.request_timing import MAX_CLIENT_ID_CHARS, timing_log

STAMPS = ("arrival_ms", "engine_first_ms", "first_out_ms", "first_sent_ms", "done_ms")


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[dict[str, Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        assert message.startswith("request timing ")
        self.records.append(json.loads(message[len("request timing ") :]))


@pytest.fixture
def lines() -> Iterator[Lines]:
    handler, level = Lines(), timing_log.level
    timing_log.addHandler(handler)
    timing_log.setLevel(logging.INFO)
    try:
        yield handler
    finally:
        timing_log.removeHandler(handler)
        timing_log.setLevel(level)


async def _timed(engine: Any, lines: Lines) -> list[dict[str, Any]]:
    streamed = {"prompt": [5, 6, 7], "max_tokens": 6, "temperature": 0, "stream": True}
    whole = {"prompt": "Hello", "max_tokens": 4, "temperature": 0}
    before = time.monotonic()
    async with serve_engine(engine) as h:
        resp = await h.client.post("/v1/completions", json=streamed,
                                   headers={"X-Request-Id": "req-7"})  # fmt: skip
        events = parse_sse(await resp.text())
        assert resp.status == 200 and events[-1] == "[DONE]"
        resp = await h.client.post("/v1/completions", json=whole,
                                   headers={"X-Request-Id": "x" * 300})  # fmt: skip
        assert resp.status == 200
        two = {"prompt": [[1, 2], [3, 4]], "max_tokens": 2}  # several prompts: not timed
        assert (await h.client.post("/v1/completions", json=two)).status == 200
    assert len(lines.records) == 2, lines.records
    for record in lines.records:
        assert before <= record["received"] <= time.monotonic()
    return lines.records


def _in_order(record: dict[str, Any], *names: str) -> None:
    stamps = [record[name] for name in names]
    assert all(s is not None for s in stamps), record
    assert 0 <= stamps[0] and stamps == sorted(stamps), record


@bounded(120)
async def test_each_request_is_timed_in_process(lines: Lines) -> None:
    streamed, whole = await _timed(AsyncEngine(tiny_config()), lines)
    assert streamed["client_id"] == "req-7"
    assert (streamed["prompt_tokens"], streamed["output_tokens"]) == (3, 6)
    assert streamed["finish"] == ["length"]
    assert streamed["engine_first_ms"] is None  # no engine process on this path
    _in_order(streamed, "arrival_ms", "first_out_ms", "first_sent_ms", "done_ms")
    assert whole["client_id"] == "x" * MAX_CLIENT_ID_CHARS  # cut, one short line
    assert whole["first_sent_ms"] is None  # one body, no chunks
    _in_order(whole, "arrival_ms", "first_out_ms", "done_ms")


@bounded(180)
async def test_the_engine_process_stamps_its_first_delta(lines: Lines) -> None:
    streamed, whole = await _timed(RemoteEngine(tiny_config()), lines)
    _in_order(streamed, *STAMPS)
    _in_order(whole, "arrival_ms", "engine_first_ms", "first_out_ms", "done_ms")
    assert streamed["output_tokens"] == 6


@bounded(60)
async def test_timing_off_logs_nothing_and_leaves_the_engine_call_alone() -> None:
    calls: list[dict[str, Any]] = []

    class Engine(AsyncEngine):
        def generate(self, request_id: str, prompt: list[int], params: Any, **kwargs: Any):
            calls.append(kwargs)
            return super().generate(request_id, prompt, params, **kwargs)

    handler = Lines()
    timing_log.addHandler(handler)
    try:
        assert not timing_log.isEnabledFor(logging.INFO)  # off unless asked for
        async with serve_engine(Engine(tiny_config())) as h:
            resp = await h.client.post("/v1/completions", json={"prompt": [1], "max_tokens": 2})
            assert resp.status == 200
    finally:
        timing_log.removeHandler(handler)
    assert calls == [{}] and handler.records == []


def test_the_flag_parses() -> None:
    import argparse

    parser = add_serve_args(argparse.ArgumentParser())
    assert parser.parse_args(["--log-request-timing"]).log_request_timing
    assert not parser.parse_args([]).log_request_timing
