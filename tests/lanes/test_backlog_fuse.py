"""Decode rows inside prompt steps during a prompt backlog (``EngineConfig.fuse_decode_backlog_s``,
``lanes/backlog_fuse.py``): while the oldest queued prompt has waited past the setting, the
decode lane leaves its rows to the prefill lane, whose next step computes them with the prompt
chunks in one forward. Checked on CPU against the unfused path, token for token."""

from __future__ import annotations

import argparse
import asyncio

import pytest
from helpers import (
    assert_engine_clean,
    collect,
    hang_up_partway,
    tiny_config,
    tiny_draft_spec,
)

from verifypd.config import CacheConfig, SchedulerConfig
from verifypd.lanes.async_engine import AsyncEngine
from verifypd.serve.cli import add_serve_args, config_from_args
from verifypd.types import Observer, ParamError, SamplingParams, ScheduledSeq, SeqStatus, StepPlan

# One prompt per prompt step (pack 0): requests sent together queue behind each other.
ONE_PROMPT_A_STEP = SchedulerConfig(prefill_pack_tokens=0)
PROMPTS = [list(range(10, 50)), [7] * 30, [1, 2, 3, 4, 5] * 6, list(range(200, 236)), [9, 8, 7]]


def _params(i: int) -> SamplingParams:
    """Greedy and seeded sampling, different lengths."""
    if i % 2:
        return SamplingParams(max_tokens=10 + 3 * i, temperature=0.9, seed=5 + i, ignore_eos=True)
    return SamplingParams(max_tokens=10 + 3 * i, temperature=0.0, ignore_eos=True)


class FusedRows(Observer):
    def __init__(self) -> None:
        self.rows = 0

    def decode_fused(self, num_rows: int) -> None:
        self.rows += num_rows


async def _run(fuse: float | None, **overrides) -> tuple[list[list[int]], list[tuple], int]:
    """The outputs, every launch as (lane, plan lane, decode rows, prompt chunks), and the
    fused rows the observer counted."""
    observer = FusedRows()
    overrides = {"fuse_decode_backlog_tokens": 0, **overrides}  # the tiny prompts fuse
    config = tiny_config(fuse_decode_backlog_s=fuse, scheduler=ONE_PROMPT_A_STEP, **overrides)
    engine = AsyncEngine(config, observer=observer)
    d = engine.dispatcher
    launches: list[tuple] = []
    inner = d._launch_fn

    async def spy(lane: str, plan: StepPlan):
        assert plan.in_prompt_step == (plan.lane == "mixed")  # three lanes: only fused steps
        prompts = sum(1 for e in plan.seqs if e.seq.num_output_tokens == 0)
        launches.append((lane, plan.lane, len(plan.seqs) - prompts, prompts))
        return await inner(lane, plan)

    d._launch_fn = spy
    jobs = [collect(engine, f"r{i}", p, _params(i)) for i, p in enumerate(PROMPTS)]
    try:
        out = await asyncio.wait_for(asyncio.gather(*jobs), 60)
    finally:
        assert_engine_clean(engine)
        await engine.stop()
    return out, launches, observer.rows


async def test_a_backlog_fuses_decode_rows_into_prompt_steps_token_for_token():
    plain, plain_launches, none_fused = await _run(None)
    fused, launches, rows = await _run(0.0)
    assert fused == plain
    assert none_fused == 0 and all(plan_lane != "mixed" for _, plan_lane, *_ in plain_launches)
    # While prompts queued, prompt steps on the prefill lane carried decode rows too.
    mixed = [x for x in launches if x[1] == "mixed"]
    assert mixed and all(lane == "prefill" for lane, *_ in mixed)
    assert any(decodes and prompts for _, _, decodes, prompts in mixed)
    assert rows == sum(decodes for _, _, decodes, _ in mixed)
    # Once the queue drained the decode lane took its rows back.
    last_mixed = max(i for i, x in enumerate(launches) if x[1] == "mixed")
    assert any(lane == "decode" for lane, *_ in launches[last_mixed:])


async def test_no_backlog_past_the_setting_fuses_nothing():
    plain, _, _ = await _run(None)
    out, launches, rows = await _run(9.0)  # no prompt waits 9 s here
    assert out == plain and rows == 0
    assert all(plan_lane != "mixed" for _, plan_lane, *_ in launches)


async def test_fused_steps_keep_speculation_lossless():
    """Drafted rounds on the decode and verify lanes between fused steps: greedy output is
    plain greedy's (the fused rows decode plainly)."""
    plain, _, _ = await _run(None)
    drafting = tiny_draft_spec(max_draft_len=3, initial_draft_len=3)
    spec, launches, rows = await _run(0.0, spec=drafting)
    greedy = [i for i in range(len(PROMPTS)) if i % 2 == 0]
    assert [spec[i] for i in greedy] == [plain[i] for i in greedy]
    assert rows > 0 and any(lane == "verify" for lane, *_ in launches)


async def test_hanging_up_during_a_backlog_leaks_nothing():
    engine = AsyncEngine(tiny_config(fuse_decode_backlog_s=0.0, scheduler=ONE_PROMPT_A_STEP))
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    try:
        await hang_up_partway(engine, PROMPTS, params, every=2)
        assert_engine_clean(engine)
        # and it serves on
        assert len(await collect(engine, "after", [5, 6, 7], params)) == 40
    finally:
        await engine.stop()
    assert_engine_clean(engine)


def test_the_setting_is_validated_and_on_the_cli():
    assert tiny_config().fuse_decode_backlog_s == 0.02  # the default since 2026-11-29
    assert tiny_config(fuse_decode_backlog_s=None).fuse_decode_backlog_s is None
    for bad in (-0.01, 10.0, True, "0.05"):
        with pytest.raises(ValueError, match="fuse_decode_backlog_s"):
            tiny_config(fuse_decode_backlog_s=bad)
    parser = add_serve_args(argparse.ArgumentParser())
    args = parser.parse_args(["--model", "dummy:tiny", "--fuse-decode-backlog-s", "0.05"])
    assert config_from_args(args).fuse_decode_backlog_s == 0.05
    args = parser.parse_args(["--model", "dummy:tiny", "--fuse-decode-backlog-s", "none"])
    assert config_from_args(args).fuse_decode_backlog_s is None  # "none" turns it off
    default = config_from_args(parser.parse_args(["--model", "dummy:tiny"]))
    assert default.fuse_decode_backlog_s == 0.02


def test_a_fused_step_is_not_a_decode_steps_time():
    """The policy's latency guard and cost model skip a prompt step carrying decode rows, as a
    decode step carrying a prompt; the single lane's mixed steps still feed them."""
    engine = AsyncEngine(tiny_config())
    (seq,) = engine.core.add_request("p", [1, 2, 3], SamplingParams(max_tokens=2))
    seq.status = SeqStatus.PREFILLING
    entry = [ScheduledSeq(seq, 3)]
    assert StepPlan("mixed", entry, in_prompt_step=True).carries_prompt
    assert not StepPlan("mixed", entry).carries_prompt


def test_no_fusing_without_room_for_the_queued_prompt():
    """A backlog fuses only while the first queued prompt can be admitted (a row free, blocks
    for its first chunk): without, a fused step would carry decode rows alone."""
    from verifypd.lanes.backlog_fuse import fusing

    engine = AsyncEngine(tiny_config(fuse_decode_backlog_s=0.01, fuse_decode_backlog_tokens=0,
                                     cache=CacheConfig(num_blocks=8, block_size=16)))  # fmt: skip
    d, sched = engine.dispatcher, engine.core.scheduler
    now = [100.0]
    d.clock = lambda: now[0]
    engine.core.add_request("q", list(range(3, 40)), SamplingParams(max_tokens=2))  # 3 blocks
    sched.waiting[0].arrival_time = 100.0
    assert not fusing(d)  # it has not waited past the setting
    now[0] = 100.02
    assert fusing(d)
    allocator = sched.kv.allocator
    held = allocator.allocate(6)  # two blocks left: too few for its prompt
    assert not fusing(d)
    allocator.release(allocator.decref(held))
    assert fusing(d)
    sched.max_num_seqs = 0  # no row free
    assert not fusing(d)


def test_the_single_lane_never_fuses():
    engine = AsyncEngine(tiny_config(lane_mode="single", fuse_decode_backlog_s=0.0))
    assert engine.dispatcher.fuse_decode_backlog_s is None


def test_a_token_floor_fuses_only_for_a_queue_that_holds_it():
    """``fuse_decode_backlog_tokens``: a backlog fuses only while the queued prompts hold that
    many tokens still to compute (a burst, not one long prompt)."""
    from verifypd.lanes.backlog_fuse import fusing, queued_at_least

    engine = AsyncEngine(tiny_config(fuse_decode_backlog_s=0.01, fuse_decode_backlog_tokens=60))
    d, sched = engine.dispatcher, engine.core.scheduler
    d.clock = lambda: 200.0
    engine.core.add_request("a", list(range(3, 43)), SamplingParams(max_tokens=2))  # 40 tokens
    sched.waiting[0].arrival_time = 100.0
    assert not fusing(d)  # waited long enough, but 40 < 60 tokens queued
    engine.core.add_request("b", list(range(3, 33)), SamplingParams(max_tokens=2))  # 30 more
    assert fusing(d)
    sched.waiting[0].num_computed_tokens = 16  # a prefix already computed: 24 + 30 left
    assert not fusing(d)
    assert queued_at_least(sched.waiting, 54) and not queued_at_least(sched.waiting, 55)
    assert queued_at_least([], 0)


async def test_a_token_floor_above_every_backlog_fuses_nothing():
    plain, _, _ = await _run(None)
    out, launches, rows = await _run(0.0, fuse_decode_backlog_tokens=10_000)
    assert out == plain and rows == 0
    assert all(plan_lane != "mixed" for _, plan_lane, *_ in launches)


def test_the_token_floor_is_validated_and_on_the_cli():
    assert tiny_config().fuse_decode_backlog_tokens == 4096
    for bad in (-1, 1.5, True, "4096"):
        with pytest.raises(ValueError, match="fuse_decode_backlog_tokens"):
            tiny_config(fuse_decode_backlog_tokens=bad)
    parser = add_serve_args(argparse.ArgumentParser())
    argv = ["--model", "dummy:tiny", "--fuse-decode-backlog-s", "0.05"]
    args = parser.parse_args([*argv, "--fuse-decode-backlog-tokens", "4096"])
    assert config_from_args(args).fuse_decode_backlog_tokens == 4096
    assert config_from_args(parser.parse_args(argv)).fuse_decode_backlog_tokens == 4096
    args = parser.parse_args([*argv, "--fuse-decode-backlog-tokens", "0"])  # any backlog
    assert config_from_args(args).fuse_decode_backlog_tokens == 0


def test_a_hold_keeps_a_fused_burst_fused_while_prompts_queue():
    """``fuse_decode_hold_tokens``: once a fused step was planned the backlog lasts, without
    the wait or the floor, while the queue holds that many tokens; the first check that finds
    no backlog ends the hold. Without it every check decides anew."""
    from verifypd.lanes.backlog_fuse import fusing, plan_fused

    for hold in (None, 1):
        engine = AsyncEngine(tiny_config(fuse_decode_backlog_s=0.01, fuse_decode_backlog_tokens=60,
                                         fuse_decode_hold_tokens=hold))  # fmt: skip
        d, sched = engine.dispatcher, engine.core.scheduler
        now = [100.0]
        d.clock = lambda now=now: now[0]
        for rid, n in (("a", 40), ("b", 30)):
            engine.core.add_request(rid, list(range(3, 3 + n)), SamplingParams(max_tokens=2))
            sched.waiting[-1].arrival_time = 100.0
        now[0] = 100.02
        assert fusing(d) and not d.fuse_held  # a backlog; no fused step planned yet
        assert plan_fused(d) is not None and d.fuse_held
        assert [s.request_id for s in sched.waiting] == []  # both prompts went into that step
        engine.core.add_request("c", list(range(3, 23)), SamplingParams(max_tokens=2))
        sched.waiting[-1].arrival_time = now[0]  # 20 tokens, just arrived: no backlog alone
        assert fusing(d) == (hold is not None)
        assert d.fuse_held == (hold is not None)
        sched.waiting.clear()
        assert not fusing(d) and not d.fuse_held  # the queue drained: the hold is over
    with pytest.raises(ValueError, match="fuse_decode_hold_tokens"):
        tiny_config(fuse_decode_hold_tokens=-1)
    with pytest.raises(ValueError, match="fuse_decode_hold_tokens"):
        tiny_config(fuse_decode_hold_tokens=True)
    assert tiny_config().fuse_decode_hold_tokens is None


async def test_a_held_burst_serves_token_for_token():
    plain, _, _ = await _run(None)
    held, launches, rows = await _run(0.0, fuse_decode_hold_tokens=0)
    assert held == plain and rows > 0
    assert any(plan_lane == "mixed" for _, plan_lane, *_ in launches)


def test_the_rule_reads_the_arrival_the_front_stamped(tiny_core) -> None:
    """A request's wait counts from the arrival its front stamped (``add_request``'s
    ``arrival_time``), not from when this loop got to it; a stamp in the future counts as now,
    and one that is no finite number is refused, naming the field, with nothing admitted."""
    import time

    from verifypd.lanes.backlog_fuse import fusing

    engine = AsyncEngine(tiny_config(fuse_decode_backlog_s=0.02, fuse_decode_backlog_tokens=0))
    params = SamplingParams(max_tokens=2)
    engine.core.add_request("now", [1, 2, 3], params)
    assert not fusing(engine.dispatcher)  # waited under 20 ms
    stamp = time.monotonic() - 0.05
    [early] = engine.core.add_request("early", [4, 5, 6], params, arrival_time=stamp)
    assert early.arrival_time == stamp and fusing(engine.dispatcher)
    before = time.monotonic()
    [seq] = tiny_core.add_request("future", [1, 2], params, arrival_time=before + 10.0)
    assert before <= seq.arrival_time <= time.monotonic()
    for bad in (float("nan"), float("-inf"), "12.5", True):
        with pytest.raises(ParamError, match="arrival_time") as err:
            tiny_core.add_request("bad", [1, 2], params, arrival_time=bad)
        assert err.value.param == "arrival_time"
    assert "bad" not in tiny_core.requests and tiny_core.scheduler.num_waiting == 1
