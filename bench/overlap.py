"""Do the lanes overlap? Decode-step latency while a verify pass is in flight on the
lower-priority stream, against the fused single-lane batch and decode queued behind verify.

The real engine pieces: ``EngineCore`` (dummy:qwen2.5-7b, bf16, Triton ops, decode CUDA graphs
captured as the engine captures them), ``ModelRunner.launch`` (prepare + forward + sample; a
verify plan runs eager, a decode plan replays its graph) and ``LaneStreams`` (decode > verify >
prefill stream priorities). For every batch B: B decoding sequences, and B other sequences with
L random drafts each (a verify pass: 1 + L query tokens per sequence), all prefilled to
--context tokens. Results are never folded back (no ``scheduler.update``): every repetition runs
the same positions, so contexts never grow.

Per repetition (medians over --repeats after --warmup), decode latency = from the decode's
arrival to the end of its step:
  alone       decode step on the decode stream, nothing else running
  overlap     verify launched on the verify stream, then decode on the decode stream
  fused       decode and verify entries in ONE step (the single-lane design)
  sequential  verify, then decode on one stream (decode waits behind verify)
  verify      verify step alone (what overlapping costs the verify pass)
Two timings:
  real    launched as the dispatcher launches them: the host enqueues verify (eager forward),
          then decode; decode arrives when its launch starts (CUDA events on an idle stream).
  queued  every step of a measurement is enqueued behind a spin kernel and released at once:
          device-side contention only, as in DESIGN.md's measured premise (an MLP stand-in).

    python bench/overlap.py
    python bench/overlap.py --device cpu --model dummy:tiny --batches 1 2 --context 16 \
        --repeats 2 --warmup 1
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

import numpy as np  # noqa: E402
import torch  # noqa: E402
from common import (  # noqa: E402
    add_common_args,
    csv_list,
    error_record,
    format_table,
    progress,
    start_run,
    sync,
)
from harness import blocks_for, engine_config, engine_info  # noqa: E402
from overlap_report import (  # noqa: E402
    DESIGN_PREMISE,
    HEADERS,
    METHOD,
    plot,
    progress_view,
    summarize,
    summary_rows,
)

from verifypd.engine.core import EngineCore  # noqa: E402
from verifypd.kernels import REFERENCE_OPS  # noqa: E402
from verifypd.lanes.executor import LaneStreams  # noqa: E402
from verifypd.types import SamplingParams, ScheduledSeq, SeqStatus, Sequence, SpecDecision, StepPlan  # noqa: E402

SCRIPT = "overlap"
KINDS = ("alone", "overlap", "fused", "sequential", "verify")
TIMINGS = ("real", "queued")
MAX_GATE_TRIES = 6  # the gate doubles its hold each time the host was slower than it ...
MAX_GATE_MS = 400.0  # ... up to this (a host sync inside a launch would never be held)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="dummy:qwen2.5-7b")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--draft-len", type=int, default=4, help="L: verify = 1 + L tokens per seq")
    p.add_argument("--verify-batch", type=int, default=0, help="verify seqs; 0 = decode batch")
    p.add_argument("--context", type=int, default=512, help="prompt tokens of every sequence")
    p.add_argument("--repeats", type=int, default=20, help="median over this many")
    p.add_argument("--warmup", type=int, default=3, help="unrecorded repetitions per batch")
    p.add_argument("--timings", type=csv_list, default=list(TIMINGS), help="real,queued")
    p.add_argument("--gate-ms", type=float, default=40.0, help="queued: initial spin hold")
    p.add_argument("--use-triton", type=int, choices=[0, 1], default=None, help="default: engine")
    p.add_argument("--cuda-graphs", type=int, choices=[0, 1], default=None, help="default: engine")
    add_common_args(p)
    args = p.parse_args(argv)
    if set(args.timings) - set(TIMINGS):
        p.error(f"--timings: choose from {TIMINGS}")
    return args


# ----------------------------------------------------------------------------- workload
def build_core(args: argparse.Namespace) -> EngineCore:
    """An engine sized for 2 x max batch sequences; decode graphs captured up to max batch."""
    num_seqs = 2 * max(max(args.batches), args.verify_batch)
    engine_kw = {"cuda_graphs": False}  # captured below, for the decode batch sizes only
    if args.use_triton is not None:
        engine_kw["use_triton"] = bool(args.use_triton)
    cfg = engine_config(
        args.model, args.device, args.dtype, args.seed,
        max_num_seqs=num_seqs,
        max_num_batched_tokens=max(8192, args.context + 1),
        max_model_len=args.max_model_len,
        num_blocks=blocks_for(num_seqs, args.context + args.draft_len + 2),
        prefix_caching=False,
        **engine_kw,
    )  # fmt: skip
    core = EngineCore(cfg)
    graphs = args.cuda_graphs
    if graphs is None:
        graphs = core.device.type == "cuda" and core.ops is not REFERENCE_OPS
    if graphs:
        core.runner.capture_graphs(1, max(args.batches), core.max_model_len)
    return core


def prefill(core: EngineCore, num_seqs: int, context: int, extra: int, rng) -> list[Sequence]:
    """Adds ``num_seqs`` random prompts and runs prefill steps until every one decodes."""
    vocab = core.model_config.vocab_size
    params = SamplingParams(max_tokens=extra, temperature=0.0, ignore_eos=True)
    seqs = []
    for i in range(num_seqs):
        seqs += core.add_request(f"overlap-{i}", rng.integers(0, vocab, context).tolist(), params)
    sched = core.scheduler
    while any(s.status is not SeqStatus.DECODING for s in seqs):
        entries = sched.plan_prefill(sched.max_num_batched_tokens, sched.max_num_seqs)
        if not entries:
            raise RuntimeError("prefill stalled: no room in the KV cache")
        plan = StepPlan("prefill", entries)
        sched.begin_step(plan)
        core.finish_step(plan, core.runner.execute(plan))
    return seqs


@dataclass
class Plans:
    decode: StepPlan  # B entries of 1 token
    verify: StepPlan  # B entries of 1 + L tokens
    fused: StepPlan  # both in one batch (the single-lane design)


class Workload:
    """Decoding sequences and verifying sequences (blocks for 1 + L reserved), as plans."""

    def __init__(self, core: EngineCore, seqs: list[Sequence], draft_len: int, rng) -> None:
        half = len(seqs) // 2
        self.decoders, self.verifiers = seqs[:half], seqs[half:]
        lens = SpecDecision({s.seq_id: draft_len for s in self.verifiers})
        entries = core.scheduler.plan_decode(lens)
        if len(entries) != len(seqs) or core.scheduler.num_preemptions:
            raise RuntimeError("could not reserve 1 + L slots for every verifying sequence")
        vocab = core.model_config.vocab_size
        self.drafts = {s.seq_id: rng.integers(0, vocab, draft_len).tolist() for s in seqs}

    def plans(self, batch: int, verify_batch: int) -> Plans:
        decode = [ScheduledSeq(s, 1) for s in self.decoders[:batch]]
        verify = [ScheduledSeq(s, 1, self.drafts[s.seq_id]) for s in self.verifiers[:verify_batch]]
        return Plans(
            StepPlan("decode", decode),
            StepPlan("verify", verify),
            StepPlan("mixed", decode + verify),
        )


# ----------------------------------------------------------------------------- timing
class Gate:
    """Queued timing: holds streams until every step of a measurement is enqueued (a spin
    kernel on a side stream, then an event the held streams wait on). No-op on CPU."""

    def __init__(self, device: torch.device, hold_ms: float) -> None:
        self.is_cuda = device.type == "cuda"
        self.hold_ms = hold_ms
        self.stream = torch.cuda.Stream(device) if self.is_cuda else None
        self.cycles_per_ms = self._calibrate() if self.is_cuda else 0.0

    @staticmethod
    def _calibrate() -> float:
        torch.cuda._sleep(1000)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(10_000_000)
        end.record()
        end.synchronize()
        return 10_000_000 / start.elapsed_time(end)

    def close(self) -> torch.cuda.Event | None:
        if not self.is_cuda:
            return None
        event = torch.cuda.Event()
        with torch.cuda.stream(self.stream):
            torch.cuda._sleep(int(self.hold_ms * self.cycles_per_ms))
            event.record()
        return event

    @staticmethod
    def held(event: torch.cuda.Event | None) -> bool:
        """True while the gate has not opened yet (so nothing it holds has started)."""
        return event is None or not event.query()


class StepTimer:
    """Launches plans on lane streams and timestamps them on the device timeline (CUDA events;
    the host clock on CPU, where steps run synchronously and nothing overlaps)."""

    def __init__(self, core: EngineCore, gate_ms: float) -> None:
        self.runner = core.runner
        self.device = core.device
        self.is_cuda = core.device.type == "cuda"
        self.streams = LaneStreams(core.device)
        self.marker = torch.cuda.Stream(core.device) if self.is_cuda else None  # stays idle
        self.gate = Gate(core.device, gate_ms)

    def mark(self, stream: torch.cuda.Stream | None = None) -> Any:
        if not self.is_cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        return event

    def ms(self, a: Any, b: Any) -> float:
        return a.elapsed_time(b) if self.is_cuda else (b - a) * 1e3

    def arrival(self, gate: torch.cuda.Event | None) -> Any:
        """A decode's arrival: now (real) or when the gate opens (queued), on an idle stream."""
        if gate is not None:
            self.marker.wait_event(gate)
        return self.mark(self.marker)

    def launch(self, lane: str, plan: StepPlan, gate, out: dict[str, Any], name: str) -> None:
        """Launches ``plan`` on ``lane``'s stream; ``out`` gets the start/end marks, the host
        seconds of the launch and the pending step under ``name``."""
        with self.streams.context(lane):
            if gate is not None:
                torch.cuda.current_stream().wait_event(gate)
            out[f"{name}_start"] = self.mark()
            t = time.perf_counter()
            out[f"{name}_pending"] = self.runner.launch(plan)
            out[f"{name}_host_ms"] = (time.perf_counter() - t) * 1e3
            out[f"{name}_end"] = self.mark()


def enqueue(kind: str, timer: StepTimer, plans: Plans, gate) -> dict[str, Any]:
    """The steps of one measurement; "d_arrival" marks when the decode tokens arrive."""
    out: dict[str, Any] = {}
    if kind == "verify":
        timer.launch("verify", plans.verify, gate, out, "v")
        return out
    if kind == "overlap":
        timer.launch("verify", plans.verify, gate, out, "v")
    if kind == "sequential":  # one stream: decode waits behind verify
        timer.launch("decode", plans.verify, gate, out, "v")
    out["d_arrival"] = timer.arrival(gate)
    timer.launch("decode", plans.fused if kind == "fused" else plans.decode, gate, out, "d")
    return out


def measure(kind: str, timer: StepTimer, plans: Plans, queued: bool) -> dict[str, Any]:
    """One sample of ``kind``; queued samples retry with a longer hold if the gate opened
    before the host had enqueued everything."""
    for attempt in range(MAX_GATE_TRIES):
        sync(timer.device)
        t0 = timer.mark(timer.marker)
        gate = timer.gate.close() if queued else None
        out = enqueue(kind, timer, plans, gate)
        held = Gate.held(gate)
        sync(timer.device)
        tokens = {k: v.result() for k, v in out.items() if k.endswith("_pending")}
        if held or attempt == MAX_GATE_TRIES - 1 or timer.gate.hold_ms >= MAX_GATE_MS:
            break
        timer.gate.hold_ms = min(2 * timer.gate.hold_ms, MAX_GATE_MS)
    check_tokens(kind, plans, tokens)
    return sample_values(timer, t0, out) | {"gate_held": held}


def check_tokens(kind: str, plans: Plans, tokens: dict[str, list[list[int]]]) -> None:
    """Every sequence got what its step samples (1 token; 1 to L + 1 after a verify)."""
    for name, got in tokens.items():
        plan = plans.verify if name == "v_pending" else plans.decode
        if name == "d_pending" and kind == "fused":
            plan = plans.fused
        for entry, ids in zip(plan.seqs, got, strict=True):
            if not 1 <= len(ids) <= 1 + len(entry.draft_token_ids):
                raise RuntimeError(f"{kind}: {len(ids)} tokens for {entry.num_query_tokens} rows")


def sample_values(timer: StepTimer, t0: Any, out: dict[str, Any]) -> dict[str, Any]:
    """Marks -> ms since ``t0``; decode latency from arrival, verify latency, GPU overlap."""
    rel = {k: timer.ms(t0, v) for k, v in out.items() if k.endswith(("_start", "_end", "_arrival"))}
    vals: dict[str, Any] = {k: v for k, v in out.items() if k.endswith("_host_ms")}
    if "d_end" in rel:
        vals["decode_ms"] = rel["d_end"] - rel["d_arrival"]
    if "v_end" in rel:
        vals["verify_ms"] = rel["v_end"] - rel["v_start"]
    if "d_end" in rel and "v_end" in rel:
        vals["total_ms"] = max(rel["d_end"], rel["v_end"]) - min(rel["d_arrival"], rel["v_start"])
        vals["overlap_ms"] = max(
            0.0, min(rel["v_end"], rel["d_end"]) - max(rel["v_start"], rel["d_arrival"])
        )
        vals["verify_busy_at_arrival"] = rel["v_start"] <= rel["d_arrival"] < rel["v_end"]
    return vals


# ----------------------------------------------------------------------------- per batch
def bench_batch(timer: StepTimer, plans: Plans, args) -> dict[str, Any]:
    """Warm-up, then ``repeats`` rounds of every (timing, kind), interleaved against drift."""
    samples: dict[str, dict[str, list[dict[str, Any]]]] = {t: {} for t in args.timings}
    for rep in range(args.warmup + args.repeats):
        for timing in args.timings:
            for kind in KINDS:
                s = measure(kind, timer, plans, timing == "queued")
                if rep >= args.warmup:
                    samples[timing].setdefault(kind, []).append(s)
    return {t: summarize(samples[t]) for t in args.timings}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    run = start_run(SCRIPT, argv, parse_args, METHOD)
    args, report = run.args, run.report
    report["design_premise"] = DESIGN_PREMISE
    rng = np.random.default_rng(args.seed)
    core = build_core(args)
    num_seqs = 2 * max(max(args.batches), args.verify_batch)
    work = Workload(core, prefill(core, num_seqs, args.context, args.draft_len + 2, rng),
                    args.draft_len, rng)  # fmt: skip
    report["engine"] = engine_info(SimpleNamespace(core=core)) | {
        "front": "EngineCore + ModelRunner.launch",
        "cuda_graphs": core.runner.graphs is not None,
    }
    timer = StepTimer(core, args.gate_ms)
    for batch in args.batches:
        vb = args.verify_batch or batch
        try:
            r = {"batch": batch, "verify_batch": vb, "draft_len": args.draft_len}
            r |= bench_batch(timer, work.plans(batch, vb), args)
        except Exception as exc:  # noqa: BLE001 - one batch failing must not hide the rest
            r = error_record(exc)
        report["results"][str(batch)] = r
        report["gate_hold_ms"] = timer.gate.hold_ms
        view = progress_view(r, args.timings)
        progress(SCRIPT, f"B={batch}", view | {"error": r.get("error")}, tuple(view))
        run.save()
    table = format_table(HEADERS, summary_rows(report["results"], args.timings))
    table += f"\ncontext {args.context} tokens, L={args.draft_len}; ms = median decode latency"
    run.finish(table, lambda png: plot(png, report["results"], args.timings))
    return report


if __name__ == "__main__":
    main()
