"""What the goodput policy reads and answers each step: the batch's rows (``SeqView``), the
prompt work (``LoadSignals``), its decision (``BatchDecision``) and the reasons it gives
(``REASONS``, exported as ``verifypd_spec_policy_decisions_total{decision}``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

REASONS = (
    "speculate",  # a plan beat plain decoding and passed the guard
    "no_gain",  # no plan beat plain decoding by the margin within the guard
    "no_candidates",  # nobody eligible (speculate=False, parked, out of tokens, far behind)
    "latency_guard",  # measured p95 decode step above its target
    "prefill_pressure",  # a prompt waited past prefill_wait_guard_s
    "prefill_running",  # prompt work is in flight or queued (GoodputConfig.yield_to_prefill)
    "batch_too_large",  # more rows than the verify graphs hold
    "probe",  # a probe of parked (or stale) requests was drafted
    "catch_up",  # a catch-up round: drafters far behind fed their context
    "tail_budget",  # a plan would pay, but its late tokens exceed the ITL tail's credit
)


@dataclass(frozen=True)
class SeqView:
    """What the policy sees of one decodable sequence this step."""

    seq_id: int
    drafter_behind: int = 1  # tokens the drafter must feed before drafting (1-2 when steady)
    tokens_left: int = 1 << 30  # tokens before max_tokens: drafts past it are thrown away
    # Its drafter is being fed its prompt behind the prefill (``follow_iter``): it decodes
    # plainly until that is done, and counts as waiting for its catch-up.
    drafter_busy: bool = False
    # Its only token so far came from its prompt step: this step gives its second token
    # (``GoodputConfig.second_token_plain``).
    fresh: bool = False
    # The mean time per token over its tokens left that keeps its TPOT within the target
    # (``tpot_goal.tpot_need_s``; ``GoodputConfig.tpot_deadlines``): None, the target itself.
    tpot_need_s: float | None = None


@dataclass(frozen=True)
class LoadSignals:
    prefill_wait_s: float | None = None  # the oldest waiting prompt's wait; None: none waits
    prefill_running: bool = False  # a prefill step in flight, or prompts waiting for one


@dataclass
class BatchDecision:
    draft_lens: dict[int, int]  # seq_id -> L (0 = plain decode)
    fused: bool  # verify inside the decode step (one target forward)
    reason: str
    draft_len: int = 0  # the L of the speculating set
    predicted_step_s: float = 0.0
    predicted_tokens: float = 0.0
    plain_step_s: float = 0.0
    late_tokens: float = 0.0  # expected tokens later than the ITL tail's bound (tail_budget)


class HeldVerdict(NamedTuple):
    """A verdict of no plan, held while the candidates stay (``key``) up to step ``until``;
    a ``tail_budget`` refusal ends sooner, once the credit covers ``needed`` (the cheapest
    refused plan's late tokens)."""

    key: tuple
    until: int
    reason: str
    needed: float
