"""Where a first token's time goes (issue 14 diagnostics, ``mixed.py --sweep --ttft-anatomy``).

``StepLog`` wraps a ``LaneDispatcher``'s fold-back and logs every lane step it folds in: its
lane, launch and fold-back times and tokens, and the requests whose prompt it finished. Per
request, ``anatomy`` splits the client's TTFT into

- ``queue``: arrival in the engine until its first prompt chunk is planned (a prefill lane busy
  with earlier prompts, or the dispatcher busy elsewhere);
- ``prefill``: that planning until the step holding its last chunk is folded back in (its
  chunks on the GPU, sharing it with the decode and verify lanes, and the gaps between them);
- ``deliver``: the rest of the client's TTFT, itself split (where the client's clock is the
  engine's) into ``submit``, the engine's arrival after the trace's intended one (the event
  loop, shared in-process by the load generator and the engine, was busy), and ``emit``, the
  fold-back until the client holds the delta.

For each prefill step it also gives the share of its wall time during which the decode or
verify lane had a step in flight too (the GPU shared), and its time per 1k prompt tokens (all
steps, and those of at least 1024 tokens). The host side: the wall time of each dispatcher
tick (the loop holds no other task while a tick runs its synchronous planning, drafting,
launching and folding). Rows report medians over all requests and over the slowest 5 % by
TTFT (the p99's company). ``window`` lists what happened around the slowest first token and
those of the next slowest whose waits overlap it (one burst): every arrival and prompt step
from the earliest of their arrivals to the last of their first tokens, with the decode and
verify lanes' busy share of that span.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from verifypd.lanes import backlog_fuse
from verifypd.serve.loop_health import probe_lag

PROMPT_LANES = ("prefill", "mixed")
BIG_STEP_TOKENS = 1024
LONG_TICK_S = 0.005
BACK_TO_BACK_S = 0.010  # a prompt step launched this soon after the last one's fold-back
LOG_TICK_S = 0.002  # ticks at least this long are kept with their start (itl_anatomy.worst)
PROBE_S = 0.001  # the loop-lag probe's sleep (``StepLog.attach`` with a loop; ``probe_lag``)
# The client (loadgen, perf_counter) and the engine (Sequence.arrival_time, monotonic) share a
# clock where both read the same one (CLOCK_MONOTONIC on Linux): then deliver splits.
SAME_CLOCK = (
    time.get_clock_info("perf_counter").implementation
    == time.get_clock_info("monotonic").implementation
)


@dataclass
class FoldedStep:
    lane: str
    start: float  # launch (the dispatcher's clock)
    end: float  # folded back in
    num_tokens: int
    # (request_id, engine arrival, first planned) of each request whose prompt this step ended
    prompts_done: list[tuple[str, float, float]] = field(default_factory=list)
    # Decode rows' roles (request_id -> ROLES entry; bench/itl_anatomy.py): who got tokens
    rows: dict[str, str] = field(default_factory=dict)
    # A prompt step's: what the backlog-fuse rule read as it was planned (``fuse_inputs``)
    fuse: str | None = None


# A decode row's role in the step that handed it its tokens: a decode step in which nobody
# drafted (plain); a plain row of a step that drafted for others, waiting for their drafts
# (rider); its own speculative round, fused or verified on its lane (spec), and such a round
# that the policy called a catch-up round (catch_up: drafters fed a new prompt's context).
ROLES = ("plain", "rider", "spec", "catch_up")


class StepLog:
    """Every step a dispatcher folds back in (``attach``), until ``reset``."""

    def __init__(self) -> None:
        self._probe: asyncio.Task | None = None  # the loop-lag probe (``attach`` with a loop)
        self.reset()

    def reset(self) -> None:
        self.steps: list[FoldedStep] = []
        self.ticks: list[float] = []  # wall seconds of each dispatcher tick
        self.long_ticks: list[tuple[float, float]] = []  # (start, s) of ticks >= LOG_TICK_S
        # (start, end, lane, rows, drafted rows, policy reason or None) of each launch through
        # the dispatcher's ``_launch`` (its drafting included; decode-ahead launches are not)
        self.launches: list[tuple[float, float, str, int, int, str | None]] = []
        self._seen: set[int] = set()
        self._drafted: dict[str, str] = {}  # request_id -> role of its drafts, until verified
        self._riders: set[str] = set()  # plain rows launched behind others' drafts
        self._fuse_read: str | None = None  # fuse_inputs at the prefill lane's last planning
        self._fuse_of: dict[int, str | None] = {}  # id(plan) -> its fuse_inputs, until folded
        # (due, late s) of each wake-up of the loop-lag probe at least LOG_TICK_S late: the
        # event loop held by something (a tick's host section, a collection, the client)
        self.loop_lags: list[tuple[float, float]] = []

    def attach(self, dispatcher: Any, loop: asyncio.AbstractEventLoop | None = None) -> StepLog:
        """Wraps the dispatcher's fold-back, launch, tick and planning; with ``loop``, also
        starts the loop-lag probe there (``close`` stops it)."""
        self._probe = None if loop is None else loop.create_task(probe_lag(self._note_lag, PROBE_S))
        inner = dispatcher._fold

        def fold(flight, seconds):
            plan = flight.plan
            roles = self._roles(plan)  # before the fold moves the rows on
            # rows still in their prompt (any lane: a short prompt computes inside a decode step)
            prompting = [e.seq for e in plan.seqs if e.seq.num_output_tokens == 0]
            inner(flight, seconds)
            step = FoldedStep(plan.lane, flight.start, dispatcher.clock(), plan.num_tokens)
            step.rows = roles
            step.fuse = self._fuse_of.pop(id(plan), None)
            for seq in prompting:
                if seq.num_output_tokens > 0 and seq.seq_id not in self._seen:
                    self._seen.add(seq.seq_id)
                    arrived, planned = seq.arrival_time, seq.first_scheduled_time
                    step.prompts_done.append((seq.request_id, arrived, planned or arrived))
            self.steps.append(step)

        dispatcher._fold = fold
        launch = dispatcher._launch

        async def marked_launch(lane, plan):
            drafting = [e for e in plan.seqs if e.draft_len]
            reason = None
            if drafting:  # the decision behind these drafts is the policy's latest
                last = getattr(dispatcher.policy.controller, "last", None)
                reason = getattr(last, "reason", None)
                role = "catch_up" if reason == "catch_up" else "spec"
                for e in plan.seqs:
                    rid = e.seq.request_id
                    if e.draft_len:
                        self._drafted[rid] = role
                    elif e.num_new_tokens == 1:
                        self._riders.add(rid)
            if plan.lane in PROMPT_LANES:
                self._fuse_of[id(plan)], self._fuse_read = self._fuse_read, None
            start = dispatcher.clock()
            try:
                return await launch(lane, plan)
            finally:
                n = len(plan.seqs)
                self.launches.append((start, dispatcher.clock(), lane, n, len(drafting), reason))

        dispatcher._launch = marked_launch
        tick = dispatcher.tick

        async def timed_tick():
            t = time.perf_counter()
            try:
                return await tick()
            finally:
                took = time.perf_counter() - t
                self.ticks.append(took)
                if took >= LOG_TICK_S:
                    self.long_ticks.append((t, took))

        dispatcher.tick = timed_tick
        if hasattr(dispatcher, "_plan"):
            plan_lane = dispatcher._plan

            def noted_plan(lane):
                if lane == "prefill":  # its plan is a fused one in a backlog
                    self._fuse_read = fuse_inputs(dispatcher)
                return plan_lane(lane)

            dispatcher._plan = noted_plan
        return self

    def _note_lag(self, late: float) -> None:
        """``probe_lag``'s report: a wake-up ``late`` s after it was due, kept from
        ``LOG_TICK_S`` (not across a stop of the loop between runs: a second or more)."""
        if LOG_TICK_S <= late < 1.0:
            self.loop_lags.append((time.perf_counter() - late, late))

    def close(self) -> None:
        """Stops the loop-lag probe (it ends at the loop's next turn)."""
        if self._probe is not None:
            self._probe.cancel()
            self._probe = None

    def _roles(self, plan: Any) -> dict[str, str]:
        """The ``ROLES`` of a decode, verify or mixed step's decode rows (prompt chunks have
        none: their first token is a TTFT)."""
        out: dict[str, str] = {}
        if plan.lane not in ("decode", "verify", "mixed"):
            return out
        for e in plan.seqs:
            rid = e.seq.request_id
            if e.draft_token_ids:
                out[rid] = self._drafted.pop(rid, "spec")
            elif e.num_new_tokens == 1:
                out[rid] = "rider" if rid in self._riders else "plain"
                self._riders.discard(rid)
        return out


def fuse_inputs(d: Any) -> str | None:
    """What the backlog-fuse rule (``verifypd.lanes.backlog_fuse``) reads as the prefill lane
    plans: the oldest queued prompt's wait, the queued prompt tokens, KV room for the first,
    the running rows, and whether a decode step is in flight or launched ahead (a fused plan
    then waits for it) or a verify step (its rows cannot ride). None: no rule, or no queue."""
    sched = d.sched
    if d.fuse_decode_backlog_s is None or not sched.waiting:
        return None
    queued = sum(s.num_tokens - s.num_computed_tokens for s in sched.waiting)
    busy = [lane for lane in ("decode", "verify") if lane in d.in_flight]
    if d.ahead.step is not None:
        busy.append("decode ahead")
    return (f"wait {d._prefill_wait() * 1e3:.1f} ms, queued {queued} tok, "
            f"{'room' if backlog_fuse._room(sched) else 'no room'}, "
            f"running {sched.num_running}/{sched.max_num_seqs}, "
            f"{' + '.join(busy) + ' busy' if busy else 'decode idle'}")  # fmt: skip


def _median(values: list[float]) -> float | None:
    return float(np.median(values)) if values else None


def _overlap(step: FoldedStep, others: list[FoldedStep]) -> float:
    """Share of ``step``'s wall time during which some step of ``others`` was in flight."""
    span = step.end - step.start
    if span <= 0:
        return 0.0
    cuts = sorted((max(o.start, step.start), min(o.end, step.end)) for o in others)
    covered, reach = 0.0, step.start
    for a, b in cuts:
        if b <= max(a, reach):  # no overlap, or covered already
            continue
        covered += b - max(a, reach)
        reach = b
    return covered / span


def prompt_turnarounds(steps: list[FoldedStep]) -> tuple[list[float], float | None]:
    """The gaps between a prompt step's fold-back and the next one's launch where that came
    within ``BACK_TO_BACK_S`` (prompts queued behind one another), and the gaps' share of
    the wall time from the first launch to the last fold-back of each such run of steps."""
    ordered = sorted(steps, key=lambda s: s.start)
    gaps: list[float] = []
    runs: set[int] = set()  # indices of the steps in such runs
    for i in range(1, len(ordered)):
        gap = ordered[i].start - ordered[i - 1].end
        if 0.0 <= gap <= BACK_TO_BACK_S:
            gaps.append(gap)
            runs.update((i - 1, i))
    total = sum(ordered[i].end - ordered[i].start for i in runs) + sum(gaps)
    return gaps, (sum(gaps) / total if total > 0 else None)


def anatomy(log: StepLog, traces: list, slow_share: float = 0.05) -> dict[str, Any]:
    """Per request the parts of its TTFT (ms), summarized; see the module docstring."""
    done: dict[str, tuple[float, float, float]] = {}  # request_id -> (arrived, planned, end)
    for s in log.steps:
        for rid, arrived, planned in s.prompts_done:
            done.setdefault(rid, (arrived, planned, s.end))
    keys = ("ttft", "queue", "prefill", "deliver", "submit", "emit")
    parts = []
    for t in traces:
        if t.ttft_s is None or t.request_id not in done:
            continue
        arrived, planned, end = done[t.request_id]
        queue, prefill = planned - arrived, end - planned
        split = (arrived - t.arrival, t.deltas[0][0] - end) if SAME_CLOCK else (None, None)
        parts.append((t.ttft_s, queue, prefill, t.ttft_s - queue - prefill, *split))
    prompt_steps = [s for s in log.steps if s.lane in PROMPT_LANES]
    decode_steps = [s for s in log.steps if s.lane in ("decode", "verify")]
    shared = [_overlap(s, decode_steps) for s in prompt_steps]

    def per_1k(steps: list[FoldedStep]) -> float | None:
        return _median([(s.end - s.start) * 1e6 / s.num_tokens for s in steps if s.num_tokens])

    big = [s for s in prompt_steps if s.num_tokens >= BIG_STEP_TOKENS]
    turns = prompt_turnarounds(prompt_steps)
    ticks = np.asarray(log.ticks) * 1e3
    out: dict[str, Any] = {
        "num_requests": len(parts),
        "num_prompt_steps": len(prompt_steps),
        "prompt_step_ms_per_1k_tokens_p50": per_1k(prompt_steps),
        "big_prompt_step_ms_per_1k_tokens_p50": per_1k(big),
        "num_big_prompt_steps": len(big),
        "prompt_step_shared_p50": _median(shared),
        "prompt_step_tokens_p50": _median([float(s.num_tokens) for s in prompt_steps]),
        # back-to-back prompt steps (a backlog): the prompt lane idle from one's fold-back to
        # the next one's launch, and that idle time's share of those runs' wall time
        "prompt_turnaround_p50_ms": _median([t * 1e3 for t in turns[0]]),
        "prompt_turnaround_share": turns[1],
        "tick_p99_ms": float(np.percentile(ticks, 99)) if ticks.size else None,
        "tick_max_ms": float(ticks.max()) if ticks.size else None,
        "num_long_ticks": int((ticks >= LONG_TICK_S * 1e3).sum()),
        "long_ticks_ms": float(ticks[ticks >= LONG_TICK_S * 1e3].sum()),
    }
    parts.sort(key=lambda p: p[0])
    slow = parts[len(parts) - max(1, round(len(parts) * slow_share)) :] if parts else []
    for name, group in (("all", parts), ("slowest", slow)):
        for i, key in enumerate(keys):
            values = [p[i] * 1e3 for p in group if p[i] is not None]
            out[f"{name}_{key}_p50_ms"] = _median(values)
    out["window"] = window(log, traces) if SAME_CLOCK else None
    return out


def window(log: StepLog, traces: list, k: int = 3) -> dict[str, Any] | None:
    """The slowest first token's wait (arrival to first token), widened by each other of the
    ``k`` slowest whose wait overlaps it (one burst; a slow first token elsewhere in the run is
    only named, in ``elsewhere``), in ms from its start: each request arriving in it (id,
    prompt tokens, TTFT), each prompt step folded back in it (lane, tokens, the prompts it
    ended, what the backlog-fuse rule read as it was planned), and the decode and verify
    lanes' busy share of it. Each arrival also says when the engine queued it (its own
    arrival stamp, which the prompt lanes' rules read: ``queued +ms`` after the client's);
    ``ticks`` lists the dispatcher ticks of 2 ms or more (their awaits included) and
    ``loop_late`` the event loop's wake-ups 2 ms or more late (``StepLog.attach`` with a
    loop). Arrivals, ticks and wake-ups are listed from the launch of the prompt step in
    flight as the span opens (what the burst's first prompts queued behind), at negative ms.
    Needs the client's and the engine's clocks to be one."""
    ranked = sorted((t for t in traces if t.ttft_s is not None), key=lambda t: -t.ttft_s)[:k]
    if not ranked:
        return None
    timed, rest = ranked[:1], ranked[1:]
    t0, t1 = timed[0].arrival, timed[0].deltas[0][0]
    grown = True
    while grown:  # widen until no other slow wait overlaps the span
        grown = False
        for t in list(rest):
            if t.arrival <= t1 and t.deltas[0][0] >= t0:
                timed.append(t)
                rest.remove(t)
                t0, t1 = min(t0, t.arrival), max(t1, t.deltas[0][0])
                grown = True
    span = FoldedStep("window", t0, t1, 0)
    lead = min([t0] + [s.start for s in log.steps
                       if s.lane in PROMPT_LANES and s.start < t0 < s.end])  # fmt: skip
    queued = {rid: arrived for s in log.steps for rid, arrived, _ in s.prompts_done}
    arrivals = [
        f"{(t.arrival - t0) * 1e3:+.1f} arrive {t.request_id} {t.prompt_len} tok"
        f" (TTFT {t.ttft_s * 1e3:.1f} ms"
        + (f", queued +{(queued[t.request_id] - t.arrival) * 1e3:.1f} ms)"
           if t.request_id in queued else ")")
        for t in sorted(traces, key=lambda t: t.arrival)
        if lead <= t.arrival <= t1 and t.ttft_s is not None
    ]  # fmt: skip
    steps = [
        f"{(s.start - t0) * 1e3:+.1f}..{(s.end - t0) * 1e3:+.1f} {s.lane} {s.num_tokens} tok"
        + (f" ends {','.join(rid for rid, _, _ in s.prompts_done)}" if s.prompts_done else "")
        + (f" [{s.fuse}]" if s.fuse else "")
        for s in sorted(log.steps, key=lambda s: s.start)
        if s.lane in PROMPT_LANES and s.end > t0 and s.start < t1
    ]
    decode = [s for s in log.steps if s.lane in ("decode", "verify")]
    return {
        "slowest": [t.request_id for t in timed],
        "elsewhere": [t.request_id for t in rest],
        "span_ms": (t1 - t0) * 1e3,
        "decode_busy_share": _overlap(span, decode),
        "prompt_busy_share": _overlap(span, [s for s in log.steps if s.lane in PROMPT_LANES]),
        "arrivals": arrivals,
        "prompt_steps": steps,
        "ticks": [f"{(a - t0) * 1e3:+.1f} tick {d * 1e3:.1f} ms" for a, d in log.long_ticks
                  if a < t1 and a + d > lead],
        "loop_late": [f"{(a - t0) * 1e3:+.1f} loop {d * 1e3:.1f} ms late"
                      for a, d in log.loop_lags if lead <= a < t1],
    }  # fmt: skip
