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
from dataclasses import dataclass, field


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


@dataclass
class TailBudget:
    """The credit of late tokens (None ``share``: no budget, every plan affordable)."""

    share: float | None
    window_tokens: int
    credit: float = field(init=False)  # starts full

    def __post_init__(self) -> None:
        if self.share is not None and not 0.0 <= self.share < 1.0:
            raise ValueError(f"tail budget share must be in [0, 1) or None, got {self.share!r}")
        if self.window_tokens < 1:
            raise ValueError(f"tail budget window must be >= 1 token, got {self.window_tokens!r}")
        self.credit = self.cap

    @property
    def cap(self) -> float:
        return math.inf if self.share is None else self.share * self.window_tokens

    def available(self) -> float:
        return math.inf if self.share is None else self.credit

    def spend(self, tokens: float, late: float) -> None:
        """One decision delivered ``tokens`` (expected), ``late`` of them late."""
        if self.share is not None:
            self.credit = min(self.cap, self.credit + self.share * tokens - late)
