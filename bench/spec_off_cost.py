"""Speculation that does not run must cost nothing (issue 14), over HTTP: `verifypd serve`
without a drafter against the same server with `--draft-model` (the default speculation policy,
real acceptance: on dummy weights about 0, so the policy should leave L = 0), started one at a
time, each driven by the same seeded closed-loop workload through bench/http_load.py.

Targets: with the drafter, output throughput within 3 % and TTFT / ITL p99 within 5 % of the
server without one. Default workload (the issue's): 96 streaming requests, 24 concurrent,
prompts of U[64, 1024] random token ids, 128 output tokens, greedy, ignore_eos.

    python bench/spec_off_cost.py                   # one H100: 7B + 0.5B, about 2 minutes
    python bench/spec_off_cost.py --order ABBA      # each server twice, to show the noise
    python bench/spec_off_cost.py --device cpu --model dummy:tiny --draft-model dummy:tiny \
        --requests 4 --concurrency 2 --prompt-lens 8 16 --output-len 4
"""

from __future__ import annotations

import argparse
import asyncio
import re
import shlex
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

import aiohttp  # noqa: E402
import numpy as np  # noqa: E402
from common import (  # noqa: E402
    Run,
    add_common_args,
    argv_or_sys,
    bar_panels,
    format_table,
    free_port,
    metadata,
    resolve_device,
    results_dir,
)
from http_load import HttpEngine, served_model, wait_ready  # noqa: E402
from loadgen import Request, Trace, closed_loop, latency_stats, load_stats  # noqa: E402

from verifypd.model_config import dummy_preset  # noqa: E402
from verifypd.types import SamplingParams  # noqa: E402

SCRIPT = "spec_off_cost"
SERVERS = {"A": "no-drafter", "B": "drafter"}
TARGETS = {"throughput": 0.03, "ttft_p99": 0.05, "itl_p99": 0.05}  # allowed relative loss
METRIC_KEYS = ("output_tok_s", "ttft_p50_ms", "ttft_p99_ms", "ttft_first_wave_p99_ms",
               "ttft_later_p99_ms", "itl_p50_ms", "itl_p99_ms", "chunk_gap_p99_ms")  # fmt: skip
# Cumulative series of /metrics that say what speculation did (deltas over the measured run).
SPEC_SERIES = re.compile(
    r"^verifypd_\w*(spec|controller|policy|decision)\w*_(total|count|sum|bucket)$"
)
POLICY_SERIES = re.compile(r'^verifypd_spec_policy_decisions_total\{.*decision="([^"]*)"')
SERIES_LINE = re.compile(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="dummy:qwen2.5-7b", help="target (both servers)")
    p.add_argument(
        "--draft-model",
        default="dummy:qwen2.5-0.5b",
        help="server B's drafter; ngram: server B speculates by prompt lookup",
    )
    p.add_argument("--requests", type=int, default=96)
    p.add_argument(
        "--concurrency", type=int, default=24, help="clients, each one request at a time"
    )
    p.add_argument("--prompt-lens", type=int, nargs=2, default=[64, 1024], help="U[lo, hi] tokens")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--warmup-requests", type=int, default=8, help="per server, before measuring")
    p.add_argument("--order", default="AB", choices=["AB", "BA", "ABBA"],
                   help="A: no drafter, B: drafter; ABBA runs each twice (noise)")  # fmt: skip
    p.add_argument("--port", type=int, default=0, help="0: a free port")
    p.add_argument("--server-timeout", type=float, default=900.0, help="seconds to get healthy")
    p.add_argument("--run-timeout", type=float, default=1800.0, help="seconds for the workload")
    p.add_argument("--serve-args", default="", help="more `verifypd serve` flags, both servers")
    p.add_argument("--vocab-size", type=int, default=32000, help="prompt ids for non-dummy models")
    add_common_args(p)
    p.set_defaults(max_model_len=0)  # 0: the server's default (the model's context length)
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- workload
def workload(args, count: int, salt: int = 0) -> list[Request]:
    """Seeded prompts of random ids, identical for both servers; all ready at t = 0."""
    rng = np.random.default_rng(args.seed * 1000 + salt)
    vocab = vocab_of(args.model, args.vocab_size)
    lo, hi = args.prompt_lens
    lens = rng.integers(lo, hi + 1, count)
    return [
        Request(
            f"req-{salt}-{i}", "closed", 0.0, rng.integers(0, vocab, n).tolist(), args.output_len
        )
        for i, n in enumerate(lens)
    ]


def vocab_of(model: str, fallback: int) -> int:
    preset = dummy_preset(model)
    return preset.vocab_size if preset is not None else fallback


def greedy(req: Request) -> SamplingParams:
    return SamplingParams(max_tokens=req.max_tokens, temperature=0.0, ignore_eos=True)


# ----------------------------------------------------------------------------- servers
def serve_command(args, server: str, port: int) -> list[str]:
    cmd = [sys.executable, "-m", "verifypd", "serve", "--model", args.model, "--port", str(port),
           "--device", args.device, "--dtype", args.dtype, "--seed", str(args.seed)]  # fmt: skip
    if args.max_model_len:
        cmd += ["--max-model-len", str(args.max_model_len)]
    if server == "drafter" and args.draft_model == "ngram":
        cmd += ["--spec", "ngram"]  # prompt lookup: speculation with no drafter model
    elif server == "drafter":
        cmd += ["--draft-model", args.draft_model]
    return cmd + shlex.split(args.serve_args)


def run_server(args, server: str, index: int, out: Path, measured, warm) -> dict[str, Any]:
    """Starts one server, drives the workload, stops it; the server's log goes to ``out``."""
    port = args.port or free_port()
    cmd = serve_command(args, server, port)
    log_path = out / f"{SCRIPT}-server-{index}-{server}.log"
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            res = asyncio.run(drive(args, f"http://127.0.0.1:{port}", proc, t0, measured, warm))
        finally:
            stop(proc)
    res.update(server=server, index=index, command=cmd, log=log_path.name)
    res["server_log"] = [ln for ln in log_path.read_text().splitlines() if _notable(ln)]
    return res


def _notable(line: str) -> bool:
    return any(k in line for k in ("sizing the KV", "step costs", "capturing CUDA", "Error"))


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


async def drive(args, base: str, proc, t0: float, measured, warm) -> dict[str, Any]:
    await wait_ready(base, args.server_timeout, proc)
    startup_s = time.perf_counter() - t0
    async with HttpEngine(base, await served_model(base)) as http:
        await closed_loop(http, warm, greedy, args.concurrency, args.run_timeout)
        before, opening = await scrape(base), {}

        async def at_wave() -> None:  # what the policy did while the opening wave prefilled
            opening.update(await scrape(base))

        traces, t_start = await closed_loop(http, measured, greedy, args.concurrency,
                                            args.run_timeout, on_wave=at_wave)  # fmt: skip
        after = await scrape(base)
    return {
        "startup_s": startup_s,
        **run_stats(traces, t_start, args.concurrency),
        "spec": spec_deltas(before, after),
        "spec_opening_wave": spec_deltas(before, opening) if opening else None,
    }


async def scrape(base: str) -> dict[str, float]:
    """The cumulative speculation series of ``GET /metrics``: {"name{labels}": value}."""
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{base}/metrics") as resp:
            text = await resp.text()
    out = {}
    for line in text.splitlines():
        m = SERIES_LINE.match(line)
        if m and SPEC_SERIES.match(m[1]):
            out[m[1] + (m[2] or "")] = float(m[3])
    return out


# ----------------------------------------------------------------------------- statistics
def run_stats(traces: list[Trace], t_start: float, concurrency: int) -> dict[str, Any]:
    load, lat = load_stats(traces, t_start), latency_stats(traces)
    waves = ttft_by_wave(traces, concurrency)
    return {
        "output_tok_s": load["output_tok_s"],
        "ttft_p50_ms": lat["ttft_ms"]["p50"], "ttft_p99_ms": lat["ttft_ms"]["p99"],
        "ttft_first_wave_p99_ms": waves["first_wave"]["p99"],
        "ttft_later_p99_ms": waves["later"]["p99"],
        "itl_p50_ms": lat["itl_ms"]["p50"], "itl_p99_ms": lat["itl_ms"]["p99"],
        "chunk_gap_p99_ms": lat["delta_gap_ms"]["p99"],
        "num_requests": load["num_requests"], "num_finished": load["num_finished"],
        "num_errors": load["num_errors"], "output_tokens": load["output_tokens"],
        "requested_output_tokens": load["requested_output_tokens"], "span_s": load["span_s"],
        "latency": lat,
        "ttft_by_wave": waves,
        "per_request": per_request(traces, t_start),
    }  # fmt: skip


def per_request(traces: list[Trace], t_start: float) -> list[list[float | int | None]]:
    """[sent s after the run's start, prompt tokens, TTFT ms] per request, in send order (where
    in the run a TTFT tail falls)."""
    rows = [
        [round(t.arrival - t_start, 4), t.prompt_len, _ms(t.ttft_s)] for t in traces if t.deltas
    ]
    return sorted(rows, key=lambda r: r[0])


def ttft_by_wave(traces: list[Trace], concurrency: int) -> dict[str, Any]:
    """TTFT of the first wave (the ``concurrency`` requests sent together at the start) against
    the rest (sent as others finished): whether a p99 is the opening burst's."""
    sent = sorted((t for t in traces if t.deltas), key=lambda t: t.arrival)
    out = {}
    for name, part in (("first_wave", sent[:concurrency]), ("later", sent[concurrency:])):
        ttft = [t.ttft_s * 1e3 for t in part]
        out[name] = {
            "n": len(ttft),
            "p50": float(np.percentile(ttft, 50)) if ttft else None,
            "p99": float(np.percentile(ttft, 99)) if ttft else None,
            "max": max(ttft, default=None),
        }
    ranked = sorted(sent, key=lambda t: t.ttft_s, reverse=True)
    top = ranked[: max(1, len(sent) // 100)]  # the requests at or above the p99
    out["p99_requests_in_first_wave"] = sum(sent.index(t) < concurrency for t in top)
    out["p99_requests"] = len(top)
    return out


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 3)


def spec_deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """What speculation did during the measured run: drafted / accepted tokens and the
    controller's (policy's) draft-length decisions (one per running sequence and step), those
    of L = 0 among them, plus the raw counters' deltas (histogram buckets left out)."""
    delta = {k: v - before.get(k, 0.0) for k, v in after.items()}
    by_name: dict[str, float] = defaultdict(float)
    for key, v in delta.items():
        if "_bucket" not in key:
            by_name[key.split("{")[0]] += v
    l0_bucket = "verifypd_controller_draft_length_bucket"
    zero = sum(v for k, v in delta.items() if k.startswith(l0_bucket) and 'le="0.0"' in k)
    drafted = by_name.get("verifypd_spec_draft_tokens_total", 0.0)
    accepted = by_name.get("verifypd_spec_accepted_tokens_total", 0.0)
    decisions = by_name.get("verifypd_controller_draft_length_count", 0.0)
    return {
        "drafted_tokens": drafted, "accepted_tokens": accepted,
        "acceptance_rate": accepted / drafted if drafted else None,
        "draft_len_decisions": decisions, "draft_len_decisions_l0": zero,
        "mean_draft_len": by_name.get("verifypd_controller_draft_length_sum", 0.0) / decisions
        if decisions else None,
        "policy_decisions": policy_decisions(delta),
        # the policy's own host time over the run (the event loop waits for each decision)
        "policy_decide_s": by_name.get("verifypd_spec_policy_decide_seconds_sum", 0.0),
        "series": {k: v for k, v in sorted(delta.items()) if v and "_bucket" not in k},
    }  # fmt: skip


def policy_decisions(delta: dict[str, float]) -> dict[str, float]:
    """The speculation policy's decisions (one per decode step) by their ``decision`` label."""
    out: dict[str, float] = defaultdict(float)
    for key, v in delta.items():
        m = POLICY_SERIES.match(key)
        if m and v:
            out[m[1]] += v
    return dict(sorted(out.items()))


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per server the mean of its runs; the drafter server against the other; the verdicts."""
    servers = {}
    for name in SERVERS.values():
        mine = [r for r in runs if r["server"] == name]
        servers[name] = {k: _mean([r.get(k) for r in mine]) for k in METRIC_KEYS}
        servers[name]["runs"] = [r["index"] for r in mine]
        servers[name].update(_totals(mine))
        servers[name]["spread"] = {k: _spread([r.get(k) for r in mine]) for k in METRIC_KEYS}
    a, b = servers["no-drafter"], servers["drafter"]
    ratios = {k: _ratio(b[k], a[k]) for k in METRIC_KEYS}
    checks = {
        "throughput": (ratios["output_tok_s"], lambda r: r >= 1 - TARGETS["throughput"]),
        "ttft_p99": (ratios["ttft_p99_ms"], lambda r: r <= 1 + TARGETS["ttft_p99"]),
        "itl_p99": (ratios["itl_p99_ms"], lambda r: r <= 1 + TARGETS["itl_p99"]),
    }
    verdicts = {
        k: None if r is None else ("PASS" if ok(r) else "MISS") for k, (r, ok) in checks.items()
    }
    return {"servers": servers, "ratios": ratios, "verdicts": verdicts,
            "pass": all(v == "PASS" for v in verdicts.values())}  # fmt: skip


def _totals(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Requests served and what speculation did, summed over a server's runs."""
    out = {k: sum(r.get(k, 0) for r in runs) for k in ("num_requests", "num_finished")}
    for k in ("drafted_tokens", "accepted_tokens", "draft_len_decisions", "draft_len_decisions_l0"):
        out[k] = sum(r.get("spec", {}).get(k, 0) for r in runs)
    for k in ("draft_len_decisions", "policy_decide_s"):  # while the opening wave prefilled
        out[f"opening_wave_{k}"] = sum((r.get("spec_opening_wave") or {}).get(k, 0) for r in runs)
    return out


def _mean(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return float(np.mean(vals)) if vals else None


def _spread(values: list[float | None]) -> float | None:
    """(max - min) / mean of one server's runs (None for a single run)."""
    vals = [v for v in values if v is not None]
    return (
        float((max(vals) - min(vals)) / np.mean(vals)) if len(vals) > 1 and np.mean(vals) else None
    )


def _ratio(b: float | None, a: float | None) -> float | None:
    return b / a if a and b is not None else None


# ----------------------------------------------------------------------------- report
def table(summary: dict[str, Any]) -> str:
    a, b = summary["servers"]["no-drafter"], summary["servers"]["drafter"]
    rows = [[k, a[k], b[k], summary["ratios"][k]] for k in METRIC_KEYS]
    verdicts = ", ".join(f"{k} {v}" for k, v in summary["verdicts"].items())
    return format_table(["metric", "no drafter", "drafter", "drafter / none"], rows) + (
        f"\ntargets: throughput >= 0.97x, TTFT and ITL p99 <= 1.05x: {verdicts}"
    )


def plot(path: Path, summary: dict[str, Any]) -> Path | None:
    servers = summary["servers"]
    names = list(servers)

    def series(keys):
        return {k: [servers[n][k] for n in names] for k in keys}

    return bar_panels(path, [
        ("output throughput", "tok/s", names, series(["output_tok_s"])),
        ("TTFT", "ms", names, series(["ttft_p50_ms", "ttft_p99_ms"])),
        ("ITL", "ms", names, series(["itl_p50_ms", "itl_p99_ms"])),
        ("chunk gap p99", "ms", names, series(["chunk_gap_p99_ms"])),
    ])  # fmt: skip


def acceptance_label(args) -> str:
    if args.draft_model == "ngram":
        return "real (prompt lookup on random prompt ids)"
    dummies = args.model.startswith("dummy:") and args.draft_model.startswith("dummy:")
    if dummies and args.model != args.draft_model:
        return "real (dummy weights: ~0)"
    return "real"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = argv_or_sys(argv)
    args = parse_args(argv)
    out = Path(args.out) if args.out else results_dir(SCRIPT)
    out.mkdir(parents=True, exist_ok=True)
    measured, warm = workload(args, args.requests), workload(args, args.warmup_requests, salt=1)
    runs = []
    for index, label in enumerate(args.order):
        res = run_server(args, SERVERS[label], index, out, measured, warm)
        runs.append(res)
        done = f"{res['num_finished']}/{res['num_requests']}"
        print(f"[{SCRIPT}] {res['server']}: {res['output_tok_s']} tok/s, {done} finished")
    device = resolve_device(args.device)  # after the servers: this process never held the GPU
    report = metadata(SCRIPT, argv, vars(args), device)
    workload_desc = {"requests": args.requests, "concurrency": args.concurrency,
                     "prompt_lens": args.prompt_lens, "output_len": args.output_len,
                     "sampling": "greedy, ignore_eos, streaming /v1/completions",
                     "prompt_tokens": sum(len(r.prompt) for r in measured)}  # fmt: skip
    report.update(acceptance=acceptance_label(args), targets=TARGETS, workload=workload_desc,
                  order=args.order, runs=runs, **summarize(runs), complete=True)  # fmt: skip
    run = Run(SCRIPT, args, device, report)
    run.finish(table(report), lambda png: plot(png, report))
    return report


if __name__ == "__main__":
    main()
