"""A sweep's result file split in two (bench/result_files.py): the main JSON keeps every summary
number, the gzip sidecar the rows' diagnostics and the policy timeline; ``load_result`` gives
back exactly the report written; the bytes do not depend on when they were written; a report
of a split run equals the one of the unsplit run; the migration of stored files
(bench/tools/split_result_details.py) writes nothing unless every file reads back equal."""

from __future__ import annotations

import gzip
import json
import os
import runpy
from pathlib import Path

import pytest
from helpers import REPO, load_bench

RF = load_bench("result_files")
TOOL = REPO / "bench" / "tools" / "split_result_details.py"


def _row(mode: str, rate: float, **extra) -> dict:
    return {"rate": rate, "acceptance_profile": "hetero", "temperature": 0.0, "mode": mode,
            "ttft_p99_ms": 100.0, "itl_p99_ms": 20.0, "tpot_p99_ms": 10.0, "goodput_rps": rate,
            "num_finished": 4, "num_requests": 4, **extra}  # fmt: skip


def sweep_report() -> dict:
    """A sweep run's report: rows with and without diagnostics, a policy timeline."""
    return {
        "device": "GPU",
        "git_commit": "abc1234",
        "command": "python bench/mixed.py --sweep",
        "sweep_config": {"rates": [2, 8]},
        "sweep": [
            _row("off", 2, slowest={"ttft": [{"request_id": "r1", "ttft_ms": 120.5}]}),
            _row("policy", 2, itl_anatomy={"plain_share": 0.5}, ttft_anatomy={"queue_ms": 3}),
            _row("off", 8),  # an error row, say: no diagnostics
            _row("vllm", 8, engine_steps=[{"t_ms": 1.0, "running": None}]),
        ],
        "policy_timeline": [
            {
                "rate": 2,
                "acceptance_profile": "hetero",
                "temperature": 0.0,
                "mode": "policy",
                "columns": ["t_s", "mean_draft_len"],
                "values": [[0.0, 2.5], [0.1, None]],
            }
        ],
        "criteria": {"policy_within_5pct_of_best": {"verdict": "PASS"}},
    }


def test_split_moves_only_the_details() -> None:
    report = sweep_report()
    main, details = RF.split_details(report)
    assert report == sweep_report()  # left as it was
    assert list(main) == [k for k in report if k != "policy_timeline"]  # the order kept
    assert [set(r) for r in main["sweep"]] == [set(_row("off", 2))] * 4
    assert details["sweep"] == [
        {"slowest": {"ttft": [{"request_id": "r1", "ttft_ms": 120.5}]}},
        {"itl_anatomy": {"plain_share": 0.5}, "ttft_anatomy": {"queue_ms": 3}},
        {},
        {"engine_steps": [{"t_ms": 1.0, "running": None}]},
    ]
    assert details["policy_timeline"] == report["policy_timeline"]
    assert RF.merge_details(main, details) == report


def test_write_and_load_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "mixed-gpu-sweep-abc.json"
    assert RF.write_result(path, sweep_report()) == path
    sidecar = tmp_path / "mixed-gpu-sweep-abc.detail.json.gz"
    main = json.loads(path.read_text())
    assert main["detail_file"] == sidecar.name
    # what the docs and the issue read stays in the main JSON
    assert main["device"] == "GPU" and main["git_commit"] == "abc1234"
    keys = {"rate", "acceptance_profile", "mode", "ttft_p99_ms", "itl_p99_ms", "tpot_p99_ms",
            "goodput_rps"}  # fmt: skip
    assert all(keys <= set(r) and not set(RF.ROW_DETAIL) & set(r) for r in main["sweep"])
    assert "policy_timeline" not in main and path.read_text().startswith('{\n  "device"')
    assert json.loads(gzip.decompress(sidecar.read_bytes()))["sweep"][2] == {}  # zcat reads it
    assert RF.load_result(path) == sweep_report()
    assert RF.load_result(str(path)) == sweep_report()


def test_a_report_without_details_has_no_sidecar(tmp_path: Path) -> None:
    plain = {**sweep_report(), "sweep": [_row("off", 2)], "policy_timeline": []}
    path = RF.write_result(tmp_path / "http.json", plain)
    assert json.loads(path.read_text()) == plain  # the empty timeline stays where it was
    assert RF.load_result(path) == plain and list(tmp_path.iterdir()) == [path]
    old = tmp_path / "old.json"  # written before the sidecars: loads as it is
    old.write_text(json.dumps(sweep_report()))
    assert RF.load_result(old) == sweep_report()


def test_a_rewrite_without_details_drops_the_old_sidecar(tmp_path: Path) -> None:
    path = RF.write_result(tmp_path / "run.json", sweep_report())
    assert RF.detail_path(path).is_file()
    RF.write_result(path, {"sweep": [_row("off", 2)]})
    assert not RF.detail_path(path).exists() and "detail_file" not in path.read_text()
    with pytest.raises(ValueError, match="use load_result"):  # a main JSON, not a report
        RF.write_result(path, {"detail_file": "run.detail.json.gz", "sweep": []})


def test_same_report_same_bytes(tmp_path: Path) -> None:
    first = RF.write_result(tmp_path / "a" / "run.json", sweep_report())
    sidecar = RF.detail_bytes(RF.split_details(sweep_report())[1])
    assert sidecar[4:8] == b"\0\0\0\0"  # the gzip header's mtime
    os.utime(first, (0, 0))
    second = RF.write_result(tmp_path / "b" / "run.json", sweep_report())
    assert first.read_bytes() == second.read_bytes()
    assert RF.detail_path(first).read_bytes() == RF.detail_path(second).read_bytes() == sidecar


def test_compact_or_indented_main(tmp_path: Path) -> None:
    compact = RF.write_result(tmp_path / "c.json", sweep_report(), compact=True)
    indented = RF.write_result(tmp_path / "i.json", sweep_report(), compact=False)
    assert compact.read_text().startswith('{"device":"GPU",') and compact.read_text()[-2] == "}"
    assert indented.read_text().startswith('{\n  "device": "GPU",')
    assert RF.load_result(compact) == RF.load_result(indented) == sweep_report()


def test_a_missing_sidecar_is_an_error(tmp_path: Path) -> None:
    path = RF.write_result(tmp_path / "run.json", sweep_report())
    RF.detail_path(path).unlink()
    with pytest.raises(FileNotFoundError, match=r"run\.json keeps .* 'run\.detail\.json\.gz'"):
        RF.load_result(path)
    main = json.loads(path.read_text())
    path.write_text(json.dumps({**main, "detail_file": "../elsewhere.detail.json.gz"}))
    with pytest.raises(FileNotFoundError, match="not beside it"):
        RF.load_result(path)


def test_details_of_other_rows_are_refused(tmp_path: Path) -> None:
    main, details = RF.split_details(sweep_report())
    with pytest.raises(ValueError, match="3 sweep rows but details for 4"):
        RF.merge_details({**main, "sweep": main["sweep"][:3]}, details)


def test_sweep_report_reads_a_split_run_as_the_unsplit_one(tmp_path: Path) -> None:
    """sweep_report.py on a run written by write_result: the same merged report, the same
    report file, and the policy timeline it plots, as on the run written whole."""
    report = load_bench("sweep_report")
    vllm = {"command": "peer_vllm", "sweep": [_row("vllm", 2, ttft_p99_ms=150.0)]}
    outputs = []
    for name, write in (("whole", lambda p, d: p.write_text(json.dumps(d))),
                        ("split", RF.write_result)):  # fmt: skip
        folder = tmp_path / name
        folder.mkdir()
        write(folder / "run.json", sweep_report())
        write(folder / "vllm.json", vllm)
        merged = report.main([str(folder / "run.json"), "--vllm", str(folder / "vllm.json"),
                              "--out", str(folder / "report.json")])  # fmt: skip
        outputs.append((merged, (folder / "report.json").read_text()))
    assert (tmp_path / "split" / "run.detail.json.gz").is_file()
    assert outputs[0] == outputs[1]
    merged = outputs[1][0]
    assert merged["policy_timeline"] == sweep_report()["policy_timeline"]
    assert merged["sweep"][0]["slowest"]["ttft"][0]["request_id"] == "r1"
    # the timeline is plotted when runs are joined (one run's is its own plot): from sidecars
    split = tmp_path / "split"
    report.main([str(split / "run.json"), str(split / "run.json"), "--out", str(split / "j.json")])
    assert (split / "j-policy.png").is_file()


def test_sidecar_run_saves_the_details_beside(tmp_path: Path) -> None:
    common = load_bench("common")
    args = type("Args", (), {"out": str(tmp_path), "tag": "t"})()
    run = common.Run("mixed", args, __import__("torch").device("cpu"), sweep_report())
    saved = RF.SidecarRun.of(run)
    assert saved.report is run.report
    saved.finish("table")
    assert RF.load_result(tmp_path / "mixed-cpu-t.json") == {**sweep_report(), "complete": True}
    assert (tmp_path / "mixed-cpu-t.detail.json.gz").is_file()


def _stored(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_migration_splits_stored_files(tmp_path: Path, capsys) -> None:
    """Indented and compact files keep their form; a file without details, and one already
    split, are left alone; a read-only file stays read-only; a second run finds nothing."""
    (tmp_path / "mixed" / "history").mkdir(parents=True)
    whole = sweep_report()
    (tmp_path / "mixed" / "a.json").write_text(json.dumps(whole, indent=2) + "\n")
    compact = tmp_path / "mixed" / "history" / "b.json"
    compact.write_text(json.dumps(whole, separators=(",", ":")) + "\n")
    compact.chmod(0o444)
    plain = {"device": "GPU", "results": {"slowest": [1, 2]}}  # no sweep rows, no timeline
    (tmp_path / "mixed" / "plain.json").write_text(json.dumps(plain, indent=2) + "\n")
    RF.write_result(tmp_path / "mixed" / "split.json", whole)
    before = _stored(tmp_path)
    tool = runpy.run_path(str(TOOL))
    done = tool["main"]([str(tmp_path)])
    assert [p.name for p in done] == ["a.json", "b.json"]
    assert "2 files with details" in capsys.readouterr().out
    for path in done:
        assert RF.load_result(path) == whole and RF.detail_path(path).is_file()
    assert (tmp_path / "mixed" / "a.json").read_text().startswith('{\n  "device": "GPU",')
    assert compact.read_text().startswith('{"device":"GPU",')
    assert compact.stat().st_mode & 0o777 == 0o444
    assert RF.detail_path(compact).stat().st_mode & 0o777 == 0o444
    after = _stored(tmp_path)
    unchanged = ["mixed/plain.json", "mixed/split.json", "mixed/split.detail.json.gz"]
    assert all(after[k] == before[k] for k in unchanged)
    assert tool["main"]([str(tmp_path)]) == [] and _stored(tmp_path) == after


def test_migration_writes_nothing_on_a_mismatch(tmp_path: Path, monkeypatch) -> None:
    for name in ("a.json", "b.json"):
        (tmp_path / name).write_text(json.dumps(sweep_report(), indent=2) + "\n")
    before = _stored(tmp_path)
    tool = runpy.run_path(str(TOOL))
    tool["main"](["--dry-run", str(tmp_path)])
    assert _stored(tmp_path) == before
    monkeypatch.setitem(tool["main"].__globals__, "load_result",
                        lambda p: {**RF.load_result(p), "sweep": []} if "b" in p.name
                        else RF.load_result(p))  # fmt: skip
    with pytest.raises(SystemExit, match="b.json: the split does not read back equal"):
        tool["main"]([str(tmp_path)])
    assert _stored(tmp_path) == before
