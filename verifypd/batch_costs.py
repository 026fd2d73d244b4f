"""Batch step costs for the goodput policy: the seconds of a target forward over a batch, of a
drafter step, of a drafter catching up on a context, and of a prefill chunk.

The *shape* of each cost (how it grows with rows and tokens) comes from the engine's start-up
measurement when there is one (``verifypd.costs.CostTable``, made by
``engine.calibrate.measure_costs``), else from a linear prior (a fixed part, the weights' read,
plus a part per token). Its *level* is refined online: every observed step updates an EWMA of
observed / predicted seconds: one level for target forwards (decode and uniform verify steps
share it: contention slows both alike), one for an eager mixed step relative to that, one for
the drafter and one for prefill. A shape measured on an idle GPU keeps its
proportions, while contention from other lanes (a prefill chunk on another stream) or a slower
host raises the level the policy plans with.

Step kinds: ``decode`` (one token per row, a graph), ``verify`` (1 + L tokens per row, uniform),
``mixed`` (rows of different lengths in one forward: eager), ``draft`` (one drafter step),
``prefill`` (prompt chunks). Pure Python; time is whatever the caller observed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

KINDS = ("decode", "verify", "mixed", "draft", "prefill")
_LEVEL_OF = {"decode": "target", "verify": "target", "mixed": "mixed", "draft": "draft",
             "prefill": "prefill"}  # fmt: skip


class CostShape(Protocol):
    """What the start-up measurement provides (``verifypd.costs.CostTable``)."""

    def target_time(self, rows: int, query_len: int) -> float | None: ...
    def prefill_time(self, tokens: int) -> float | None: ...
    def draft_time(self, rows: int) -> float | None: ...


@dataclass(frozen=True)
class LinearPrior:
    """The shape without a measurement: a forward costs ``fixed_s`` (reading the weights) plus
    ``token_s`` per query token; a drafter step ``draft_frac`` of a target step of as many rows."""

    fixed_s: float = 5e-3
    token_s: float = 2e-5
    draft_frac: float = 0.12

    def target_time(self, rows: int, query_len: int) -> float:
        return self.fixed_s + self.token_s * rows * max(query_len, 1)

    def prefill_time(self, tokens: int) -> float:
        return self.fixed_s + self.token_s * tokens

    def draft_time(self, rows: int) -> float:
        return self.draft_frac * self.target_time(rows, 1)


class BatchCostModel:
    """Predicts step seconds from a shape and online per-kind levels (observed / predicted)."""

    def __init__(
        self,
        shape: CostShape | None = None,
        weight: float = 0.2,  # EWMA weight of the newest observation in a level
        mixed_prior: float = 1.3,  # level of an eager mixed step before any was seen
    ) -> None:
        if not 0.0 < weight <= 1.0 or mixed_prior <= 0.0:
            raise ValueError("need weight in (0, 1] and mixed_prior > 0")
        self.prior = LinearPrior()
        self.shape = shape
        self.weight = weight
        self.level = {"target": 1.0, "mixed": mixed_prior, "draft": 1.0, "prefill": 1.0}
        self.num_observations = dict.fromkeys(KINDS, 0)

    @property
    def measured(self) -> bool:
        """Whether the costs have a measured shape (a start-up calibration), not the prior."""
        return self.shape is not None

    # ------------------------------------------------------------------ shape
    def _target(self, rows: int, query_len: int) -> float:
        t = self.shape.target_time(rows, query_len) if self.shape is not None else None
        return t if t is not None and t > 0.0 else self.prior.target_time(rows, query_len)

    def _draft(self, rows: int) -> float:
        t = self.shape.draft_time(rows) if self.shape is not None else None
        return t if t is not None and t > 0.0 else self.prior.draft_time(rows)

    def _prefill(self, tokens: int) -> float:
        t = self.shape.prefill_time(tokens) if self.shape is not None else None
        return t if t is not None and t > 0.0 else self.prior.prefill_time(tokens)

    def _shape_time(self, kind: str, rows: int, tokens: int) -> float:
        if kind == "draft":
            return self._draft(rows)
        if kind == "prefill":
            return self._prefill(tokens)
        return self._target(rows, math.ceil(tokens / max(rows, 1)))

    # ------------------------------------------------------------------ predictions
    def decode(self, rows: int) -> float:
        return 0.0 if rows <= 0 else self.level["target"] * self._target(rows, 1)

    def verify(self, rows: int, query_len: int) -> float:
        return 0.0 if rows <= 0 else self.level["target"] * self._target(rows, query_len)

    def mixed(self, rows: int, tokens: int) -> float:
        """Rows of different query lengths in one (eager) forward."""
        level = self.level["target"] * self.level["mixed"]
        return 0.0 if rows <= 0 else level * self._shape_time("mixed", rows, tokens)

    def draft(self, rows: int) -> float:
        return 0.0 if rows <= 0 else self.level["draft"] * self._draft(rows)

    def prefill(self, tokens: int) -> float:
        return 0.0 if tokens <= 0 else self.level["prefill"] * self._prefill(tokens)

    def catch_up(self, tokens: int) -> float:
        """A drafter feeding ``tokens`` of context at once: a prefill of the drafter, priced as
        the target's prefill scaled by the drafter/target ratio of a one-row step."""
        if tokens <= 0:
            return 0.0
        ratio = self._draft(1) / self._target(1, 1)
        return self.level["draft"] * ratio * self._prefill(tokens)

    def prefill_tokens_within(self, seconds: float, low: int, high: int) -> int:
        """The most prefill tokens in [low, high] predicted to run within ``seconds``."""
        if self.prefill(high) <= seconds:
            return high
        lo, hi = low, high  # prefill(lo) may exceed: low is the floor
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.prefill(mid) <= seconds else (lo, mid)
        return lo

    # ------------------------------------------------------------------ learning
    def observe(self, kind: str, seconds: float, rows: int, tokens: int) -> None:
        """One landed step of ``kind`` with ``rows`` sequences and ``tokens`` query tokens."""
        if kind not in KINDS:
            raise ValueError(f"unknown step kind {kind!r}; expected one of {KINDS}")
        if seconds <= 0.0 or rows <= 0 or tokens <= 0:
            return
        predicted = self._shape_time(kind, rows, tokens)
        if kind == "mixed":  # its level is relative to the target's
            predicted *= self.level["target"]
        # One outlier (a first step that warmed something up) moves a level by at most
        # weight * 3: the shape was measured, the level only corrects it.
        ratio = min(4.0, max(0.25, seconds / predicted))
        key = _LEVEL_OF[kind]
        self.level[key] += self.weight * (ratio - self.level[key])
        self.num_observations[kind] += 1

    def snapshot(self) -> dict[str, float]:
        return {f"level_{k}": round(v, 4) for k, v in self.level.items()}
