"""The step's logits processing: an ordered pipeline of stages between the model's logits and
the sampler (temperature, top-k, top-p) or the verify.

Every sampled row belongs to a sequence and a position: plain decode and prefill rows are
position 0 of a sequence with no drafts; a verify of L drafts has positions 0..L, and position
j is processed as if drafts 0..j-1 were already part of the sequence (its token counts, its
output length, the tokens a bad word's prefix is matched against). So a verify applies exactly
what plain decoding would have applied at each position, and speculation stays lossless.

Fast path: a stage runs only when some sequence of the step wants it, and only the sequences
that want any stage are processed (the others' rows are left untouched). A step where no
sequence wants any stage returns the logits as they are, without any device work.

Adding a stage (grammar masks, say): write ``apply(logits, batch) -> logits`` over the
``[B, 1 + W, V]`` logits of the sequences in ``batch`` (a private copy: in place is fine; rows
of sequences that do not want the stage must come out unchanged) and a ``wants(seq)``
predicate, insert a ``LogitsStage`` into ``PIPELINE`` where it belongs, and make
``SamplingParams.uses_logits_controls`` true for requests that use it (the fast-path test).
The raw logits passed to ``LogitsProcessor.process`` are never modified (log-probabilities
read them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from verifypd.engine import logits_stages as stages
from verifypd.engine.token_counts import TokenCounts, upload
from verifypd.types import Sequence


@dataclass
class LogitsBatch:
    """What the stages read: B sequences, each with 1 + W rows (positions 0..W)."""

    seqs: list[Sequence]
    drafts: Tensor  # [B, W] int64 draft ids (W = 0 for plain rows)
    num_drafts: Tensor  # [B] int64 real drafts per row (positions past it are padding)
    counts: TokenCounts
    eos_token_ids: frozenset[int]
    _output_counts: tuple[Tensor, Tensor] | None = field(default=None, repr=False)

    @property
    def device(self) -> torch.device:
        return self.drafts.device

    @property
    def width(self) -> int:
        return self.drafts.shape[1]

    def output_counts(self) -> tuple[Tensor, Tensor]:
        """Per position, how often each token occurs in the output including the drafts
        before it ([B, 1 + W, V] float32), and the table rows of the sequences ([B])."""
        if self._output_counts is None:
            rows = self.counts.rows_of(self.seqs)
            base = self.counts.output.index_select(0, rows)  # [B, V]
            counts = stages.with_drafts(base, self.drafts, self.num_drafts)
            self._output_counts = counts, rows
        return self._output_counts


@dataclass(frozen=True)
class LogitsStage:
    name: str
    wants: Callable[[Sequence], bool]
    apply: Callable[[Tensor, LogitsBatch], Tensor]


# vLLM's order: token bans and biases first, then the penalties (which scale what is left).
PIPELINE: list[LogitsStage] = [
    LogitsStage("bad_words", stages.wants_bad_words, stages.ban_bad_words),
    LogitsStage("logit_bias", stages.wants_logit_bias, stages.add_logit_bias),
    LogitsStage("min_tokens", stages.wants_min_tokens, stages.mask_stops_before_min_tokens),
    LogitsStage("penalties", stages.wants_penalties, stages.apply_penalties),
]


class LogitsProcessor:
    """Runs ``PIPELINE`` for one model runner; owns the incremental token counts."""

    def __init__(self, device: torch.device, eos_token_ids: frozenset[int] = frozenset()):
        self.device = device
        self.eos_token_ids = eos_token_ids
        self.counts: TokenCounts | None = None
        self.pipeline = PIPELINE

    def process(
        self,
        logits: Tensor,
        seqs: list[Sequence],
        drafts: Tensor | None = None,
        num_drafts: Tensor | None = None,
    ) -> Tensor:
        """``logits`` [B, 1 + W, V] (or [B, V] for plain rows) of ``seqs`` -> processed logits
        of the same shape; ``drafts`` [B, W] and ``num_drafts`` [B] for a verify."""
        if not any(s.params.uses_logits_controls for s in seqs):
            return logits  # the fast path: one attribute per sequence
        if logits.dim() == 2:
            return self.process(logits[:, None], seqs, drafts, num_drafts)[:, 0]
        active = [st for st in self.pipeline if any(st.wants(s) for s in seqs)]
        if not active:
            return logits
        picked = [i for i, s in enumerate(seqs) if any(st.wants(s) for st in active)]
        index = upload(picked, logits.device) if len(picked) < len(seqs) else None
        batch = self._batch(logits, [seqs[i] for i in picked], index, drafts, num_drafts)
        sub = logits.clone() if index is None else logits.index_select(0, index)
        for stage in active:
            sub = stage.apply(sub, batch)
        return sub if index is None else logits.index_copy(0, index, sub)

    def _batch(self, logits, seqs, index, drafts, num_drafts) -> LogitsBatch:
        """The picked ``seqs`` (rows ``index`` of the step's, None = all) and their drafts."""
        dev = logits.device
        if drafts is None:
            drafts = torch.zeros(logits.shape[0], 0, dtype=torch.int64, device=dev)
            num_drafts = torch.zeros(logits.shape[0], dtype=torch.int64, device=dev)
        if index is not None:
            drafts, num_drafts = drafts.index_select(0, index), num_drafts.index_select(0, index)
        if self.counts is None:
            self.counts = TokenCounts(logits.shape[-1], dev)
        return LogitsBatch(seqs, drafts, num_drafts, self.counts, self.eos_token_ids)
