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
verify lane stays idle. A short prompt may ride in a plain decode step instead of taking a
prompt step (``lanes.prompt_rides``, where its graphs were captured).

The dispatcher launches a lane's step on that lane's stream and does not wait for it: on GPU
lanes overlap, and stream priorities let decode kernels jump ahead of queued verify and prefill
work. A lane has at most one step in flight, and a sequence is in at most one step. Priority is
strict with bounded starvation: a waiting prefill whose oldest request has waited past the TTFT
budget goes first once (where steps land before the next choice, ``steps_land``, a prompt goes
after each decode or verify step instead). A launch that pauses part-way
(``background_lanes``: an eager prompt step enqueued a few layers at a time) runs as a task of
its own: its lane is busy from the start, and the other lanes launch and land while it is
being enqueued.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

from verifypd.engine.core import EngineCore
from verifypd.lanes.ahead_launch import launch_ahead
from verifypd.lanes.backlog_fuse import decode_yields, fusing, plan_fused
from verifypd.lanes.decode_ahead import DecodeAhead
from verifypd.lanes.decode_pacing import DecodePacing
from verifypd.lanes.deltas import Deltas
from verifypd.lanes.lane_steps import LANES, SINGLE_LANE, InFlight, Launcher, choose_lane
from verifypd.lanes.prompt_ahead import PromptAhead, launch_prompt_ahead, move_up
from verifypd.lanes.prompt_rides import PromptRides
from verifypd.lanes.spec_policy import SpeculationPolicy
from verifypd.lanes.step_failures import StepFailures
from verifypd.types import (
    NO_SPECULATION,
    RequestFailure,
    RequestOutput,
    ScheduledSeq,
    SeqStatus,
    SpecDecision,
    StepPlan,
)


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
        deliver_before_drafting: bool = False,
        policy: SpeculationPolicy | None = None,
        decode_ahead: bool = False,
        ahead_beside_prefill: bool = True,
        ahead_waits_for_prompts: bool = True,
        background_lanes: frozenset[str] = frozenset(),
        decode_gap_beside_prefill_s: float = 0.0,
        prompt_in_decode_tokens: int = 0,
        fuse_decode_backlog_s: float | None = None,
        fuse_decode_backlog_tokens: int = 0,
        fuse_decode_hold_tokens: int | None = None,
        fuse_rounds_rows: int | None = None,
        prompt_ahead: bool = False,
        steps_land: bool = False,
    ) -> None:
        self._lane_context = lane_context or (lambda lane: contextlib.nullcontext())
        self.lanes = SINGLE_LANE if single_lane else LANES
        self.core = core
        self.policy = policy or SpeculationPolicy.of(core)
        self.sched = core.scheduler
        self._launch_fn = launch
        self._deliver = deliver
        self.failures = StepFailures(core, deliver)
        self.ttft_budget_s = ttft_budget_s
        # A launch returns once its step has run (CPU): no lane runs beside another.
        self.steps_land = steps_land
        self.clock = clock
        self.verify_queue: list[ScheduledSeq] = []
        self.in_flight: dict[str, InFlight] = {}
        self.launch_log: list[str] = []  # lanes in launch order (tests, debugging)
        self._last_lane: str | None = None
        # When a landed step's deltas are made (``lanes.deltas``: after the next launch where a
        # launch only enqueues, so that host work overlaps the GPU, with exceptions).
        self.deltas = Deltas(core, deliver, emit_after_launch, deliver_before_drafting)
        self.ahead = DecodeAhead(
            decode_ahead and not single_lane,
            ahead_beside_prefill,
            ahead_waits_for_prompts,
            getattr(self.policy, "second_token_plain", False),
        )
        # Decode steps spaced beside a long prompt step (``lanes.decode_pacing``).
        self.pacing = DecodePacing(decode_gap_beside_prefill_s)
        # A prompt whose rest is at most this many tokens rides in the next plain decode step
        # (EngineConfig.prompt_in_decode_tokens, its largest; 0 = never; ``lanes.prompt_rides``).
        self.rides = PromptRides(core, 0 if single_lane else prompt_in_decode_tokens)
        # In a prompt backlog the decode rows ride in prompt steps (``lanes.backlog_fuse``;
        # EngineConfig.fuse_decode_backlog_s and _tokens; None: never).
        self.fuse_decode_backlog_s = None if single_lane else fuse_decode_backlog_s
        self.fuse_decode_backlog_tokens = fuse_decode_backlog_tokens
        self.fuse_decode_hold_tokens = fuse_decode_hold_tokens
        self.fuse_rounds_rows = None if single_lane else fuse_rounds_rows  # ... and under load
        self.fuse_held = False  # the last prompt step carried the decode rows
        # The next prompt step launched behind the one in flight (``lanes.prompt_ahead``).
        self.prompt_ahead = PromptAhead(prompt_ahead and not single_lane)
        # Lanes whose launch pauses part-way: launched as tasks (``_launch_marked``).
        self.background_lanes = background_lanes
        self._launches: set[asyncio.Task] = set()

    @property
    def decode_ahead(self) -> bool:
        return self.ahead.enabled

    @property
    def num_ahead_steps(self) -> int:
        return self.ahead.num_steps

    @property
    def num_ahead_held(self) -> int:
        return self.ahead.num_held

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
            if self.deltas.take_handed_out():  # first tokens: their consumers run first (the
                return True  # next launch may be a long host section, which TTFT would wait for)
            progressed = await self._launch_ahead() or progressed
            progressed = await self._launch_next(progressed)
            return await launch_prompt_ahead(self) or progressed
        finally:
            self.deltas.emit()

    async def _launch_next(self, progressed: bool) -> bool:
        idle = {lane for lane in self.lanes if lane not in self.in_flight}
        if self.pacing.paced(self.in_flight, self.clock):
            idle.discard("decode")
        tried: set[str] = set()
        while True:
            lane = choose_lane(
                idle - tried,
                self._has_work(),
                self._prefill_wait(),
                self.ttft_budget_s,
                self.lanes,
                # Where steps land before the next choice (CPU), decode is always idle: strict
                # priority would starve drafted rows and prompts behind plain decodes.
                verify_due=bool(self.verify_queue) and self._last_lane == "decode",
                prefill_due=self.steps_land and self._last_lane in ("decode", "verify"),
            )
            if lane is None:
                return progressed
            plan = self._plan(lane)
            if self.deltas.take_handed_out():  # ahead of a drafting launch: their consumers run
                return True  # first, and the next tick launches it
            if plan is not None and await self._launch(lane, plan):
                return True
            tried.add(lane)

    def collect(self) -> bool:
        done = [lane for lane, f in self.in_flight.items() if f.pending and f.pending.done()]
        for lane in done:
            f = self.in_flight.pop(lane)
            self._fold(f, f.pending.seconds(self.clock() - f.start))
            # A decode step launched ahead moves up; it may have landed too (in order).
            while lane == "decode" and self.ahead.step is not None:
                f = self.ahead.move_up()
                now = self.clock()
                f.start = max(f.start, now)  # it ran on the GPU behind the one just folded
                if f.pending is None or not f.pending.done():
                    self.in_flight[lane] = f
                    break
                self._fold(f, None)
            if lane == "prefill":
                move_up(self)  # a prompt step launched ahead takes its place
        pipelined = self.decode_ahead and set(self.in_flight) == {"decode"}
        self.deltas.settle(bool(self.in_flight) and not pipelined)
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
        self.deltas.landed(self.core.apply_step(f.plan, token_ids))

    # ------------------------------------------------------------------ planning per lane
    def _plan(self, lane: str) -> StepPlan | None:
        """A lane's next step as plain data: who runs, and each decode entry's draft length
        (the policy's ``SpecDecision``). Planning reserves KV slots and launches nothing."""
        if lane == "decode":
            return None if decode_yields(self) else self._plan_decode()
        if lane == "verify":
            return self._plan_verify()
        if lane == "mixed":
            decision = self.ahead.take_decision(self.core.decodable())
            decision = self.policy.decide() if decision is None else decision
            if self._delivers_first(decision):
                return None
            return self.sched.schedule_mixed(decision)
        if fusing(self):
            return plan_fused(self)
        if self._prompt_waits_for_decode():
            return None
        budget, sched = self.core.prefill_budget(), self.sched
        entries = sched.plan_prefill(budget, sched.max_num_seqs, sched.prefill_pack(self.clock()))
        return StepPlan("prefill", entries) if entries else None

    def _plan_decode(self) -> StepPlan | None:
        """Drafts for speculating sequences only while the verify lane is idle, so one cohort
        drafts and verifies together; while a verify is in flight the others decode plainly
        (decode never waits for verify)."""
        decision = self.ahead.take_decision(self.core.decodable())  # made while one ran
        if decision is None:
            decision = self.policy.decide(prefill_running=self._prefill_signal())
        if "verify" in self.in_flight or self.verify_queue:
            decision = NO_SPECULATION
        if self._delivers_first(decision):
            return None
        entries = self.sched.plan_decode(decision)
        if not decision.lens:
            self.policy.verify_queue(len(self.verify_queue))
            self.rides.ride(entries)
        return StepPlan("decode", entries, fused=decision.fused) if entries else None

    def _delivers_first(self, decision: SpecDecision) -> bool:
        """Deltas go out ahead of the drafting launch ``decision`` plans (``Deltas.ahead_of``);
        the decision is then kept for the next plan (``DecodeAhead.keep``: a decision has side
        effects, it is not asked twice)."""
        if not self.deltas.ahead_of(decision):
            return False
        self.ahead.keep(decision, self.core.decodable())
        return True

    async def _launch_ahead(self) -> bool:
        """The next decode step behind the one in flight (``lanes.ahead_launch``); False when
        there is nothing to launch ahead."""
        return await launch_ahead(self)

    def _prompt_waits_for_decode(self) -> bool:
        """The prefill lane leaves the next prompt to the decode lane (``lanes.prompt_rides``)."""
        decided = self.ahead.decided
        drafting = (
            self.deltas.drafted_last
            or bool(self.verify_queue)
            or "verify" in self.in_flight
            or (decided is not None and bool(decided.lens))
        )
        return self.rides.leaves_to_decode("decode" in self.in_flight, drafting,
                                           self._prefill_wait())  # fmt: skip

    def _log_launch(self, lane: str) -> None:
        self.launch_log.append(lane)
        if len(self.launch_log) > 4096:  # a server runs for days: keep the recent part
            del self.launch_log[:2048]

    def flights(self) -> list[InFlight]:
        """Every launched step not yet folded back in (the steps ahead included)."""
        ahead = [f for f in (self.ahead.step, self.prompt_ahead.step) if f is not None]
        return [*self.in_flight.values(), *ahead]

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
        drafts = lane == "prefill" and any(e.draft_len for e in plan.seqs)  # a fused round
        if lane in ("decode", "mixed") or drafts:
            self.deltas.drafted_last = any(e.draft_len for e in plan.seqs)
            if self.deltas.drafted_last:
                plan = self._draft(lane, plan)
                if plan is None:
                    return False
        if lane != "verify":  # verify entries were marked when they were queued
            self.sched.begin_step(plan)
        await self._launch_marked(lane, plan)
        return True

    def _draft(self, lane: str, plan: StepPlan) -> StepPlan | None:
        """The drafting step: the drafter proposes each speculating entry's L tokens, on the
        stream of the ``lane`` launching the step (nobody waits for it: the verify follows
        it on the GPU). Drafted entries verify inside this step (single lane, a fused
        decision, or a prompt step carrying the round: ``fuse_rounds_rows``); else they queue
        for the verify lane, their slots reserved until verified, and the plain rest decodes
        (with ``drafts_beside_decode`` the drafts are made on the verify lane's stream, idle
        whenever a round drafts, so the plain rest does not wait behind them)."""
        inside = plan.lane == "mixed" or plan.fused
        beside = not inside and getattr(self.policy, "drafts_beside_decode", False)
        with self._lane_context("verify" if beside else lane):
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
            self.pacing.last_launch = start
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
            rest = self.failures.isolate(plan, failure.request_ids)
            if rest is not None and rest.seqs:
                await self._launch_marked(lane, rest)
        except Exception:
            del self.in_flight[lane]
            self.failures.fail(plan)

    def _report(self) -> None:
        self.core.observer.queue_depths(self.queue_depths())
        self.core.observer.requests(self.sched.num_running, self.sched.num_waiting)
