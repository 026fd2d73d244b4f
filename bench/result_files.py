"""A sweep's result file in two parts: the main JSON (every summary number; the file the docs
link to) and, beside it, ``<stem>.detail.json.gz`` with the bulky per-run diagnostics: each
``sweep`` row's ``ROW_DETAIL`` keys and the top-level ``policy_timeline``. The main JSON names its
sidecar in ``detail_file``; ``load_result`` puts the two back together.

    main, details = split_details(report)  # merge_details(main, details) == report
    write_result(path, report)             # the main JSON and, if there are details, the sidecar
    load_result(path) == report            # a file that names no sidecar loads as it is

The sidecar is gzipped compact JSON without a time stamp, so the same details give the same
bytes (``zcat X.detail.json.gz`` reads it). Its ``sweep`` holds one dict per row of the main
JSON, in the same order ({} for a row without diagnostics).
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

from common import Run, json_default, write_json

# A row's diagnostics: the slowest requests, the TTFT / ITL anatomies (mixed.py --sweep
# --ttft-anatomy / --itl-anatomy), vLLM's engine steps (peer_vllm.py sweep --trace-steps) and
# each request's first-token stamps through a front (bench/request_times.py).
ROW_DETAIL = ("slowest", "itl_anatomy", "ttft_anatomy", "engine_steps", "request_times")
DETAIL_FILE = "detail_file"  # the main JSON's key naming its sidecar
DETAIL_SUFFIX = ".detail.json.gz"


def slim_row(row: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in row.items() if k not in ROW_DETAIL}


def row_count(row: dict[str, Any], name: str) -> Any:
    """A sweep row's count of ``name`` (``kernel_compiles``, ``decode_rows_fused``): the
    engine's in-process (``num_<name>``), else the server's over HTTP (``server_<name>``)."""
    return row.get(f"num_{name}") or (row.get("server") or {}).get(f"server_{name}")


def split_details(report: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(main, details): ``report`` without its rows' ``ROW_DETAIL`` keys and its non-empty
    ``policy_timeline``, and what was taken out ({} when there is nothing to take)."""
    rows = report.get("sweep") or []
    row_details = [{k: row[k] for k in ROW_DETAIL if k in row} for row in rows]
    details: dict[str, Any] = {}
    if any(row_details):
        details["sweep"] = row_details
    if report.get("policy_timeline"):
        details["policy_timeline"] = report["policy_timeline"]
    main = {k: v for k, v in report.items() if k != "policy_timeline" or k not in details}
    if "sweep" in details:
        main["sweep"] = [slim_row(row) for row in rows]
    return main, details


def merge_details(main: dict[str, Any], details: dict[str, Any]) -> dict[str, Any]:
    """The report ``split_details`` took apart (without ``detail_file``)."""
    report = {k: v for k, v in main.items() if k != DETAIL_FILE}
    if "sweep" in details:
        rows, extra = report["sweep"], details["sweep"]
        if len(rows) != len(extra):
            raise ValueError(f"{len(rows)} sweep rows but details for {len(extra)}")
        report["sweep"] = [{**row, **more} for row, more in zip(rows, extra, strict=True)]
    if "policy_timeline" in details:
        report["policy_timeline"] = details["policy_timeline"]
    return report


def detail_path(path: Path) -> Path:
    return path.with_name(path.stem + DETAIL_SUFFIX)


def detail_bytes(details: dict[str, Any]) -> bytes:
    """Compact JSON, gzipped with mtime 0 in the header: the same details give the same bytes."""
    text = json.dumps(details, separators=(",", ":"), default=json_default)
    return gzip.compress(text.encode(), compresslevel=9, mtime=0)


def write_result(path: Path, report: dict[str, Any], compact: bool | None = None) -> Path:
    """Writes ``report`` as the main JSON at ``path`` and its details, if any, into the sidecar
    (first, so the main JSON never names a sidecar that is not there yet). ``compact``: None
    for ``write_json``'s choice (indented unless large), else compact (True) or indented."""
    if DETAIL_FILE in report:
        raise ValueError(f"{path}: a main JSON naming {report[DETAIL_FILE]}; use load_result")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    main, details = split_details(report)
    sidecar = detail_path(path)
    if details:
        sidecar.write_bytes(detail_bytes(details))
        main[DETAIL_FILE] = sidecar.name
    else:
        sidecar.unlink(missing_ok=True)  # an earlier report's details at this path
    if compact is None:
        return write_json(path, main)
    style: dict[str, Any] = {"separators": (",", ":")} if compact else {"indent": 2}
    path.write_text(json.dumps(main, default=json_default, **style) + "\n")
    return path


def load_result(path: str | Path) -> dict[str, Any]:
    """The report written to ``path``, its sidecar's details merged back (without the
    ``detail_file`` key); a sidecar that is named but missing is an error, not a loss."""
    path = Path(path)
    main = json.loads(path.read_text())
    name = main.get(DETAIL_FILE) if isinstance(main, dict) else None
    if name is None:
        return main
    if Path(name).name != name or not path.with_name(name).is_file():
        raise FileNotFoundError(
            f"{path} keeps its rows' diagnostics and policy timeline in {name!r}, which is not "
            f"beside it (copy the .detail.json.gz along with the .json)"
        )
    details = json.loads(gzip.decompress(path.with_name(name).read_bytes()))
    return merge_details(main, details)


class SidecarRun(Run):
    """A ``Run`` whose report is saved by ``write_result`` (the details into the sidecar)."""

    @classmethod
    def of(cls, run: Run) -> SidecarRun:
        return cls(run.script, run.args, run.device, run.report)  # the same report dict

    def save(self) -> Path:
        return write_result(self.path("json"), self.report)
