"""The lane dispatcher against a small fake engine (``fake_core``: the real scheduler and KV
block manager, no model): speculative rounds over three lanes, fused verifies, rejected drafts,
a failing request, and the promise that planning launches nothing."""

from __future__ import annotations

import pytest
from fake_core import FakeCore, FakePending, FakePolicy

from verifypd.lanes.dispatcher import InFlight, LaneDispatcher
from verifypd.types import RequestFailure, RequestOutput, SeqStatus, StepPlan

PROMPTS = {"a": [10, 11, 12], "b": list(range(100, 121)), "c": [7]}
MAX_TOKENS = 9


def _setup(single_lane=False, max_tokens=MAX_TOKENS, **policy_kw):
    core = FakeCore()
    policy = FakePolicy(core, **policy_kw)
    delivered: list[RequestOutput] = []

    async def launch(lane, plan):
        return core.launch(plan)

    d = LaneDispatcher(core, launch, delivered.append, 10.0, single_lane=single_lane,
                       policy=policy)  # fmt: skip
    for rid, prompt in PROMPTS.items():
        core.add_request(rid, prompt, max_tokens)
    return core, policy, d, delivered


async def _drain(d: LaneDispatcher) -> None:
    for _ in range(500):
        if not d.has_work():
            return
        await d.tick()
    raise AssertionError("the dispatcher did not finish its requests")


def _tokens(delivered: list[RequestOutput]) -> dict[str, list[int]]:
    got: dict[str, list[int]] = {}
    for out in delivered:
        got.setdefault(out.request_id, []).extend(out.new_token_ids)
    return got


def _expected(rid: str) -> list[int]:
    last = PROMPTS[rid][-1]
    return [last + 1 + k for k in range(MAX_TOKENS)]


def _assert_clean(core: FakeCore, delivered: list[RequestOutput]) -> None:
    assert core.kv.num_free_blocks == core.kv.num_blocks  # nothing leaked
    core.kv.check_integrity([])
    assert {o.request_id for o in delivered if o.finished} == set(PROMPTS)


@pytest.mark.parametrize("single_lane", [False, True], ids=["three-lane", "single-lane"])
@pytest.mark.parametrize("wrong_from", [None, 1, 0], ids=["all-accepted", "one-of-3", "none"])
async def test_speculative_rounds_give_the_plain_output(single_lane, wrong_from):
    core, policy, d, delivered = _setup(single_lane)
    policy.wrong_from = wrong_from
    await _drain(d)
    got = _tokens(delivered)
    assert got == {rid: _expected(rid) for rid in PROMPTS}
    _assert_clean(core, delivered)
    verified = [p for p in core.launched if any(e.draft_token_ids for e in p.seqs)]
    assert verified, "nobody speculated"
    if not single_lane:  # drafted entries went through the verify lane, alone
        assert {p.lane for p in verified} == {"verify"}
        assert "verify" in d.launch_log


async def test_the_policy_hears_of_prompt_work_in_flight_or_queued():
    """A decode step planned while prompts wait or a prefill step is in flight tells the
    policy so (``GoodputConfig.yield_to_prefill`` reads it); once every prompt is in, it
    does not."""
    core, policy, d, delivered = _setup()
    await _drain(d)
    assert policy.prefill_seen[0] is True  # "b" (21 tokens) needs three chunks
    assert policy.prefill_seen[-1] is False
    assert _tokens(delivered) == {rid: _expected(rid) for rid in PROMPTS}


async def test_steps_beside_a_prompt_step_are_timed_as_contended():
    """A step launched while a prefill step is in flight, or in flight when one is launched,
    is recorded as contended (the cost model's own levels); prompt steps and every step after
    the last prompt chunk landed are not."""
    core, policy, d, delivered = _setup()
    await _drain(d)
    prefills = sum(1 for p in core.launched if p.lane == "prefill")
    assert prefills >= 3  # "b" (21 tokens) in chunks of 8
    last_prefill = max(i for i, (lane, _) in enumerate(core.recorded) if lane == "prefill")
    before = [c for lane, c in core.recorded[:last_prefill] if lane != "prefill"]
    assert any(before), "no step was timed beside a prompt step"
    assert not any(c for lane, c in core.recorded if lane == "prefill")
    assert not any(c for _, c in core.recorded[last_prefill + 2 :])
    assert _tokens(delivered) == {rid: _expected(rid) for rid in PROMPTS}


async def test_drafts_made_while_a_prompt_step_runs_are_timed_as_contended():
    core, policy, d, _ = _setup()
    while not core.decodable() or d.in_flight:  # the first prompt chunks land
        await d.tick()
    assert policy.proposed_contended == []
    # a prompt step in flight (one that stays: it never lands)
    d.in_flight["prefill"] = InFlight(StepPlan("prefill", []), FakePending([]), 0.0)
    d.in_flight["prefill"].pending.polls = -(10**6)
    await d.tick()
    assert policy.proposed_contended == [True]
    del d.in_flight["prefill"]
    await _drain(d)
    assert policy.proposed_contended[-1] is False


async def test_a_fused_decision_verifies_inside_the_decode_step():
    core, policy, d, delivered = _setup(fused=True)
    await _drain(d)
    assert _tokens(delivered) == {rid: _expected(rid) for rid in PROMPTS}
    assert "verify" not in d.launch_log
    assert any(p.lane == "decode" and any(e.draft_token_ids for e in p.seqs)
               for p in core.launched)  # fmt: skip
    _assert_clean(core, delivered)


async def test_planning_launches_nothing_and_marks_no_sequence():
    """A plan is data: the decision (each entry's draft length) and KV slots, no drafting, no
    launch, no sequence status or in-flight mark; drafting is part of the launch."""
    core, policy, d, _ = _setup(max_tokens=100)
    policy.draft_len = 0  # prefill every prompt, plain decodes: no drafting yet
    for _ in range(50):
        await d.tick()
        if all(s.status is SeqStatus.DECODING for s in core.seqs.values()):
            break
    while d.in_flight:  # let the steps in flight land
        d.collect()
    policy.draft_len = 3
    decoding = list(core.decodable())
    assert decoding
    launched = len(core.launched)
    plan = d._plan("decode")
    assert plan is not None and {e.draft_len for e in plan.seqs} == {3}
    assert not policy.proposed and len(core.launched) == launched
    assert all(not e.draft_token_ids for e in plan.seqs)
    assert all(s.status is SeqStatus.DECODING and not s.in_flight for s in decoding)
    assert not d.verify_queue
    await d._launch("decode", plan)  # drafting happens here: the cohort queues for verify
    assert policy.proposed and len(d.verify_queue) == len(plan.seqs)
    assert all(s.status is SeqStatus.VERIFYING for s in decoding)


async def test_a_failing_request_ends_alone_and_frees_its_blocks():
    core, policy, d, delivered = _setup()
    launch = core.launch

    def failing(plan):
        if any(e.seq.request_id == "b" and e.seq.num_output_tokens >= 2 for e in plan.seqs):
            raise RequestFailure({"b"}, ValueError("bad sampling tensors"))
        return launch(plan)

    core.launch = failing
    await _drain(d)
    got = _tokens(delivered)
    assert got["a"] == _expected("a") and got["c"] == _expected("c")
    assert [o.finish_reason for o in delivered if o.request_id == "b" and o.finished] == ["error"]
    _assert_clean(core, delivered)


@pytest.mark.parametrize("beside", [False, True])
@pytest.mark.parametrize("fused", [False, True])
async def test_a_separate_rounds_drafts_are_made_on_the_verify_lanes_stream_when_beside(
    beside, fused
):
    """``drafts_beside_decode``: a round whose verify runs on its own lane drafts under the
    verify lane's stream context, so the plain rows' decode step does not queue behind the
    drafts; a fused round (its verify inside the decode step) always drafts on the decode
    lane's. The output is the plain output either way."""
    core = FakeCore()
    policy = FakePolicy(core, fused=fused)
    policy.drafts_beside_decode = beside
    delivered: list[RequestOutput] = []
    contexts: list[str] = []

    class Recorder:
        def __init__(self, lane):
            self.lane = lane

        def __enter__(self):
            contexts.append(self.lane)

        def __exit__(self, *exc):
            return False

    async def launch(lane, plan):
        return core.launch(plan)

    d = LaneDispatcher(core, launch, delivered.append, 10.0, policy=policy,
                       lane_context=Recorder)  # fmt: skip
    proposed_under: list[str] = []
    inner = policy.propose

    def propose(entries, contended=False):
        proposed_under.append(contexts[-1])
        return inner(entries, contended)

    policy.propose = propose
    for rid, prompt in PROMPTS.items():
        core.add_request(rid, prompt, MAX_TOKENS)
    await _drain(d)
    assert _tokens(delivered) == {rid: _expected(rid) for rid in PROMPTS}
    assert proposed_under  # the rounds drafted
    want = "verify" if beside and not fused else "decode"
    assert set(proposed_under) == {want}
    _assert_clean(core, delivered)


@pytest.mark.parametrize("single_lane", [False, True], ids=["three-lane", "single-lane"])
@pytest.mark.parametrize("before", [True, False], ids=["before", "after"])
async def test_deltas_go_out_before_a_drafting_launch_that_follows_a_plain_one(single_lane, before):
    """Deltas waiting for the next launch (``emit_after_launch``) go out before it, their
    consumers first (the tick launches nothing more), when it drafts and the launch before it
    was plain (``deliver_before_drafting``); behind a drafting launch after another they follow
    it. The policy is asked once per launched step either way (the decision is kept)."""
    core = FakeCore()
    policy = FakePolicy(core, draft_len=0, fused=True)
    events: list[str] = []

    async def launch(lane, plan):
        events.append("draft" if any(e.draft_token_ids for e in plan.seqs) else lane)
        return core.launch(plan)

    def deliver(out: RequestOutput) -> None:
        events.append("delta")
        delivered.append(out)

    delivered: list[RequestOutput] = []
    d = LaneDispatcher(core, launch, deliver, 10.0, single_lane=single_lane, policy=policy,
                       emit_after_launch=True, deliver_before_drafting=before)  # fmt: skip
    core.add_request("a", PROMPTS["a"], MAX_TOKENS)
    step = "mixed" if single_lane else "decode"
    while events.count(step) < 2:  # the prompt step, then plain steps
        await d.tick()
    policy.draft_len = 3
    await _drain(d)
    assert _tokens(delivered)["a"] == _expected("a")
    _assert_clean_one(core)
    first = events.index("draft")
    steps = sum(e in (step, "prefill") for e in events[:first])  # one token each
    # Before: every plain step's token is out before the drafting launch; after: the last
    # one follows it.
    assert events[:first].count("delta") == steps - (not before)
    # A round's deltas follow the next drafting launch: between the two, only the last plain
    # step's (after).
    later = events.index("draft", first + 1)
    assert events[first + 1 : later].count("delta") == (not before)
    launches = sum(e in (step, "draft") for e in events)
    assert len(policy.prefill_seen) == launches


def _assert_clean_one(core: FakeCore) -> None:
    assert core.kv.num_free_blocks == core.kv.num_blocks
    core.kv.check_integrity([])


@pytest.mark.parametrize("gone", ["a", "b"])
async def test_a_request_aborted_while_deltas_go_out_ahead_of_a_round_loses_nothing(gone):
    """Between the tick that hands deltas out ahead of a drafting launch and the tick that
    launches it (their consumers run in between), a request is aborted: the kept decision
    serves the rest, the other request gets its whole output, and no block leaks."""
    core = FakeCore()
    policy = FakePolicy(core, draft_len=0, fused=True)
    delivered: list[RequestOutput] = []

    async def launch(lane, plan):
        return core.launch(plan)

    d = LaneDispatcher(core, launch, delivered.append, 10.0, policy=policy,
                       emit_after_launch=True, deliver_before_drafting=True)  # fmt: skip
    for rid in ("a", "b"):
        core.add_request(rid, PROMPTS[rid], MAX_TOKENS)
    while min(core.sent.get(rid, 0) for rid in ("a", "b")) < 2:  # both decoding plainly
        await d.tick()
    policy.draft_len = 3
    for _ in range(20):
        await d.tick()
        if d.deltas.num_ahead:
            break
    assert d.deltas.num_ahead == 1
    assert core.seqs[gone].seq_id in d.ahead.decided.lens  # kept for the launch to come
    for out in core.abort_request(gone):
        delivered.append(out)
    await _drain(d)
    kept = "b" if gone == "a" else "a"
    assert _tokens(delivered)[kept] == _expected(kept)
    assert {o.request_id for o in delivered if o.finished} == {"a", "b"}
    assert any(o.finish_reason == "abort" for o in delivered if o.request_id == gone)
    _assert_clean_one(core)
