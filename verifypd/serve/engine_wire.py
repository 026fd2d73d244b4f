"""The wire between ``verifypd serve --engine-process``'s front (``serve.engine_process``) and
its engine process (``serve.engine_worker``): length-prefixed pickle frames over a socketpair.
Both ends are this package, and the socket never leaves the machine (never a network socket).

- front to engine: ``("config", EngineConfig, log_level)`` once, then ``("add", id, prompt,
  params)``, ``("abort", id)``, ``("check",)`` and ``("stop",)``;
- engine to front: ``("ready", info)`` or ``("failed", is_value_error, text)`` once, then one
  ``("step", outputs, refused, calls, stats, sent_at)`` frame per turn of the engine's loop
  that had something to say (every delta, every admission refused with its ``ParamError``,
  every ``Observer`` call, the running/waiting/KV figures, and the ``time.monotonic()`` it was
  sent at), ``("checked", error)`` and ``("stopped",)``.
"""

from __future__ import annotations

import asyncio
import pickle
import socket
import struct
from typing import Any

HEADER = struct.Struct("!I")


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
