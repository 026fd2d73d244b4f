"""Decode steps spaced out beside a long prompt step (``EngineConfig.decode_gap_beside_prefill_s``).

While a prompt step of at least ``PACED_PROMPT_TOKENS`` tokens is in flight, a decode step is
launched no sooner than the gap after the last one, and none ahead of the one in flight: the
prompt step has the GPU in between. A gap of 0 (the default) launches them back to back.
"""

from __future__ import annotations

from collections.abc import Callable

from verifypd.lanes.lane_steps import InFlight

PACED_PROMPT_TOKENS = 1024  # a prompt step this long paces decode


class DecodePacing:
    """The dispatcher's pacing rule and the launch time of its last decode step."""

    def __init__(self, gap_s: float) -> None:
        self.gap_s = gap_s
        self.last_launch = float("-inf")

    def holds_ahead(self, in_flight: dict[str, InFlight]) -> bool:
        """Pacing is on and a long prompt step is in flight: no decode step ahead."""
        f = in_flight.get("prefill")
        if self.gap_s <= 0.0 or f is None:
            return False
        return sum(e.num_new_tokens for e in f.plan.seqs) >= PACED_PROMPT_TOKENS

    def paced(self, in_flight: dict[str, InFlight], clock: Callable[[], float]) -> bool:
        """The decode lane waits: beside a long prompt step, the last decode step was launched
        less than the gap ago (the clock is read only then)."""
        return self.holds_ahead(in_flight) and clock() - self.last_launch < self.gap_s
