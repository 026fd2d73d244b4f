"""The goodput policy with a TPOT target (``GoodputConfig.tpot_target_s``): while a plain step
misses the target, neither the rider bound nor the latency guard holds a plan back."""

import pytest
from goodput_helpers import FakeClock, Shape, _add, _policy, _teach, _views

from verifypd.config import SchedulerConfig, SpecConfig
from verifypd.controller import GoodputConfig, expected_tokens
from verifypd.lanes.spec_policy import goodput_config_for


@pytest.mark.parametrize(("target_ms", "speculates"), [(None, False), (10.5, False), (10.0, True)])
def test_a_tpot_target_lifts_the_rider_bound_only_while_plain_steps_miss_it(target_ms, speculates):
    """Two requests that accept 0.9 beside two that may not speculate, whose tokens would wait
    a whole round: under the rider bound the step stays plain. With a TPOT target below the
    plain step (10.08 ms here) the riders miss it anyway, so the two speculate; with one above
    it, the bound holds as before."""
    target = None if target_ms is None else target_ms / 1e3
    policy = _policy(tpot_target_s=target)
    fast = _add(policy, 2)
    riders = _add(policy, 2, start=2, speculate=False)
    for i in fast:
        _teach(policy, i, 0.9)
    d = policy.decide(_views(fast + riders))
    assert d.plain_step_s == pytest.approx(10.08e-3)
    assert (d.draft_len > 0) is speculates
    if speculates:
        assert {i for i, n in d.draft_lens.items() if n} == set(fast)
    else:
        assert d.reason == "no_gain"


@pytest.mark.parametrize(("target_ms", "draft_len"), [(None, 1), (10.5, 1), (10.0, 2)])
def test_a_tpot_target_lifts_the_latency_guard_only_while_plain_steps_miss_it(target_ms, draft_len):
    """Two requests at 0.9 and two at 0.3 with a dear drafter: two drafts a round would make
    the 0.3 ones' time per token 1.16 plain steps, past the guard, so the round drafts one.
    With a TPOT target below the plain step they miss it plainly too: the round drafts two,
    the most tokens per second. A target above the plain step changes nothing."""
    target = None if target_ms is None else target_ms / 1e3
    policy = _policy(Shape(draft=3e-3), tpot_target_s=target)
    ids = _add(policy, 4)
    for i, alpha in zip(ids, (0.9, 0.9, 0.3, 0.3), strict=True):
        _teach(policy, i, alpha)
    d = policy.decide(_views(ids))
    assert d.draft_len == draft_len and all(n == draft_len for n in d.draft_lens.values())
    slow = d.predicted_step_s / expected_tokens(policy.acceptance(ids[2]), draft_len)
    assert (slow > 1.1 * d.plain_step_s) is (draft_len == 2)


@pytest.mark.parametrize("measured", [True, False])
def test_the_target_reads_the_plain_step_requests_are_measured_to_see(measured):
    """A target of 10.5 ms above the predicted plain step (10.08 ms) but below the one
    requests see (11 ms between plain decisions: prompt steps beside them): with
    ``tpot_target_measured`` the seen step misses the target, so the two fast requests
    speculate once it is learnt; reading the prediction only, the riders' bound holds."""
    clock = FakeClock()
    policy = _policy(clock=clock, tpot_target_s=10.5e-3, tpot_target_measured=measured)
    fast = _add(policy, 2)
    riders = _add(policy, 2, start=2, speculate=False)
    for i in fast:
        _teach(policy, i, 0.9)
    decisions = []
    for _ in range(24):
        d = policy.decide(_views(fast + riders))
        decisions.append(d)
        if d.draft_len:
            break
        clock.advance(11e-3)
    assert decisions[0].reason == "no_gain"
    assert decisions[0].plain_step_s == pytest.approx(10.08e-3)
    assert policy.cadence.plain_seen_s == pytest.approx(11e-3)
    assert (decisions[-1].draft_len > 0) is measured
    if measured:
        assert {i for i, n in decisions[-1].draft_lens.items() if n} == set(fast)
    assert policy.snapshot()["plain_seen_s"] == policy.cadence.plain_seen_s


def test_a_request_prior_count_lets_a_new_requests_first_verifies_move_its_estimate():
    """With ``request_prior_count`` 1 a new request's α̂ (the population's prior) moves half
    way to its first verify's evidence; without, by ``request_weight`` (0.15)."""
    estimates = []
    for count in (None, 1.0):
        policy = _policy(request_prior_count=count)
        (i,) = _add(policy, 1)
        start = policy.acceptance(i)
        policy.observe_acceptance(i, 4, 0)  # one position tested, none accepted
        estimates.append((start, policy.acceptance(i)))
    (start, slow), (start_fast, fast) = estimates
    assert start == start_fast > 0.5
    assert slow == pytest.approx(start * (1.0 - 0.15))
    assert fast == pytest.approx(start * 0.5)


@pytest.mark.parametrize("explore", [None, 0.8])
def test_explore_alpha_plans_a_new_requests_first_verify_optimistically(explore):
    """Four new requests at a population α of 0.3 with a dear drafter, beside a TPOT target
    the plain step misses: planned at 0.3 no plan pays; with ``explore_alpha`` 0.8 the
    policy drafts for them, and once their own verifies say 0.1, it stops."""
    policy = _policy(Shape(draft=3e-3), tpot_target_s=5e-3, explore_alpha=explore,
                     population_prior_count=1.0)  # fmt: skip
    seed = _add(policy, 1, start=99)
    _teach(policy, seed[0], 0.3, verifies=200)  # the population learns 0.3 from it
    policy.remove_request(seed[0])
    ids = _add(policy, 4)
    assert policy.acceptance(ids[0]) == pytest.approx(0.3, abs=0.05)
    first = policy.decide(_views(ids))
    assert (first.draft_len > 0) is (explore is not None)
    if explore is None:
        return
    for i in ids:
        _teach(policy, i, 0.1)
    later = policy.decide(_views(ids))
    assert later.draft_len == 0 and later.reason == "no_gain"


def test_tpot_target_is_validated():
    with pytest.raises(ValueError, match="tpot_target_s"):
        GoodputConfig(tpot_target_s=0.0)
    with pytest.raises(ValueError, match="tpot_target_s"):
        SpecConfig(tpot_target_s=-1e-3)
    g = goodput_config_for(SchedulerConfig(), SpecConfig(tpot_target_s=4e-3), True, True)
    assert g.tpot_target_s == 4e-3 and g.tpot_target_measured
    bad_values = (("request_prior_count", 0.0), ("explore_alpha", 1.0), ("tpot_target_measured", 1))
    for field, bad in bad_values:
        with pytest.raises(ValueError, match=field):
            SpecConfig(**{field: bad})
        with pytest.raises(ValueError, match=field):
            GoodputConfig(**{field: bad})
    learn = SpecConfig(request_prior_count=2.0, explore_alpha=0.8)
    g = goodput_config_for(SchedulerConfig(), learn, True, True)
    assert (g.request_prior_count, g.explore_alpha) == (2.0, 0.8)
    off = SpecConfig(tpot_target_s=4e-3, tpot_target_measured=False)
    assert not goodput_config_for(SchedulerConfig(), off, True, True).tpot_target_measured
