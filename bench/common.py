"""Shared pieces of the benchmark scripts: run metadata, JSON output, tables, timing. The
hardware ceilings (copy GB/s, bf16 matmul TFLOP/s) are in ``hw_ceilings.py``, the bar charts and
the PNG writer in ``bar_plots.py`` (both re-exported here), the transformers reference in
``hf_reference.py`` and the engine-side harness in ``harness.py``.

Every script runs on CPU with tiny settings (``--device cpu --model dummy:tiny``) so its logic is
tested in CI; numbers only mean something on a GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import gc
import json
import os
import platform
import re
import shlex
import socket
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from bar_plots import Panel, bar_chart, bar_panels, draw_bars, save_figure  # noqa: F401
from hw_ceilings import hardware_ceilings

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_ROOT = REPO_ROOT / "bench" / "results"
# The folder of bench/results/ each script writes into by default (bench/results/README.md is
# the index of the topics and their headline files).
TOPICS = {
    "kernels": "kernels",
    "gemv": "kernels",
    "gpu_check": "kernels",
    "latency": "latency",
    "spec": "spec",
    "spec_off_cost": "spec",
    "draft_window": "spec",
    "mixed": "mixed",
    "offline": "offline",
    "overlap": "profile",
    "profile_decode": "profile",
    "profile_prefill": "profile",
    "gemm_host": "profile",
    "host_inputs": "profile",
    "profile_offline": "profile",
    "profile_spec": "profile",
    "timeline": "profile",
    "catch_up_cost": "profile",
    "sample_cost": "profile",
    "policy_sim": "profile",
    "front_cost": "profile",
    "burst": "profile",
    "peer_vllm": "peer",
    "api_cost": "api",
    "grammar_mask": "api",
}


def results_dir(script: str) -> Path:
    """``bench/results/<topic>/`` of a script (the results root for one without a topic)."""
    return RESULTS_ROOT / TOPICS.get(script, "")


# ----------------------------------------------------------------------------- CLI helpers
def add_common_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="output folder (default: bench/results/TOPIC/)")
    p.add_argument("--no-ceilings", action="store_true", help="skip the copy/matmul ceilings")
    p.add_argument("--tag", default="", help="appended to the output file names (split runs)")
    p.add_argument(
        "--max-model-len",
        type=int,
        default=4096,
        help="engine context limit (as nano-vllm's bench); 0 = the model's own (32K+); it also "
        "bounds the CUDA-graph decode attention grid",
    )


def add_spec_args(p: argparse.ArgumentParser, acceptance: float = 0.8) -> None:
    """The speculative pair of the speculation benchmarks (a 7B target, a 0.5B drafter), the
    fixed draft length and the synthetic acceptance alpha (see ``harness.synthetic_spec``)."""
    p.add_argument("--model", default="dummy:qwen2.5-7b", help="target model")
    p.add_argument("--draft-model", "--draft", default="dummy:qwen2.5-0.5b", help="drafter")
    p.add_argument("--draft-len", type=int, default=4, help="fixed L; the controller's L_max")
    p.add_argument("--acceptance", type=float, default=acceptance, help="synthetic alpha")


def add_front_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--front",
        default="llm",
        choices=["llm", "async"],
        help="llm: LLM.generate (lanes on its private loop); async: AsyncEngine lanes",
    )
    p.add_argument("--lane-mode", default="three", choices=["three", "single"], help="async only")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a server started next)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def csv_list(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


# ----------------------------------------------------------------------------- metadata
def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu"


def device_slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown"


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except Exception:  # noqa: BLE001 - a missing package is just "None" in the report
        return None


def git_commit() -> str:
    """HEAD of the repo; ``VERIFYPD_GIT_COMMIT`` wins (machines that get a copy without .git)."""
    if os.environ.get("VERIFYPD_GIT_COMMIT"):
        return os.environ["VERIFYPD_GIT_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"


def git_dirty() -> bool | None:
    try:
        out = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return bool(out.stdout.strip()) if out.returncode == 0 else None


def metadata(script: str, argv: Sequence[str], params: dict[str, Any], device: torch.device):
    """Who/what/where/when of a run; ``params`` are the parsed arguments."""
    return {
        "script": script,
        "device": device_name(device),
        "device_type": device.type,
        "cuda_capability": (
            list(torch.cuda.get_device_capability(device)) if device.type == "cuda" else None
        ),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "triton": _version("triton"),
            "transformers": _version("transformers"),
            "numpy": np.__version__,
            "cuda": torch.version.cuda,
        },
        "git_commit": git_commit(),
        "git_dirty": git_dirty(),
        "date_utc": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": shlex.join(["python", f"bench/{script}.py", *argv]),
        "argv": list(argv),
        "params": params,
        "host": platform.node(),
    }


@dataclass
class Run:
    """One run of a benchmark: its parsed arguments, device and JSON report (metadata, hardware
    ceilings, then what the script adds), written to the script's result file by ``save``."""

    script: str
    args: argparse.Namespace
    device: torch.device
    report: dict[str, Any]

    def path(self, ext: str) -> Path:
        return result_path(self.args.out, self.script, self.device, ext, self.args.tag)

    def save(self) -> Path:
        """Writes the report as it stands (after every measurement: a killed run keeps them)."""
        return write_json(self.path("json"), self.report)

    def finish(self, table: str, plot: Callable[[Path], Path | None] | None = None) -> Path:
        """Marks the report complete, saves it, draws ``plot(png_path)``, prints ``table``."""
        self.report["complete"] = True
        json_path = self.save()
        png = plot(self.path("png")) if plot is not None else None
        print(table)
        print(f"wrote {json_path}" + (f" and {png}" if png else ""))
        return json_path


def start_run(
    script: str,
    argv: Sequence[str] | None,
    parse_args: Callable[[list[str]], argparse.Namespace],
    method: str | None = None,
) -> Run:
    """Parses ``argv`` (default ``sys.argv[1:]``) for a script that took ``add_common_args``,
    resolves the device and starts the report: metadata, ceilings, ``method``, ``complete``
    (False until ``Run.finish``) and an empty ``results``."""
    argv = argv_or_sys(argv)
    args = parse_args(argv)
    device = resolve_device(args.device)
    report = metadata(script, argv, vars(args), device)
    report["ceilings"] = hardware_ceilings(device, args.no_ceilings)
    if method is not None:
        report["method"] = method
    report["complete"], report["results"] = False, {}
    return Run(script, args, device, report)


def result_path(
    out_dir: str | Path | None, script: str, device: torch.device, ext: str, tag: str = ""
) -> Path:
    """``<out>/<script>-<device-slug>[-<tag>].<ext>``; no ``out_dir``: the script's topic folder."""
    out = Path(out_dir) if out_dir else results_dir(script)
    out.mkdir(parents=True, exist_ok=True)
    suffix = f"-{device_slug(tag)}" if tag else ""
    return out / f"{script}-{device_slug(device_name(device))}{suffix}.{ext}"


COMPACT_JSON_BYTES = 256 * 1024


def write_json(path: Path, data: dict[str, Any]) -> Path:
    """Indented for reading; a result whose compact text passes ``COMPACT_JSON_BYTES`` (per-step
    timelines, per-request traces) stays compact, so the results folder stays small enough to
    travel with the repository to the GPU machine."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(data, separators=(",", ":"), default=json_default)
    if len(text) <= COMPACT_JSON_BYTES:
        text = json.dumps(data, indent=2, default=json_default)
    path.write_text(text + "\n")
    return path


def write_json_and_plot(out: str | None, result: dict[str, Any], plot) -> None:
    """A report tool's ``--out``: the JSON there and ``plot(result, PNG path)``'s figure beside
    it (``plot`` returns the path, or None without matplotlib); nothing without ``--out``."""
    if not out:
        return
    path = write_json(Path(out), result)
    png = plot(result, path.with_suffix(".png"))
    print(f"wrote {path}" + (f" and {png}" if png else ""))


def json_default(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):  # configs: every field
        return dataclasses.asdict(obj)
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, (torch.dtype, torch.device, Path)):
        return str(obj)
    return repr(obj)


def progress(script: str, what: str, m: dict[str, Any], keys: Sequence[str] = ()) -> None:
    """One line per finished measurement on stderr, so a long or killed run shows where it got."""
    keys = (*keys, "decode_tok_s", "e2e_tok_s", "output_tok_s", "error")
    parts = [f"{k}={_cell(m[k])}" for k in keys if m.get(k) is not None]
    print(f"[{script}] {what}: {' '.join(parts) or 'done'}", file=sys.stderr, flush=True)


def error_record(exc: BaseException) -> dict[str, str]:
    """An exception as JSON: the run goes on and the report says what failed."""
    tb = traceback.format_exception(type(exc), exc, exc.__traceback__)
    return {"error": f"{type(exc).__name__}: {exc}", "traceback": "".join(tb)[-4000:]}


# ----------------------------------------------------------------------------- output
def format_table(headers: list[str], rows: list[list[Any]]) -> str:
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))
    sep = "  ".join("-" * w for w in widths)
    body = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    return "\n".join([line, sep, *body])


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 10 else f"{v:,.1f}"
    return str(v)


# ----------------------------------------------------------------------------- timing
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device) -> tuple[float, Any]:
    """Wall seconds of ``fn()`` between two device syncs, and its result."""
    sync(device)
    start = time.perf_counter()
    result = fn()
    sync(device)
    return time.perf_counter() - start, result


def median(values: list[float]) -> float:
    return float(statistics.median(values))


def release_memory() -> None:
    """Frees what dropped engines held (call after the last reference is gone)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def gpu_memory_gb(device: torch.device) -> dict[str, float] | None:
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    return {
        "allocated": torch.cuda.memory_allocated(device) / 2**30,
        "reserved": torch.cuda.memory_reserved(device) / 2**30,
        "free": free / 2**30,
        "total": total / 2**30,
    }


# ----------------------------------------------------------------------------- profiles
KERNEL_KINDS = ("matmul", "attention", "other")
_MATMUL_NAMES = ("gemm", "gemv", "cutlass", "sm90", "nvjet")
_MATMUL_NAMES += ("aten::mm", "addmm", "linear", "matmul")  # CPU ops (smoke runs)


def kernel_kind(name: str) -> str:
    """A profiled kernel's share (on CPU an aten op's): GEMMs, attention, or the rest."""
    n = name.lower()
    if any(k in n for k in _MATMUL_NAMES):
        return "matmul"
    if "attention" in n or "split_kv" in n or "merge" in n or "sdpa" in n:
        return "attention"
    return "other"


def argv_or_sys(argv: Sequence[str] | None) -> list[str]:
    return list(sys.argv[1:] if argv is None else argv)
