"""Stepping the lane dispatcher by hand, one step at a time, each waited for (the profile
benchmarks and the tests that step the engine themselves; ``LLM``, the CLI and the server run
the same dispatcher from ``AsyncEngine``'s task). It is not a second driver: ``step`` is one
``LaneDispatcher.tick`` with a launcher that runs the step on the current stream, then a wait
for the step and its fold-back (``LaneDispatcher.collect``).

In the single-lane mode (the default here) one step is one speculative round, top to bottom:

1. decide, plan and draft: the policy picks each request's draft length L as data
   (``SpeculationPolicy.decide`` -> ``SpecDecision``); the scheduler plans the step and
   reserves 1 + L slots per speculating sequence (``Scheduler.schedule_mixed``); the drafting
   step proposes L tokens for each (``LaneDispatcher._draft`` -> ``policy.propose`` ->
   ``EngineCore.draft``). The drafts are the verify's inputs.
2. verify (``EngineCore.launch``): one target forward over [last token, d_1 .. d_L] per
   sequence, in the same batch as plain decodes and prefill chunks, then acceptance (greedy
   match or rejection sampling); behind it, chained drafts and the drafter's catch-up on the
   prompt chunks where the policy wants them (``policy.after_launch``).
3. roll back and learn (``EngineCore.record_step`` / ``policy.step_landed`` /
   ``EngineCore.apply_step``): step costs, acceptance, each sequence advances by its accepted
   drafts plus one token and releases the slots of the rejected ones; deltas are emitted.

With ``single_lane=False`` the same pieces run split over the three lanes, one lane's step
per ``step``.
"""

from __future__ import annotations

from collections.abc import Coroutine

from verifypd.engine.core import EngineCore
from verifypd.engine.runner import PendingStep
from verifypd.lanes.dispatcher import LaneDispatcher
from verifypd.lanes.spec_policy import SpeculationPolicy
from verifypd.types import RequestOutput, StepPlan


class SyncDriver:
    """Steps one ``EngineCore``'s lane dispatcher synchronously."""

    def __init__(
        self,
        core: EngineCore,
        policy: SpeculationPolicy | None = None,
        single_lane: bool = True,
    ) -> None:
        self.core = core
        self.policy = policy or SpeculationPolicy.of(core)
        self._outputs: list[RequestOutput] = []
        self.dispatcher = LaneDispatcher(
            core,
            self._launch,
            self._outputs.append,
            ttft_budget_s=core.config.scheduler.ttft_budget_s,
            single_lane=single_lane,
            policy=self.policy,
            prompt_in_decode_tokens=core.prompt_in_decode_tokens,
            steps_land=True,  # each step is waited for before the next tick
        )

    async def _launch(self, lane: str, plan: StepPlan) -> PendingStep:
        pending = self.core.launch(plan)
        self.policy.after_launch(plan, pending)
        return pending

    def step(self) -> list[RequestOutput]:
        """One lane step (plan, launch, wait, fold back); returns its deltas."""
        d = self.dispatcher
        _run_now(d.tick())
        for flight in list(d.in_flight.values()):
            flight.pending.result()  # waits for the device
        d.collect()
        outputs, self._outputs[:] = list(self._outputs), []
        return outputs

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished()


def _run_now(coro: Coroutine) -> None:
    """Runs a coroutine that never suspends (the launcher above awaits nothing) to its end,
    without an event loop."""
    try:
        coro.send(None)
    except StopIteration:
        return
    coro.close()
    raise RuntimeError("a synchronous lane step suspended")
