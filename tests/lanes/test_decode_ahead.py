"""Decode-ahead (``EngineConfig.decode_ahead``): a decode step planned and launched behind the
one in flight, its input tokens read on the device. On CPU the worker thread runs each step
before the next tick, so every other decode step is launched ahead of the one not yet folded
back in: the same bookkeeping as on a GPU, checked token for token against the plain path."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from helpers import assert_engine_clean, collect, hang_up_partway, tiny_config, tiny_draft_spec

from verifypd.config import CacheConfig
from verifypd.engine.core import EngineCore
from verifypd.lanes.async_engine import AsyncEngine
from verifypd.types import (
    NO_SPECULATION,
    Observer,
    RequestFailure,
    SamplingParams,
    ScheduledSeq,
    SeqStatus,
    Sequence,
    SpecDecision,
    StepPlan,
    StructuredOutput,
)

PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3], [7] * 40, list(range(10, 60)), [9, 8, 7],
           list(range(100, 130)), [4, 4, 5, 5, 6, 6]]  # fmt: skip


def _params(i: int, stop_token: int | None = None) -> SamplingParams:
    """Greedy and seeded sampling, different lengths (some end while a step ahead is in
    flight), one request with a penalty (never planned ahead: it rides as an ordinary entry)."""
    kw = {"max_tokens": 9 + 4 * i, "ignore_eos": True}
    if i % 2:
        kw.update(temperature=0.9, seed=11 + i)
    else:
        kw.update(temperature=0.0)
    if i == 4:
        kw.update(frequency_penalty=0.5)
    if stop_token is not None and i == 1:
        kw.update(stop_token_ids=[stop_token])
    return SamplingParams(**kw)


class AheadCounter(Observer):
    def __init__(self) -> None:
        self.steps = 0

    def decode_ahead(self) -> None:
        self.steps += 1


async def _run(ahead: bool, stop_token: int | None = None) -> tuple[list[list[int]], int]:
    counter = AheadCounter()
    engine = AsyncEngine(tiny_config(decode_ahead=ahead), observer=counter)
    jobs = [collect(engine, f"r{i}", p, _params(i, stop_token)) for i, p in enumerate(PROMPTS)]
    try:
        out = await asyncio.wait_for(asyncio.gather(*jobs), 60)
    finally:
        assert_engine_clean(engine)  # every block back, including those of steps ahead
        await engine.stop()
    assert counter.steps == engine.dispatcher.num_ahead_steps  # the metric's hook
    return out, engine.dispatcher.num_ahead_steps


async def test_decode_ahead_is_token_identical_and_leaks_nothing():
    plain, none_ahead = await _run(False)
    ahead, num_ahead = await _run(True)
    assert none_ahead == 0 and num_ahead > 0
    assert ahead == plain


async def test_a_stop_token_landing_under_a_step_ahead_drops_its_token():
    plain, _ = await _run(False)
    stop = plain[1][5]  # request 1 stops at its sixth token (or earlier, at a repeat)
    ref, _ = await _run(False, stop_token=stop)
    got, num_ahead = await _run(True, stop_token=stop)
    assert num_ahead > 0
    assert got == ref
    assert got[1] == ref[1] and len(got[1]) <= 6 and got[1][-1] == stop


async def test_abort_with_a_step_ahead_in_flight_frees_every_block():
    engine = AsyncEngine(tiny_config(decode_ahead=True, cache=CacheConfig(num_blocks=64)))
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    await hang_up_partway(engine, PROMPTS, params, every=4)
    assert engine.dispatcher.num_ahead_steps > 0
    assert_engine_clean(engine)
    await engine.stop()


def test_default_is_on_only_where_launches_enqueue():
    assert AsyncEngine(tiny_config()).dispatcher.decode_ahead is False  # CPU: a worker thread
    assert AsyncEngine(tiny_config(decode_ahead=True)).dispatcher.decode_ahead is True
    spec = AsyncEngine(tiny_config(decode_ahead=True, spec=tiny_draft_spec())).dispatcher
    assert spec.decode_ahead is True  # while the policy speculates for no one
    single = AsyncEngine(tiny_config(decode_ahead=True, lane_mode="single"))
    assert single.dispatcher.decode_ahead is False


async def _run_spec(ahead: bool, speculate: list[bool]):
    """Draft-model speculation (the drafter is the target: every draft is accepted) where only
    the requests marked ``speculate`` may speculate (the fixed-L policy speculates for every
    one of them). Checks at each launch ahead that no running request may speculate."""
    engine = AsyncEngine(tiny_config(decode_ahead=ahead, spec=tiny_draft_spec()))
    launch = engine.dispatcher._launch_ahead
    speculating_at_launch: list[int] = []

    async def spy():
        running = [s for s in engine.core.scheduler.running if s.status is SeqStatus.DECODING]
        launched = await launch()
        if launched:
            speculating_at_launch.append(sum(s.params.speculate for s in running))
        return launched

    engine.dispatcher._launch_ahead = spy
    jobs = [
        collect(engine, f"r{i}", p, dataclasses.replace(_params(0), speculate=speculate[i]))
        for i, p in enumerate(PROMPTS)
    ]
    try:
        out = await asyncio.wait_for(asyncio.gather(*jobs), 60)
    finally:
        assert_engine_clean(engine)
        await engine.stop()
    return out, speculating_at_launch, engine.core.spec.num_drafted


async def test_with_a_drafter_decode_runs_ahead_while_no_one_speculates():
    """No request may speculate: the policy decides "no one" for every step, and decode runs
    ahead as without a drafter; the same tokens as without decode-ahead."""
    quiet = [False] * len(PROMPTS)
    ref, none, _ = await _run_spec(False, quiet)
    got, launches, drafted = await _run_spec(True, quiet)
    assert none == [] and len(launches) > 0 and drafted == 0
    assert got == ref


async def test_with_speculating_requests_nothing_runs_ahead_of_a_drafting_step():
    """Half the requests speculate: while any of them runs, the policy's decision for the step
    ahead speculates and nothing is launched ahead (a drafting step needs landed tokens); once
    they finish, decode runs ahead. Lossless either way."""
    mixed = [i % 2 == 0 for i in range(len(PROMPTS))]
    ref, _, drafted_ref = await _run_spec(False, mixed)
    got, launches, drafted = await _run_spec(True, mixed)
    assert got == ref
    assert drafted_ref > 0 and drafted > 0
    assert launches and all(n == 0 for n in launches)


# Greedy wherever the case allows: a prompt step sampling the end-of-text token at random
# would end the request before its decode step (the test failed that way now and then).
@pytest.mark.parametrize(
    "params,ahead",
    [
        (SamplingParams(max_tokens=50, temperature=0.0), True),
        (SamplingParams(max_tokens=50, temperature=0.7, seed=1), True),
        (SamplingParams(max_tokens=50, temperature=0.0, repetition_penalty=1.2), False),
        (SamplingParams(max_tokens=50, temperature=0.0, logit_bias={5: 1.0}), False),
        (SamplingParams(max_tokens=50, temperature=0.0, min_tokens=4), False),
        (SamplingParams(max_tokens=50, temperature=0.0, logprobs=2), False),
        ("grammar", False),  # set on the sequence below (dummy:tiny has no HF tokenizer)
        (SamplingParams(max_tokens=2, temperature=0.0), False),  # the step in flight: its last
    ],
    ids=["greedy", "seeded", "penalty", "bias", "min-tokens", "logprobs", "grammar", "last"],
)
def test_plan_ahead_takes_only_what_needs_nothing_from_the_host(params, ahead):
    grammar = params == "grammar"
    if grammar:
        params = SamplingParams(max_tokens=50, temperature=0.0)
    core = EngineCore(tiny_config())
    core.add_request("r", [1, 2, 3, 4, 5], params)
    sched = core.scheduler
    prefill = StepPlan("prefill", sched.plan_prefill(1 << 12, 8))
    sched.begin_step(prefill)
    core.apply_step(prefill, core.launch(prefill).result())
    plan = StepPlan("decode", sched.plan_decode(NO_SPECULATION))
    sched.begin_step(plan)
    pending = core.launch(plan)
    seq = plan.seqs[0].seq
    if grammar:
        seq.params = dataclasses.replace(params, structured=StructuredOutput("json_object"))

    entries = sched.plan_ahead(plan, pending.sampled_at)

    assert [e.seq for e in entries] == ([seq] if ahead else [])
    if ahead:
        (e,) = entries
        assert e.ahead_position == seq.num_tokens and e.sample_position == seq.num_tokens + 1
        assert len(seq.block_table) * core.kv.block_size >= seq.num_tokens + 1  # slot reserved


async def test_a_request_failing_in_a_step_ahead_ends_alone():
    """A launch ahead that fails for one request's own inputs (``RequestFailure``) ends that
    request with "error"; the others plan again and finish with the tokens they get without
    it; every block comes back."""
    alone, _ = await _run(True)
    engine = AsyncEngine(tiny_config(decode_ahead=True))
    launch = engine.dispatcher._launch_fn
    failed: list[int] = []

    async def poisoned(lane, plan):
        ahead = [e.seq.request_id for e in plan.seqs if e.is_ahead]
        if "r2" in ahead and not failed:
            failed.append(len(plan.seqs))
            raise RequestFailure({"r2"}, RuntimeError("poisoned input"))
        return await launch(lane, plan)

    engine.dispatcher._launch_fn = poisoned
    reasons: dict[str, str | None] = {}

    async def run(i, prompt):
        ids = []
        async for out in engine.generate(f"r{i}", prompt, _params(i)):
            ids += out.new_token_ids
            if out.finished:
                reasons[f"r{i}"] = out.finish_reason
        return ids

    try:
        jobs = [run(i, p) for i, p in enumerate(PROMPTS)]
        got = await asyncio.wait_for(asyncio.gather(*jobs), 60)
        assert failed and reasons["r2"] == "error"
        assert all(reasons[f"r{i}"] == "length" for i in range(len(PROMPTS)) if i != 2)
        others = [i for i in range(len(PROMPTS)) if i != 2]
        assert [got[i] for i in others] == [alone[i] for i in others]
        assert got[2] == alone[2][: len(got[2])]  # what it got before the failure is right
        assert_engine_clean(engine)
    finally:
        await engine.stop()


QUIET = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, speculate=False)


async def _a_in_flight(engine: AsyncEngine) -> None:
    """Request A (may not speculate) prefilled, its first decode step left in flight."""
    d = engine.dispatcher
    engine.core.add_request("A", [1, 2, 3, 4, 5], QUIET)
    for _ in range(20):
        await d.tick()
        if "decode" in d.in_flight:
            break
    assert "decode" in d.in_flight and d.ahead.step is None


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


def test_the_launch_log_stays_bounded_for_launches_ahead_too():
    """A server runs for days, and with decode-ahead most decode launches go ahead."""
    d = AsyncEngine(tiny_config(decode_ahead=True)).dispatcher
    for _ in range(10_000):
        d._log_launch("decode")
    assert 2048 <= len(d.launch_log) <= 4096


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
