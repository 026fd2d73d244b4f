"""Shared helpers of the goodput policy tests: a memory-bound GPU in miniature (``Shape``), a
policy on simulated time priced with it, and requests added to it, taught an acceptance history
and seen as a batch."""

import random
from dataclasses import dataclass

from controller_sim import FakeClock

from verifypd.config import SpecConfig
from verifypd.controller import BatchCostModel, GoodputConfig, SeqView, build_policy


@dataclass(frozen=True)
class Shape:
    """A memory-bound GPU in miniature: a forward reads the weights (``fixed``) and pays a
    little per token; a drafter step is ``draft`` plus a little per row."""

    fixed: float = 10e-3
    per_token: float = 20e-6
    draft: float = 0.6e-3
    prefill_token: float = 20e-6

    def target_time(self, rows, q):
        return self.fixed + self.per_token * rows * max(q, 1)

    def draft_time(self, rows):
        return self.draft + 5e-6 * rows

    def prefill_time(self, tokens):
        return self.fixed + self.prefill_token * tokens


def _policy(shape=Shape(), clock=None, max_draft_len=4, **goodput):
    spec = SpecConfig(max_draft_len=max_draft_len, initial_draft_len=max_draft_len)
    return build_policy(spec, BatchCostModel(shape), GoodputConfig(**goodput), clock or FakeClock())


def _add(policy, n, start=0, greedy=True, speculate=True):
    for i in range(start, start + n):
        policy.add_request(i, greedy, 0.0 if greedy else 0.8, speculate)
    return list(range(start, start + n))


def _teach(policy, seq_id, alpha, verifies=40, L=4, seed=0):
    """Acceptance history of a request whose drafts are accepted with probability α (the same
    history for every request taught with the same α and seed)."""
    rng = random.Random(seed)
    for _ in range(verifies):
        k = 0
        while k < L and rng.random() < alpha:
            k += 1
        policy.observe_acceptance(seq_id, L, k)


def _views(ids, behind=1):
    return [SeqView(i, behind) for i in ids]
