"""Where the decode tail comes from (issue 14 diagnostics, ``mixed.py --sweep --itl-anatomy``).

Every token a client receives is an ITL sample: its delta's gap over the delta's tokens, as in
``loadgen.itl_quantiles``. Each delta is matched to the lane step that handed it over (the last
step folded back in before the delta that held the request, from ``ttft_anatomy.StepLog``) and
takes that step's role for the request (``ttft_anatomy.ROLES``: plain, rider, spec,
catch_up); a gap is ``shared`` when a prompt step was in flight during part of it (the GPU
then ran the decode work beside a prefill chunk). Per row ``anatomy`` gives

- of the tail (the tokens at or above the row's ITL p99): the share of each role, alone and
  shared, and the median gap, delivering step and wait before that step's launch;
- of all tokens: each role's share and its own p99, and the share of shared gaps.

So a p99 that trails another mode's can be read: its slow tokens are speculative rounds or
plain steps, beside a prompt step or not, the step itself long or the wait for it.
"""

from __future__ import annotations

import bisect
from typing import Any

import numpy as np
from ttft_anatomy import PROMPT_LANES, ROLES, SAME_CLOCK, FoldedStep, StepLog, _overlap


def _deliveries(log: StepLog) -> dict[str, tuple[list[float], list[FoldedStep]]]:
    """Per request, the fold-back times of the decode steps that held it, in order."""
    out: dict[str, tuple[list[float], list[FoldedStep]]] = {}
    for s in log.steps:
        for rid in s.rows:
            ends, steps = out.setdefault(rid, ([], []))
            ends.append(s.end)
            steps.append(s)
    return out


def samples(log: StepLog, traces: list) -> list[tuple]:
    """One entry per delta after a request's first: (gap s, tokens, role, shared, delivering
    step s, wait s = gap minus the step, gap start, gap end, request id, the step). A delta no
    logged step explains has role None."""
    by_req = _deliveries(log)
    prompts = [s for s in log.steps if s.lane in PROMPT_LANES]
    out = []
    for t in traces:
        ends, steps = by_req.get(t.request_id, ([], []))
        for (t0, _), (t1, n) in zip(t.deltas, t.deltas[1:], strict=False):
            i = bisect.bisect_right(ends, t1) - 1
            step = steps[i] if i >= 0 and ends[i] > t0 else None
            role = step.rows[t.request_id] if step is not None else None
            gap = FoldedStep("gap", t0, t1, 0)
            shared = _overlap(gap, prompts) > 0.0
            dur = step.end - step.start if step is not None else float("nan")
            out.append((t1 - t0, n, role, shared, dur, t1 - t0 - dur, t0, t1, t.request_id, step))
    return out


def anatomy(log: StepLog, traces: list, tail_q: float = 99.0) -> dict[str, Any] | None:
    """The row's ITL samples by role and prompt-step company (module docstring); None where
    the client's clock is not the engine's (the deltas cannot be matched to steps)."""
    if not SAME_CLOCK:
        return None
    rows = samples(log, traces)
    if not rows:
        return {"num_tokens": 0}
    per_token = np.repeat([g / n for g, n, *_ in rows], [n for _, n, *_ in rows])
    weight = np.asarray([n for _, n, *_ in rows], dtype=float)
    value = np.asarray([g / n for g, n, *_ in rows])
    role = [r[2] or "unmatched" for r in rows]
    shared = np.asarray([r[3] for r in rows])
    p99 = float(np.percentile(per_token, tail_q))
    tail = value >= p99
    out: dict[str, Any] = {
        "num_tokens": int(weight.sum()),
        "itl_p99_ms": p99 * 1e3,
        "num_tail_tokens": int(weight[tail].sum()),
        "shared_share": float(weight[shared].sum() / weight.sum()),
    }
    tail_w = weight[tail].sum()
    for name in (*ROLES, "unmatched"):
        mine = np.asarray([r == name for r in role])
        if not mine.any():
            continue
        out[f"{name}_share"] = float(weight[mine].sum() / weight.sum())
        mine_tokens = np.repeat(value[mine], weight[mine].astype(int))
        out[f"{name}_p99_ms"] = float(np.percentile(mine_tokens, tail_q)) * 1e3
        for flag, label in ((True, "shared"), (False, "alone")):
            sel = tail & mine & (shared == flag)
            if sel.any():
                out[f"tail_{name}_{label}_share"] = float(weight[sel].sum() / tail_w)
    picked = [r for r, t in zip(rows, tail, strict=True) if t]
    for i, key in ((0, "gap"), (4, "step"), (5, "wait")):
        vals = [r[i] * 1e3 for r in picked if r[i] == r[i]]  # NaN: no step matched
        out[f"tail_{key}_p50_ms"] = float(np.median(vals)) if vals else None
    out["worst"] = worst(log, rows)
    out["tpot_tail"] = tpot_tail(rows, traces)
    return out


def tpot_tail(rows: list[tuple], traces: list, k: int = 5) -> list[dict[str, Any]]:
    """The ``k`` slowest requests by TPOT, each gap with the step that ended it: [ms from the
    request's arrival to the gap's end, gap ms, tokens, role, shared, the step's lane, its
    tokens, its ms]. Set beside the same requests' deltas in a peer's run of the trace
    (``bench/tpot_pairs.py``), it says which of our steps the lost time went to."""
    by_req: dict[str, list[tuple]] = {}
    for r in rows:
        by_req.setdefault(r[8], []).append(r)
    slow = sorted((t for t in traces if t.tpot_s is not None), key=lambda t: -t.tpot_s)[:k]
    return [
        {
            "request_id": t.request_id,
            "tpot_ms": _ms(t.tpot_s),
            "gaps": [_gap_row(r, t.arrival) for r in by_req.get(t.request_id, [])],
        }
        for t in slow
    ]


def _ms(s: float) -> float | None:
    return round(s * 1e3, 3) if s == s else None  # NaN: no step matched


def _gap_row(r: tuple, arrival: float) -> list:
    gap, n, role, shared, dur, _, _, end, _, step = r
    lane, tokens = (step.lane, step.num_tokens) if step is not None else (None, None)
    return [_ms(end - arrival), _ms(gap), n, role, bool(shared), lane, tokens, _ms(dur)]


def worst(log: StepLog, rows: list[tuple], k: int = 12) -> list[dict[str, Any]]:
    """The ``k`` slowest tokens (by their delta's gap per token), each with what the engine
    did during its gap: the delivering step, the prompt steps' share, the longest dispatcher
    tick, and every launch (lane, rows/drafted, the policy's reason, host ms of the launch)
    and fold-back in it, in ms from the gap's start."""
    out = []
    prompts = [s for s in log.steps if s.lane in PROMPT_LANES]
    slowest = sorted(rows, key=lambda r: (-round(r[0] / r[1], 9), r[7]))[:k]  # ties: earlier
    for gap, n, role, _, dur, wait, t0, t1, rid, step in slowest:
        span = FoldedStep("gap", t0, t1, 0)
        ticks = [d for a, d in log.long_ticks if a < t1 and a + d > t0]
        events = [
            (
                a,
                f"{(a - t0) * 1e3:+.1f} launch {lane} {rows_}/{drafted}"
                + (f" {reason}" if reason else "")
                + f" ({(b - a) * 1e3:.1f} ms)",
            )
            for a, b, lane, rows_, drafted, reason in log.launches
            if t0 <= a <= t1
        ]
        events += [
            (
                s.end,
                f"{(s.end - t0) * 1e3:+.1f} fold {s.lane} {len(s.rows) or s.num_tokens}"
                + f" ({(s.end - s.start) * 1e3:.1f} ms)",
            )
            for s in log.steps
            if t0 < s.end <= t1
        ]
        out.append({
            "request_id": rid, "role": role, "gap_ms": gap * 1e3, "tokens": n,
            "step_lane": step.lane if step is not None else None,
            "step_ms": dur * 1e3 if dur == dur else None,
            "wait_ms": wait * 1e3 if wait == wait else None,
            "prompt_ms": _overlap(span, prompts) * gap * 1e3,
            "tick_max_ms": max(ticks, default=0.0) * 1e3,
            "events": [e for _, e in sorted(events)],
        })  # fmt: skip
    return out
