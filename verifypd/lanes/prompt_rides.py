"""Prompts riding in decode steps (``EngineConfig.prompt_in_decode_tokens``): the dispatcher's
rules for when a short prompt is computed inside the decode lane's next plain step
(``engine.prompt_in_decode``) instead of in a prompt step beside it.

A prompt rides when its rest is at most ``max_tokens`` and the step has no more rows than the
graphs hold; never in a step that drafts (its verify rows have no graph with a prompt). While a
plain decode step is in flight and none that drafts is coming, the prefill lane leaves such a
prompt to the decode lane, for at most ``MAX_RIDE_WAIT_S`` (then it takes a prompt step).

This module holds the rules; the dispatcher plans and launches.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from verifypd.engine.core import EngineCore
    from verifypd.types import ScheduledSeq

# A prompt that has waited this long for a decode step to ride in takes a prompt step instead.
MAX_RIDE_WAIT_S = 0.03


class PromptRides:
    """Whether the next prompt rides in a decode step, and appending it to one."""

    def __init__(self, core: EngineCore, max_tokens: int) -> None:
        self.sched, self.observer = core.scheduler, core.observer
        self.max_tokens = max_tokens  # the longest rest that rides (0: none does)
        self.max_rows = core.prompt_in_decode_rows if max_tokens else 0  # the graphs' batch

    def ride(self, entries: list[ScheduledSeq]) -> None:
        """Appends the next prompt to a plain decode step's ``entries`` when it fits: the step
        computes it."""
        if self.max_tokens and 0 < len(entries) <= self.max_rows:
            chunk = self.sched.plan_prompt_end(self.max_tokens)
            if chunk is not None:
                entries.append(chunk)
                self.observer.prompt_in_decode()

    def leaves_to_decode(self, plain_in_flight: bool, drafting: bool, wait: float | None) -> bool:
        """The prefill lane leaves the next prompt to the decode lane: a plain decode step is
        in flight (``plain_in_flight``), none that drafts is coming (``drafting``: a round
        under way or decided), the prompt has waited (``wait``) less than ``MAX_RIDE_WAIT_S``
        and it fits."""
        if not self.max_tokens or not plain_in_flight or drafting:
            return False
        if wait is not None and wait >= MAX_RIDE_WAIT_S:
            return False
        return self.sched.prompt_end_fits(self.max_tokens)
