"""Decode-ahead (``EngineConfig.decode_ahead``): the next decode step launched behind the one in
flight.

While a decode step is in flight, the next one is planned and launched behind it on the same
stream, its input tokens read on the device, so the host's fold-back and planning overlap the
GPU instead of sitting between steps. With speculation configured, the policy decides for every
step ahead too (its batch named, since their previous step is still in flight); a decision to
speculate for anyone ends the run ahead: the next step waits for its tokens and drafts (a
drafting step needs landed tokens), and takes the decision made here.

This module holds the rules and the state; the dispatcher plans and launches the step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from verifypd.types import SpecDecision

if TYPE_CHECKING:
    from verifypd.batch_costs import BatchCostModel
    from verifypd.engine.core import EngineCore
    from verifypd.lanes.lane_steps import InFlight
    from verifypd.types import Sequence


class DecodeAhead:
    """Whether a step may go ahead of the decode step in flight, and the step ahead itself."""

    def __init__(
        self,
        enabled: bool,
        beside_prefill: bool,
        waits_for_prompts: bool,
        same_batch_only: bool = False,
    ) -> None:
        self.enabled = enabled
        # ... also while a prompt step is in flight (EngineConfig.decode_ahead_beside_prefill).
        self.beside_prefill = beside_prefill
        # ... but not when a prompt step in flight that ends prompts is predicted to land
        # before the decode step in flight (EngineConfig.decode_ahead_waits_for_prompts): its
        # rows then join the next step instead of waiting behind the one ahead.
        self.waits_for_prompts = waits_for_prompts
        self.step: InFlight | None = None  # the decode step launched behind the one in flight
        self.declined: InFlight | None = None  # the head no step ahead was planned behind
        # The policy's decision for the next decode step, made while deciding whether to run
        # ahead (it speculated, so nothing ran ahead); the next decode plan takes it.
        self.decided: SpecDecision | None = None
        self.decided_for: frozenset[int] = frozenset()  # the seq ids of the batch it saw
        # A kept decision serves only the batch it saw: a row that joined since (a prompt
        # landed) is decided for afresh (SpecConfig.second_token_plain; else it rides the
        # decided round, outside every bound the policy keeps for riders).
        self.same_batch_only = same_batch_only
        self.held: tuple[InFlight, InFlight] | None = None  # (decode, prompt) steps it held for
        self.num_steps = 0  # decode steps launched ahead (tests, benchmarks)
        self.num_held = 0  # steps not launched ahead for a landing prompt (the same)

    def may_ask(self, head: InFlight | None, prompt: InFlight | None, core: EngineCore) -> bool:
        """Whether a step may be planned ahead of ``head``, the decode step in flight, now
        (``prompt``: the prompt step in flight). Asked once per step in flight (the loop polls
        many times a step), except while it holds for a landing prompt: then it is asked
        again as the loop polls, and goes ahead once the prompt has landed."""
        if not self.enabled or self.step is not None or head is None:
            return False
        if not self.beside_prefill and prompt is not None:
            return False  # the host's turnaround between decode steps is the prompt's
        if head.pending is None or head.pending.device_ids is None or head is self.declined:
            return False
        if self._holds_for_prompt(head, prompt, core):
            return False
        self.declined, self.held = head, None  # (the steps held for are not kept alive)
        return True

    def _holds_for_prompt(self, head: InFlight, prompt: InFlight | None, core: EngineCore) -> bool:
        """No step goes ahead of ``head`` yet: ``prompt`` lands first with new rows
        (``lands_first``). Once it has landed, the step ahead is launched with them (behind
        ``head``: the rows in flight wait for nothing); a verdict stands while the same two
        steps are in flight (the loop polls)."""
        if self.held is not None and self.held[0] is head and self.held[1] is prompt:
            return True
        if not self.waits_for_prompts or prompt is None:
            return False
        if not lands_first(prompt, head, core.costs):
            return False
        self.held = (head, prompt)
        self.num_held += 1
        return True

    def keep(self, decision: SpecDecision, batch: list[Sequence]) -> None:
        """Keeps the policy's decision for the step after the one in flight (``batch``: the
        rows it was made for)."""
        self.decided, self.decided_for = decision, frozenset(s.seq_id for s in batch)

    def take_decision(self, decodable: list[Sequence]) -> SpecDecision | None:
        """The decision made for the next decode step while one ran, once; None when there is
        none, everyone it named ended with the step in flight (it is not this batch's), or
        (``same_batch_only``) a row joined that it did not see."""
        decision, self.decided = self.decided, None
        if decision is None or not any(s.seq_id in decision.lens for s in decodable):
            return None
        if self.same_batch_only and any(s.seq_id not in self.decided_for for s in decodable):
            return None
        return decision

    def launched(self, flight: InFlight) -> None:
        self.step, self.declined = flight, None
        self.num_steps += 1

    def move_up(self) -> InFlight | None:
        """The step ahead, handed over as the one in flight before it lands (None: none)."""
        flight, self.step = self.step, None
        return flight


def lands_first(prompt: InFlight, head: InFlight, costs: BatchCostModel) -> bool:
    """``prompt``, the prompt step in flight, ends prompts and is predicted (the cost model) to
    land before ``head``, the decode step in flight. A step launched ahead now could not take
    the prompt's rows: their second token would wait for ``head``, the step ahead (beside the
    next prompt step of a burst, 20-40 ms) and then their own step; held, for ``head`` and
    their own (as in vLLM, the step after the prompt's). Wrong, the rows in flight lose one
    host turnaround; right, nothing (the step goes ahead as it lands)."""
    seqs = prompt.plan.seqs
    if not any(e.seq.num_computed_tokens + e.num_new_tokens >= e.seq.num_tokens for e in seqs):
        return False  # only middle chunks: no row joins
    lands = prompt.start + costs.prefill(prompt.plan.num_tokens)
    return lands <= head.start + costs.decode(len(head.plan.seqs), contended=True)
