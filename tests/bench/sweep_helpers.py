"""What the rate sweep's tests share (tests/bench/test_bench_sweep_*.py and the tests that run a
tiny sweep of their own): the tiny CPU sweep's arguments, the keys of a sweep row, a tiny
policy row, a recorder of prefix-cache resets, and a constructed row for the criteria and the
report."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import load_bench

from verifypd.kvcache.manager import KVCacheManager

ROW_KEYS = {"rate", "acceptance_profile", "temperature", "mode", "ttft_p99_ms", "itl_p99_ms",
            "tpot_p99_ms", "goodput_rps", "ttft_p50_ms", "itl_p95_ms", "tpot_p50_ms",
            "output_tok_s", "num_drafted", "num_accepted", "trace_fingerprint",
            "num_preemptions", "num_ahead_steps", "num_ahead_held", "num_deltas_ahead",
            "num_kernel_compiles", "num_decode_rows_fused", "ttft_p99_ci_ms",
            "itl_p99_ci_ms", "tpot_p99_ci_ms"}  # fmt: skip
SWEEP_TINY = ["--sweep", "--device", "cpu", "--model", "dummy:tiny", "--draft-model",
              "dummy:tiny", "--num-requests", "4", "--rates", "20,40", "--profiles",
              "uniform-0.8,hetero", "--temperatures", "0", "--modes", "off,three-fixed,policy",
              "--short-prompt-len", "8", "16", "--short-output-len", "4", "8",
              "--long-prompt-len", "40", "64", "--long-output-len", "2", "4",
              "--long-fraction", "0.34", "--warmup-requests", "1", "--max-num-seqs", "8",
              "--snapshot-interval", "0.005", "--num-kv-blocks", "256",
              "--no-ceilings"]  # fmt: skip


def tiny_policy_row(tmp_path: Path, *flags: str) -> dict:
    """The one row of a tiny CPU sweep of the policy (hetero, 20 req/s) run with ``flags``."""
    args = [*SWEEP_TINY, "--modes", "policy", "--rates", "20", "--profiles", "hetero"]
    load_bench("mixed").main([*args, *flags, "--out", str(tmp_path)])
    rows = load_bench("result_files").load_result(tmp_path / "mixed-cpu-sweep.json")["sweep"]
    assert len(rows) == 1
    return rows[0]


def count_cache_resets(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Records the blocks in use at each prefix-cache reset (a replayed trace must not find
    its prompts cached by the previous run)."""
    calls: list[int] = []
    inner = KVCacheManager.reset_prefix_cache

    def reset(self):
        inner(self)
        calls.append(self.num_blocks - self.num_free_blocks)

    monkeypatch.setattr(KVCacheManager, "reset_prefix_cache", reset)
    return calls


def _row(mode, rate, profile="hetero", ttft=100.0, itl=20.0, tpot=10.0, good=5.0, p50=8.0):
    return {"mode": mode, "rate": rate, "acceptance_profile": profile, "temperature": 0.0,
            "ttft_p99_ms": ttft, "itl_p99_ms": itl, "tpot_p99_ms": tpot, "goodput_rps": good,
            "tpot_p50_ms": p50}  # fmt: skip
