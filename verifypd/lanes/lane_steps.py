"""The lanes in priority order, the choice of the next one to launch, and a step in flight."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from verifypd.engine.runner import PendingStep
from verifypd.types import StepPlan

LANES = ("decode", "verify", "prefill")  # priority order
SINGLE_LANE = ("mixed",)  # baseline: decode, verify and prefill fused in one batch


def choose_lane(
    idle: set[str],
    has_work: dict[str, bool],
    prefill_wait_s: float | None,
    ttft_budget_s: float,
    lanes: tuple[str, ...] = LANES,
    verify_due: bool = False,
    prefill_due: bool = False,
) -> str | None:
    """Policy: the highest-priority idle lane with work; a starved prefill first, then a
    verify that has already waited for one decode step (``verify_due``), then a prompt that
    has waited for one step of another lane (``prefill_due``)."""
    starved = prefill_wait_s is not None and prefill_wait_s > ttft_budget_s
    if starved and "prefill" in idle and has_work.get("prefill"):
        return "prefill"
    if verify_due and "verify" in idle and has_work.get("verify"):
        return "verify"
    if prefill_due and "prefill" in idle and has_work.get("prefill"):
        return "prefill"
    for lane in lanes:
        if lane in idle and has_work.get(lane):
            return lane
    return None


@dataclass
class InFlight:
    plan: StepPlan
    pending: PendingStep | None  # None while the launch itself is still running
    start: float
    contended: bool = False  # a prompt step was in flight beside it (the cost model's)


Launcher = Callable[[str, StepPlan], Awaitable[PendingStep]]
