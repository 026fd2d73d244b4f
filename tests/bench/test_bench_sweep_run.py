"""The rate sweep of issue 14 run in process (bench/mixed.py --sweep): a tiny sweep end to end
on CPU (schema, identical traces in every mode, a fresh prefix cache before every run, process
counters, criteria, policy timeline and plots), --max-wall-s skipping the runs that would
overrun, and a run's policy view counted from its start."""

from __future__ import annotations

import itertools
import json
from collections import defaultdict
from pathlib import Path

import pytest
from helpers import load_bench
from sweep_helpers import ROW_KEYS, SWEEP_TINY, count_cache_resets

from verifypd.lanes.async_engine import AsyncEngine

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def test_tiny_sweep_end_to_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[int, list[tuple]] = defaultdict(list)  # engine -> what it was handed, in order
    inner = AsyncEngine.generate
    built = itertools.count()

    def generate(self, request_id, prompt, params):
        if not hasattr(self, "_test_order"):  # (an id() may be reused once an engine is freed)
            self._test_order = next(built)
        seen[self._test_order].append((request_id, tuple(prompt), params.max_tokens,
                               params.synthetic_acceptance))  # fmt: skip
        return inner(self, request_id, prompt, params)

    monkeypatch.setattr(AsyncEngine, "generate", generate)
    resets = count_cache_resets(monkeypatch)
    load_bench("mixed").main([*SWEEP_TINY, "--out", str(tmp_path), "--throwaway-engine"])
    assert resets == [0] * 12  # before every run, on an idle engine (no block in use)
    main = json.loads((tmp_path / "mixed-cpu-sweep.json").read_text())
    # the rows' diagnostics and the policy timeline are in the sidecar (bench/result_files.py)
    assert main["detail_file"] == "mixed-cpu-sweep.detail.json.gz" and "policy_timeline" not in main
    assert not any("slowest" in r for r in main["sweep"]) and len(main["sweep"]) == 12
    data = load_bench("result_files").load_result(tmp_path / "mixed-cpu-sweep.json")
    assert data["device"] == "cpu" and data["git_commit"] and data["complete"] is True
    assert data["params"]["num_kv_blocks"] == 256 and data["slo"]["ttft_ms"] == 300.0
    rows = data["sweep"]
    keys = {(r["rate"], r["acceptance_profile"], r["mode"]) for r in rows}
    assert len(rows) == len(keys) == 2 * 2 * 3
    for r in rows:
        assert ROW_KEYS <= set(r), ROW_KEYS - set(r)
        ladder = r["goodput_by_tpot_slo"]  # non-decreasing as the TPOT target loosens
        assert list(ladder) == [f"{y:g}" for y in load_bench("sweep").TPOT_SLO_LADDER_MS]
        assert list(ladder.values()) == sorted(ladder.values())
        assert ladder["15"] == r["goodput_rps"]  # the plan's TPOT target is on the ladder
        assert r["num_finished"] == r["num_requests"] > 0 and r["ttft_p99_ms"] > 0
        slow = r["slowest"]  # the p99's company, slowest first, with the profile's alpha
        assert set(slow) == {"ttft", "tpot"} and 1 <= len(slow["ttft"]) <= 4
        assert [x["ttft_ms"] for x in slow["ttft"]] == sorted(
            (x["ttft_ms"] for x in slow["ttft"]), reverse=True)  # fmt: skip
        assert all(x["alpha"] is not None and x["request_id"].startswith("req-")
                   for x in slow["ttft"] + slow["tpot"])  # fmt: skip
        # Fixed L always drafts; the policy may decide that speculation does not pay here.
        assert (r["num_drafted"] > 0) == (r["mode"] == "three-fixed") or r["mode"] == "policy"
    engines = {n: e["engine"] for n, e in data["sweep_engines"].items()}
    assert engines["off"]["num_kv_blocks"] == engines["policy"]["num_kv_blocks"] == 256
    assert (
        engines["policy"]["spec"]["policy"] == "goodput" and engines["policy"]["spec"]["controller"]
    )
    # Every mode got the identical trace: the same fingerprints (ids, arrivals, prompts,
    # alphas) and, as handed to each engine after its warm-up, the same requests in order.
    prints = defaultdict(set)
    for r in rows:
        prints[(r["rate"], r["acceptance_profile"])].add(r["trace_fingerprint"])
    assert all(len(p) == 1 for p in prints.values()) and len(prints) == 4
    throwaway, off, fixed, policy = (seen[k] for k in sorted(seen))  # built one by one
    # First the throwaway engine of the first mode: the warm-up, then the burn-in (another
    # trace at the first rate), nothing measured; then each measured engine: the warm-up and
    # the runs.
    kinds = lambda handed: [r[0].split("-")[0] for r in handed]  # noqa: E731
    assert kinds(throwaway) == ["warm"] + ["burn"] * (len(throwaway) - 1)
    assert len(throwaway) > 2 and data["throwaway_engine"]["mode"] == "off"
    # Each run's process counters (bench/process_counters.py): CPU, so collections, CPU
    # seconds and the host's shares (Linux), no allocator or GPU clocks.
    for where in [data["throwaway_engine"], *data["sweep_engines"].values(), *rows]:
        counts = where.get("process") or where["warmup_process"]
        assert set(counts) - {"host_busy_share", "host_steal_share"} == {
            "gc_collections_gen0", "gc_collections_gen1", "gc_collections_gen2", "gc_pause_ms",
            "gc_max_pause_ms", "cpu_s"}  # fmt: skip
        assert all(v >= 0 for v in counts.values())
    for handed in (off, fixed, policy):
        assert kinds(handed) == ["warm"] + ["req"] * 16
    sent = lambda reqs: [r[:3] for r in reqs if r[0].startswith("req-")]  # noqa: E731
    assert sent(off) == sent(fixed) == sent(policy) and len(sent(off)) == 2 * 2 * 4
    assert [r[3] for r in fixed] == [r[3] for r in policy]
    alphas = [r[3] for r in policy if r[0].startswith("req-")]
    assert all(a is None for r in off for a in [r[3]])  # off has no synthetic mode to send to
    plan = load_bench("sweep").SweepPlan.from_dict(data["sweep_config"])
    want = [plan.alphas(rate, p, 4) for rate in (20.0, 40.0) for p in ("uniform-0.8", "hetero")]
    assert alphas == [a for w in want for a in w] and want[0] == [0.8] * 4
    assert len(set(want[1] + want[3])) > 1  # hetero: mixed alphas (the check above can fail)
    assert {c["tpot_slo_ms"] for c in data["goodput_gain_by_tpot_slo"]} <= {3.0, 4.0, 5.0, 6.0,
                                                                         8.0, 10.0, 15.0, 20.0,
                                                                         30.0}  # fmt: skip
    assert len(data["goodput_gain_by_tpot_slo"]) == 9  # hetero, T = 0: one per target
    crit = data["criteria"]
    assert set(crit) == {"policy_within_5pct_of_best", "hetero_goodput_gain_15pct",
                         "light_load_tpot_p50_1p5x_off"}  # fmt: skip
    assert crit["policy_within_5pct_of_best"]["num_checks"] == 2 * 2 * 4
    assert all(c["verdict"] in ("PASS", "MISS") for c in crit.values())
    report = load_bench("sweep_report")
    stored = data["policy_timeline"]
    assert all("samples" not in t and len(t["values"][0]) == len(t["columns"]) for t in stored)
    timeline = [{**t, "samples": report.timeline_samples(t)} for t in stored]
    assert len(timeline) == 4 and all(t["mode"] == "policy" and t["samples"] for t in timeline)
    sample = timeline[0]["samples"][-1]  # with what the drafter was fed behind prompt steps
    assert sample["drafter_followed_tokens"] >= 0 and sample["drafter_follows_stopped"] == 0
    # counters of each run alone (the engine serves all four), no engine-life means; the last
    # sample is the run's end state (taken once it drained)
    assert all(t["samples"][-1]["num_steps"] > 0 for t in timeline)
    assert all(t["samples"][-1]["num_requests"] == 0 for t in timeline)
    assert all("cadence_spec_s" not in x for t in timeline for x in t["samples"])
    assert (tmp_path / "mixed-cpu-sweep-hetero-t0.0.png").is_file()
    assert (tmp_path / "mixed-cpu-sweep-policy.png").is_file()


def test_max_wall_skips_runs_that_would_overrun(tmp_path: Path) -> None:
    argv = [*SWEEP_TINY, "--out", str(tmp_path), "--max-wall-s", "5", "--run-seconds", "0"]
    argv[argv.index("off,three-fixed,policy")] = "off"
    argv[argv.index("20,40")] = "20,0.5"  # 4 requests at 0.5/s: estimated 12 s, over 5 s
    data = load_bench("mixed").main(argv)
    assert {r["rate"] for r in data["sweep"]} == {20.0} and len(data["sweep"]) == 2
    assert [(s["rate"], s["mode"]) for s in data["skipped"]] == [(0.5, "off")] * 2
    assert data["estimate_s"] > 0 and "throwaway_engine" not in data  # none by default
    assert data["criteria"]["policy_within_5pct_of_best"]["verdict"] == "N/A"


def test_a_runs_policy_view_counts_from_its_start():
    sweep = load_bench("mixed_sweep")
    base = {"num_steps": 100, "decisions_catch_up": 7, "decisions": {"speculate": 5, "no_gain": 2},
            "drafter_eager_steps": 3, "cadence_spec_steps": 40, "cadence_spec_s": 0.01,
            "num_requests": 4, "population_acceptance": 0.6, "num_fused": 90,
            "fused_fraction": 0.9}  # fmt: skip
    now = {"num_steps": 130, "decisions_catch_up": 9, "decisions": {"speculate": 25, "no_gain": 2},
           "drafter_eager_steps": 3, "cadence_spec_steps": 52, "cadence_spec_s": 0.011,
           "num_requests": 6, "population_acceptance": 0.7, "num_fused": 96,
           "fused_fraction": 96 / 130}  # fmt: skip
    out = sweep.since(now, base)
    assert sweep.run_view(lambda: now, base)() == out
    assert out == {"num_steps": 30, "decisions_catch_up": 2,
                   "decisions": {"speculate": 20, "no_gain": 0}, "drafter_eager_steps": 0,
                   "cadence_spec_steps": 12, "num_requests": 6,
                   "population_acceptance": 0.7, "num_fused": 6,
                   "fused_fraction": 0.2}  # fmt: skip
    # a run with no step yet has no share of its own
    assert sweep.since(base, base)["fused_fraction"] is None
