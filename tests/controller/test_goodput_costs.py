"""The goodput policy's cost model and what it reports: the online cost levels (one target
contention shared by decode and verify), prefill tokens within a time target, the round overhead
charged to speculative plans only, and the cost levels and decode cadence in the snapshot."""

import pytest
from controller_sim import FakeClock
from goodput_helpers import Shape, _add, _policy, _teach, _views

from verifypd.controller import BatchCostModel


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
