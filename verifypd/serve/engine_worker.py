"""The engine process of ``verifypd serve --engine-process``: ``python -m
verifypd.serve.engine_worker FD``. It builds the engine from the config the front sends, then
answers the front's frames (``serve.engine_wire``) on its own event loop: each turn of the loop
that produced anything (deltas, refused admissions, observer calls) is one ``step`` frame.

It ignores SIGINT and SIGTERM (the front drains, then sends ``stop``) and exits when the front's
end of the socket closes, even during the model load.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from verifypd.serve.engine_wire import pack, read_frame, recv_blocking, send_blocking
from verifypd.serve.lifecycle import run_event_loop
from verifypd.serve.loop_health import probe_lag
from verifypd.types import Observer, ParamError, RequestOutput, SamplingParams

if TYPE_CHECKING:
    from verifypd.lanes.async_engine import AsyncEngine

logger = logging.getLogger("verifypd.serve")


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

    def add(
        self, request_id: str, prompt: list[int], params: SamplingParams, arrival: float
    ) -> None:
        try:
            self.engine.submit(request_id, prompt, params, self.deliver, arrival)
        except ParamError as err:
            self.refused.append((request_id, True, err.param, str(err)))
        except Exception as exc:  # this request fails (a 500), nobody else does
            logger.exception("admitting %s failed", request_id)
            self.refused.append((request_id, False, None, f"the engine could not admit it: {exc}"))
        self.touch()

    def flush(self) -> None:
        self._scheduled = False
        stats = _stats(self.engine)
        frame = ("step", self.outputs, self.refused, self.observer.calls, stats, time.monotonic())
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
        while (message := await _next_frame(reader)) is not None and message[0] != "stop":
            kind = message[0]
            if kind == "add":
                relay.add(*message[1:])
            elif kind == "abort":
                engine.abort(message[1])
            elif kind == "check":
                relay.send(("checked", _integrity_error(engine)))
            elif kind == "snapshot":
                relay.send(("snapshot", engine.policy_snapshot()))
    finally:
        probe.cancel()
        await engine.stop()  # every live request ends with an "abort" delta
    if message is not None:  # the front asked: it waits for the last deltas, then this
        relay.send(("stopped",))
        await writer.drain()
    writer.close()


async def _next_frame(reader: asyncio.StreamReader) -> Any:
    """The front's next frame, or None once it has gone away."""
    try:
        return await read_frame(reader)
    except (asyncio.IncompleteReadError, ConnectionError):
        logger.info("the front went away; stopping the engine")
        return None


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
    """The engine process: ``python -m verifypd.serve.engine_worker FD``."""
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
    run_event_loop(serve_engine(engine, observer, sock))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
