"""The drafter catching up on a context before it drafts: in replays of chunk graphs for views
far behind (``chunked_catch_up``), then a first draft step made uniform so it replays a graph
(``uniform_catch_up``). ``replay`` is the one uniform step both use (and the prompt follow's
replays, ``draft_follow``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from verifypd.types import ScheduledSeq, StepPlan

if TYPE_CHECKING:
    from verifypd.engine.cuda_graphs import StepGraphs
    from verifypd.engine.draft_view import DraftView
    from verifypd.engine.runner import ModelRunner


def chunked_catch_up(
    runner: ModelRunner, views: list[DraftView], sizes: tuple[int, ...], max_chunks: int
) -> None:
    """Views further behind than the catch-up graphs reach (a request fresh from its prefill,
    or one that decoded plainly for a while) feed their context in replays of a chunk graph
    (``sizes``: the captured chunk lengths q, ascending): each view the largest q that
    its context is longer than and that covers it in at most ``max_chunks`` replays; views of
    one q replay together (as many as its graph holds), each replay feeding every one of them
    the same q tokens, ending at least one token short of its last (the first draft step
    feeds that), so each replay is uniform; a view less than q behind re-feeds stored tokens
    to match. If some far view fits no chunk graph (a context no longer than the smallest q,
    or longer than the replays reach), nothing is chunked: the eager first step feeds them
    all (its host time is the same for one view or many)."""
    graphs = runner.graphs
    sizes = [q for q in sizes if q in graphs]
    if max_chunks <= 0 or not sizes:
        return
    reach = max((k for k in graphs if k < sizes[0]), default=1)
    far = [v for v in views if v.num_tokens - v.num_computed_tokens > reach]
    groups: dict[int, list[DraftView]] = {}
    for v in far:
        behind = v.num_tokens - 1 - v.num_computed_tokens
        fits = [q for q in sizes if v.num_tokens > q and behind <= max_chunks * q]
        if not fits:
            return
        groups.setdefault(fits[-1], []).append(v)
    for q, group in sorted(groups.items()):
        rows = graphs[q].max_batch
        for i in range(0, len(group), rows):
            _replay_chunks(runner, group[i : i + rows], q, reach)


def _replay_chunks(runner: ModelRunner, far: list[DraftView], q: int, reach: int) -> None:
    while far:
        replay(runner, far, q, 1)
        far = [v for v in far if v.num_tokens - v.num_computed_tokens > reach]


def replay(
    runner: ModelRunner,
    views: list[DraftView],
    q: int,
    short: int,
    graphs: dict[int, StepGraphs] | None = None,
) -> None:
    """One uniform step of q tokens for each view, ending at least ``short`` tokens before its
    last (a view less than q behind re-feeds stored tokens to match), in a graph of ``graphs``
    (default the runner's) when one holds it; the views' progress moves on by q."""
    for v in views:
        v.num_computed_tokens = min(v.num_computed_tokens, v.num_tokens - short - q)
    runner.logits(runner.prepare(StepPlan("draft", [ScheduledSeq(v, q) for v in views])), [],
                  graphs=graphs)  # fmt: skip
    for v in views:
        v.num_computed_tokens += q


def uniform_catch_up(views: list[DraftView], graphs: dict[int, StepGraphs]) -> None:
    """Makes the first draft step uniform so it replays a CUDA graph: every view feeds the same
    q tokens, q the smallest captured query length that covers the view furthest behind and
    holds the batch (1 when all are caught up, 2 after a round whose drafts were all accepted,
    up to ``SpecConfig.catch_up_graphs`` after plain steps). Views less far behind re-feed
    their last tokens: recomputing an already-stored token's KV writes the same values (up to
    rounding, which only touches drafts; the verify decides). With a view further behind than
    every graph (a new request's prompt) nothing is rewound and the step runs eager."""
    behind = max(v.num_tokens - v.num_computed_tokens for v in views)
    fits = [
        q for q, g in graphs.items() if q >= behind and g.max_batch >= len(views) and g.with_logits
    ]
    if behind <= 1 or not fits:
        return
    q = min(fits)
    if any(v.num_tokens < q for v in views):
        return  # a context shorter than q (a tiny prompt): eager
    for v in views:
        v.num_computed_tokens = v.num_tokens - q
