"""Where the host's time goes while ``bench/mixed.py`` runs: wraps the engine's and lanes' step
methods (class level, so every engine of the run) and records each call that holds the host
for at least ``SLOW_S``, each slow ``ModelRunner.launch`` with what it launched, and every GC
pause of a millisecond or more; every call's time goes into percentiles by method. Wrapping
costs ~1 µs a call: do not read the run's latencies as a clean measurement. Arguments are
bench/mixed.py's; the summary goes to stdout and to ``host-diag-<device>-<tag>.json`` beside
mixed.py's result (``--out``). With ``--cprofile`` the drafting launches, the plain ones, the
chained drafting and the proposals are each profiled (cProfile, on only inside those calls,
which slows them by about a fifth) into ``host-diag-<device>-<tag>.pstats.txt``::

    python bench/host_diag.py --sweep --rates 2 --modes policy ... --tag T --out DIR [--cprofile] \
        [--slow-callbacks MS]

With ``--slow-callbacks MS`` the engines' loops run in asyncio's debug mode and every callback
that holds the loop for MS or more is kept, named (``bench/loop_callbacks.py``), under
``slow_callbacks``.

A diagnostic for the ITL tail's "slow launches" (docs/performance.md), not a benchmark.
"""

from __future__ import annotations

import collections
import contextlib
import cProfile
import functools
import gc
import inspect
import io
import itertools
import json
import pstats
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import mixed  # noqa: E402
from bench.common import device_slug  # noqa: E402
from bench.loop_callbacks import SlowCallbacks  # noqa: E402
from verifypd.controller import goodput  # noqa: E402
from verifypd.engine import (  # noqa: E402
    chained_drafts,
    core,
    draft_catch_up,
    runner,
    scheduler,
    speculative,
)
from verifypd.kvcache import manager  # noqa: E402
from verifypd.lanes import deltas, dispatcher, spec_policy  # noqa: E402

SLOW_S = 3e-3
# --cprofile: the calls profiled, each kind on its own (a drafting launch, a plain launch, the
# next round's drafts made behind a verify, the drafting of a round: catch-up feeds included,
# and each piece of a prompt step enqueued in pieces, EngineConfig.prefill_slice_layers)
PROFILED = ("launch+drafts", "launch", "DraftChainer.chain", "SpeculationPolicy.propose",
            "launch_iter")  # fmt: skip
WRAPPED = [
    (dispatcher.LaneDispatcher, ("_plan", "_draft", "_fold", "_report", "_mark_contention")),
    (spec_policy.SpeculationPolicy, ("decide", "propose", "after_launch", "step_landed")),
    (deltas.Deltas, ("emit", "settle", "landed")),
    (core.EngineCore, ("apply_step", "record_step")),
    (speculative.DraftModelProposer,
     ("propose", "chain", "confirm", "_draft_step", "_prepare_view", "_attach")),
    (manager.KVCacheManager, ("allocate", "truncate")),
    (chained_drafts.DraftChainer, ("adopt", "chain", "confirm")),
    (runner.ModelRunner, ("prepare", "logits")),
    (scheduler.Scheduler, ("plan_decode", "plan_prefill", "begin_step", "plan_ahead")),
    (goodput.GoodputPolicy, ("decide",)),
]  # fmt: skip
# module functions, wrapped in the module that calls them (its name for them)
WRAPPED_FUNCTIONS = [
    (speculative, ("chunked_catch_up", "uniform_catch_up", "wait_for_follow")),
    (draft_catch_up, ("replay",)),
]
SLOW_INSIDE_KEPT = 40  # per outer method, the slowest calls whose inside is kept


class HostLog:
    def __init__(self, profile: bool = False) -> None:
        # --cprofile: one profiler per kind of call below, on only inside such calls
        self.profiles = {k: cProfile.Profile() for k in PROFILED} if profile else {}
        self._profiling = False
        self.slow: dict[str, list[float]] = collections.defaultdict(list)
        self.took: dict[str, list[float]] = collections.defaultdict(list)  # every call, s
        self.launches: list[dict[str, Any]] = []
        self.pieces: list[dict[str, Any]] = []  # slow pieces of steps launched in pieces
        self.gc_pauses: list[tuple[int, float]] = []
        self._gc_start: float | None = None
        self._saved: list[tuple[Any, str, Any]] = []
        # the wrapped calls under way, each with its wrapped calls' time inside it (s, by key)
        self._open: list[dict[str, float]] = []
        self.inside: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)

    def timed(self, key: str, f):
        @functools.wraps(f)
        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            self._open.append({})
            try:
                with self._profiled(key):
                    return f(*args, **kwargs)
            finally:
                took = time.perf_counter() - t
                self.took[key].append(took)
                self._close(key, took)
                if took >= SLOW_S:
                    self.slow[key].append(round(took * 1e3, 2))

        return wrapper

    def _close(self, key: str, took: float) -> None:
        """Ends the innermost open call: its time goes into its caller's inside, and a slow
        call keeps its own (the wrapped calls directly inside it, and the rest as "self")."""
        inside = self._open.pop()
        if self._open:
            self._open[-1][key] = self._open[-1].get(key, 0.0) + took
        if took < SLOW_S:
            return
        ms = {k: round(v * 1e3, 2) for k, v in sorted(inside.items(), key=lambda kv: -kv[1])}
        ms["self"] = round((took - sum(inside.values())) * 1e3, 2)
        kept = self.inside[key]
        kept.append({"ms": round(took * 1e3, 2), "inside_ms": ms})
        if len(kept) > 2 * SLOW_INSIDE_KEPT:  # keep the slowest, in bounded memory
            kept.sort(key=lambda c: -c["ms"])
            del kept[SLOW_INSIDE_KEPT:]

    def install(self) -> None:
        """Wraps the methods (``uninstall`` puts them back)."""
        self._saved = []
        for cls, names in [*WRAPPED, (runner.ModelRunner, ("launch",))]:
            for name in names:
                f = cls.__dict__[name]
                if inspect.iscoroutinefunction(f):  # awaits yield: not host time of its own
                    continue
                self._saved.append((cls, name, f))
                key = f"{cls.__name__}.{name}"
                setattr(cls, name, self._launch(f) if name == "launch" else self.timed(key, f))
        f = runner.ModelRunner.__dict__["launch_iter"]
        self._saved.append((runner.ModelRunner, "launch_iter", f))
        runner.ModelRunner.launch_iter = self._launch_iter(f)
        for module, names in WRAPPED_FUNCTIONS:
            for name in names:
                f = getattr(module, name)
                self._saved.append((module, name, f))
                setattr(module, name, self.timed(name, f))
        gc.callbacks.append(self._gc)

    def uninstall(self) -> None:
        for cls, name, f in self._saved:
            setattr(cls, name, f)
        self._saved = []
        if self._gc in gc.callbacks:
            gc.callbacks.remove(self._gc)

    def _launch(self, f):
        @functools.wraps(f)
        def launch(model_runner, plan):
            t = time.perf_counter()
            drafted = any(e.draft_token_ids for e in plan.seqs)
            kind = plan.lane + ("+drafts" if drafted else "")
            self._open.append({})
            try:
                with self._profiled("launch+drafts" if drafted else "launch"):
                    return f(model_runner, plan)
            finally:
                took = time.perf_counter() - t
                self.took[f"ModelRunner.launch[{kind}]"].append(took)
                self._close(f"ModelRunner.launch[{kind}]", took)
                if took >= SLOW_S:
                    self.launches.append({
                        "ms": round(took * 1e3, 2), "lane": plan.lane, "rows": len(plan.seqs),
                        "tokens": plan.num_tokens, "carries_prompt": bool(plan.carries_prompt),
                        "drafts": sum(len(e.draft_token_ids) for e in plan.seqs),
                        "ahead_rows": sum(e.is_ahead for e in plan.seqs),
                        # graph replays so far: a count that stays put across slow launches
                        # places them before serving (the start-up's calibration)
                        "graph_steps_so_far": model_runner.num_graph_steps,
                    })  # fmt: skip

        return launch

    def _launch_iter(self, f):
        """Times each piece of a step launched in pieces (``ModelRunner.launch_iter``: the
        event loop runs between them, not inside one); the slow ones are kept in order."""

        @functools.wraps(f)
        def launch_iter(model_runner, plan, every=0):
            pieces = f(model_runner, plan, every)
            key = f"ModelRunner.launch_iter[{plan.lane}]"
            for index in itertools.count():
                t = time.perf_counter()
                self._open.append({})
                done = False
                try:
                    with self._profiled("launch_iter"):
                        next(pieces)
                except StopIteration as stop:
                    done, value = True, stop.value
                finally:
                    took = time.perf_counter() - t
                    self.took[key].append(took)
                    self._close(key, took)
                    if took >= SLOW_S:
                        self.pieces.append({
                            "ms": round(took * 1e3, 2), "lane": plan.lane, "piece": index,
                            "last": done, "rows": len(plan.seqs), "tokens": plan.num_tokens,
                        })  # fmt: skip
                if done:
                    return value
                yield

        return launch_iter

    @contextlib.contextmanager
    def _profiled(self, key: str):
        """Profiles the call with ``key``'s profiler (--cprofile), unless one already runs."""
        prof = self.profiles.get(key)
        if prof is None or self._profiling:
            yield
            return
        self._profiling = True
        prof.enable()
        try:
            yield
        finally:
            prof.disable()
            self._profiling = False

    def profile_text(self, top: int = 40) -> str:
        """Each profiler's heaviest functions, by own time and by cumulative time."""
        out = io.StringIO()
        for key, prof in self.profiles.items():
            for order in ("tottime", "cumulative"):
                out.write(f"==== {key}, by {order} ====\n")
                if not prof.getstats():
                    out.write("no calls\n")
                    continue
                pstats.Stats(prof, stream=out).sort_stats(order).print_stats(top)
        return out.getvalue()

    def _gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        elif self._gc_start is not None:
            took, self._gc_start = time.perf_counter() - self._gc_start, None
            if took >= 1e-3:
                self.gc_pauses.append((info.get("generation", -1), round(took * 1e3, 2)))

    def summary(self) -> dict[str, Any]:
        slow = {
            k: {"calls": len(self.took[k]), "slow": len(v), "max_ms": max(v),
                "slowest_ms": sorted(v)[-15:]}
            for k, v in self.slow.items()
        }  # fmt: skip
        every = {}
        for k, v in sorted(self.took.items()):
            ms = np.asarray(v) * 1e3
            every[k] = {"calls": len(v), "total_ms": round(float(ms.sum()), 1),
                        **{f"p{q}_ms": round(float(np.percentile(ms, q)), 3) for q in (50, 90, 99)},
                        "max_ms": round(float(ms.max()), 3)}  # fmt: skip
        inside = {
            k: sorted(v, key=lambda c: -c["ms"])[:SLOW_INSIDE_KEPT] for k, v in self.inside.items()
        }
        return {"slow_s": SLOW_S, "every_call": every, "slow_calls": slow,
                "slow_inside": inside, "slow_launches": self.launches,
                "slow_pieces": self.pieces,
                "gc_pauses_ms": self.gc_pauses}  # fmt: skip


# in the file, not printed
_LONG = ("slow_launches", "slow_inside", "slow_pieces", "slow_callbacks")


def inside_summed(inside: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, float]]:
    """Per method, its kept slow calls' inside summed over them (the calls' count, their
    total, and each inner call's share of it in ms)."""
    out = {}
    for key, calls in inside.items():
        summed: dict[str, float] = collections.Counter()
        for c in calls:
            summed.update(c["inside_ms"])
        out[key] = {"calls": len(calls), "ms": round(sum(c["ms"] for c in calls), 2),
                    **{k: round(v, 2) for k, v in summed.most_common()}}  # fmt: skip
    return out


def _own_options(argv: list[str]) -> tuple[bool, float | None, list[str]]:
    """``--cprofile`` and ``--slow-callbacks MS`` (ours), and the rest (bench/mixed.py's)."""
    profile, slow_ms, rest = False, None, []
    args = iter(argv)
    for a in args:
        if a == "--cprofile":
            profile = True
        elif a == "--slow-callbacks":
            slow_ms = float(next(args, "nan"))
            if not slow_ms > 0:
                raise SystemExit("--slow-callbacks takes a threshold in ms above 0")
        else:
            rest.append(a)
    return profile, slow_ms, rest


def main(argv: list[str] | None = None) -> dict[str, Any]:
    profile, slow_ms, argv = _own_options(sys.argv[1:] if argv is None else argv)
    log = HostLog(profile)
    log.install()
    slow = SlowCallbacks(slow_ms / 1e3) if slow_ms else None
    if slow is not None:
        slow.install()
    try:
        report = mixed.main(argv)
    finally:
        log.uninstall()
        if slow is not None:
            slow.uninstall()
    out = {key: report.get(key) for key in ("device", "git_commit", "date_utc")}
    out["command"] = " ".join(["python bench/host_diag.py", *argv])
    out.update(log.summary())
    if slow is not None:
        out["slow_callbacks"] = slow.summary()
    args = mixed.parse_args(argv)
    stem = f"host-diag-{device_slug(out['device'] or 'unknown')}-{args.tag or 'run'}"
    path = Path(args.out) / f"{stem}.json"
    path.write_text(json.dumps(out, indent=1))
    if profile:
        (Path(args.out) / f"{stem}.pstats.txt").write_text(log.profile_text())
    print(json.dumps({k: v for k, v in out.items() if k not in _LONG}, indent=1))
    print(json.dumps({"slow_inside_summed_ms": inside_summed(out["slow_inside"])}, indent=1))
    print(f"[host_diag] wrote {path}")
    return out


if __name__ == "__main__":
    main()
