"""Take docs/dashboard.png: serve a FakeEngine under synthetic traffic, screenshot /dashboard.

    python tests/serve/dashboard_screenshot.py [--warmup 40] [--out docs/dashboard.png]

Needs a ``chromium`` binary (Debian: ``apt-get install -y chromium``). Loopback only.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
from aiohttp import web

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(1, str(Path(__file__).parents[2]))

from fake_engine import FakeEngine  # noqa: E402

from verifypd.serve.app import build_app  # noqa: E402
from verifypd.serve.metrics import PrometheusObserver  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--hide-scrollbars", "--virtual-time-budget=5000", "--window-size=1400,1000",
]  # fmt: skip


async def client_loop(session: aiohttp.ClientSession, rng: random.Random, start: float) -> None:
    """One simulated user: a mix of chat/completions, streams and early disconnects."""
    while True:
        phase = math.sin((time.monotonic() - start) / 6.0)  # load swells and ebbs
        await asyncio.sleep(rng.uniform(0.05, 0.4) * (1.5 - phase))
        payload = {"max_tokens": rng.randint(16, 96), "stream": rng.random() < 0.7}
        if rng.random() < 0.5:
            path, payload["messages"] = "/v1/chat/completions", [{"role": "user", "content": "hi"}]
        else:
            path, payload["prompt"] = "/v1/completions", "x" * rng.randint(4, 200)
        with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
            timeout = aiohttp.ClientTimeout(total=rng.uniform(0.3, 3) if rng.random() < 0.1 else 30)
            async with session.post(path, json=payload, timeout=timeout) as resp:
                await resp.read()


async def main(warmup: float, out: Path, port: int) -> int:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        print("chromium not found (apt-get install -y chromium)", file=sys.stderr)
        return 1
    observer = PrometheusObserver("SmolLM2-135M-Instruct")
    engine = FakeEngine(
        "SmolLM2-135M-Instruct", max_model_len=2048, num_blocks=400, max_num_seqs=12,
        step_s=0.012, prefill_steps=3, observer=observer,
    )  # fmt: skip
    await engine.start()
    app = build_app(engine, max_queue=64, observer=observer)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    url = f"http://127.0.0.1:{port}"
    async with aiohttp.ClientSession(url) as session:
        start, rng = time.monotonic(), random.Random(1)
        users = [asyncio.create_task(client_loop(session, rng, start)) for _ in range(24)]
        print(f"warming up for {warmup:.0f}s at {url}/dashboard", file=sys.stderr)
        await asyncio.sleep(warmup)
        rc = await screenshot(chromium, f"{url}/dashboard", out)
        for user in users:
            user.cancel()
        await asyncio.gather(*users, return_exceptions=True)
    await runner.cleanup()
    await engine.stop()
    return rc


async def screenshot(chromium: str, url: str, out: Path) -> int:
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as profile:
        flags = [*CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--screenshot={out}"]
        proc = await asyncio.create_subprocess_exec(
            chromium, *flags, url, stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
        rc = await asyncio.wait_for(proc.wait(), 120)
    print(f"chromium exited {rc}; wrote {out}", file=sys.stderr)
    return rc


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--warmup", type=float, default=40.0)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "dashboard.png")
    parser.add_argument("--port", type=int, default=8765)
    args = parser.parse_args()
    sys.exit(asyncio.run(main(args.warmup, args.out, args.port)))
