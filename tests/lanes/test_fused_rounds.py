"""Rounds riding in prompt steps under load (``EngineConfig.fuse_rounds_rows``,
``lanes/backlog_fuse.rounds_ride``): from that many decoding rows, while a prompt waits, the
prefill lane's next step computes the decode rows with their drafts, verified inside, and the
prompt chunks in one forward. Checked on CPU against plain greedy decoding, token for token."""

from __future__ import annotations

import argparse
import asyncio

import pytest
from helpers import (
    MemoryBound,
    assert_engine_clean,
    collect,
    hang_up_partway,
    pin_costs,
    tiny_config,
    tiny_draft_spec,
)

from verifypd.config import SchedulerConfig
from verifypd.controller.goodput import GoodputPolicy
from verifypd.lanes.async_engine import AsyncEngine
from verifypd.lanes.backlog_fuse import fusing, rounds_ride
from verifypd.serve.cli import add_serve_args, config_from_args
from verifypd.types import (
    NO_SPECULATION,
    SamplingParams,
    ScheduledSeq,
    SeqStatus,
    SpecDecision,
    StepPlan,
)

ONE_PROMPT_A_STEP = SchedulerConfig(prefill_pack_tokens=0)  # requests queue behind each other
PROMPTS = [list(range(10, 50)), [7] * 30, [1, 2, 3, 4, 5] * 6, list(range(200, 236)), [9, 8, 7]]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
NO_BACKLOG = {"fuse_decode_backlog_s": None}  # only the load rule fuses


class DearDrafts(MemoryBound):
    """A drafter step half a target step: priced as a decode step's round, the goodput policy
    drafts 2 of 3 for some rows here."""

    def draft_time(self, rows: int) -> float:
        return 5e-3


async def _run(
    lens: list[int] | None = None, **overrides
) -> tuple[list[list[int]], list[tuple[str, str, int, int, int]]]:
    """The outputs, and every launch as (lane, plan lane, decode rows, prompt chunks, drafted
    rows); ``lens`` gets the draft length of every drafted row in a fused prompt step. A
    goodput policy's costs are pinned (``pin_costs``, on ``DearDrafts``)."""
    config = tiny_config(scheduler=ONE_PROMPT_A_STEP, **{**NO_BACKLOG, **overrides})
    engine = AsyncEngine(config)
    if isinstance(engine.core.controller, GoodputPolicy):
        pin_costs(engine.core.costs, engine.core.controller)
        engine.core.costs.shape = DearDrafts()
    d = engine.dispatcher
    launches: list[tuple[str, str, int, int, int]] = []
    inner = d._launch_fn

    async def spy(lane: str, plan: StepPlan):
        prompts = sum(1 for e in plan.seqs if e.seq.status is SeqStatus.PREFILLING)
        drafted = [e.draft_len for e in plan.seqs if e.draft_token_ids]
        launches.append((lane, plan.lane, len(plan.seqs) - prompts, prompts, len(drafted)))
        if lens is not None and plan.in_prompt_step:
            lens.extend(drafted)
        return await inner(lane, plan)

    d._launch_fn = spy
    jobs = [collect(engine, f"r{i}", p, GREEDY) for i, p in enumerate(PROMPTS)]
    try:
        out = await asyncio.wait_for(asyncio.gather(*jobs), 60)
    finally:
        assert_engine_clean(engine)
        await engine.stop()
    return out, launches


async def test_rounds_ride_in_prompt_steps_token_for_token():
    plain, _ = await _run()
    drafting = tiny_draft_spec(max_draft_len=3, initial_draft_len=3)
    out, launches = await _run(spec=drafting, fuse_rounds_rows=1)
    assert out == plain
    # Prompt steps on the prefill lane carried decode rows with their drafts, verified inside.
    rounds = [x for x in launches if x[1] == "mixed" and x[4]]
    assert rounds and all(lane == "prefill" for lane, *_ in rounds)
    assert any(prompts and drafted for *_, prompts, drafted in rounds)
    # With no prompt waiting the lanes ran apart again.
    last = max(i for i, x in enumerate(launches) if x[1] == "mixed")
    assert any(lane in ("decode", "verify") for lane, *_ in launches[last:])


async def test_the_goodput_policys_rows_draft_the_most_in_a_prompt_step():
    """``SpeculationPolicy.in_prompt_step``: the rows the goodput policy lets speculate draft
    L_max in a prompt step (priced as a decode step's round, some would draft 2 here: the
    test fails without the rule); lossless."""
    plain, _ = await _run()
    lens: list[int] = []
    spec = tiny_draft_spec(controller=True, policy="goodput", max_draft_len=3,
                           initial_draft_len=1, follow_prefill=False,
                           second_token_plain=False)  # (the fused rows' second tokens) # fmt: skip
    out, launches = await _run(lens, spec=spec, fuse_rounds_rows=1)
    assert out == plain
    assert lens and set(lens) == {3}
    assert any(prompts and drafted for *_, prompts, drafted in launches if _[1] == "mixed")


def test_a_single_lane_step_with_a_prompt_chunk_does_not_feed_the_latency_guard():
    spec = tiny_draft_spec(controller=True, policy="goodput", max_draft_len=3, initial_draft_len=1)
    engine = AsyncEngine(tiny_config(spec=spec, lane_mode="single"))
    a, b = (engine.core.add_request(rid, [3, 4, 5], GREEDY)[0] for rid in "ab")
    a.status, b.status = SeqStatus.DECODING, SeqStatus.PREFILLING
    policy, latency = engine.dispatcher.policy, engine.core.controller.decode_latency
    policy.step_landed(StepPlan("mixed", [ScheduledSeq(a, 1), ScheduledSeq(b, 3)]), 0.2)
    assert latency.count == 0  # b's prompt chunk rode in it
    policy.step_landed(StepPlan("mixed", [ScheduledSeq(a, 1)]), 0.2)
    assert latency.count == 1


def test_a_fixed_draft_length_stays_in_a_prompt_step():
    engine = AsyncEngine(tiny_config(spec=tiny_draft_spec(max_draft_len=4, initial_draft_len=2)))
    decision = SpecDecision({1: 2, 2: 2})
    assert engine.dispatcher.policy.in_prompt_step(decision, []) is decision


def test_every_row_that_may_speculate_drafts_the_most_in_a_prompt_step():
    """Under the goodput policy, whatever it decided for a decode step (none, or L = 2)."""
    spec = tiny_draft_spec(controller=True, policy="goodput", max_draft_len=4)
    engine = AsyncEngine(tiny_config(spec=spec))
    rows = []
    for rid, speculate in (("a", True), ("b", False), ("c", True)):
        params = SamplingParams(max_tokens=4, speculate=speculate)
        [seq] = engine.core.add_request(rid, [3, 4, 5], params)
        rows.append(seq)
    policy, (a, _, c) = engine.dispatcher.policy, rows
    for decided in (NO_SPECULATION, SpecDecision({a.seq_id: 2})):
        assert policy.in_prompt_step(decided, rows).lens == {a.seq_id: 4, c.seq_id: 4}


async def test_below_the_rows_nothing_rides():
    drafting = tiny_draft_spec(max_draft_len=3, initial_draft_len=3)
    plain, _ = await _run(spec=drafting)
    out, launches = await _run(spec=drafting, fuse_rounds_rows=len(PROMPTS) + 1)
    assert out == plain
    assert all(plan_lane != "mixed" for _, plan_lane, *_ in launches)


def test_the_rule_counts_decoding_rows_and_needs_a_waiting_prompt():
    engine = AsyncEngine(tiny_config(fuse_rounds_rows=2, **NO_BACKLOG))
    d, sched = engine.dispatcher, engine.core.scheduler
    params = SamplingParams(max_tokens=4)
    for rid in ("a", "b", "c"):
        engine.core.add_request(rid, [3, 4, 5, 6], params)
    plan = StepPlan("prefill", sched.plan_prefill(64, 2))  # a and b admitted, c queued
    assert [e.seq.request_id for e in plan.seqs] == ["a", "b"]
    assert not rounds_ride(d)  # both still prefilling: no row decodes
    for e in plan.seqs:
        e.seq.num_computed_tokens = e.seq.num_tokens
        e.seq.status = SeqStatus.DECODING
    assert rounds_ride(d) and fusing(d)  # two rows decode, c waits
    d.fuse_rounds_rows = 3
    assert not rounds_ride(d) and not fusing(d)
    d.fuse_rounds_rows = 2
    sched.max_num_seqs = 2  # no row free for c
    assert not rounds_ride(d)
    sched.max_num_seqs = 8
    sched.waiting.clear()  # nothing waits
    assert not rounds_ride(d) and not fusing(d)


async def test_hanging_up_while_rounds_ride_leaks_nothing():
    config = tiny_config(
        spec=tiny_draft_spec(max_draft_len=3, initial_draft_len=3),
        scheduler=ONE_PROMPT_A_STEP,
        fuse_rounds_rows=1,
        **NO_BACKLOG,
    )
    engine = AsyncEngine(config)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    try:
        await hang_up_partway(engine, PROMPTS, params, every=2)
        assert_engine_clean(engine)
        assert len(await collect(engine, "after", [5, 6, 7], params)) == 40  # it serves on
    finally:
        await engine.stop()
    assert_engine_clean(engine)


def test_the_setting_is_validated_and_the_single_lane_ignores_it():
    assert tiny_config().fuse_rounds_rows is None
    for bad in (0, -1, 1.5, True, "8"):
        with pytest.raises(ValueError, match="fuse_rounds_rows"):
            tiny_config(fuse_rounds_rows=bad)
    engine = AsyncEngine(tiny_config(lane_mode="single", fuse_rounds_rows=1))
    assert engine.dispatcher.fuse_rounds_rows is None
    parser = add_serve_args(argparse.ArgumentParser())
    args = parser.parse_args(["--model", "dummy:tiny", "--fuse-rounds-rows", "12"])
    assert config_from_args(args).fuse_rounds_rows == 12
    assert config_from_args(parser.parse_args(["--model", "dummy:tiny"])).fuse_rounds_rows is None
    with pytest.raises(ValueError, match="fuse_rounds_rows"):
        config_from_args(parser.parse_args(["--model", "dummy:tiny", "--fuse-rounds-rows", "0"]))
