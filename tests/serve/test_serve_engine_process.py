"""``verifypd serve --engine-process``: the engine in a child process behind ``RemoteEngine``.

Against the in-process engine on the same requests: the same tokens and text, streamed and not,
greedy and seeded, with log-probabilities; the engine's own refusal (a grammar this tokenizer
cannot serve) as the same 400 naming the field; /metrics sees the engine's steps. Reliability: a
client that leaves mid-stream frees its blocks in the child while another request finishes; a
killed engine process fails the live stream with an error event and new requests with a 500;
the real CLI drains and exits 0 on SIGTERM (its child gone too) and exits 1 when its engine
process dies.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import bounded, parse_sse, read_event, tiny_config, tiny_draft_spec, wait_until
from server_utils import serve_engine, start_server_process, verifypd_serve_command

from verifypd.lanes.async_engine import AsyncEngine
from verifypd.serve.engine_process import EngineProcessError, RemoteEngine
from verifypd.types import ParamError, SamplingParams

REQUESTS: list[tuple[str, dict[str, Any]]] = [
    ("/v1/completions", {"prompt": "The sky is", "max_tokens": 10, "temperature": 0, "n": 2}),
    ("/v1/completions", {"prompt": [5, 6, 7, 8], "max_tokens": 10, "temperature": 0.8,
                         "seed": 3, "stream": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Name a color."}],
                              "max_tokens": 10, "temperature": 0.8, "seed": 4}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 10,
                              "temperature": 0, "stream": True,
                              "stream_options": {"include_usage": True}}),
    ("/v1/completions", {"prompt": "Hello", "max_tokens": 6, "temperature": 0, "logprobs": 2,
                         "echo": True}),
    ("/v1/completions", {"prompt": "Pick one", "max_tokens": 8, "temperature": 0,
                         "structured_outputs": {"choice": ["yes", "no"]}}),
]  # fmt: skip


def _children(pid: int) -> list[int]:
    """Child processes of ``pid``, whichever of its threads started them: every process whose
    parent is ``pid`` (/proc/N/stat; a thread's ``children`` file can miss a child while the
    thread that started it is gone and the child is being reparented)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue  # gone meanwhile
        if int(fields[1]) == pid:  # state, then ppid
            out.append(int(stat.parent.name))
    return out


def _answer(payload: Any) -> list[Any]:
    """What must match between engines: each choice's text, finish reason and log-probs, and
    the usage."""
    if isinstance(payload, list):  # a stream: text per choice index, then the usage chunk
        texts: dict[int, str] = {}
        usage = None
        for event in payload[:-1]:
            usage = event.get("usage") or usage
            for choice in event["choices"]:
                delta = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                texts[choice["index"]] = texts.get(choice["index"], "") + delta
        return [texts, usage, payload[-1]]
    choices = [
        (
            c["index"],
            c.get("text") or c["message"]["content"],
            c["finish_reason"],
            c.get("logprobs"),
        )
        for c in payload["choices"]
    ]
    return [choices, payload["usage"]]


def _same(a: Any, b: Any) -> bool:
    """Equal, floats to 1e-5 relative: the engine process sets its own CPU thread count, and
    another reduction order moves the last bits of fp32 log-probs."""
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-5)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


async def _answers(engine: Any) -> list[list[Any]]:
    answers = []
    async with serve_engine(engine) as h:
        for path, body in REQUESTS:
            resp = await h.client.post(path, json=body)
            text = await resp.text()
            if resp.status != 200:  # the engine's refusal: compared whole
                answers.append([resp.status, json.loads(text)])
                continue
            answers.append(_answer(parse_sse(text) if body.get("stream") else json.loads(text)))
        metrics = await (await h.client.get("/metrics")).text()
        info = await (await h.client.get("/server_info")).json()
        assert info["engine_client"] == type(engine).__name__, info
        assert info["engine_config"]["model"] == "dummy:tiny"
    return answers, metrics


@bounded(240)
async def test_the_engine_process_answers_as_the_engine_in_process() -> None:
    local, _ = await _answers(AsyncEngine(tiny_config()))
    remote, metrics = await _answers(RemoteEngine(tiny_config()))
    assert _same(remote, local), (remote, local)
    assert all(text for text in local[0][0])  # something was generated to compare
    assert local[4][0][0][3]["top_logprobs"]
    assert local[5][0] == 400 and local[5][1]["error"]["param"] == "structured_outputs"
    steps = [
        line for line in metrics.splitlines()
        if line.startswith("verifypd_lane_step_seconds_count") and 'lane="decode"' in line
    ]  # fmt: skip
    assert steps and float(steps[0].split()[-1]) > 0, steps  # observer calls replayed
    assert _sample(metrics, "verifypd_engine_loop_lag_seconds_count", "") > 0  # its own probe


@bounded(120)
async def test_an_engine_refusal_crosses_with_its_field() -> None:
    engine = RemoteEngine(tiny_config())
    await engine.start()
    try:
        with pytest.raises(ParamError) as err:
            async for _ in engine.generate("r", [10**6], SamplingParams(max_tokens=2)):
                pass
        assert err.value.param == "prompt"
        with pytest.raises(ParamError) as err:  # a caller's stamp that is not a time
            async for _ in engine.generate("t", [1], SamplingParams(max_tokens=2), float("nan")):
                pass
        assert err.value.param == "arrival_time"
        outs = [o async for o in engine.generate("r", [1, 2], SamplingParams(max_tokens=2))]
        assert outs[-1].finished and outs[-1].num_output_tokens == 2
        await engine.check_integrity()
    finally:
        await engine.stop()
    assert engine._proc.returncode == 0


@bounded(180)
async def test_a_client_leaving_frees_its_blocks_in_the_engine_process() -> None:
    engine = RemoteEngine(tiny_config())
    long = {"prompt": "Once", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    async with serve_engine(engine) as h:
        free = engine.kv_blocks_free
        assert free > 0
        leaving = await h.client.post("/v1/completions", json=long)
        await read_event(leaving)
        await read_event(leaving)
        other = asyncio.ensure_future(
            # ignore_eos: at the default temperature dummy:tiny samples its EOS early in ~1 % of
            # 8-token requests (a stop, not a failure of this test's point)
            h.client.post(
                "/v1/completions", json={"prompt": "Hi", "max_tokens": 8, "ignore_eos": True}
            )
        )
        leaving.close()  # the client goes away mid-stream
        resp = await other
        assert resp.status == 200, await resp.text()
        body = await resp.json()
        assert body["usage"]["completion_tokens"] == 8, body
        await h.wait_engine_idle(30)
        await engine.check_integrity()
        await wait_until(lambda: engine.kv_blocks_free >= free, 10)
        metrics = await (await h.client.get("/metrics")).text()
    assert _sample(metrics, "verifypd_requests_finished_total", 'reason="abort"') == 1
    assert _sample(metrics, "verifypd_requests_finished_total", 'reason="length"') == 1


def _sample(metrics: str, name: str, label: str) -> float:
    """The one sample of ``name`` whose labels hold ``label``."""
    (line,) = [m for m in metrics.splitlines() if m.startswith(name + "{") and label in m]
    return float(line.split()[-1])


@bounded(180)
async def test_a_dead_engine_process_fails_live_and_new_requests() -> None:
    engine = RemoteEngine(tiny_config())
    long = {"prompt": "Once", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    async with serve_engine(engine) as h:
        resp = await h.client.post("/v1/completions", json=long)
        await read_event(resp)
        os.kill(engine.pid, signal.SIGKILL)
        events = parse_sse((await resp.read()).decode())
        assert events[-1] == "[DONE]"
        assert events[-2]["error"]["type"] == "server_error", events[-2]
        await asyncio.wait_for(engine.closed.wait(), 10)
        after = await h.client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert after.status == 500, await after.text()
    with pytest.raises(EngineProcessError):
        await engine.check_integrity()


@bounded(180)
async def test_the_policy_snapshot_crosses_from_the_engine_process() -> None:
    """``RemoteEngine.policy_snapshot``: the child's ``AsyncEngine.policy_snapshot()`` (what the
    sweeps sample into timelines), its counters moving with the child's steps; asked of an
    engine process that is gone, an error."""
    config = tiny_config(spec=tiny_draft_spec(controller=True))
    engine = RemoteEngine(config)
    await engine.start()
    try:
        before = await engine.policy_snapshot()
        params = SamplingParams(max_tokens=8, temperature=0)
        outs = [o async for o in engine.generate("r", [1, 2, 3], params)]
        assert outs[-1].finished
        after = await engine.policy_snapshot()
    finally:
        await engine.stop()
    local = AsyncEngine(config)
    try:
        assert set(after) == set(local.policy_snapshot())  # the same keys in process
    finally:
        await local.stop()
    assert after["num_steps"] > before["num_steps"] == 0
    assert sum(after["decisions"].values()) > sum(before["decisions"].values()) == 0
    assert after["drafter_graph_steps"] + after["drafter_eager_steps"] > 0
    with pytest.raises(EngineProcessError):
        await engine.policy_snapshot()


@bounded(120)
async def test_an_engine_never_started_exits_with_its_front() -> None:
    engine = RemoteEngine(tiny_config())
    await engine.stop()  # closes the front's end: the child sees it and exits
    assert engine._proc.returncode == 0


def test_a_model_the_engine_rejects_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="unknown dummy preset 'nope'"):
        RemoteEngine(tiny_config(model="dummy:nope"))


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads children from /proc")
def test_the_cli_drains_on_sigterm_and_exits_when_its_engine_dies() -> None:
    args = ("--model", "dummy:tiny", "--device", "cpu", "--engine-process")
    with start_server_process(verifypd_serve_command(*args), timeout=180) as server:
        (child,) = _children(server.proc.pid)
        assert server.stop(signal.SIGTERM) == 0
        with pytest.raises(ProcessLookupError):
            _wait_gone(child)
    with start_server_process(verifypd_serve_command(*args), timeout=180) as server:
        (child,) = _children(server.proc.pid)
        os.kill(child, signal.SIGKILL)
        assert server.proc.wait(30) == 1
        assert any("engine process exited" in line for line in server.stderr), server.stderr


def _wait_gone(pid: int) -> None:
    """Raises ProcessLookupError once ``pid`` is gone (reaped); fails after 10 s."""
    for _ in range(1000):
        os.kill(pid, 0)
        time.sleep(0.01)
    raise AssertionError(f"process {pid} still exists")


async def test_the_front_stamps_each_arrival_for_the_engine() -> None:
    """The front takes the request's arrival (its own loop is not the one a step launch
    holds) and sends it with the request; the engine process's relay admits it with it."""
    from types import SimpleNamespace as NS

    from verifypd.serve.engine_worker import RecordingObserver, Relay

    sent: list[tuple] = []
    remote = RemoteEngine.__new__(RemoteEngine)  # no child process: the wire is what counts
    remote._queues, remote.closed, remote.tokenizer = {}, asyncio.Event(), None

    async def start() -> None:
        pass

    remote.start, remote._send = start, sent.append
    params = SamplingParams(max_tokens=1, detokenize=False)  # ids only: sent as they are
    before = time.monotonic()
    waiting = asyncio.ensure_future(remote.generate("r", [1, 2], params).__anext__())
    await asyncio.sleep(0)
    kind, rid, prompt, got, arrival = sent[0]
    assert (kind, rid, prompt, got) == ("add", "r", [1, 2], params)
    assert before <= arrival <= time.monotonic()
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert sent[-1] == ("abort", "r")  # the request left before its last delta
    # A caller's own earlier stamp goes as it is (the engine's admission checks it).
    again = asyncio.ensure_future(remote.generate("s", [3], params, arrival_time=1.5).__anext__())
    await asyncio.sleep(0)
    assert sent[-1] == ("add", "s", [3], params, 1.5)
    again.cancel()
    with pytest.raises(asyncio.CancelledError):
        await again

    submitted: list[tuple] = []
    relay = Relay(NS(submit=lambda *args: submitted.append(args)), RecordingObserver(), None)
    relay.touch = lambda: None
    relay.add("r", [1, 2], params, arrival)
    assert submitted == [("r", [1, 2], params, relay.deliver, arrival)]
