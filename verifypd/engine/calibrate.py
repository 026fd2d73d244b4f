"""Start-up cost calibration: times real forwards of the target and the drafter, after the
CUDA graphs are captured, into a ``costs.CostTable`` (the speculation policy's prior).

What is timed, each point a warm-up then the median of ``repeats`` synchronized timings (CUDA
events on a GPU, wall time on the CPU):
- target: ``ModelRunner.launch`` + its result, the path of a step (graph replay where a graph
  exists, the verify's acceptance and the token copy-back included), for rows on a grid of
  powers of two up to ``max_num_seqs`` (decode, q = 1) and up to the verify graphs' batch limit
  (q = 1 + L for every L whose verify graph was captured; every L without graphs), plus two
  eager mixed shapes (query_len 0, see ``costs``);
- prefill: one sequence's chunk of 128 / 512 / 2048 tokens (at most max_num_batched_tokens);
- drafter: one single-token step (prepare, forward, argmax) at the decode grid.

Rows attend to a context of ``context_len`` tokens. Scratch KV: the context's blocks are taken
from the engine's KV manager (the drafter's, for the drafter) once and shared by every row
(forks: read only), each row writes its own tail blocks, freed after its point (the context's
at the end). The host's share of a step (preparing and uploading its inputs) is inside each
timing, as it is in the step times the lanes measure online.
Expected on an H100 for a 7B target with a 0.5B drafter at default flags (9 decode points, 4 x 7
verify points, 2 mixed, 3 prefill, 9 draft: ~50 points x 4 runs): about 2-2.5 s.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from verifypd.costs import MIXED, CostTable
from verifypd.engine.timing import Span
from verifypd.kvcache import KVCacheManager
from verifypd.types import SamplingParams, ScheduledSeq, Sequence, StepPlan

if TYPE_CHECKING:
    from verifypd.engine.runner import ModelRunner
    from verifypd.engine.setup import EngineParts

PREFILL_TOKENS = (128, 512, 2048)
MIXED_ROWS = (8, 32)
# The most rows a verify graph is captured for (engine.setup); larger verify batches are
# compute-bound and run eager. Calibration measures up to it without graphs too.
VERIFY_GRAPH_BATCH = 64


def row_grid(limit: int) -> list[int]:
    """1, 2, 4, ... up to ``limit``, and ``limit`` itself."""
    grid = [1 << k for k in range(limit.bit_length()) if 1 << k <= limit]
    return grid if grid[-1] == limit else [*grid, limit]


class ScratchKV:
    """Throwaway sequences over blocks borrowed from ``kv``: rows share one context of
    ``context_len`` tokens (a multiple of the block size, so the shared blocks are only read)
    and each gets its own blocks for the tokens it writes. ``free`` gives every block back."""

    def __init__(self, kv: KVCacheManager, context_len: int) -> None:
        self.kv = kv
        self.context: list[int] = []
        self.context_len = context_len if kv.allocate(self.context, context_len) else 0
        self.tables: list[list[int]] = []

    def rows(self, num_rows: int, query_len: int) -> list[Sequence] | None:
        """``num_rows`` sequences whose next ``query_len`` tokens follow the context; None if
        the pool has no room for their tails."""
        seqs = []
        for _ in range(num_rows):
            table = self.kv.fork(self.context)
            self.tables.append(table)
            if not self.kv.allocate(table, self.context_len + query_len):
                return None
            seqs.append(_seq(self.context_len + 1, self.context_len, table))
        return seqs

    def prompt(self, num_tokens: int) -> Sequence | None:
        """A sequence with ``num_tokens`` prompt tokens to prefill, none computed."""
        table: list[int] = []
        self.tables.append(table)
        if not self.kv.allocate(table, num_tokens):
            return None
        return _seq(num_tokens, 0, table)

    def free_rows(self) -> None:
        for table in self.tables:
            self.kv.free(table)
        self.tables = []

    def free(self) -> None:
        self.free_rows()
        self.kv.free(self.context)


def _seq(num_tokens: int, num_computed: int, table: list[int]) -> Sequence:
    seq = Sequence("calibrate", [0] * num_tokens, SamplingParams(temperature=0.0, ignore_eos=True))
    seq.num_computed_tokens = num_computed
    seq.block_table = table
    return seq


class PointTimer:
    """Median seconds of ``fn`` after a warm-up, each run synchronized."""

    def __init__(self, device: torch.device, repeats: int) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self.repeats = repeats

    def __call__(self, fn: Callable[[], object]) -> float:
        fn()
        times = []
        for _ in range(self.repeats):
            self._sync()
            span = Span(self.cuda)
            fn()
            span.stop()
            self._sync()
            times.append(span.seconds())
        return float(statistics.median(times))

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)


def measure_costs(core: EngineParts, context_len: int = 512, repeats: int = 3) -> CostTable:
    """Times the grid above on ``core``'s models; leaves their KV pools and step counters as
    they were (calibration is start-up work, not steps)."""
    t0 = time.perf_counter()
    timer = PointTimer(core.device, repeats)
    spec, sched = core.config.spec, core.config.scheduler
    max_q = 1 + (spec.max_draft_len if core.spec.enabled else 0)
    bs = core.block_size
    ctx = max(0, min(context_len, core.max_model_len - max_q - 1)) // bs * bs
    runners = [core.runner] + ([core.spec.drafter.runner] if core.spec.drafter else [])
    counters = [_counters(r) for r in runners]
    scratch = ScratchKV(core.kv, ctx)
    try:
        target = _target_points(core, scratch, timer, verify_widths(core))
        target.update(_mixed_points(core, scratch, timer))
        prefill = _prefill_points(core, scratch, timer)
    finally:
        scratch.free()
    draft = _draft_points(core, timer, ctx) if core.spec.drafter is not None else {}
    meta = {
        "repeats": repeats,
        "seconds": time.perf_counter() - t0,
        "device": str(core.device),
        "cuda_graphs": bool(core.runner.graphs),
        "max_num_seqs": sched.max_num_seqs,
    }
    for name, runner, saved in zip(("target", "draft"), runners, counters, strict=False):
        meta[f"{name}_graph_steps"] = runner.num_graph_steps - saved[0]  # warm-ups included
        meta[f"{name}_eager_steps"] = runner.num_eager_steps - saved[1]
        _restore_counters(runner, saved)
    mixed_len = spec.max_draft_len if any(q == MIXED for _, q in target) else 0
    return CostTable(target, prefill, draft, scratch.context_len, mixed_len, meta)


def mixed_rows(max_num_seqs: int) -> list[int]:
    """The eager mixed shapes' row counts: ``MIXED_ROWS`` that fit, else all the rows."""
    fit = [r for r in MIXED_ROWS if r <= max_num_seqs]
    return fit or ([max_num_seqs] if max_num_seqs >= 2 else [])


def verify_widths(core: EngineParts) -> list[int]:
    """q = 1 and the verify widths 1 + L that a step runs on a captured graph (all of them
    when no graphs were captured: every width then takes the same eager path)."""
    if not core.spec.enabled:
        return [1]
    widths = range(2, core.config.spec.max_draft_len + 2)
    graphs = core.runner.graphs
    return [1] + [q for q in widths if q in graphs or not graphs]


def _target_points(core, scratch: ScratchKV, timer: PointTimer, widths: list[int]) -> dict:
    max_seqs = core.config.scheduler.max_num_seqs
    out: dict[tuple[int, int], float] = {}
    for q in widths:
        graphs = core.runner.graphs.get(q)
        limit = max_seqs if q == 1 else min(max_seqs, VERIFY_GRAPH_BATCH)
        limit = graphs.max_batch if graphs is not None else limit
        for rows in row_grid(limit):
            seqs = scratch.rows(rows, q)
            if seqs is not None:
                plan = StepPlan("decode" if q == 1 else "verify", [_entry(s, q - 1) for s in seqs])
                out[(rows, q)] = timer(lambda p=plan: core.runner.launch(p).result())
            scratch.free_rows()
    return out


def _mixed_points(core, scratch: ScratchKV, timer: PointTimer) -> dict:
    """Eager mixed shapes: half the rows decode, the others verify max_draft_len drafts."""
    num_drafts = core.config.spec.max_draft_len
    if not core.spec.enabled or num_drafts < 1:
        return {}
    out = {}
    for rows in mixed_rows(core.config.scheduler.max_num_seqs):
        seqs = scratch.rows(rows, 1 + num_drafts)
        if seqs is not None:
            entries = [_entry(s, num_drafts if i >= rows // 2 else 0) for i, s in enumerate(seqs)]
            plan = StepPlan("mixed", entries)
            out[(rows, MIXED)] = timer(lambda p=plan: core.runner.launch(p).result())
        scratch.free_rows()
    return out


def _prefill_points(core, scratch: ScratchKV, timer: PointTimer) -> dict[int, float]:
    sched = core.config.scheduler
    limit = min(sched.max_num_batched_tokens, core.max_model_len - 1)
    out = {}
    for tokens in [n for n in PREFILL_TOKENS if n <= limit]:
        seq = scratch.prompt(tokens)
        if seq is not None:
            plan = StepPlan("prefill", [ScheduledSeq(seq, tokens)])
            out[tokens] = timer(lambda p=plan: core.runner.launch(p).result())
        scratch.free_rows()
    return out


def _draft_points(core, timer: PointTimer, ctx: int) -> dict[int, float]:
    """One drafter single-token step as a proposal runs it: prepare, forward (the q = 1 graph
    where it fits), argmax of the drafted token."""
    drafter = core.spec.drafter
    scratch = ScratchKV(drafter.kv, ctx)
    out = {}
    try:
        for rows in row_grid(core.config.scheduler.max_num_seqs):
            seqs = scratch.rows(rows, 1)
            if seqs is not None:
                plan = StepPlan("draft", [ScheduledSeq(s, 1) for s in seqs])
                out[rows] = timer(lambda p=plan: _draft_step(drafter.runner, p))
            scratch.free_rows()
    finally:
        scratch.free()
    return out


@torch.inference_mode()
def _draft_step(runner: ModelRunner, plan: StepPlan) -> torch.Tensor:
    inputs = runner.prepare(plan)
    return runner.logits(inputs, inputs.sample_rows).argmax(dim=-1)


def _entry(seq: Sequence, num_drafts: int) -> ScheduledSeq:
    return ScheduledSeq(seq, 1, draft_token_ids=[0] * num_drafts)


def _counters(runner: ModelRunner) -> tuple:
    return runner.num_graph_steps, runner.num_eager_steps, runner.eager_shapes.copy()


def _restore_counters(runner: ModelRunner, saved: tuple) -> None:
    runner.num_graph_steps, runner.num_eager_steps, runner.eager_shapes = saved
