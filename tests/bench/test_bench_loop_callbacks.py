"""bench/loop_callbacks.py: asyncio's debug mode names every callback that holds the event loop
past a threshold; ``SlowCallbacks`` keeps those records (not printed) for the loops made after
``install``, and puts everything back on ``uninstall``. bench/host_diag.py's
``--slow-callbacks MS`` runs a sweep with it."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
from helpers import load_bench
from sweep_helpers import SWEEP_TINY

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


async def _holds_the_loop() -> None:
    await asyncio.sleep(0)
    time.sleep(0.03)  # one step of this task: 30 ms with the loop held


async def _quick() -> None:
    await asyncio.sleep(0.001)


async def _both() -> None:
    await asyncio.gather(_holds_the_loop(), _quick())


def test_slow_callbacks_are_named_and_kept(capsys) -> None:
    lc = load_bench("loop_callbacks")
    before = (asyncio.new_event_loop, logging.getLogger("asyncio").propagate)
    slow = lc.SlowCallbacks(0.015)
    slow.install()
    try:
        loop = asyncio.new_event_loop()
        assert loop.get_debug() and loop.slow_callback_duration == 0.015
        try:
            loop.run_until_complete(_both())
        finally:
            loop.close()
    finally:
        slow.uninstall()
    assert (asyncio.new_event_loop, logging.getLogger("asyncio").propagate) == before
    names = [name for _, _, name in slow.calls]
    assert "_holds_the_loop" in names and "_quick" not in names, names
    summary = slow.summary()
    held = summary["by_callback"]["_holds_the_loop"]
    assert held["count"] == 1 and 30 <= held["max_ms"] < 300
    assert any(c["name"] == "_holds_the_loop" and c["ms"] >= 30 for c in summary["slowest"])
    assert "Executing" not in capsys.readouterr().err  # kept, not printed
    fresh = asyncio.new_event_loop()  # made after uninstall: asyncio's own threshold
    try:
        assert fresh.slow_callback_duration == 0.1
    finally:
        fresh.close()


def test_callback_names() -> None:
    lc = load_bench("loop_callbacks")
    task = ("<Task pending name='Task-7' coro=<LaneDispatcher._launch_marked() running at "
            "/x/dispatcher.py:310> cb=[set.discard()]>")  # fmt: skip
    assert lc.callback_name(task) == "LaneDispatcher._launch_marked"
    assert lc.callback_name("<Handle _SelectorSocketTransport._read_ready()>") == (
        "_SelectorSocketTransport._read_ready"
    )
    assert lc.callback_name("<TimerHandle when=5.0 sleep.<locals>.f() at x.py:1>") == (
        "sleep.<locals>.f"
    )
    assert lc.callback_name("something else") == "something else"


def test_host_diag_slow_callbacks_option(tmp_path) -> None:
    """``--slow-callbacks MS`` is host_diag's own (not passed to bench/mixed.py) and adds the
    named callbacks of the sweep's engine loop to the summary."""
    diag = load_bench("host_diag")
    assert diag._own_options(["--rates", "2", "--slow-callbacks", "2.5", "--cprofile"]) == (
        True, 2.5, ["--rates", "2"])  # fmt: skip
    with pytest.raises(SystemExit):
        diag._own_options(["--slow-callbacks", "0"])
    args = [*SWEEP_TINY, "--modes", "off", "--rates", "20", "--profiles", "hetero"]
    out = diag.main([*args, "--out", str(tmp_path), "--tag", "s", "--slow-callbacks", "0.2"])
    calls = out["slow_callbacks"]
    assert calls["threshold_ms"] == pytest.approx(0.2)
    assert calls["by_callback"] and all(v["count"] > 0 for v in calls["by_callback"].values())
    assert "--slow-callbacks" not in out["command"]
