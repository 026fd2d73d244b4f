"""Signal trackers the draft controller reads each step.

Pure Python, no torch. Time comes from an injected ``clock`` so tests run on simulated time.

- ``Ewma``: exponentially weighted moving average.
- ``AcceptanceEstimate``: per-request per-token acceptance α̂ from verify outcomes.
- ``WindowPercentile``: nearest-rank percentile over a sliding *time* window.
- ``StepCostModel``: per-sequence step costs (decode d, verify a + b·(L + 1), draft c per
  token) fitted from observed lane steps, with priors until observations arrive.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

LANES = ("decode", "verify", "prefill", "draft", "mixed")


class Ewma:
    """v ← v + w·(x − v). With no ``initial`` value the first update sets v = x.

    ``prior_count``: the initial value counts as that many observations, not as the whole
    past: update n (from 0) weighs max(w, 1 / (prior_count + n + 1)), a running mean with the
    prior until it is as long as the EWMA's memory (1 / w), the EWMA from then on. A small
    weight alone would keep a wrong prior for ~1 / w updates."""

    def __init__(
        self, weight: float, initial: float | None = None, prior_count: float | None = None
    ) -> None:
        if not 0.0 < weight <= 1.0:
            raise ValueError("EWMA weight must be in (0, 1]")
        if prior_count is not None and (prior_count <= 0.0 or initial is None):
            raise ValueError("prior_count must be > 0 and needs an initial value")
        self.weight = weight
        self._value = initial
        self._prior_count = prior_count
        self._updates = 0

    @property
    def value(self) -> float | None:
        """Current average; None before the first update when no initial value was given."""
        return self._value

    def update(self, x: float) -> float:
        v = self._value
        w = self.weight
        if self._prior_count is not None:
            w = max(w, 1.0 / (self._prior_count + self._updates + 1))
        self._updates += 1
        self._value = x if v is None else v + w * (x - v)
        return self._value


class AcceptanceEstimate:
    """Per-token acceptance α̂ of one request.

    A verify of L drafts with K accepted tests n = K + 1[K < L] positions (it stops at the first
    rejection) and K of them pass. α̂ = EWMA(K) / EWMA(n) is the decayed maximum-likelihood
    estimate of α in the truncated-geometric model behind E[tokens | α, L] = (1 − α^(L+1)) /
    (1 − α). The plain ratio K / L is biased low for that formula (α = 0.9, L = 4: E[K]/L = 0.77).
    The prior α₀ counts as one earlier observation of one position.
    """

    def __init__(self, weight: float, prior: float, prior_count: float | None = None) -> None:
        # prior_count (see Ewma): the prior α₀ counts as that many verifies (None: the EWMA
        # starts from it with weight w, i.e. the prior fades over ~1 / w verifies).
        self._accepted = Ewma(weight, prior, prior_count)  # EWMA of K
        self._tested = Ewma(weight, 1.0, prior_count)  # EWMA of n
        self.num_drafted = 0
        self.num_accepted = 0
        self.num_updates = 0  # verifies that tested at least one position
        self._value = _ratio(self._accepted.value, self._tested.value)

    @property
    def value(self) -> float:
        return self._value  # read every step for every request: computed on update

    def update(self, num_drafted: int, num_accepted: int) -> None:
        if not 0 <= num_accepted <= num_drafted:
            raise ValueError(f"need 0 <= accepted <= drafted, got {num_accepted}/{num_drafted}")
        if num_drafted == 0:
            return  # nothing was tested
        self.num_drafted += num_drafted
        self.num_accepted += num_accepted
        self._observe(num_accepted, num_accepted + (num_accepted < num_drafted))

    def missed(self) -> None:
        """A round whose proposer found nothing to draft (a prompt lookup without a match)
        gave one token, as a round whose first draft is rejected does: one position tested,
        none passed. Nothing was drafted, so ``num_drafted`` stays; ``num_updates`` counts it.
        So α̂ also carries how often the proposer finds drafts at all."""
        self._observe(0, 1)

    def _observe(self, passed: int, tested: int) -> None:
        """One verify's positions: ``tested`` of them, ``passed`` accepted."""
        self.num_updates += 1
        self._accepted.update(passed)
        self._tested.update(tested)
        self._value = _ratio(self._accepted.value, self._tested.value)


def _ratio(num: float | None, den: float | None) -> float:
    assert num is not None and den is not None and den > 0.0
    return min(1.0, max(0.0, num / den))


class WindowPercentile:
    """Nearest-rank percentiles of the values added during the last ``window_s`` seconds.

    A sample added at time t is kept while ``clock() - t <= window_s``; at most ``max_samples``
    are kept (oldest dropped first) so memory stays bounded under any step rate.
    """

    def __init__(
        self, window_s: float, clock: Callable[[], float], max_samples: int = 4096
    ) -> None:
        if window_s <= 0.0 or max_samples <= 0:
            raise ValueError("window_s and max_samples must be positive")
        self.window_s = window_s
        self._clock = clock
        self._samples: deque[tuple[float, float]] = deque(maxlen=max_samples)  # (t, value)
        # The same values kept sorted: a percentile is read before every decode step, and
        # sorting the window each time cost tens of microseconds of host time per step.
        self._sorted: list[float] = []

    @property
    def count(self) -> int:
        """Number of samples inside the window now."""
        self._prune()
        return len(self._samples)

    def add(self, value: float) -> None:
        if len(self._samples) == self._samples.maxlen:  # the deque drops its oldest
            self._drop(self._samples[0][1])
        self._samples.append((self._clock(), value))
        bisect.insort(self._sorted, value)

    def percentile(self, q: float) -> float | None:
        """The nearest-rank q-th percentile, q in [0, 100] (numpy's convention; 95 = p95):
        the ⌈q/100 · n⌉-th smallest of the n samples in the window; None when it is empty."""
        if not 0.0 <= q <= 100.0:
            raise ValueError("q must be in [0, 100]")
        self._prune()
        if not self._samples:
            return None
        values = self._sorted
        rank = max(1, math.ceil(q / 100.0 * len(values)))
        return values[rank - 1]

    def _prune(self) -> None:
        # The documented rule itself, not ``t < now - window_s``: the two differ by a rounding
        # at the window's edge (now 3.0, t 0.9999999999999999: 3.0 - t == 2.0 but
        # t < 3.0 - 2.0).
        now = self._clock()
        while self._samples and now - self._samples[0][0] > self.window_s:
            self._drop(self._samples.popleft()[1])

    def _drop(self, value: float) -> None:
        del self._sorted[bisect.bisect_left(self._sorted, value)]


@dataclass(frozen=True)
class StepCosts:
    """Per-sequence step costs in seconds: d (plain decode), a + b·(L + 1) (verify of L drafts
    plus the last token), c (drafting one token)."""

    decode_s: float  # d
    verify_fixed_s: float  # a
    verify_token_s: float  # b
    draft_token_s: float  # c

    def cost(self, draft_len: int) -> float:
        """Seconds one sequence spends to produce its tokens of one round with draft length L:
        d for L = 0, else c·L + a + b·(L + 1)."""
        if draft_len == 0:
            return self.decode_s
        verify_s = self.verify_fixed_s + self.verify_token_s * (draft_len + 1)
        return self.draft_token_s * draft_len + verify_s


class _DecayedSums:
    """Σ γ^age · (1, x, y, x², x·y) over observations; each new one decays the old by γ."""

    def __init__(self, decay: float) -> None:
        self.decay = decay
        self.w = self.x = self.y = self.xx = self.xy = 0.0

    def add(self, x: float, y: float) -> None:
        g = self.decay
        self.w = g * self.w + 1.0
        self.x = g * self.x + x
        self.y = g * self.y + y
        self.xx = g * self.xx + x * x
        self.xy = g * self.xy + x * y


class StepCostModel:
    """Per-sequence step costs fitted from observed lane steps.

    - decode: d = Σ s / Σ B over decode steps (s seconds, B sequences).
    - draft: c = Σ s / Σ T over draft steps (T drafted tokens, all sequences).
    - verify: per-sequence y = s / B against x = T / B (tokens per sequence, L + 1 on average),
      y ≈ a + b·x by weighted least squares with a ridge of weight λ pulling b toward a slope
      prior b₀, so the fit stays defined when every verify used the same L.
    Sums decay by γ per observation of their lane. Before a lane's first observation its
    estimate is a prior relative to d: a₀ = (1 − β)·d, b₀ = β·d, c₀ = κ·d; d₀ is given.
    The slope prior b₀ is the last slope the data identified (centred spread Σ w (x − x̄)² ≥ λ);
    until then it is the β-share line through the verify mean, b₀ = β·ȳ / (1 − β + β·x̄).
    So a decayed spread of L does not let b drift back to a guess (which would make the
    controller re-explore long drafts periodically), and a change of d (e.g. a slow decode
    step) does not move the verify line. Prefill and mixed steps are only counted.
    """

    def __init__(
        self,
        prior_decode_s: float = 1e-3,
        prior_verify_token_frac: float = 0.1,  # β
        prior_draft_frac: float = 0.1,  # κ
        decay: float = 0.98,  # γ
        slope_prior_weight: float = 1.0,  # λ
    ) -> None:
        if prior_decode_s <= 0.0 or not 0.0 < decay <= 1.0 or slope_prior_weight <= 0.0:
            raise ValueError("need prior_decode_s > 0, decay in (0, 1], slope_prior_weight > 0")
        if not 0.0 <= prior_verify_token_frac <= 1.0 or prior_draft_frac < 0.0:
            raise ValueError("need prior_verify_token_frac in [0, 1] and prior_draft_frac >= 0")
        self.prior_decode_s = prior_decode_s
        self.beta = prior_verify_token_frac
        self.kappa = prior_draft_frac
        self.slope_prior_weight = slope_prior_weight
        self._sums = {lane: _DecayedSums(decay) for lane in ("decode", "verify", "draft")}
        self._learned_slope: float | None = None
        self.num_observations = dict.fromkeys(LANES, 0)

    def observe(self, lane: str, seconds: float, num_seqs: int, num_tokens: int) -> None:
        """Record one lane step: ``num_seqs`` sequences, ``num_tokens`` query tokens in all
        (verify: Σ (L_i + 1); draft: Σ L_i). Steps with no sequences or tokens are ignored."""
        if lane not in LANES:
            raise ValueError(f"unknown lane {lane!r}; expected one of {LANES}")
        if seconds < 0.0 or num_seqs < 0 or num_tokens < 0:
            raise ValueError("seconds, num_seqs and num_tokens must be >= 0")
        if num_seqs == 0 or num_tokens == 0:
            return
        self.num_observations[lane] += 1
        if lane == "decode":
            self._sums[lane].add(num_seqs, seconds)
        elif lane == "draft":
            self._sums[lane].add(num_tokens, seconds)
        elif lane == "verify":
            self._sums[lane].add(num_tokens / num_seqs, seconds / num_seqs)
            _, b, s_xx = self._fit_verify()
            if s_xx >= self.slope_prior_weight:
                self._learned_slope = b

    def decode_cost(self) -> float:
        """d: seconds per sequence of a plain decode step."""
        s = self._sums["decode"]
        return s.y / s.x if s.w > 0.0 else self.prior_decode_s

    def draft_cost(self) -> float:
        """c: seconds per drafted token per sequence."""
        s = self._sums["draft"]
        return s.y / s.x if s.w > 0.0 else self.kappa * self.decode_cost()

    def verify_cost(self, draft_len: int) -> float:
        """a + b·(L + 1): seconds per sequence of verifying L drafts."""
        a, b = self.verify_line()
        return a + b * (draft_len + 1)

    def verify_line(self) -> tuple[float, float]:
        """(a, b), both clamped at 0 so that the verify cost never falls with L."""
        a, b, _ = self._fit_verify()
        return a, b

    def _fit_verify(self) -> tuple[float, float, float]:
        """(a, b, Σ w (x − x̄)²) of the ridge fit; the priors before any verify."""
        s = self._sums["verify"]
        if s.w == 0.0:
            d = self.decode_cost()
            return (1.0 - self.beta) * d, self.beta * d, 0.0
        x_mean, y_mean = s.x / s.w, s.y / s.w
        s_xx = max(0.0, s.xx - s.w * x_mean * x_mean)
        s_xy = s.xy - s.w * x_mean * y_mean  # Σ w (x − x̄)(y − ȳ)
        b0 = self._learned_slope
        if b0 is None:
            b0 = self.beta * y_mean / (1.0 - self.beta + self.beta * x_mean)
        lam = self.slope_prior_weight
        b = max(0.0, (s_xy + lam * b0) / (s_xx + lam))
        return max(0.0, y_mean - b * x_mean), b, s_xx

    def costs(self) -> StepCosts:
        a, b = self.verify_line()
        return StepCosts(self.decode_cost(), a, b, self.draft_cost())
