"""The engine in its own process (``verifypd serve --engine-process``): the HTTP front and the
engine stop sharing one event loop.

In one process the front's work (parsing, tokenizing, one SSE write per streamed chunk, metrics)
runs on the loop that also launches the engine's steps, so a busy front delays steps and a step's
host work delays first tokens. Here the front process holds a ``RemoteEngine`` (an
``EngineClient``) and the engine runs in a child process, ``python -m
verifypd.serve.engine_process FD``, on its own loop, as vLLM splits its API server from its
engine core.

The wire is a socketpair between the two (never a network socket): length-prefixed pickle frames.

- front to engine: ``("config", EngineConfig, log_level)`` once, then ``("add", id, prompt,
  params)``, ``("abort", id)``, ``("check",)`` and ``("stop",)``;
- engine to front: ``("ready", info)`` or ``("failed", is_value_error, text)`` once, then one
  ``("step", outputs, refused, calls, stats)`` frame per turn of the engine's loop that had
  something to say (every delta, every admission refused with its ``ParamError``, every
  ``Observer`` call, and the running/waiting/KV figures), ``("checked", error)`` and
  ``("stopped",)``.

The front replays the observer calls on its own ``PrometheusObserver``, so /metrics and the
dashboard read as in one process; the engine process's own loop lag is one of those calls
(``verifypd_engine_loop_lag_seconds``; ``verifypd_event_loop_lag_seconds`` is the front's). If
the engine process dies, every live request fails, new ones get a 500 and ``closed`` is set
(``verifypd serve`` then exits 1, for its supervisor to restart it). The child ignores SIGINT
and SIGTERM (the front drains, then sends ``stop``) and exits when the front's end of the socket
closes, even during the model load.
"""

from __future__ import annotations

import asyncio
import logging
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from verifypd.serve.loop_health import probe_lag
from verifypd.types import Observer, ParamError, RequestOutput, SamplingParams

if TYPE_CHECKING:
    from verifypd.config import EngineConfig
    from verifypd.lanes.async_engine import AsyncEngine

logger = logging.getLogger("verifypd.serve")
HEADER = struct.Struct("!I")
STOP_TIMEOUT_S = 30.0  # how long ``stop`` waits for the engine process before killing it


class EngineProcessError(RuntimeError):
    """The engine process is gone (or failed to start for a reason that is not the input's)."""


# -- frames ------------------------------------------------------------------------------


def pack(message: Any) -> bytes:
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(len(body)) + body


def send_blocking(sock: socket.socket, message: Any) -> None:
    sock.sendall(pack(message))


def recv_blocking(sock: socket.socket) -> Any:
    """One frame; raises EOFError when the other end has closed."""
    (size,) = HEADER.unpack(_recv_exactly(sock, HEADER.size))
    return pickle.loads(_recv_exactly(sock, size))


def _recv_exactly(sock: socket.socket, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise EOFError("the other end closed the socket")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


async def read_frame(reader: asyncio.StreamReader) -> Any:
    """One frame; raises ``asyncio.IncompleteReadError`` when the other end has closed."""
    (size,) = HEADER.unpack(await reader.readexactly(HEADER.size))
    return pickle.loads(await reader.readexactly(size))


# -- front -------------------------------------------------------------------------------


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
        self._queues: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._checks: list[asyncio.Future[str | None]] = []
        self._stats = (0, 0, 0.0, 0)  # running, waiting, KV usage, free KV blocks
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task | None = None
        self._stopping = False
        front, child = socket.socketpair()
        try:
            self._proc = subprocess.Popen(
                [python, "-m", "verifypd.serve.engine_process", str(child.fileno())],
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
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        """Deltas of every choice; a ``ParamError`` raised by the engine's admission is raised
        here; closing early aborts the request in the engine process."""
        await self.start()
        self._send(("add", request_id, list(prompt_token_ids), params))
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._queues[request_id] = queue
        remaining = params.n
        try:
            while remaining:
                item = await queue.get()
                if isinstance(item, BaseException):
                    remaining = 0  # refused or lost: nothing to abort
                    raise item
                remaining -= item.finished
                yield item
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
        self._send(("check",))
        future: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
        self._checks.append(future)
        error = await future
        if error is not None:
            raise AssertionError(error)

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
                elif kind == "checked":
                    self._checks.pop(0).set_result(message[1])
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
    ) -> None:
        for name, args in calls:
            getattr(self.observer, name)(*args)
        self._stats = stats
        for request_id, is_input, param, text in refused:
            self._put(request_id, ParamError(param, text) if is_input else EngineProcessError(text))
        for out in outputs:
            self._put(out.request_id, out)

    def _put(self, request_id: str, item: RequestOutput | BaseException) -> None:
        queue = self._queues.get(request_id)
        if queue is not None:
            queue.put_nowait(item)

    def _on_closed(self) -> None:
        if not self._stopping:
            logger.error("the engine process exited; failing %d live requests", len(self._queues))
        for queue in self._queues.values():
            queue.put_nowait(EngineProcessError("the engine process exited"))
        for future in self._checks:
            future.set_exception(EngineProcessError("the engine process exited"))
        self._checks.clear()
        self._stats = (0, 0, 0.0, 0)
        self.closed.set()


# -- engine process ----------------------------------------------------------------------


class RecordingObserver(Observer):
    """Records every ``Observer`` call as (name, args) for the front to replay."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple]] = []
        self.notify: Callable[[], None] | None = None


def _recorder(name: str) -> Callable[..., None]:
    def record(self: RecordingObserver, *args: Any) -> None:
        self.calls.append((name, args))
        if self.notify is not None:
            self.notify()

    record.__name__ = name
    return record


for _name in [n for n in vars(Observer) if not n.startswith("_")]:
    setattr(RecordingObserver, _name, _recorder(_name))


class Relay:
    """The engine process's side: what the engine produced in one turn of the loop, sent as
    one ``step`` frame when the loop next gets to it."""

    def __init__(self, engine: AsyncEngine, observer: RecordingObserver, writer: Any) -> None:
        self.engine = engine
        self.observer = observer
        self.writer = writer
        self.outputs: list[RequestOutput] = []
        self.refused: list[tuple[str, bool, str | None, str]] = []  # id, input's fault, param, text
        self._scheduled = False
        observer.notify = self.touch

    def touch(self) -> None:
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self.flush)

    def deliver(self, out: RequestOutput) -> None:
        self.outputs.append(out)
        self.touch()

    def add(self, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        try:
            self.engine.submit(request_id, prompt, params, self.deliver)
        except ParamError as err:
            self.refused.append((request_id, True, err.param, str(err)))
        except Exception as exc:  # this request fails (a 500), nobody else does
            logger.exception("admitting %s failed", request_id)
            self.refused.append((request_id, False, None, f"the engine could not admit it: {exc}"))
        self.touch()

    def flush(self) -> None:
        self._scheduled = False
        frame = ("step", self.outputs, self.refused, self.observer.calls, _stats(self.engine))
        self.outputs, self.refused, self.observer.calls = [], [], []
        self.writer.write(pack(frame))

    def send(self, message: Any) -> None:
        self.flush()  # what came before this reply arrives before it
        self.writer.write(pack(message))


async def serve_engine(
    engine: AsyncEngine, observer: RecordingObserver, sock: socket.socket
) -> None:
    """Answer the front's frames until ``stop`` or until the front goes away."""
    sock.setblocking(False)
    reader, writer = await asyncio.open_unix_connection(sock=sock)
    relay = Relay(engine, observer, writer)
    await engine.start()
    probe = asyncio.create_task(probe_lag(observer.engine_loop_lag))
    try:
        while True:
            try:
                message = await read_frame(reader)
            except (asyncio.IncompleteReadError, ConnectionError):
                logger.info("the front went away; stopping the engine")
                return
            kind = message[0]
            if kind == "add":
                relay.add(*message[1:])
            elif kind == "abort":
                engine.abort(message[1])
            elif kind == "check":
                relay.send(("checked", _integrity_error(engine)))
            elif kind == "stop":
                await engine.stop()
                relay.send(("stopped",))
                await writer.drain()
                return
    finally:
        probe.cancel()
        await engine.stop()
        writer.close()


def _stats(engine: AsyncEngine) -> tuple[int, int, float, int]:
    return engine.num_running, engine.num_waiting, engine.kv_usage, engine.kv_blocks_free


def _integrity_error(engine: AsyncEngine) -> str | None:
    try:
        engine.check_integrity()
    except AssertionError as err:
        return str(err) or "integrity check failed"
    return None


def _exit_with_front(sock: socket.socket) -> threading.Event:
    """While the model loads: exit as soon as the front's end closes (it sends nothing until
    the engine is ready, so the first thing a peek sees is either the end or a request). Set
    the returned event once loaded: from then on the event loop sees the end and stops the
    engine cleanly."""
    loaded = threading.Event()

    def watch() -> None:
        try:
            if not sock.recv(1, socket.MSG_PEEK) and not loaded.is_set():
                os._exit(3)
        except OSError:
            pass

    threading.Thread(target=watch, name="verifypd-front-watch", daemon=True).start()
    return loaded


def main(argv: list[str]) -> int:
    """The engine process: ``python -m verifypd.serve.engine_process FD``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front drains, then sends "stop"
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sock = socket.socket(fileno=int(argv[1]))
    try:
        _, config, level = recv_blocking(sock)
    except EOFError:
        return 3
    logging.basicConfig(
        stream=sys.stderr,
        level=level,
        format="%(asctime)s %(levelname)s %(name)s[engine]: %(message)s",
    )
    loaded = _exit_with_front(sock)
    observer = RecordingObserver()
    try:
        from verifypd.serve.app import create_engine

        engine = create_engine(config, observer)
    except Exception as exc:
        logger.debug("engine start-up failed", exc_info=True)
        send_blocking(sock, ("failed", isinstance(exc, ValueError), str(exc)))
        return 1
    info = {
        "model_name": engine.model_name,
        "tokenizer": engine.tokenizer,
        "max_model_len": engine.max_model_len,
        "vocab_size": engine.vocab_size,
        "limits": engine.core.limits,
        "stats": _stats(engine),
    }
    loaded.set()
    send_blocking(sock, ("ready", info))
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency; asyncio as fallback
        asyncio.run(serve_engine(engine, observer, sock))
    else:
        uvloop.run(serve_engine(engine, observer, sock))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
