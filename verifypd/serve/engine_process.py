"""The engine in its own process (``verifypd serve --engine-process``): the HTTP front and the
engine stop sharing one event loop.

In one process the front's work (parsing, tokenizing, one SSE write per streamed chunk, metrics)
runs on the loop that also launches the engine's steps, so a busy front delays steps and a step's
host work delays first tokens. Here the front process holds a ``RemoteEngine`` (an
``EngineClient``) and the engine runs in a child process, ``python -m
verifypd.serve.engine_worker FD`` (``serve.engine_worker``), on its own loop, as vLLM splits its
API server from its engine core. They talk over a socketpair (``serve.engine_wire``).

The front replays the engine's observer calls on its own ``PrometheusObserver``, so /metrics and
the dashboard read as in one process; the engine process's own loop lag is one of those calls
(``verifypd_engine_loop_lag_seconds``; ``verifypd_event_loop_lag_seconds`` is the front's). If
the engine process dies, every live request fails, new ones get a 500 and ``closed`` is set
(``verifypd serve`` then exits 1, for its supervisor to restart it).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from verifypd.serve.engine_wire import pack, read_frame, recv_blocking, send_blocking
from verifypd.serve.front_text import FrontText, engine_params, front_detokenizes
from verifypd.types import Observer, ParamError, RequestOutput, RequestTiming, SamplingParams

if TYPE_CHECKING:
    from verifypd.config import EngineConfig

logger = logging.getLogger("verifypd.serve")
STOP_TIMEOUT_S = 30.0  # how long ``stop`` waits for the engine process before killing it


class EngineProcessError(RuntimeError):
    """The engine process is gone (or failed to start for a reason that is not the input's)."""


class RemoteEngine:
    """An ``EngineClient`` whose engine runs in a child process (see the module docstring).

    Construction blocks until the model is loaded (``verifypd serve`` builds engines in a
    loader thread); a model or option the engine rejects raises ``ValueError`` as the
    in-process engine would. ``python`` is the child's interpreter (default: this one).
    """

    def __init__(
        self,
        config: EngineConfig,
        observer: Observer | None = None,
        *,
        python: str = sys.executable,
        log_level: int | None = None,
    ) -> None:
        self.config = config
        self.observer = observer or Observer()
        self.closed = asyncio.Event()  # set once the engine process is gone (stop or death)
        # per request: (delta or error, when the engine process sent it)
        self._queues: dict[str, asyncio.Queue[tuple[RequestOutput | BaseException, float]]] = {}
        # the front's questions, answered in order: reply kind -> the futures waiting for it
        self._asked: dict[str, list[asyncio.Future[Any]]] = {"checked": [], "snapshot": []}
        self._stats = (0, 0, 0.0, 0)  # running, waiting, KV usage, free KV blocks
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task | None = None
        self._stopping = False
        front, child = socket.socketpair()
        try:
            self._proc = subprocess.Popen(
                [python, "-m", "verifypd.serve.engine_worker", str(child.fileno())],
                pass_fds=[child.fileno()],
            )
        finally:
            child.close()
        self._sock = front
        if log_level is None:
            log_level = logging.getLogger("verifypd").getEffectiveLevel()
        try:
            send_blocking(front, ("config", config, log_level))
            reply = recv_blocking(front)  # blocks while the child loads the model
        except (EOFError, OSError) as exc:
            self._reap()
            raise EngineProcessError(
                f"the engine process exited during start-up (code {self._proc.returncode})"
            ) from exc
        if reply[0] == "failed":
            self._reap()
            _, is_value_error, text = reply
            raise ValueError(text) if is_value_error else EngineProcessError(text)
        info = reply[1]
        self.model_name: str = info["model_name"]
        self.tokenizer = info["tokenizer"]
        self.max_model_len: int = info["max_model_len"]
        self.vocab_size: int = info["vocab_size"]
        self._limits = info["limits"]  # engine.admission.RequestLimits
        self._stats = info["stats"]
        self.pid = self._proc.pid

    # -- lifecycle
    async def start(self) -> None:
        if self._reader_task is None:
            self._sock.setblocking(False)
            reader, self._writer = await asyncio.open_unix_connection(sock=self._sock)
            self._reader_task = asyncio.create_task(self._read(reader), name="verifypd-remote")

    async def stop(self) -> None:
        """Abort every live request, stop the engine process and wait for it to exit."""
        if self._stopping:
            return
        self._stopping = True
        if self._writer is None:
            self._sock.close()  # never started: the child sees the end and exits
        else:
            if not self.closed.is_set():
                self._send(("stop",))
                try:
                    await asyncio.wait_for(self.closed.wait(), STOP_TIMEOUT_S)
                except TimeoutError:
                    logger.warning(
                        "engine process did not stop in %.0f s; killing it", STOP_TIMEOUT_S
                    )
                    self._proc.kill()
            self._writer.close()
        await asyncio.get_running_loop().run_in_executor(None, self._wait_exit)

    def _reap(self) -> None:
        """Start-up failed: close our end and wait for the child."""
        self._sock.close()
        self._wait_exit()

    def _wait_exit(self) -> None:
        try:
            self._proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()

    # -- requests
    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        timing: RequestTiming | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Deltas of every choice; a ``ParamError`` raised by the engine's admission is raised
        here; closing early aborts the request in the engine process. Its arrival is stamped
        here (``time.monotonic()``, one clock for both processes): the engine's loop, busy
        enqueueing steps, reads the socket late, and its queue rules read the wait.
        ``arrival_time``: an earlier stamp of the caller's (``AsyncEngine.generate``'s), which
        the engine's admission checks as it checks its own callers'. ``timing``: its arrival,
        the engine process's send of the first delta and this iterator's get of it are stamped."""
        arrival = time.monotonic() if arrival_time is None else arrival_time
        if timing is not None:
            timing.arrival = arrival
        await self.start()
        text = None  # the front makes the text where the engine needs none (front_text)
        if self.tokenizer is not None and front_detokenizes(params):
            text = FrontText(self.tokenizer, prompt_token_ids, params)
        sent = params if text is None else engine_params(params)
        self._send(("add", request_id, list(prompt_token_ids), sent, arrival))
        queue: asyncio.Queue[tuple[RequestOutput | BaseException, float]] = asyncio.Queue()
        self._queues[request_id] = queue
        remaining = params.n
        try:
            while remaining:
                item, sent_at = await queue.get()
                if isinstance(item, BaseException):
                    remaining = 0  # refused or lost: nothing to abort
                    raise item
                remaining -= item.finished
                if timing is not None and timing.first_out is None:
                    timing.engine_first, timing.first_out = sent_at, time.monotonic()
                yield item if text is None else text.fill(item)
        finally:
            self._queues.pop(request_id, None)
            if remaining and not self.closed.is_set():
                self._send(("abort", request_id))

    def abort(self, request_id: str) -> None:
        if not self.closed.is_set():
            self._send(("abort", request_id))

    def max_choice_len(self, n: int) -> int:
        return self._limits.max_choice_len(n)

    async def check_integrity(self) -> None:
        """The engine's own KV/scheduler consistency check, run in the engine process; raises
        AssertionError with its message."""
        error = await self._ask(("check",), "checked")
        if error is not None:
            raise AssertionError(error)

    async def policy_snapshot(self) -> dict[str, Any] | None:
        """The engine process's ``AsyncEngine.policy_snapshot()`` (its speculation policy's
        state now, None without one), as the benchmarks sample it in process."""
        return await self._ask(("snapshot",), "snapshot")

    async def _ask(self, message: tuple, reply: str) -> Any:
        """Sends ``message`` and waits for the engine process's ``reply`` frame to it (the
        engine answers in order, after the deltas it made before it)."""
        self._send(message)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._asked[reply].append(future)
        return await future

    @property
    def num_running(self) -> int:
        return self._stats[0]

    @property
    def num_waiting(self) -> int:
        return self._stats[1]

    @property
    def kv_usage(self) -> float:
        return self._stats[2]

    @property
    def kv_blocks_free(self) -> int:
        return self._stats[3]

    # -- wire
    def _send(self, message: Any) -> None:
        if self._writer is None:
            raise EngineProcessError("the engine is not started")
        if self.closed.is_set():
            raise EngineProcessError("the engine process is gone")
        self._writer.write(pack(message))

    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                message = await read_frame(reader)
                kind = message[0]
                if kind == "step":
                    self._on_step(*message[1:])
                elif kind in self._asked:  # "checked", "snapshot"
                    future = self._asked[kind].pop(0)
                    if not future.done():  # its asker may have been cancelled
                        future.set_result(message[1])
                elif kind == "stopped":
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self._on_closed()

    def _on_step(
        self,
        outputs: list[RequestOutput],
        refused: list[tuple[str, bool, str | None, str]],
        calls: list[tuple[str, tuple]],
        stats: tuple[int, int, float, int],
        sent_at: float,
    ) -> None:
        for name, args in calls:
            getattr(self.observer, name)(*args)
        self._stats = stats
        for request_id, is_input, param, text in refused:
            error = ParamError(param, text) if is_input else EngineProcessError(text)
            self._put(request_id, error, sent_at)
        for out in outputs:
            self._put(out.request_id, out, sent_at)

    def _put(self, request_id: str, item: RequestOutput | BaseException, sent_at: float) -> None:
        queue = self._queues.get(request_id)
        if queue is not None:
            queue.put_nowait((item, sent_at))

    def _on_closed(self) -> None:
        if not self._stopping:
            logger.error("the engine process exited; failing %d live requests", len(self._queues))
        now = time.monotonic()
        for queue in self._queues.values():
            queue.put_nowait((EngineProcessError("the engine process exited"), now))
        for waiting in self._asked.values():
            for future in waiting:
                if not future.done():
                    future.set_exception(EngineProcessError("the engine process exited"))
            waiting.clear()
        self._stats = (0, 0, 0.0, 0)
        self.closed.set()
