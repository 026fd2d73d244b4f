"""What a launched step leaves behind: its packed result's layout (``ResultSlot``), the handle
the host waits on (``PendingStep``) and a verify's outputs still on the device (``VerifyOutputs``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from verifypd.engine.logprobs import StepLogprobs
from verifypd.engine.timing import Span
from verifypd.types import StepPlan


@dataclass
class VerifyOutputs:
    """What a launched verify leaves on the device, for drafting the next round behind it
    before the host has seen it: row ``k`` is ``plan.seqs[seqs[k]]``."""

    seqs: list[int]  # plan indices of the verified seqs
    input_ids: torch.Tensor  # [T] the verify's input ids (drafts copied in)
    first_rows: list[int]  # per seq: its row of ``input_ids`` holding its last known token
    out: torch.Tensor  # [B, 1 + L] accepted drafts, then the final token
    num_accepted: torch.Tensor  # [B] int64


@dataclass(frozen=True)
class ResultSlot:
    """Where one plan entry's tokens sit in a step's packed result (flat int64 ``[N]``).

    - no token (a prompt chunk short of the prompt's end): ``start == -1``;
    - one sampled token: ``packed[start]`` (``accepted_at == -1``);
    - a verify of L drafts: ``packed[start : start + 1 + L]`` holds the accepted drafts, then
      the final token; ``packed[accepted_at]`` says how many drafts were accepted, so the
      entry's tokens are ``packed[start : start + packed[accepted_at] + 1]``.
    """

    start: int = -1
    accepted_at: int = -1

    def tokens(self, flat: list[int]) -> list[int]:
        if self.start < 0:
            return []
        if self.accepted_at < 0:
            return [flat[self.start]]
        return flat[self.start : self.start + flat[self.accepted_at] + 1]


NO_TOKEN = ResultSlot()


class PendingStep:
    """A launched step. ``done()`` polls without blocking; ``result()`` returns token ids."""

    def __init__(
        self,
        plan: StepPlan,
        packed: torch.Tensor | None,
        layout: list[ResultSlot],
        event=None,
    ):
        self.plan = plan
        self._packed = packed  # host tensor (pinned on CUDA) filled by a non-blocking copy
        self._layout = layout  # one slot per plan entry
        self._event = event
        self.span: Span | None = None  # from when its drafts were ready (device drafts only)
        self.verified: VerifyOutputs | None = None  # a verify's results, still on the device
        self.logprobs: StepLogprobs | None = None  # log-probs riding in the same buffer
        # The packed result on the device (before its copy to the host): a decode step planned
        # ahead of this one reads its input tokens there (``sampled_at``).
        self.device_ids: torch.Tensor | None = None

    def seconds(self, wall: float) -> float:
        """The step's own duration: with drafts still being made on the GPU when it was
        launched, its GPU time after them (its launch-to-done ``wall`` time holds the drafting
        too); else ``wall``."""
        measured = self.span.seconds() if self.span is not None else None
        return wall if measured is None else measured

    def done(self) -> bool:
        return self._event is None or self._event.query()

    def sampled_at(self, i: int) -> int:
        """Where plan entry ``i``'s one sampled token sits in ``device_ids``; -1 when it has
        none or more than one (a prompt chunk short of its end, a verify)."""
        slot = self._layout[i]
        return slot.start if slot.accepted_at < 0 and self.device_ids is not None else -1

    def result(self) -> list[list[int]]:
        if self._event is not None:
            self._event.synchronize()
        flat = self._packed.tolist() if self._packed is not None else []
        out = [slot.tokens(flat) for slot in self._layout]
        if self.logprobs is not None:
            self.logprobs.unpack(self._packed, self.plan, out)
        return out
