"""Batch step costs for the goodput policy: the seconds of a target forward over a batch, of a
drafter step, of a drafter catching up on a context, and of a prefill chunk.

The *shape* of each cost (how it grows with rows and tokens) comes from the engine's start-up
measurement when there is one (``verifypd.costs.CostTable``, made by
``engine.calibrate.measure_costs``), else from a linear prior (a fixed part, the weights' read,
plus a part per token). Its *level* is refined online: every observed step updates an EWMA of
observed / predicted seconds: one level for target forwards (decode and uniform verify steps
share it), one for an eager mixed step relative to that, one for the drafter and one for
prefill. A shape measured on an idle GPU keeps its
proportions, while a slower host raises the level the policy plans with.

**Contention.** A step that ran while prompt work was in flight on another stream (the
dispatcher says so: ``contended``) updates a level of its own, one per kind (decode, verify,
mixed, draft), and predictions asked for ``contended`` read those. Prompt chunks do not take
from every step alike: small kernels (the drafter's steps, a verify's extra tokens) may lose
more of the GPU to a prefill chunk than a plain decode step does, and a plan beside a prompt
step is judged on those costs. A kind with fewer than ``min_contended`` contended observations
reads its uncontended level. Contended observations never move the uncontended levels: those
describe the GPU to itself.

Step kinds: ``decode`` (one token per row, a graph), ``verify`` (1 + L tokens per row, uniform),
``mixed`` (rows of different lengths in one forward: eager), ``draft`` (one drafter step),
``prefill`` (prompt chunks). Pure Python; time is whatever the caller observed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

KINDS = ("decode", "verify", "mixed", "draft", "prefill")
CONTENDED_KINDS = ("decode", "verify", "mixed", "draft")  # prefill is the contender
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
        min_contended: int = 4,  # contended observations before a kind's contended level counts
    ) -> None:
        if not 0.0 < weight <= 1.0 or mixed_prior <= 0.0 or min_contended < 1:
            raise ValueError("need weight in (0, 1], mixed_prior > 0 and min_contended >= 1")
        self.prior = LinearPrior()
        self.shape = shape
        self.weight = weight
        self.min_contended = min_contended
        self.level = {"target": 1.0, "mixed": mixed_prior, "draft": 1.0, "prefill": 1.0}
        # kind -> observed / shape seconds of its steps beside prompt work (absolute: a mixed
        # step's is not relative to the target's)
        self.contended_level = dict.fromkeys(CONTENDED_KINDS, 1.0)
        self.num_observations = dict.fromkeys(KINDS, 0)
        self.num_contended = dict.fromkeys(CONTENDED_KINDS, 0)

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
    def level_of(self, kind: str, contended: bool = False) -> float:
        """The factor on ``kind``'s shape: its contended level once it has been observed
        ``min_contended`` times beside prompt work (when asked for), else the uncontended one."""
        if contended and self.num_contended.get(kind, 0) >= self.min_contended:
            return self.contended_level[kind]
        level = self.level[_LEVEL_OF[kind]]
        return level * self.level["target"] if kind == "mixed" else level

    def decode(self, rows: int, contended: bool = False) -> float:
        return 0.0 if rows <= 0 else self.level_of("decode", contended) * self._target(rows, 1)

    def verify(self, rows: int, query_len: int, contended: bool = False) -> float:
        level = self.level_of("verify", contended)
        return 0.0 if rows <= 0 else level * self._target(rows, query_len)

    def mixed(self, rows: int, tokens: int, contended: bool = False) -> float:
        """Rows of different query lengths in one (eager) forward."""
        level = self.level_of("mixed", contended)
        return 0.0 if rows <= 0 else level * self._shape_time("mixed", rows, tokens)

    def draft(self, rows: int, contended: bool = False) -> float:
        return 0.0 if rows <= 0 else self.level_of("draft", contended) * self._draft(rows)

    def prefill(self, tokens: int) -> float:
        return 0.0 if tokens <= 0 else self.level["prefill"] * self._prefill(tokens)

    def catch_up(self, tokens: int, contended: bool = False) -> float:
        """A drafter feeding ``tokens`` of context at once: a prefill of the drafter, priced as
        the target's prefill scaled by the drafter/target ratio of a one-row step."""
        if tokens <= 0:
            return 0.0
        ratio = self._draft(1) / self._target(1, 1)
        return self.level_of("draft", contended) * ratio * self._prefill(tokens)

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
    def observe(
        self, kind: str, seconds: float, rows: int, tokens: int, contended: bool = False
    ) -> None:
        """One landed step of ``kind`` with ``rows`` sequences and ``tokens`` query tokens;
        ``contended``: prompt work was in flight beside it (a prefill step's own time is
        always its uncontended kind)."""
        if kind not in KINDS:
            raise ValueError(f"unknown step kind {kind!r}; expected one of {KINDS}")
        if seconds <= 0.0 or rows <= 0 or tokens <= 0:
            return
        shape_s = self._shape_time(kind, rows, tokens)
        if contended and kind in CONTENDED_KINDS:
            self._observe_contended(kind, seconds / shape_s)
            return
        predicted = shape_s * self.level["target"] if kind == "mixed" else shape_s
        # One outlier (a first step that warmed something up) moves a level by at most
        # weight * 3: the shape was measured, the level only corrects it.
        ratio = min(4.0, max(0.25, seconds / predicted))
        key = _LEVEL_OF[kind]
        self.level[key] += self.weight * (ratio - self.level[key])
        self.num_observations[kind] += 1

    def _observe_contended(self, kind: str, ratio: float) -> None:
        """A contended level starts at the uncontended one and follows its own observations,
        each clamped to [0.25, 16] (wider than the uncontended clamp: on an H100 a prompt
        chunk beside a drafter step stretched it 3-5 times on average)."""
        if self.num_contended[kind] == 0:
            self.contended_level[kind] = self.level_of(kind)
        level = self.contended_level[kind]
        self.contended_level[kind] = level + self.weight * (min(16.0, max(0.25, ratio)) - level)
        self.num_contended[kind] += 1

    def snapshot(self) -> dict[str, float | None]:
        """The levels (a contended one None until it counts)."""
        levels: dict[str, float | None] = {f"level_{k}": round(v, 4) for k, v in self.level.items()}
        for k in CONTENDED_KINDS:
            counts = self.num_contended[k] >= self.min_contended
            levels[f"contended_{k}"] = round(self.contended_level[k], 4) if counts else None
        return levels
