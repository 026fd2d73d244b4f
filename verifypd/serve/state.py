"""Server state shared by the handlers: lifecycle phase, engine, admission bound.

Admission: ``max_queue`` bounds the number of generation requests the server has handed to the
engine and not yet finished (queued in the engine + running + streaming their last bytes).
Request ``max_queue + 1`` gets 429 with ``Retry-After``; nothing ever waits in the server.
"""

from __future__ import annotations

import asyncio
import enum
import time
from typing import TYPE_CHECKING

from verifypd.serve.engine_client import EngineClient
from verifypd.serve.errors import model_not_found, overloaded, unavailable
from verifypd.serve.limits import ServeLimits

if TYPE_CHECKING:
    from verifypd.serve.metrics import PrometheusObserver

RETRY_AFTER_FULL_S = 1
RETRY_AFTER_DRAINING_S = 5


class Phase(enum.Enum):
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"


class ServerState:
    """Phase, engine handle and in-flight requests of one app."""

    def __init__(
        self,
        max_queue: int,
        observer: PrometheusObserver,
        served_model_name: str | None = None,
        api_key: str | None = None,
        limits: ServeLimits | None = None,
    ) -> None:
        if max_queue < 1:
            raise ValueError("max_queue must be >= 1")
        self.max_queue = max_queue
        self.observer = observer
        self.served_model_name = served_model_name
        self.api_key = api_key
        self.limits = limits or ServeLimits()
        self.engine: EngineClient | None = None
        self.phase = Phase.STARTING
        self.started_at = int(time.time())
        self.inflight: dict[str, float] = {}  # request id -> admission time
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        return self.engine.model_name if self.engine is not None else self.observer.model_name

    @property
    def is_ready(self) -> bool:
        return self.phase is Phase.READY

    def attach(self, engine: EngineClient) -> None:
        """Hand a started engine to the server and become ready."""
        self.engine = engine
        self.observer.set_model_name(self.model_name)
        self.phase = Phase.READY

    def begin_drain(self) -> None:
        self.phase = Phase.DRAINING

    def check_accepting(self) -> None:
        """Raise 503 unless the server takes new generation requests."""
        if self.phase is Phase.STARTING:
            raise unavailable("starting (loading the model)", RETRY_AFTER_DRAINING_S)
        if self.phase is Phase.DRAINING:
            raise unavailable("shutting down", RETRY_AFTER_DRAINING_S)

    def check_model(self, requested: str | None) -> None:
        """404 unless ``requested`` is None or one of the names this server answers to."""
        names = {self.model_name, self.engine.model_name if self.engine is not None else None}
        if requested is not None and requested not in names:
            raise model_not_found(requested, self.model_name)

    def check_capacity(self) -> None:
        """429 when the admission bound is reached (checked before tokenizing, and again at
        admission)."""
        if len(self.inflight) >= self.max_queue:
            raise overloaded(self.max_queue, RETRY_AFTER_FULL_S)

    def admit(self, request_id: str) -> None:
        """Count a request against the bound, or raise 429."""
        self.check_accepting()
        self.check_capacity()
        self.inflight[request_id] = time.monotonic()
        self._idle.clear()

    def release(self, request_id: str) -> None:
        self.inflight.pop(request_id, None)
        if not self.inflight:
            self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no request is in flight; False on timeout."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True

    def abort_inflight(self) -> int:
        """Ask the engine to abort every in-flight request (drain deadline passed)."""
        ids = list(self.inflight)
        for request_id in ids:
            self.engine.abort(request_id)
        return len(ids)
