"""Server lifecycle pieces: engine loading off the event loop, signals, graceful drain."""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from verifypd.serve.state import ServerState

logger = logging.getLogger("verifypd.serve")
T = TypeVar("T")
ABORT_GRACE_S = 5.0  # after the drain deadline, how long aborted streams get to end cleanly


def run_event_loop(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` on uvloop (asyncio's loop where uvloop is missing): the server's front and
    the engine process both do."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency; keep asyncio as fallback
        return asyncio.run(main)
    return uvloop.run(main)


async def run_in_daemon_thread(fn: Callable[[], T]) -> T:
    """Run a slow blocking call (model loading) in a daemon thread and await its result.

    A daemon thread (not the default executor) lets the process exit on SIGTERM even while a
    load is still running.
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if not future.done():
            future.set_result(value) if ok else future.set_exception(value)

    def work() -> None:
        try:
            result, ok = fn(), True
        except BaseException as exc:  # handed to the awaiting coroutine
            result, ok = exc, False
        try:
            loop.call_soon_threadsafe(settle, ok, result)
        except RuntimeError:  # the loop is gone: nobody is waiting any more
            pass

    threading.Thread(target=work, name="verifypd-engine-load", daemon=True).start()
    return await future


class ShutdownSignals:
    """SIGTERM/SIGINT once: drain. Twice: stop waiting for in-flight requests."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.stopped = asyncio.Event()
        self.forced = asyncio.Event()

    def install(self, loop: asyncio.AbstractEventLoop) -> None:
        for sig in self.SIGNALS:
            loop.add_signal_handler(sig, self._on_signal, sig)

    def remove(self, loop: asyncio.AbstractEventLoop) -> None:
        for sig in self.SIGNALS:
            loop.remove_signal_handler(sig)

    def _on_signal(self, sig: signal.Signals) -> None:
        if self.stopped.is_set():
            logger.warning("second %s: aborting in-flight requests now", sig.name)
            self.forced.set()
        else:
            logger.info("%s: draining", sig.name)
            self.stopped.set()

    async def unless_stopped(self, work: Awaitable[T]) -> T | None:
        """Await ``work`` unless a stop signal comes first (then cancel it, return None)."""
        task = asyncio.ensure_future(work)
        stop = asyncio.ensure_future(self.stopped.wait())
        await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        if task.done():
            return task.result()
        task.cancel()
        return None


async def drain(
    state: ServerState,
    timeout: float,
    forced: asyncio.Event | None = None,
    grace: float = ABORT_GRACE_S,
) -> bool:
    """Stop admitting, let in-flight requests finish for up to ``timeout`` seconds, then abort
    the rest (their streams end with an error event and ``[DONE]``). True if none was aborted."""
    state.begin_drain()
    logger.info("draining %d in-flight requests (timeout %.1fs)", len(state.inflight), timeout)
    if await _idle_or_forced(state, timeout, forced):
        return True
    logger.warning("drain deadline: aborting %d requests", state.abort_inflight())
    await state.wait_idle(grace)
    return False


async def _idle_or_forced(state: ServerState, timeout: float, forced: asyncio.Event | None) -> bool:
    idle = asyncio.ensure_future(state.wait_idle(timeout))
    waiters = {idle}
    if forced is not None:
        waiters.add(asyncio.ensure_future(forced.wait()))
    await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    for waiter in waiters:
        waiter.cancel()
    return idle.done() and not idle.cancelled() and idle.result()
