"""The live dashboard: GET /dashboard (one self-contained HTML page, no external assets),
GET /dashboard/data (the current snapshot it polls every second) and GET /dashboard/history
(the last two minutes of per-second snapshots, so a freshly opened page has full charts)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections import deque
from collections.abc import AsyncIterator
from importlib import resources

from aiohttp import web

from verifypd.serve.openai_api import STATE_KEY
from verifypd.serve.state import ServerState

logger = logging.getLogger("verifypd.serve")
HISTORY_LEN = 120
HISTORY_INTERVAL_S = 1.0
HISTORY_KEY: web.AppKey[deque] = web.AppKey("verifypd_dashboard_history", deque)


def add_dashboard(app: web.Application) -> None:
    """Register the dashboard routes and the background sampler of its history."""
    app[HISTORY_KEY] = deque(maxlen=HISTORY_LEN)
    app.router.add_get("/dashboard", dashboard_page)
    app.router.add_get("/dashboard/data", dashboard_data)
    app.router.add_get("/dashboard/history", dashboard_history)
    app.cleanup_ctx.append(_history_sampler)


@functools.cache
def dashboard_html() -> str:
    return resources.files("verifypd.serve").joinpath("dashboard.html").read_text("utf-8")


async def dashboard_page(request: web.Request) -> web.Response:
    return web.Response(text=dashboard_html(), content_type="text/html")


async def dashboard_data(request: web.Request) -> web.Response:
    return web.json_response(dashboard_snapshot(request.app[STATE_KEY]))


async def dashboard_history(request: web.Request) -> web.Response:
    snapshots = list(request.app[HISTORY_KEY])
    return web.json_response({"interval_s": HISTORY_INTERVAL_S, "snapshots": snapshots})


def dashboard_snapshot(state: ServerState) -> dict:
    """Live engine signals plus server-side admission state, as plain JSON."""
    refresh_engine_gauges(state)
    return {
        "time": time.time(),
        "model": state.model_name,
        "phase": state.phase.value,
        "inflight": len(state.inflight),
        "max_queue": state.max_queue,
        "max_model_len": state.engine.max_model_len if state.engine is not None else None,
        **state.observer.live.snapshot(),
    }


def refresh_engine_gauges(state: ServerState) -> None:
    """Pull running/waiting/KV gauges from the engine so scrapes never show stale values."""
    engine = state.engine
    if engine is not None:
        state.observer.sample_engine(
            engine.num_running, engine.num_waiting, engine.kv_usage, engine.kv_blocks_free
        )


async def _history_sampler(app: web.Application) -> AsyncIterator[None]:
    task = asyncio.create_task(_sample_forever(app[STATE_KEY], app[HISTORY_KEY]))
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def _sample_forever(state: ServerState, history: deque) -> None:
    while True:
        await asyncio.sleep(HISTORY_INTERVAL_S)
        if state.engine is None:
            continue
        try:
            history.append(dashboard_snapshot(state))
        except Exception:  # a broken engine property must not kill the sampler
            logger.exception("dashboard sampling failed")
