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
round, or one that may not speculate) waits at most (1 + ``rider_slack``)·t₀ for its one token.
So speculation is chosen only where it makes the batch faster and makes nobody's tokens much
slower than plain decoding would. A plan must also beat plain
decoding's tokens per second by ``gain_margin``. Candidate sets S are prefixes of the
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
from dataclasses import dataclass
from typing import Any

from verifypd.batch_costs import BatchCostModel
from verifypd.config import SpecConfig
from verifypd.controller.draft_controller import (
    ControllerConfig,
    DraftController,
    build_controller,
)
from verifypd.controller.policy import expected_tokens
from verifypd.controller.signals import AcceptanceEstimate

REASONS = (
    "speculate",  # a plan beat plain decoding and passed the guard
    "no_gain",  # no plan beat plain decoding by the margin within the guard
    "no_candidates",  # nobody eligible (speculate=False, parked, out of tokens, far behind)
    "latency_guard",  # measured p95 decode step above its target
    "prefill_pressure",  # a prompt waited past prefill_wait_guard_s
    "prefill_running",  # prompt work is in flight or queued (GoodputConfig.yield_to_prefill)
    "batch_too_large",  # more rows than the verify graphs hold
    "probe",  # a probe of parked requests was drafted
    "catch_up",  # a catch-up round: drafters far behind fed their context
)


@dataclass(frozen=True)
class GoodputConfig:
    latency_slack: float = 0.10  # ε of the latency guard
    gain_margin: float = 0.02  # a plan must beat plain tokens/s by this fraction
    accept_floor: float = 0.15  # population α below this: parked (drafted only in probes)
    max_catch_up: int = 64  # most tokens a drafter catches up on for one request per step
    probe_min_steps: int = 64  # first probe interval; doubles while probes find nothing
    probe_max_steps: int = 4096
    probe_alpha: float = 0.5  # α a probed request is planned with
    population_weight: float = 0.02  # EWMA weight of one verify in the population's α
    # The population's prior α (ControllerConfig.initial_acceptance) counts as this many
    # verifies, not as the EWMA's whole memory: a drafter that does not predict the traffic
    # parks the policy after a round or two of verifies instead of ~80 (each speculative step
    # of a drafter that accepts nothing is a slow step for its whole batch).
    population_prior_count: float = 4.0
    request_weight: float = 0.15  # EWMA weight of one verify in a request's α̂
    prefill_wait_guard_s: float | None = None  # None: no prefill-pressure rule
    max_spec_rows: int | None = None  # None: no row limit (no verify graphs, e.g. CPU)
    alpha_bucket: float = 0.05  # α̂ within one bucket enter the speculating set together
    # Plain rows of a fused step are padded to the verify width (one graph replay, the
    # engine's runner with CUDA graphs); False: a fused step with plain rows runs eager.
    padded_fused: bool = False
    # A drafter further behind than max_catch_up (a request fresh from its prefill) catches
    # up in a catch-up round: at most one every this many steps (arrivals batch into one
    # eager drafter forward), its one-off cost left out of the latency guard.
    catch_up_every_steps: int = 8
    # A first draft step that cannot replay a graph (some drafter more than
    # ``graph_catch_up`` tokens behind: after plain steps, or a catch-up) runs eager: mostly
    # host time.
    eager_draft_s: float = 4e-3
    # Most tokens a drafter may be behind and still start with a graph replay (the drafter's
    # largest catch-up graph, ``SpecConfig.catch_up_graphs``; 2 without them).
    graph_catch_up: int = 2
    # Most tokens a drafter may be behind and still catch up in chunk-graph replays
    # (``SpecConfig.catch_up_chunk``); 0 without them. Neither kind pays the eager one-off.
    # With chunk graphs, a drafter further behind (a long prompt) is not drafted for at all:
    # its eager catch-up is ~10 ms of host time that stalls every lane.
    chunk_catch_up: int = 0
    # No speculating step may take longer than this many plain steps (None: no cap). The
    # guard above bounds the expected time per token; this bounds the step itself, which is
    # the inter-token gap a request sees when its first draft is rejected (the ITL tail).
    max_step_ratio: float | None = None
    # One-off costs (catch-up, eager first step) count in a plan's tokens/s spread over this
    # many steps: an investment the following steps pay back. (With 8, on an H200 at 5 req/s
    # and up, long prompts' catch-ups never paid, every drafter fell far behind during plain
    # steps, and the policy stopped speculating for good.)
    amortize_steps: int = 32
    # Plain rows riding in a speculating step (a request waiting for its catch-up round, or
    # one that may not speculate) may wait up to (1 + rider_slack) plain steps.
    rider_slack: float = 0.25
    # Hysteresis: after a speculating step, keep speculating unless the plan falls below
    # plain decoding's tokens/s by this fraction (stopping makes the next resume eager).
    keep_margin: float = 0.02
    # A "no gain" verdict of the full plan search stands for up to this many steps while the
    # batch's candidates stay the same (rows, who, α̂ bucket, far/last/probe): the search reads
    # nothing else that changes in between but the costs' online levels. The search took
    # ~0.5 ms of host time per step at 24 rows on an H100 host (measured at c78e11c), which
    # a drafter that never paid cost every decode step. 1: search every step.
    no_gain_hold_steps: int = 8
    # No speculation while prompt work is in flight or queued: a prefill chunk on its own
    # stream shares the GPU with the decode round, and a round with drafts then stretches the
    # decode tail most (the ITL p99 where `off` won the sweep). ``SpecConfig.yield_to_prefill``
    # sets it for the engine (off by default: not measurably better yet).
    yield_to_prefill: bool = False
    # Rows waiting for their drafter's catch-up round (far behind, within reach of the catch-up
    # graphs) ride in a speculating step outside the rider bound: they speculate themselves
    # within ``catch_up_every_steps``. Without it, one fresh request keeps the whole batch
    # plain until its round (the uniform-0.8 sweeps: "no_gain" on most steps at 8+ req/s).
    waiting_riders_exempt: bool = False
    # Host time a speculative round pays and a plain decode step does not: with decode-ahead a
    # plain step is launched while the one before runs, while a drafting step needs its
    # tokens landed first (fold-back, planning, upload between GPU steps). Added to every
    # speculative plan's step time (value and guard). 0: not charged.
    round_overhead_s: float = 0.0
    # The ITL tail: a round whose first draft is rejected hands each of its requests one token
    # after the whole step, so the step itself is the inter-token gap in the tail. Among the
    # plans within this fraction of the best tokens/s, the one with the shortest step wins
    # (a shorter L, or fewer speculators); 0: the best tokens/s always.
    tail_tolerance: float = 0.0
    # Most context tokens one catch-up round feeds the drafters (the first far request is
    # always taken, so a long prompt is not starved): a round's catch-up runs on the decode
    # stream ahead of its drafts, and with chunk graphs it holds no host time but all of it is
    # GPU time every row of the step waits for (at 14 req/s on an H100, rounds that fed 15
    # prompts at once took 90-150 ms). The rest wait for the next round (counted as waiting
    # riders). None: no limit.
    catch_up_round_tokens: int | None = None
    # No catch-up round while prompt work is in flight or queued (``LoadSignals``): its
    # context feed then shares the GPU with a prompt step, and every row of the step waits
    # for both (the slowest tokens at 5 req/s on an H100 with chunk graphs: 90 ms steps).
    # The far requests wait, as riders, for a round with the GPU to itself.
    catch_up_yields_to_prefill: bool = False
    # A separate round's drafts run beside the plain rows' decode step (on the verify lane's
    # stream, ``SpecConfig.drafts_beside_decode``): its plain rows wait for decode(B - |S|)
    # only, and the rider bound reads that; the round's time is still charged in full.
    drafts_beside_decode: bool = False
    # With ``waiting_riders_exempt``: a row rides outside the rider bound for at most this many
    # decisions from when it began waiting for its drafter (None: as long as it waits). Then it
    # is a plain rider again, so others' rounds may not stretch its gaps past the bound until
    # its catch-up round: with uniform 0.8 at 11-14 req/s on an H100 the slowest TPOTs were
    # long prompts riding others' rounds at 15-21 ms a token while they waited.
    waiting_rider_max_steps: int | None = None
    # While prompt work is in flight or queued (``LoadSignals.prefill_running``), plans are
    # priced with the cost model's contended levels (``BatchCostModel.level_of``): what decode,
    # verify, mixed and draft steps measured beside prompt steps. A round beside a prompt chunk
    # is judged on what it costs there, not on the GPU to itself.
    contention_costs: bool = False

    def __post_init__(self) -> None:
        checks = [
            (self.latency_slack >= 0.0 and self.gain_margin >= 0.0, "slack, margin >= 0"),
            (0.0 <= self.accept_floor < 1.0, "accept_floor in [0, 1)"),
            (self.max_catch_up >= 2, "max_catch_up >= 2"),
            (1 <= self.probe_min_steps <= self.probe_max_steps, "1 <= probe min <= max"),
            (0.0 < self.probe_alpha < 1.0, "probe_alpha in (0, 1)"),
            (0.0 < self.population_weight <= 1.0, "population_weight in (0, 1]"),
            (self.population_prior_count > 0.0, "population_prior_count > 0"),
            (0.0 < self.request_weight <= 1.0, "request_weight in (0, 1]"),
            (0.0 < self.alpha_bucket <= 1.0, "alpha_bucket in (0, 1]"),
            (self.catch_up_every_steps >= 1, "catch_up_every_steps >= 1"),
            (self.eager_draft_s >= 0.0 and self.amortize_steps >= 1, "eager >= 0, amortize >= 1"),
            (0.0 <= self.keep_margin < 1.0, "keep_margin in [0, 1)"),
            (self.no_gain_hold_steps >= 1, "no_gain_hold_steps >= 1"),
            (self.round_overhead_s >= 0.0, "round_overhead_s >= 0"),
            (0.0 <= self.tail_tolerance < 1.0, "tail_tolerance in [0, 1)"),
            (self.rider_slack >= 0.0, "rider_slack >= 0"),
            (self.graph_catch_up >= 1 and self.chunk_catch_up >= 0, "catch-up reaches >= 0"),
            (self.max_step_ratio is None or self.max_step_ratio >= 1.0, "max_step_ratio >= 1"),
            (
                self.catch_up_round_tokens is None or self.catch_up_round_tokens >= 1,
                "catch_up_round_tokens >= 1",
            ),  # fmt: skip
            (
                self.waiting_rider_max_steps is None or self.waiting_rider_max_steps >= 1,
                "waiting_rider_max_steps >= 1",
            ),  # fmt: skip
        ]
        for ok, rule in checks:
            if not ok:
                raise ValueError(f"GoodputConfig: need {rule}")


@dataclass(frozen=True)
class SeqView:
    """What the policy sees of one decodable sequence this step."""

    seq_id: int
    drafter_behind: int = 1  # tokens the drafter must feed before drafting (1-2 when steady)
    tokens_left: int = 1 << 30  # tokens before max_tokens: drafts past it are thrown away
    # Its drafter is being fed its prompt behind the prefill (``follow_iter``): it decodes
    # plainly until that is done, and counts as waiting for its catch-up.
    drafter_busy: bool = False


@dataclass(frozen=True)
class LoadSignals:
    prefill_wait_s: float | None = None  # the oldest waiting prompt's wait; None: none waits
    prefill_running: bool = False  # a prefill step in flight, or prompts waiting for one


@dataclass
class BatchDecision:
    draft_lens: dict[int, int]  # seq_id -> L (0 = plain decode)
    fused: bool  # verify inside the decode step (one target forward)
    reason: str
    draft_len: int = 0  # the L of the speculating set
    predicted_step_s: float = 0.0
    predicted_tokens: float = 0.0
    plain_step_s: float = 0.0


@dataclass
class _Plan:
    value: float  # tokens per second
    step_s: float
    tokens: float
    k: int
    draft_len: int
    fused: bool


@dataclass
class _Candidate:
    seq_id: int
    alpha: float
    behind: int
    tokens_left: int
    probe: bool = False
    far: bool = False  # its drafter catches up beyond max_catch_up (a catch-up round)
    last: bool = False  # its last token: drafts are cut, and the guard does not apply


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
        self.num_fused = 0
        self.last: BatchDecision | None = None
        self._probe_interval = self.goodput.probe_min_steps
        self._next_probe = self.goodput.probe_min_steps
        self._probed: set[int] = set()  # seq ids drafted in the last probe, not yet verified
        self._next_catch_up = 0
        self._no_gain: tuple[tuple, int] | None = None  # (candidates' key, held until step)
        self.num_searches = 0  # full plan searches (the rest: blocked, no candidates, held)
        self._waiting = 0  # rows of the last batch waiting for a catch-up round
        # seq id -> the decision from which it has waited for its drafter (rows of the last
        # batch only: one that stops waiting starts afresh the next time)
        self._waiting_since: dict[int, int] = {}
        # Decode cadence: the time from one decision to the next against the prediction, for
        # speculating and plain steps (what a request waits between its decode steps).
        self.cadence = {k: [0, 0.0, 0.0] for k in ("spec", "plain")}  # steps, actual, predicted
        self._last_decision: tuple[float, str, float] | None = None

    # ------------------------------------------------------------------ requests, learning
    def add_request(
        self, seq_id: int, greedy: bool, temperature: float, speculate: bool = True
    ) -> None:
        known = seq_id in self._requests
        super().add_request(seq_id, greedy, temperature, speculate)
        if not known:  # starts at the population's acceptance
            st = self._requests[seq_id]
            w = self.goodput.request_weight
            st.acceptance = AcceptanceEstimate(w, self.population.value)
            st.drafter_temperature = self._drafter_temperature(st)

    def observe_acceptance(self, seq_id: int, num_drafted: int, num_accepted: int) -> None:
        super().observe_acceptance(seq_id, num_drafted, num_accepted)
        if seq_id in self._requests and num_drafted:
            self.population.update(num_drafted, num_accepted)
        if seq_id in self._probed:
            self._probed.discard(seq_id)
            found = num_accepted >= self.goodput.accept_floor * num_drafted and num_accepted
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
        self._record(decision, batch)
        self._time_cadence(decision, t0)
        return decision

    def _time_cadence(self, d: BatchDecision, t0: float) -> None:
        now = self.clock()
        if self._last_decision is not None:
            at, kind, predicted = self._last_decision
            if now - at < 10 * predicted:  # not an idle gap between requests
                c = self.cadence[kind]
                c[0], c[1], c[2] = c[0] + 1, c[1] + now - at, c[2] + predicted
        kind = "spec" if d.draft_len else "plain"
        self._last_decision = (now, kind, d.predicted_step_s if d.draft_len else t0)

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
        if held is not None and self.num_steps < held[1] and held[0] == self._key(batch, cands):
            return no_gain
        self.num_searches += 1
        speculating = self.last is not None and self.last.draft_len > 0
        bar = (1.0 - g.keep_margin) if speculating else (1.0 + g.gain_margin)
        best = self._best_plan(len(batch), cands, t0, bar * len(batch) / t0, contended)
        if best is None:
            self._no_gain = (self._key(batch, cands), self.num_steps + g.no_gain_hold_steps)
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
        return BatchDecision(lens, best.fused, reason, best.draft_len, best.step_s, best.tokens)

    def _key(self, batch: list[SeqView], cands: list[_Candidate]) -> tuple:
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

    def _candidates(self, batch: list[SeqView], load: LoadSignals) -> list[_Candidate]:
        """Requests that may speculate now, highest α̂ first (ties by seq id: deterministic).
        While the population is parked (its α below ``accept_floor``: the drafter does not
        predict this traffic) a request whose own α̂ is below the floor too only on a probe
        step, planned at ``probe_alpha``."""
        g = self.goodput
        parked = self.population.value < g.accept_floor
        probing = parked and self.num_steps >= self._next_probe and not self._probed
        catching_up = self.num_steps >= self._next_catch_up and not (
            g.catch_up_yields_to_prefill and load.prefill_running
        )
        out = []
        self._waiting = 0
        since, self._waiting_since = self._waiting_since, {}
        for v in batch:
            st = self._requests.get(v.seq_id)
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
                out.append(_Candidate(v.seq_id, 1.0, v.drafter_behind, v.tokens_left, last=True))
                continue
            alpha = st.acceptance.value
            if parked and alpha < g.accept_floor:  # only its own evidence, or a probe
                if not probing:
                    continue
                out.append(_Candidate(v.seq_id, g.probe_alpha, v.drafter_behind, v.tokens_left,
                                      probe=True))  # fmt: skip
                continue
            out.append(_Candidate(v.seq_id, alpha, v.drafter_behind, v.tokens_left, far=far))
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
        self, cands: list[_Candidate], since: dict[int, int]
    ) -> list[_Candidate]:
        """Far candidates past ``catch_up_round_tokens`` (in α̂ order, the first always in)
        wait for the next catch-up round, as waiting riders."""
        budget = self.goodput.catch_up_round_tokens
        if budget is None:
            return cands
        out, fed = [], 0
        for c in cands:
            if c.far and fed and fed + c.behind > budget:
                self._wait(c.seq_id, since)
                continue
            fed += c.behind if c.far else 0
            out.append(c)
        return out

    def _best_plan(
        self, rows: int, cands: list[_Candidate], t0: float, floor: float, contended: bool
    ) -> _Plan | None:
        """The plan over L = 1..L_max and the speculating sets S = the first k candidates, k at
        the ends of the α̂ buckets, with the most tokens per second (or, with
        ``tail_tolerance``, the shortest step among those close to it), if it beats ``floor``
        tokens per second (None: none does), every step priced ``contended`` or not. Work per
        step is O(buckets · L_max), not O(B · L_max): it runs on the host before every decode
        step."""
        g, c = self.goodput, contended
        limit = (1.0 + g.latency_slack) * t0
        cap = math.inf if g.max_step_ratio is None else g.max_step_ratio * t0
        exempt = self._waiting if g.waiting_riders_exempt else 0
        groups = _groups(cands, g.alpha_bucket, max(g.graph_catch_up, g.chunk_catch_up))
        best: _Plan | None = None
        # With a tail tolerance every plan is kept (the shortest close one wins); without, only
        # the best so far (the search runs on the host before decode steps).
        plans: list[_Plan] | None = [] if g.tail_tolerance else None
        # What a group's set costs whatever L: (one-off, one drafter step, steady catch-up),
        # priced once, not at every L.
        fixed = [
            (
                self.costs.catch_up(grp.far, c) + (g.eager_draft_s if grp.eager else 0),
                self.costs.draft(grp.end, c),
                self.costs.catch_up(grp.steady, c),
            )
            for grp in groups
        ]
        for L in range(1, self.config.max_draft_len + 1):
            tokens, least = float(rows), math.inf
            for grp, (one_off, draft_step_s, steady_s) in zip(groups, fixed, strict=True):
                k = grp.end
                tokens += grp.count * (expected_tokens(grp.mean_alpha, L) - 1.0) + grp.last_gain
                least = min(least, expected_tokens(grp.min_alpha, L))  # the slowest speculator
                draft_s = L * draft_step_s + steady_s
                bound = min(limit * least, cap)
                # plain rows wait for their one token: the whole step, or (drafts beside the
                # decode step) their own decode step
                riders = (1.0 + g.rider_slack) * t0 if k + exempt < rows else math.inf
                for fused, step_s in self._step_times(rows, k, L, draft_s, c):
                    step_s += g.round_overhead_s
                    value = tokens / (step_s + one_off / g.amortize_steps)
                    wait = step_s
                    if g.drafts_beside_decode and not fused:
                        wait = self.costs.decode(rows - k, c) + g.round_overhead_s
                    if step_s > bound or wait > riders or value <= floor:
                        continue
                    if plans is None and best is not None and value <= best.value:
                        continue  # the first of equals stays: deterministic
                    plan = _Plan(value, step_s + one_off, tokens, k, L, fused)
                    if best is None or value > best.value:
                        best = plan
                    if plans is not None:
                        plans.append(plan)
        if not plans or best is None:
            return best
        close = (p for p in plans if p.value >= (1.0 - g.tail_tolerance) * best.value)
        return min(close, key=lambda p: (p.step_s, -p.value))

    def _step_times(
        self, rows: int, k: int, L: int, draft_s: float, contended: bool
    ) -> list[tuple[bool, float]]:
        """(fused, seconds) of one round: the fused step and the separate decode + verify."""
        c, busy = self.costs, contended
        uniform = k == rows or self.goodput.padded_fused
        fwd = c.verify(rows, 1 + L, busy) if uniform else c.mixed(rows, rows + k * L, busy)
        separate = draft_s + c.decode(rows - k, busy) + c.verify(k, 1 + L, busy)
        return [(True, draft_s + fwd), (False, separate)]

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
                "fused_fraction": self.num_fused / self.num_steps if self.num_steps else None,
                "last_reason": d.reason if d else None,
                "last_fused": d.fused if d else None,
                "last_draft_len": d.draft_len if d else None,
                "predicted_step_s": d.predicted_step_s if d else None,
                "plain_step_s": d.plain_step_s if d else None,
                "probe_interval": self._probe_interval,
                "cost_levels": levels,
                # the same as scalars (benchmark timelines keep scalars only)
                **{f"cost_{k}": v for k, v in levels.items()},
                **{
                    f"cadence_{k}_{name}": (v[i] / v[0] if i else v[0]) if v[0] else None
                    for k, v in self.cadence.items()
                    for i, name in enumerate(("steps", "s", "predicted_s"))
                },
            }
        )
        return snap


@dataclass
class _Group:
    """Candidates [.., end) up to one α̂ bucket, with the totals of everything before it."""

    end: int  # k: the set size when this group is the last one in
    count: int = 0  # speculating rows of this group (not on their last token)
    mean_alpha: float = 0.0
    min_alpha: float = 1.0
    last_gain: float = 0.0  # rows on their last token yield nothing more
    steady: int = 0  # cumulative: catch-up tokens of steady drafters (beyond two)
    far: int = 0  # cumulative: context tokens of drafters in a catch-up round
    eager: bool = False  # cumulative: some drafter further behind than its graphs reach


def _groups(cands: list[_Candidate], bucket: float, graph_catch_up: int) -> list[_Group]:
    """Runs of candidates in one α̂ bucket (they enter the speculating set together); a group
    is ``eager`` once some drafter in or before it is more than ``graph_catch_up`` behind."""
    out: list[_Group] = []
    steady = far = 0
    eager = False
    alphas: list[float] = []
    for i, c in enumerate(cands):
        steady += 0 if c.far else max(0, c.behind - 2)
        far += c.behind if c.far else 0
        eager = eager or c.behind > graph_catch_up
        if not c.last:
            alphas.append(c.alpha)
        nxt = cands[i + 1] if i + 1 < len(cands) else None
        if nxt is not None and not nxt.last and not c.last:
            if math.floor(c.alpha / bucket) == math.floor(nxt.alpha / bucket):
                continue
        if nxt is not None and nxt.last and c.last:
            continue
        grp = _Group(i + 1, len(alphas), steady=steady, far=far, eager=eager)
        if alphas:
            grp.mean_alpha, grp.min_alpha = sum(alphas) / len(alphas), min(alphas)
        out.append(grp)
        alphas = []
    return out


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
