"""Acceptance learning and zero cost when speculation does not pay, on simulated time: the
population's acceptance as new requests' prior, the drafter following prompts and plain steps
only where speculation may pay, parking with backed-off probes, and a population stuck below
what pays probed back by stale probes (catch-up rounds where the drafters are far behind)."""

import random

import pytest
from goodput_helpers import Shape, _add, _policy, _teach, _views

from verifypd.controller import SeqView


def test_useless_drafter_costs_only_backed_off_probes():
    """Acceptance 0: the population's acceptance falls, the policy parks, and probes back off
    exponentially: drafted steps grow with the log of the steps, not linearly."""
    policy = _policy(probe_min_steps=16, probe_max_steps=1024)
    ids = _add(policy, 8)
    drafted_steps, next_id = 0, 8
    for step in range(4000):
        d = policy.decide(_views(ids))
        drafted = [i for i, n in d.draft_lens.items() if n]
        drafted_steps += bool(drafted)
        for i in drafted:
            policy.observe_acceptance(i, d.draft_lens[i], 0)
        if step % 100 == 99:  # requests come and go
            policy.remove_request(ids.pop(0))
            ids += _add(policy, 1, next_id)
            next_id += 1
    assert policy.population.value < 0.1
    assert 0 < drafted_steps <= 24
    assert not policy.expects_speculation(ids[-1])  # the drafter no longer follows prefill
    assert policy.decisions["no_candidates"] + policy.decisions["no_gain"] > 3900
    assert policy.snapshot()["probe_interval"] == 1024


def test_a_probe_that_finds_acceptance_resets_the_backoff():
    policy = _policy(probe_min_steps=8, probe_max_steps=512)
    ids = _add(policy, 2)
    for i in ids:
        _teach(policy, i, 0.0, verifies=200)
    for _ in range(300):
        for i, n in policy.decide(_views(ids)).draft_lens.items():
            if n:
                policy.observe_acceptance(i, n, 0)
    assert policy._probe_interval > 8
    d = policy.decide(_views(ids))
    while not any(d.draft_lens.values()):
        d = policy.decide(_views(ids))
    assert d.reason == "probe"
    for i, n in d.draft_lens.items():
        if n:
            policy.observe_acceptance(i, n, n)  # the drafter predicts this traffic now
    assert policy._probe_interval == 8


def test_the_drafter_follows_prefill_only_where_speculation_is_expected():
    policy = _policy()
    _add(policy, 1)
    _add(policy, 1, start=1, speculate=False)
    assert policy.expects_speculation(0) and not policy.expects_speculation(1)
    assert not policy.expects_speculation(42)  # unknown


def test_new_requests_start_at_the_population_acceptance():
    policy = _policy()
    ids = _add(policy, 4)
    for i in ids:
        _teach(policy, i, 0.3, verifies=200)
    population = policy.population.value
    assert 0.2 < population < 0.45
    _add(policy, 1, start=99)
    assert policy.acceptance(99) == pytest.approx(population)


def test_the_drafter_follows_plain_steps_only_of_requests_that_may_pay():
    """``expects_drafting``: a request that may speculate, the population not parked, its own
    α̂ at least ``follow_min_alpha``."""
    policy = _policy(follow_min_alpha=0.3)
    _add(policy, 3)
    _add(policy, 1, start=3, speculate=False)
    _teach(policy, 0, 0.8)
    _teach(policy, 1, 0.05)
    assert [policy.expects_drafting(i) for i in (0, 1, 2, 3, 99)] == [
        True, False, True, False, False  # 2: the population's α̂ so far; 99: unknown
    ]  # fmt: skip
    for _ in range(200):  # the population stops accepting: parked
        policy.observe_acceptance(1, 4, 0)
    assert not policy.expects_drafting(0)


# -- a population stuck below what pays --------------------------------------------------------

DEAR_DRAFTS = Shape(draft=3e-3)  # α ≈ 0.3 does not pay here, α ≈ 0.9 does


def _stuck_policy(stale: bool, probe_min_steps: int = 16, **goodput):
    """A population taught α ≈ 0.3 by four earlier requests (above the parking floor, below
    what pays), then four new requests."""
    policy = _policy(DEAR_DRAFTS, probe_min_steps=probe_min_steps, probe_when_stale=stale,
                     **goodput)  # fmt: skip
    old = _add(policy, 4)
    for i in old:
        _teach(policy, i, 0.3, verifies=200)
        policy.remove_request(i)
    assert policy.goodput.accept_floor < policy.population.value < 0.35
    return policy, _add(policy, 4, start=10)


def _run_verifying(policy, ids, alpha, steps, seed=0):
    rng, reasons = random.Random(seed), []
    for _ in range(steps):
        d = policy.decide(_views(ids))
        reasons.append(d.reason)
        for i, n in d.draft_lens.items():
            if n:
                k = 0
                while k < n and rng.random() < alpha:
                    k += 1
                policy.observe_acceptance(i, n, k)
    return reasons


def test_a_population_stuck_below_what_pays_is_probed_back():
    """New requests start at the population's α; below what pays, nothing drafts and nothing
    moves it (without the stale probe: for good). The stale probe drafts for the requests
    without evidence once a probe interval has passed; they accept, and speculation resumes."""
    policy, ids = _stuck_policy(stale=False)
    assert set(_run_verifying(policy, ids, 0.9, 400)) == {"no_gain"}

    policy, ids = _stuck_policy(stale=True)
    reasons = _run_verifying(policy, ids, 0.9, 400)
    assert reasons.index("probe") == 16 - 1 and reasons.count("probe") == 1
    assert reasons[16:].count("speculate") >= 380
    assert policy.population.value > 0.8


def test_a_stale_probe_drafts_only_requests_without_evidence_and_backs_off():
    """A request with its own low α̂ is not probed again (it rides: the rider bound is loosened
    here, else its one token bounds the probe's step); probes that find nothing back off
    exponentially, so traffic the drafter cannot predict costs a few probes."""
    policy, ids = _stuck_policy(stale=True, probe_min_steps=8, rider_slack=1.0)
    _teach(policy, ids[0], 0.2, verifies=50)  # its own evidence: it does not pay
    probed = set()
    for _ in range(2000):
        d = policy.decide(_views(ids))
        for i, n in d.draft_lens.items():
            if n:
                assert d.reason == "probe"
                probed.add(i)
                policy.observe_acceptance(i, n, 0)  # nothing accepted
    assert ids[0] not in probed and probed == set(ids[1:])
    assert policy.decisions["probe"] == 1  # the others have evidence now: no more probes
    new = _add(policy, 2, start=50)  # new requests are probed, less and less often
    for step in range(4000):
        d = policy.decide(_views(ids + new))
        for i, n in d.draft_lens.items():
            if n:
                policy.observe_acceptance(i, n, 0)
        if step % 200 == 199:
            new = [*new[1:], *_add(policy, 1, start=100 + step)]
    assert 3 <= policy.decisions["probe"] <= 12
    assert policy._probe_interval > 8


def test_a_stale_probe_keeps_the_rider_bound():
    """A plain row (a request with its own evidence that does not pay) rides in every step: a
    probe's step would stretch its token beyond (1 + rider_slack) plain steps, so none runs."""
    policy, ids = _stuck_policy(stale=True, probe_min_steps=8)
    _teach(policy, ids[0], 0.2, verifies=50)
    assert set(_run_verifying(policy, ids, 0.9, 200)) == {"no_gain"}
    policy.remove_request(ids[0])
    assert "probe" in _run_verifying(policy, ids[1:], 0.9, 200)


def test_a_stale_probe_feeds_far_drafters_in_a_catch_up_round():
    """Requests that never drafted have drafters a whole prompt behind: the probe is their
    catch-up round (its feed a one-off, not priced as every step's), and a row at its last
    token rides outside the guard (as a rider it would bound the probe's step)."""
    policy, ids = _stuck_policy(stale=True)
    last = _add(policy, 1, start=90)[0]
    views = [SeqView(i, 300) for i in ids] + [SeqView(last, 1200, tokens_left=1)]
    reasons = []
    for _ in range(2 * policy.goodput.probe_min_steps):
        d = policy.decide(views)
        reasons.append(d.reason)
        if d.draft_len:
            break
    assert reasons[-1] == "catch_up" and set(reasons[:-1]) == {"no_gain"}
    assert {i for i, n in d.draft_lens.items() if n} == set(ids)
    assert len(reasons) == policy.goodput.probe_min_steps


def test_a_parked_probe_feeds_far_drafters_in_a_catch_up_round():
    """While parked the drafter does not follow prompts, so new requests' drafters are a whole
    prompt behind: their probe is a catch-up round (the feed a one-off, amortized), not a feed
    priced into every round, which here would keep the probe from ever paying: parked for good."""
    shape = Shape(fixed=4e-3, per_token=5e-6, draft=0.5e-3, prefill_token=20e-6)
    policy = _policy(shape, probe_min_steps=8, max_catch_up=64, catch_up_every_steps=1)
    for i in _add(policy, 4):
        _teach(policy, i, 0.0, verifies=200)
        policy.remove_request(i)
    assert policy.population.value < policy.goodput.accept_floor  # parked
    ids = _add(policy, 4, start=10)
    assert not any(policy.expects_speculation(i) for i in ids)  # no prompt pass: far behind
    reasons = []
    for _ in range(4 * policy.goodput.probe_min_steps):
        d = policy.decide([SeqView(i, 300) for i in ids])
        reasons.append(d.reason)
        if d.draft_len:
            break
    assert reasons[-1] == "catch_up" and set(reasons[:-1]) == {"no_candidates"}
    assert all(d.draft_lens[i] > 0 for i in ids)
    assert len(reasons) == policy.goodput.probe_min_steps
