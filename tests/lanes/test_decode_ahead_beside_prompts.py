"""Decode-ahead (``EngineConfig.decode_ahead``) beside a prompt step in flight: no step ahead
there when ``decode_ahead_beside_prefill`` is off; decode steps spaced by
``decode_gap_beside_prefill_s`` (and none ahead) beside a long prompt step, and that setting's
validation; a step ahead waiting for a prompt step that lands before the decode step in flight
(``decode_ahead_waits_for_prompts``). The tokens are those of the plain path throughout."""

from __future__ import annotations

import asyncio

import pytest
from decode_ahead_helpers import PROMPTS, QUIET, _a_in_flight, _params, _run
from helpers import collect, tiny_config

from verifypd.lanes.async_engine import AsyncEngine
from verifypd.types import ScheduledSeq, Sequence, StepPlan


class _Never:
    """A step that stays in flight (stands for a long prompt step)."""

    def done(self) -> bool:
        return False


async def _beside_held_prompt_step(engine: AsyncEngine, held, on_decode, hold=(3, 9)):
    """Runs PROMPTS on ``engine`` with ``held`` (a prompt step that never lands) in flight from
    the ``hold[0]``-th plain decode launch to the ``hold[1]``-th; ``on_decode(plan)`` sees every
    decode launch first. Returns the tokens and the plain decode launches counted."""
    d = engine.dispatcher
    launch = d._launch_fn
    decodes = 0

    async def spy(lane, plan):
        nonlocal decodes
        if lane == "decode":
            on_decode(plan)
        pending = await launch(lane, plan)
        if lane == "decode" and plan.prev_ids is None and not d.sched.waiting:
            decodes += 1
            if decodes == hold[0]:  # a prompt step comes in beside the decode steps ...
                d.in_flight.setdefault("prefill", held)
            if decodes == hold[1]:  # ... and lands some decode steps later
                d.in_flight.pop("prefill", None)
        return pending

    d._launch_fn = spy
    jobs = [collect(engine, f"r{i}", p, _params(i)) for i, p in enumerate(PROMPTS)]
    try:
        out = await asyncio.wait_for(asyncio.gather(*jobs), 60)
    finally:
        await engine.stop()
    return out, decodes


@pytest.mark.parametrize("beside", [True, False])
async def test_no_step_ahead_beside_a_prompt_step_when_told(beside):
    """``EngineConfig.decode_ahead_beside_prefill=False``: while a prompt step is in flight no
    decode step is launched ahead (the decode stream leaves the host's turnaround to it); the
    tokens are those of the plain path either way."""
    from verifypd.lanes.dispatcher import InFlight

    plain, _ = await _run(False)
    engine = AsyncEngine(tiny_config(decode_ahead=True, decode_ahead_beside_prefill=beside))
    d = engine.dispatcher
    ahead_beside: list[bool] = []

    def on_decode(plan):
        if plan.prev_ids is not None:
            ahead_beside.append("prefill" in d.in_flight)

    held = InFlight(StepPlan("prefill", []), _Never(), 0.0)
    out, decodes = await _beside_held_prompt_step(engine, held, on_decode)
    assert out == plain
    assert decodes >= 9 and ahead_beside.count(False) > 0
    assert any(ahead_beside) is beside


@pytest.mark.parametrize("prompt_tokens", [2048, 512])
async def test_decode_steps_are_spaced_beside_a_long_prompt_step(prompt_tokens):
    """``EngineConfig.decode_gap_beside_prefill_s``: while a prompt step of 1,024 tokens or
    more is in flight, decode steps are launched at least the gap apart and none ahead; beside
    a shorter one (and before and after) they run back to back. Tokens as on the plain path."""
    from verifypd.lanes.dispatcher import InFlight

    gap = 0.2
    plain, _ = await _run(False)
    engine = AsyncEngine(tiny_config(decode_ahead=True, decode_gap_beside_prefill_s=gap))
    d = engine.dispatcher
    prompt = Sequence("long", [3] * prompt_tokens, QUIET)  # only its plan is shown
    held = InFlight(StepPlan("prefill", [ScheduledSeq(prompt, prompt_tokens)]), _Never(), 0.0)
    beside: list[float] = []  # launch times of decode steps while the prompt step is held
    free: list[float] = []

    def on_decode(plan):
        holding = d.in_flight.get("prefill") is held
        # the launch time the pacing rule reads (the dispatcher's clock, taken just before the
        # launch: a clock read here, later by a varying few µs, made gaps of 0.19997 s)
        (beside if holding else free).append(d.pacing.last_launch)
        if prompt_tokens >= 1024:  # none ahead beside the long one
            assert plan.prev_ids is None or not holding

    out, _ = await _beside_held_prompt_step(engine, held, on_decode, hold=(3, 8))
    assert out == plain
    gaps = [b - a for a, b in zip(beside, beside[1:], strict=False)]
    free_gaps = [b - a for a, b in zip(free, free[1:], strict=False)]
    assert len(beside) >= 4 and min(free_gaps) < gap  # back to back when nothing is held
    if prompt_tokens >= 1024:
        assert min(gaps) >= gap
    else:
        assert min(gaps) < gap


def test_the_decode_gap_is_validated():
    assert tiny_config().decode_gap_beside_prefill_s == 0.0
    assert tiny_config(decode_gap_beside_prefill_s=0.01).decode_gap_beside_prefill_s == 0.01
    for bad in (-0.01, 1.0, True, "0.01"):
        with pytest.raises(ValueError, match="decode_gap_beside_prefill_s"):
            tiny_config(decode_gap_beside_prefill_s=bad)


@pytest.mark.parametrize(
    "case,held",
    [("lands-first", True), ("lands-after", False), ("middle-chunk", False), ("told-not", False),
     ("crowded", True)],
)  # fmt: skip
async def test_a_step_ahead_waits_for_a_prompt_landing_before_the_step_in_flight(case, held):
    """``EngineConfig.decode_ahead_waits_for_prompts``: A's decode step is in flight beside B's
    prompt step. If the cost model has B's step land first, nothing goes ahead until it has
    landed, and then the step ahead takes A and B (a step ahead launched before could not take
    B, whose second token would wait behind it), however many rows A's step has (the rows in
    flight wait for nothing: the step goes ahead as B lands). If B's step lands after A's, or
    only computes a middle chunk of B's prompt, or the setting is off, the step goes ahead
    without B."""
    from verifypd.lanes.dispatcher import InFlight

    waits = case != "told-not"
    engine = AsyncEngine(tiny_config(decode_ahead=True, decode_ahead_waits_for_prompts=waits))
    d, core = engine.dispatcher, engine.core
    others = [f"A{i}" for i in range(5 if case == "crowded" else 0)]
    for rid in others:  # decoding beside A, in the same steps
        core.add_request(rid, [1, 2, 3], QUIET)
    await _a_in_flight(engine)
    head = d.in_flight["decode"]
    assert len(head.plan.seqs) == 1 + len(others)
    core.add_request("B", list(range(20, 60)), QUIET)
    budget = 8 if case == "middle-chunk" else 1 << 12
    prompt = StepPlan("prefill", core.scheduler.plan_prefill(budget, 8))
    core.scheduler.begin_step(prompt)
    d.in_flight["prefill"] = InFlight(prompt, _Never(), head.start)
    prefill_s = 0.030 if case == "lands-after" else 0.001
    core.costs.prefill = lambda tokens: prefill_s  # A's step: 20 ms beside it
    core.costs.decode = lambda rows, contended=False: 0.020 if contended else 0.004

    launched = await d._launch_ahead()

    assert launched is not held and d.num_ahead_held == int(held)
    assert await d._launch_ahead() is False  # asked once per step in flight (held: polled)
    assert d.num_ahead_held == int(held)
    del d.in_flight["prefill"]  # B's prompt step lands
    core.apply_step(prompt, core.launch(prompt).result())
    if held:
        assert await d._launch_ahead() is True  # now, behind A's step: nobody waited for B
        assert d.ahead.step.plan.prev_ids is not None and d.in_flight["decode"] is head
    ahead = sorted(e.seq.request_id for e in d.ahead.step.plan.seqs)
    assert ahead == sorted(["A", *others, *(["B"] if held else [])])
    await engine.stop()
