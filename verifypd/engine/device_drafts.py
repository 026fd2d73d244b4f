"""Drafts where they were made: the runner-side half of a drafted plan entry.

A plan entry (``types.ScheduledSeq``) is plain data: its draft count lives in
``draft_token_ids`` (the ids, or ``DRAFT_ON_DEVICE`` placeholders while they are still on the
GPU). What only the device can read rides beside it in one ``DeviceDrafts``, made by the
drafter (``speculative.DraftModelProposer``, ``chained_drafts.DraftChainer``) and read by the
runner's verify (``step_inputs``: the ids copied into the verify's input; ``runner``: the
drafter's distributions for rejection sampling) and by the executor (a verify on another stream
waits for ``ready``). Proposing never syncs the host with the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DeviceDrafts:
    """One entry's drafts on the device."""

    ids: torch.Tensor | None = None  # [L] int64 draft ids; None: the host ids are the drafts
    probs: torch.Tensor | None = None  # [L, V] the drafter's distributions; None: deterministic
    ready: torch.cuda.Event | None = None  # recorded after the drafting kernels

    def truncate(self, n: int) -> None:
        """Keeps the first ``n`` drafts."""
        if self.ids is not None:
            self.ids = self.ids[:n]
        if self.probs is not None:
            self.probs = self.probs[:n]


def device_ids(entry) -> torch.Tensor | None:
    """``entry``'s draft ids still on the device, or None."""
    drafts = entry.drafts
    return drafts.ids if drafts is not None else None


def drafter_probs(entry) -> torch.Tensor | None:
    """``entry``'s drafter distributions [L, V], or None for deterministic drafts."""
    drafts = entry.drafts
    return drafts.probs if drafts is not None else None
