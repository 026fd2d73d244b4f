"""bench/results/ is sorted by topic: every benchmark writes into a topic folder that exists, and
no result file lies outside a topic folder."""

from __future__ import annotations

import sys

from verifypd.__main__ import bench_dir, bench_names

sys.path.insert(0, str(bench_dir()))
import common  # noqa: E402

RESULTS = bench_dir() / "results"


def test_every_benchmark_that_writes_results_has_a_topic() -> None:
    writers = [
        n
        for n in bench_names(bench_dir())
        if "result_path" in (bench_dir() / f"{n}.py").read_text()
    ]
    assert writers, "no benchmark writes results?"
    for name in writers:
        assert name in common.TOPICS, f"bench/{name}.py has no topic in common.TOPICS"


def test_result_files_live_in_topic_folders() -> None:
    topics = set(common.TOPICS.values())
    for path in RESULTS.rglob("*"):
        if path.is_file() and path.name != "README.md":
            rel = path.relative_to(RESULTS)
            assert rel.parts[0] in topics, f"{rel} is not in a topic folder"
            assert len(rel.parts) == 2 or rel.parts[1] == "history", rel


def test_default_output_goes_to_the_topic_folder() -> None:
    import torch

    path = common.result_path(None, "gemv", torch.device("cpu"), "json", "t")
    assert path == RESULTS / "kernels" / "gemv-cpu-t.json"
