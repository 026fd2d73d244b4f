"""Reusable helpers for server tests.

In-process: ``serve_engine(engine, ...)`` runs ``build_app`` on an aiohttp TestServer (which
always enables handler cancellation, like ``run_server``) and yields a :class:`Harness`.

Subprocess: ``start_server_process(cmd)`` launches a real server (``verifypd serve ...`` via
``verifypd_serve_command`` or the FakeEngine script via ``fake_server_command``) and waits for
its ready line; ``ServerProcess.stop()`` sends SIGTERM and returns the exit code.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import re
import signal
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from verifypd.serve.app import build_app
from verifypd.serve.openai_api import STATE_KEY
from verifypd.serve.state import ServerState
from verifypd.serve.transport import OpenAIAppRunner

READY_RE = re.compile(r"^verifypd serving (?P<model>\S+) at (?P<url>http://\S+)$")
FAKE_SERVER = Path(__file__).with_name("fake_server.py")


def bounded(seconds: float) -> Callable:
    """Decorator: fail an async test that runs longer than ``seconds`` instead of hanging."""

    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        async def run(*args: Any, **kwargs: Any) -> Any:
            return await asyncio.wait_for(fn(*args, **kwargs), seconds)

        return run

    return wrap


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
        async with asyncio.timeout(timeout):
            while self.engine.num_running or self.engine.num_waiting or self.state.inflight:
                await asyncio.sleep(0.01)


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


def parse_sse(body: str) -> list[Any]:
    """SSE body -> list of decoded ``data:`` payloads (``"[DONE]"`` kept as the string)."""
    events = []
    for block in body.split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), f"not an SSE data event: {block!r}"
        data = block[len("data: ") :]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


# -- subprocess --------------------------------------------------------------------------


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    url: str = ""
    model: str = ""
    stdout: list[str] = field(default_factory=list)
    stderr: list[str] = field(default_factory=list)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        """Send ``sig`` and wait for the exit code (kill after ``timeout``)."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def start_server_process(cmd: list[str], timeout: float = 120.0, **popen: Any) -> ServerProcess:
    """Launch ``cmd`` and wait for ``verifypd serving MODEL at URL`` on its stdout."""
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1, **popen
    )
    server = ServerProcess(proc)
    ready = threading.Event()
    threading.Thread(target=_read_lines, args=(proc.stdout, server, ready), daemon=True).start()
    threading.Thread(target=_read_lines, args=(proc.stderr, server, None), daemon=True).start()
    _wait_ready(server, ready, timeout)
    return server


def _read_lines(stream: Any, server: ServerProcess, ready: threading.Event | None) -> None:
    sink = server.stderr if ready is None else server.stdout
    for line in stream:
        sink.append(line.rstrip("\n"))
        match = READY_RE.match(sink[-1]) if ready is not None else None
        if match:
            server.url, server.model = match["url"], match["model"]
            ready.set()


def _wait_ready(server: ServerProcess, ready: threading.Event, timeout: float) -> None:
    deadline = timeout
    while not ready.wait(0.1):
        deadline -= 0.1
        if server.proc.poll() is not None or deadline <= 0:
            server.proc.kill()
            server.proc.wait()
            log = "\n".join(server.stdout + server.stderr)
            raise RuntimeError(f"server did not become ready (rc={server.proc.returncode}):\n{log}")


def verifypd_serve_command(*args: str) -> list[str]:
    """``python -m verifypd serve --port 0 ARGS`` (the real engine; port printed when ready)."""
    return [sys.executable, "-m", "verifypd", "serve", "--port", "0", *args]


def fake_server_command(*args: str) -> list[str]:
    """The real ``run_server`` around a FakeEngine (see fake_server.py for its options)."""
    return [sys.executable, str(FAKE_SERVER), "--port", "0", *args]
