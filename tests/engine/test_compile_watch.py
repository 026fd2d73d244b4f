"""Triton compiles after start-up are seen (``engine.compile_watch``): the process-wide hook
chains the one before it and hands every kernel's name to each subscriber; the engine reports
them from its loop as a warning and ``Observer.kernel_compiled``. Triton's own calls are
stood in for here (the CPU interprets kernels and never compiles); the GPU test
tests/engine/test_no_midrun_compile.py replaces the hook itself."""

from __future__ import annotations

import asyncio
import logging

import pytest
from helpers import collect, tiny_config

from verifypd.engine import compile_watch
from verifypd.engine.compile_watch import CompileReporter, subscribe
from verifypd.lanes.async_engine import AsyncEngine
from verifypd.types import Observer, SamplingParams

runtime = compile_watch._runtime()
pytestmark = pytest.mark.skipif(runtime is None, reason="this Triton has no jit_cache_hook")


def triton_compiles(kernel: str):
    """What Triton does before compiling a kernel: the hook's answer (True would skip it)."""
    hook = runtime.jit_cache_hook
    assert hook is not None
    return hook(key=("k",), repr=f"{kernel}[num_warps=4](x_ptr: *fp32)", fn=None,
                compile={}, is_manual_warmup=False, already_compiled=False)  # fmt: skip


@pytest.fixture(autouse=True)
def _restore_hook():
    before = runtime.jit_cache_hook
    yield
    runtime.jit_cache_hook = before
    compile_watch._sinks.clear()
    compile_watch._previous[0] = None


class Compiles(Observer):
    def __init__(self) -> None:
        self.names: list[str] = []

    def kernel_compiled(self, name: str) -> None:
        self.names.append(name)


def test_subscribers_get_each_kernel_and_the_hook_before_is_kept():
    seen: list[str] = []
    runtime.jit_cache_hook = lambda **kw: seen.append(kw["repr"]) or False
    previous = runtime.jit_cache_hook
    a, b = [], []
    drop_a, drop_b = subscribe(a), subscribe(b)
    assert triton_compiles("_decode_kernel") is False  # compile as usual
    assert a == b == ["_decode_kernel"] and len(seen) == 1
    drop_a()
    triton_compiles("_prefill_kernel")
    assert a == ["_decode_kernel"] and b == ["_decode_kernel", "_prefill_kernel"]
    drop_b()
    assert runtime.jit_cache_hook is previous  # the last one out puts it back
    runtime.jit_cache_hook = lambda **kw: True  # a hook that skips compiling is obeyed
    drop = subscribe(a)
    assert triton_compiles("_k") is True and a[-1] == "_k"
    drop()


def test_a_hook_set_over_ours_stays_when_we_leave():
    drop = subscribe([])
    theirs = lambda **kw: False  # noqa: E731
    runtime.jit_cache_hook = theirs
    drop()
    assert runtime.jit_cache_hook is theirs


def test_the_reporter_warns_counts_and_tells_the_observer(caplog):
    observer = Compiles()
    reporter = CompileReporter(watch=True)
    reporter.report(observer)  # nothing yet
    assert observer.names == [] and reporter.total == 0
    triton_compiles("_noise_race_chunk_kernel")
    triton_compiles("_prefill_attention_kernel")
    with caplog.at_level(logging.WARNING, logger="verifypd"):
        reporter.report(observer)
    assert observer.names == ["_noise_race_chunk_kernel", "_prefill_attention_kernel"]
    assert reporter.total == 2 and reporter.names == []
    assert "Triton compiled _prefill_attention_kernel after start-up" in caplog.text
    before = compile_watch._previous[0]
    reporter.close()  # no longer watching: the hook before it is back
    assert runtime.jit_cache_hook is before and compile_watch._sinks == []


def test_an_engine_reports_compiles_from_its_loop_and_lets_go_when_stopped():
    async def run() -> None:
        observer = Compiles()
        engine = AsyncEngine(tiny_config(), observer=observer)
        # The CPU interprets kernels: the engine does not watch there (nothing compiles) ...
        assert compile_watch._sinks == []
        # ... but whatever its list holds is reported with the next landed step.
        engine.core.compiles.names.append("_some_kernel")
        params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        try:
            assert len(await collect(engine, "r", [1, 2, 3], params)) == 3
            assert observer.names == ["_some_kernel"] and engine.core.compiles.total == 1
        finally:
            await engine.stop()

    asyncio.run(run())


def test_a_watching_reporter_is_closed_by_the_engine_stop():
    async def run() -> None:
        engine = AsyncEngine(tiny_config())
        engine.core.compiles.close()  # as built on a GPU: watching
        engine.core.compiles = CompileReporter(watch=True)
        assert len(compile_watch._sinks) == 1
        await engine.stop()
        assert compile_watch._sinks == []

    asyncio.run(run())
