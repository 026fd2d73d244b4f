"""bench/front_cost.py: the HTTP front's CPU time per streamed chunk, against a real server
around the fake engine, and the fake engine's own time measured alone."""

from __future__ import annotations

import os
import sys
import time

import pytest
from helpers import load_bench


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/<pid>/stat")
def test_process_cpu_seconds_from_proc() -> None:
    front = load_bench("front_cost")
    t0 = time.process_time()
    while time.process_time() - t0 < 0.3:  # burn CPU in this process
        pass
    assert front.cpu_seconds(os.getpid()) == pytest.approx(time.process_time(), abs=0.05)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/<pid>/stat")
def test_every_stream_and_chunk_is_counted(tmp_path) -> None:
    front = load_bench("front_cost")
    report = front.main(["--streams", "1,3", "--tokens", "6", "--idle-s", "0.2", "--out",
                         str(tmp_path), "--no-ceilings"])  # fmt: skip
    cases = report["results"]["cases"]
    assert [c["streams"] for c in cases] == [1, 3] and report["complete"]
    for c in cases:
        # one chunk per token (the fake engine emits one a step) and the closing chunk
        assert c["chunks"] == c["streams"] * 7
        assert c["engine_alone"]["tokens"] == c["streams"] * 6
        # (a run this short is within /proc's 10 ms CPU resolution: only bounds here)
        assert c["server_cpu_s"] >= 0 and 0 <= c["busy_share"] < 1
        assert c["front_cpu_per_chunk_us"] == pytest.approx(
            c["cpu_per_chunk_us"] - c["engine_alone"]["cpu_per_token_us"]
        )
    assert (tmp_path / "front_cost-cpu.json").exists()
