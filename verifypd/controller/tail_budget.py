"""The ITL tail's budget: how many of the tokens the goodput policy delivers may come late.

A speculating round hands a request its tokens after the whole round: draft steps, then the
verify. When the first draft is rejected that is one token after about 1.2-1.6 plain steps (a
0.5B drafter beside a 7B target), and a plain row riding in the round waits as long for its one
token. Per-token ITL counts such a gap once per token delivered, so when more than 1 % of all
tokens come from such rounds the ITL p99 is a round's length, not a plain step's: speculation
made the tail worse even where it made the mean faster.

A token is **late** when it arrives more than ``ratio`` plain steps after the one before it.
``late_tokens`` gives a speculator's expected late tokens in one round; the policy spends a
credit (``TailBudget``) that grows by ``share`` per token delivered, and a plan whose late
tokens exceed the credit is not taken. So at most about ``share`` of all tokens are late
because of speculation, and the ITL p99 stays a plain step's as long as ``share`` is well under
1 %. A round no longer than ``ratio`` plain steps costs nothing: speculation that does not
stretch gaps is never limited. The credit holds at most ``share · window_tokens`` late tokens,
so a quiet spell does not bank a burst of slow rounds.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from verifypd.controller.signals import WindowPercentile


def late_tokens(alpha: float, draft_len: int, step_ratio: float) -> float:
    """Expected tokens of one speculator's round that arrive more than τ after the one before,
    where the round takes ``step_ratio`` · τ: the round's n tokens share its gap (each n-th of
    it), so they are late when n < step_ratio. With n − 1 accepted drafts of L, P(n) =
    α^(n−1)(1 − α) for n ≤ L and α^L for n = L + 1."""
    out = 0.0
    for n in range(1, draft_len + 2):
        if n >= step_ratio:
            break
        p = alpha ** (n - 1) * (1.0 - alpha) if n <= draft_len else alpha**draft_len
        out += n * p
    return out


class TailBudget:
    """The credit of late tokens (None ``share``: no budget, every plan affordable), and the
    bound a token is late beyond: ``ratio`` plain steps, or the ``quantile`` of the plain steps'
    own cadence against their prediction where that is longer (at light load a plain step that
    a prompt lands beside takes 1.3-1.5 predicted steps, and the ITL p99 without speculation
    is such a step: a round shorter than it does not move the p99)."""

    MIN_SAMPLES = 100  # plain steps timed before their quantile is read

    def __init__(
        self,
        share: float | None,
        window_tokens: int,
        ratio: float = 1.05,
        quantile: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if share is not None and not 0.0 <= share < 1.0:
            raise ValueError(f"tail budget share must be in [0, 1) or None, got {share!r}")
        if window_tokens < 1:
            raise ValueError(f"tail budget window must be >= 1 token, got {window_tokens!r}")
        self.share, self.window_tokens, self.ratio, self.quantile = (
            share, window_tokens, ratio, quantile,
        )  # fmt: skip
        self.credit = self.cap  # starts full
        self.plain = WindowPercentile(300.0, clock, max_samples=1024)

    @property
    def cap(self) -> float:
        return math.inf if self.share is None else self.share * self.window_tokens

    def available(self) -> float:
        return math.inf if self.share is None else self.credit

    def spend(self, tokens: float, late: float) -> None:
        """One decision delivered ``tokens`` (expected), ``late`` of them late."""
        if self.share is not None:
            self.credit = min(self.cap, self.credit + self.share * tokens - late)

    def observe_plain(self, ratio: float) -> None:
        """A plain step's cadence (the time to the next decision) over its prediction."""
        if self.share is not None and self.quantile is not None:
            self.plain.add(ratio)

    def bound_s(self, t0: float) -> float:
        """Seconds after the token before which a token is late, for a plain step of ``t0``."""
        ratio = self.ratio
        if self.quantile is not None and self.plain.count >= self.MIN_SAMPLES:
            ratio = max(ratio, self.plain.percentile(self.quantile) or ratio)
        return ratio * t0
