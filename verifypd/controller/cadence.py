"""The decode cadence the goodput policy sees: the time from one decision to the next against
what it predicted, for speculative rounds and plain steps (what a request waits between its
decode steps, prompt steps beside them and the host included)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class Cadence:
    """Running totals per kind (``"spec"``, ``"plain"``: steps, seconds, predicted seconds),
    and two EWMAs (weight ``EWMA``) the TPOT target reads: ``plain_seen_s``, the gap from a
    plain decision to the next, and ``round_seen_ratio``, a round's gap over its prediction.
    None until one is seen. A gap over ten predictions is an idle one between requests."""

    EWMA = 0.1

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.totals = {k: [0, 0.0, 0.0] for k in ("spec", "plain")}
        self.plain_seen_s: float | None = None
        self.round_seen_ratio: float | None = None
        self._last: tuple[float, str, float] | None = None  # (at, kind, predicted)

    def decided(self, speculative: bool, predicted_s: float) -> None:
        """A decision now, whose step is predicted to take ``predicted_s``."""
        now = self.clock()
        if self._last is not None:
            at, kind, predicted = self._last
            gap = now - at
            if gap < 10 * predicted:
                c = self.totals[kind]
                c[0], c[1], c[2] = c[0] + 1, c[1] + gap, c[2] + predicted
                if kind == "plain":
                    self.plain_seen_s = self._ewma(self.plain_seen_s, gap)
                else:
                    self.round_seen_ratio = self._ewma(self.round_seen_ratio, gap / predicted)
        self._last = (now, "spec" if speculative else "plain", predicted_s)

    def _ewma(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.EWMA * (new - old)

    def snapshot(self) -> dict[str, Any]:
        """The EWMAs, and per kind the steps and mean seconds, actual and predicted."""
        out: dict[str, Any] = {
            "plain_seen_s": self.plain_seen_s,
            "round_seen_ratio": self.round_seen_ratio,
        }
        for k, v in self.totals.items():
            for i, name in enumerate(("steps", "s", "predicted_s")):
                out[f"cadence_{k}_{name}"] = (v[i] / v[0] if i else v[0]) if v[0] else None
        return out
