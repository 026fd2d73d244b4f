"""The feedback controller's knobs (``ControllerConfig``; the controller is
``verifypd.controller.draft_controller``, whose docstring gives the rules they set)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from verifypd.config import SpecConfig


@dataclass(frozen=True)
class ControllerConfig:
    max_draft_len: int = 4  # L_max
    initial_draft_len: int = 2  # L of a new request
    ewma_alpha: float = 0.3  # weight of the newest verify in α̂
    p95_decode_target_s: float = 0.05  # shrink above this p95 decode-step latency
    p95_window_s: float = 5.0  # sliding time window of that p95
    verify_queue_high: int = 8  # shrink when the verify queue is deeper than this
    verify_queue_low: int = 2  # grow only when it is at most this deep
    accept_floor: float = 0.1  # below this α̂, L goes to 0
    grow_dwell_steps: int = 3  # steps a grow condition must hold before each L += 1
    shrink_dwell_steps: int = 2  # steps a model shrink condition must hold before L ← L*
    probe_every_steps: int = 50  # probe L = 1 every this many steps at L = 0; 0 = never
    p95_grow_frac: float = 0.8  # grow only while p95 <= this fraction of the target
    shrink_factor: float = 0.5  # f in L ← ⌊f·L⌋ under pressure
    gain_margin: float = 0.03  # m: act on the model only when G(L*) > (1 + m)·G(L)
    initial_acceptance: float = 0.8  # α₀, the prior of α̂
    drafter_temp_min_frac: float = 0.25  # s_min: lowest drafter temperature, as a fraction of τ
    drafter_temp_full_accept: float = 0.8  # α_full: from this α̂ up the drafter samples at τ

    def __post_init__(self) -> None:
        checks = [
            (0 <= self.initial_draft_len <= self.max_draft_len, "0 <= initial <= max_draft_len"),
            (0.0 < self.ewma_alpha <= 1.0, "ewma_alpha in (0, 1]"),
            (self.p95_decode_target_s > 0.0 and self.p95_window_s > 0.0, "p95 target, window > 0"),
            (0 <= self.verify_queue_low <= self.verify_queue_high, "0 <= queue low <= high"),
            (0.0 <= self.accept_floor < 1.0, "accept_floor in [0, 1)"),
            (min(self.grow_dwell_steps, self.shrink_dwell_steps) >= 1, "dwell steps >= 1"),
            (self.probe_every_steps >= 0, "probe_every_steps >= 0"),
            (0.0 < self.p95_grow_frac <= 1.0, "p95_grow_frac in (0, 1]"),
            (0.0 <= self.shrink_factor < 1.0, "shrink_factor in [0, 1)"),
            (self.gain_margin >= 0.0, "gain_margin >= 0"),
            (0.0 <= self.initial_acceptance <= 1.0, "initial_acceptance in [0, 1]"),
            (0.0 <= self.drafter_temp_min_frac <= 1.0, "drafter_temp_min_frac in [0, 1]"),
            (0.0 < self.drafter_temp_full_accept <= 1.0, "drafter_temp_full_accept in (0, 1]"),
        ]
        for ok, rule in checks:
            if not ok:
                raise ValueError(f"ControllerConfig: need {rule}")

    @classmethod
    def from_spec(cls, spec: SpecConfig, **overrides: Any) -> ControllerConfig:
        """L_max and the initial L from the engine's ``SpecConfig``; the rest from overrides."""
        base = cls(max_draft_len=spec.max_draft_len, initial_draft_len=spec.initial_draft_len)
        return dataclasses.replace(base, **overrides)
