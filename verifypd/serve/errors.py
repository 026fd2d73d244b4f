"""OpenAI-style error bodies: ``{"error": {"message", "type", "param", "code"}}``.

Handlers raise :class:`APIError`; :func:`error_middleware` turns it (and unknown routes and
unexpected exceptions) into a JSON response with the right status and headers.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from aiohttp import web

logger = logging.getLogger("verifypd.serve")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class APIError(Exception):
    """An error that maps one to one onto an HTTP error response."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        retry_after: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.retry_after = retry_after

    def body(self) -> dict:
        """The JSON body, also used as an SSE error event mid-stream."""
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> web.Response:
        headers = {} if self.retry_after is None else {"Retry-After": str(self.retry_after)}
        return web.json_response(self.body(), status=self.status, headers=headers)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def invalid_request(message: str, param: str | None = None) -> APIError:
    """400: the request is malformed or a field has a wrong type or value."""
    return APIError(400, message, param=param)


def model_not_found(name: str, served: str) -> APIError:
    message = f"The model '{name}' does not exist; this server serves '{served}'."
    return APIError(404, message, type="not_found_error", param="model", code="model_not_found")


def overloaded(max_queue: int, retry_after: int = 1) -> APIError:
    """429: the admission bound is reached."""
    message = f"Server is at capacity ({max_queue} requests in flight); retry later."
    return APIError(429, message, type="rate_limit_error", retry_after=retry_after)


def unavailable(reason: str, retry_after: int = 5) -> APIError:
    """503: the server is starting or draining."""
    return APIError(
        503, f"Server is {reason}; retry later.", type="server_error", retry_after=retry_after
    )


def unauthorized() -> APIError:
    message = "Missing or invalid API key (send 'Authorization: Bearer <key>')."
    return APIError(401, message, type="authentication_error", code="invalid_api_key")


def server_error(message: str) -> APIError:
    return APIError(500, message, type="server_error")


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Render APIError, unknown routes and unexpected exceptions as OpenAI error bodies."""
    try:
        return await handler(request)
    except APIError as err:
        return err.response()
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        err = APIError(exc.status, exc.reason, type=_http_error_type(exc.status))
        return err.response()
    except Exception:
        logger.exception("unhandled error on %s %s", request.method, request.path)
        return server_error("Internal server error.").response()


def _http_error_type(status: int) -> str:
    return "not_found_error" if status == 404 else "invalid_request_error"
