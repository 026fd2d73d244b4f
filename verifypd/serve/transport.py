"""Below the app: HTTP connections whose own errors use the OpenAI error shape.

aiohttp answers requests it cannot parse (a bad request line, a malformed header, a header
that is too long) from the connection handler, before any middleware runs, with a plain-text
body. ``OpenAIAppRunner`` serves the app with a connection handler that sends those errors as
``{"error": {...}}`` JSON too, so that every 4xx and 5xx the server sends has one shape.
"""

from __future__ import annotations

from http import HTTPStatus

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from verifypd.serve.errors import error_body


class OpenAIRequestHandler(RequestHandler):
    """aiohttp's connection handler; its protocol errors are OpenAI error bodies."""

    __slots__ = ()

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        super().handle_error(request, status, exc, message)  # logs; raises if output started
        kind = "server_error" if status >= 500 else "invalid_request_error"
        text = _phrase(status)
        if status < 500 and exc is not None:  # what was wrong with the request, never a trace
            text = f"{text}: {exc}"
        response = web.json_response(error_body(text, kind), status=status)
        response.force_close()
        return response


class OpenAIServer(web.Server):
    """``web.Server`` whose connections are ``OpenAIRequestHandler``s."""

    def __call__(self) -> RequestHandler:
        return OpenAIRequestHandler(self, loop=self._loop, **self._kwargs)


class OpenAIAppRunner(web.AppRunner):
    """``web.AppRunner`` serving through ``OpenAIServer`` (same arguments)."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = OpenAIServer  # the app builds a plain Server; only __call__ differs
        return server


def _phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return f"HTTP error {status}"
