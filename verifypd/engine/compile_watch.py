"""Triton kernels compiled after start-up, seen as they happen.

Start-up compiles every kernel variant a step can take (``cuda_graphs.warm_up_eager`` and the
graph captures); one that Triton still compiles under traffic stalls every lane for 0.5-2 s,
a TTFT and ITL spike that a benchmark would show as noise. Triton calls
``knobs.runtime.jit_cache_hook`` before each compile (never on a cache hit), so watching costs
the hot path nothing. The hook is process-wide: each watcher subscribes a list the hook
appends the kernel's name to (safe from any thread), the engine reports them from its loop
(``CompileReporter.report``: a warning and the observer's ``kernel_compiled``,
``verifypd_kernel_compiles_total``), and a hook set before the first subscriber is still
called after ours.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from verifypd.types import Observer

logger = logging.getLogger("verifypd")

_sinks: list[list[str]] = []
_previous: list[Callable[..., Any] | None] = [None]  # the hook ours replaced


def _runtime() -> Any:
    """Triton's runtime knobs where they have the compile hook (Triton 3.4 and later)."""
    try:
        import triton
    except ImportError:
        return None
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    return runtime if runtime is not None and hasattr(runtime, "jit_cache_hook") else None


def _hook(*, repr: str, **kwargs: Any) -> Any:  # noqa: A002 (Triton's keyword)
    name = repr.split("[", 1)[0]
    for sink in list(_sinks):
        sink.append(name)
    previous = _previous[0]
    return previous(repr=repr, **kwargs) if previous is not None else False  # False: compile


def subscribe(sink: list[str]) -> Callable[[], None]:
    """Appends the name of every kernel Triton compiles from now on to ``sink``; returns the
    unsubscribe. A no-op on a Triton without the hook."""
    runtime = _runtime()
    if runtime is None:
        return lambda: None
    if not _sinks:
        _previous[0] = runtime.jit_cache_hook
        runtime.jit_cache_hook = _hook
    _sinks.append(sink)

    def unsubscribe() -> None:
        _sinks[:] = [s for s in _sinks if s is not sink]
        if not _sinks:  # the hook before ours goes back, unless another replaced ours since
            if runtime.jit_cache_hook is _hook:
                runtime.jit_cache_hook = _previous[0]
            _previous[0] = None

    return unsubscribe


class CompileReporter:
    """An engine's watch, from the end of its start-up (on a GPU; elsewhere nothing compiles:
    the CPU runs Triton's interpreter or torch)."""

    def __init__(self, watch: bool) -> None:
        self.names: list[str] = []
        self.total = 0  # compiles reported so far (benchmarks take differences)
        self._unsubscribe = subscribe(self.names) if watch else (lambda: None)

    @property
    def seen(self) -> int:
        """Compiles so far, reported or not yet."""
        return self.total + len(self.names)

    def report(self, observer: Observer) -> None:
        """Each compile since the last call: a warning naming the kernel, and ``observer``."""
        if not self.names:
            return
        names = self.names[:]
        del self.names[: len(names)]
        self.total += len(names)
        for name in names:
            logger.warning(
                "Triton compiled %s after start-up: every lane stalled while it did; a "
                "batch shape the warm-up missed (please report it)",
                name,
            )
            observer.kernel_compiled(name)

    def close(self) -> None:
        self._unsubscribe()
