"""Stateless decision math, checked against independent computations."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from verifypd.controller.policy import (
    best_draft_len,
    drafter_temperature,
    expected_tokens,
    shrink_draft_len,
    token_rates,
)
from verifypd.controller.signals import StepCosts


def _expected_tokens_by_pmf(alpha: float, draft_len: int) -> float:
    """E[K + 1] with P(K = k) = α^k (1 − α) for k < L and P(K = L) = α^L."""
    pmf = [alpha**k * (1 - alpha) for k in range(draft_len)] + [alpha**draft_len]
    return sum((k + 1) * p for k, p in enumerate(pmf))


@given(st.floats(0.0, 1.0), st.integers(0, 16))
def test_expected_tokens_matches_truncated_geometric(alpha, draft_len):
    assert expected_tokens(alpha, draft_len) == pytest.approx(
        _expected_tokens_by_pmf(alpha, draft_len), rel=1e-9, abs=1e-12
    )


def test_expected_tokens_edges():
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(0.5, 0) == 1.0


def test_token_rates_and_argmax():
    costs = StepCosts(decode_s=1.0, verify_fixed_s=0.9, verify_token_s=0.1, draft_token_s=0.1)
    rates = token_rates(0.9, costs, 4)
    assert rates[0] == 1.0  # plain decode: one token per d
    assert rates[4] == pytest.approx((1 - 0.9**5) / 0.1 / (0.4 + 0.9 + 0.5))
    assert best_draft_len(rates) == 4


def test_best_draft_len_breaks_ties_toward_shorter():
    # α = 0.5, cost(L) = 1 + 0.2·L (L >= 1): G(1) = 1.5/1.2 = G(2) = 1.75/1.4 = 1.25
    costs = StepCosts(decode_s=1.0, verify_fixed_s=0.9, verify_token_s=0.1, draft_token_s=0.1)
    rates = token_rates(0.5, costs, 4)
    assert rates[1] == pytest.approx(rates[2])
    assert best_draft_len(rates) == 1
    assert best_draft_len([1.0, 3.0, 3.0, 2.0]) == 1


@pytest.mark.parametrize("max_draft_len", range(1, 17))
def test_halving_reaches_zero_in_floor_log2_plus_one_steps(max_draft_len):
    L, steps = max_draft_len, 0
    while L > 0:
        new = shrink_draft_len(L, 0.5)
        assert new <= L // 2
        L, steps = new, steps + 1
    assert steps == math.floor(math.log2(max_draft_len)) + 1


@given(st.integers(1, 64), st.floats(0.0, 0.99))
def test_shrink_always_makes_progress(draft_len, factor):
    assert 0 <= shrink_draft_len(draft_len, factor) < draft_len


def test_drafter_temperature_rule():
    def rule(alpha, greedy=False, tau=1.0):
        return drafter_temperature(greedy, tau, alpha, min_frac=0.25, full_accept=0.8)

    assert rule(0.9, greedy=True) == 0.0
    assert rule(0.9, tau=0.0) == 0.0
    assert rule(0.9, tau=0.7) == 0.7  # α ≥ α_full: the target temperature
    assert rule(0.4, tau=0.7) == pytest.approx(0.35)  # 0.7 · 0.4/0.8
    assert rule(0.0, tau=0.7) == pytest.approx(0.175)  # floor s_min·τ


@given(st.floats(0.0, 1.0), st.floats(0.0, 1.0), st.floats(0.0, 2.0))
def test_drafter_temperature_is_monotone_and_clamped(a1, a2, tau):
    lo, hi = sorted((a1, a2))
    t_lo = drafter_temperature(False, tau, lo, 0.25, 0.8)
    t_hi = drafter_temperature(False, tau, hi, 0.25, 0.8)
    assert 0.0 <= t_lo <= t_hi <= tau
