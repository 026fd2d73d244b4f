"""The goodput policy ranking its plans by goodput's own measure (``GoodputConfig.tpot_objective``,
``plan_search.TargetGoal``): the share of rows whose time per token meets the TPOT target
first, tokens a second only between plans that bring as many rows under it."""

import pytest
from goodput_helpers import FakeClock, Shape, _add, _policy, _teach, _views

from verifypd.config import SchedulerConfig, SpecConfig
from verifypd.controller import GoodputConfig, SeqView, expected_tokens
from verifypd.controller.cadence import Cadence
from verifypd.controller.plan_search import PlanSearch
from verifypd.controller.tpot_goal import TargetGoal, tpot_need_s
from verifypd.lanes.spec_policy import goodput_config_for, tpot_need
from verifypd.sampling_params import SamplingParams
from verifypd.types import Sequence


def _decide(alphas, target_s, objective, draft=3e-3, **goodput):
    policy = _policy(Shape(draft=draft), tpot_target_s=target_s, tpot_objective=objective,
                     **goodput)  # fmt: skip
    ids = _add(policy, len(alphas))
    for i, alpha in zip(ids, alphas, strict=True):
        _teach(policy, i, alpha)
    return policy, ids, policy.decide(_views(ids))


def _within(policy, ids, d, target_s):
    """Rows whose expected time per token under decision ``d`` meets ``target_s``."""
    out = 0
    for i in ids:
        if d.draft_lens[i]:
            per_token = d.predicted_step_s / expected_tokens(policy.acceptance(i), d.draft_len)
        else:
            per_token = d.predicted_step_s if d.draft_len else d.plain_step_s
        out += per_token <= target_s
    return out


def test_the_objective_brings_more_rows_under_the_target_than_the_most_tokens_a_second():
    """Four requests at 0.9 and four at 0.6, a dear drafter, a 9 ms target below the plain step
    (10.16 ms). The most tokens a second drafts two a round: the 0.9 ones make the target, the
    0.6 ones do not. Ranked by rows within the target, one draft a round brings all eight
    under it, for a few per cent fewer tokens a second."""
    target = 9e-3
    alphas = [0.9] * 4 + [0.6] * 4
    p_tok, ids, by_tokens = _decide(alphas, target, objective=False)
    p_obj, _, by_rows = _decide(alphas, target, objective=True)
    assert by_tokens.plain_step_s > target
    assert by_tokens.draft_len == 2 and by_rows.draft_len == 1
    assert all(by_rows.draft_lens.values()) and all(by_tokens.draft_lens.values())
    assert _within(p_tok, ids, by_tokens, target) == 4
    assert _within(p_obj, ids, by_rows, target) == 8
    rate = lambda d: d.predicted_tokens / d.predicted_step_s  # noqa: E731
    assert 0.9 * rate(by_tokens) < rate(by_rows) < rate(by_tokens)


def test_the_objective_speculates_where_no_plan_beats_plain_tokens_a_second():
    """One request at 0.9, two at 0.6 and four at 0.2 with a dearer drafter, a 10 ms target
    the plain step (10.14 ms) misses: no plan has more tokens a second than plain decoding,
    but a round of one draft brings the three that accept well under the target."""
    target = 10e-3
    alphas = [0.9] + [0.6] * 2 + [0.2] * 4
    _, _, by_tokens = _decide(alphas, target, objective=False, draft=4e-3)
    policy, ids, by_rows = _decide(alphas, target, objective=True, draft=4e-3)
    assert by_tokens.draft_len == 0 and by_tokens.reason == "no_gain"
    assert by_rows.draft_len == 1 and by_rows.reason == "speculate"
    assert _within(policy, ids, by_rows, target) == 3


@pytest.mark.parametrize("target_ms", [12.0, 30.0])
def test_with_a_target_the_plain_step_meets_the_objective_changes_nothing_here(target_ms):
    """With the plain step under the target the bounds hold and every row of these plans
    meets it, so the ranking falls to tokens a second: the same decision as without."""
    alphas = [0.9] * 4 + [0.6] * 4
    _, _, plain = _decide(alphas, target_ms / 1e3, objective=False)
    _, _, obj = _decide(alphas, target_ms / 1e3, objective=True)
    assert (obj.draft_len, obj.draft_lens, obj.fused) == (plain.draft_len, plain.draft_lens,
                                                          plain.fused)  # fmt: skip


def test_target_goal_counts_rows_not_tokens_and_reads_the_inflation():
    """Two rows at 0.9 and two at 0.3 speculating with L = 2 in a 10 ms round, two plain rows
    waiting; target 5 ms. E(0.9, 2) = 2.71 makes 3.7 ms a token, E(0.3, 2) = 1.39 7.2 ms: the
    0.9 rows count, the 0.3 ones do not, the plain ones only while their wait meets it."""
    goal = TargetGoal(5e-3, 1.0, False, 100.0)
    groups = [(2, 0.9), (2, 0.3)]
    tokens = 2 * expected_tokens(0.9, 2) + 2 * expected_tokens(0.3, 2) + 2
    tie = TargetGoal.TIE_WEIGHT * tokens / 10e-3 / 100.0
    assert goal.value(6, groups, 2, tokens, 10e-3, 6e-3) == pytest.approx(2 / 6 + tie)
    assert goal.value(6, groups, 2, tokens, 10e-3, 4e-3) == pytest.approx(4 / 6 + tie)
    # requests see 1.5x the predicted steps: the 0.9 rows (5.5 ms a token) miss it too
    slow = TargetGoal(5e-3, 1.5, False, 100.0)
    assert slow.value(6, groups, 2, tokens, 10e-3, 4e-3) == pytest.approx(tie)
    # plain decoding's floor: its rows count only where its step meets the target
    assert goal.floor(100.0) == pytest.approx(TargetGoal.TIE_WEIGHT)
    assert TargetGoal(5e-3, 1.0, True, 100.0).floor(105.0) == pytest.approx(1.00105)


def test_tpot_objective_is_validated_and_passed_on():
    with pytest.raises(ValueError, match="tpot_objective"):
        SpecConfig(tpot_objective=True)
    with pytest.raises(ValueError, match="tpot_objective"):
        GoodputConfig(tpot_objective=True)
    with pytest.raises(ValueError, match="tpot_objective"):
        SpecConfig(tpot_target_s=4e-3, tpot_objective=1)
    spec = SpecConfig(tpot_target_s=4e-3, tpot_objective=True)
    assert goodput_config_for(SchedulerConfig(), spec, True, True).tpot_objective
    assert not goodput_config_for(SchedulerConfig(), SpecConfig(), True, True).tpot_objective


def test_the_objective_reads_steps_at_what_plain_steps_are_measured_to_take():
    """The first test's batch: one draft a round (13.36 ms predicted) brings the 0.6 rows
    under 9 ms a token (8.35 ms). Plain steps measured 1.1x their prediction (prompt steps
    beside them) make that 9.2 ms: only the 0.9 rows can make it, and between plans that bring
    four, tokens a second decide (two drafts, as without the objective). Without
    ``tpot_target_measured`` the prediction stands."""
    decisions = []
    for seen, measured in ((None, True), (1.1, True), (1.1, False)):
        policy = _policy(Shape(draft=3e-3), tpot_target_s=9e-3, tpot_objective=True,
                         tpot_target_measured=measured)  # fmt: skip
        ids = _add(policy, 8)
        for i, alpha in zip(ids, [0.9] * 4 + [0.6] * 4, strict=True):
            _teach(policy, i, alpha)
        policy.cadence.plain_seen_s = None if seen is None else seen * 10.16e-3
        policy.cadence.round_seen_ratio = 2.0  # exported, not read
        decisions.append(policy.decide(_views(ids)))
    assert [d.draft_len for d in decisions] == [1, 2, 1]
    assert decisions[0].predicted_step_s == pytest.approx(13.36e-3)
    assert decisions[0].plain_step_s == pytest.approx(10.16e-3)


def test_cadence_learns_the_plain_gap_and_the_rounds_ratio():
    """Gaps from a decision to the next: plain ones into ``plain_seen_s``, a round's over its
    prediction into ``round_seen_ratio`` (EWMAs of weight 0.1); an idle gap (over ten
    predictions) into neither."""
    clock = FakeClock()
    cadence = Cadence(clock)
    cadence.decided(False, 4e-3)
    clock.advance(5e-3)
    cadence.decided(True, 10e-3)  # the plain step took 5 ms
    clock.advance(12e-3)
    cadence.decided(True, 10e-3)  # the round took 1.2x its prediction
    clock.advance(15e-3)
    cadence.decided(False, 4e-3)  # ... this one 1.5x
    clock.advance(1.0)
    cadence.decided(False, 4e-3)  # idle: not counted
    assert cadence.plain_seen_s == pytest.approx(5e-3)
    assert cadence.round_seen_ratio == pytest.approx(1.2 + 0.1 * (1.5 - 1.2))
    snap = cadence.snapshot()
    assert snap["cadence_spec_steps"] == 2 and snap["cadence_plain_steps"] == 1
    assert snap["cadence_spec_s"] == pytest.approx(13.5e-3)
    assert snap["round_seen_ratio"] == cadence.round_seen_ratio


def test_tpot_need_is_what_keeps_the_requests_tpot_within_the_target():
    """10 tokens out, the first 45 ms ago, 10 to go, a 5 ms target: 19 gaps may take 95 ms,
    so the last 10 tokens may take 5 ms each; 60 ms ago, 3.5 ms each; 100 ms ago it is too
    late (below zero). Before the first token, or with none left: the target."""
    assert tpot_need_s(5e-3, 10, 10, 45e-3) == pytest.approx(5e-3)
    assert tpot_need_s(5e-3, 10, 10, 60e-3) == pytest.approx(3.5e-3)
    assert tpot_need_s(5e-3, 10, 10, 100e-3) < 0.0
    assert tpot_need_s(5e-3, 10, 10, 20e-3) == pytest.approx(7.5e-3)
    assert tpot_need_s(5e-3, 0, 10, 0.0) == tpot_need_s(5e-3, 10, 0, 1.0) == 5e-3


def test_target_goal_with_needs_counts_each_row_against_its_own():
    """The four-group batch of the test above with every row's need at the target gives the
    same values; a row too late already counts under no plan, one far ahead under every plan,
    and plain decoding's floor counts the rows whose need its step meets."""
    groups = [(2, 0.9), (2, 0.3)]
    tokens = 2 * expected_tokens(0.9, 2) + 2 * expected_tokens(0.3, 2) + 2
    tie = TargetGoal.TIE_WEIGHT * tokens / 10e-3 / 100.0
    plain = TargetGoal(5e-3, 1.0, 0.0, 100.0)

    def goal(spec, riders):
        return TargetGoal(5e-3, 1.0, 0.0, 100.0, tuple(sorted(spec + riders))), [
            sorted(spec[:2]),
            sorted(spec[2:]),
        ]

    same, per_group = goal([5e-3] * 4, [5e-3] * 2)
    for wait in (6e-3, 4e-3):
        assert same.value(6, groups, 2, tokens, 10e-3, wait, per_group) == pytest.approx(
            plain.value(6, groups, 2, tokens, 10e-3, wait)
        )
    # one 0.9 row too late, one 0.3 row far ahead (7.2 ms a token meets its 8 ms), one plain
    # row too late, the other ahead of a 6 ms wait
    mixed, per_group = goal([-1e-3, 5e-3, 5e-3, 8e-3], [-1e-3, 7e-3])
    assert mixed.value(6, groups, 2, tokens, 10e-3, 6e-3, per_group) == pytest.approx(3 / 6 + tie)
    # plain decoding's share: the rows whose need a 5.5 ms step meets
    policy = _policy(Shape(), tpot_target_s=5e-3, tpot_objective=True, tpot_deadlines=True)
    search = PlanSearch(policy.goodput, policy.costs, 4)
    needs = {0: -1e-3, 1: 5e-3, 2: 6e-3, 3: 8e-3}
    assert search._goal(4, 5e-3, 5.5e-3, needs).plain_meets == pytest.approx(0.5)


@pytest.mark.parametrize(("need", "draft_len"), [(None, 1), (-1e-3, 2), (1.0, 2)])
def test_with_deadlines_rows_no_plan_can_move_do_not_hold_the_plan_back(need, draft_len):
    """The first test's batch (a 9 ms target: one draft a round brings the 0.6 rows under it,
    two drafts bring only the 0.9 ones). Held to the target (no need known) the 0.6 rows keep
    the round at one draft. Already too late, or so far ahead that any round meets their
    need, they count alike under every plan, and tokens a second decide: two drafts."""
    policy = _policy(Shape(draft=3e-3), tpot_target_s=9e-3, tpot_objective=True,
                     tpot_deadlines=True)  # fmt: skip
    ids = _add(policy, 8)
    alphas = [0.9] * 4 + [0.6] * 4
    for i, alpha in zip(ids, alphas, strict=True):
        _teach(policy, i, alpha)
    needs = [None if a == 0.9 else need for a in alphas]
    views = [SeqView(i, 1, tpot_need_s=n) for i, n in zip(ids, needs, strict=True)]
    d = policy.decide(views)
    assert d.draft_len == draft_len and all(d.draft_lens.values())


@pytest.mark.parametrize("name", ["tpot_deadlines", "tpot_unguarded"])
def test_the_objectives_variants_need_it_and_are_passed_on(name):
    with pytest.raises(ValueError, match=name):
        SpecConfig(tpot_target_s=4e-3, **{name: True})
    with pytest.raises(ValueError, match=name):
        GoodputConfig(tpot_target_s=4e-3, **{name: True})
    spec = SpecConfig(tpot_target_s=4e-3, tpot_objective=True, **{name: True})
    assert getattr(goodput_config_for(SchedulerConfig(), spec, True, True), name) is True
    obj = SpecConfig(tpot_target_s=4e-3, tpot_objective=True)
    assert getattr(goodput_config_for(SchedulerConfig(), obj, True, True), name) is False


def test_the_engine_reads_a_requests_need_from_its_tokens_and_first_token_time():
    """``spec_policy.tpot_need``: none before the first token; after it, from max_tokens,
    the tokens out and the time since the first."""
    seq = Sequence("r", [1, 2, 3], SamplingParams(max_tokens=20))
    assert tpot_need(5e-3, seq, 10.0) is None
    seq.first_token_time = 9.955
    seq.token_ids.extend([7] * 10)
    assert tpot_need(5e-3, seq, 10.0) == pytest.approx(tpot_need_s(5e-3, 10, 10, 45e-3))


def test_a_tokens_weight_stops_one_marginal_row_from_holding_the_batch_to_short_rounds():
    """Four requests at 0.9 and one at 0.3, a 9 ms target, a cheap drafter. Rows first, two
    drafts a round keep the 0.3 row under the target, all five within; with tokens a second
    weighed 1:1 against the share of rows, four drafts leave it above for ~20 % more tokens a
    second (one row in five is worth a 20 % gain)."""
    alphas = [0.9] * 4 + [0.3]
    decisions = []
    for weight in (None, 1.0):
        policy, ids, d = _decide(alphas, 9e-3, True, draft=1e-3, tpot_tokens_weight=weight)
        decisions.append((d.draft_len, _within(policy, ids, d, 9e-3), d))
    (rows_first, within_first, a), (weighed, within_weighed, b) = decisions
    assert (rows_first, within_first) == (2, 5) and (weighed, within_weighed) == (4, 4)
    rate = lambda d: d.predicted_tokens / d.predicted_step_s  # noqa: E731
    assert rate(b) > 1.15 * rate(a)
    with pytest.raises(ValueError, match="tpot_tokens_weight"):
        SpecConfig(tpot_target_s=4e-3, tpot_objective=True, tpot_tokens_weight=0.0)
    with pytest.raises(ValueError, match="tpot_tokens_weight"):
        GoodputConfig(tpot_target_s=4e-3, tpot_objective=True, tpot_tokens_weight=-1.0)
    spec = SpecConfig(tpot_target_s=4e-3, tpot_objective=True, tpot_tokens_weight=1.0)
    assert goodput_config_for(SchedulerConfig(), spec, True, True).tpot_tokens_weight == 1.0


def test_unguarded_the_target_alone_bounds_the_rounds_where_the_plain_step_meets_it():
    """Four requests at 0.9 and one at 0.05, a 15 ms target the plain step (10.1 ms) meets:
    the latency guard holds the round to three drafts (four would make the 0.05 request's
    time per token more than a plain step's). With ``tpot_unguarded`` the objective alone
    decides: four drafts, more tokens a second, and every row still within 15 ms."""
    alphas = [0.9] * 4 + [0.05]
    decisions = []
    for unguarded in (False, True):
        policy, ids, d = _decide(alphas, 15e-3, True, draft=1e-3, tpot_unguarded=unguarded)
        assert d.plain_step_s < 15e-3 and all(d.draft_lens.values())
        decisions.append((d, _within(policy, ids, d, 15e-3)))
    (guarded, within_guarded), (free, within_free) = decisions
    assert (guarded.draft_len, free.draft_len) == (3, 4) and within_guarded == within_free == 5
    rate = lambda d: d.predicted_tokens / d.predicted_step_s  # noqa: E731
    assert rate(free) > rate(guarded)
