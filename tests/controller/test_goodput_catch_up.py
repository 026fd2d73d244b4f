"""Drafters behind their requests on simulated time: catch-up rounds (rate limited, paid back
over the following steps or over the rounds a request has left, within a token budget, waiting
for prompt work when they yield to it), and which drafters catch-up graphs, chunk replays or only
an eager forward reach."""

import pytest
from goodput_helpers import Shape, _add, _policy, _teach, _views

from verifypd.config import SpecConfig
from verifypd.controller import GoodputConfig, LoadSignals, SeqView, expected_tokens
from verifypd.controller.plan_search import Candidate, catch_up_rounds


def test_far_behind_drafters_catch_up_only_in_rate_limited_rounds():
    """A drafter that must feed a long context (a request fresh from its prefill) is drafted
    for only in a catch-up round, at most one every ``catch_up_every_steps`` steps, whose
    one-off cost is left out of the guard (so rare a spike stays out of the p99)."""
    policy = _policy(max_catch_up=64, catch_up_every_steps=10)
    ids = _add(policy, 3)
    for i in ids:
        _teach(policy, i, 0.9)
    assert policy.decide([SeqView(0, 1)]).draft_lens[0] > 0  # steady: any step
    d = policy.decide([SeqView(1, 500)])
    assert d.reason == "catch_up" and d.draft_lens[1] > 0
    reasons = [policy.decide([SeqView(2, 500)]).reason for _ in range(10)]
    assert reasons == ["no_candidates"] * 9 + ["catch_up"]
    # Between rounds, a far-behind request is a plain row: a step with drafts would make its
    # token slower than plain decoding, so the guard keeps the whole batch plain.
    assert policy.decide([SeqView(0, 1), SeqView(2, 500)]).reason == "no_gain"


def test_catch_up_pays_back_over_the_following_steps():
    """A long prompt's catch-up is an investment: with a one-off of several plain steps it is
    still taken when the following steps repay it, so drafters that fell behind during plain
    steps do not stay parked for good."""
    shape = Shape(fixed=4e-3, per_token=5e-6, draft=0.5e-3, prefill_token=20e-6)
    policy = _policy(shape, max_catch_up=64, catch_up_every_steps=1)
    ids = _add(policy, 10)
    for i in ids:
        _teach(policy, i, 0.8)
    d = policy.decide(_views(ids, behind=1000))
    assert d.reason == "catch_up" and all(n > 0 for n in d.draft_lens.values())
    assert policy.costs.catch_up(10 * 1000) > 3 * d.plain_step_s  # a real one-off


@pytest.mark.parametrize("within", [False, True])
def test_a_catch_up_is_spread_over_at_most_the_rounds_its_requests_have_left(within):
    """The same long-prompt catch-up: taken for requests with many tokens to go; with
    ``amortize_within_request``, not for requests a few tokens from their end (the feed
    spread over the ~2 rounds they have left costs more than speculation gains)."""
    shape = Shape(fixed=4e-3, per_token=5e-6, draft=0.5e-3, prefill_token=20e-6)
    reasons = {}
    for left in (1 << 30, 8):
        policy = _policy(shape, max_catch_up=64, catch_up_every_steps=1,
                         amortize_within_request=within)  # fmt: skip
        ids = _add(policy, 10)
        for i in ids:
            _teach(policy, i, 0.8)
        d = policy.decide([SeqView(i, 1000, left) for i in ids])
        reasons[left] = d.reason, all(n > 0 for n in d.draft_lens.values())
    assert reasons[1 << 30] == ("catch_up", True)
    assert reasons[8] == (("no_gain", False) if within else ("catch_up", True))


def test_catch_up_rounds_are_the_rounds_a_request_has_left():
    def cand(alpha, left):
        return Candidate(0, alpha, 1000, left, far=True)

    assert catch_up_rounds(cand(0.8, 8), 32, None) == 32.0  # not within the request
    assert catch_up_rounds(cand(0.8, 8), 32, 4) == pytest.approx(8 / expected_tokens(0.8, 4))
    assert catch_up_rounds(cand(0.8, 1 << 30), 32, 4) == 32.0  # never beyond amortize_steps
    assert catch_up_rounds(cand(0.5, 1), 32, 4) == 1.0  # at least the round it pays for
    assert catch_up_rounds(cand(0.0, 10), 32, 4) == 10.0  # α̂ = 0: one token a round


def test_drafters_within_the_catch_up_graphs_are_not_planned_eager():
    """A drafter a few tokens behind (its request decoded plainly for a few steps) starts with
    a graph replay when catch-up graphs reach it: its plan pays no eager one-off, so the policy
    resumes speculation where an eager first step would not pay."""
    shape = Shape(fixed=4e-3, per_token=5e-6, draft=0.3e-3)
    plans = {}
    for reach in ({"graph_catch_up": 2}, {"graph_catch_up": 8}, {"chunk_catch_up": 520}):
        policy = _policy(shape, eager_draft_s=40e-3, amortize_steps=1, **reach)
        ids = _add(policy, 8)
        for i in ids:
            _teach(policy, i, 0.8)
        plans[tuple(reach.values())[0]] = policy.decide(_views(ids, behind=5))
    for reached in (8, 520):
        d = plans[reached]
        assert d.reason == "speculate" and all(n > 0 for n in d.draft_lens.values())
    assert plans[2].reason == "no_gain"  # the same batch, planned with an eager first step


def test_drafters_only_an_eager_catch_up_reaches_are_not_drafted_for():
    shape = Shape(fixed=4e-3, per_token=5e-6, draft=0.5e-3, prefill_token=20e-6)
    policy = _policy(
        shape, max_catch_up=64, catch_up_every_steps=1, chunk_catch_up=520, rider_slack=5.0
    )  # the long prompt's request rides along: no rider limit
    ids = _add(policy, 10)
    for i in ids:
        _teach(policy, i, 0.8)
    views = _views(ids[:8]) + [SeqView(8, 300), SeqView(9, 3000)]  # a short and a long prompt
    d = policy.decide(views)
    assert d.reason == "catch_up" and d.draft_lens[8] > 0  # chunk replays reach 300
    assert d.draft_lens[9] == 0  # 3000 only an eager forward reaches


@pytest.mark.parametrize("budget", [None, 1000, 100])
def test_a_catch_up_round_feeds_at_most_its_token_budget(budget):
    """Far drafters past ``catch_up_round_tokens`` (α̂ order, the first always in) wait for the
    next round as waiting riders; without a budget every far request catches up at once."""
    policy = _policy(max_catch_up=64, catch_up_every_steps=8, catch_up_round_tokens=budget,
                     rider_slack=5.0, waiting_riders_exempt=True)  # fmt: skip
    ids = _add(policy, 4)
    for i, alpha in zip(ids, (0.9, 0.85, 0.8, 0.75), strict=True):
        _teach(policy, i, alpha)
    views = [SeqView(0, 1)] + [SeqView(i, 600) for i in ids[1:]]  # three fresh prompts
    d = policy.decide(views)
    assert d.reason == "catch_up"
    fed = [i for i in ids[1:] if d.draft_lens[i]]
    want = {None: [1, 2, 3], 1000: [1], 100: [1]}[budget]  # 600 + 600 > 1000: one a round
    assert fed == want
    assert policy._waiting == 3 - len(want)
    # the next round (8 steps on) takes the next by α̂
    for _ in range(7):
        policy.decide([SeqView(0, 1)])
    rest = [SeqView(0, 1)] + [SeqView(i, 600) for i in ids[1:] if i not in fed]
    if rest[1:]:
        d = policy.decide(rest)
        assert d.reason == "catch_up" and d.draft_lens[rest[1].seq_id] > 0


def test_the_catch_up_round_budget_is_validated():
    with pytest.raises(ValueError, match="catch_up_round_tokens"):
        GoodputConfig(catch_up_round_tokens=0)
    with pytest.raises(ValueError, match="catch_up_round_tokens"):
        SpecConfig(catch_up_round_tokens=0)


@pytest.mark.parametrize("yields", [False, True])
def test_a_catch_up_round_waits_for_prompt_work_to_end_when_it_yields(yields):
    policy = _policy(max_catch_up=64, catch_up_every_steps=1, catch_up_yields_to_prefill=yields,
                     rider_slack=5.0, waiting_riders_exempt=True)  # fmt: skip
    ids = _add(policy, 2)
    for i in ids:
        _teach(policy, i, 0.9)
    views = [SeqView(0, 1), SeqView(1, 600)]  # a fresh prompt's drafter is far behind
    busy = policy.decide(views, LoadSignals(prefill_running=True))
    assert (busy.reason == "catch_up") is not yields
    assert busy.draft_lens[1] == (0 if yields else busy.draft_len)
    if yields:  # the steady request still speculates; the far one rides
        assert busy.reason == "speculate" and busy.draft_lens[0] > 0
    idle = policy.decide(views, LoadSignals(prefill_running=False))
    assert idle.reason == "catch_up" and idle.draft_lens[1] > 0


@pytest.mark.parametrize("bad", [0, -1, 2.5, None])
def test_catch_up_every_steps_is_validated(bad):
    with pytest.raises(ValueError, match="catch_up_every_steps"):
        SpecConfig(catch_up_every_steps=bad)
