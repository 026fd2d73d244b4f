"""Acceptance-aware feedback controller: per-request draft length L and drafter temperature.

Each ``step()`` reads the global signals once (verify-queue depth q, p95 decode-step latency
over a sliding window, fitted step costs) and updates every request's base draft length:

1. ``speculate=False`` → 0.  α̂ < ``accept_floor`` → 0 at once.
2. Pressure (q > ``verify_queue_high`` or p95 > ``p95_decode_target_s``) → L ← ⌊f·L⌋
   (multiplicative decrease, f = ``shrink_factor``), every step while it lasts.
3. Otherwise the model target L* = argmax_L G(L), G(L) = E[tokens | α̂, L] / cost(L), is
   compared with the current L with a relative margin m (``gain_margin``):
   G(L*) ≤ (1 + m)·G(L) → hold. L* < L → L ← L* once that held for ``shrink_dwell_steps``
   steps in a row. L* > L → L ← L + 1, but only with headroom (q ≤ ``verify_queue_low`` and
   p95 ≤ ``p95_grow_frac``·target or no samples yet) and once that held for
   ``grow_dwell_steps`` steps in a row.
4. Probe: a speculating request whose base L has been 0 for at least ``probe_every_steps``
   steps gets L = 1 for one step on every step whose number is a multiple of
   ``probe_every_steps`` (a clock shared by all requests), if there is headroom. Probes never
   change the base L; they only buy a fresh acceptance sample. The shared clock puts every
   parked request's probe into the same step: with three lanes a verify step costs a full
   target forward whatever its batch, so probes scattered over the steps would each add one.

A new request starts at the lower median base L of the live speculating requests (the
configured initial L when there are none), parked if they are all parked: a request arriving
while the others decode plainly would otherwise be a lone speculator whose verify step nobody
shares.

A request *parked* at 0 by the model (floor, model shrink, or a hold at 0) learns about α only
from probes, so there the grow dwell counts steps that brought a new acceptance sample: it
leaves 0 after ``grow_dwell_steps`` favourable probes in a row, not after one lucky probe
whose α̂ then stays frozen for many steps. (A request pushed to 0 by pressure regrows on the
step dwell: its α̂ is recent.)

The separate shrink/grow thresholds, the dwells and the margin are the hysteresis: with steady
inputs L settles and stays. Everything is a function of the inputs and the injected clock.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from verifypd.config import SpecConfig
from verifypd.controller.controller_config import ControllerConfig
from verifypd.controller.policy import (
    best_draft_len,
    drafter_temperature,
    shrink_draft_len,
    token_rates,
)
from verifypd.controller.signals import AcceptanceEstimate, StepCostModel, WindowPercentile

COUNTERS = ("grow", "shrink_queue", "shrink_latency", "shrink_model", "shrink_accept", "probe")


@dataclass(frozen=True)
class _Signals:
    """What one step reads once for all requests."""

    rates_of: Callable[[float], list[float]]  # α̂ -> [G(0), ..., G(L_max)]
    pressure: str | None  # "shrink_queue" | "shrink_latency" | None
    has_headroom: bool


@dataclass
class _RequestState:
    is_greedy: bool
    temperature: float  # the target's sampling temperature τ
    speculate: bool
    acceptance: AcceptanceEstimate
    draft_len: int  # base L, the controller's state (probes excluded)
    decision: int  # the last L handed out (probes included)
    drafter_temperature: float = 0.0
    reason: str = "new"
    grow_dwell: int = 0  # consecutive steps the grow condition held
    shrink_dwell: int = 0  # consecutive steps the model shrink condition held
    steps_at_zero: int = 0  # consecutive steps with base L = 0
    is_parked: bool = False  # at 0 because the model judged speculation not to pay
    seen_updates: int = 0  # acceptance.num_updates at the previous step


class DraftController:
    """Sets each live request's draft length and drafter temperature once per engine step.

    The engine reports what happened (``observe_*``), calls ``step()`` and reads the decisions.
    Observations for unknown (already removed) requests are ignored.
    """

    def __init__(
        self,
        config: ControllerConfig,
        clock: Callable[[], float] = time.monotonic,
        cost_model: StepCostModel | None = None,
    ) -> None:
        self.config = config
        self.clock = clock
        self.cost_model = cost_model if cost_model is not None else StepCostModel()
        self.decode_latency = WindowPercentile(config.p95_window_s, clock)
        self.verify_queue_depth = 0
        self.num_steps = 0
        self.counters = dict.fromkeys(COUNTERS, 0)
        self._requests: dict[int, _RequestState] = {}
        self._last_pressure: str | None = None
        self._last_headroom = True

    # -- requests ---------------------------------------------------------------------------

    def add_request(
        self, seq_id: int, greedy: bool, temperature: float, speculate: bool = True
    ) -> None:
        """Register a live request. Re-adding a known id (e.g. after preemption) updates its
        sampling settings and keeps its acceptance history and draft length."""
        st = self._requests.get(seq_id)
        if st is None:
            cfg = self.config
            acceptance = AcceptanceEstimate(cfg.ewma_alpha, cfg.initial_acceptance)
            L0, parked = self._initial_draft_len() if speculate else (0, False)
            st = _RequestState(greedy, temperature, speculate, acceptance, L0, L0)
            st.is_parked = parked
            self._requests[seq_id] = st
        st.is_greedy, st.temperature, st.speculate = greedy, temperature, speculate
        if not speculate:
            st.draft_len = st.decision = 0
        st.drafter_temperature = self._drafter_temperature(st)

    def _initial_draft_len(self) -> tuple[int, bool]:
        """(L, parked) of a new speculating request: the live speculators' lower median L."""
        peers = [st for st in self._requests.values() if st.speculate]
        if not peers:
            return self.config.initial_draft_len, False
        lens = sorted(st.draft_len for st in peers)
        median = lens[(len(lens) - 1) // 2]
        return median, median == 0 and all(st.is_parked for st in peers)

    def remove_request(self, seq_id: int) -> None:
        """Forget a request and all its state (unknown ids are ignored)."""
        self._requests.pop(seq_id, None)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._requests

    def __len__(self) -> int:
        return len(self._requests)

    # -- observations -----------------------------------------------------------------------

    def observe_acceptance(self, seq_id: int, num_drafted: int, num_accepted: int) -> None:
        """One verify outcome: ``num_accepted`` of ``num_drafted`` drafts kept."""
        st = self._requests.get(seq_id)
        if st is not None:
            st.acceptance.update(num_drafted, num_accepted)

    def observe_miss(self, seq_id: int) -> None:
        """Its proposer found nothing to draft where it was given L > 0 (``AcceptanceEstimate.
        missed``): its α̂ falls as after a round whose first draft is rejected."""
        st = self._requests.get(seq_id)
        if st is not None:
            st.acceptance.missed()

    def observe_step(
        self, lane: str, seconds: float, num_seqs: int, num_tokens: int, prompt: bool = False
    ) -> None:
        """One finished lane step (lane: decode | verify | prefill | draft | mixed). Decode and
        mixed (fused) steps feed the p95 decode latency, except a mixed step carrying a prompt
        chunk (``prompt``, the single lane's: its time is the chunk's, and the guard would stop
        speculation whenever prompts arrive); all feed the cost model."""
        self.cost_model.observe(lane, seconds, num_seqs, num_tokens)
        if lane == "decode" or (lane == "mixed" and not prompt):
            self.decode_latency.add(seconds)

    def observe_verify_queue(self, depth: int) -> None:
        """Current verify-lane queue depth (sequences waiting for verification)."""
        if depth < 0:
            raise ValueError("queue depth must be >= 0")
        self.verify_queue_depth = depth

    # -- decisions --------------------------------------------------------------------------

    def step(self) -> dict[int, int]:
        """Decide L for every live request (in insertion order) and return {seq_id: L}."""
        sig = self._read_signals()
        out = {}
        for seq_id, st in self._requests.items():
            out[seq_id] = self._decide(st, sig)
            st.drafter_temperature = self._drafter_temperature(st)
        self.num_steps += 1
        return out

    def draft_length(self, seq_id: int) -> int:
        """The L last handed out for this request (a probe included); the per-request getters
        raise KeyError for ids that are not live."""
        return self._requests[seq_id].decision

    def drafter_temperature(self, seq_id: int) -> float:
        return self._requests[seq_id].drafter_temperature

    def acceptance(self, seq_id: int) -> float:
        """α̂: the per-token acceptance estimate the decisions use."""
        return self._requests[seq_id].acceptance.value

    def decision_reason(self, seq_id: int) -> str:
        """Why the last decision: new | off | fixed | hold | no_headroom | grow_dwell | grow |
        shrink_dwell | shrink_model | shrink_queue | shrink_latency | accept_floor | probe."""
        return self._requests[seq_id].reason

    def snapshot(self) -> dict[str, Any]:
        """Plain-data view of the controller state and decision counters, for metrics."""
        reqs = list(self._requests.values())
        hist = [0] * (self.config.max_draft_len + 1)
        for st in reqs:
            hist[st.decision] += 1
        spec = [st for st in reqs if st.speculate]
        costs = self.cost_model.costs()
        return {
            "num_steps": self.num_steps,
            "num_requests": len(reqs),
            "verify_queue_depth": self.verify_queue_depth,
            "p95_decode_s": self.decode_latency.percentile(95.0),
            "num_decode_samples": self.decode_latency.count,
            "pressure": self._last_pressure,
            "has_headroom": self._last_headroom,
            "mean_draft_len": _mean([st.decision for st in reqs]),
            "draft_len_hist": hist,
            "mean_acceptance": _mean([st.acceptance.value for st in spec]),
            "mean_drafter_temperature": _mean([st.drafter_temperature for st in reqs]),
            "num_grow": self.counters["grow"],
            "num_shrink": sum(v for k, v in self.counters.items() if k.startswith("shrink")),
            **{f"num_{k}": v for k, v in self.counters.items() if k.startswith("shrink")},
            "num_probes": self.counters["probe"],
            "costs": dataclasses.asdict(costs),
        }

    # -- internals --------------------------------------------------------------------------

    def _read_signals(self) -> _Signals:
        cfg = self.config
        p95 = self.decode_latency.percentile(95.0)
        pressure = None
        if self.verify_queue_depth > cfg.verify_queue_high:
            pressure = "shrink_queue"
        elif p95 is not None and p95 > cfg.p95_decode_target_s:
            pressure = "shrink_latency"
        latency_ok = p95 is None or p95 <= cfg.p95_grow_frac * cfg.p95_decode_target_s
        queue_ok = self.verify_queue_depth <= cfg.verify_queue_low
        headroom = pressure is None and queue_ok and latency_ok
        self._last_pressure, self._last_headroom = pressure, headroom
        costs = self.cost_model.costs()
        return _Signals(lambda a: token_rates(a, costs, cfg.max_draft_len), pressure, headroom)

    def _decide(self, st: _RequestState, sig: _Signals) -> int:
        old = st.draft_len
        st.draft_len, st.reason = self._next_draft_len(st, sig)
        if st.reason != "grow_dwell":
            st.grow_dwell = 0
        if st.reason != "shrink_dwell":
            st.shrink_dwell = 0
        if st.draft_len > old:
            self.counters["grow"] += 1
        elif st.draft_len < old:
            kind = "shrink_accept" if st.reason == "accept_floor" else st.reason
            self.counters[kind] += 1
        if st.draft_len > 0:
            st.is_parked = False
        elif st.reason in ("hold", "accept_floor", "shrink_model"):
            st.is_parked = True
        st.seen_updates = st.acceptance.num_updates
        st.decision = self._maybe_probe(st, sig)
        return st.decision

    def _next_draft_len(self, st: _RequestState, sig: _Signals) -> tuple[int, str]:
        """The new base L and the rule that chose it (steps 1-3 of the module docstring)."""
        L = st.draft_len
        alpha = st.acceptance.value
        if not st.speculate:
            return 0, "off"
        if alpha < self.config.accept_floor:
            return 0, "accept_floor"
        if sig.pressure is not None:
            return shrink_draft_len(L, self.config.shrink_factor), sig.pressure
        rates = sig.rates_of(alpha)
        target = best_draft_len(rates)
        if rates[target] <= (1.0 + self.config.gain_margin) * rates[L]:
            return L, "hold"
        if target < L:
            st.shrink_dwell += 1
            if st.shrink_dwell < self.config.shrink_dwell_steps:
                return L, "shrink_dwell"
            return target, "shrink_model"
        if not sig.has_headroom:
            return L, "no_headroom"
        if st.is_parked and st.acceptance.num_updates == st.seen_updates:
            return L, "grow_dwell"  # parked: only a new (probe) sample advances the dwell
        st.grow_dwell += 1
        if st.grow_dwell < self.config.grow_dwell_steps:
            return L, "grow_dwell"
        return L + 1, "grow"

    def _maybe_probe(self, st: _RequestState, sig: _Signals) -> int:
        """Base L, or 1 on a scheduled probe step of a request parked at L = 0."""
        if st.draft_len > 0 or not st.speculate:
            st.steps_at_zero = 0
            return st.draft_len
        st.steps_at_zero += 1
        every = self.config.probe_every_steps
        if every and self.config.max_draft_len and sig.has_headroom:
            if st.steps_at_zero >= every and (self.num_steps + 1) % every == 0:
                self.counters["probe"] += 1
                st.reason = "probe"
                return 1
        return 0

    def _drafter_temperature(self, st: _RequestState) -> float:
        cfg = self.config
        return drafter_temperature(
            st.is_greedy,
            st.temperature,
            st.acceptance.value,
            cfg.drafter_temp_min_frac,
            cfg.drafter_temp_full_accept,
        )


class FixedController(DraftController):
    """Same API, no feedback: L = ``draft_len`` (default: the config's initial L) for every
    speculating request, 0 for ``speculate=False``; the drafter samples at the target's
    temperature (0 for greedy). Signals are still tracked so that metrics look the same."""

    def __init__(
        self,
        config: ControllerConfig,
        clock: Callable[[], float] = time.monotonic,
        draft_len: int | None = None,
    ) -> None:
        super().__init__(config, clock)
        self.fixed_draft_len = config.initial_draft_len if draft_len is None else draft_len
        if not 0 <= self.fixed_draft_len <= config.max_draft_len:
            raise ValueError("draft_len must be in [0, max_draft_len]")

    def add_request(
        self, seq_id: int, greedy: bool, temperature: float, speculate: bool = True
    ) -> None:
        super().add_request(seq_id, greedy, temperature, speculate)
        st = self._requests[seq_id]
        st.draft_len = st.decision = self.fixed_draft_len if speculate else 0

    def _decide(self, st: _RequestState, sig: _Signals) -> int:
        st.draft_len = st.decision = self.fixed_draft_len if st.speculate else 0
        st.reason = "fixed" if st.speculate else "off"
        return st.decision

    def _drafter_temperature(self, st: _RequestState) -> float:
        return 0.0 if st.is_greedy else max(0.0, st.temperature)


def build_controller(
    spec: SpecConfig, clock: Callable[[], float] = time.monotonic, **overrides: Any
) -> DraftController:
    """The engine's controller: ``DraftController`` (the per-request feedback loop) when
    ``spec.controller`` is on, else a ``FixedController`` at ``spec.initial_draft_len``. The
    goodput policy is built by ``verifypd.controller.goodput.build_policy``."""
    config = ControllerConfig.from_spec(spec, **overrides)
    return DraftController(config, clock) if spec.controller else FixedController(config, clock)


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None
