"""bench/peer_vllm.py on CPU (the verifypd side; vLLM runs only on the GPU machine): each part
runs on ``dummy:tiny`` and writes positive numbers, the HTTP step drives ``verifypd serve``
through ``bench/http_load.py``, and ``combine`` computes the advantage in the right direction."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import peer_report  # noqa: E402
import peer_vllm  # noqa: E402

TINY = ["--device", "cpu", "--model", "dummy:tiny", "--draft-model", "dummy:tiny",
        "--batches", "1", "2", "--decode-lens", "3", "6", "--prompt-len", "8", "--repeats", "1",
        "--offline-requests", "3", "--offline-lens", "4", "8", "--rates", "40",
        "--mixed-requests", "3", "--mix", "tiny", "--max-model-len", "256",
        "--num-kv-blocks", "128"]  # fmt: skip


def test_run_verifypd_parts(tmp_path: Path) -> None:
    parts = "decode,offline,mixed,spec-draft,spec-ngram"
    data = peer_vllm.main(["run", "--parts", parts, "--out", str(tmp_path), *TINY])
    res = data["result"]
    for part in parts.split(","):
        assert "error" not in res[part], res[part].get("error")
    for part in ("decode", "spec-draft", "spec-ngram"):
        rows = res[part]["decode"]
        assert [r["batch"] for r in rows] == [1, 2]
        assert all(r["decode_tok_s"] > 0 and r["t_long_s"] > 0 for r in rows)
    for front in ("async", "llm"):
        off = res["offline"][front]
        assert off["output_tokens"] == off["requested_tokens"] > 0
    (rate,) = res["mixed"]["rates"]
    assert rate["load"]["num_finished"] == 3 and rate["latency"]["ttft_ms"]["p99"] > 0
    assert res["spec-draft"]["spec_stats"]["verifies"] > 0
    files = list(tmp_path.glob("peer_vllm-cpu-verifypd-*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["meta"]["device"] == "cpu"


def test_http_step_drives_verifypd_serve(tmp_path: Path) -> None:
    argv = ["http", "--out", str(tmp_path), "--port", "0", *TINY]
    argv[argv.index("--port") + 1] = str(_free_port())
    data = peer_vllm.main(argv)
    (rate,) = data["result"]["rates"]
    load = rate["load"]
    assert load["num_finished"] == 3 and load["num_errors"] == 0
    # every request's tokens are counted, from the chunks or the final usage
    assert load["output_tokens"] == load["requested_output_tokens"]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ratio_rows_direction() -> None:
    ours = {
        "verifypd": {"decode": {"decode": [{"batch": 1, "decode_tok_s": 120.0}]},
                     "offline": {"async": {"output_tok_s": 50.0}, "llm": {"output_tok_s": 80.0}},
                     "mixed": {"rates": [{"rate": 2.0, "goodput_rps": 1.0,
                                          "latency": {"ttft_ms": {"p50": 10.0, "p99": 40.0}}}]}},
        "vllm": {"decode": {"decode": [{"batch": 1, "decode_tok_s": 100.0}]},
                 "offline": {"async": {"output_tok_s": 100.0}},
                 "mixed": {"rates": [{"rate": 2.0, "goodput_rps": 2.0,
                                      "latency": {"ttft_ms": {"p50": 20.0, "p99": 20.0}}}]}},
    }  # fmt: skip
    rows = {r["what"]: r for r in peer_report.ratio_rows(ours, {})}
    assert rows["decode batch 1"]["advantage"] == pytest.approx(1.2)  # higher tok/s wins
    assert rows["offline 256 req"]["verifypd"] == 80.0  # our best front
    assert rows["offline 256 req"]["advantage"] == pytest.approx(0.8)
    assert rows["mixed in-process 2 req/s ttft p50"]["advantage"] == pytest.approx(2.0)  # lower ms
    assert rows["mixed in-process 2 req/s ttft p99"]["advantage"] == pytest.approx(0.5)
    assert rows["mixed in-process 2 req/s goodput"]["advantage"] == pytest.approx(0.5)
    assert rows["decode batch 64"]["advantage"] is None  # missing on both sides


def test_api_cost_variants_run(tmp_path: Path) -> None:
    """bench/api_cost.py: every variant (log-probs, a regex grammar over the word-level
    tokenizer it writes, both) runs through the lanes and yields a positive step time."""
    import api_cost

    argv = ["--device", "cpu", "--model", "dummy:tiny", "--batches", "1", "2", "--lens", "2",
            "5", "--prompt-len", "8", "--repeats", "1", "--max-model-len", "256",
            "--out", str(tmp_path)]  # fmt: skip
    data = api_cost.main(argv)
    variants = data["result"]["variants"]
    assert set(variants) == set(api_cost.VARIANTS)
    for name, rows in variants.items():
        assert isinstance(rows, list), f"{name}: {rows}"
        assert [r["batch"] for r in rows] == [1, 2] and all(r["step_ms"] > 0 for r in rows)
    assert data["result"]["engine"]["model"] == "dummy:tiny"
