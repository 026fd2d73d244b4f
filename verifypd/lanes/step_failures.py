"""A launch that raised ends the requests it concerns with "error", and only those: one
request's failure never fails another, and nothing of a step that never ran reaches the cache."""

from __future__ import annotations

import logging
from collections.abc import Callable

from verifypd.engine.core import EngineCore
from verifypd.types import RequestOutput, StepPlan


class StepFailures:
    def __init__(self, core: EngineCore, deliver: Callable[[RequestOutput], None]) -> None:
        self.core = core
        self._deliver = deliver

    def isolate(self, plan: StepPlan, request_ids: set[str]) -> StepPlan | None:
        """Ends the failed requests with "error"; returns the step without them (None, after
        failing the whole step, when none of them is in it)."""
        failed = [e for e in plan.seqs if e.seq.request_id in request_ids]
        if not failed:
            self.fail(plan)
            return None
        logging.getLogger("verifypd").exception("requests %s failed", sorted(request_ids))
        self.core.scheduler.abandon(StepPlan(plan.lane, failed))
        self.end_requests(request_ids)
        return StepPlan(plan.lane, [e for e in plan.seqs if e.seq.request_id not in request_ids])

    def fail(self, plan: StepPlan) -> None:
        """A launch raised: end the affected requests with "error" instead of hanging."""
        logging.getLogger("verifypd").exception("lane step failed; ending its requests")
        self.core.scheduler.abandon(plan)  # its KV was never written: nothing may reach the cache
        self.end_requests({s.seq.request_id for s in plan.seqs})

    def end_requests(self, request_ids: set[str]) -> None:
        for rid in request_ids:
            for out in self.core.abort_request(rid, "error"):
                self._deliver(out)
