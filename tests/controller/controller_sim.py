"""Simulated time and a tiny simulated engine loop for the controller tests."""

from __future__ import annotations

from dataclasses import dataclass, field

from verifypd.controller import ControllerConfig, DraftController


class FakeClock:
    """Injected clock: time moves only when a test says so."""

    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


class PatternOracle:
    """Deterministic per-position acceptance: position i of the draft stream is accepted iff
    ``pattern[i % len(pattern)]``; a verify stops at the first rejection. Long-run α is the
    mean of the pattern, with no randomness (steady input)."""

    def __init__(self, pattern: list[int]) -> None:
        self.pattern = pattern
        self.pos = 0

    @property
    def alpha(self) -> float:
        return sum(self.pattern) / len(self.pattern)

    def verify(self, draft_len: int) -> int:
        """K accepted of ``draft_len`` drafts."""
        k = 0
        while k < draft_len:
            ok = self.pattern[self.pos % len(self.pattern)]
            self.pos += 1
            if not ok:
                break
            k += 1
        return k


@dataclass
class TrueCosts:
    """Per-sequence seconds the simulated GPU takes: d, a + b·(L + 1), c per drafted token."""

    d: float = 1e-3
    a: float = 0.9e-3
    b: float = 0.1e-3
    c: float = 0.1e-3

    def cost(self, draft_len: int) -> float:
        if draft_len == 0:
            return self.d
        return self.c * draft_len + self.a + self.b * (draft_len + 1)


@dataclass
class SimEngine:
    """Each step: report the queue depth, ``step()``, run one decode step (the latency
    ``decode_latency_s`` if set, else d), then draft + verify every speculating request at the
    true costs and report its acceptance; then advance the clock by ``dt``."""

    ctrl: DraftController
    clock: FakeClock
    oracles: dict[int, PatternOracle]
    costs: TrueCosts = field(default_factory=TrueCosts)
    queue_depth: int = 0
    decode_latency_s: float | None = None
    dt: float = 0.01
    history: list[dict[int, int]] = field(default_factory=list)
    reasons: list[dict[int, str]] = field(default_factory=list)

    def step(self) -> dict[int, int]:
        self.ctrl.observe_verify_queue(self.queue_depth)
        decisions = self.ctrl.step()
        self.history.append(decisions)
        self.reasons.append({s: self.ctrl.decision_reason(s) for s in decisions})
        latency = self.costs.d if self.decode_latency_s is None else self.decode_latency_s
        self.ctrl.observe_step("decode", latency, 1, 1)
        for seq_id, n in decisions.items():
            if n > 0 and seq_id in self.oracles:
                self._speculate(seq_id, n)
        self.clock.advance(self.dt)
        return decisions

    def warm_up_costs(self, max_draft_len: int) -> None:
        """Report one decode step and a draft + verify step at every L in [1, L_max] at the true
        costs, as mixed traffic would: the cost model then knows the verify slope."""
        self.ctrl.observe_step("decode", self.costs.d, 1, 1)
        for n in range(1, max_draft_len + 1):
            self._report_costs(n)

    def run(self, num_steps: int) -> list[int]:
        """Run and return the decisions of the first request over these steps."""
        first = next(iter(self.oracles))
        return [self.step()[first] for _ in range(num_steps)]

    def _report_costs(self, draft_len: int) -> None:
        c = self.costs
        self.ctrl.observe_step("draft", c.c * draft_len, 1, draft_len)
        self.ctrl.observe_step("verify", c.a + c.b * (draft_len + 1), 1, draft_len + 1)

    def _speculate(self, seq_id: int, draft_len: int) -> None:
        self._report_costs(draft_len)
        k = self.oracles[seq_id].verify(draft_len)
        self.ctrl.observe_acceptance(seq_id, draft_len, k)


def make_sim(
    pattern: list[int],
    costs: TrueCosts | None = None,
    num_requests: int = 1,
    warm: bool = True,
    **config: object,
) -> SimEngine:
    """A controller on a fake clock with ``num_requests`` sampled requests sharing ``pattern``;
    ``warm``: the cost model has seen every draft length once (see ``warm_up_costs``)."""

    clock = FakeClock()
    ctrl = DraftController(ControllerConfig(**config), clock)  # type: ignore[arg-type]
    oracles = {}
    for seq_id in range(num_requests):
        ctrl.add_request(seq_id, greedy=False, temperature=1.0)
        oracles[seq_id] = PatternOracle(pattern)
    sim = SimEngine(ctrl, clock, oracles, costs or TrueCosts())
    if warm:
        sim.warm_up_costs(ctrl.config.max_draft_len)
    return sim
