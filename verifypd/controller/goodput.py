"""The load-aware speculation policy: per step, for the whole decode batch, who speculates, with
what draft length L (0 included), and whether the verify is fused into the decode step.

Each step the engine hands over the decodable sequences (``SeqView``: context, how far the
drafter is behind, tokens left) and the load (``LoadSignals``). With α̂ᵢ each request's
acceptance estimate, E(α, L) = (1 − α^(L+1)) / (1 − α) the tokens one verify yields, and the
step costs predicted by ``BatchCostModel`` (measured at start-up, refined online):

    plain step       t₀ = decode(B)                          → B tokens
    speculate S, L   fused:    draft + verify/mixed(B rows, B + |S|·L tokens)
                     separate: draft + decode(B − |S|) + verify(|S|, 1 + L)
                     draft = L · draft(|S|) + catch_up(tokens the drafter is behind)
                                                             → B − |S| + Σ_{i∈S} E(α̂ᵢ, L) tokens

It picks the plan with the most tokens per second, among the plans that pass the **latency
guard**: no speculating request's expected time per token, step / E(α̂ᵢ, L), may exceed
(1 + ε)·t₀, and a plain request riding in the step (one waiting for its drafter's catch-up
round, or one that may not speculate) waits at most (1 + ``rider_slack``)·t₀ for its one token
(with a TPOT target Y, ``tpot_target_s``, neither bound while t₀ > Y: all miss Y when plain).
So speculation is chosen only where it makes the batch faster and makes nobody's tokens much
slower than plain decoding would. A plan must also beat plain
decoding's tokens per second by ``gain_margin``. With ``tpot_objective`` (and a target) plans
are ranked first by the share of rows whose time per token meets Y, then by tokens per second
(``tpot_goal.TargetGoal``); with ``tpot_deadlines`` each row's Y is what its request has left
(``SeqView.tpot_need_s``). Candidate sets S are prefixes of the
eligible requests sorted by α̂ (requests with α̂ bucketed alike enter together).

No speculation at all when the measured p95 decode step is above its target, when a prompt has
waited for its prefill past ``prefill_wait_guard_s``, or when the batch is larger than the
verify graphs (``max_spec_rows``).

**Zero cost when speculation does not pay.** Every verify updates the population's acceptance
(an EWMA over all requests whose prior counts as ``population_prior_count`` verifies; a new
request's α̂ starts there). When it falls below
``accept_floor`` the drafter does not predict this traffic and the policy is *parked*: only
requests whose own α̂ is above the floor are drafted for, the others only in probes, which are
global, back off exponentially (every ``probe_min_steps`` steps, doubling to
``probe_max_steps`` while they find nothing, reset when one finds acceptance), take only
requests whose drafter catch-up is short, and must pass the guard too. The drafter follows a
request's prefill (``expects_speculation``) only while the policy is not parked; otherwise it
catches up on a context only when the policy drafts for it.

A request on its last token rides along with the speculating set (its drafts are cut) and is
left out of the guard.

Deterministic given its inputs and the injected clock; every decision carries its reason
(``BatchDecision.reason``, counted in ``decisions`` and exported as
``verifypd_spec_policy_decisions_total{decision}``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

from verifypd.batch_costs import BatchCostModel
from verifypd.config import SpecConfig
from verifypd.controller.cadence import Cadence
from verifypd.controller.decisions import REASONS, BatchDecision, HeldVerdict, LoadSignals, SeqView
from verifypd.controller.draft_controller import ControllerConfig, DraftController, build_controller
from verifypd.controller.goodput_config import GoodputConfig
from verifypd.controller.plan_search import Candidate, PlanSearch, Tail, split_by_round_budget
from verifypd.controller.signals import AcceptanceEstimate
from verifypd.controller.tail_budget import TailBudget


class GoodputPolicy(DraftController):
    """Batch-level speculation decisions by expected goodput under a per-request latency
    guard. Keeps ``DraftController``'s request registry, acceptance estimates and drafter
    temperatures; decides with ``decide`` (``step`` decides for every registered request)."""

    def __init__(
        self,
        config: ControllerConfig,
        goodput: GoodputConfig | None = None,
        costs: BatchCostModel | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(config, clock)
        self.goodput = goodput or GoodputConfig()
        self.costs = costs if costs is not None else BatchCostModel()
        self.population = AcceptanceEstimate(self.goodput.population_weight,
                                             config.initial_acceptance,
                                             self.goodput.population_prior_count)  # fmt: skip
        self.decisions = dict.fromkeys(REASONS, 0)
        self.tail = TailBudget(self.goodput.tail_budget, self.goodput.tail_window_tokens)
        self.num_fused = 0
        self.last: BatchDecision | None = None
        self._probe_interval = self.goodput.probe_min_steps
        self._next_probe = self.goodput.probe_min_steps
        self._probed: set[int] = set()  # seq ids drafted in the last probe, not yet verified
        self._last_spec_step = 0  # the last decision that drafted
        self._exploring = False  # this step probes while stale (``_candidates``)
        self._next_catch_up = 0
        self._no_gain: HeldVerdict | None = None
        self.num_searches = 0  # full plan searches (the rest: blocked, no candidates, held)
        self._waiting = 0  # rows of the last batch waiting for a catch-up round
        # seq id -> the decision from which it has waited for its drafter (rows of the last
        # batch only: one that stops waiting starts afresh the next time)
        self._waiting_since: dict[int, int] = {}
        # the gaps between decisions against their predictions (plain_seen_s read against
        # the TPOT target with ``tpot_target_measured``; round_seen_ratio exported only)
        self.cadence = Cadence(self.clock)

    # ------------------------------------------------------------------ requests, learning
    def add_request(
        self, seq_id: int, greedy: bool, temperature: float, speculate: bool = True
    ) -> None:
        known = seq_id in self._requests
        super().add_request(seq_id, greedy, temperature, speculate)
        if not known:  # starts at the population's acceptance
            st = self._requests[seq_id]
            g = self.goodput
            st.acceptance = AcceptanceEstimate(g.request_weight, self.population.value,
                                               g.request_prior_count)  # fmt: skip
            st.drafter_temperature = self._drafter_temperature(st)

    def observe_acceptance(self, seq_id: int, num_drafted: int, num_accepted: int) -> None:
        super().observe_acceptance(seq_id, num_drafted, num_accepted)
        if seq_id in self._requests and num_drafted:
            self.population.update(num_drafted, num_accepted)
        found = num_accepted >= self.goodput.accept_floor * num_drafted and num_accepted
        self._probe_answered(seq_id, bool(found))

    def observe_miss(self, seq_id: int) -> None:
        """A lookup without a match (``DraftController.observe_miss``) counts for the
        population too, and a probe that found nothing to draft found no acceptance."""
        super().observe_miss(seq_id)
        if seq_id in self._requests:
            self.population.missed()
        self._probe_answered(seq_id, False)

    def _probe_answered(self, seq_id: int, found: bool) -> None:
        """A probed request's verify (or miss) came back: the probe interval resets where it
        found acceptance and doubles, up to ``probe_max_steps``, where it did not."""
        if seq_id not in self._probed:
            return
        self._probed.discard(seq_id)
        g = self.goodput
        self._probe_interval = (
            g.probe_min_steps if found else min(2 * self._probe_interval, g.probe_max_steps)
        )

    def expects_speculation(self, seq_id: int) -> bool:
        """Whether the drafter should follow this request's prefill: it may speculate and the
        population is not parked."""
        st = self._requests.get(seq_id)
        parked = self.population.value < self.goodput.accept_floor
        return st is not None and st.speculate and not parked

    def expects_drafting(self, seq_id: int) -> bool:
        """Whether the drafter should catch up behind this request's plain decode steps
        (``SpecConfig.follow_decode_max_rows``): it expects speculation
        (``expects_speculation``) and its own α̂ is at least ``follow_min_alpha``."""
        st = self._requests.get(seq_id)
        if st is None or not self.expects_speculation(seq_id):
            return False
        return st.acceptance.value >= self.goodput.follow_min_alpha

    # ------------------------------------------------------------------ decisions
    def step(self) -> dict[int, int]:
        """``decide`` for every registered request, all caught up (tests, the old API)."""
        return self.decide([SeqView(sid) for sid in self._requests]).draft_lens

    def decide(self, batch: list[SeqView], load: LoadSignals | None = None) -> BatchDecision:
        load = load or LoadSignals()
        self.num_steps += 1
        contended = self.goodput.contention_costs and load.prefill_running
        t0 = self.costs.decode(len(batch), contended)
        decision = self._decide(batch, load, t0, contended)
        decision.plain_step_s = t0
        if decision.draft_len:
            self._last_spec_step = self.num_steps
            self.tail.spend(decision.predicted_tokens, decision.late_tokens)
        else:
            self.tail.spend(len(batch), 0.0)
        self._record(decision, batch)
        self.cadence.decided(bool(decision.draft_len),
                             decision.predicted_step_s if decision.draft_len else t0)  # fmt: skip
        return decision

    def _decide(
        self, batch: list[SeqView], load: LoadSignals, t0: float, contended: bool
    ) -> BatchDecision:
        off = {v.seq_id: 0 for v in batch}
        g = self.goodput
        rule = self._blocking_rule(len(batch), load)
        if rule is not None:
            return BatchDecision(off, False, rule)
        cands = self._candidates(batch, load)
        if not cands:
            return BatchDecision(off, False, "no_candidates")
        no_gain = BatchDecision(off, False, "no_gain", predicted_step_s=t0,
                                predicted_tokens=float(len(batch)))  # fmt: skip
        held = self._no_gain
        if held is not None and self.num_steps < held.until and held.key == self._key(batch, cands):
            if held.reason == "no_gain" or self.tail.available() < held.needed:
                no_gain.reason = held.reason
                return no_gain
        self.num_searches += 1
        speculating = self.last is not None and self.last.draft_len > 0
        bar = (1.0 - g.keep_margin) if speculating else (1.0 + g.gain_margin)
        floor, outside = bar * len(batch) / t0, 0
        if self._exploring and any(c.probe for c in cands):
            # a stale probe explores: its requests only, any plan within the guard; rows at
            # their last token ride outside it, as always
            outside = sum(c.last for c in cands)
            cands, floor = [c for c in cands if c.probe], 0.0
        search = PlanSearch(g, self.costs, self.config.max_draft_len, contended)
        tail = None
        if self.tail.share is not None:
            tail = Tail(g.tail_ratio * t0, len(batch), self.tail.available())
        seen = self.cadence.plain_seen_s if g.tpot_target_measured else None
        seen = t0 if seen is None else max(t0, seen)
        needs = None
        if g.tpot_deadlines and g.tpot_target_s is not None:
            y = g.tpot_target_s
            needs = {v.seq_id: y if v.tpot_need_s is None else v.tpot_need_s for v in batch}
        best = search.best(len(batch), cands, t0, floor, self._waiting, outside, tail, seen,
                           needs)  # fmt: skip
        if best is None:
            if tail is not None and tail.refused:
                no_gain.reason = "tail_budget"
            until = self.num_steps + g.no_gain_hold_steps
            needed = tail.least_refused if tail is not None else math.inf
            self._no_gain = HeldVerdict(self._key(batch, cands), until, no_gain.reason, needed)
            return no_gain
        self._no_gain = None
        chosen = cands[: best.k]
        lens = dict(off)
        for c in chosen:
            lens[c.seq_id] = best.draft_len
        probes = {c.seq_id for c in chosen if c.probe}
        if probes:
            self._probed |= probes
            self._next_probe = self.num_steps + self._probe_interval
        reason = "probe" if probes and len(probes) == len(chosen) else "speculate"
        if any(c.far for c in chosen):
            self._next_catch_up = self.num_steps + g.catch_up_every_steps
            reason = "catch_up"
        return BatchDecision(lens, best.fused, reason, best.draft_len, best.step_s, best.tokens,
                             late_tokens=best.late)  # fmt: skip

    def _key(self, batch: list[SeqView], cands: list[Candidate]) -> tuple:
        """What a "no gain" verdict depends on besides the costs' levels (built only while a
        verdict is held or being stored, not on the steps that speculate)."""
        bucket = self.goodput.alpha_bucket
        rows = ((c.seq_id, int(c.alpha / bucket), c.far, c.last, c.probe) for c in cands)
        return (len(batch), self._waiting, *rows)

    def _blocking_rule(self, rows: int, load: LoadSignals) -> str | None:
        g = self.goodput
        p95 = self.decode_latency.percentile(95.0)
        if p95 is not None and p95 > self.config.p95_decode_target_s:
            return "latency_guard"
        guard = g.prefill_wait_guard_s
        if guard is not None and load.prefill_wait_s is not None and load.prefill_wait_s > guard:
            return "prefill_pressure"
        if g.yield_to_prefill and load.prefill_running:
            return "prefill_running"
        if g.max_spec_rows is not None and rows > g.max_spec_rows:
            return "batch_too_large"
        return None

    def _candidates(self, batch: list[SeqView], load: LoadSignals) -> list[Candidate]:
        """Requests that may speculate now, highest α̂ first (ties by seq id: deterministic).
        While the population is parked (its α below ``accept_floor``: the drafter does not
        predict this traffic) a request whose own α̂ is below the floor too only on a probe
        step, planned at ``probe_alpha``. While it is not parked but nothing has drafted for
        a probe interval (``stale``: a prior below what pays holds every new request back,
        and without drafts nothing moves it), a request with no verify of its own is planned
        at ``probe_alpha`` on a probe step (``GoodputConfig.probe_when_stale``)."""
        g = self.goodput
        parked = self.population.value < g.accept_floor
        stale = (
            g.probe_when_stale
            and not parked
            and self.num_steps - self._last_spec_step >= self._probe_interval
        )
        probing = (parked or stale) and self.num_steps >= self._next_probe and not self._probed
        self._exploring = stale and probing
        catching_up = self.num_steps >= self._next_catch_up and not (
            g.catch_up_yields_to_prefill and load.prefill_running
        )
        out = []
        self._waiting = 0
        since, self._waiting_since = self._waiting_since, {}
        for v in batch:
            st = self._requests.get(v.seq_id)
            if v.fresh and g.second_token_plain:
                continue  # decodes plainly, and rides inside the rider bound
            if v.drafter_busy:
                if st is not None and st.speculate:
                    self._wait(v.seq_id, since)
                continue
            far = v.drafter_behind > g.max_catch_up
            beyond = g.chunk_catch_up and v.drafter_behind > g.chunk_catch_up
            if st is None or not st.speculate or (far and not catching_up):
                if st is not None and st.speculate and far and not beyond:
                    self._wait(v.seq_id, since)
                continue
            if beyond:
                continue  # only an eager catch-up reaches it: not worth its host time
            if v.tokens_left < 2:  # its last token: it rides along, outside the guard
                out.append(Candidate(v.seq_id, 1.0, v.drafter_behind, v.tokens_left, last=True))
                continue
            alpha = st.acceptance.value
            if g.explore_alpha is not None and not parked and not st.acceptance.num_updates:
                alpha = max(alpha, g.explore_alpha)  # its first verify planned optimistically
            if self._exploring and not st.acceptance.num_updates and alpha < g.probe_alpha:
                out.append(Candidate(v.seq_id, g.probe_alpha, v.drafter_behind, v.tokens_left,
                                      probe=True, far=far))  # fmt: skip
                continue
            if parked and alpha < g.accept_floor:  # only its own evidence, or a probe
                if not probing:
                    continue
                out.append(Candidate(v.seq_id, g.probe_alpha, v.drafter_behind, v.tokens_left,
                                      probe=True, far=far))  # fmt: skip
                continue
            out.append(Candidate(v.seq_id, alpha, v.drafter_behind, v.tokens_left, far=far))
        if all(c.last for c in out):
            return []
        out.sort(key=lambda c: (c.last, -c.alpha, c.seq_id))
        return self._within_round_budget(out, since)

    def _wait(self, seq_id: int, since: dict[int, int]) -> None:
        """A row waits for its drafter (its catch-up round, or the forward behind its prompt):
        it counts among the rows outside the rider bound (``waiting_riders_exempt``) until it
        has waited ``waiting_rider_max_steps`` decisions."""
        start = self._waiting_since[seq_id] = since.get(seq_id, self.num_steps)
        limit = self.goodput.waiting_rider_max_steps
        self._waiting += int(limit is None or self.num_steps - start < limit)

    def _within_round_budget(
        self, cands: list[Candidate], since: dict[int, int]
    ) -> list[Candidate]:
        """Far candidates past ``catch_up_round_tokens`` (in α̂ order, the first always in)
        wait for the next catch-up round, as waiting riders."""
        taken, deferred = split_by_round_budget(cands, self.goodput.catch_up_round_tokens)
        for c in deferred:
            self._wait(c.seq_id, since)
        return taken

    def _record(self, d: BatchDecision, batch: list[SeqView]) -> None:
        self.decisions[d.reason] += 1
        self.num_fused += d.fused
        self.last = d
        for v in batch:
            st = self._requests.get(v.seq_id)
            if st is None:
                continue
            st.draft_len = st.decision = d.draft_lens.get(v.seq_id, 0)
            st.reason = d.reason if st.decision or d.reason != "speculate" else "not_chosen"
            if st.decision:  # read only where it drafts
                st.drafter_temperature = self._drafter_temperature(st)

    def snapshot(self) -> dict[str, Any]:
        snap = super().snapshot()
        d = self.last
        levels = self.costs.snapshot()
        snap.update(
            {
                "policy": "goodput",
                "population_acceptance": self.population.value,
                "decisions": dict(self.decisions),
                **{f"decisions_{k}": v for k, v in self.decisions.items()},
                "num_fused": self.num_fused,
                "fused_fraction": self.num_fused / self.num_steps if self.num_steps else None,
                "last_reason": d.reason if d else None,
                "last_fused": d.fused if d else None,
                "last_draft_len": d.draft_len if d else None,
                "predicted_step_s": d.predicted_step_s if d else None,
                "plain_step_s": d.plain_step_s if d else None,
                "probe_interval": self._probe_interval,
                "tail_credit": self.tail.available() if self.tail.share is not None else None,
                "cost_levels": levels,
                # the same as scalars (benchmark timelines keep scalars only)
                **{f"cost_{k}": v for k, v in levels.items()},
                **self.cadence.snapshot(),
            }
        )
        return snap


def build_policy(
    spec: SpecConfig,
    costs: BatchCostModel | None = None,
    goodput: GoodputConfig | None = None,
    clock: Callable[[], float] = time.monotonic,
    **overrides: Any,
) -> DraftController:
    """The engine's speculation policy from its ``SpecConfig``: the goodput policy
    (``controller`` on, ``policy="goodput"``), the feedback controller (``policy="feedback"``)
    or fixed L (``controller`` off)."""
    if spec.controller and spec.policy == "goodput":
        config = ControllerConfig.from_spec(spec, **overrides)
        return GoodputPolicy(config, goodput, costs, clock)
    return build_controller(spec, clock, **overrides)
