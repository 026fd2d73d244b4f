"""Acceptance-aware feedback controller (draft length and drafter temperature per request)
and the signal trackers it reads. Pure Python: no torch, no engine, lanes or serve imports."""

from verifypd.controller.draft_controller import (
    ControllerConfig,
    DraftController,
    FixedController,
    build_controller,
)
from verifypd.controller.policy import expected_tokens
from verifypd.controller.signals import (
    AcceptanceEstimate,
    Ewma,
    StepCostModel,
    StepCosts,
    WindowPercentile,
)

__all__ = [
    "AcceptanceEstimate",
    "ControllerConfig",
    "DraftController",
    "Ewma",
    "FixedController",
    "StepCostModel",
    "StepCosts",
    "WindowPercentile",
    "build_controller",
    "expected_tokens",
]
