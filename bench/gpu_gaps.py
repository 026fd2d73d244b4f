"""Where the GPU sat idle in a torch profiler trace (Chrome trace JSON, ``export_chrome_trace``):
the union of every stream's kernels, copies and sets, and each gap between them of at least
``min_gap_us``. Per gap: the work before and after it, how late the host issued the work after
it (its launch call's start minus the gap's start: above zero the GPU waited for the host), and
the host ranges (``record_function`` annotations) that overlapped it.

    python bench/gpu_gaps.py TRACE.json[.gz] [--min-gap-us 20] [--top 30]

``annotated(targets)`` wraps methods in ``record_function`` ranges for one profiled run, so a
gap can be read against what the host was doing (``bench/burst.py --trace``).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gzip
import json
from collections.abc import Generator, Iterable
from pathlib import Path
from typing import Any

DEVICE_CATS = frozenset(("kernel", "gpu_memcpy", "gpu_memset"))
LAUNCH_CATS = frozenset(("cuda_runtime", "cuda_driver"))


def load_trace(path: str | Path) -> dict:
    raw = Path(path).read_bytes()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    return json.loads(raw)


def _events(trace: dict) -> list[dict]:
    return [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]


def _busy(device: list[dict]) -> list[tuple[float, float, dict, dict]]:
    """The union of the device intervals: (start, end, first event, last event) per run."""
    out: list[list[Any]] = []
    for e in sorted(device, key=lambda e: e["ts"]):
        start, end = float(e["ts"]), float(e["ts"]) + float(e["dur"])
        if out and start <= out[-1][1]:
            if end > out[-1][1]:
                out[-1][1], out[-1][3] = end, e
        else:
            out.append([start, end, e, e])
    return [tuple(x) for x in out]


def _overlaps(ranges: list[dict], start: float, end: float) -> dict[str, float]:
    """Per annotation name, the microseconds of [start, end] it covered."""
    out: dict[str, float] = {}
    for r in ranges:
        lo, hi = max(start, float(r["ts"])), min(end, float(r["ts"]) + float(r["dur"]))
        if hi > lo:
            out[r["name"]] = out.get(r["name"], 0.0) + hi - lo
    return out


def kernel_gaps(
    trace: dict, min_gap_us: float = 20.0, top: int = 30, window: tuple[float, float] | None = None
) -> dict:
    """The GPU's busy and idle time between its first and last work (or within ``window``,
    microseconds on the trace's clock), the gaps of at least ``min_gap_us`` (the ``top``
    longest listed) and their idle time split by whether the host issued the next work late."""
    events = _events(trace)
    device = [e for e in events if e.get("cat") in DEVICE_CATS]
    if window is not None:
        device = [e for e in device if window[0] <= e["ts"] <= window[1]]
    if not device:
        raise ValueError("the trace has no GPU work (was CUDA activity recorded?)")
    launches = {
        e["args"]["correlation"]: float(e["ts"])
        for e in events
        if e.get("cat") in LAUNCH_CATS and "correlation" in e.get("args", {})
    }
    ranges = [e for e in events if e.get("cat") == "user_annotation"]
    busy = _busy(device)
    first, last = busy[0][0], busy[-1][1]
    gaps = []
    for (_, end, _, before), (start, _, after, _) in zip(busy, busy[1:], strict=False):
        if start - end < min_gap_us:
            continue
        launched = launches.get(after.get("args", {}).get("correlation"))
        host = _overlaps(ranges, end, start)
        gaps.append({
            "at_us": end - first,
            "us": start - end,
            "before": before["name"][:80],
            "after": after["name"][:80],
            "launch_late_us": None if launched is None else launched - end,
            "host": {k: round(v, 1) for k, v in sorted(host.items(), key=lambda kv: -kv[1])[:4]},
        })  # fmt: skip
    idle = sum(g["us"] for g in gaps)
    late = sum(g["us"] for g in gaps if (g["launch_late_us"] or 0) > 0)
    by_host: dict[str, float] = {}
    for g in gaps:
        name = next(iter(g["host"]), "(none)")
        by_host[name] = by_host.get(name, 0.0) + g["us"] / 1e3
    by_host = dict(sorted(by_host.items(), key=lambda kv: -kv[1]))
    return {
        "span_ms": (last - first) / 1e3,
        "busy_ms": sum(b - a for a, b, _, _ in busy) / 1e3,
        "idle_ms": (last - first - sum(b - a for a, b, _, _ in busy)) / 1e3,
        "min_gap_us": min_gap_us,
        "gaps": len(gaps),
        "gaps_ms": idle / 1e3,
        "gaps_host_late_ms": late / 1e3,
        "gaps_ms_by_host_range": by_host,
        "longest": sorted(gaps, key=lambda g: -g["us"])[:top],
    }  # fmt: skip


@contextlib.contextmanager
def annotated(targets: Iterable[tuple[Any, str]]) -> Generator[None, None, None]:
    """Wraps each ``(owner, method name)`` in a ``record_function`` range named after it for
    the block (synchronous methods; a generator method's every resumption is a range)."""
    import inspect

    from torch.profiler import record_function

    saved = []
    for owner, name in targets:
        fn = getattr(owner, name)
        label = f"{getattr(owner, '__name__', type(owner).__name__)}.{name}"
        if inspect.isgeneratorfunction(fn):
            wrapper = _generator_wrapper(fn, label)
        else:

            def wrapper(*a, _fn=fn, _label=label, **k):
                with record_function(_label):
                    return _fn(*a, **k)

            functools.update_wrapper(wrapper, fn)
        saved.append((owner, name, owner.__dict__.get(name)))
        setattr(owner, name, wrapper)
    try:
        yield
    finally:
        for owner, name, original in reversed(saved):
            if original is None:
                delattr(owner, name)
            else:
                setattr(owner, name, original)


def _generator_wrapper(fn: Any, label: str) -> Any:
    from torch.profiler import record_function

    @functools.wraps(fn)
    def wrapper(*a, **k):
        gen = fn(*a, **k)
        while True:
            with record_function(label):
                try:
                    next(gen)
                except StopIteration as stop:
                    return stop.value
            yield

    return wrapper


def format_gaps(summary: dict, rows: int = 12) -> str:
    lines = [
        f"GPU span {summary['span_ms']:.1f} ms: busy {summary['busy_ms']:.1f}, idle "
        f"{summary['idle_ms']:.1f}; {summary['gaps']} gaps >= {summary['min_gap_us']:.0f} us "
        f"({summary['gaps_ms']:.1f} ms, host late in {summary['gaps_host_late_ms']:.1f})",
        "  idle by the host range over it: " + ", ".join(
            f"{k} {v:.1f}" for k, v in list(summary["gaps_ms_by_host_range"].items())[:6]),
    ]  # fmt: skip
    for g in summary["longest"][:rows]:
        late = "?" if g["launch_late_us"] is None else f"{g['launch_late_us']:.0f}"
        lines.append(
            f"  {g['at_us'] / 1e3:8.2f} ms +{g['us']:7.0f} us  late {late}"
            f"  {g['before'][:28]} -> {g['after'][:28]}  {g['host']}"
        )  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace")
    p.add_argument("--min-gap-us", type=float, default=20.0)
    p.add_argument("--top", type=int, default=30)
    args = p.parse_args(argv)
    print(format_gaps(kernel_gaps(load_trace(args.trace), args.min_gap_us, args.top), args.top))


if __name__ == "__main__":
    main()
