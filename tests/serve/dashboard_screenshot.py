"""Take docs/dashboard.png: serve an engine under live traffic, screenshot /dashboard.

    python tests/serve/dashboard_screenshot.py [--model default] [--spec ngram] [--warmup 60]
    python tests/serve/dashboard_screenshot.py --model fake   # the FakeEngine, no torch

By default the REAL engine serves the embedded SmolLM2-135M on CPU with n-gram speculation.
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

from verifypd.config import EngineConfig, SchedulerConfig, SpecConfig  # noqa: E402
from verifypd.serve.app import build_app, create_engine  # noqa: E402
from verifypd.serve.metrics import PrometheusObserver  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--hide-scrollbars", "--virtual-time-budget=5000", "--window-size=1400,1000",
]  # fmt: skip


QUESTIONS = [
    "What is the capital of France?", "Write a haiku about the sea.",
    "List the numbers from 1 to 30, separated by commas.", "Explain photosynthesis briefly.",
    "Repeat after me three times: the quick brown fox jumps over the lazy dog.",
    "Give me three tips for learning to cook.", "What is 17 times 3?",
]  # fmt: skip
PROMPTS = ["def fibonacci(n):", "Once upon a time, in a small village,", "1, 2, 3, 4, 5,",
           "The three most important inventions are"]  # fmt: skip


async def client_loop(
    session: aiohttp.ClientSession, rng: random.Random, start: float, max_tokens: int
) -> None:
    """One simulated user: a mix of chat/completions, streams and early disconnects."""
    while True:
        phase = math.sin((time.monotonic() - start) / 6.0)  # load swells and ebbs
        await asyncio.sleep(rng.uniform(0.05, 0.4) * (1.5 - phase))
        payload = {
            "max_tokens": rng.randint(max_tokens // 4, max_tokens),
            "stream": rng.random() < 0.7,
            "temperature": rng.choice([0, 0, 0.7]),
        }
        if rng.random() < 0.5:
            path = "/v1/chat/completions"
            payload["messages"] = [{"role": "user", "content": rng.choice(QUESTIONS)}]
        else:
            path, payload["prompt"] = "/v1/completions", rng.choice(PROMPTS)
        with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
            timeout = aiohttp.ClientTimeout(total=rng.uniform(0.3, 3) if rng.random() < 0.1 else 30)
            async with session.post(path, json=payload, timeout=timeout) as resp:
                await resp.read()


def make_engine(args: argparse.Namespace, observer: PrometheusObserver) -> object:
    if args.model == "fake":
        return FakeEngine(
            "SmolLM2-135M-Instruct", max_model_len=2048, num_blocks=400, max_num_seqs=12,
            step_s=0.012, prefill_steps=3, observer=observer,
        )  # fmt: skip
    config = EngineConfig(
        model=args.model, device="cpu", spec=SpecConfig(method=args.spec),
        scheduler=SchedulerConfig(max_model_len=2048, max_num_seqs=args.max_num_seqs),
    )  # fmt: skip
    return create_engine(config, observer)


async def main(args: argparse.Namespace) -> int:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        print("chromium not found (apt-get install -y chromium)", file=sys.stderr)
        return 1
    observer = PrometheusObserver("SmolLM2-135M-Instruct")
    engine = make_engine(args, observer)
    await engine.start()
    app = build_app(engine, max_queue=64, observer=observer)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", args.port).start()
    url = f"http://127.0.0.1:{args.port}"
    async with aiohttp.ClientSession(url) as session:
        start, rng = time.monotonic(), random.Random(1)
        users = [
            asyncio.create_task(client_loop(session, rng, start, args.max_tokens))
            for _ in range(args.users)
        ]
        print(f"warming up for {args.warmup:.0f}s at {url}/dashboard", file=sys.stderr)
        await asyncio.sleep(args.warmup)
        rc = await screenshot(chromium, f"{url}/dashboard", args.out)
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
    parser.add_argument("--model", default="default", help="a verifypd model spec, or 'fake'")
    parser.add_argument("--spec", choices=("off", "ngram"), default="ngram")
    parser.add_argument("--users", type=int, default=12, help="simulated clients")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=12)
    parser.add_argument("--warmup", type=float, default=60.0)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "dashboard.png")
    parser.add_argument("--port", type=int, default=8765)
    sys.exit(asyncio.run(main(parser.parse_args())))
