"""Smoke tests of bench/burst.py: on CPU with ``dummy:tiny`` and tiny sizes into a temp dir,
with and without decode rows, with ``--profile --trace``, over HTTP against a real ``verifypd
serve``, and ``--compare`` of result files; its JSON has the metadata and positive numbers."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest
from helpers import load_bench, start_server_process, verifypd_serve_command
from smoke_helpers import read_json


def test_burst(tmp_path: Path) -> None:
    """bench/burst.py on CPU: runs with and without decode rows, the burst's first tokens all
    within its span, decode tokens only where decode rows ran; an engine option reaches the
    engine (a bad one is the engine's error)."""
    bench = load_bench("burst")
    argv = ["--device", "cpu", "--model", "dummy:tiny", "--prompts", "40", "20",
            "--decode-rows", "2", "--decode-context", "8", "--decode-tokens", "400",
            "--repeats", "1", "--num-kv-blocks", "256", "--engine-option", "prefill_slice_layers=0",
            "--out", str(tmp_path)]  # fmt: skip
    bench.main(argv)
    data = read_json(tmp_path, "burst")
    res = data["results"]
    assert res["engine_options"] == {"prefill_slice_layers": 0}
    assert [r["decode_rows"] for r in res["runs"]] == [0, 2]
    for r in res["runs"]:
        assert len(r["ttft_ms"]) == 2 and max(r["ttft_ms"]) == pytest.approx(r["span_ms"])
        assert r["ms_per_1k_prompt_tokens"] == pytest.approx(r["span_ms"] * 1000 / 60)
    assert res["runs"][0]["decode_tokens_in_burst"] == 0
    assert res["runs"][1]["decode_tokens_in_burst"] > 0
    with pytest.raises(ValueError, match="prefill_slice_layers"):
        bench.main([*argv[:-4], "--engine-option", "prefill_slice_layers=-1",
                    "--out", str(tmp_path)])  # fmt: skip


def test_burst_trace_annotates_the_host_steps(tmp_path: Path) -> None:
    """bench/burst.py --profile --trace on CPU: the profiled bursts' traces are written, with
    the burst and the host's step parts as ranges (the GPU gaps need a GPU)."""
    bench = load_bench("burst")
    gg = load_bench("gpu_gaps")
    bench.main(["--device", "cpu", "--model", "dummy:tiny", "--prompts", "30", "--decode-rows",
                "1", "--decode-context", "8", "--decode-tokens", "400", "--repeats", "1",
                "--num-kv-blocks", "256", "--profile", "--trace", str(tmp_path / "traces"),
                "--out", str(tmp_path)])  # fmt: skip
    profiled = [r for r in read_json(tmp_path, "burst")["results"]["runs"] if r.get("profiled")]
    assert sorted(r["trace"] for r in profiled) == ["burst-trace-0-rows.json.gz",
                                                    "burst-trace-1-rows.json.gz"]  # fmt: skip
    trace = gg.load_trace(tmp_path / "traces" / "burst-trace-1-rows.json.gz")
    names = {e["name"] for e in trace["traceEvents"] if e.get("cat") == "user_annotation"}
    # on the event loop's thread (on CPU the step itself runs in a worker thread)
    assert {"burst", "LaneDispatcher.collect", "EngineCore.apply_step", "Scheduler.begin_step",
            "Scheduler.plan_prefill"} <= names  # fmt: skip
    with pytest.raises(SystemExit):
        bench.main(["--device", "cpu", "--trace", str(tmp_path), "--out", str(tmp_path)])


def test_burst_over_http(tmp_path: Path) -> None:
    """bench/burst.py --http against a real ``verifypd serve``: the same runs through the
    server's front (its settings recorded, the vocabulary read from its dummy preset), and the
    decode rows' disconnects leave nothing running on it."""
    cmd = verifypd_serve_command("--model", "dummy:tiny", "--device", "cpu",
                                 "--num-kv-blocks", "256", "--max-model-len", "256")  # fmt: skip
    bench = load_bench("burst")
    with start_server_process(cmd, timeout=120) as server:
        argv = ["--http", server.url, "--prompts", "40", "20", "--decode-rows", "2",
                "--decode-context", "8", "--decode-tokens", "200", "--repeats", "1",
                "--out", str(tmp_path)]  # fmt: skip
        bench.main(argv)
        with pytest.raises(SystemExit):  # an in-process option, refused over HTTP
            bench.main([*argv, "--engine-option", "prefill_slice_layers=0"])
        metrics = urllib.request.urlopen(f"{server.url}/metrics", timeout=10).read().decode()
        server.stop()
    res = read_json(tmp_path, "burst")["results"]
    assert res["http"] == server.url and res["vocab"] == 512
    assert res["server_info"]["engine_config"]["model"] == "dummy:tiny"
    assert [r["decode_rows"] for r in res["runs"]] == [0, 2]
    for r in res["runs"]:
        assert len(r["ttft_ms"]) == 2 and max(r["ttft_ms"]) == pytest.approx(r["span_ms"])
    assert res["runs"][0]["decode_tokens_in_burst"] == 0
    assert res["runs"][1]["decode_tokens_in_burst"] > 0
    running = [line for line in metrics.splitlines()
               if line.startswith("verifypd_num_requests_running")]  # fmt: skip
    assert running and float(running[0].split()[-1]) == 0.0


def test_burst_compare_draws_each_file(tmp_path: Path) -> None:
    bench = load_bench("burst")
    data = {"results": {"summary": {"0": {"span_ms": 200.0}, "32": {"span_ms": 250.0}}}}
    files = []
    for tag in ("a", "b"):
        path = tmp_path / f"burst-cpu-{tag}-abc1234.json"
        path.write_text(json.dumps(data))
        files.append(str(path))
    bench.main(["--compare", *files, "--out", str(tmp_path / "c.png")])
    assert (tmp_path / "c.png").stat().st_size > 1000
