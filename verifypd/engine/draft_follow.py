"""The drafter following prompt steps (``PromptFollower``): while the target prefills a prompt
chunk, the drafter computes its own KV of those tokens on the follow stream, below every lane,
so the request's first speculative round starts steady; behind plain decode steps it catches
up the same way on the contexts it fell behind on (``decode_follow_items``). Whatever drafts
for such a view waits for that forward on the GPU first (``wait_for_follow``).
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import TYPE_CHECKING

import torch

from verifypd.engine.draft_catch_up import replay
from verifypd.engine.draft_view import DraftView
from verifypd.types import ScheduledSeq, SeqStatus, Sequence, StepPlan

if TYPE_CHECKING:
    from verifypd.config import SpecConfig
    from verifypd.engine.cuda_graphs import StepGraphs
    from verifypd.engine.scheduler import Scheduler
    from verifypd.engine.speculative import DraftModelProposer

# (sequence, its view, the sequence's tokens fed up to: the view's ``local`` count of them)
Claim = tuple[Sequence, DraftView, int]


def _recorded_event(is_cuda: bool):
    """A CUDA event recorded on the current stream (None off the GPU)."""
    if not is_cuda:
        return None
    event = torch.cuda.Event()
    event.record()
    return event


def wait_for_follow(views: list[DraftView]) -> None:
    """The current stream waits for the forwards behind the views' prompt chunks."""
    for v in views:
        if v.ready is not None:
            torch.cuda.current_stream().wait_event(v.ready)
            v.ready = None


def beyond_light_load(scheduler: Scheduler, most: int | None) -> bool:
    """Another prompt waits (queued or part-prefilled, read once the step is in flight), or
    more than ``most`` sequences decode (None: never beyond)."""
    if most is None:
        return False
    decoding = (SeqStatus.DECODING, SeqStatus.VERIFYING)
    running = scheduler.running
    return scheduler.prompts_waiting() or sum(s.status in decoding for s in running) > most


def prompt_follow_items(
    scheduler: Scheduler, plan: StepPlan, expects: Callable[[int], bool], most: int | None
) -> list[tuple[Sequence, int]]:
    """(sequence, its prompt tokens once ``plan`` has run) for each prompt chunk of ``plan``
    whose request ``expects`` names (by seq_id), unless ``beyond_light_load``."""
    if beyond_light_load(scheduler, most):
        return []
    return [
        (e.seq, e.seq.num_computed_tokens + e.num_new_tokens)
        for e in plan.seqs
        if e.seq.status is SeqStatus.PREFILLING and expects(e.seq.seq_id)
    ]


def decode_follow_items(
    drafter: DraftModelProposer,
    scheduler: Scheduler,
    plan: StepPlan,
    wants: Callable[[int], bool],
    spec: SpecConfig,
    graphs: bool,
) -> list[tuple[Sequence, int]]:
    """(sequence, where its drafter's catch-up ends) for each plain row of the launched decode
    step ``plan`` whose drafter is beyond the catch-up graphs' reach (``graphs``: captured;
    nearer, its first draft step replays one) and that ``wants`` names (by seq_id): the drafter
    catches up behind the step on at most one chunk (``SpecConfig.follow_decode_tokens``, or
    the largest ``catch_up_chunk``) more of its context, up to all but its last token; only at
    light load (``SpecConfig.follow_decode_max_rows``, 0: never). Rows drafting in the step,
    and views with drafts not yet verified, chained ones, or a forward already queued, are
    left out: their KV progress is the proposer's."""
    most = spec.follow_decode_max_rows
    if not most or beyond_light_load(scheduler, most):
        return []
    reach = max((2, *spec.catch_up_graphs)) if graphs else 2
    budget = spec.follow_decode_tokens or max(spec.chunk_sizes, default=256)
    chained = drafter.chained
    out = []
    for e in plan.seqs:
        seq = e.seq
        if e.draft_len or e.draft_token_ids or not wants(seq.seq_id):
            continue
        if seq.status.is_finished or not seq.num_output_tokens:  # (a prompt: not yet)
            continue
        if seq.params.max_tokens - seq.num_output_tokens < 2:
            continue
        if chained is not None and seq.seq_id in chained.rows:
            continue
        view = drafter.views.get(seq.seq_id)
        if view is not None and (view.draft_start is not None or view.following_now()):
            continue
        view = view or drafter.view_of(seq)
        done, total = view.num_computed_tokens, view.local(seq.num_tokens)
        if total - done > reach:
            out.append((seq, view.seq_end(min(total - 1, done + budget))))
    return out


class PromptFollower:
    """A drafter's forwards behind prompt steps (``follow_iter``), and the blocks of ended
    requests' views that such a forward may still write (``retire``, ``release_held``)."""

    def __init__(self, drafter: DraftModelProposer) -> None:
        self.drafter = drafter
        # Prompt tokens fed behind prefill steps (``follow_iter``), and forwards it stopped
        # part-way because a request ended (benchmarks read them).
        self.num_followed_tokens = 0
        self.num_follows_stopped = 0
        self.num_follow_replays = 0  # of those, chunk-graph replays (``follow_graphs``)
        # Views of ended requests whose forward behind a prompt step may still be enqueued or
        # run on the GPU: their blocks go back once it has (``release_held``).
        self._held: list[DraftView] = []
        # Chunk graphs of the follow stream (``follow_iter``), q -> graphs: buffers and memory
        # pools of their own, since proposals on the decode stream replay the runner's chunk
        # graphs meanwhile. {}: the follow runs eager.
        self.follow_graphs: dict[int, StepGraphs] = {}
        # ... and those of the feed stream, the catch-up beside decode steps
        # (``SpecConfig.follow_decode_stream`` "beside" or "below").
        self.feed_graphs: dict[int, StepGraphs] = {}

    @torch.inference_mode()
    def follow_iter(
        self,
        items: list[tuple[Sequence, int]],
        every: int = 0,
        graphs: dict[int, StepGraphs] | None = None,
    ) -> Generator[None, None, int]:
        """Catches the drafter up on prompt chunks the target is prefilling: each (seq, end)
        computes the drafter's KV of ``seq``'s tokens up to ``end`` without logits, so the
        request's first speculative round starts steady instead of feeding its whole context
        inside a decode step; returns the tokens fed. Its first ``next`` claims the views
        (``following``: nothing drafts for them) and their blocks, and pauses, so the work can
        be queued behind earlier ones; the next ones enqueue it: replays of chunk graphs
        (``graphs``; None: the follow stream's own, ``follow_graphs``; a pause after each) for
        contexts at least as long as their smallest q, one eager forward for the rest (and for
        all without those graphs), pausing after every ``every`` layers (0: in one piece), the
        event loop free between.
        A request that has ended by its turn is left out, and one that ends part-way stops it
        (no further piece is enqueued, and its blocks go back once those enqueued have run,
        ``release_held``; the others keep their progress and catch up later). The views
        count the fed tokens once every piece is enqueued."""
        self.release_held()
        claimed = [(seq, v, end) for seq, end in items if (v := self._claim(seq, end)) is not None]
        if not claimed:
            return 0
        try:
            yield  # claimed; the forward waits for its turn
            views = self._live_views(claimed)
            if not views:
                return 0
            fed = sum(v.num_tokens - v.num_computed_tokens for v in views)
            if not (yield from self._enqueue(views, every, graphs)):
                return 0
            self._mark_fed(views)
            self.num_followed_tokens += fed
            return fed
        finally:
            self._unclaim(claimed)

    def _claim(self, seq: Sequence, end: int) -> DraftView | None:
        """``seq``'s view, claimed with its blocks up to ``end``; None where the request has
        ended, the view is (being) fed that far already, or the blocks are not there."""
        if seq.status.is_finished:
            return None
        view = self.drafter.view_of(seq)
        end = view.local(end)
        if max(view.num_computed_tokens, view.follow_end) >= end:
            return None
        if not self.drafter.kv.allocate(view.block_table, end):
            return None
        view.following += 1
        view.follow_end = end
        return view

    def _live_views(self, claimed: list[Claim]) -> list[DraftView]:
        """The claimed views whose request is still on and that are still behind their end,
        given the tokens up to it."""
        views = self.drafter.views
        live = [(seq, v, end) for seq, v, end in claimed
                if views.get(seq.seq_id) is v and v.num_computed_tokens < v.local(end)]  # fmt: skip
        for seq, v, end in live:
            v.token_ids = self.drafter._drafter_ids(v.ids_of(seq.token_ids[:end]))
        return [v for _, v, _ in live]

    def _enqueue(
        self, views: list[DraftView], every: int, graphs: dict[int, StepGraphs] | None
    ) -> Generator[None, None, bool]:
        """Enqueues the forward piece by piece, a pause after each; False where a request
        ended part-way stopped it."""
        pieces = self._follow_pieces(views, every, graphs)
        for _ in pieces:
            yield
            if any(self.drafter.views.get(v.seq_id) is not v for v in views):
                pieces.close()
                self.num_follows_stopped += 1
                stopped = _recorded_event(self.drafter.runner.is_cuda)  # the pieces enqueued
                for v in views:
                    v.ready = stopped
                return False
        return True

    def _mark_fed(self, views: list[DraftView]) -> None:
        # It runs on the follow stream, below every lane; the policy drafts for these
        # views only once it has run (``following_now``), and the first drafting waits for
        # it on the GPU anyway (``wait_for_follow``), not every drafting.
        ready = _recorded_event(self.drafter.runner.is_cuda)
        for v in views:
            v.num_computed_tokens = v.num_tokens
            v.ready = ready

    def _unclaim(self, claimed: list[Claim]) -> None:
        for _, v, _ in claimed:
            v.following -= 1
            if not v.following:
                v.follow_end = v.num_computed_tokens
        self.release_held()

    def _follow_pieces(
        self, views: list[DraftView], every: int, graphs: dict[int, StepGraphs] | None
    ) -> Generator[None, None, None]:
        graphs = self.follow_graphs if graphs is None else graphs
        smallest = min(graphs, default=None)
        replayed = [v for v in views if smallest is not None and v.num_tokens >= smallest]
        eager = [v for v in views if smallest is None or v.num_tokens < smallest]
        yield from self._follow_replays(replayed, graphs)
        yield from self._follow_eager(eager, every)

    def _follow_replays(
        self, views: list[DraftView], graphs: dict[int, StepGraphs]
    ) -> Generator[None, None, None]:
        """Feeds each view its context up to its last token in replays of chunk graphs
        (``graphs``), pausing after each: a few hundred microseconds of host time a replay
        where one eager forward over a prompt held the event loop for 17-32 ms (a 0.5B drafter
        on an H100). Each view replays the largest q it is at least
        q behind, or, less than the smallest q behind, the smallest q re-feeding stored tokens
        (every view's context is at least that long); views of one q replay together, as many
        as the graph holds."""
        sizes = sorted(graphs)
        todo = [v for v in views if v.num_computed_tokens < v.num_tokens]
        while todo:
            groups: dict[int, list[DraftView]] = {}
            for v in todo:
                behind = v.num_tokens - v.num_computed_tokens
                q = max((s for s in sizes if s <= behind), default=sizes[0])
                groups.setdefault(q, []).append(v)
            for q, group in sorted(groups.items()):
                rows = graphs[q].max_batch
                for i in range(0, len(group), rows):
                    replay(self.drafter.runner, group[i : i + rows], q, 0, graphs)
                    self.num_follow_replays += 1
                    yield
            todo = [v for v in todo if v.num_computed_tokens < v.num_tokens]

    def _follow_eager(self, views: list[DraftView], every: int) -> Generator[None, None, None]:
        """One eager forward over the views' contexts, pausing after every ``every`` layers."""
        if not views:
            return
        runner = self.drafter.runner
        entries = [ScheduledSeq(v, v.num_tokens - v.num_computed_tokens) for v in views]
        yield from runner.forward_iter(runner.prepare(StepPlan("draft", entries)), [], every)

    def retire(self, view: DraftView | None) -> None:
        """An ended request's view (None: it had none): its blocks go back once no forward
        behind a prompt step of it can write to them (``release_held``)."""
        if view is not None:
            self._held.append(view)
        self.release_held()

    def release_held(self, wait: bool = False) -> None:
        """Frees the blocks of ended requests' views once no forward behind a prompt step of
        theirs is being enqueued or can still write to them: the follow stream runs below
        every lane, so such a forward may run long after it was enqueued, and blocks handed
        out again before it has would be overwritten. ``wait``: wait on the GPU for those
        already enqueued (tests)."""
        keep = []
        for v in self._held:
            if v.ready is not None and wait and not v.following:
                v.ready.synchronize()
            if v.following or (v.ready is not None and not v.ready.query()):
                keep.append(v)
            else:
                self.drafter.kv.free(v.block_table)
        self._held = keep
