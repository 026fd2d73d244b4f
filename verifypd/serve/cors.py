"""CORS for browser clients: ``--allowed-origins`` (and ``--allowed-methods/-headers``).

Off by default (no CORS headers at all). When on, a preflight (``OPTIONS`` with
``Access-Control-Request-Method``) from an allowed origin is answered 204 before routing and
authentication (browsers send no credentials on a preflight), and every response to an allowed
origin, streams and errors included, carries ``Access-Control-Allow-Origin``: the headers are
added in ``on_response_prepare``, before an SSE stream sends its first byte.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from aiohttp import web

from verifypd.serve.errors import APIError, Handler

WILDCARD = "*"
PREFLIGHT_MAX_AGE_S = 600


@dataclass(frozen=True)
class CorsConfig:
    allowed_origins: tuple[str, ...] = ()  # empty: CORS off
    allowed_methods: tuple[str, ...] = (WILDCARD,)
    allowed_headers: tuple[str, ...] = (WILDCARD,)

    @property
    def enabled(self) -> bool:
        return bool(self.allowed_origins)

    def allow_origin(self, origin: str) -> str | None:
        """The Access-Control-Allow-Origin value for ``origin``, or None when not allowed."""
        if WILDCARD in self.allowed_origins:
            return WILDCARD
        return origin if origin in self.allowed_origins else None


def parse_list(value: str) -> tuple[str, ...]:
    """A flag value as a list: vLLM's JSON form ``'["a", "b"]'`` or ``a,b``."""
    value = value.strip()
    if value.startswith("["):
        items = json.loads(value)
        if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
            raise ValueError(f"expected a JSON list of strings, got {value!r}")
    else:
        items = value.split(",")
    return tuple(item.strip() for item in items if item.strip())


def install_cors(app: web.Application, cors: CorsConfig) -> None:
    """Add the preflight middleware (outermost) and the response-header hook."""
    if not cors.enabled:
        return
    app.middlewares.insert(0, _preflight_middleware(cors))

    async def add_headers(request: web.Request, response: web.StreamResponse) -> None:
        allowed = cors.allow_origin(request.headers.get("Origin", ""))
        if allowed is not None and "Access-Control-Allow-Origin" not in response.headers:
            response.headers["Access-Control-Allow-Origin"] = allowed
            if allowed != WILDCARD:
                response.headers["Vary"] = "Origin"

    app.on_response_prepare.append(add_headers)


def _preflight_middleware(cors: CorsConfig) -> Handler:
    @web.middleware
    async def preflight(request: web.Request, handler: Handler) -> web.StreamResponse:
        method = request.headers.get("Access-Control-Request-Method")
        if request.method != "OPTIONS" or method is None:
            return await handler(request)
        if cors.allow_origin(request.headers.get("Origin", "")) is None:
            return APIError(403, "CORS: origin not allowed", type="permission_error").response()
        return web.Response(status=204, headers=_preflight_headers(cors, request, method))

    return preflight


def _preflight_headers(cors: CorsConfig, request: web.Request, method: str) -> dict[str, str]:
    methods = method if WILDCARD in cors.allowed_methods else ", ".join(cors.allowed_methods)
    asked = request.headers.get("Access-Control-Request-Headers", "")
    headers = asked if WILDCARD in cors.allowed_headers else ", ".join(cors.allowed_headers)
    answer = {
        "Access-Control-Allow-Methods": methods,
        "Access-Control-Max-Age": str(PREFLIGHT_MAX_AGE_S),
    }
    if headers:
        answer["Access-Control-Allow-Headers"] = headers
    return answer
