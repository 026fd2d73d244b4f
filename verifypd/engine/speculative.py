"""Speculative decoding: proposers and the glue that attaches drafts to decode entries.

Verification itself lives in the runner (one target forward over [last token + L drafts],
then ``rejection_sample``); the scheduler rolls back rejected KV by truncating the block table.

Draft model KV: the drafter has its own pool and allocator. Its view of a sequence computes KV
for the last token and d_1..d_{L-1} while drafting; after verification accepted k drafts, the
KV of positions < N + k is still valid, which is exactly ``min(computed, num_tokens - 1)``
for the new token count, so the rollback is lazy and happens at the next proposal.
"""

from __future__ import annotations

import torch

from verifypd.config import SpecConfig
from verifypd.engine.loader import LoadedModel
from verifypd.engine.ngram import NgramProposer
from verifypd.engine.runner import ModelRunner
from verifypd.engine.sampler import SamplingTensors, processed_probs, sample
from verifypd.kvcache import KVCacheManager, KVPool
from verifypd.types import SamplingParams, ScheduledSeq, Sequence, StepPlan

_DRAFT_SEED_SALT = 0x5DEECE66D  # drafter noise must not reuse the target's sampling stream


class DraftView:
    """The drafter's copy of a target sequence: same tokens, its own KV progress and blocks."""

    def __init__(self, seq: Sequence) -> None:
        self.seq_id = seq.seq_id
        self.token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.params = seq.params
        self.seed = seq.seed ^ _DRAFT_SEED_SALT

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


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
        self.vocab_size = cfg.vocab_size
        self.views: dict[int, DraftView] = {}

    def propose(self, entries: list[ScheduledSeq], lens: list[int], temps: list[float]) -> None:
        """Fills ``draft_token_ids`` (and ``draft_probs`` for sampled requests) of each entry."""
        active = [
            (e, self._prepare_view(e.seq, n), n, t)
            for e, n, t in zip(entries, lens, temps, strict=True)
            if n > 0
        ]
        active = [a for a in active if a[1] is not None]
        if not active:
            return
        probs: dict[int, list[torch.Tensor]] = {id(e): [] for e, *_ in active}
        for j in range(max(n for _, _, n, _ in active)):
            step = [a for a in active if a[2] > j]
            views = [v for _, v, _, _ in step]
            toks, q = self._draft_step(views, [t for *_, t in step])
            for k, (e, v, _, t) in enumerate(step):
                v.num_computed_tokens = v.num_tokens
                v.token_ids.append(toks[k])
                e.draft_token_ids.append(toks[k])
                if q is not None and t > 0:
                    probs[id(e)].append(q[k])
        for e, _, _, t in active:
            if t > 0 and probs[id(e)]:
                e.draft_probs = torch.stack(probs[id(e)])

    def _prepare_view(self, seq: Sequence, num_drafts: int) -> DraftView | None:
        view = self.views.get(seq.seq_id)
        if view is None:
            view = self.views[seq.seq_id] = DraftView(seq)
        view.token_ids = list(seq.token_ids)
        view.num_computed_tokens = min(view.num_computed_tokens, seq.num_tokens - 1)
        self.kv.truncate(view.block_table, view.num_computed_tokens)
        if not self.kv.allocate(view.block_table, seq.num_tokens + num_drafts - 1):
            return None
        return view

    @torch.inference_mode()
    def _draft_step(self, views: list[DraftView], temps: list[float]):
        """One drafter forward: catch-up tokens for each view, one sampled token each."""
        plan = StepPlan(
            "draft", [ScheduledSeq(v, v.num_tokens - v.num_computed_tokens) for v in views]
        )
        inputs = self.runner.prepare(plan)
        logits = self.runner.forward(inputs, inputs.sample_rows)
        t = SamplingTensors.build(
            temperature=temps,
            top_k=[v.params.top_k for v in views],
            top_p=[v.params.top_p for v in views],
            seeds=[v.seed for v in views],
            positions=[v.num_tokens for v in views],
            device=logits.device,
        )
        tokens = sample(logits, t)
        q = None if t.all_greedy else processed_probs(logits, t)
        return tokens.tolist(), q

    def free(self, seq_id: int) -> None:
        view = self.views.pop(seq_id, None)
        if view is not None:
            self.kv.free(view.block_table)


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

    def wants(self, seq: Sequence) -> bool:
        return self.enabled and seq.params.speculate and seq.draft_len > 0

    def propose(self, entries: list[ScheduledSeq], temps: dict[int, float] | None = None) -> None:
        """Attaches drafts to the decode entries of speculating sequences (in place)."""
        spec = [e for e in entries if self.wants(e.seq)]
        if self.ngram is not None:
            for e in spec:
                e.draft_token_ids = self.ngram.propose(
                    e.seq.seq_id, e.seq.token_ids, e.seq.draft_len
                )
        elif self.drafter is not None and spec:
            temps = temps or {}
            lens = [e.seq.draft_len for e in spec]
            t = [_drafter_temp(e.seq.params, temps.get(e.seq.seq_id)) for e in spec]
            self.drafter.propose(spec, lens, t)
        for e in spec:  # never draft past max_tokens: extra tokens would be thrown away
            room = e.seq.params.max_tokens - e.seq.num_output_tokens - 1
            del e.draft_token_ids[max(room, 0) :]
            if e.draft_probs is not None:
                e.draft_probs = e.draft_probs[: len(e.draft_token_ids)]

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
