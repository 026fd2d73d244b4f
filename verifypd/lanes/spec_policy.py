"""The speculation policy: everything that decides how to speculate, above the engine.

``SpeculationPolicy`` owns the controller (``verifypd.controller``: the goodput policy, the
feedback controller or fixed L) and makes every speculative decision the lane dispatcher hands
down to the engine: each request's draft length L and whether a round's verify is fused into
the decode step (``decide``: per-step data, a ``SpecDecision``), drafter temperatures,
whether to chain the next round's drafts behind a verify, and for whom the drafter follows a
prompt's prefill or catches up behind a plain decode step. It learns from what the engine
reports (``SpecListener``: requests coming and going, acceptance) and from what the dispatcher
times (each lane step, each drafting). The engine (``EngineCore``) executes: it drafts, chains
and launches when told to.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Generator
from contextlib import AbstractContextManager, nullcontext

from verifypd.config import SchedulerConfig, SpecConfig
from verifypd.controller import GoodputConfig, GoodputPolicy, LoadSignals, SeqView, build_policy
from verifypd.controller.tpot_goal import tpot_need_s
from verifypd.engine.core import EngineCore
from verifypd.engine.model import drain
from verifypd.engine.runner import PendingStep
from verifypd.engine.timing import Span
from verifypd.types import (
    NO_SPECULATION,
    ScheduledSeq,
    Sequence,
    SpecDecision,
    SpecListener,
    StepPlan,
)

logger = logging.getLogger("verifypd")


def goodput_config(core: EngineCore) -> GoodputConfig:
    """The goodput policy's limits from the engine's: no speculation for more rows than the
    verify graphs hold (an eager verify of a large batch costs more than it yields), none
    while a prompt has waited half its TTFT budget for its prefill, and how far behind a
    drafter may be while its first draft step still replays a graph."""
    graphs = core.use_cuda_graphs and core.spec.enabled
    return goodput_config_for(core.config.scheduler, core.config.spec, graphs, core.decode_ahead)


def tpot_need(target_s: float, seq: Sequence, now: float) -> float | None:
    """``tpot_need_s`` of ``seq`` at ``now`` (``time.monotonic``); None before its first
    token (the policy then holds it to the target itself)."""
    if seq.first_token_time is None:
        return None
    left = seq.params.max_tokens - seq.num_output_tokens
    return tpot_need_s(target_s, seq.num_output_tokens, left, now - seq.first_token_time)


def goodput_config_for(
    sched: SchedulerConfig, spec: SpecConfig, graphs: bool, decode_ahead: bool
) -> GoodputConfig:
    """``goodput_config`` from the configs and two facts of the engine (CUDA graphs with a
    drafter, decode-ahead): also what ``bench/policy_sim.py`` runs the policy with."""
    reach = max((2, *spec.catch_up_graphs)) if graphs else 2
    chunks = max(spec.chunk_sizes, default=0) * spec.catch_up_chunks + reach if graphs else 0
    return GoodputConfig(
        prefill_wait_guard_s=sched.ttft_budget_s / 2,
        max_spec_rows=min(sched.max_num_seqs, 64) if graphs else None,
        padded_fused=graphs,
        graph_catch_up=reach,
        chunk_catch_up=chunks if spec.chunk_sizes else 0,
        latency_slack=spec.guard_slack,
        rider_slack=spec.rider_slack,
        max_step_ratio=spec.max_step_ratio,
        yield_to_prefill=spec.yield_to_prefill,
        waiting_riders_exempt=spec.waiting_riders_exempt,
        waiting_rider_max_steps=spec.waiting_rider_max_steps,
        round_overhead_s=spec.round_overhead_s if decode_ahead else 0.0,
        tail_tolerance=spec.tail_tolerance,
        catch_up_round_tokens=spec.catch_up_round_tokens,
        catch_up_every_steps=spec.catch_up_every_steps,
        catch_up_yields_to_prefill=spec.catch_up_yields_to_prefill,
        drafts_beside_decode=spec.drafts_beside_decode,
        contention_costs=spec.contention_costs,
        second_token_plain=spec.second_token_plain,
        probe_when_stale=spec.probe_when_stale,
        amortize_within_request=spec.amortize_within_request,
        tail_budget=spec.tail_budget,
        tail_ratio=spec.tail_ratio,
        tpot_target_s=spec.tpot_target_s,
        tpot_target_measured=spec.tpot_target_measured,
        tpot_objective=spec.tpot_objective,
        tpot_deadlines=spec.tpot_deadlines,
        tpot_tokens_weight=spec.tpot_tokens_weight,
        tpot_unguarded=spec.tpot_unguarded,
        request_prior_count=spec.request_prior_count,
        explore_alpha=spec.explore_alpha,
    )


class SpeculationPolicy(SpecListener):
    """Decides draft lengths, drafter temperatures, fusing and chaining; learns costs and
    acceptance. One per engine: it attaches itself as the engine's listener."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.enabled = core.spec.enabled
        self.controller = build_policy(core.config.spec, core.costs, goodput_config(core))
        # Whether ``decide`` reads the prefill signal (GoodputConfig.yield_to_prefill,
        # catch_up_yields_to_prefill or contention_costs).
        g = self.controller.goodput if isinstance(self.controller, GoodputPolicy) else None
        self.reads_prompt_work = g is not None and (
            g.yield_to_prefill or g.catch_up_yields_to_prefill or g.contention_costs
        )
        # A separate round drafts on the verify lane's stream (SpecConfig.drafts_beside_decode).
        self.drafts_beside_decode = core.config.spec.drafts_beside_decode
        # A row's second token waits for no drafts (SpecConfig.second_token_plain): a decision
        # kept for the next step does not serve a batch a row joined since.
        self.second_token_plain = core.config.spec.second_token_plain
        # The drafter's catch-up behind decode steps runs on a stream of its own
        # (SpecConfig.follow_decode_stream "beside" or "below").
        self.feeds_beside = core.config.spec.feeds_beside_decode
        # a drafting not yet observed: (span, rows, tokens drafted, beside prompt work)
        self._draft_span: tuple[Span, int, int, bool] | None = None
        core.attach_listener(self)

    @classmethod
    def of(cls, core: EngineCore) -> SpeculationPolicy:
        """The policy attached to ``core``, or a new one attached now."""
        listener = core.listener
        return listener if isinstance(listener, SpeculationPolicy) else cls(core)

    # ------------------------------------------------------------------ engine reports
    def request_added(self, seq: Sequence) -> None:
        if self.enabled:
            p = seq.params
            self.controller.add_request(seq.seq_id, p.is_greedy, p.temperature, p.speculate)

    def request_removed(self, seq: Sequence) -> None:
        self.controller.remove_request(seq.seq_id)

    def accepted(self, seq: Sequence, num_drafted: int, num_accepted: int) -> None:
        self.controller.observe_acceptance(seq.seq_id, num_drafted, num_accepted)

    def no_drafts(self, seq: Sequence) -> None:
        self.controller.observe_miss(seq.seq_id)

    # ------------------------------------------------------------------ decisions
    def decide(
        self, prefill_running: bool = False, seqs: list[Sequence] | None = None
    ) -> SpecDecision:
        """This step's speculation decisions, as data (``SpecDecision``): each speculating
        sequence's L, and whether its verify is fused into the decode step. Nothing on the
        sequences changes; the scheduler and the drafter read the decision from the plan.
        ``prefill_running``: prompt work is in flight on another lane or queued for it.
        ``seqs``: the step's decode batch (default: the decodable sequences; a decode step
        planned ahead names its own, whose previous step is still in flight)."""
        if not self.enabled:
            return NO_SPECULATION
        start = time.perf_counter()
        if isinstance(self.controller, GoodputPolicy):
            lens, fused = self._decide_batch(prefill_running, seqs)
        else:
            lens, fused = self.controller.step(), False
        speculates = {s.seq_id for s in self.core.running if s.params.speculate}
        decision = SpecDecision(
            {sid: n for sid, n in lens.items() if n > 0 and sid in speculates}, fused
        )
        # One observation per step (not per sequence: at batch 24 that was ~0.1 ms of host
        # time a step, paid with speculation off too).
        self.core.observer.draft_length(decision.reserve)
        self.core.observer.policy_decide(time.perf_counter() - start)
        return decision

    def in_prompt_step(self, decision: SpecDecision, rows: list[Sequence]) -> SpecDecision:
        """A round riding in a prompt step (``EngineConfig.fuse_rounds_rows``): there every
        row of ``rows`` that may speculate drafts L_max under the goodput policy, whatever it
        decided for a decode step (its verify tokens are a few more in a compute-bound step;
        a row left plain gets one token a prompt step, and under load the batch then grows
        until the policy sees no gain anywhere). A fixed L stays as it is."""
        if not self.enabled or not isinstance(self.controller, GoodputPolicy):
            return decision
        top = self.core.config.spec.max_draft_len
        return SpecDecision({s.seq_id: top for s in rows if s.params.speculate})

    def _decide_batch(
        self, prefill_running: bool, seqs: list[Sequence] | None
    ) -> tuple[dict[int, int], bool]:
        """The goodput policy's decision for this step's decode batch."""
        spec = self.core.config.spec
        target = spec.tpot_target_s if spec.tpot_deadlines else None
        now = time.monotonic() if target is not None else 0.0
        views = [
            SeqView(
                seq.seq_id,
                self.core.drafter_behind(seq),
                seq.params.max_tokens - seq.num_output_tokens,
                self.core.drafter_busy(seq),
                seq.num_output_tokens == 1 and not seq.in_flight,  # its 2nd token next
                None if target is None else tpot_need(target, seq, now),
            )
            for seq in (self.core.decodable() if seqs is None else seqs)
        ]
        waiting = self.core.waiting
        wait = time.monotonic() - min(s.arrival_time for s in waiting) if waiting else None
        load = LoadSignals(prefill_wait_s=wait, prefill_running=prefill_running)
        decision = self.controller.decide(views, load)
        self.core.observer.spec_decision(decision.reason, decision.fused, decision.draft_len)
        return decision.draft_lens, decision.fused

    def drafter_temps(self, entries: list[ScheduledSeq]) -> dict[int, float]:
        temps = {
            e.seq.seq_id: self.controller.drafter_temperature(e.seq.seq_id)
            for e in entries
            if self.core.spec.wants(e)
        }
        if temps:  # exported as the mean over the drafting requests
            self.core.observer.drafter_temperature(sum(temps.values()) / len(temps))
        return temps

    def gap_is_idle(self, verify: StepPlan) -> bool:
        """Chaining fills the GPU's gap between a verify and the next round's drafting, which
        otherwise waits for the host. Where other work is queued (a prompt waiting for its
        prefill, sequences outside this verify) that gap is not idle, and a chain would take
        GPU time from that work: chain only when this verify holds every running sequence
        and no request waits."""
        if self.core.waiting:
            return False
        in_plan = {id(e.seq) for e in verify.seqs}
        return all(id(s) in in_plan for s in self.core.running)

    # ------------------------------------------------------------------ drafting
    def propose(self, entries: list[ScheduledSeq], contended: bool = False) -> None:
        """Drafts for the speculating entries; the controller learns the drafting cost (per
        drafted token) from steady proposals, as it learns decode and verify costs from steps
        (``contended``: a prompt step is in flight beside it).
        A draft model's proposal is timed on the GPU (it runs there after ``propose`` returns,
        and is observed once it has run); n-gram lookups by wall time. A proposal whose
        drafter first caught up on a whole prompt is left out: that one-off prefill would make
        drafting look several times dearer than it is."""
        self.observe_draft_cost()
        span = Span(self.core.drafts_on_device)
        drafted, steady = self.core.draft(entries, self.drafter_temps(entries))
        if drafted and steady:
            self._draft_span = (span.stop(), len(drafted), sum(drafted), contended)
        self.observe_draft_cost()

    def after_launch(
        self,
        plan: StepPlan,
        pending: PendingStep,
        beside: Callable[[], AbstractContextManager] = nullcontext,
    ) -> None:
        """What follows a launched step on its stream: the next round's drafts behind a verify
        (``chain_after``), the drafter's catch-up behind prompt chunks (``follow_prefill``)
        and behind a decode step's plain rows (``follow_decode``; in ``beside``, the feed
        stream's context, with ``SpecConfig.follow_decode_stream`` "beside" or "below")."""
        self.chain_after(plan, pending)
        self.follow_prefill(plan)
        with beside() if self.feeds_beside else nullcontext():
            self.follow_decode(plan)

    def follow_behind(self, plan: StepPlan, every: int) -> Generator[None, None, None] | None:
        """For a launch in pieces: the drafter's forward behind ``plan``'s prompt chunks, as a
        generator pausing after every ``every`` layers, to run after the launch has returned
        (the prompt step lands and hands out its first tokens meanwhile); None: nothing to
        follow. Who is followed is read, and their drafter views claimed, now."""
        expects = getattr(self.controller, "expects_speculation", None)
        items = self.core.follow_items(plan, expects) if expects is not None else []
        if not items:
            return None
        pieces = self.core.follow_iter(items, every)
        try:
            next(pieces)  # claims the drafter views now: nobody drafts for them meanwhile
        except StopIteration:
            return None
        return pieces

    def follow_decode(self, plan: StepPlan) -> None:
        """The drafter's catch-up, right behind a launched decode step on its stream (or
        beside it, ``SpecConfig.follow_decode_stream``), on the contexts of its plain rows
        that the policy expects to draft for (``SpecConfig.follow_decode_max_rows``)."""
        wants = getattr(self.controller, "expects_drafting", None)
        if wants is not None:
            items = self.core.follow_decode_items(plan, wants)
            drain(self.core.follow_iter(items, on_decode=True, beside=self.feeds_beside))

    def chain_after(self, plan: StepPlan, pending: PendingStep) -> None:
        """Drafts the next round behind a launched verify when the GPU's gap after it is idle,
        timed on the GPU for the controller like a proposal. Runs on the event-loop thread
        (on CPU the step itself runs in a worker thread; there the chain follows it)."""
        if not (self.core.can_chain(pending) and self.gap_is_idle(plan)):
            return
        self.observe_draft_cost()
        span = Span(self.core.device.type == "cuda")
        rows, num_drafted = self.core.chain(plan, pending)
        if rows:  # chained only with no prompt work about (``gap_is_idle``): uncontended
            self._draft_span = (span.stop(), rows, num_drafted, False)

    def follow_prefill(self, plan: StepPlan) -> None:
        """The drafter follows the prompt chunks of the requests the policy expects to
        speculate for (a policy without that notion: nobody's)."""
        expects = getattr(self.controller, "expects_speculation", None)
        if expects is not None:
            self.core.follow_prefill(plan, expects)

    # ------------------------------------------------------------------ learning
    def step_landed(self, plan: StepPlan, seconds: float) -> None:
        """A step came back (after ``EngineCore.record_step``): its lane's cost, and any
        drafting that has run by now."""
        if self.enabled and not plan.carries_prompt:  # (a prompt inside: not a decode cost)
            prompt = plan.lane == "mixed" and plan.has_prompt_chunk  # the single lane's
            self.controller.observe_step(plan.lane, seconds, len(plan.seqs), plan.num_tokens,
                                         prompt)  # fmt: skip
        self.observe_draft_cost()

    def verify_queue(self, depth: int) -> None:
        if self.enabled:
            self.controller.observe_verify_queue(depth)

    def observe_draft_cost(self) -> None:
        if self._draft_span is None:
            return
        span, num_seqs, num_drafted, contended = self._draft_span
        seconds = span.seconds()
        if seconds is not None:
            self._draft_span = None
            self.controller.observe_step("draft", seconds, num_seqs, num_drafted)
            steps = max(1, round(num_drafted / num_seqs))  # one proposal: L drafter steps
            self.core.costs.observe("draft", seconds / steps, num_seqs, num_seqs, contended)
