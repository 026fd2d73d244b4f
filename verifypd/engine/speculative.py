"""Speculative decoding: proposers and the glue that attaches drafts to decode entries.

Verification itself lives in the runner (one target forward over [last token + L drafts],
then ``rejection_sample``); the scheduler rolls back rejected KV by truncating the block table.

Draft model KV: the drafter has its own pool and allocator. Its view of a sequence computes KV
for the last token and d_1..d_{L-1} while drafting; after verification accepted k drafts, the
KV of positions < N + k is still valid, which is exactly ``min(computed, num_tokens - 1)``
for the new token count, so the rollback is lazy and happens at the next proposal.

The drafter's view of a sequence is ``draft_view.DraftView``; catching it up on a context before
it drafts, ``draft_catch_up``; feeding it prompt chunks behind the target's prefill,
``draft_follow``; drafting the next round behind a verify, ``chained_drafts``.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from verifypd.config import SpecConfig
from verifypd.engine.chained_drafts import ChainedDrafts, DraftChainer
from verifypd.engine.device_drafts import DeviceDrafts
from verifypd.engine.draft_catch_up import chunked_catch_up, uniform_catch_up
from verifypd.engine.draft_follow import PromptFollower, wait_for_follow
from verifypd.engine.draft_view import DraftView, draft_sampling, window_skip
from verifypd.engine.loader import LoadedModel
from verifypd.engine.ngram import NgramProposer
from verifypd.engine.runner import ModelRunner, VerifyOutputs
from verifypd.engine.sampler import SamplingTensors, sample_with_probs
from verifypd.kvcache import KVCacheManager, KVPool
from verifypd.types import DRAFT_ON_DEVICE, SamplingParams, ScheduledSeq, Sequence, StepPlan

if TYPE_CHECKING:
    from verifypd.engine.cuda_graphs import StepGraphs

_uniform_catch_up = uniform_catch_up  # its name here before it moved (kept importable)


class DraftModelProposer:
    """Drafts with a smaller model sharing the target's tokenizer."""

    def __init__(
        self, loaded: LoadedModel, num_blocks: int, block_size: int, device, dtype
    ) -> None:
        cfg = loaded.config
        self.pool = KVPool(
            cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim, dtype, device
        )
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False)
        self.runner = ModelRunner(loaded.model, self.pool, block_size, device)
        self.block_size = block_size
        self.vocab_size = cfg.vocab_size  # the width of its logits
        self.input_vocab = cfg.embed_vocab_size  # ids its embedding reads
        self.views: dict[int, DraftView] = {}
        # The context window of its views (``SpecConfig.draft_window``, set at setup): a
        # prompt's first ``window_sink`` and last ``window`` tokens; None: whole contexts.
        self.window: int | None = None
        self.window_sink = 0
        self._graph_ready = False  # the last draft step replayed the q = 1 graph
        self.last_catch_up = 0  # most tokens a view had to feed in the last proposal's 1st step
        # Set with the drafter's graphs (``setup.capture_graphs``): the chunk graphs' q, and
        # the most replays a proposal's catch-up may take (0: none).
        self.catch_up_chunk: tuple[int, ...] = ()
        self.catch_up_chunks = 0
        self.last_adopted: set[int] = set()  # id() of the last proposal's adopting entries
        self.chainer = DraftChainer(self)  # the next round drafted behind a verify
        self.follower = PromptFollower(self)  # the drafter fed prompt chunks behind prefills
        # Drafting runs on the decode stream (proposals) or behind a verify (chains); the
        # graphs' static buffers, the views' blocks and the pool are shared, so each drafting
        # waits for the one before it on the GPU.
        self._last_work = None

    # ------------------------------------------------------------------ chained drafting
    @property
    def chained(self) -> ChainedDrafts | None:
        return self.chainer.chained

    @chained.setter
    def chained(self, chained: ChainedDrafts | None) -> None:
        self.chainer.chained = chained

    @property
    def num_adopted(self) -> int:
        return self.chainer.num_adopted

    def chain(self, verify: StepPlan, verified: VerifyOutputs, num_drafts: int, max_len: int):
        return self.chainer.chain(verify, verified, num_drafts, max_len)

    def confirm(self, plan: StepPlan, token_ids: list[list[int]]) -> None:
        self.chainer.confirm(plan, token_ids)

    def warm_up_chain(self) -> None:
        self.chainer.warm_up_chain()

    # ------------------------------------------------------------------ prompt following
    def follow_iter(
        self,
        items: list[tuple[Sequence, int]],
        every: int = 0,
        graphs: dict[int, StepGraphs] | None = None,
    ) -> Generator[None, None, int]:
        """Feeds the drafter the prompt chunks the target is prefilling (or contexts it fell
        behind on), in pieces (``PromptFollower.follow_iter``); returns the tokens fed."""
        return self.follower.follow_iter(items, every, graphs)

    def chunk_graphs(self) -> dict[int, StepGraphs]:
        """The runner's catch-up chunk graphs (``catch_up_chunk``), by q: a catch-up on the
        decode stream replays these (the follow stream has its own)."""
        graphs = self.runner.graphs
        return {q: graphs[q] for q in self.catch_up_chunk if q in graphs}

    def release_held(self, wait: bool = False) -> None:
        """Frees ended requests' blocks that no follow can still write to
        (``PromptFollower.release_held``)."""
        self.follower.release_held(wait)

    # ------------------------------------------------------------------ drafting
    def propose(self, entries: list[ScheduledSeq], lens: list[int], temps: list[float]) -> None:
        """Attaches each entry's drafts, left on the device (``entry.drafts``: the ids, and
        the drafter's distributions for sampled requests).

        Draft step j feeds the token drafted at step j - 1 straight from the device, and the
        verify reads the drafts there too: a proposal costs no host sync, so the verify can be
        launched behind it while the GPU still drafts. Entries whose next round was already
        drafted behind their verify (``chain``) adopt those drafts instead."""
        adopted = self.last_adopted = self.chainer.adopt(entries, lens)
        active = [
            (e, v, n, t)
            for e, n, t in zip(entries, lens, temps, strict=True)
            if n > 0 and id(e) not in adopted and (v := self._prepare_view(e.seq, n)) is not None
        ]
        if not active:
            self.last_catch_up = 0
            return
        self._follow_last_work()
        wait_for_follow([v for _, v, _, _ in active])
        views = [v for _, v, _, _ in active]
        for _, v, _, t in active:
            v.draft_temp = t
        self.last_catch_up = max(v.num_tokens - v.num_computed_tokens for v in views)
        chunked_catch_up(self.runner, views, self.catch_up_chunk, self.catch_up_chunks)
        uniform_catch_up(views, self.runner.graphs)
        for v in views:
            v.draft_start = v.num_tokens
        active.sort(key=lambda a: -a[2])  # longest first: each step's rows are a prefix
        sampling = self._sampling([v for _, v, _, _ in active], [t for *_, t in active])
        drafted: list[torch.Tensor] = []  # per step j: [B_j] token ids on the device
        probs: list[torch.Tensor | None] = []
        prev: torch.Tensor | None = None
        for j in range(max(n for _, _, n, _ in active)):
            step = [a for a in active if a[2] > j]
            if prev is not None and len(step) < prev.shape[0]:
                prev = prev[: len(step)]
            step_sampling = None
            if sampling is not None and any(t > 0 for *_, t in step):
                step_sampling = sampling.prefix(len(step), j)
            toks, q = self._draft_step([v for _, v, _, _ in step], step_sampling, prev)
            for _, v, _, _ in step:
                v.num_computed_tokens = v.num_tokens
                v.token_ids.append(-1)  # placeholder until the ids come back to the host
            drafted.append(toks)
            probs.append(q)
            prev = toks
        self._attach(active, drafted, probs)

    def _attach(self, active, drafted: list[torch.Tensor], probs: list) -> None:
        """Per entry: its row of the [B, L] draft matrix, still on the device. The view keeps
        placeholders: the next proposal re-reads the sequence's real tokens."""
        rows = drafted[0].shape[0]
        cols = [F.pad(t, (0, rows - t.shape[0])) if t.shape[0] < rows else t for t in drafted]
        matrix = torch.stack(cols, dim=1)  # [B, L]: step j's rows are a prefix
        ready = self._record_work()
        for k, (e, _, n, t) in enumerate(active):
            e.draft_token_ids = [DRAFT_ON_DEVICE] * n
            q = None
            if t > 0 and all(probs[j] is not None for j in range(n)):
                q = torch.stack([probs[j][k] for j in range(n)])
            e.drafts = DeviceDrafts(matrix[k, :n], q, ready)

    def _follow_last_work(self) -> None:
        if self._last_work is not None:
            torch.cuda.current_stream().wait_event(self._last_work)

    def _record_work(self):
        if not self.runner.is_cuda:
            return None
        self._last_work = torch.cuda.Event()
        self._last_work.record()
        return self._last_work

    # ------------------------------------------------------------------ chained drafting

    def _tables(self, views: list[DraftView]) -> torch.Tensor:
        width = max(len(v.block_table) for v in views)
        tables = np.zeros((len(views), width), dtype=np.int32)
        for i, v in enumerate(views):
            tables[i, : len(v.block_table)] = v.block_table
        return self.runner._to_device(tables, torch.int32)

    @staticmethod
    def _greedy(logits: torch.Tensor) -> torch.Tensor:
        return logits.argmax(dim=-1)

    def _prepare_view(self, seq: Sequence, num_drafts: int) -> DraftView | None:
        view = self.view_of(seq)
        if view.following:  # a forward behind a step is being enqueued for it: it feeds the view
            return None
        view.token_ids = self._drafter_ids(view.ids_of(seq.token_ids))
        known = view.num_tokens - 1
        if view.draft_start is not None:  # drafts whose verify never landed: none is known
            known, view.draft_start = min(known, view.draft_start), None
        view.num_computed_tokens = min(view.num_computed_tokens, known)
        self.kv.truncate(view.block_table, view.num_computed_tokens)
        if not self.kv.allocate(view.block_table, view.num_tokens + num_drafts - 1):
            return None
        return view

    def view_of(self, seq: Sequence) -> DraftView:
        """``seq``'s view, made (with the context window) on first use."""
        view = self.views.get(seq.seq_id)
        if view is None:
            view = self.views[seq.seq_id] = DraftView(seq, self.window, self.window_sink)
        return view

    def behind(self, seq: Sequence) -> int:
        """Tokens the drafter must feed for ``seq`` before it drafts (its whole view when it
        never has: the window's, with one)."""
        view = self.views.get(seq.seq_id)
        if view is not None:
            return view.local(seq.num_tokens) - view.num_computed_tokens
        return seq.num_tokens - window_skip(seq, self.window, self.window_sink)

    def _drafter_ids(self, token_ids: list[int]) -> list[int]:
        """Target ids outside the drafter's embedding (a padded target embedding) map to 0."""
        v = self.input_vocab
        if not token_ids or max(token_ids) < v:
            return list(token_ids)
        return [t if t < v else 0 for t in token_ids]

    @torch.inference_mode()
    def _draft_step(self, views: list[DraftView], sampling: SamplingTensors | None, prev):
        """One drafter forward: catch-up tokens for each view, one token each (greedy when
        ``sampling`` is None)."""
        logits = self._continue_graph(views, prev)
        if logits is None:
            entries = [ScheduledSeq(v, v.num_tokens - v.num_computed_tokens) for v in views]
            inputs = self.runner.prepare(StepPlan("draft", entries))
            if prev is not None:  # the placeholders' real values, still on the device
                inputs.input_ids = prev
            graphed_before = self.runner.num_graph_steps
            logits = self.runner.logits(inputs, inputs.sample_rows)
            replayed = self.runner.num_graph_steps > graphed_before
            self._graph_ready = replayed and inputs.meta.max_query_len == 1
        if sampling is None:
            return logits.argmax(dim=-1), None
        return sample_with_probs(logits, sampling)

    def _continue_graph(self, views: list[DraftView], prev) -> torch.Tensor | None:
        """After one graphed single-token step, the next one of the same rows advances the
        graph's inputs on the device instead of preparing them on the host."""
        graphs = self.runner.graphs.get(1)
        if prev is None or graphs is None or not self._graph_ready:
            return None
        if not graphs.can_run_next(len(views), max(v.num_tokens for v in views) - 1):
            return None
        return graphs.run_next(prev)

    def _sampling(self, views: list[DraftView], temps: list[float]) -> SamplingTensors | None:
        """The proposal's sampling parameters, copied to the device once (step j takes a
        prefix of the rows, at positions j further: ``SamplingTensors.prefix``); None when
        every row drafts greedily."""
        if all(t == 0 for t in temps):
            return None
        return draft_sampling(views, temps, [v.num_tokens for v in views], self.runner.device)

    def verified(self, seq_id: int, num_accepted: int) -> None:
        """A verify of this sequence's drafts landed: the KV of its accepted drafts stays, the
        rest is stale (the sequence may decode plainly for a while before it drafts again)."""
        view = self.views.get(seq_id)
        if view is not None and view.draft_start is not None:
            limit = view.draft_start + num_accepted
            view.num_computed_tokens = min(view.num_computed_tokens, limit)
            view.draft_start = None

    def free(self, seq_id: int) -> None:
        if self.chained is not None:
            self.chained.confirmed.pop(seq_id, None)
        self.follower.retire(self.views.pop(seq_id, None))


class SpecDecoder:
    """Chooses who speculates, proposes drafts and records acceptance."""

    def __init__(self, config: SpecConfig, drafter: DraftModelProposer | None = None) -> None:
        self.config = config
        self.drafter = drafter
        self.ngram = (
            NgramProposer(config.ngram_min, config.ngram_max) if config.method == "ngram" else None
        )
        self.num_drafted = 0
        self.num_accepted = 0
        self.num_verifies = 0

    @property
    def enabled(self) -> bool:
        return self.config.method != "off"

    @property
    def last_proposal_was_steady(self) -> bool:
        """False when the drafter had to catch up on more than the last round's tokens (a new
        or long-parked request: a one-off prefill of the drafter, not the cost of drafting)."""
        return self.drafter is None or self.drafter.last_catch_up <= 2

    def fresh_drafts(self, entries: list[ScheduledSeq]) -> list[int]:
        """The draft lengths of ``entries`` that the last proposal drafted itself (those served
        from chained drafts were drafted, and timed, behind the verify before)."""
        adopted = self.drafter.last_adopted if self.drafter is not None else set()
        return [
            len(e.draft_token_ids) for e in entries if e.draft_token_ids and id(e) not in adopted
        ]

    def wants(self, entry: ScheduledSeq) -> bool:
        """The entry drafts this step: the policy gave it L > 0 and its request speculates."""
        return self.enabled and entry.draft_len > 0 and entry.seq.params.speculate

    def propose(self, entries: list[ScheduledSeq], temps: dict[int, float] | None = None) -> None:
        """Attaches drafts to the decode entries of speculating sequences (in place), each
        entry's ``draft_len`` of them."""
        spec = [e for e in entries if self.wants(e)]
        if self.ngram is not None:
            for e in spec:
                e.draft_token_ids = self.ngram.propose(e.seq.seq_id, e.seq.token_ids, e.draft_len)
                e.draft_missed = not e.draft_token_ids
        elif self.drafter is not None and spec:
            temps = temps or {}
            lens = [e.draft_len for e in spec]
            t = [_drafter_temp(e.seq.params, temps.get(e.seq.seq_id)) for e in spec]
            self.drafter.propose(spec, lens, t)
        for e in spec:  # never draft past max_tokens: extra tokens would be thrown away
            e.truncate_drafts(e.seq.params.max_tokens - e.seq.num_output_tokens - 1)

    def chain(self, plan: StepPlan, verified: VerifyOutputs, max_len: int) -> int:
        """Drafts the next round of ``plan``'s verified sequences behind it on the device
        (see ``DraftModelProposer.chain``), with the longest L any of them verifies now."""
        if self.drafter is None:
            return 0
        lens = [plan.seqs[i].draft_len for i in verified.seqs]
        return self.drafter.chain(plan, verified, max(lens, default=0), max_len)

    def confirm(self, plan: StepPlan, token_ids: list[list[int]]) -> None:
        if self.drafter is not None:
            self.drafter.confirm(plan, token_ids)

    def record(self, entry: ScheduledSeq, new_ids: list[int]) -> int:
        """Acceptance bookkeeping after a verify; returns the number of accepted drafts."""
        num_drafted = len(entry.draft_token_ids)
        num_accepted = max(len(new_ids) - 1, 0)
        seq = entry.seq
        seq.num_drafted += num_drafted
        seq.num_accepted += num_accepted
        self.num_drafted += num_drafted
        self.num_accepted += num_accepted
        self.num_verifies += 1
        if self.drafter is not None:
            self.drafter.verified(seq.seq_id, num_accepted)
        return num_accepted

    def forget(self, seq: Sequence) -> None:
        if self.ngram is not None:
            self.ngram.forget(seq.seq_id)
        if self.drafter is not None:
            self.drafter.free(seq.seq_id)


def _drafter_temp(params: SamplingParams, controller_temp: float | None) -> float:
    if params.is_greedy:
        return 0.0
    return params.temperature if controller_temp is None else controller_temp
