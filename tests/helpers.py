"""Helpers shared by every test package (importable as ``helpers``: tests/conftest.py puts this
folder on ``sys.path``). Fixtures built on them live in tests/conftest.py.

- tiny engines: ``tiny_config`` / ``tiny_draft_spec`` (``dummy:tiny`` on CPU, fp32), ``pin_costs``
  (the goodput policy's costs fixed: decisions independent of the machine); running an
  ``AsyncEngine``: ``collect`` (one request's token ids), ``generate_all`` (prompts at once, then
  ``assert_engine_clean`` and stop);
- SSE: ``parse_sse`` (a whole body) and ``read_event`` (the next event of an open stream);
- servers in a subprocess: ``start_server_process`` / ``verifypd_serve_command`` /
  ``ServerProcess`` (the real ``verifypd serve``), ``smollm_server`` (the embedded model);
- ``bounded``: fail an async test that runs too long instead of hanging; ``wait_until``: poll a
  condition (an engine's or server's state) until it holds;
- ``load_bench``: import a script from bench/ as a module;
- ``triton_on_cpu``: the mark of a test that runs the Triton kernels on CPU tensors.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from verifypd.config import EngineConfig, SpecConfig

REPO = Path(__file__).resolve().parents[1]
READY_RE = re.compile(r"^verifypd serving (?P<model>\S+) at (?P<url>http://\S+)$")

# Triton runs on CPU tensors only on its interpreter, which tests/conftest.py turns on where there
# is no GPU; on a GPU machine these cases would hand CPU pointers to compiled kernels.
triton_on_cpu = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton on CPU tensors needs TRITON_INTERPRET=1 (set without a GPU); the compiled "
    "kernels have their own CUDA tests",
)


# -- tiny engines ----------------------------------------------------------------------------


def tiny_config(**overrides: Any) -> EngineConfig:
    """``EngineConfig`` of the ``dummy:tiny`` model on CPU; keyword arguments override fields."""
    return EngineConfig(**{"model": "dummy:tiny", "device": "cpu", **overrides})


def tiny_draft_spec(**overrides: Any) -> SpecConfig:
    """Draft-model speculation with ``dummy:tiny`` drafting for itself (every draft accepted
    unless the test perturbs the drafter), at a fixed draft length (no controller)."""
    return SpecConfig(
        **{"method": "draft", "draft_model": "dummy:tiny", "controller": False, **overrides}
    )


@dataclass(frozen=True)
class MemoryBound:
    """Step costs of a memory-bound GPU for the goodput policy: a verify nearly as cheap as a
    decode step, drafter steps cheap (``BatchCostModel``'s shape)."""

    def target_time(self, rows: int, q: int) -> float:
        return 1e-2 + 1e-5 * rows * max(q, 1)

    def draft_time(self, rows: int) -> float:
        return 1e-4

    def prefill_time(self, tokens: int) -> float:
        return 1e-3 + 1e-4 * tokens


def pin_costs(costs: Any, controller: Any = None) -> None:
    """An engine's ``BatchCostModel`` on the ``MemoryBound`` shape, its online levels frozen,
    and (given the speculation controller) its decode-latency window kept empty, so that its
    latency guard (p95 decode step above ``p95_decode_target_s``) never fires: the goodput
    policy's decisions then do not depend on this machine's timings (on a loaded 2-core
    machine a tiny model's CPU steps passed the 50 ms target, and a test saw no drafting)."""
    costs.shape = MemoryBound()
    costs.observe = lambda *a, **k: None
    if controller is not None:  # attached by the engine's speculation policy (lanes)
        controller.decode_latency.add = lambda seconds: None


def serve_arrivals(
    core: Any,
    dispatcher: Any,
    arrivals: list[tuple[str, list[int], Any]],
    max_ticks: int,
    after_each: Callable[[], None] | None = None,
) -> None:
    """Adds each (request_id, prompt, params) to ``core`` one ``dispatcher`` tick apart (then
    ``after_each``), then ticks until no request is unfinished, at most ``max_ticks`` times."""

    async def run() -> None:
        for rid, ids, params in arrivals:
            core.add_request(rid, ids, params)
            await dispatcher.tick()
            if after_each is not None:
                after_each()
        for _ in range(max_ticks):
            if not core.has_unfinished():
                return
            await dispatcher.tick()

    asyncio.run(run())


async def collect(engine: Any, request_id: str, prompt: list[int], params: Any) -> list[int]:
    """Every output token id of one (single-choice) request on an ``AsyncEngine``."""
    return [
        t async for out in engine.generate(request_id, prompt, params) for t in out.new_token_ids
    ]


async def consume_some(engine: Any, request_id: str, prompt: list[int], params: Any, n: int):
    """Reads a request's deltas until ``n`` tokens came, then hangs up (an abort)."""
    agen = engine.generate(request_id, prompt, params)
    got = 0
    async for out in agen:
        got += len(out.new_token_ids)
        if got >= n:
            break
    await agen.aclose()


async def hang_up_partway(engine: Any, prompts: list[list[int]], params: Any, every: int):
    """Request ``a{i}`` hangs up after ``3 + every * i`` tokens; returns once the engine has
    nothing left in flight (the aborted requests' steps landed)."""
    jobs = [consume_some(engine, f"a{i}", p, params, 3 + every * i) for i, p in enumerate(prompts)]
    await asyncio.wait_for(asyncio.gather(*jobs), 60)
    for _ in range(100):
        if not engine.dispatcher.has_work():
            break
        await asyncio.sleep(0.01)


async def generate_all(
    engine: Any,
    prompts: list[list[int]],
    params: Any,
    timeout: float = 120.0,
    delays: list[float] | None = None,
) -> list[list[int]]:
    """The prompts' token ids, run on an ``AsyncEngine`` (requests ``r0``, ``r1``...): at once,
    or request i sent ``delays[i]`` seconds after the start; ``params`` one for all, or a list
    (one per prompt). Then the engine must be clean (``assert_engine_clean``), and it is
    stopped."""
    each = params if isinstance(params, list) else [params] * len(prompts)

    async def one(i: int, prompt: list[int]) -> list[int]:
        if delays is not None:
            await asyncio.sleep(delays[i])
        return await collect(engine, f"r{i}", prompt, each[i])

    try:
        jobs = [one(i, p) for i, p in enumerate(prompts)]
        return await asyncio.wait_for(asyncio.gather(*jobs), timeout)
    finally:
        assert_engine_clean(engine)
        await engine.stop()


def spy_drafter(engine: Any) -> tuple[list[int], list[int]]:
    """(tokens each drafter forward behind a step fed, the most tokens a view fed in each
    proposal's first draft step), recorded as the ``AsyncEngine`` runs."""
    drafter = engine.core.spec.drafter
    fed: list[int] = []
    catch_ups: list[int] = []
    follow, propose = drafter.follow_iter, drafter.propose

    def follow_spy(items: Any, *args: Any) -> Any:
        fed.append((yield from follow(items, *args)))
        return fed[-1]

    def propose_spy(*args: Any) -> None:
        propose(*args)
        catch_ups.append(drafter.last_catch_up)

    drafter.follow_iter, drafter.propose = follow_spy, propose_spy
    return fed, catch_ups


def assert_engine_clean(engine: Any) -> None:
    """No request left in an ``AsyncEngine`` and every KV block back (the drafter's too)."""
    engine.check_integrity()
    assert engine.kv_usage == 0 and engine.num_running == engine.num_waiting == 0
    drafter = engine.core.spec.drafter
    if drafter is not None:
        drafter.release_held(wait=True)  # ended requests' follows enqueued on a GPU stream
        assert drafter.kv.usage == 0


# -- async tests and SSE -----------------------------------------------------------------------


def bounded(seconds: float) -> Callable:
    """Decorator: fail an async test that runs longer than ``seconds`` instead of hanging."""

    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        async def run(*args: Any, **kwargs: Any) -> Any:
            return await asyncio.wait_for(fn(*args, **kwargs), seconds)

        return run

    return wrap


async def wait_until(condition: Callable[[], object], timeout: float = 5.0) -> None:
    """Poll ``condition`` every 10 ms until it is true; TimeoutError after ``timeout`` s."""
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.01)


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


async def read_event(resp: Any) -> bytes:
    """The next raw SSE event (``b"data: ...\\n\\n"``) of an open aiohttp response."""
    return await resp.content.readuntil(b"\n\n")


# -- servers in a subprocess -----------------------------------------------------------------


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


def smollm_server(
    *args: str, timeout: float = 180.0, env: dict[str, str] | None = None
) -> ServerProcess:
    """The real server on the embedded SmolLM2-135M on CPU, with extra ``verifypd serve`` args
    (and environment variables on top of this process's)."""
    cmd = verifypd_serve_command("--model", "default", "--device", "cpu", *args)
    extra = {"env": {**os.environ, **env}} if env else {}
    return start_server_process(cmd, timeout=timeout, **extra)


# -- bench scripts ---------------------------------------------------------------------------


def load_bench(name: str) -> ModuleType:
    """Import ``bench/NAME.py`` as module ``bench_NAME`` (bench/ itself goes on ``sys.path`` for
    the scripts' shared imports)."""
    bench = REPO / "bench"
    if sys.path[0] != str(bench):  # first, so that bench/kernels.py wins over tests/kernels
        sys.path.insert(0, str(bench))
    spec = importlib.util.spec_from_file_location(f"bench_{name}", bench / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while decorating
    spec.loader.exec_module(module)
    return module
