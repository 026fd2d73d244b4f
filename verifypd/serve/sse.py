"""Server-sent events: ``data: {json}\\n\\n`` events ending with ``data: [DONE]``."""

from __future__ import annotations

import json

from aiohttp import web

SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # tell reverse proxies not to buffer the stream
}
DONE = b"data: [DONE]\n\n"


def encode_event(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


class SSEStream:
    """One streaming response. Writes raise ConnectionResetError once the client is gone."""

    def __init__(self, request: web.Request) -> None:
        self._request = request
        self.response = web.StreamResponse(status=200, headers=SSE_HEADERS)

    async def open(self) -> None:
        await self.response.prepare(self._request)

    async def send(self, payload: dict) -> None:
        await self.response.write(encode_event(payload))

    async def finish(self) -> None:
        """Write the ``[DONE]`` sentinel and end the body."""
        await self.response.write(DONE)
        await self.response.write_eof()
