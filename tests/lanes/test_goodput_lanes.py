"""The goodput policy driving the real engine (dummy:tiny on CPU): a verify fused into the
decode step or run on its own lane is lossless, the drafter follows prefill chunks only while
the policy expects to speculate, and the Sarathi-style prefill budget bounds prompt chunks.

The policy's cost model is pinned to a fixed shape (its online levels frozen) so that its
decisions do not depend on this machine's timings."""

import asyncio

import pytest
import torch
from helpers import (
    MemoryBound,
    generate_all,
    pin_costs,
    spy_drafter,
    tiny_config,
    tiny_draft_spec,
)

from verifypd.config import SchedulerConfig
from verifypd.controller import AcceptanceEstimate, GoodputPolicy
from verifypd.lanes.async_engine import AsyncEngine
from verifypd.types import SamplingParams

PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3], [7] * 40, list(range(10, 60)), [9, 8, 7]]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def _engine(
    mixed_level: float = 1.0,
    useless_drafter: bool = False,
    follow: bool = False,
    pad: bool = False,
    **cfg,
) -> AsyncEngine:
    spec = tiny_draft_spec(controller=True, policy="goodput", max_draft_len=3,
                           initial_draft_len=3, follow_prefill=follow,
                           always_pad_verify=pad)  # fmt: skip
    engine = AsyncEngine(tiny_config(spec=spec, **cfg))
    costs = engine.core.costs
    pin_costs(costs, engine.core.controller)  # levels frozen, no latency guard: no timing
    costs.level["mixed"] = mixed_level
    assert isinstance(engine.core.controller, GoodputPolicy)
    if useless_drafter:
        with torch.no_grad():
            for p in engine.core.spec.drafter.runner.model.parameters():
                p.copy_(torch.randn_like(p))
    return engine


async def _run(engine: AsyncEngine, prompts=PROMPTS, params=GREEDY) -> list[list[int]]:
    return await generate_all(engine, prompts, params)


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    return asyncio.run(_run(AsyncEngine(tiny_config())))


async def test_fused_verify_runs_in_the_decode_lane_and_is_lossless(reference):
    engine = _engine()
    assert await _run(engine) == reference
    policy = engine.core.controller
    assert policy.decisions["speculate"] > 0 and policy.num_fused > 0
    assert engine.core.spec.num_verifies > 0
    assert "verify" not in engine.dispatcher.launch_log  # every verify was fused


@pytest.mark.parametrize("beside", [False, True], ids=["drafts-ahead", "drafts-beside"])
async def test_separate_verify_lane_when_mixed_steps_are_dear_is_lossless(reference, beside):
    """Requests that may not speculate make a fused step mixed (eager); priced at 50x, the
    policy puts the verify on its own lane (its drafts made ahead of the plain rows' decode
    step, or beside it: ``SpecConfig.drafts_beside_decode``)."""
    engine = _engine(mixed_level=50.0)
    policy = engine.core.controller
    policy.goodput = type(policy.goodput)(
        latency_slack=5.0, rider_slack=5.0, drafts_beside_decode=beside
    )  # let plain rows wait
    engine.dispatcher.policy.drafts_beside_decode = beside
    policy.population = AcceptanceEstimate(0.02, 0.97)  # the drafter is the target
    params = [GREEDY, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                                     speculate=False)]  # fmt: skip

    async def one(rid, prompt, p):
        return [t async for out in engine.generate(rid, prompt, p) for t in out.new_token_ids]

    jobs = [one(f"r{i}", pr, params[i % 2]) for i, pr in enumerate(PROMPTS)]
    try:
        got = await asyncio.wait_for(asyncio.gather(*jobs), 120)
    finally:
        engine.check_integrity()
        await engine.stop()
    assert got == reference
    assert "verify" in engine.dispatcher.launch_log
    assert policy.decisions["speculate"] > policy.num_fused


async def test_the_drafter_follows_prefill_and_drafts_from_a_steady_start(reference):
    engine = _engine(follow=True)
    fed, catch_ups = spy_drafter(engine)
    assert await _run(engine) == reference
    assert sum(fed) == sum(len(p) for p in PROMPTS)  # every prompt token, once
    assert catch_ups and max(catch_ups) <= 2  # no proposal fed a whole context


async def test_a_useless_drafter_parks_the_policy_and_stops_following_prefill(reference):
    engine = _engine(useless_drafter=True, follow=True)
    engine.core.controller.population = AcceptanceEstimate(0.02, 0.0)  # many rejected verifies
    fed, _ = spy_drafter(engine)
    assert await _run(engine) == reference  # lossless whatever the drafter proposes
    assert not fed  # parked: the drafter never followed a prefill
    assert engine.core.spec.num_drafted <= 3 * len(PROMPTS)  # probes at most


def test_prefill_budget_follows_the_step_target():
    target = tiny_config(scheduler=SchedulerConfig(prefill_step_target_s=0.01005,
                                                   min_prefill_budget=16))  # fmt: skip
    core = AsyncEngine(target).core
    core.costs.shape = MemoryBound()
    # 1 ms + 0.1 ms per token: 90 tokens fit in 10 ms
    assert core.prefill_budget() == 90
    for _ in range(80):  # steps twice as slow as the shape says
        core.costs.observe("prefill", 2 * MemoryBound().prefill_time(90), 1, 90)
    assert core.prefill_budget() == 40
    plain = AsyncEngine(tiny_config()).core
    assert plain.prefill_budget() == plain.config.scheduler.max_num_batched_tokens


async def test_prefill_chunks_stay_within_the_budget(reference):
    # A TTFT budget a slow CPU never reaches: the bound is not lifted for a backlog here.
    cfg = SchedulerConfig(prefill_step_target_s=0.00405, min_prefill_budget=16, ttft_budget_s=600)
    engine = AsyncEngine(tiny_config(scheduler=cfg))
    pin_costs(engine.core.costs)
    budget = engine.core.prefill_budget()
    assert budget == 30
    sizes = []
    record = engine.core.record_step
    engine.core.record_step = lambda plan, s, contended=False: (
        sizes.append(plan.num_tokens) if plan.lane == "prefill" else None,
        record(plan, s, contended),
    )
    assert await _run(engine) == reference
    assert sizes and max(sizes) <= budget and max(len(p) for p in PROMPTS) > budget


@pytest.mark.parametrize("temperature", [0.0, 0.8])
async def test_plain_rows_padded_into_a_fused_verify_sample_exactly_as_unpadded(temperature):
    """A fused step whose plain rows (here: requests that may not speculate) are padded to the
    verify width, as the runner does where a graph exists for it, gives every request the
    tokens it gets unpadded, sampled ones included (their row is read before the padding)."""
    sampled = SamplingParams(max_tokens=16, temperature=temperature, seed=3, ignore_eos=True)
    rider = SamplingParams(max_tokens=16, temperature=temperature, seed=4, ignore_eos=True,
                           speculate=False)  # fmt: skip

    async def run(pad: bool):
        engine = _engine(mixed_level=1.0, pad=pad)
        policy = engine.core.controller
        policy.goodput = type(policy.goodput)(latency_slack=5.0, rider_slack=5.0, padded_fused=True)
        policy.population = AcceptanceEstimate(0.02, 0.97)
        runner = engine.core.runner
        widths = []
        width_of = runner.inputs.verify_width
        runner.inputs.verify_width = lambda plan: widths.append(width_of(plan)) or widths[-1]

        async def one(rid, prompt, p):
            return [t async for o in engine.generate(rid, prompt, p) for t in o.new_token_ids]

        jobs = [one(f"r{i}", pr, (sampled, rider)[i % 2]) for i, pr in enumerate(PROMPTS)]
        try:
            return await asyncio.wait_for(asyncio.gather(*jobs), 120), widths, policy
        finally:
            engine.check_integrity()
            await engine.stop()

    padded, widths, policy = await run(True)
    unpadded, _, _ = await run(False)
    assert padded == unpadded
    assert policy.num_fused > 0 and any(w > 0 for w in widths)  # plain rows were padded


def test_the_prefill_bound_needs_measured_costs_and_lifts_under_a_backlog():
    sched = SchedulerConfig(prefill_step_target_s=0.02)
    core = AsyncEngine(tiny_config(scheduler=sched)).core  # no calibration (CPU)
    high = core.config.scheduler.max_num_batched_tokens
    assert core.prefill_budget() == high  # the prior's costs are not the hardware's
    core.costs.shape = MemoryBound()
    bounded = core.prefill_budget()
    assert bounded < high
    core.add_request("r", list(range(1, 40)), SamplingParams(max_tokens=4))
    arrival = core.scheduler.waiting[0].arrival_time
    lift = core.config.scheduler.prefill_bound_lift * core.config.scheduler.ttft_budget_s
    assert core.prefill_budget(now=arrival + 0.9 * lift) == bounded
    assert core.prefill_budget(now=arrival + 1.1 * lift) == high


async def test_with_tpot_deadlines_the_policy_reads_each_requests_need_and_is_lossless(reference):
    """``tpot_deadlines``: every decodable row comes to the policy with its request's need
    (``SeqView.tpot_need_s``), which falls below a 0.1 ms target once its steps take longer
    (any CPU step does), and the output stays plain greedy's."""
    spec = tiny_draft_spec(controller=True, policy="goodput", max_draft_len=3,
                           initial_draft_len=3, tpot_target_s=1e-4, tpot_objective=True,
                           tpot_deadlines=True)  # fmt: skip
    engine = AsyncEngine(tiny_config(spec=spec))
    policy = engine.core.controller
    pin_costs(engine.core.costs, policy)
    needs, decide = [], policy.decide

    def spy(batch, load=None):
        needs.extend(v.tpot_need_s for v in batch)
        return decide(batch, load)

    policy.decide = spy
    assert await _run(engine) == reference
    assert needs and None not in needs  # every row had its first token
    assert min(needs) < 1e-4
