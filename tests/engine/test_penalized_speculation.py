"""Sampling with penalties under speculation follows the penalised target distribution.

A Markov target (logits ``T[prev]``) with strong penalties: every position of a verify is
processed by the engine's logits pipeline with its drafts counted, and rejection sampling
draws from the result. The first two emitted tokens must follow the exact penalised
distribution: t0 from the penalties of the prompt alone, t1 from those with t0 counted as
output (whether t1 came from the same verify, after an accepted draft, or from the next one).
"""

from __future__ import annotations

import pytest
import torch
from logits_reference import reference_row
from stats_helpers import single_thread  # noqa: F401
from test_rejection import assert_matches, plain_tensors

from verifypd.engine.logits_pipeline import LogitsProcessor
from verifypd.engine.rejection import rejection_sample
from verifypd.engine.sampler import SamplingTensors, processed_probs, sample
from verifypd.types import SamplingParams, Sequence

V = 5
NUM_ROWS = 20_000
MAX_DRAFTS = 3
PROMPT = [0]
PARAMS = SamplingParams(
    max_tokens=8, temperature=1.0, frequency_penalty=1.2, presence_penalty=0.4,
    repetition_penalty=1.5, logit_bias={1: 0.7},
)  # fmt: skip


def _target_probs(logits: torch.Tensor) -> torch.Tensor:
    n = logits.shape[0]
    t = SamplingTensors.build([1.0] * n, [0] * n, [1.0] * n, [0] * n, [0] * n, "cpu")
    return processed_probs(logits, t)


def _round(proc, seqs, T, Q, seeds, positions, num_drafts, deterministic):
    """Drafts from the (unpenalised) drafter Q, then a verify of the penalised target."""
    prev = torch.tensor([s.last_token_id for s in seqs])
    drafts, draft_dists, target_rows = [], [], []
    for j in range(MAX_DRAFTS):
        target_rows.append(T[prev])
        q = Q[prev]
        x = q.argmax(-1) if deterministic else sample(q.log(), plain_tensors(seeds, positions + j))
        drafts.append(x)
        draft_dists.append(q)
        prev = x
    target_rows.append(T[prev])
    drafts = torch.stack(drafts, 1)
    logits = proc.process(torch.stack(target_rows, 1), seqs, drafts, num_drafts)
    target = _target_probs(logits.view(-1, V)).view(logits.shape)
    q = None if deterministic else torch.stack(draft_dists, 1)
    return rejection_sample(target, q, drafts, num_drafts, seeds, positions)


def _penalised(T: torch.Tensor, output: list[int]) -> torch.Tensor:
    """The exact next-token distribution after ``PROMPT + output``."""
    prev = (PROMPT + output)[-1]
    return torch.softmax(reference_row(T[prev], PROMPT, output, PARAMS), dim=-1)


@pytest.mark.parametrize("drafter", ["sampled", "deterministic"])
def test_penalised_speculation_follows_the_penalised_target(drafter):
    gen = torch.Generator().manual_seed(7)
    T = torch.randn(V, V, generator=gen) * 1.5
    T[:, 2] += 1.0  # a likely token, so repeats (and their penalties) matter
    # The drafter knows the target's logits but not the penalties: drafts that the penalties
    # would make unlikely get proposed, and must be rejected at the right rate.
    Q = torch.softmax(T, dim=-1)
    deterministic = drafter == "deterministic"
    seqs = [Sequence(f"r{i}", PROMPT, PARAMS) for i in range(NUM_ROWS)]
    seeds = torch.arange(NUM_ROWS) * 7919 + 3
    positions = torch.full((NUM_ROWS,), len(PROMPT))
    num_drafts = torch.randint(1, MAX_DRAFTS + 1, (NUM_ROWS,), generator=gen)
    proc = LogitsProcessor(torch.device("cpu"))

    out, num_accepted = _round(proc, seqs, T, Q, seeds, positions, num_drafts, deterministic)
    first = out[:, 0]
    for s, t0 in zip(seqs, first.tolist(), strict=True):
        s.token_ids.append(t0)  # the next round counts t0 (an incremental update)
    out2, _ = _round(proc, seqs, T, Q, seeds, positions + 1, num_drafts, deterministic)
    second = torch.where(num_accepted >= 1, out[:, 1], out2[:, 0])
    assert (num_accepted >= 1).float().mean() > 0.2, "the verify path must be exercised"

    p0 = _penalised(T, [])
    assert_matches(torch.bincount(first, minlength=V), p0, 0.02, f"first {drafter}")
    joint = torch.stack([p0[a] * _penalised(T, [a]) for a in range(V)])  # [V, V]
    counts = torch.bincount(first * V + second, minlength=V * V)
    assert_matches(counts, joint, 0.03, f"joint {drafter}")
