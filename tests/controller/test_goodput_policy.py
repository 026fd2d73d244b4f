"""The goodput policy on simulated time: batch decisions, the latency guard, zero cost when
speculation does not pay (population prior, backed-off probes), the blocking rules, and the
cost model's online levels."""

import random
from dataclasses import dataclass

import pytest
from controller_sim import FakeClock
from hypothesis import given, settings
from hypothesis import strategies as st

from verifypd.config import SpecConfig
from verifypd.controller import (
    BatchCostModel,
    DraftController,
    FixedController,
    GoodputConfig,
    GoodputPolicy,
    LoadSignals,
    SeqView,
    build_policy,
    expected_tokens,
)
from verifypd.controller.goodput import REASONS
from verifypd.controller.plan_search import Candidate, catch_up_rounds


@dataclass(frozen=True)
class Shape:
    """A memory-bound GPU in miniature: a forward reads the weights (``fixed``) and pays a
    little per token; a drafter step is ``draft`` plus a little per row."""

    fixed: float = 10e-3
    per_token: float = 20e-6
    draft: float = 0.6e-3
    prefill_token: float = 20e-6

    def target_time(self, rows, q):
        return self.fixed + self.per_token * rows * max(q, 1)

    def draft_time(self, rows):
        return self.draft + 5e-6 * rows

    def prefill_time(self, tokens):
        return self.fixed + self.prefill_token * tokens


def _policy(shape=Shape(), clock=None, max_draft_len=4, **goodput):
    spec = SpecConfig(max_draft_len=max_draft_len, initial_draft_len=max_draft_len)
    return build_policy(spec, BatchCostModel(shape), GoodputConfig(**goodput), clock or FakeClock())


def _add(policy, n, start=0, greedy=True, speculate=True):
    for i in range(start, start + n):
        policy.add_request(i, greedy, 0.0 if greedy else 0.8, speculate)
    return list(range(start, start + n))


def _teach(policy, seq_id, alpha, verifies=40, L=4, seed=0):
    """Acceptance history of a request whose drafts are accepted with probability α (the same
    history for every request taught with the same α and seed)."""
    rng = random.Random(seed)
    for _ in range(verifies):
        k = 0
        while k < L and rng.random() < alpha:
            k += 1
        policy.observe_acceptance(seq_id, L, k)


def _views(ids, behind=1):
    return [SeqView(i, behind) for i in ids]


def test_build_policy_follows_spec_config():
    costs = BatchCostModel()
    assert type(build_policy(SpecConfig(), costs)) is GoodputPolicy
    assert type(build_policy(SpecConfig(policy="feedback"), costs)) is DraftController
    assert type(build_policy(SpecConfig(controller=False), costs)) is FixedController
    with pytest.raises(ValueError):
        SpecConfig(policy="oracle")


def test_light_load_high_acceptance_speculates_every_request_fused():
    policy = _policy()
    ids = _add(policy, 4)
    for i in ids:
        _teach(policy, i, 0.9)
    d = policy.decide(_views(ids))
    assert d.reason == "speculate" and d.fused
    assert set(d.draft_lens.values()) == {d.draft_len} and d.draft_len >= 2
    assert d.predicted_tokens / d.predicted_step_s > 1.5 * len(ids) / d.plain_step_s


def test_large_batch_with_costly_verify_does_not_speculate():
    """Compute-bound verify (the per-token cost dominates): plain decoding wins."""
    policy = _policy(Shape(fixed=2e-3, per_token=100e-6))
    ids = _add(policy, 48)
    for i in ids:
        _teach(policy, i, 0.6)
    d = policy.decide(_views(ids))
    assert d.reason == "no_gain" and not any(d.draft_lens.values()) and not d.fused


def test_yield_to_prefill_blocks_speculation_only_while_prompt_work_runs():
    for yields in (False, True):
        policy = _policy(yield_to_prefill=yields)
        ids = _add(policy, 4)
        for i in ids:
            _teach(policy, i, 0.9)
        busy = policy.decide(_views(ids), LoadSignals(prefill_running=True))
        idle = policy.decide(_views(ids), LoadSignals(prefill_running=False))
        assert idle.reason == "speculate"
        assert busy.reason == ("prefill_running" if yields else "speculate")
        assert (not any(busy.draft_lens.values())) == yields


@pytest.mark.parametrize("exempt", [False, True])
def test_riders_waiting_for_their_catch_up_round_ride_when_exempt(exempt):
    """A fresh request (drafter far behind) between catch-up rounds is a rider: under the
    rider bound it keeps the batch plain; exempt, the others speculate and it rides."""
    policy = _policy(waiting_riders_exempt=exempt)
    ids = _add(policy, 4)
    for i in ids:
        _teach(policy, i, 0.9)
    assert policy.decide([SeqView(3, 500)]).reason == "catch_up"  # next round in 8 steps
    d = policy.decide([SeqView(0, 1), SeqView(1, 1), SeqView(2, 1), SeqView(3, 500)])
    if exempt:
        assert d.reason == "speculate" and d.draft_lens[3] == 0
        assert all(d.draft_lens[i] > 0 for i in (0, 1, 2))
    else:
        assert d.reason == "no_gain" and not any(d.draft_lens.values())


@pytest.mark.parametrize("plain", [False, True])
def test_a_rows_second_token_waits_for_no_drafts_when_set(plain):
    """A row fresh from its prompt step (its next token is its second), its drafter far behind:
    exempt as a waiting rider, it rides the others' round (its second token waits for their
    drafts); with ``second_token_plain`` it rides inside the rider bound, so the step is
    plain, and from its next step on it is an exempt waiting rider. A fresh row within reach
    of its drafter does not speculate in that step either."""
    policy = _policy(waiting_riders_exempt=True, second_token_plain=plain)
    ids = _add(policy, 4)
    for i in ids:
        _teach(policy, i, 0.9)
    assert policy.decide([SeqView(3, 500)]).reason == "catch_up"  # the next round in 8 steps
    steady = [SeqView(0, 1), SeqView(1, 1), SeqView(2, 1)]
    d = policy.decide([*steady, SeqView(3, 500, fresh=True)])
    if plain:
        assert d.reason == "no_gain" and not any(d.draft_lens.values())
    else:
        assert d.reason == "speculate" and d.draft_lens[3] == 0 and d.draft_lens[0] > 0
    after = policy.decide([*steady, SeqView(3, 500)])
    assert after.reason == "speculate" and after.draft_lens[3] == 0 and after.draft_lens[0] > 0
    near = policy.decide([*steady, SeqView(3, 1, fresh=True)])
    if plain:
        assert near.reason == "no_gain" and not any(near.draft_lens.values())
    else:
        assert near.reason == "speculate" and near.draft_lens[3] > 0


@pytest.mark.parametrize("limit", [None, 3])
def test_a_waiting_rider_is_exempt_for_at_most_its_limit(limit):
    """A fresh request whose catch-up round does not come (one every 100 steps) rides in the
    others' rounds outside the rider bound, for ``waiting_rider_max_steps`` decisions at most:
    then the bound holds for it again and the batch decodes plainly; once caught up it is a
    candidate, and a later wait starts its count afresh."""
    policy = _policy(waiting_riders_exempt=True, catch_up_every_steps=100,
                     waiting_rider_max_steps=limit)  # fmt: skip
    ids = _add(policy, 4)
    for i in ids:
        _teach(policy, i, 0.9)
    assert policy.decide([SeqView(3, 500)]).reason == "catch_up"  # the next round in 100 steps
    batch = [SeqView(0, 1), SeqView(1, 1), SeqView(2, 1), SeqView(3, 500)]
    reasons = [policy.decide(batch).reason for _ in range(6)]
    if limit is None:
        assert reasons == ["speculate"] * 6
    else:
        assert reasons == ["speculate"] * 3 + ["no_gain"] * 3
    assert policy.decide(_views(ids)).reason == "speculate"  # caught up: no longer waiting
    assert policy.decide(batch).reason == "speculate"  # waiting again: counted afresh


def test_a_no_gain_verdict_is_held_while_the_candidates_stay():
    """The full plan search runs once per ``no_gain_hold_steps`` while the batch's candidates
    are unchanged, and at once when they change; the decisions are those of searching every
    step (the costs do not move here)."""
    shape = Shape(fixed=2e-3, per_token=100e-6)
    held, every = _policy(shape), _policy(shape, no_gain_hold_steps=1)
    for policy in (held, every):
        ids = _add(policy, 48)
        for i in ids:
            _teach(policy, i, 0.6)
    batches = [ids] * 20 + [ids[:47]] * 5
    got = [[held.decide(_views(b)).reason for b in batches],
           [every.decide(_views(b)).reason for b in batches]]  # fmt: skip
    assert got[0] == got[1] == ["no_gain"] * 25
    assert (held.num_searches, every.num_searches) == (3 + 1, 25)  # steps 1, 9, 17; 21
    for policy in (held, every):  # new evidence moves a request to another α̂ bucket
        _teach(policy, ids[0], 1.0)
    before = held.num_searches
    held.decide(_views(ids[:47]))
    assert held.num_searches == before + 1


def test_speculation_turns_off_as_the_batch_grows():
    """Same costs, same acceptance: small batches speculate, large ones do not."""
    chosen = {}
    for rows in (1, 4, 16, 64):
        policy = _policy(Shape(fixed=2e-3, per_token=300e-6))  # compute-bound at 64 rows
        ids = _add(policy, rows)
        for i in ids:
            _teach(policy, i, 0.7)
        chosen[rows] = policy.decide(_views(ids)).draft_len
    assert chosen[1] > 0 and chosen[64] == 0
    assert chosen[1] >= chosen[4] >= chosen[16] >= chosen[64]


@settings(max_examples=150, deadline=None)
@given(
    alphas=st.lists(st.floats(0.0, 0.99), min_size=1, max_size=24),
    fixed=st.floats(1e-3, 20e-3),
    per_token=st.floats(1e-6, 200e-6),
    draft=st.floats(0.05e-3, 5e-3),
    slack=st.sampled_from([0.0, 0.05, 0.2]),
)
def test_no_request_is_expected_slower_than_plain_decoding(alphas, fixed, per_token, draft, slack):
    """The latency guard, for any acceptance mix and any costs: every request's expected time
    per token under the chosen plan is within (1 + ε) of the plain step."""
    policy = _policy(Shape(fixed, per_token, draft), latency_slack=slack)
    ids = _add(policy, len(alphas))
    for i, a in zip(ids, alphas, strict=True):
        _teach(policy, i, a, verifies=30)
    d = policy.decide(_views(ids))
    L = d.draft_len
    limit = (1.0 + slack) * d.plain_step_s * (1 + 1e-9)
    rider_limit = (1.0 + policy.goodput.rider_slack) * d.plain_step_s * (1 + 1e-9)
    for i in ids:
        n = d.draft_lens[i]
        per_token = d.predicted_step_s / (expected_tokens(policy.acceptance(i), n) if n else 1)
        assert n in (0, L) and (
            d.reason != "speculate" or per_token <= (limit if n else rider_limit)
        )
    if d.reason == "speculate":  # and it pays for the batch
        assert d.predicted_tokens / d.predicted_step_s > len(ids) / d.plain_step_s


def test_hetero_batch_keeps_the_low_acceptance_requests_within_the_guard():
    policy = _policy()
    ids = _add(policy, 10)
    alphas = [0.9] * 3 + [0.6] * 4 + [0.2] * 3
    for r in range(60):  # verifies interleaved, as they land in a server
        for i, a in zip(ids, alphas, strict=True):
            _teach(policy, i, a, verifies=1, seed=r)
    d = policy.decide(_views(ids))
    assert d.reason == "speculate"
    for i in ids:
        n = d.draft_lens[i]
        e = expected_tokens(policy.acceptance(i), n) if n else 1.0
        slack = policy.goodput.latency_slack
        assert d.predicted_step_s / e <= (1 + slack) * d.plain_step_s * (1 + 1e-9)


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


def test_a_request_at_its_last_token_rides_along_outside_the_guard():
    policy = _policy()
    ids = _add(policy, 3)
    for i in ids:
        _teach(policy, i, 0.9)
    d = policy.decide([SeqView(0), SeqView(1), SeqView(2, tokens_left=1)])
    assert d.reason == "speculate" and d.draft_lens[0] == d.draft_lens[2] == d.draft_len > 0


def test_the_drafter_follows_prefill_only_where_speculation_is_expected():
    policy = _policy()
    _add(policy, 1)
    _add(policy, 1, start=1, speculate=False)
    assert policy.expects_speculation(0) and not policy.expects_speculation(1)
    assert not policy.expects_speculation(42)  # unknown


@pytest.mark.parametrize(
    ("setup", "reason"),
    [
        ("latency", "latency_guard"),
        ("prefill", "prefill_pressure"),
        ("rows", "batch_too_large"),
        ("off", "no_candidates"),
    ],
)
def test_blocking_rules_turn_speculation_off(setup, reason):
    clock = FakeClock()
    policy = _policy(clock=clock, prefill_wait_guard_s=0.25, max_spec_rows=4)
    ids = _add(policy, 8 if setup == "rows" else 3, speculate=setup != "off")
    for i in ids:
        _teach(policy, i, 0.9)
    load = LoadSignals(prefill_wait_s=0.3 if setup == "prefill" else 0.1)
    if setup == "latency":
        for _ in range(20):
            policy.observe_step("decode", 0.2, 3, 3)  # p95 far above the 50 ms target
    d = policy.decide(_views(ids), load)
    assert d.reason == reason and not any(d.draft_lens.values())
    assert policy.decisions[reason] == 1 and set(policy.decisions) == set(REASONS)


def test_separate_verify_lane_when_an_eager_mixed_step_is_dear():
    """Some requests cannot speculate (speculate=False): a fused step would mix row lengths
    (eager). When the eager penalty is large the verify goes to its own lane."""
    costs = BatchCostModel(Shape(fixed=2e-3, per_token=5e-6, draft=0.1e-3), mixed_prior=3.0)
    spec = SpecConfig(max_draft_len=4, initial_draft_len=4)
    policy = build_policy(
        spec, costs, GoodputConfig(latency_slack=2.0, rider_slack=2.0), FakeClock()
    )
    ids = _add(policy, 2) + _add(policy, 2, start=2, speculate=False)
    for i in ids[:2]:
        _teach(policy, i, 0.95)
    d = policy.decide(_views(ids))
    assert d.reason == "speculate" and not d.fused
    cheap = _policy(
        Shape(fixed=2e-3, per_token=5e-6, draft=0.1e-3), latency_slack=2.0, rider_slack=2.0
    )
    _add(cheap, 2), _add(cheap, 2, start=2, speculate=False)
    for i in ids[:2]:
        _teach(cheap, i, 0.95)
    cheap.costs.level["mixed"] = 1.0
    assert cheap.decide(_views(ids)).fused


def test_decisions_are_deterministic():
    def run():
        policy = _policy()
        ids = _add(policy, 12)
        out = []
        for step in range(50):
            d = policy.decide(_views(ids))
            out.append((d.reason, d.fused, tuple(sorted(d.draft_lens.items()))))
            for i, n in d.draft_lens.items():
                if n:
                    policy.observe_acceptance(i, n, (i + step) % (n + 1))
        return out

    assert run() == run()


def test_new_requests_start_at_the_population_acceptance():
    policy = _policy()
    ids = _add(policy, 4)
    for i in ids:
        _teach(policy, i, 0.3, verifies=200)
    population = policy.population.value
    assert 0.2 < population < 0.45
    _add(policy, 1, start=99)
    assert policy.acceptance(99) == pytest.approx(population)


# -- the cost model ----------------------------------------------------------------------------


def test_cost_levels_follow_observations_and_share_target_contention():
    costs = BatchCostModel(Shape())
    base_decode, base_verify = costs.decode(8), costs.verify(8, 5)
    costs.observe("decode", 2 * Shape().target_time(8, 1), 8, 8)  # twice as slow as measured
    assert costs.decode(8) == pytest.approx(1.2 * base_decode)  # one step moves it by w = 0.2
    costs.observe("decode", 1000.0, 8, 8)  # an outlier moves it by at most w * 3
    assert costs.level["target"] == pytest.approx(1.2 + 0.2 * (4.0 - 1.2))
    for _ in range(60):
        costs.observe("decode", 2 * Shape().target_time(8, 1), 8, 8)
    assert costs.decode(8) == pytest.approx(2 * base_decode, rel=1e-3)
    assert costs.verify(8, 5) == pytest.approx(2 * base_verify, rel=1e-3)  # same contention
    for _ in range(60):
        costs.observe("mixed", 2 * 1.5 * Shape().target_time(8, 2), 8, 16)
    assert costs.level["mixed"] == pytest.approx(1.5, rel=1e-3)
    for _ in range(60):  # converges back once steps are fast again
        costs.observe("decode", Shape().target_time(8, 1), 8, 8)
    assert costs.decode(8) == pytest.approx(base_decode, rel=1e-3)
    with pytest.raises(ValueError):
        costs.observe("warp", 1.0, 1, 1)


def test_the_snapshot_carries_the_cost_levels_as_scalars():
    policy = _policy()
    for _ in range(60):
        policy.costs.observe("decode", 2 * Shape().target_time(8, 1), 8, 8)
    snap = policy.snapshot()
    assert snap["cost_level_target"] == pytest.approx(2.0, rel=1e-3)
    assert snap["cost_levels"]["level_target"] == snap["cost_level_target"]


def test_prefill_tokens_within_a_target():
    costs = BatchCostModel(Shape())
    n = costs.prefill_tokens_within(0.02, 256, 8192)
    assert costs.prefill(n) <= 0.02 < costs.prefill(n + 1)
    assert costs.prefill_tokens_within(10.0, 256, 8192) == 8192
    assert costs.prefill_tokens_within(1e-6, 256, 8192) == 256  # never below the floor
    for _ in range(60):
        costs.observe("prefill", 2 * Shape().prefill_time(2048), 1, 2048)
    assert costs.prefill_tokens_within(0.02, 256, 8192) < n


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


def test_the_decode_cadence_is_timed_against_the_prediction():
    """From one decision to the next: speculating and plain steps apart, idle gaps left out."""
    clock = FakeClock()
    policy = _policy(clock=clock)
    ids = _add(policy, 4)
    for i in ids:
        _teach(policy, i, 0.9)
    first = policy.decide(_views(ids))
    assert first.draft_len > 0
    clock.advance(2 * first.predicted_step_s)
    policy.decide(_views(ids))
    clock.advance(100.0)  # nothing to decode for a while
    policy.decide(_views(ids))
    snap = policy.snapshot()
    assert snap["cadence_spec_steps"] == 1 and snap["cadence_plain_steps"] is None
    assert snap["cadence_spec_s"] == pytest.approx(2 * first.predicted_step_s)
    assert snap["cadence_spec_predicted_s"] == pytest.approx(first.predicted_step_s)


def test_the_step_cap_bounds_the_speculating_step_itself():
    """The guard bounds the expected time per token; the cap bounds the step (the gap a
    request sees when its first draft is rejected): with it, L shrinks until the step fits."""
    shape = Shape(fixed=4e-3, per_token=5e-6, draft=0.5e-3)
    decisions = {}
    for cap in (None, 1.25):
        policy = _policy(shape, max_step_ratio=cap)
        ids = _add(policy, 4)
        for i in ids:
            _teach(policy, i, 0.9)
        decisions[cap] = policy.decide(_views(ids))
    free, capped = decisions[None], decisions[1.25]
    assert free.draft_len > capped.draft_len > 0
    assert free.predicted_step_s > 1.25 * free.plain_step_s
    assert capped.predicted_step_s <= 1.25 * capped.plain_step_s


def test_the_step_cap_counts_a_catch_up_rounds_context_feed():
    """A catch-up round's one-off feed is part of the step every row of it waits for: under a
    cap that the round's drafts at L = 4 fit but not with the feed, L shrinks until the whole
    step fits."""
    shape = Shape(fixed=4e-3, per_token=5e-6, draft=0.2e-3, prefill_token=20e-6)
    decisions = {}
    for cap in (None, 1.3):
        policy = _policy(shape, max_step_ratio=cap, max_catch_up=64, catch_up_every_steps=1,
                         chunk_catch_up=520, rider_slack=5.0)  # fmt: skip
        ids = _add(policy, 5)
        for i in ids:
            _teach(policy, i, 0.9)
        decisions[cap] = policy.decide(_views(ids[:4]) + [SeqView(4, 300)])
    free, capped = decisions[None], decisions[1.3]
    assert free.reason == "catch_up" and free.draft_lens[4] > 0
    assert free.predicted_step_s > 1.3 * free.plain_step_s  # its 300 tokens tip it over
    assert 0 < capped.draft_len < free.draft_len
    assert capped.predicted_step_s <= 1.3 * capped.plain_step_s


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


def test_a_round_overhead_is_charged_to_speculative_plans_only():
    """Where decode-ahead hides a plain step's host turnaround, a speculative round still pays
    it: charged to every speculative plan, a gain that fits without it no longer does."""
    ids = list(range(8))
    gains = []
    for overhead in (0.0, 4e-3, 40e-3):
        policy = _policy(round_overhead_s=overhead)
        _add(policy, len(ids))
        for i in ids:
            _teach(policy, i, 0.7)
        d = policy.decide(_views(ids))
        gains.append(d.predicted_tokens / d.predicted_step_s if d.draft_len else None)
        assert d.plain_step_s == pytest.approx(Shape().target_time(len(ids), 1))  # plain: as is
    assert gains[0] is not None and gains[1] is not None and gains[1] < gains[0]
    assert gains[2] is None  # a round dearer than the tokens it wins: plain decoding


def test_the_round_overhead_reaches_the_policy_only_where_decode_ahead_runs():
    from verifypd.config import EngineConfig
    from verifypd.engine.core import EngineCore
    from verifypd.lanes.spec_policy import goodput_config

    spec = SpecConfig(method="ngram", round_overhead_s=1e-3)
    core = EngineCore(EngineConfig(model="dummy:tiny", device="cpu", spec=spec))
    assert goodput_config(core).round_overhead_s == 0.0  # CPU: no decode-ahead by default
    core = EngineCore(EngineConfig(model="dummy:tiny", device="cpu", spec=spec, decode_ahead=True))
    assert goodput_config(core).round_overhead_s == 1e-3


@pytest.mark.parametrize(
    ("options", "reads"),
    [({}, False), ({"yield_to_prefill": True}, True), ({"catch_up_yields_to_prefill": True}, True)],
)
def test_the_engine_reads_prompt_work_for_a_policy_that_yields_to_it(options, reads):
    from verifypd.config import EngineConfig
    from verifypd.engine.core import EngineCore
    from verifypd.lanes.spec_policy import SpeculationPolicy

    spec = SpecConfig(method="ngram", catch_up_round_tokens=512, catch_up_every_steps=3,
                      waiting_rider_max_steps=5, **options)  # fmt: skip
    core = EngineCore(EngineConfig(model="dummy:tiny", device="cpu", spec=spec))
    policy = SpeculationPolicy(core)
    assert policy.reads_prompt_work is reads
    g = policy.controller.goodput
    assert g.catch_up_round_tokens == 512 and g.catch_up_every_steps == 3
    assert g.waiting_rider_max_steps == 5
    assert g.catch_up_yields_to_prefill is options.get("catch_up_yields_to_prefill", False)


@pytest.mark.parametrize("beside", [False, True])
def test_drafts_beside_decode_reaches_the_dispatcher_and_the_policy(beside):
    from verifypd.config import EngineConfig
    from verifypd.engine.core import EngineCore
    from verifypd.lanes.spec_policy import SpeculationPolicy

    spec = SpecConfig(method="ngram", drafts_beside_decode=beside)
    core = EngineCore(EngineConfig(model="dummy:tiny", device="cpu", spec=spec))
    policy = SpeculationPolicy(core)
    assert policy.drafts_beside_decode is beside
    assert policy.controller.goodput.drafts_beside_decode is beside


def test_tail_tolerance_takes_the_shortest_step_among_plans_close_to_the_best():
    """A rejected first draft makes the whole step one request's inter-token gap: with a
    tolerance the policy gives up at most that fraction of tokens/s for a shorter step, and
    with none it keeps the best tokens/s. An H200-like shape at light load: α̂ ≈ 0.73 gains
    4 % tokens/s from L = 3 over L = 2 for a step 13 % longer."""
    shape = Shape(fixed=3.9e-3, per_token=5e-6, draft=0.63e-3)
    out = {}
    for tol in (0.0, 0.05, 0.10, 0.5):
        policy = _policy(shape, tail_tolerance=tol)
        ids = _add(policy, 4)
        for i in ids:
            _teach(policy, i, 0.75, verifies=200)
        out[tol] = policy.decide(_views(ids))
    best = out[0.0]
    rate = {tol: d.predicted_tokens / d.predicted_step_s for tol, d in out.items()}
    assert best.draft_len == 3 and best.reason == "speculate"
    for tol in (0.05, 0.10):
        d = out[tol]
        assert d.reason == "speculate" and 0 < d.draft_len < best.draft_len
        assert d.predicted_step_s < best.predicted_step_s
        assert rate[tol] >= (1.0 - tol) * rate[0.0]
    assert out[0.10].draft_len <= out[0.05].draft_len
    # However loose the tolerance, a plan must still beat plain decoding by the gain margin.
    assert rate[0.5] > 1.02 * 4 / out[0.5].plain_step_s


@given(
    alphas=st.lists(st.floats(0.0, 0.99), min_size=1, max_size=12),
    tol=st.floats(0.0, 0.5),
)
@settings(max_examples=60, deadline=None)
def test_tail_tolerance_never_leaves_the_tolerance_band(alphas, tol):
    """Property: the tolerant choice speculates exactly when the plain choice does, with a
    step no longer and tokens/s within the tolerance of it."""
    shape = Shape(fixed=3.9e-3, per_token=5e-6, draft=0.63e-3)
    decided = []
    for t in (0.0, tol):
        policy = _policy(shape, tail_tolerance=t)
        ids = _add(policy, len(alphas))
        for i, a in zip(ids, alphas, strict=True):
            _teach(policy, i, a, verifies=60, seed=i)
        decided.append(policy.decide(_views(ids)))
    plain, tolerant = decided
    assert (plain.draft_len > 0) == (tolerant.draft_len > 0)
    if plain.draft_len:
        assert tolerant.predicted_step_s <= plain.predicted_step_s + 1e-12
        plain_rate = plain.predicted_tokens / plain.predicted_step_s
        tolerant_rate = tolerant.predicted_tokens / tolerant.predicted_step_s
        assert tolerant_rate >= (1.0 - tol) * plain_rate - 1e-9


def test_tail_tolerance_is_checked():
    with pytest.raises(ValueError, match="tail_tolerance"):
        GoodputConfig(tail_tolerance=1.0)
    with pytest.raises(ValueError, match="tail_tolerance"):
        SpecConfig(tail_tolerance=-0.1)


def test_a_row_whose_drafter_is_being_fed_decodes_plainly_as_a_waiting_rider():
    """A row whose drafter is being fed its prompt behind the prefill (``drafter_busy``) is no
    candidate; it rides along plainly and, like a row waiting for its catch-up round, outside
    the rider bound when ``waiting_riders_exempt`` (it speculates once fed)."""
    shape = Shape(fixed=4e-3, per_token=5e-6, draft=0.5e-3)
    out = {}
    for exempt in (False, True):
        policy = _policy(shape, waiting_riders_exempt=exempt, rider_slack=0.05)
        ids = _add(policy, 4)
        for i in ids:
            _teach(policy, i, 0.9)
        out[exempt] = policy.decide(_views(ids[:3]) + [SeqView(3, 1, drafter_busy=True)])
    assert out[True].reason == "speculate" and out[True].draft_lens[3] == 0
    assert all(out[True].draft_lens[i] > 0 for i in range(3))
    assert out[False].draft_len == 0  # a plain rider may not wait a whole round
    policy = _policy(shape)
    _add(policy, 1)
    _teach(policy, 0, 0.9)
    assert policy.decide([SeqView(0, 1, drafter_busy=True)]).reason == "no_candidates"


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


@pytest.mark.parametrize("beside", [False, True])
def test_drafts_beside_the_decode_step_let_riders_wait_for_their_own_step_only(beside):
    """Four requests that accept 0.9 beside four that may not speculate: drafted ahead of the
    decode step, every plan makes the plain four wait past the rider bound; drafted beside it
    (on the verify lane's stream), a separate round keeps them at their own decode step."""
    policy = _policy(drafts_beside_decode=beside, rider_slack=0.05)
    spec = _add(policy, 4)
    plain = _add(policy, 4, start=4, speculate=False)
    for i in spec:
        _teach(policy, i, 0.9)
    d = policy.decide(_views(spec + plain))
    if not beside:
        assert d.reason == "no_gain"
        return
    assert d.reason == "speculate" and not d.fused
    assert all(d.draft_lens[i] == d.draft_len > 0 for i in spec)
    assert all(d.draft_lens[i] == 0 for i in plain)
    # the round is still charged in full: drafts, the plain rows' step and the verify
    costs = policy.costs
    full = d.draft_len * costs.draft(4) + costs.decode(4) + costs.verify(4, 1 + d.draft_len)
    assert d.predicted_step_s == pytest.approx(full, rel=0.05)


@pytest.mark.parametrize("bad", [0, -3, 1.5])
def test_waiting_rider_max_steps_is_validated(bad):
    with pytest.raises(ValueError, match="waiting_rider_max_steps"):
        SpecConfig(waiting_rider_max_steps=bad)
    if isinstance(bad, int):
        with pytest.raises(ValueError, match="waiting_rider_max_steps"):
            GoodputConfig(waiting_rider_max_steps=bad)


@pytest.mark.parametrize("bad", [0, -1, 2.5, None])
def test_catch_up_every_steps_is_validated(bad):
    with pytest.raises(ValueError, match="catch_up_every_steps"):
        SpecConfig(catch_up_every_steps=bad)


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


@pytest.mark.parametrize("name, default", [("probe_when_stale", True),
                                           ("amortize_within_request", False)])  # fmt: skip
def test_the_policys_switches_are_bools(name, default):
    assert getattr(GoodputConfig(), name) is default
    assert getattr(SpecConfig(), name) is default
    with pytest.raises(ValueError, match=name):
        GoodputConfig(**{name: 1})
    with pytest.raises(ValueError, match=name):
        SpecConfig(**{name: "no"})


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
