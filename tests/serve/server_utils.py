"""Helpers for the server tests on a FakeEngine.

In-process: ``serve_engine(engine, ...)`` runs ``build_app`` on an aiohttp TestServer (which
always enables handler cancellation, like ``run_server``) and yields a :class:`Harness`.

Subprocess: ``fake_server_command`` is the real ``run_server`` around a FakeEngine, for
``helpers.start_server_process``. The SSE readers, ``bounded``, ``wait_until`` and the
subprocess helpers live in tests/helpers.py and are re-exported here for the serve tests.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from helpers import (  # noqa: F401  (re-exported)
    ServerProcess,
    bounded,
    parse_sse,
    read_event,
    start_server_process,
    verifypd_serve_command,
    wait_until,
)

from verifypd.serve.app import build_app
from verifypd.serve.openai_api import STATE_KEY
from verifypd.serve.state import ServerState
from verifypd.serve.transport import OpenAIAppRunner

FAKE_SERVER = Path(__file__).with_name("fake_server.py")


# -- in-process --------------------------------------------------------------------------


class OpenAITestServer(TestServer):
    """TestServer with run_server's runner (protocol errors in the OpenAI shape)."""

    async def _make_runner(self, **kwargs: Any) -> web.AppRunner:
        return OpenAIAppRunner(self.app, **kwargs)


@dataclass
class Harness:
    client: TestClient
    engine: Any
    app: web.Application

    @property
    def state(self) -> ServerState:
        return self.app[STATE_KEY]

    async def wait_engine_idle(self, timeout: float = 5.0) -> None:
        """Wait until the engine has no running/waiting work and the server nothing in flight."""
        engine, state = self.engine, self.state
        await wait_until(
            lambda: not (engine.num_running or engine.num_waiting or state.inflight), timeout
        )


@contextlib.asynccontextmanager
async def serve_engine(
    engine: Any, *, max_queue: int = 64, **kwargs: Any
) -> AsyncIterator[Harness]:
    """Start ``engine``, serve it with ``build_app`` and yield a connected test client."""
    await engine.start()
    app = build_app(engine, max_queue=max_queue, **kwargs)
    # TestServer always runs with handler_cancellation=True, like run_server.
    client = TestClient(OpenAITestServer(app))
    await client.start_server()
    try:
        yield Harness(client, engine, app)
    finally:
        await client.close()
        await engine.stop()


def fake_server_command(*args: str) -> list[str]:
    """The real ``run_server`` around a FakeEngine (see fake_server.py for its options)."""
    return [sys.executable, str(FAKE_SERVER), "--port", "0", *args]
