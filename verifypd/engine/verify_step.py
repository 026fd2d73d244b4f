"""The verify half of a step: each seq's L drafts against its 1 + L target distributions
(``DraftVerifier``), and the sampling tensors both halves sample with (``sampling_tensors``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from verifypd.engine.device_drafts import drafter_probs
from verifypd.engine.logits_pipeline import LogitsProcessor
from verifypd.engine.rejection import (
    emit_accepted,
    greedy_accept,
    rejection_sample,
    synthetic_num_accepted,
)
from verifypd.engine.sampler import SamplingTensors, processed_probs
from verifypd.engine.step_inputs import StepInputs
from verifypd.types import RequestFailure, ScheduledSeq, StepPlan


class DraftVerifier:
    """Verifies the step's drafts on the device: the runner's forward gives the logits, this
    turns them into accepted drafts and a final token per seq."""

    def __init__(
        self,
        device: torch.device,
        to_device: Callable[..., torch.Tensor],
        logits_processor: LogitsProcessor,
        synthetic_acceptance: float | None = None,
    ) -> None:
        self.device = device
        self._to_device = to_device  # the runner's uploads (pinned, non-blocking on CUDA)
        self.logits_processor = logits_processor  # the runner's: penalties, biases, bans
        # Benchmark only (DESIGN.md): accepted counts drawn from a truncated geometric
        # (``SpecConfig.synthetic_acceptance``).
        self.synthetic_acceptance = synthetic_acceptance

    def verify(
        self, plan: StepPlan, inputs: StepInputs, logits: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Verifies each seq's L drafts against its 1 + L target distributions: argmax match
        for all-greedy batches, rejection sampling otherwise, synthetic in benchmarks.
        Returns the [B, 1 + L] accepted drafts then the final token, and [B] accepted counts."""
        scheds = [plan.seqs[i] for i in inputs.verify_seqs]
        seqs = [s.seq for s in scheds]
        num_drafts = [len(s.draft_token_ids) for s in scheds]
        num_rows = [len(r) - 1 for r in inputs.verify_rows]  # L, or the padded width
        width = max(num_rows)
        rows = _verify_rows(logits, num_rows, width)  # [B, L + 1, V]
        b = len(scheds)
        # Each draft is read back from its row of the input ids (where it may have been
        # copied on the device); rows past a seq's L repeat its first row (masked by L).
        draft_rows = [r[1 + min(j, n - 1)] if n else r[0]
                      for r, n in zip(inputs.verify_rows, num_rows, strict=True)
                      for j in range(width)]  # fmt: skip
        seeds_host, positions_host = [s.seed for s in seqs], [s.num_tokens for s in seqs]
        synthetic = []  # benchmark only: accepted counts drawn on the host
        if self.synthetic_acceptance is not None:
            synthetic = synthetic_num_accepted(
                self._synthetic_alphas(seqs), num_drafts, seeds_host, positions_host
            )
        small = self._to_device(  # one upload: draft rows [B * L], then [B] vectors
            draft_rows + num_drafts + seeds_host + positions_host + synthetic, torch.int64
        )
        drafts = inputs.input_ids[small[: b * width]].view(b, width)
        num_drafts_t, seeds, positions = small[b * width : b * width + 3 * b].view(3, b)
        rows = self.logits_processor.process(rows, seqs, drafts, num_drafts_t)
        if synthetic:  # real forwards; keep k drafts and the target's most likely token after
            k = small[b * width + 3 * b :]
            final = rows.argmax(-1).gather(1, k[:, None]).squeeze(1)
            return emit_accepted(drafts, k, final), k
        if all(s.params.is_greedy for s in seqs):
            return greedy_accept(rows.argmax(-1), drafts, num_drafts_t)
        rep = [s for s in seqs for _ in range(width + 1)]  # each position: its seq's settings
        pos = [s.num_tokens + j for s in seqs for j in range(width + 1)]
        t = sampling_tensors(rep, pos, self.device)
        target = processed_probs(rows.view(-1, rows.shape[-1]), t).view(rows.shape)
        draft_probs = _draft_probs(scheds, width, target, drafts)
        return rejection_sample(target, draft_probs, drafts, num_drafts_t, seeds, positions)

    def _synthetic_alphas(self, seqs) -> list[float]:
        """Each row's synthetic alpha: its request's own, else the engine's global one."""
        alpha = self.synthetic_acceptance
        return [a if (a := s.params.synthetic_acceptance) is not None else alpha for s in seqs]


def _verify_rows(logits: torch.Tensor, num_drafts: list[int], width: int) -> torch.Tensor:
    """[sum(1 + L_b), V] -> [B, 1 + L, V]; a view when every seq has L drafts."""
    if all(n == width for n in num_drafts):
        return logits.view(len(num_drafts), width + 1, -1)
    rows = logits.new_zeros(len(num_drafts), width + 1, logits.shape[-1])
    off = 0
    for k, n in enumerate(num_drafts):
        rows[k, : n + 1] = logits[off : off + n + 1]
        off += n + 1
    return rows


def _draft_probs(
    scheds: list[ScheduledSeq], width: int, target: torch.Tensor, drafts: torch.Tensor
):
    """Drafter distributions q [B, L, V], or None for deterministic proposers (n-gram);
    a deterministic draft in a mixed batch is one-hot at its id (``drafts`` [B, L])."""
    probs = [drafter_probs(s) for s in scheds]
    if all(p is None for p in probs):
        return None
    vocab = target.shape[-1]
    out = torch.zeros(len(scheds), width, vocab, device=target.device)
    for k, (s, p) in enumerate(zip(scheds, probs, strict=True)):
        n = len(s.draft_token_ids)
        if p is None:
            out[k, :n].scatter_(1, drafts[k, :n, None], 1.0)
        else:
            out[k, :n, : p.shape[-1]] = p[:n]  # a smaller drafter vocab pads with 0
    return out


def sampling_tensors(seqs, positions: list[int], device) -> SamplingTensors:
    """The step's sampling tensors. When they cannot be built, the rows that fail alone
    (on the host) name the requests at fault (``RequestFailure``); none: the step's."""
    try:
        return _build_sampling(seqs, positions, device)
    except Exception as exc:
        bad = {s.request_id for s, p in zip(seqs, positions, strict=True) if _fails(s, p)}
        if not bad:
            raise
        raise RequestFailure(bad, exc) from exc


def _build_sampling(seqs, positions: list[int], device) -> SamplingTensors:
    return SamplingTensors.build(
        temperature=[s.params.temperature for s in seqs],
        top_k=[s.params.top_k for s in seqs],
        top_p=[s.params.top_p for s in seqs],
        seeds=[s.seed for s in seqs],
        positions=positions,
        device=device,
    )


def _fails(seq, position: int) -> bool:
    try:
        _build_sampling([seq], [position], "cpu")
    except Exception:
        return True
    return False
