"""The aiohttp application (``build_app``) and the process entry point (``run_server``).

Routes: GET /health, GET /v1/models, POST /v1/completions, POST /v1/chat/completions,
POST /tokenize, POST /detokenize, GET /version, GET /server_info, GET /metrics, GET /dashboard
(+ /dashboard/data, /dashboard/history; GET / redirects there).

Run the app with ``handler_cancellation=True`` (``web.AppRunner``/``TestServer`` keyword):
that is how a client disconnect reaches the handler and aborts its request.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web

from verifypd.serve.cors import CorsConfig, install_cors
from verifypd.serve.dashboard import add_dashboard, refresh_engine_gauges
from verifypd.serve.engine_client import EngineClient
from verifypd.serve.errors import Handler, error_middleware, unauthorized
from verifypd.serve.lifecycle import (
    ShutdownSignals,
    drain,
    run_event_loop,
    run_in_daemon_thread,
)
from verifypd.serve.limits import ServeLimits, body_size_middleware
from verifypd.serve.loop_health import add_loop_health
from verifypd.serve.metrics import PrometheusObserver
from verifypd.serve.openai_api import STATE_KEY, create_chat_completion, create_completion
from verifypd.serve.state import RETRY_AFTER_DRAINING_S, ServerState
from verifypd.serve.tokenize_api import add_tokenize_routes
from verifypd.serve.transport import OpenAIAppRunner
from verifypd.types import Observer

if TYPE_CHECKING:
    from verifypd.config import EngineConfig

logger = logging.getLogger("verifypd.serve")
DEFAULT_MAX_QUEUE = 512
DEFAULT_DRAIN_TIMEOUT_S = 30.0
EngineFactory = Callable[["EngineConfig", Observer], EngineClient]


def build_app(
    engine: EngineClient | None,
    *,
    max_queue: int,
    served_model_name: str | None = None,
    api_key: str | None = None,
    observer: PrometheusObserver | None = None,
    limits: ServeLimits | None = None,
    cors: CorsConfig | None = None,
) -> web.Application:
    """The OpenAI-compatible app around a started ``AsyncEngine``.

    ``engine=None`` builds an app in the "starting" phase (/health 503) that becomes ready on
    ``attach_engine``. Metrics come from ``observer``, else the engine's own
    PrometheusObserver, else a new one that is installed as ``engine.observer``. ``limits``
    bound what one request may send and take (``ServeLimits()`` when None).
    """
    name = served_model_name or (engine.model_name if engine is not None else "verifypd")
    observer = observer or _engine_observer(engine, name)
    limits = limits or ServeLimits()
    state = ServerState(max_queue, observer, served_model_name, api_key, limits)
    middlewares = [error_middleware, body_size_middleware(limits.max_request_bytes)]
    middlewares += [_auth_middleware(api_key)] if api_key else []
    app = web.Application(
        middlewares=middlewares,
        client_max_size=limits.max_request_bytes,
        # A connection must deliver a request's headers within the read timeout (aiohttp arms
        # its keep-alive timer from the connection's start); a refused body is not drained.
        handler_args={"keepalive_timeout": limits.request_read_timeout_s, "lingering_time": 0},
    )
    app[STATE_KEY] = state
    _add_routes(app, state)
    install_cors(app, cors or CorsConfig())
    add_loop_health(app, observer)
    if engine is not None:
        state.attach(engine)
    return app


def attach_engine(app: web.Application, engine: EngineClient) -> None:
    """Make an app built with ``engine=None`` serve ``engine`` (which must be started)."""
    app[STATE_KEY].attach(engine)


def _engine_observer(engine: EngineClient | None, name: str) -> PrometheusObserver:
    existing = engine.observer if engine is not None else None
    if isinstance(existing, PrometheusObserver):
        return existing
    observer = PrometheusObserver(name)
    if engine is not None and (existing is None or type(existing) is Observer):
        engine.observer = observer
    elif engine is not None:
        logger.warning("engine has a custom observer; /metrics will not see engine events")
    return observer


def _add_routes(app: web.Application, state: ServerState) -> None:
    app.router.add_get("/", _to_dashboard)
    app.router.add_get("/health", _health)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/server_info", _server_info)
    app.router.add_post("/v1/completions", create_completion)
    app.router.add_post("/v1/chat/completions", create_chat_completion)
    add_tokenize_routes(app)
    app.router.add_get("/metrics", _metrics_handler(state))
    add_dashboard(app)


def _auth_middleware(api_key: str) -> Any:
    expected = api_key.encode()

    @web.middleware
    async def check_api_key(request: web.Request, handler: Handler) -> web.StreamResponse:
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        is_bearer = scheme.lower() == "bearer"  # HTTP auth schemes are case-insensitive
        is_valid = hmac.compare_digest(given.strip().encode(), expected) and is_bearer
        if (request.path.startswith("/v1/") or request.path == "/server_info") and not is_valid:
            raise unauthorized()
        return await handler(request)

    return check_api_key


async def _to_dashboard(request: web.Request) -> web.StreamResponse:
    raise web.HTTPFound("/dashboard")


async def _health(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    if state.is_ready:
        return web.json_response({"status": "ok"})
    headers = {"Retry-After": str(RETRY_AFTER_DRAINING_S)}
    return web.json_response({"status": state.phase.value}, status=503, headers=headers)


async def _models(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    state.check_accepting()
    card = {
        "id": state.model_name,
        "object": "model",
        "created": state.started_at,
        "owned_by": "verifypd",
        "root": _model_root(state),
        "parent": None,
        "max_model_len": state.engine.max_model_len,
    }
    return web.json_response({"object": "list", "data": [card]})


async def _server_info(request: web.Request) -> web.Response:
    """How this server runs (vLLM's route name; there it is a developer route): the engine's
    every setting, the kind of engine client (``RemoteEngine`` under ``--engine-process``), the
    queue and the request limits. Benchmarks record it beside their results. Behind the API key
    when there is one."""
    state = request.app[STATE_KEY]
    state.check_accepting()
    info = {
        "model": state.model_name,
        "engine_client": type(state.engine).__name__,
        "engine_config": dataclasses.asdict(state.engine.config),
        "max_queue": state.max_queue,
        "limits": dataclasses.asdict(state.limits),
    }
    return web.json_response(info, dumps=lambda obj: json.dumps(obj, default=str))


def _model_root(state: ServerState) -> str:
    """What the model was loaded from (vLLM's ``root``): the --model spec, else its name."""
    return state.engine.config.model or state.engine.model_name


def _metrics_handler(state: ServerState) -> Handler:
    """prometheus_client's aiohttp handler when present, else generate_latest."""
    try:
        from prometheus_client.aiohttp import make_aiohttp_handler

        export = make_aiohttp_handler(state.observer.registry)
    except ImportError:
        export = _plain_metrics(state)

    async def metrics(request: web.Request) -> web.StreamResponse:
        refresh_engine_gauges(state)
        return await export(request)

    return metrics


def _plain_metrics(state: ServerState) -> Handler:
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    async def export(request: web.Request) -> web.Response:
        body = generate_latest(state.observer.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    return export


# -- process entry point -------------------------------------------------------------------


def create_engine(config: EngineConfig, observer: Observer | None = None) -> EngineClient:
    """Construct the real AsyncEngine (slow: loads the model). Imported lazily (torch)."""
    from verifypd.lanes.async_engine import AsyncEngine

    if config.device != "cuda":
        limit_cpu_threads()
    return AsyncEngine(config, observer=observer)


def limit_cpu_threads() -> int:
    """Leave one core to the event loop: torch intra-op threads = min(default, cores - 1).

    On CPU the steps run in a worker thread while the event loop streams tokens; OpenMP
    workers that spin-wait for a core held by the event loop (or by any other process) made
    each step 8-25x slower on a 2-core machine. An explicit OMP_NUM_THREADS wins.
    """
    import torch

    if "OMP_NUM_THREADS" not in os.environ:
        num_cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
        torch.set_num_threads(max(1, min(torch.get_num_threads(), num_cores - 1)))
    return torch.get_num_threads()


def run_server(
    config: EngineConfig,
    host: str = "127.0.0.1",
    port: int = 8000,
    max_queue: int = DEFAULT_MAX_QUEUE,
    *,
    served_model_name: str | None = None,
    api_key: str | None = None,
    drain_timeout: float = DEFAULT_DRAIN_TIMEOUT_S,
    engine_factory: EngineFactory | None = None,
    limits: ServeLimits | None = None,
    cors: CorsConfig | None = None,
) -> int:
    """Serve until SIGTERM/SIGINT, then drain; returns the process exit code.

    Listens at once (/health 503), loads the engine in a thread, then prints exactly one line
    ``verifypd serving <model> at http://HOST:PORT`` (``port=0`` picks a free port and prints
    it). On the first signal it drains (see ``lifecycle.drain``); a second signal aborts.
    """
    server = _serve(
        config, host, port, max_queue, served_model_name, api_key, drain_timeout, engine_factory,
        limits, cors,
    )  # fmt: skip
    return run_event_loop(server)


async def _serve(
    config: EngineConfig,
    host: str,
    port: int,
    max_queue: int,
    served_model_name: str | None,
    api_key: str | None,
    drain_timeout: float,
    engine_factory: EngineFactory | None,
    limits: ServeLimits | None,
    cors: CorsConfig | None,
) -> int:
    observer = PrometheusObserver(served_model_name or _provisional_name(config.model))
    app = build_app(
        None, max_queue=max_queue, served_model_name=served_model_name, api_key=api_key,
        observer=observer, limits=limits, cors=cors,
    )  # fmt: skip
    runner = OpenAIAppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=2.0)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except OSError as exc:
        logger.error("cannot listen on %s:%s: %s", host, port, exc)
        await runner.cleanup()
        return 1
    factory = engine_factory or create_engine
    return await _serve_until_signal(app, runner, host, config, factory, drain_timeout)


async def _serve_until_signal(
    app: web.Application,
    runner: web.AppRunner,
    host: str,
    config: EngineConfig,
    factory: EngineFactory,
    drain_timeout: float,
) -> int:
    state = app[STATE_KEY]
    signals, loop, engine = ShutdownSignals(), asyncio.get_running_loop(), None
    signals.install(loop)
    try:
        logger.info("loading model %s", config.model)
        started = time.monotonic()
        load = run_in_daemon_thread(lambda: factory(config, state.observer))
        engine = await signals.unless_stopped(load)
        if engine is None:
            return 0
        await engine.start()
        attach_engine(app, engine)
        logger.info("ready: %s loaded in %.1f s", state.model_name, time.monotonic() - started)
        print(ready_line(state.model_name, host, runner.addresses[0][1]), flush=True)
        if await _engine_gone_first(signals.stopped, engine):
            logger.error("the engine process exited; stopping the server")
            return 1
        await drain(state, drain_timeout, signals.forced)
        return 0
    except ValueError as exc:  # a model or option the engine rejects: one line, no traceback
        logger.error("cannot start: %s", exc)
        logger.debug("start-up failure", exc_info=True)
        return 1
    except Exception:
        logger.exception("verifypd server failed")
        return 1
    finally:
        await runner.cleanup()
        if engine is not None:
            await engine.stop()
        signals.remove(loop)  # last: a late signal must not kill a clean shutdown


async def _engine_gone_first(stopped: asyncio.Event, engine: EngineClient) -> bool:
    """Wait for a stop signal or, for an engine in its own process (``closed``), for that
    process to end; True when the engine went first."""
    closed = getattr(engine, "closed", None)
    waits = {asyncio.ensure_future(stopped.wait())}
    if closed is not None:
        waits.add(asyncio.ensure_future(closed.wait()))
    _, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for task in pending:
        task.cancel()
    return not stopped.is_set()


def ready_line(model: str, host: str, port: int) -> str:
    shown = f"[{host}]" if ":" in host else host
    return f"verifypd serving {model} at http://{shown}:{port}"


def _provisional_name(model: str) -> str:
    """A label for metrics while the model loads (rebound to the engine's name once ready)."""
    return os.path.basename(model.rstrip("/")) or model
