"""The goodput policy with a TPOT target (``GoodputConfig.tpot_target_s``): while a plain step
misses the target, the rider bound gives way to the rows that can make it by speculating."""

import pytest
from test_goodput_policy import _add, _policy, _teach, _views

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
    if speculates:  # the latency guard still holds for the speculators
        assert {i for i, n in d.draft_lens.items() if n} == set(fast)
        assert d.predicted_step_s / expected_tokens(0.9, d.draft_len) <= 1.1 * d.plain_step_s
    else:
        assert d.reason == "no_gain"


def test_tpot_target_is_validated():
    with pytest.raises(ValueError, match="tpot_target_s"):
        GoodputConfig(tpot_target_s=0.0)
    with pytest.raises(ValueError, match="tpot_target_s"):
        SpecConfig(tpot_target_s=-1e-3)
    g = goodput_config_for(SchedulerConfig(), SpecConfig(tpot_target_s=4e-3), True, True)
    assert g.tpot_target_s == 4e-3
