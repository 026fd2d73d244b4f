"""lanes.gc_pacer (EngineConfig.gc_serving): the collector runs at the step loop's waits, not
wherever allocations cross a threshold; its due collections follow CPython's generations; a
loop that never waits still collects; the process gets its collector back when the engine
stops; and an engine serving with it loses nothing."""

from __future__ import annotations

import asyncio
import gc
from dataclasses import replace

import pytest
from helpers import generate_all, tiny_config

from verifypd.lanes.async_engine import AsyncEngine
from verifypd.lanes.gc_pacer import OVERDUE, GcPacer
from verifypd.types import SamplingParams


@pytest.fixture
def collector():
    """Small thresholds, restored afterwards with the collector's state."""
    threshold, enabled = gc.get_threshold(), gc.isenabled()
    gc.collect()
    gc.set_threshold(50, 3, 2)
    yield
    gc.set_threshold(*threshold)
    (gc.enable if enabled else gc.disable)()


class _Node:
    """A collector-tracked object with no free list (a list may come from CPython's free list
    without counting as an allocation)."""

    def __init__(self) -> None:
        self.ref = self


def _garbage(n: int) -> None:
    """``n`` reference cycles: only the collector frees them."""
    for _ in range(n):
        _Node()


def test_idle_collects_at_the_waits_only(collector) -> None:
    pacer = GcPacer("idle")
    pacer.start()
    assert not gc.isenabled() and pacer.paced
    _garbage(200)
    assert gc.get_count()[0] >= 200  # nothing collected meanwhile
    pacer.waiting(after_progress=False, in_flight=True)  # no step queued behind: not now
    assert pacer.collections == [0, 0, 0]
    pacer.waiting(after_progress=True, in_flight=True)
    assert pacer.collections == [1, 0, 0] and gc.get_count()[0] < 50
    for _ in range(3):  # generation 1 is due after three young collections (threshold 3)
        _garbage(60)
        pacer.waiting(after_progress=True, in_flight=True)
    assert pacer.collections == [3, 1, 0]
    pacer.stop()
    assert gc.isenabled() and not pacer.paced


def test_the_full_collection_waits_for_an_idle_gpu(collector) -> None:
    pacer = GcPacer("idle")
    pacer.start()
    for _ in range(12):  # young and generation-1 collections until generation 2 is due
        _garbage(60)
        pacer.waiting(after_progress=True, in_flight=True)
    assert pacer.collections[2] == 0 and gc.get_count()[2] >= 2
    _garbage(60)
    pacer.waiting(after_progress=False, in_flight=False)  # nothing in flight
    assert pacer.collections[2] == 1
    pacer.stop()


def test_an_overdue_full_collection_runs_under_load(collector) -> None:
    pacer = GcPacer("idle")
    pacer.start()
    for _ in range(4 * 2 * OVERDUE + 4):  # never idle: generation 2 goes overdue
        _garbage(60)
        pacer.waiting(after_progress=True, in_flight=True)
    assert pacer.collections[2] >= 1
    pacer.stop()


def test_a_loop_that_never_waits_collects_once_overdue(collector) -> None:
    pacer = GcPacer("idle")
    pacer.start()
    _garbage(60)
    pacer.busy()
    assert pacer.collections == [0, 0, 0]
    _garbage(50 * OVERDUE)
    pacer.busy()
    assert pacer.collections[0] == 1
    pacer.stop()


@pytest.mark.parametrize("mode", ["auto", "off"])
def test_auto_and_off_never_collect_themselves(collector, mode) -> None:
    pacer = GcPacer(mode)
    pacer.start()
    assert gc.isenabled() is (mode == "auto")
    _garbage(500)
    pacer.waiting(after_progress=True, in_flight=False)
    pacer.busy()
    assert pacer.collections == [0, 0, 0]
    pacer.stop()
    assert gc.isenabled()


def test_a_collector_off_before_start_stays_off(collector) -> None:
    gc.disable()
    pacer = GcPacer("idle")
    pacer.start()
    pacer.stop()
    assert not gc.isenabled()


def test_unknown_modes_are_refused() -> None:
    with pytest.raises(ValueError, match="gc_serving"):
        GcPacer("sometimes")
    with pytest.raises(ValueError, match="gc_serving"):
        replace(tiny_config(), gc_serving="sometimes")


async def _watch_collector(seen: set) -> None:
    while True:
        seen.add(gc.isenabled())
        await asyncio.sleep(0)


async def test_an_engine_serving_with_the_paced_collector(collector) -> None:
    """Same tokens as with CPython's collector; the collector off while the loop runs and
    collections made at its waits; the collector back on once the engine stops."""
    gc.set_threshold(4, 3, 2)  # a tiny CPU engine makes little garbage; its steps land at once,
    # so its loop never waits on a step in flight: only the overdue collections run
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = [[1, 2, 3, 4, 5] * 3, [7] * 30, list(range(10, 40))]
    outputs, enabled_while_serving = {}, {}
    for mode in ("auto", "idle"):
        engine = AsyncEngine(replace(tiny_config(), gc_serving=mode))
        seen = set()

        watcher = asyncio.create_task(_watch_collector(seen))
        outputs[mode] = await generate_all(engine, prompts, params, timeout=60)  # stops it
        watcher.cancel()
        enabled_while_serving[mode] = seen
        assert gc.isenabled()
        assert (sum(engine.gc.collections) > 0) is (mode == "idle")
    assert outputs["idle"] == outputs["auto"]
    assert enabled_while_serving["auto"] == {True} and False in enabled_while_serving["idle"]
