"""Stateless decision math of the draft controller, in the notation of DESIGN.md.

α: per-token acceptance, L: draft length, E[tokens | α, L]: tokens one verify yields,
G(L) = E[tokens | α, L] / cost(L): tokens per second of one sequence at draft length L.
"""

from __future__ import annotations

import math

from verifypd.controller.signals import StepCosts

_MIN_COST_S = 1e-12  # guards G(L) against zero-second measurements


def expected_tokens(alpha: float, draft_len: int) -> float:
    """E[tokens | α, L] = Σ_{k=0}^{L} α^k = (1 − α^(L+1)) / (1 − α), and L + 1 at α = 1.

    K accepted drafts (truncated geometric) plus the bonus or resampled token.
    """
    if alpha >= 1.0:
        return float(draft_len + 1)
    return (1.0 - alpha ** (draft_len + 1)) / (1.0 - alpha)


def token_rates(alpha: float, costs: StepCosts, max_draft_len: int) -> list[float]:
    """[G(0), ..., G(L_max)]; G(0) = 1 / d is plain decode."""
    return [
        expected_tokens(alpha, n) / max(costs.cost(n), _MIN_COST_S)
        for n in range(max_draft_len + 1)
    ]


def best_draft_len(rates: list[float], rel_tol: float = 1e-9) -> int:
    """argmax_L G(L); the smallest L among values within ``rel_tol`` of the maximum, so that
    exact ties (e.g. α = 0.5 where two lengths give the same rate) resolve deterministically."""
    top = max(rates)
    return next(n for n, g in enumerate(rates) if g >= top * (1.0 - rel_tol))


def shrink_draft_len(draft_len: int, factor: float) -> int:
    """Multiplicative decrease L ← ⌊f·L⌋ with f < 1: strictly smaller for every L ≥ 1.

    From L, ⌊log_{1/f} L⌋ + 1 decreases reach 0 (f = 1/2: 4 → 2 → 1 → 0).
    """
    return math.floor(draft_len * factor)


def drafter_temperature(
    is_greedy: bool, temperature: float, alpha: float, min_frac: float, full_accept: float
) -> float:
    """τ_draft = τ · clamp(α / α_full, s_min, 1); 0 for greedy requests.

    At high acceptance the drafter samples at the target temperature τ (its distribution is
    the best proposal when the models agree). As α falls below α_full the drafter is sharpened
    linearly in α, down to s_min·τ, so its proposals concentrate on its most likely tokens,
    the ones a disagreeing target still tends to accept. Always within [0, τ].
    """
    if is_greedy or temperature <= 0.0:
        return 0.0
    scale = min(1.0, max(min_frac, alpha / full_accept))
    return temperature * scale
