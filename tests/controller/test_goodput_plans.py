"""The goodput policy's plan choice on simulated time: when a batch speculates and how (fused, or
with its verify on a lane of its own), the latency guard that keeps every request's expected time
per token within (1 + ε) of a plain step, the no-gain verdict held while the candidates stay,
and the blocking rules that turn speculation off."""

import pytest
from controller_sim import FakeClock
from goodput_helpers import Shape, _add, _policy, _teach, _views
from hypothesis import given, settings
from hypothesis import strategies as st

from verifypd.config import SpecConfig
from verifypd.controller import (
    BatchCostModel,
    GoodputConfig,
    LoadSignals,
    build_policy,
    expected_tokens,
)
from verifypd.controller.goodput import REASONS


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


def test_a_single_lane_step_carrying_a_prompt_chunk_is_not_a_decode_latency():
    """The single lane's mixed steps feed the latency guard, but one with a prompt chunk inside
    (``prompt``) is the chunk's time: slow ones of those leave speculation on."""
    for prompt, reason in ((True, "speculate"), (False, "latency_guard")):
        policy = _policy(clock=FakeClock())
        ids = _add(policy, 3)
        for i in ids:
            _teach(policy, i, 0.9)
        for _ in range(20):
            policy.observe_step("mixed", 0.2, 3, 3, prompt)  # p95 far above the 50 ms target
        assert policy.decide(_views(ids), LoadSignals()).reason == reason


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
