"""The three lanes and their priority dispatcher (Verify-PD).

Lanes, highest priority first:
- decode: one target token for every decoding sequence with L = 0, and the drafts of every
  speculating sequence (n-gram lookup, or L drafter forwards); drafted sequences move on to
- verify: one target forward over [last token + L drafts] per sequence, rejection sampling;
- prefill: prompt chunks (bounded by a token budget, so a decode waits at most one chunk; with
  ``SchedulerConfig.prefill_step_target_s`` the budget is what the cost model predicts to run
  within that time, Sarathi-style, so a chunk sharing the GPU with a decode step stays short).

Every speculative decision is the speculation policy's (``lanes.spec_policy``), made as data
(a ``SpecDecision``) when a step is planned; planning launches nothing. Drafting is a step of
its own, launched on the decode lane's stream just before the decode step it belongs to. The
policy may fuse a round's verify into the decode step (``StepPlan.fused``): then the drafted
sequences verify in the decode lane's one target forward, as in the single lane, and the
verify lane stays idle.

The dispatcher launches a lane's step on that lane's stream and does not wait for it: on GPU
lanes overlap, and stream priorities let decode kernels jump ahead of queued verify and prefill
work. A lane has at most one step in flight, and a sequence is in at most one step. Priority is
strict with bounded starvation: a waiting prefill whose oldest request has waited past the TTFT
budget goes first once. A launch that pauses part-way (``background_lanes``: an eager prompt
step enqueued a few layers at a time) runs as a task of its own: its lane is busy from the
start, and the other lanes launch and land while it is being enqueued.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from verifypd.engine.core import EngineCore
from verifypd.engine.runner import PendingStep
from verifypd.lanes.spec_policy import SpeculationPolicy
from verifypd.types import (
    NO_SPECULATION,
    RequestFailure,
    RequestOutput,
    ScheduledSeq,
    SeqStatus,
    Sequence,
    SpecDecision,
    StepPlan,
)

LANES = ("decode", "verify", "prefill")  # priority order


SINGLE_LANE = ("mixed",)  # baseline: decode, verify and prefill fused in one batch
PACED_PROMPT_TOKENS = 1024  # a prompt step this long paces decode (decode_gap_beside_prefill_s)


def choose_lane(
    idle: set[str],
    has_work: dict[str, bool],
    prefill_wait_s: float | None,
    ttft_budget_s: float,
    lanes: tuple[str, ...] = LANES,
    verify_due: bool = False,
) -> str | None:
    """Policy: the highest-priority idle lane with work; a starved prefill first, then a
    verify that has already waited for one decode step (``verify_due``)."""
    starved = prefill_wait_s is not None and prefill_wait_s > ttft_budget_s
    if starved and "prefill" in idle and has_work.get("prefill"):
        return "prefill"
    if verify_due and "verify" in idle and has_work.get("verify"):
        return "verify"
    for lane in lanes:
        if lane in idle and has_work.get(lane):
            return lane
    return None


@dataclass
class InFlight:
    plan: StepPlan
    pending: PendingStep | None  # None while the launch itself is still running
    start: float
    contended: bool = False  # a prompt step was in flight beside it (the cost model's)


Launcher = Callable[[str, StepPlan], Awaitable[PendingStep]]


class LaneDispatcher:
    """Plans and launches lane steps by priority and folds finished ones back in."""

    def __init__(
        self,
        core: EngineCore,
        launch: Launcher,
        deliver: Callable[[RequestOutput], None],
        ttft_budget_s: float,
        clock: Callable[[], float] = time.monotonic,
        single_lane: bool = False,
        lane_context: Callable[[str], contextlib.AbstractContextManager] | None = None,
        emit_after_launch: bool = False,
        policy: SpeculationPolicy | None = None,
        decode_ahead: bool = False,
        ahead_beside_prefill: bool = True,
        ahead_waits_for_prompts: bool = True,
        background_lanes: frozenset[str] = frozenset(),
        decode_gap_beside_prefill_s: float = 0.0,
    ) -> None:
        self._lane_context = lane_context or (lambda lane: contextlib.nullcontext())
        self.lanes = SINGLE_LANE if single_lane else LANES
        self.core = core
        self.policy = policy or SpeculationPolicy.of(core)
        self.sched = core.scheduler
        self._launch_fn = launch
        self._deliver = deliver
        self.ttft_budget_s = ttft_budget_s
        self.clock = clock
        self.verify_queue: list[ScheduledSeq] = []
        self.in_flight: dict[str, InFlight] = {}
        self.launch_log: list[str] = []  # lanes in launch order (tests, debugging)
        self._last_lane: str | None = None
        # Where a launch only enqueues (GPU) and no other step is in flight, a landed step's
        # deltas are made after the next launch, so detokenizing and delivery overlap the GPU
        # instead of leaving it idle.
        self.emit_after_launch = emit_after_launch
        self._unemitted: list[Sequence] = []
        # Decode-ahead (EngineConfig.decode_ahead): while a decode step is in flight, the next
        # one is planned and launched behind it on the same stream, its input tokens read on
        # the device, so the host's fold-back and planning overlap the GPU instead of sitting
        # between steps. With speculation configured, the policy decides for every step ahead
        # too (its batch named, since their previous step is still in flight); a decision to
        # speculate for anyone ends the run ahead: the next step waits for its tokens and
        # drafts (a drafting step needs landed tokens).
        self.decode_ahead = decode_ahead and not single_lane
        # ... also while a prompt step is in flight (EngineConfig.decode_ahead_beside_prefill).
        self.ahead_beside_prefill = ahead_beside_prefill
        # ... but not when a prompt step in flight that ends prompts is predicted to land
        # before the decode step in flight (EngineConfig.decode_ahead_waits_for_prompts): its
        # rows then join the next step instead of waiting behind the one ahead.
        self.ahead_waits_for_prompts = ahead_waits_for_prompts
        # While a long prompt step is in flight, a decode step is launched no sooner than this
        # after the last one (EngineConfig.decode_gap_beside_prefill_s; 0 = back to back), and
        # none ahead: the prompt step has the GPU in between.
        self.decode_gap_beside_prefill_s = decode_gap_beside_prefill_s
        self._last_decode_launch = float("-inf")
        self._ahead: InFlight | None = None  # the decode step launched behind the one in flight
        self._declined: InFlight | None = None  # the head no step ahead was planned behind
        # The policy's decision for the next decode step, made while deciding whether to run
        # ahead (it speculated, so nothing ran ahead); _plan_decode takes it.
        self._decided: SpecDecision | None = None
        self.num_ahead_steps = 0  # decode steps launched ahead (tests, benchmarks)
        self.num_ahead_held = 0  # steps not launched ahead for a landing prompt (the same)
        self._held: tuple[InFlight, InFlight] | None = None  # (decode, prompt) steps it held for
        # Lanes whose launch pauses part-way: launched as tasks (``_launch_marked``).
        self.background_lanes = background_lanes
        self._launches: set[asyncio.Task] = set()
        # First tokens were just handed out: ``tick`` returns before launching anything more.
        self._first_tokens_out = False

    # ------------------------------------------------------------------ signals
    def queue_depths(self) -> dict[str, int]:
        return {
            "decode": len(self.core.decodable()),
            "verify": len(self.verify_queue),
            "prefill": self.sched.num_waiting + self.sched.num_prefilling,
        }

    def _has_work(self) -> dict[str, bool]:
        depths = self.queue_depths()
        work = {lane: depths[lane] > 0 for lane in LANES}
        work["mixed"] = any(work.values())
        return work

    def _prefill_wait(self) -> float | None:
        if not self.sched.waiting:
            return None
        return self.clock() - min(s.arrival_time for s in self.sched.waiting)

    def has_work(self) -> bool:
        return bool(self.in_flight) or any(self._has_work().values())

    # ------------------------------------------------------------------ one iteration
    async def tick(self) -> bool:
        """Collects finished steps and launches at most one lane (and a decode step ahead of
        the one in flight). Returns True on progress."""
        progressed = await self._launch_ahead()
        progressed = self.collect() or progressed
        try:
            if self._first_tokens_out:  # their consumers (a stream writer) run first: the
                self._first_tokens_out = False  # next launch may be a long host section (a
                return True  # drafter catching up on the new prompt), which TTFT would wait for
            progressed = await self._launch_ahead() or progressed
            return await self._launch_next(progressed)
        finally:
            self._emit()

    async def _launch_next(self, progressed: bool) -> bool:
        idle = {lane for lane in self.lanes if lane not in self.in_flight}
        if self._decode_paced():
            idle.discard("decode")
        tried: set[str] = set()
        while True:
            lane = choose_lane(
                idle - tried,
                self._has_work(),
                self._prefill_wait(),
                self.ttft_budget_s,
                self.lanes,
                # Where steps land before the next choice (CPU), decode is always idle and
                # strict priority would starve the drafted cohort behind plain decodes.
                verify_due=bool(self.verify_queue) and self._last_lane == "decode",
            )
            if lane is None:
                return progressed
            plan = self._plan(lane)
            if plan is not None and await self._launch(lane, plan):
                return True
            tried.add(lane)

    def _beside_long_prompt(self) -> bool:
        """A prompt step of at least ``PACED_PROMPT_TOKENS`` tokens is in flight."""
        f = self.in_flight.get("prefill")
        return f is not None and sum(e.num_new_tokens for e in f.plan.seqs) >= PACED_PROMPT_TOKENS

    def _decode_paced(self) -> bool:
        """The decode lane waits: a long prompt step is in flight and the last decode step was
        launched less than ``decode_gap_beside_prefill_s`` ago."""
        gap = self.decode_gap_beside_prefill_s
        if gap <= 0.0 or not self._beside_long_prompt():
            return False
        return self.clock() - self._last_decode_launch < gap

    def collect(self) -> bool:
        done = [lane for lane, f in self.in_flight.items() if f.pending and f.pending.done()]
        for lane in done:
            f = self.in_flight.pop(lane)
            self._fold(f, f.pending.seconds(self.clock() - f.start))
            # A decode step launched ahead moves up; it may have landed too (in order).
            while lane == "decode" and self._ahead is not None:
                f, self._ahead = self._ahead, None
                now = self.clock()
                f.start = max(f.start, now)  # it ran on the GPU behind the one just folded
                if f.pending is None or not f.pending.done():
                    self.in_flight[lane] = f
                    break
                self._fold(f, None)
        # Deltas wait for the next launch only while the GPU has nothing else to run (another
        # lane's step in flight keeps it busy: then delivery goes first; a decode step ahead
        # is launched first, since the GPU is about to run out of decode work), and never a
        # first token (TTFT). A stop string can end a sequence only once it is detokenized:
        # emit now, so it is never planned again.
        pipelined = self.decode_ahead and set(self.in_flight) == {"decode"}
        waits = self.emit_after_launch and (not self.in_flight or pipelined)
        first = any(s.first_token_time is None for s in self._unemitted)
        if not waits or first or any(s.params.stop for s in self._unemitted):
            self._emit()
            self._first_tokens_out = first
        if done:
            self._report()
        return bool(done)

    def _fold(self, f: InFlight, seconds: float | None) -> None:
        """Folds a landed step in; ``seconds`` None: it landed together with the step before
        it, so its own duration is unknown (not recorded)."""
        token_ids = f.pending.result()
        if seconds is not None:
            self.core.record_step(f.plan, seconds, f.contended)
            self.policy.step_landed(f.plan, seconds)
        self._unemitted += self.core.apply_step(f.plan, token_ids)

    def _emit(self) -> None:
        changed, self._unemitted = self._unemitted, []
        for out in self.core.emit(changed) if changed else ():
            self._deliver(out)

    # ------------------------------------------------------------------ planning per lane
    def _plan(self, lane: str) -> StepPlan | None:
        """A lane's next step as plain data: who runs, and each decode entry's draft length
        (the policy's ``SpecDecision``). Planning reserves KV slots and launches nothing."""
        if lane == "decode":
            return self._plan_decode()
        if lane == "verify":
            return self._plan_verify()
        if lane == "mixed":
            return self.sched.schedule_mixed(self.policy.decide())
        budget, sched = self.core.prefill_budget(), self.sched
        entries = sched.plan_prefill(budget, sched.max_num_seqs, sched.prefill_pack_tokens)
        return StepPlan("prefill", entries) if entries else None

    def _plan_decode(self) -> StepPlan | None:
        """Drafts for speculating sequences only while the verify lane is idle, so one cohort
        drafts and verifies together; while a verify is in flight the others decode plainly
        (decode never waits for verify)."""
        decision, self._decided = self._decided, None  # made for this step while one ran
        if decision is not None and not any(
            s.seq_id in decision.lens for s in self.core.decodable()
        ):  # everyone it named ended with the step in flight: it is not this batch's
            decision = None
        if decision is None:
            decision = self.policy.decide(prefill_running=self._prefill_signal())
        if "verify" in self.in_flight or self.verify_queue:
            decision = NO_SPECULATION
        entries = self.sched.plan_decode(decision)
        if not decision.lens:
            self.policy.verify_queue(len(self.verify_queue))
        return StepPlan("decode", entries, fused=decision.fused) if entries else None

    async def _launch_ahead(self) -> bool:
        """Launches the next decode step behind the one in flight (``decode_ahead``): its
        entries planned ahead of the host (``Scheduler.plan_ahead``), then every decodable
        sequence not in flight. False when there is nothing to launch ahead."""
        head = self.in_flight.get("decode")
        if not self.decode_ahead or self._ahead is not None or head is None:
            return False
        if not self.ahead_beside_prefill and "prefill" in self.in_flight:
            return False  # the host's turnaround between decode steps is the prompt's
        if self.decode_gap_beside_prefill_s > 0.0 and self._beside_long_prompt():
            return False  # decode steps are spaced out beside it
        if head.pending is None or head.pending.device_ids is None or head is self._declined:
            return False  # asked once per step in flight: the loop polls many times a step
        if self._holds_for_prompt(head):
            return False  # asked again as the loop polls: it goes ahead once the prompt landed
        self._declined, self._held = head, None  # (the steps held for are not kept alive)
        if self.policy.enabled:
            if self.verify_queue or "verify" in self.in_flight:
                return False  # a speculative round is under way
            batch = [e.seq for e in head.plan.seqs if e.seq.status is SeqStatus.DECODING]
            decision = self.policy.decide(self._prefill_signal(), batch + self.core.decodable())
            if decision.lens:  # the next step waits for its tokens and drafts, as decided
                # here: a decision has side effects (catch-up rounds, probes, the no-gain
                # hold), so it is not asked again when that step is planned (asked twice, the
                # second answer lost every catch-up round the first one scheduled).
                self._decided = decision
                return False
        entries = self.sched.plan_ahead(head.plan, head.pending.sampled_at)
        if not entries:
            return False
        self._declined = None
        entries += self.sched.plan_decode(NO_SPECULATION)
        plan = StepPlan("decode", entries, prev_ids=head.pending.device_ids)
        self.sched.begin_step(plan)
        self._log_launch("decode")
        self.num_ahead_steps += 1
        self.core.observer.decode_ahead()
        flight = self._ahead = InFlight(plan, None, self.clock(), "prefill" in self.in_flight)
        self._last_decode_launch = flight.start
        try:
            flight.pending = await self._launch_fn("decode", plan)
        except RequestFailure as failure:  # some requests' own inputs: the rest wait
            self._ahead = None
            self.sched.abandon(plan)  # nothing of it ran; the others plan again later
            self._end_requests(failure.request_ids)
            return False
        except Exception:
            self._ahead = None
            self._fail(plan)
            return False
        return True

    def _holds_for_prompt(self, head: InFlight) -> bool:
        """No step goes ahead of ``head`` yet: a prompt step in flight lands first with new
        rows (``_lands_first``). Once it has landed, the step ahead is launched with them
        (behind ``head``: the rows in flight wait for nothing); a verdict stands while the
        same two steps are in flight (the loop polls)."""
        f = self.in_flight.get("prefill")
        if self._held is not None and self._held[0] is head and self._held[1] is f:
            return True
        if not self.ahead_waits_for_prompts or f is None or not self._lands_first(f, head):
            return False
        self._held = (head, f)
        self.num_ahead_held += 1
        return True

    def _lands_first(self, f: InFlight, head: InFlight) -> bool:
        """``f``, the prompt step in flight, ends prompts and is predicted (the cost model) to
        land before ``head``, the decode step in flight. A step launched ahead now could not
        take the prompt's rows: their second token would wait for ``head``, the step ahead
        (beside the next prompt step of a burst, 20-40 ms) and then their own step; held, for
        ``head`` and their own (as in vLLM, the step after the prompt's). Wrong, the rows in
        flight lose one host turnaround; right, nothing (the step goes ahead as it lands)."""
        seqs = f.plan.seqs
        if not any(e.seq.num_computed_tokens + e.num_new_tokens >= e.seq.num_tokens for e in seqs):
            return False  # only middle chunks: no row joins
        costs = self.core.costs
        lands = f.start + costs.prefill(f.plan.num_tokens)
        return lands <= head.start + costs.decode(len(head.plan.seqs), contended=True)

    def _log_launch(self, lane: str) -> None:
        self.launch_log.append(lane)
        if len(self.launch_log) > 4096:  # a server runs for days: keep the recent part
            del self.launch_log[:2048]

    def flights(self) -> list[InFlight]:
        """Every launched step not yet folded back in (a decode step ahead included)."""
        return [*self.in_flight.values(), *([self._ahead] if self._ahead else [])]

    def _prefill_signal(self) -> bool:
        """Prompt work in flight or queued; only read by a policy that reads it (yields to it,
        or prices plans beside it: no scan of the running set otherwise)."""
        return self.policy.reads_prompt_work and (
            "prefill" in self.in_flight or self.sched.prompts_waiting()
        )

    def _plan_verify(self) -> StepPlan | None:
        entries, self.verify_queue = self.verify_queue, []
        return StepPlan("verify", entries) if entries else None

    # ------------------------------------------------------------------ launching
    async def _launch(self, lane: str, plan: StepPlan) -> bool:
        """Launches ``plan`` (its drafting first); False when nothing was left to launch on
        this lane (every entry drafted and went to the verify lane)."""
        if lane in ("decode", "mixed") and any(e.draft_len for e in plan.seqs):
            plan = self._draft(plan)
            if plan is None:
                return False
        if lane != "verify":  # verify entries were marked when they were queued
            self.sched.begin_step(plan)
        await self._launch_marked(lane, plan)
        return True

    def _draft(self, plan: StepPlan) -> StepPlan | None:
        """The drafting step: the drafter proposes each speculating entry's L tokens, on the
        decode lane's stream (nobody waits for it: the verify follows it on the GPU). Drafted
        entries verify inside this step (single lane, or a fused decision); else they queue
        for the verify lane, their slots reserved until verified, and the plain rest decodes
        (with ``drafts_beside_decode`` the drafts are made on the verify lane's stream, idle
        whenever a round drafts, so the plain rest does not wait behind them)."""
        inside = plan.lane == "mixed" or plan.fused
        beside = not inside and getattr(self.policy, "drafts_beside_decode", False)
        with self._lane_context("verify" if beside else plan.lane):
            self.policy.propose(plan.seqs, "prefill" in self.in_flight)
        if inside:
            return plan
        plain = [e for e in plan.seqs if not e.draft_token_ids]
        for e in plan.seqs:
            if e.draft_token_ids:
                e.seq.status = SeqStatus.VERIFYING
                self.verify_queue.append(e)
                self.sched.begin_step(StepPlan("verify", [e]))  # reserved until verified
        self.policy.verify_queue(len(self.verify_queue))
        return StepPlan("decode", plain) if plain else None

    async def _launch_marked(self, lane: str, plan: StepPlan) -> None:
        start = self.clock()
        self._last_lane = lane
        self._log_launch(lane)
        self._report()
        self._mark_contention(lane)
        flight = self.in_flight[lane] = InFlight(plan, None, start, "prefill" in self.in_flight)
        if lane == "decode":
            self._last_decode_launch = start
        if lane in self.background_lanes:
            task = asyncio.create_task(self._finish_launch(lane, plan, flight))
            self._launches.add(task)
            task.add_done_callback(self._launches.discard)
            return
        await self._finish_launch(lane, plan, flight)

    def _mark_contention(self, lane: str) -> None:
        """A prompt step launched now shares the GPU with every step in flight."""
        if lane == "prefill":
            for f in self.flights():
                f.contended = True

    def cancel_launches(self) -> None:
        """Cancels the launches still being enqueued (the engine stops)."""
        for task in list(self._launches):
            task.cancel()

    async def _finish_launch(self, lane: str, plan: StepPlan, flight: InFlight) -> None:
        try:
            flight.pending = await self._launch_fn(lane, plan)
        except RequestFailure as failure:  # some requests' own inputs: the rest go on
            del self.in_flight[lane]
            rest = self._isolate(plan, failure.request_ids)
            if rest is not None and rest.seqs:
                await self._launch_marked(lane, rest)
        except Exception:
            del self.in_flight[lane]
            self._fail(plan)

    def _isolate(self, plan: StepPlan, request_ids: set[str]) -> StepPlan | None:
        """Ends the failed requests with "error"; returns the step without them (None, after
        failing the whole step, when none of them is in it)."""
        failed = [e for e in plan.seqs if e.seq.request_id in request_ids]
        if not failed:
            self._fail(plan)
            return None
        logging.getLogger("verifypd").exception("requests %s failed", sorted(request_ids))
        self.sched.abandon(StepPlan(plan.lane, failed))
        self._end_requests(request_ids)
        return StepPlan(plan.lane, [e for e in plan.seqs if e.seq.request_id not in request_ids])

    def _fail(self, plan: StepPlan) -> None:
        """A launch raised: end the affected requests with "error" instead of hanging."""
        logging.getLogger("verifypd").exception("lane step failed; ending its requests")
        self.sched.abandon(plan)  # its KV was never written: nothing may reach the cache
        self._end_requests({s.seq.request_id for s in plan.seqs})

    def _end_requests(self, request_ids: set[str]) -> None:
        for rid in request_ids:
            for out in self.core.abort_request(rid, "error"):
                self._deliver(out)

    def _report(self) -> None:
        self.core.observer.queue_depths(self.queue_depths())
        self.core.observer.requests(self.sched.num_running, self.sched.num_waiting)
