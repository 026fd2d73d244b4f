"""The synchronous single-lane driver: one step at a time, waited for (the profile benchmarks
and tests that step the engine by hand; ``LLM`` and the CLI run the lane dispatcher).
Its ``step`` is one speculative round, top to bottom:

1. decide and draft (``SpeculationPolicy.plan_mixed``): the policy picks each request's draft
   length L; the scheduler reserves 1 + L slots per speculating sequence
   (``Scheduler.schedule_mixed``); the drafter proposes L tokens for each (``policy.propose``
   -> ``EngineCore.draft``). The drafts are the verify's inputs.
2. verify (``EngineCore.launch``): one target forward over [last token, d_1 .. d_L] per
   sequence, in the same batch as plain decodes and prefill chunks, then acceptance (greedy
   match or rejection sampling); behind it, chained drafts and the drafter's catch-up on the
   prompt chunks where the policy wants them (``policy.after_launch``).
3. roll back and learn (``EngineCore.record_step`` / ``policy.step_landed`` /
   ``EngineCore.finish_step``): step costs, acceptance, each sequence advances by its accepted
   drafts plus one token and releases the slots of the rejected ones; deltas are emitted.

The lane dispatcher runs the same pieces split over three lanes.
"""

from __future__ import annotations

import time

from verifypd.engine.core import EngineCore
from verifypd.lanes.spec_policy import SpeculationPolicy
from verifypd.types import RequestOutput


class SyncDriver:
    """Steps one ``EngineCore`` synchronously under its ``SpeculationPolicy``."""

    def __init__(self, core: EngineCore, policy: SpeculationPolicy | None = None) -> None:
        self.core = core
        self.policy = policy or SpeculationPolicy.of(core)

    def step(self) -> list[RequestOutput]:
        """One single-lane step (plan, launch, wait, fold back); returns its deltas."""
        plan = self.policy.plan_mixed()
        if plan is None:
            return []
        self.core.scheduler.begin_step(plan)
        start = time.perf_counter()
        pending = self.core.launch(plan)
        self.policy.after_launch(plan, pending)
        token_ids = pending.result()
        seconds = pending.seconds(time.perf_counter() - start)
        self.core.record_step(plan, seconds)
        self.policy.step_landed(plan, seconds)
        return self.core.finish_step(plan, token_ids)

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished()
