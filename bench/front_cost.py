"""The HTTP front's host time per streamed chunk: the real server (``run_server``: aiohttp,
uvloop, the SSE writer, metrics) around ``tests/serve/fake_server.py``'s engine, which emits one
token per running request every ``--step-ms`` and does no model work. ``--streams`` clients
stream ``--tokens`` tokens each at once; the server process's CPU time (``/proc``, Linux), less
its idle rate measured first, is divided by the chunks the clients received. Also each case's
share of the wall time the server was busy and its event loop's lag (``/metrics``). The same
fake engine alone, in this process with its deltas read directly, gives its own CPU time per
token; the difference is the front's.

On a GPU server the engine shares this event loop, so this is the part of a step's host time
that the front takes, per chunk, at a given number of streams. The fake engine's own per-token
work (its stop check, its KV accounting) is measured alone and subtracted.

/proc counts CPU time in clock ticks (10 ms): a case needs a second or more of streaming.

    python bench/front_cost.py [--streams 1,16,64] [--step-ms 7] [--tokens 100]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

import aiohttp  # noqa: E402
from common import add_common_args, csv_list, format_table, free_port, start_run  # noqa: E402
from http_load import server_means, server_totals, wait_ready  # noqa: E402

SCRIPT = "front_cost"
FAKE_SERVER = Path(__file__).resolve().parents[1] / "tests" / "serve" / "fake_server.py"
sys.path.append(str(FAKE_SERVER.parent))


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--streams", type=lambda s: [int(x) for x in csv_list(s)], default=[1, 16, 64])
    p.add_argument("--step-ms", type=float, default=7.0, help="the fake engine's step")
    p.add_argument(
        "--tokens", type=int, default=100, help="per stream (the fake engine's 512 KV blocks)"
    )
    p.add_argument("--idle-s", type=float, default=2.0, help="the idle rate's measurement")
    add_common_args(p)
    args = p.parse_args(argv)
    if args.device == "auto":
        args.device = "cpu"  # no model runs: the host is what is measured
    return args


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` (Linux ``/proc/<pid>/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def stream(session: aiohttp.ClientSession, url: str, tokens: int) -> int:
    """One streamed completion; the number of data events with a choice (chunks) received."""
    body = {"prompt": "a", "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}  # fmt: skip
    chunks = 0
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:200]}")
        async for line in resp.content:
            if line.startswith(b"data: {"):
                chunks += 1
    return chunks


async def measure(args, streams: int) -> dict[str, Any]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, str(FAKE_SERVER), "--port", str(port), "--step-s",
           str(args.step_ms / 1e3), "--max-num-seqs", str(streams),
           "--max-queue", str(4 * streams)]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        await wait_ready(url, 60.0, proc)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            await stream(session, url, 8)  # the first request's one-off costs
            idle0, t0 = cpu_seconds(proc.pid), time.perf_counter()
            await asyncio.sleep(args.idle_s)
            idle_rate = (cpu_seconds(proc.pid) - idle0) / (time.perf_counter() - t0)
            before = await server_totals(url)
            cpu0, t0 = cpu_seconds(proc.pid), time.perf_counter()
            counts = await asyncio.gather(
                *(stream(session, url, args.tokens) for _ in range(streams))
            )
            wall = time.perf_counter() - t0
            cpu = cpu_seconds(proc.pid) - cpu0
            lag = server_means(before, await server_totals(url))
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    chunks = sum(counts)
    busy = cpu - idle_rate * wall
    return {"streams": streams, "chunks": chunks, "wall_s": wall, "server_cpu_s": cpu,
            "idle_cpu_rate": idle_rate, "cpu_per_chunk_us": busy / chunks * 1e6,
            "busy_share": cpu / wall, "chunks_per_s": chunks / wall,
            "loop_lag_mean_ms": lag.get("server_loop_lag_mean_ms"),
            "loop_lag_late_share": lag.get("server_loop_lag_late_share")}  # fmt: skip


async def engine_alone(args, streams: int) -> dict[str, Any]:
    """The fake engine without the front: ``streams`` requests read in this process."""
    from fake_engine import FakeEngine

    from verifypd.types import SamplingParams

    engine = FakeEngine(step_s=args.step_ms / 1e3, max_num_seqs=streams)
    await engine.start()
    params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)

    async def one(i: int) -> int:
        return sum([len(out.new_token_ids) async for out in engine.generate(f"r{i}", [97], params)])

    try:
        cpu0, t0 = time.process_time(), time.perf_counter()
        await asyncio.sleep(args.idle_s)
        idle_rate = (time.process_time() - cpu0) / (time.perf_counter() - t0)
        cpu0, t0 = time.process_time(), time.perf_counter()
        tokens = sum(await asyncio.gather(*(one(i) for i in range(streams))))
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    finally:
        await engine.stop()
    return {"tokens": tokens, "wall_s": wall, "cpu_s": cpu, "idle_cpu_rate": idle_rate,
            "cpu_per_token_us": (cpu - idle_rate * wall) / tokens * 1e6}  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, Any]:
    run = start_run(SCRIPT, argv, parse_args, method=__doc__.split("\n\n")[0])
    rows = []
    for n in run.args.streams:
        row = asyncio.run(measure(run.args, n))
        row["engine_alone"] = asyncio.run(engine_alone(run.args, n))
        row["front_cpu_per_chunk_us"] = (
            row["cpu_per_chunk_us"] - row["engine_alone"]["cpu_per_token_us"]
        )
        rows.append(row)
        run.report["results"] = {"cases": rows}
        run.save()
    table = format_table(
        ["streams", "chunks/s", "µs CPU / chunk", "engine alone", "front", "server busy",
         "loop late ≥ 5 ms"],
        [[r["streams"], f"{r['chunks_per_s']:,.0f}", f"{r['cpu_per_chunk_us']:.1f}",
          f"{r['engine_alone']['cpu_per_token_us']:.1f}", f"{r['front_cpu_per_chunk_us']:.1f}",
          f"{r['busy_share']:.0%}", f"{r['loop_lag_late_share'] or 0:.1%}"] for r in rows],
    )  # fmt: skip
    run.finish(table)
    return run.report


if __name__ == "__main__":
    main()
