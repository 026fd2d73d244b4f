"""``verifypd bench NAME``: found from any working directory; an unknown name lists the scripts."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from verifypd.__main__ import bench_dir, main


def test_bench_runs_from_another_directory(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    argv_before = list(sys.argv)
    with pytest.raises(SystemExit) as exit_info:  # argparse's --help exits 0 after printing
        main(["bench", "latency", "--help"])
    assert exit_info.value.code == 0
    assert "Decode speed at fixed batch sizes" in capsys.readouterr().out
    assert sys.argv == argv_before


def test_unknown_bench_lists_the_benchmarks(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "no-such-bench"]) == 2
    err = capsys.readouterr().err
    assert "unknown benchmark 'no-such-bench'" in err
    listed = err.split("choose one of:")[1].strip().split(", ")
    assert {"latency", "spec", "mixed", "offline", "kernels"} <= set(listed)
    assert not {
        "common",
        "harness",
        "loadgen",
        "hf_batch",
        "http_load",
        "sweep",
        "peer_sweep",
    } & set(listed)  # libraries, not benches
    assert all((bench_dir() / f"{name}.py").is_file() for name in listed)
    # every name listed runs as a script; a module other scripts import is not listed
    for name in listed:
        assert '__name__ == "__main__"' in (bench_dir() / f"{name}.py").read_text(), name
