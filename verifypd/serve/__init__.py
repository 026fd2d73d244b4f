"""aiohttp OpenAI-compatible server: SSE streaming, Prometheus metrics, live dashboard page.

Public API (imported lazily, so that ``import verifypd.serve.metrics`` stays light):
``build_app``, ``attach_engine``, ``run_server`` (serve.app), ``serve_main``, ``add_serve_args``
(serve.cli), ``ServeLimits`` (serve.limits), ``OpenAIAppRunner`` (serve.transport) and
``PrometheusObserver`` (serve.metrics).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "build_app": "verifypd.serve.app",
    "attach_engine": "verifypd.serve.app",
    "run_server": "verifypd.serve.app",
    "serve_main": "verifypd.serve.cli",
    "add_serve_args": "verifypd.serve.cli",
    "ServeLimits": "verifypd.serve.limits",
    "OpenAIAppRunner": "verifypd.serve.transport",
    "PrometheusObserver": "verifypd.serve.metrics",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'verifypd.serve' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
