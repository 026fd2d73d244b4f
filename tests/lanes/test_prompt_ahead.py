"""Prompt-ahead (``EngineConfig.prompt_ahead``): the next prompt step planned and launched behind
the one in flight. On CPU the worker thread runs a step during its launch, so the one ahead is
planned while the step before it has run but is not yet folded back in, and often still runs in
the thread when that one is folded: the same bookkeeping as on a GPU, checked token for token
against the engine without it."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from helpers import (
    assert_engine_clean,
    collect,
    generate_all,
    hang_up_partway,
    pin_costs,
    tiny_config,
    tiny_draft_spec,
)

from verifypd.config import CacheConfig, SchedulerConfig
from verifypd.lanes.async_engine import AsyncEngine
from verifypd.lanes.lane_steps import InFlight
from verifypd.lanes.prompt_ahead import launch_prompt_ahead, prompt_ahead_on
from verifypd.types import Observer, RequestFailure, SamplingParams, StepPlan

# A burst: prompts longer than a step's budget (chunked over several steps) among short ones.
PROMPTS = [[3 + (40 * i + 7 * j) % 500 for j in range(n)]
           for i, n in enumerate((70, 12, 45, 5, 90, 20, 33))]  # fmt: skip
SCHED = SchedulerConfig(max_num_batched_tokens=32, max_prefill_chunk=32)


def _params(i: int) -> SamplingParams:
    if i % 2:
        return SamplingParams(max_tokens=6 + i, temperature=0.8, seed=5 + i, ignore_eos=True)
    return SamplingParams(max_tokens=6 + i, temperature=0.0, ignore_eos=True)


class Counter(Observer):
    def __init__(self) -> None:
        self.ahead = 0

    def prompt_ahead(self) -> None:
        self.ahead += 1


def _engine(ahead: bool, **overrides) -> tuple[AsyncEngine, Counter]:
    counter = Counter()
    config = tiny_config(prompt_ahead=ahead, scheduler=SCHED, **overrides)
    engine = AsyncEngine(config, observer=counter)
    if config.spec.method != "off":  # the policy's decisions independent of this CPU's timings
        pin_costs(engine.core.costs, engine.core.controller)
    return engine, counter


def _spy_plans(engine: AsyncEngine) -> list[tuple[bool, list[int]]]:
    """Every prompt step launched: (launched ahead, its requests' ids), and checks that no
    sequence is in two steps in flight at once."""
    d, seen = engine.dispatcher, []
    launch = d._launch_fn

    async def spy(lane, plan):
        if lane == "prefill":
            ids = [e.seq.seq_id for e in plan.seqs]
            ahead = d.prompt_ahead.step is not None and d.prompt_ahead.step.plan is plan
            others = [e.seq.seq_id for f in d.flights() if f.plan is not plan
                      for e in f.plan.seqs]  # fmt: skip
            assert not set(ids) & set(others), "a sequence in two steps in flight"
            seen.append((ahead, [e.seq.request_id for e in plan.seqs]))
        return await launch(lane, plan)

    d._launch_fn = spy
    return seen


async def _run(ahead: bool, **overrides) -> tuple[list[list[int]], AsyncEngine, Counter, list]:
    engine, counter = _engine(ahead, **overrides)
    plans = _spy_plans(engine)
    params = [_params(i) for i in range(len(PROMPTS))]
    out = await generate_all(engine, PROMPTS, params)  # checks the engine clean, stops it
    return out, engine, counter, plans


async def test_prompt_ahead_is_token_identical_and_leaks_nothing():
    plain, engine0, _, plans0 = await _run(False)
    got, engine, counter, plans = await _run(True)
    assert engine0.dispatcher.prompt_ahead.num_steps == 0 and not any(a for a, _ in plans0)
    num = engine.dispatcher.prompt_ahead.num_steps
    assert num > 0 and counter.ahead == num  # the metric's hook
    assert sum(a for a, _ in plans) == num
    assert got == plain


async def test_with_decode_ahead_and_a_drafter_as_on_a_gpu_greedy_tokens_are_identical():
    """The combination a GPU engine runs by default: prompt steps ahead beside decode steps
    ahead, with a drafter under the speculation policy (the drafter is the target, so every
    draft is accepted and rounds carry several tokens). The greedy requests get the same
    tokens as without prompt-ahead; the seeded sampled ones all their tokens (which rounds
    the policy gives a sampled request depends on its batch-mates, and a speculative round
    samples differently from a plain step, with the same distribution); every block back."""
    gpu_like = {"decode_ahead": True, "spec": tiny_draft_spec(controller=True)}
    plain, _, _, _ = await _run(False, **gpu_like)
    got, engine, _, plans = await _run(True, **gpu_like)
    assert engine.dispatcher.decode_ahead and engine.dispatcher.policy is not None
    assert engine.dispatcher.prompt_ahead.num_steps > 0 and any(a for a, _ in plans)
    assert engine.core.spec_stats()["drafted"] > 0
    greedy = [i for i in range(len(PROMPTS)) if _params(i).temperature == 0]
    assert [got[i] for i in greedy] == [plain[i] for i in greedy]
    assert [len(t) for t in got] == [_params(i).max_tokens for i in range(len(PROMPTS))]


def test_config_is_validated_and_on_by_default_where_launches_only_enqueue():
    assert tiny_config().prompt_ahead is None
    with pytest.raises(ValueError, match="prompt_ahead"):
        tiny_config(prompt_ahead=1)
    on_gpu = {(None, True): True, (None, False): False, (False, True): False, (True, False): True}
    for (field, enqueues), want in on_gpu.items():  # enqueues: a GPU's launches
        assert prompt_ahead_on(field, enqueues) is want, (field, enqueues)
    assert AsyncEngine(tiny_config()).dispatcher.prompt_ahead.enabled is False  # CPU: off
    assert AsyncEngine(tiny_config(prompt_ahead=True)).dispatcher.prompt_ahead.enabled is True
    single = AsyncEngine(tiny_config(prompt_ahead=True, lane_mode="single"))
    assert single.dispatcher.prompt_ahead.enabled is False  # one lane: every step fused


async def test_abort_with_a_prompt_step_ahead_frees_every_block():
    engine, _ = _engine(True, cache=CacheConfig(num_blocks=96))
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    await hang_up_partway(engine, PROMPTS, params, every=2)
    assert engine.dispatcher.prompt_ahead.num_steps > 0
    assert_engine_clean(engine)
    await engine.stop()


async def test_a_request_failing_in_a_step_ahead_ends_alone():
    """A launch ahead failing for one request's own inputs ends that request with "error";
    the others plan again and get the tokens they get without prompt-ahead."""
    plain, *_ = await _run(False)
    engine, _ = _engine(True)
    d = engine.dispatcher
    launch, failed = d._launch_fn, []

    async def poisoned(lane, plan):
        ahead = d.prompt_ahead.step is not None and d.prompt_ahead.step.plan is plan
        rids = {e.seq.request_id for e in plan.seqs}
        if ahead and not failed and rids - {"r0"}:
            victim = sorted(rids - {"r0"})[0]
            failed.append(victim)
            raise RequestFailure({victim}, RuntimeError("poisoned input"))
        return await launch(lane, plan)

    d._launch_fn = poisoned
    reasons: dict[str, str | None] = {}

    async def run(i: int) -> list[int]:
        ids = []
        async for out in engine.generate(f"r{i}", PROMPTS[i], _params(i)):
            ids += out.new_token_ids
            if out.finished:
                reasons[f"r{i}"] = out.finish_reason
        return ids

    try:
        got = await asyncio.wait_for(asyncio.gather(*(run(i) for i in range(len(PROMPTS)))), 60)
    finally:
        assert_engine_clean(engine)
        await engine.stop()
    (victim,) = failed
    assert reasons[victim] == "error"
    for i, ids in enumerate(got):
        if f"r{i}" != victim:
            assert reasons[f"r{i}"] == "length" and ids == plain[i]


async def test_a_backlog_with_no_rows_decoding_goes_ahead():
    """A backlog that would fuse (``fuse_decode_backlog_s`` 0, any queue) with nothing
    decoding: no rows to ride, so prompt steps go ahead; the same tokens."""
    plain, *_ = await _run(False)
    engine, _ = _engine(True, fuse_decode_backlog_s=0.0, fuse_decode_backlog_tokens=0)
    params = [dataclasses.replace(_params(i), max_tokens=1) for i in range(len(PROMPTS))]
    got = await generate_all(engine, PROMPTS, params)
    assert engine.dispatcher.prompt_ahead.num_steps > 0
    assert got == [p[:1] for p in plain]  # the first tokens (seeded ones too)


async def test_no_step_ahead_while_the_decode_rows_are_to_ride_in_the_next():
    """A backlog that fuses (``fuse_decode_backlog_s`` 0, any queue): the next prompt step is
    to carry the decode rows, so none goes ahead of it."""
    engine, _ = _engine(True, fuse_decode_backlog_s=0.0, fuse_decode_backlog_tokens=0)
    d = engine.dispatcher
    launch, ahead_while_fusing = d._launch_fn, []

    async def spy(lane, plan):
        ahead = d.prompt_ahead.step is not None and d.prompt_ahead.step.plan is plan
        if ahead and any(s.status.name == "DECODING" for s in engine.core.scheduler.running):
            ahead_while_fusing.append(plan)
        return await launch(lane, plan)

    d._launch_fn = spy
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    first = asyncio.create_task(collect(engine, "d", [5, 6, 7], params))
    while (
        not engine.core.scheduler.running or engine.core.scheduler.running[0].num_output_tokens < 2
    ):
        await asyncio.sleep(0.001)
    try:
        rest = [collect(engine, f"r{i}", p, _params(i)) for i, p in enumerate(PROMPTS)]
        await asyncio.wait_for(asyncio.gather(first, *rest), 60)
    finally:
        assert_engine_clean(engine)
        await engine.stop()
    assert ahead_while_fusing == []


async def test_a_prompt_sharing_the_first_block_in_flight_waits_to_reuse_it():
    """Two prompts with one 48-token prefix, the first longer than a step: the second is not
    planned ahead of the first's last chunk (its blocks are not cached yet); planned after it
    lands, it reuses them, as without prompt-ahead. A prompt with another prefix goes ahead."""
    shared = list(range(100, 148))
    prompts = [shared + list(range(300, 330)), shared + [7, 8, 9], list(range(400, 460))]
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)

    async def run(ahead: bool) -> tuple[list[list[int]], int, list]:
        engine, _ = _engine(ahead)
        plans = _spy_plans(engine)
        kv = engine.core.kv
        try:
            out = [await asyncio.wait_for(collect(engine, "warm", [1, 2, 3], params), 60)]
            kv.num_prefix_hit_tokens = 0
            jobs = [collect(engine, f"r{i}", p, params) for i, p in enumerate(prompts)]
            out += await asyncio.wait_for(asyncio.gather(*jobs), 60)
        finally:
            assert_engine_clean(engine)
            await engine.stop()
        return out, kv.num_prefix_hit_tokens, plans

    plain, hits_plain, _ = await run(False)
    got, hits, plans = await run(True)
    assert got == plain
    assert hits == hits_plain >= 32  # the second prompt reused the shared full blocks
    assert not any(ahead and "r1" in rids for ahead, rids in plans)
    assert any(ahead and "r2" in rids for ahead, rids in plans)  # another prefix goes ahead


async def test_a_step_ahead_contends_with_the_other_lanes_not_with_the_one_before_it():
    """A step launched ahead shares the GPU with the decode step in flight (its time is
    contended, the cost model's), not with the prompt step it queues behind on its stream."""
    engine, _ = _engine(True)
    d, core = engine.dispatcher, engine.core
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    for i in (0, 2):
        core.add_request(f"r{i}", PROMPTS[i], params)
    plan = StepPlan("prefill", d.sched.plan_prefill(32, 64, 512))
    d.sched.begin_step(plan)
    head = d.in_flight["prefill"] = InFlight(plan, await d._launch_fn("prefill", plan), 0.0)
    other = d.in_flight["decode"] = InFlight(StepPlan("decode", []), None, 0.0)
    assert await launch_prompt_ahead(d)
    assert other.contended and not head.contended
    del d.in_flight["decode"]  # (a stand-in: nothing of it runs)
    for _ in range(5000):  # the engine loop's shape, to the end of both requests (a launch
        await d.tick()  # runs in a worker thread: the loop polls while it does)
        await asyncio.sleep(0.001)
        if not core.has_unfinished() and not d.in_flight:
            break
    assert not core.has_unfinished()
    assert_engine_clean(engine)
    await engine.stop()
