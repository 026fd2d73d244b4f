"""Speculation policies: the load-aware goodput policy (per step, for the batch), the older
acceptance-aware feedback controller (per request), fixed L, and the signal trackers and cost
models they read. Pure Python: no torch, no engine, lanes or serve imports."""

from verifypd.batch_costs import BatchCostModel
from verifypd.controller.decisions import BatchDecision, LoadSignals, SeqView
from verifypd.controller.draft_controller import (
    ControllerConfig,
    DraftController,
    FixedController,
    build_controller,
)
from verifypd.controller.goodput import GoodputConfig, GoodputPolicy, build_policy
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
    "BatchCostModel",
    "BatchDecision",
    "GoodputConfig",
    "GoodputPolicy",
    "LoadSignals",
    "SeqView",
    "build_policy",
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
