"""The server's event-loop health metrics (serve.loop_health): the lag probe sees a blocked
loop, the GC timer sees collections, and both reach /metrics."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time

from server_utils import Harness, bounded, wait_until
from test_serve_vllm_metrics import samples_of

from verifypd.serve.loop_health import GcTimer, probe_lag


def test_gc_timer_reports_each_collection_until_removed() -> None:
    seen: list[tuple[int, float]] = []
    timer = GcTimer(lambda gen, s: seen.append((gen, s)))
    timer.install()
    try:
        gc.collect()
    finally:
        timer.remove()
    assert (2, seen[-1][1]) == seen[-1] and seen[-1][1] >= 0.0
    count = len(seen)
    gc.collect()
    assert len(seen) == count  # removed: no more reports
    timer.remove()  # twice is harmless


@bounded(10)
async def test_lag_probe_sees_a_blocked_loop() -> None:
    lags: list[float] = []
    task = asyncio.create_task(probe_lag(lags.append, interval_s=0.005))
    try:
        await wait_until(lambda: len(lags) >= 3)
        time.sleep(0.06)  # the loop cannot run the probe for 60 ms
        await wait_until(lambda: max(lags) >= 0.04)
        assert min(lags) < 0.04  # before the block it woke on time
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@bounded(10)
async def test_loop_health_reaches_metrics(harness: Harness) -> None:
    model = ("model", "fake-model")
    lag_count = ("verifypd_event_loop_lag_seconds_count", (model,))
    gc2 = ("verifypd_gc_pause_seconds_count", (("generation", "2"), model))

    async def samples() -> dict:
        return samples_of(await (await harness.client.get("/metrics")).text())

    before = await samples()
    gc.collect()
    await asyncio.sleep(0.05)
    after = await samples()
    assert after[lag_count] > before[lag_count]
    assert after[gc2] >= before[gc2] + 1
