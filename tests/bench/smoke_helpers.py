"""What the smoke tests of the benchmark scripts share (tests/bench/test_bench_smoke_*.py): the
metadata keys of every benchmark JSON, and reading a script's CPU JSON with its metadata
checked."""

from __future__ import annotations

import json
from pathlib import Path

META_KEYS = {"device", "versions", "git_commit", "date_utc", "command", "params", "ceilings"}


def read_json(out: Path, script: str) -> dict:
    data = json.loads((out / f"{script}-cpu.json").read_text())
    assert META_KEYS <= set(data)
    assert data["device"] == "cpu"
    assert data["ceilings"]["copy_gbps"] is None
    assert data["command"].startswith(f"python bench/{script}.py")
    assert {"torch", "triton", "transformers"} <= set(data["versions"])
    return data
