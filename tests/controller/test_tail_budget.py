"""The ITL tail's budget on simulated time: the expected late tokens of a round, the credit,
and the goodput policy keeping speculation's late tokens to the budget's share of all tokens
while it still speculates where rounds are short or the credit allows."""

import random

import pytest
from goodput_helpers import Shape, _add, _policy, _teach, _views
from hypothesis import given, settings
from hypothesis import strategies as st

from verifypd.config import SpecConfig
from verifypd.controller import GoodputConfig, expected_tokens
from verifypd.controller.tail_budget import TailBudget, late_tokens


def test_late_tokens_counts_the_rounds_that_give_too_few_tokens_for_their_length():
    # a round of 1.5 bounds: only a round with one token (the first draft rejected) is late
    assert late_tokens(0.8, 4, 1.5) == pytest.approx(0.2)
    # 2.5 bounds: one or two tokens (each gets half the round: 1.25 bounds) are late
    assert late_tokens(0.8, 4, 2.5) == pytest.approx(0.2 + 2 * 0.8 * 0.2)
    assert late_tokens(0.8, 4, 1.0) == 0.0  # a round within the bound: none
    assert late_tokens(1.0, 4, 1.5) == 0.0  # nothing rejected: five tokens in the round


@settings(max_examples=60, deadline=None)
@given(alpha=st.floats(0.0, 0.99), L=st.integers(1, 8), ratio=st.floats(1.0, 12.0))
def test_late_tokens_against_a_simulation_and_its_bounds(alpha, L, ratio):
    rng, rounds, late = random.Random(0), 4000, 0
    for _ in range(rounds):
        n = 1
        while n <= L and rng.random() < alpha:
            n += 1
        late += n if n < ratio else 0
    value = late_tokens(alpha, L, ratio)
    assert 0.0 <= value <= expected_tokens(alpha, L) + 1e-9
    if ratio > L + 1:  # every token of every round is late
        assert value == pytest.approx(expected_tokens(alpha, L))
    assert abs(late / rounds - value) < 0.15 * (L + 1) ** 0.5 + 1e-9


def test_the_credit_grows_by_the_share_per_token_up_to_its_window():
    budget = TailBudget(0.01, window_tokens=1000)
    assert budget.available() == pytest.approx(10.0)  # starts full
    budget.spend(tokens=4.0, late=6.0)
    assert budget.available() == pytest.approx(4.04)
    budget.spend(tokens=10_000.0, late=0.0)
    assert budget.available() == pytest.approx(10.0)  # capped
    assert TailBudget(None, 1000).available() == float("inf")
    for bad in ({"share": 1.0, "window_tokens": 10}, {"share": 0.01, "window_tokens": 0}):
        with pytest.raises(ValueError, match="tail budget"):
            TailBudget(**bad)


def _late_share(policy, ids, alpha, steps, seed=0):
    """(late tokens / tokens, speculating steps) over ``steps`` decisions, drafts accepted with
    probability ``alpha``, late tokens counted from the actual rounds (a round longer than the
    bound whose tokens come too few for its length, and its plain riders)."""
    rng, late, tokens, spec = random.Random(seed), 0.0, 0.0, 0
    bound = policy.goodput.tail_ratio
    for _ in range(steps):
        d = policy.decide(_views(ids))
        ratio = d.predicted_step_s / d.plain_step_s / bound if d.draft_len else 0.0
        spec += bool(d.draft_len)
        for i, n in d.draft_lens.items():
            k = 0
            while k < n and rng.random() < alpha:
                k += 1
            if n:
                policy.observe_acceptance(i, n, k)
            tokens += k + 1
            late += k + 1 if k + 1 < ratio else 0
    return late / tokens, spec


def test_the_policy_keeps_speculations_late_tokens_to_the_budget():
    """Four requests accepting 0.8 on a GPU in miniature where every round is longer than 1.05
    plain steps: without a budget every step speculates and about 6 % of the tokens are late;
    with a 0.5 % budget one step in 40 speculates and the late share is the budget's."""
    shares = {}
    for budget in (None, 0.005):
        policy = _policy(Shape(), tail_budget=budget, tail_window_tokens=400)
        ids = _add(policy, 4)
        for i in ids:
            _teach(policy, i, 0.8)
        shares[budget] = _late_share(policy, ids, 0.8, 3000)
    (free, free_spec), (kept, kept_spec) = shares[None], shares[0.005]
    assert free_spec == 3000 and free > 0.03
    # the credit is spent, not hoarded (the window's starting credit is 2 of ~12k tokens)
    assert 30 < kept_spec < 300 and 0.6 * 0.005 < kept < 1.3 * 0.005
    # every step that did not speculate says why: the budget (never a held "no gain")
    assert policy.decisions["tail_budget"] == 3000 - kept_spec
    assert policy.decisions["no_gain"] == 0


def test_a_zero_budget_still_takes_rounds_within_the_bound():
    """Cheap drafts: without a budget the best plan drafts 4 a round (longer than 1.05 plain
    steps); a zero budget takes the best round within the bound (a shorter L), late-free; a
    bound of 1.5 holds the L = 4 round too."""
    lens = {}
    for budget, ratio in ((None, 1.05), (0.0, 1.05), (0.0, 1.5)):
        policy = _policy(Shape(draft=0.2e-3), tail_budget=budget, tail_ratio=ratio)
        ids = _add(policy, 4)
        for i in ids:
            _teach(policy, i, 0.9)
        d = policy.decide(_views(ids))
        assert d.reason == "speculate" and d.late_tokens == 0.0
        if budget is not None:
            assert d.predicted_step_s <= ratio * d.plain_step_s
        lens[budget, ratio] = d.draft_len, d.predicted_step_s / d.plain_step_s
    assert lens[None, 1.05][0] == 4 and lens[None, 1.05][1] > 1.05
    assert 1 <= lens[0.0, 1.05][0] < 4
    assert lens[0.0, 1.5][0] == 4


def test_a_plain_rider_in_a_long_round_is_a_late_token():
    """One request may not speculate: it rides in every round (the rider bound loosened), and
    each long round makes its token late. A credit below one token refuses such a round even
    where the speculator alone would be cheap in late tokens."""
    for window, expect in ((50, "tail_budget"), (300, "speculate")):  # credit 0.5 / 3 late
        policy = _policy(Shape(), tail_budget=0.01, tail_window_tokens=window, rider_slack=1.0)
        (fast,) = _add(policy, 1)
        (plain,) = _add(policy, 1, start=1, speculate=False)
        _teach(policy, fast, 0.95)
        d = policy.decide(_views([fast, plain]))
        assert d.reason == expect
        if expect == "speculate":
            assert d.late_tokens >= 1.0 and d.draft_lens[plain] == 0


def test_the_budget_reaches_the_policy_and_is_checked():
    from verifypd.config import EngineConfig
    from verifypd.engine.core import EngineCore
    from verifypd.lanes.spec_policy import SpeculationPolicy

    spec = SpecConfig(method="ngram", tail_budget=0.005, tail_ratio=1.2)
    core = EngineCore(EngineConfig(model="dummy:tiny", device="cpu", spec=spec))
    policy = SpeculationPolicy(core).controller
    assert policy.goodput.tail_budget == 0.005 and policy.goodput.tail_ratio == 1.2
    assert policy.snapshot()["tail_credit"] == pytest.approx(0.005 * 2048)
    assert SpecConfig().tail_budget is None
    for bad in ({"tail_budget": 1.0}, {"tail_budget": -0.1}, {"tail_ratio": 0.9}):
        with pytest.raises(ValueError, match="tail_"):
            SpecConfig(**bad)
        with pytest.raises(ValueError, match="tail"):
            GoodputConfig(**bad)


def test_a_refusal_is_held_only_until_the_credit_covers_the_cheapest_refused_plan():
    """Steps stopped by the credit alone keep the verdict without a search (the search is
    host time before every decode step) until the credit has grown to the cheapest refused
    plan: the same decisions as searching every step, with a fraction of the searches."""
    runs = {}
    for hold in (1, 8):
        policy = _policy(Shape(), tail_budget=0.005, tail_window_tokens=400,
                         no_gain_hold_steps=hold)  # fmt: skip
        ids = _add(policy, 4)
        for i in ids:
            _teach(policy, i, 0.8)
        runs[hold] = [policy.decide(_views(ids)).draft_len for _ in range(1500)], policy
    (every, searched), (held, holding) = runs[1], runs[8]
    assert held == every and sum(map(bool, held)) >= 15
    assert holding.num_searches < searched.num_searches / 4
