"""Decode-ahead (``EngineConfig.decode_ahead``) and the speculation policy: with A's decode step
in flight, the policy decides for the step ahead. Nothing is launched ahead where that decision
would speculate, and it is kept as the next step's (asked once per step in flight); a catch-up
round decided there runs; a kept decision serves a row that joined since only without
``second_token_plain`` (with it, a fresh row's first step goes ahead plain); a stored decision
naming no one left is dropped."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from decode_ahead_helpers import QUIET, _a_in_flight
from helpers import tiny_config, tiny_draft_spec

from verifypd.engine.core import EngineCore
from verifypd.lanes.async_engine import AsyncEngine
from verifypd.types import NO_SPECULATION, SpecDecision, StepPlan


def _prefill_now(core: EngineCore) -> None:
    """Every waiting prompt prefilled in one step, landed: its requests decode next."""
    prefill = StepPlan("prefill", core.scheduler.plan_prefill(1 << 12, 8))
    core.scheduler.begin_step(prefill)
    core.apply_step(prefill, core.launch(prefill).result())


async def _land_decode(d) -> None:
    for _ in range(500):  # the decode step in flight lands
        if d.collect():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the decode step never landed")


@pytest.mark.parametrize("speculates", [True, False])
async def test_a_step_ahead_waits_when_the_policy_would_speculate(speculates):
    """A decode step of A is in flight and B, just prefilled, may speculate: the policy's
    decision for the step ahead (A ahead, B decodable) drafts for B, so nothing is launched
    ahead and B drafts in the next step after A lands. If B may not speculate, the step goes
    ahead with both."""
    engine = AsyncEngine(tiny_config(decode_ahead=True, spec=tiny_draft_spec()))
    d, core = engine.dispatcher, engine.core
    await _a_in_flight(engine)
    core.add_request("B", [7, 8, 9], dataclasses.replace(QUIET, speculate=speculates))
    _prefill_now(core)  # B decodes next

    decisions = []
    decide = d.policy.decide
    d.policy.decide = lambda *a, **k: decisions.append(1) or decide(*a, **k)

    launched = await d._launch_ahead()

    assert launched is not speculates
    if launched:
        assert {e.seq.request_id for e in d.ahead.step.plan.seqs} == {"A", "B"}
    else:  # asked once per step in flight, however often the loop polls
        assert await d._launch_ahead() is False and len(decisions) == 1
        # ... and that decision is the next step's: once A lands, B drafts as decided there,
        # without asking again (a second answer would have lost B's catch-up round).
        await _land_decode(d)
        plan = d._plan_decode()
        assert len(decisions) == 1 and d.ahead.decided is None
        lens = {e.seq.request_id: e.draft_len for e in plan.seqs}
        assert lens["B"] > 0 and lens["A"] == 0
        core.scheduler.abandon(plan)
    await engine.stop()


async def test_a_catch_up_round_decided_for_the_step_ahead_runs():
    """The goodput policy: A's decode step is in flight when B arrives with a prompt its
    drafter has not followed (further behind than max_catch_up). Deciding on a step ahead of
    A's, the policy schedules B's catch-up round, so nothing runs ahead; that decision must be
    the next step's. Asked again (as before 3846172), the round was already spent, B was no
    candidate, and with decode-ahead on a GPU (a step always in flight) B never drafted.
    (B's second token is not held back here, ``second_token_plain`` off: with it B's first
    step is plain and goes ahead, the next test.)"""
    spec = tiny_draft_spec(
        controller=True, policy="goodput", follow_prefill=False, second_token_plain=False
    )
    engine = AsyncEngine(tiny_config(decode_ahead=True, spec=spec))
    d, core = engine.dispatcher, engine.core
    pol = d.policy.controller  # CPU costs: make B's round pay, with A riding along
    pol.costs.catch_up = lambda tokens, contended=False: 0.0
    pol.goodput = dataclasses.replace(pol.goodput, rider_slack=10.0, eager_draft_s=0.0)
    await _a_in_flight(engine)
    core.add_request("B", list(range(10, 110)), dataclasses.replace(QUIET, speculate=True))
    _prefill_now(core)  # B decodes next, its drafter far behind

    assert await d._launch_ahead() is False
    assert pol.last.reason == "catch_up"
    await _land_decode(d)
    plan = d._plan_decode()
    lens = {e.seq.request_id: e.draft_len for e in plan.seqs}
    assert lens["B"] > 0 and lens["A"] == 0
    assert pol.decisions["catch_up"] == 1
    core.scheduler.abandon(plan)
    await engine.stop()


@pytest.mark.parametrize("plain", [False, True])
async def test_a_kept_decision_serves_a_joined_row_only_without_second_token_plain(plain):
    """A decision kept for the next step (made while A's step was in flight) names A; B's
    prompt lands before that step is planned. Without ``second_token_plain`` the step takes
    the kept decision and B rides it; with it, the policy decides again for the batch with B
    (B's second token must not wait for drafts it was never weighed against)."""
    spec = tiny_draft_spec(second_token_plain=plain)
    engine = AsyncEngine(tiny_config(decode_ahead=True, spec=spec))
    d, core = engine.dispatcher, engine.core
    assert d.ahead.same_batch_only is plain
    core.add_request("A", [1, 2, 3, 4, 5], QUIET)
    _prefill_now(core)  # A decodes next
    a = core.decodable()[0]
    d.ahead.keep(SpecDecision(lens={a.seq_id: 3}, fused=True), [a])
    core.add_request("B", [7, 8, 9], QUIET)
    _prefill_now(core)  # B joined
    decisions = []
    d.policy.decide = lambda *a, **k: decisions.append(1) or NO_SPECULATION
    plan = d._plan_decode()
    lens = {e.seq.request_id: e.draft_len for e in plan.seqs}
    if plain:
        assert decisions == [1] and lens == {"A": 0, "B": 0}
    else:
        assert decisions == [] and lens == {"A": 3, "B": 0} and plan.fused
    core.scheduler.abandon(plan)
    await engine.stop()


async def test_a_fresh_rows_first_step_goes_ahead_plain_with_second_token_plain():
    """The same arrival with ``second_token_plain`` (the default): B's first decode step gives
    its second token, so the policy neither catches it up nor lets it ride a round there; the
    step goes ahead with A and B, and B's catch-up round comes in a later step."""
    spec = tiny_draft_spec(controller=True, policy="goodput", follow_prefill=False)
    assert spec.second_token_plain
    engine = AsyncEngine(tiny_config(decode_ahead=True, spec=spec))
    d, core = engine.dispatcher, engine.core
    pol = d.policy.controller
    pol.costs.catch_up = lambda tokens, contended=False: 0.0
    pol.goodput = dataclasses.replace(pol.goodput, rider_slack=10.0, eager_draft_s=0.0)
    await _a_in_flight(engine)
    core.add_request("B", list(range(10, 110)), dataclasses.replace(QUIET, speculate=True))
    _prefill_now(core)

    assert await d._launch_ahead() is True
    assert {e.seq.request_id: e.draft_len for e in d.ahead.step.plan.seqs} == {"A": 0, "B": 0}
    assert pol.decisions["catch_up"] == 0
    await engine.stop()


async def test_a_stored_decision_naming_no_one_left_is_not_used():
    """A decision stored for the next step whose speculating sequences all ended with the step
    in flight is dropped: the policy decides for the batch there is."""
    engine = AsyncEngine(tiny_config(decode_ahead=True, spec=tiny_draft_spec()))
    d, core = engine.dispatcher, engine.core
    core.add_request("A", [1, 2, 3, 4, 5], QUIET)
    _prefill_now(core)  # A decodes next
    gone = max(s.seq_id for s in core.decodable()) + 1
    d.ahead.decided = SpecDecision(lens={gone: 4}, fused=True)
    decisions = []
    decide = d.policy.decide
    d.policy.decide = lambda *a, **k: decisions.append(1) or decide(*a, **k)
    plan = d._plan_decode()
    assert len(decisions) == 1 and d.ahead.decided is None
    assert [(e.seq.request_id, e.draft_len) for e in plan.seqs] == [("A", 0)]
    assert not plan.fused
    core.scheduler.abandon(plan)
    await engine.stop()
