"""``verifypd serve --log-request-timing``: one log line per generation request, saying where
its first token spent its time.

The line (logger ``verifypd.serve.timing``, level INFO) is ``request timing {json}`` with the
server's id, the client's ``X-Request-Id`` header if it sent one, the token counts and finish
reasons, ``received`` (the ``time.monotonic()`` at which the front began reading the request:
one clock for every process on the host, so a client on the same machine can line its own
times up against it), and, in ms after ``received``:

- ``arrival_ms``: handed to the engine (its queue rules count the wait from here);
- ``engine_first_ms``: the engine process sent the first delta (``--engine-process`` only);
- ``first_out_ms``: the front got the first delta;
- ``first_sent_ms``: the first content chunk, made, went to the socket (streams only);
- ``done_ms``: the response ended.

Requests with several prompts are not timed. The logger is off (WARNING) unless the flag, or
an embedding application, sets it to INFO.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from verifypd.types import RequestTiming

timing_log = logging.getLogger("verifypd.serve.timing")
if timing_log.level == logging.NOTSET:
    timing_log.setLevel(logging.WARNING)
CLIENT_ID_HEADER = "X-Request-Id"
MAX_CLIENT_ID_CHARS = 128  # a longer header is cut: a log line stays one short line


def start_timing(received: float | None, num_prompts: int) -> RequestTiming | None:
    """A ``RequestTiming`` to pass to the engine, or None when timing is off. ``received``:
    when the handler began (None: now)."""
    if num_prompts != 1 or not timing_log.isEnabledFor(logging.INFO):
        return None
    return RequestTiming(received=time.monotonic() if received is None else received)


def log_timing(request: Any, request_id: str, timing: RequestTiming, collected: Any) -> None:
    """The request's line; ``collected`` is its ``protocol.OutputCollector``."""
    timing.done = time.monotonic()
    client_id = request.headers.get(CLIENT_ID_HEADER)
    received = timing.received or timing.done
    record: dict[str, Any] = {
        "id": request_id,
        "client_id": client_id[:MAX_CLIENT_ID_CHARS] if client_id else None,
        "prompt_tokens": collected.num_prompt_tokens,
        "output_tokens": sum(collected.num_output_tokens),
        "finish": collected.finish_reasons,
        "received": round(received, 6),
    }
    for name in ("arrival", "engine_first", "first_out", "first_sent", "done"):
        stamp = getattr(timing, name)
        record[f"{name}_ms"] = None if stamp is None else round((stamp - received) * 1e3, 3)
    timing_log.info("request timing %s", json.dumps(record))
