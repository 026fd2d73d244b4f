"""The rate sweep of issue 14 (bench/mixed.py --sweep, bench/sweep.py, bench/sweep_criteria.py,
bench/sweep_report.py): a tiny sweep end to end on CPU (schema, identical traces in every mode,
criteria), the plan's traces and profiles, and the criteria / vLLM merge on constructed rows (a
miss shows MISS)."""

from __future__ import annotations

import itertools
import json
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers import load_bench, start_server_process, verifypd_serve_command

from verifypd.kvcache.manager import KVCacheManager
from verifypd.lanes.async_engine import AsyncEngine
from verifypd.types import SamplingParams

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


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def tiny_policy_row(tmp_path: Path, *flags: str) -> dict:
    """The one row of a tiny CPU sweep of the policy (hetero, 20 req/s) run with ``flags``."""
    args = [*SWEEP_TINY, "--modes", "policy", "--rates", "20", "--profiles", "hetero"]
    load_bench("mixed").main([*args, *flags, "--out", str(tmp_path)])
    rows = load_bench("result_files").load_result(tmp_path / "mixed-cpu-sweep.json")["sweep"]
    assert len(rows) == 1
    return rows[0]


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
    # Each run's process counters (bench/process_counters.py): CPU, so collections only.
    for where in [data["throwaway_engine"], *data["sweep_engines"].values(), *rows]:
        counts = where.get("process") or where["warmup_process"]
        assert set(counts) == {"gc_collections_gen0", "gc_collections_gen1",
                               "gc_collections_gen2", "gc_pause_ms", "gc_max_pause_ms"}  # fmt: skip
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


def _plan(sweep, **kw):
    mix = sweep.Mix((8, 16), (4, 8), (40, 64), (2, 4), 0.25)
    base = dict(mix=mix, vocab=512, seed=3, rates=(5.0, 10.0), profiles=("hetero", "uniform-0.6"),
                temperatures=(0.0,), num_requests=3000, run_seconds=0.0, drain_timeout=1.0,
                slo_ttft_ms=100.0, slo_tpot_ms=10.0)  # fmt: skip
    return sweep.SweepPlan(**{**base, **kw})


def test_goodput_at_each_tpot_target_of_the_ladder() -> None:
    sweep = load_bench("sweep")
    plan = SimpleNamespace(slo_ttft_ms=300.0, slo_tpot_ms=15.0)

    def trace(ttft_s: float, tpot_s: float):
        return SimpleNamespace(finish_reason="length", ttft_s=ttft_s, tpot_s=tpot_s)

    traces = [trace(0.1, 0.0035), trace(0.1, 0.0045), trace(0.1, 0.012), trace(0.5, 0.003)]
    assert sweep.goodput(traces, 2.0, plan) == (1.5, 3)  # the stated SLO: TTFT 300, TPOT 15
    assert sweep.goodput(traces, 2.0, plan, 4.0) == (0.5, 1)
    assert sweep.goodput(traces, 2.0, plan, 3.0) == (0.0, 0)  # the 3 ms one is past 300 ms
    crit = load_bench("sweep_criteria")
    ladder = lambda mode, rate, **g: {**_row(mode, rate), "goodput_by_tpot_slo": g}  # noqa: E731
    rows = [ladder("off", 2, **{"4": 1.0, "15": 2.0}), ladder("policy", 2, **{"4": 1.6, "15": 2.0}),
            ladder("three-fixed", 2, **{"4": 1.2, "15": 1.9}),
            ladder("off", 8, **{"4": 2.0, "15": 8.0}), ladder("policy", 8, **{"4": 2.1, "15": 7.0}),
            ladder("policy-x", 8, **{"4": 9.0, "15": 9.0})]  # fmt: skip
    got = {c["tpot_slo_ms"]: c for c in crit.goodput_gain_by_tpot_slo(rows)}
    assert set(got) == {4.0, 15.0}
    assert got[4.0]["rate"] == 2 and got[4.0]["best_mode"] == "three-fixed"  # not policy-x
    assert got[4.0]["gain"] == pytest.approx(1.6 / 1.2 - 1) and got[4.0]["ok"]
    assert got[15.0]["gain"] == pytest.approx(0.0) and not got[15.0]["ok"]  # its best rate, 2
    lines = crit.goodput_ladder_lines(list(got.values()))
    assert lines[0].startswith("  +15% T=0 TPOT <= 4 ms: +33% at 2 req/s")
    assert crit.goodput_gain_by_tpot_slo([_row("off", 2), _row("policy", 2)]) == []


def test_plan_traces_and_profiles() -> None:
    sweep = load_bench("sweep")
    plan = _plan(sweep)
    again = sweep.SweepPlan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert again.to_dict() == plan.to_dict()  # (Mix: load_bench imports its own loadgen)
    a, b = plan.requests(5.0), again.requests(5.0)
    assert [(r.arrival_s, r.prompt) for r in a] == [(r.arrival_s, r.prompt) for r in b]
    assert [r.prompt for r in plan.requests(10.0)] != [r.prompt for r in a]
    hetero = plan.alphas(5.0, "hetero", 3000)
    assert hetero == again.alphas(5.0, "hetero", 3000)
    shares = {x: hetero.count(x) / 3000 for x in (0.9, 0.6, 0.2)}
    assert abs(shares[0.9] - 0.3) < 0.04 and abs(shares[0.6] - 0.4) < 0.04
    assert abs(shares[0.2] - 0.3) < 0.04 and sum(shares.values()) == 1
    assert plan.alphas(5.0, "uniform-0.6", 5) == [0.6] * 5
    bounded = _plan(sweep, run_seconds=2.0).requests(5.0)
    assert 0 < len(bounded) < 30 and all(r.arrival_s <= 2.0 for r in bounded)
    with pytest.raises(ValueError, match="profiles"):
        _plan(sweep, profiles=("uniform-0.5",))


def test_the_burn_in_is_another_trace_at_the_first_rate() -> None:
    sweep = load_bench("sweep")
    assert _plan(sweep).burn_in() is None
    plan = _plan(sweep, burn_in_s=2.0)
    burn = plan.burn_in()
    assert burn.rates == (5.0,) and burn.run_seconds == 2.0 and burn.burn_in_s == 0.0
    reqs, first = burn.requests(5.0), plan.requests(5.0)
    assert 0 < len(reqs) < 30 and all(r.arrival_s <= 2.0 for r in reqs)
    assert all(r.request_id.startswith("burn-") for r in reqs)
    assert [r.prompt for r in reqs] != [r.prompt for r in first[: len(reqs)]]  # another seed
    assert plan.requests(5.0)[0].request_id == "req-0"  # the measured trace is unchanged
    assert [(r.arrival_s, r.prompt) for r in first] == [
        (r.arrival_s, r.prompt) for r in _plan(sweep).requests(5.0)
    ]
    assert plan.estimate_s(2) == pytest.approx(_plan(sweep).estimate_s(2) + 2.0 + 4.0)  # once
    assert plan.estimate_s(2, with_burn_in=False) == pytest.approx(_plan(sweep).estimate_s(2))
    again = sweep.SweepPlan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert again.burn_in() == burn
    old = {k: v for k, v in plan.to_dict().items() if k not in ("burn_in_s", "id_prefix")}
    assert sweep.SweepPlan.from_dict(old).burn_in() is None  # results written before it


def _row(mode, rate, profile="hetero", ttft=100.0, itl=20.0, tpot=10.0, good=5.0, p50=8.0):
    return {"mode": mode, "rate": rate, "acceptance_profile": profile, "temperature": 0.0,
            "ttft_p99_ms": ttft, "itl_p99_ms": itl, "tpot_p99_ms": tpot, "goodput_rps": good,
            "tpot_p50_ms": p50}  # fmt: skip


def test_criteria_on_constructed_rows() -> None:
    sweep = load_bench("sweep_criteria")
    rows = [_row("off", 2, p50=12.0), _row("three-fixed", 2, itl=18.0),
            _row("policy", 2, itl=18.5, good=5.9, p50=7.0),
            _row("off", 8, good=4.0), _row("three-fixed", 8, good=4.2),
            _row("policy", 8, ttft=104.0, good=4.0)]  # fmt: skip
    crit = sweep.criteria(rows)
    within = crit["policy_within_5pct_of_best"]
    assert within["verdict"] == "PASS" and within["num_checks"] == 8
    gain = crit["hetero_goodput_gain_15pct"]  # 5.9 / 5.0 = +18 % at rate 2
    assert gain["verdict"] == "PASS" and gain["checks"][0]["rate"] == 2
    light = crit["light_load_tpot_p50_1p5x_off"]  # 12 / 7 = 1.71x
    assert light["verdict"] == "PASS" and light["checks"][0]["speedup"] == pytest.approx(12 / 7)
    rows[5]["itl_p99_ms"] = 21.1  # 5.5 % behind the best (20.0): a miss
    rows[2]["goodput_rps"] = 5.7  # +14 % only
    rows[0]["tpot_p50_ms"] = 10.0  # 1.43x only
    crit = sweep.criteria(rows)
    assert [c["verdict"] for c in crit.values()] == ["MISS"] * 3
    (miss,) = [c for c in crit["policy_within_5pct_of_best"]["checks"] if not c["ok"]]
    assert (miss["rate"], miss["metric"], miss["best_mode"]) == (8, "itl_p99_ms", "off")
    lines = sweep.criteria_lines(crit)
    assert sum(line.startswith("MISS") for line in lines) == 3
    assert any("metric=itl_p99_ms" in line and "MISS" in line for line in lines)
    assert sweep.criteria([_row("off", 2)])["hetero_goodput_gain_15pct"]["verdict"] == "N/A"
    assert "num_clear_misses" not in crit["policy_within_5pct_of_best"]  # rows without intervals
    # A policy variant is judged on its own against the non-policy modes, and does not count
    # as a rival of ``policy``.
    tight = [_row("policy-tight", 2, itl=10.0, good=5.0, p50=6.0)]
    assert sweep.policy_variants(rows + tight) == ["policy-tight"]
    assert sweep.criteria(rows + tight) == crit
    crit_tight = sweep.criteria(rows + tight, "policy-tight")
    assert crit_tight["light_load_tpot_p50_1p5x_off"]["checks"][0]["speedup"] == 10.0 / 6.0


def test_merge_with_vllm_and_http(tmp_path: Path) -> None:
    report = load_bench("sweep_report")
    ours = {
        "device": "GPU",
        "git_commit": "abc",
        "command": "python bench/mixed.py --sweep",
        "sweep": [
            {**_row("off", 2), "slowest": {"ttft": [{"request_id": "r1"}]}},
            _row("policy", 2, ttft=90.0, itl=15.0, tpot=8.0),
            _row("off", 8),
            _row("policy", 8, ttft=120.0, itl=15.0, tpot=8.0),
        ],
    }
    vllm = {
        "command": "python bench/peer_vllm.py sweep",
        "sweep": [{**_row("vllm", 2), "engine_steps": [{"t_ms": 1.0}]}, _row("vllm", 8)],
    }
    http = {"command": "python bench/mixed.py --sweep --http",
            "sweep": [_row("policy", 2, ttft=80.0, itl=19.0, tpot=9.0)]}  # fmt: skip
    off = {**ours, "sweep": [r for r in ours["sweep"] if r["mode"] == "off"]}  # one mode per run
    pol = {
        **ours,
        "sweep": [r for r in ours["sweep"] if r["mode"] == "policy"],
        "policy_timeline": [{"mode": "policy", "rate": 2, "acceptance_profile": "hetero",
                             "temperature": 0.0,
                             "samples": [{"t_s": 0.0, "mean_draft_len": 2.0}]}],
    }  # fmt: skip
    paths = []
    for name, data in (("off", off), ("pol", pol), ("vllm", vllm), ("http", http)):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(data))
    out = tmp_path / "merged.json"
    merged = report.main([str(paths[0]), str(paths[1]), "--vllm", str(paths[2]), "--http",
                          str(paths[3]), "--out", str(out)])  # fmt: skip
    assert len(merged["sweep"]) == 4 + 2 + 1
    written = json.loads(out.read_text())
    assert written["device"] == "GPU" and merged["git_commit"] == "abc"
    # the timeline stays in the run's own JSON; the report names that file
    assert "policy_timeline" not in written
    assert written["policy_timeline_in"] == ["off.json", "pol.json"]
    assert merged["policy_timeline"][0]["rate"] == 2
    assert {r["mode"] for r in merged["sweep"]} == {"off", "policy", "vllm", "http:policy"}
    ahead = merged["criteria"]["policy_ahead_of_vllm"]
    assert ahead["verdict"] == "MISS" and ahead["num_misses"] == 1  # TTFT 120 > 100 at 8/s
    assert [c["ok"] for c in ahead["checks"]] == [True, False]
    assert merged["criteria"]["http_policy_ahead_of_vllm"]["verdict"] == "PASS"
    assert merged["criteria"]["http_policy_ahead_of_vllm"]["vllm_front"] == "in-process"
    lines = report.report_lines(merged)
    assert any(line.startswith("MISS policy ahead of vLLM (in-process)") for line in lines)
    assert any("MISS hetero t=0.0 rate=8: ttft 120.0 vs 100.0" in line for line in lines)
    assert (tmp_path / "merged-hetero-t0.0.png").is_file()
    # the rows' diagnostics stay in the runs' files (vLLM's engine steps, the slowest requests)
    assert not any("engine_steps" in r or "slowest" in r for r in written["sweep"])
    assert [r["ttft_p99_ms"] for r in written["sweep"]] == [
        r["ttft_p99_ms"] for r in merged["sweep"]
    ]
    # one run alone: the report adds no rows, so no plots (the run has the same ones)
    report.main([str(paths[1]), "--out", str(tmp_path / "alone.json")])
    assert (tmp_path / "alone.json").is_file() and not list(tmp_path.glob("alone*.png"))
    # one run with HTTP rows: the rate plots gain rows, the policy's timeline is the run's own
    report.main([str(paths[1]), "--http", str(paths[3]), "--out", str(tmp_path / "one.json")])
    assert (tmp_path / "one-hetero-t0.0.png").is_file()
    assert not (tmp_path / "one-policy.png").exists()
    # an HTTP sitting alone: no in-process rows, the HTTP policy judged against vLLM's server
    vllm_http = {"command": "python bench/mixed.py --sweep --http", "git_commit": "def",
                 "sweep": [_row("vllm-http", 2, ttft=85.0, itl=20.0, tpot=9.5)]}  # fmt: skip
    (tmp_path / "vllm-http.json").write_text(json.dumps(vllm_http))
    sitting = report.main(["--http", str(paths[3]), str(tmp_path / "vllm-http.json"),
                           "--out", str(tmp_path / "sitting.json")])  # fmt: skip
    assert {r["mode"] for r in sitting["sweep"]} == {"http:policy", "http:vllm-http"}
    judged = sitting["criteria"]["http_policy_ahead_of_vllm"]
    assert judged["verdict"] == "PASS" and judged["vllm_front"] == "http"
    assert sitting["git_commit"] is None  # the first HTTP run's (none given here)
    with pytest.raises(SystemExit):
        report.main([])
    # a server run under another --mode-label, read as a policy variant by --label
    http["sweep"][0]["mode"] = "ours-ep"
    paths[3].write_text(json.dumps(http))
    args = [str(paths[1]), "--vllm", str(paths[2]), "--http", str(paths[3])]
    unread = report.main([*args, "--out", str(tmp_path / "unread.json")])
    assert "http_variants_ahead_of_vllm" not in unread["criteria"]
    read = report.main([*args, "--label", "ours-ep=policy-http-proc", "--out",
                        str(tmp_path / "read.json")])  # fmt: skip
    assert read["criteria"]["http_variants_ahead_of_vllm"]["policy-http-proc"]["verdict"] == "PASS"
    assert {r.get("mode_label") for r in read["sweep"] if r["mode"].startswith("http:")} == {
        "ours-ep"
    }
    with pytest.raises(SystemExit):
        report.main([*args, "--label", "ours-ep"])
    assert (tmp_path / "merged-policy.png").is_file()  # two runs' timelines joined
    none = report.ahead_of_vllm(ours["sweep"], [])
    assert none["verdict"] == "N/A"
    with pytest.raises(ValueError, match="different sweep plans"):
        report.join_ours([{**off, "sweep_config": {"rates": [1]}}, pol])


def test_the_vllm_comparison_says_which_leads_are_clear_of_the_intervals() -> None:
    report = load_bench("sweep_report")
    ci = lambda ttft, itl, tpot: {"ttft_p99_ci_ms": ttft, "itl_p99_ci_ms": itl,  # noqa: E731
                                  "tpot_p99_ci_ms": tpot}  # fmt: skip
    ours = [{**_row("policy", 2, ttft=120.0, itl=11.0, tpot=9.5),
             **ci([90.0, 130.0], [10.0, 12.0], [9.0, 10.0])},
            _row("policy", 8)]  # fmt: skip
    theirs = [{**_row("vllm", 2, ttft=100.0, itl=15.0, tpot=7.5),
               **ci([95.0, 105.0], [14.0, 16.0], [7.0, 8.0])},
              _row("vllm", 8, ttft=110.0, itl=25.0, tpot=12.0)]  # fmt: skip
    block = report.ahead_of_vllm(ours, theirs)
    first, second = block["checks"]
    # behind on TTFT within the intervals; ahead on ITL and behind on TPOT, both clear
    assert [first[m]["clear"] for m in ("ttft_p99_ms", "itl_p99_ms", "tpot_p99_ms")] == [
        False, True, True]  # fmt: skip
    assert "clear" not in second["ttft_p99_ms"] and second["ok"]  # rows without intervals
    assert (block["num_weighed"], block["num_clearly_ahead"], block["num_clearly_behind"]) == (
        3, 1, 1)  # fmt: skip
    lines = report.vllm_lines(block, "vLLM")
    assert "1 clearly ahead, 1 clearly behind" in lines[0]
    assert "ttft 120.0 vs 100.0, itl 11.0 vs 15.0*, tpot 9.5 vs 7.5*" in lines[1]
    plain = report.ahead_of_vllm([_row("policy", 8)], theirs)
    assert "num_weighed" not in plain and "clearly" not in report.vllm_lines(plain, "vLLM")[0]


def test_repeat_spread_of_two_runs_of_one_plan(tmp_path: Path) -> None:
    """Two runs of the same plan: the relative spread per metric over the cells both have,
    and the share of cells beyond the criteria's 5 %; a repeat of another plan is refused."""
    sweep, report = load_bench("sweep_criteria"), load_bench("sweep_report")
    a = [_row("off", 2, itl=10.0, ttft=100.0), _row("policy", 2, itl=10.0, ttft=100.0),
         _row("off", 8, itl=20.0, ttft=100.0)]  # fmt: skip
    b = [_row("off", 2, itl=10.4, ttft=100.0), _row("policy", 2, itl=13.0, ttft=100.0),
         _row("three-fixed", 8)]  # a cell only one run has: not compared  # fmt: skip
    spread = sweep.repeat_spread(a, b)
    itl = spread["itl_p99_ms"]
    assert itl["cells"] == 2 and itl["share_above_tol"] == 0.5
    assert itl["max"] == pytest.approx(0.3) and itl["median"] == pytest.approx(0.17)
    assert spread["ttft_p99_ms"]["share_above_tol"] == 0.0
    assert any("itl_p99_ms: 50% of 2 cells" in line for line in sweep.spread_lines(spread))
    plan = {"rates": [2, 8]}
    paths = []
    for name, rows, cfg in (("a", a, plan), ("b", b, plan), ("c", b, {"rates": [5]})):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps({"sweep": rows, "sweep_config": cfg, "command": name}))
    merged = report.main([str(paths[0]), "--repeat", str(paths[1]),
                          "--out", str(tmp_path / "m.json")])  # fmt: skip
    assert merged["repeat_spread"]["itl_p99_ms"]["cells"] == 2
    assert merged["repeat_misses"]["misses"] == 0  # the policy misses nothing in run a
    assert merged["sources"]["repeat"] == "b"
    with pytest.raises(SystemExit):
        report.main([str(paths[0]), "--repeat", str(paths[2]), "--out", str(tmp_path / "n.json")])


def test_slowest_requests_are_the_p99s_company() -> None:
    """The slowest requests by TTFT and by TPOT (5 %, at least 3), slowest first, each with
    its profile alpha; requests without a TPOT (one token, unfinished) are left out there."""
    sweep, loadgen = load_bench("sweep"), load_bench("loadgen")
    traces = []
    for i in range(40):  # TTFT grows with i, TPOT falls with it
        t = loadgen.Trace(f"req-{i}", "short", 10 + i, 8, arrival=0.0)
        t.deltas = [(0.01 * (i + 1), 1), (0.01 * (i + 1) + 0.001 * (50 - i), 3)]
        t.finish_time, t.finish_reason = t.deltas[-1][0], "length"
        traces.append(t)
    traces[0].finish_time = None  # unfinished: no TPOT
    alpha_of = {f"req-{i}": 0.2 if i % 2 else 0.9 for i in range(40)}
    slow = sweep.slowest_requests(traces, alpha_of, t_start=-0.5)
    assert [x["request_id"] for x in slow["ttft"]] == ["req-39", "req-38", "req-37"]
    assert [x["request_id"] for x in slow["tpot"]] == ["req-1", "req-2", "req-3"]
    first = slow["tpot"][0]
    assert first["alpha"] == 0.2 and first["prompt_len"] == 11 and first["num_output"] == 4
    assert first["tpot_ms"] == pytest.approx(49 / 3, abs=1e-3)  # kept to the microsecond
    assert first["max_gap_ms"] == pytest.approx(49)
    # every delta of the TPOT ones, ms from the arrival, and the arrival from the run's start
    assert first["deltas_ms"] == [[20.0, 1], [69.0, 3]]
    assert first["arrival_ms"] == pytest.approx(500.0)
    assert "deltas_ms" not in slow["ttft"][0]
    many = sweep.slowest_requests(traces * 3, alpha_of)  # 120 requests: 5 % is 6
    assert len(many["ttft"]) == 6


def test_tpot_by_alpha_class() -> None:
    """Per acceptance class, the finished requests with a TPOT and their TPOT p50 / p99: an
    unfinished request, a one-token one and a request without a class are left out; classes
    come highest α first."""
    sweep, loadgen = load_bench("sweep"), load_bench("loadgen")
    traces = []
    for i in range(9):  # TPOT i + 1 ms; classes 0.9 (i < 3), 0.6 (3 <= i < 6), 0.2
        t = loadgen.Trace(f"req-{i}", "short", 10, 4, arrival=0.0)
        t.deltas = [(0.01, 1), (0.01 + 0.003 * (i + 1), 3)]
        t.finish_time, t.finish_reason = t.deltas[-1][0], "length"
        traces.append(t)
    traces[8].finish_reason = "error"  # not finished: left out
    one = loadgen.Trace("req-one", "short", 10, 1, arrival=0.0)
    one.deltas, one.finish_time, one.finish_reason = [(0.01, 1)], 0.01, "length"
    alpha_of = {f"req-{i}": (0.9, 0.6, 0.2)[i // 3] for i in range(9)} | {"req-one": 0.2}
    by = sweep.tpot_by_alpha([*traces, one, loadgen.Trace("req-x", "short", 1, 4, 0.0)], alpha_of)
    assert list(by) == ["0.9", "0.6", "0.2"]
    assert by["0.9"]["num"] == 3 and by["0.9"]["tpot_p50_ms"] == pytest.approx(2.0)
    assert by["0.6"]["tpot_p50_ms"] == pytest.approx(5.0)
    assert by["0.2"]["num"] == 2 and by["0.2"]["tpot_p50_ms"] == pytest.approx(7.5)
    assert by["0.2"]["tpot_p99_ms"] == pytest.approx(7.99)
    # The light-load check gives off's TPOT p50 over the policy's per class both rows have.
    crit = load_bench("sweep_criteria")
    off, pol = _row("off", 2, p50=4.0), _row("policy", 2, p50=3.2)
    off["tpot_by_alpha"] = {"0.9": {"tpot_p50_ms": 4.0}, "0.6": {"tpot_p50_ms": 4.2}}
    pol["tpot_by_alpha"] = {"0.9": {"tpot_p50_ms": 2.0}, "0.6": {"tpot_p50_ms": 3.0},
                            "0.2": {"tpot_p50_ms": 4.4}}  # fmt: skip
    (check,) = crit.criteria([off, pol])["light_load_tpot_p50_1p5x_off"]["checks"]
    assert check["speedup_by_alpha"] == {"0.9": 2.0, "0.6": 1.4}
    assert "speedup_by_alpha" not in crit.light_load_tpot([_row("off", 2), _row("policy", 2)])[
        "checks"][0]  # fmt: skip


def test_misses_replicated_in_a_repeat() -> None:
    """A within-5 % miss counts as replicated only where the repeat misses the same check; a
    policy variant's rows are not among the modes the policy is judged against."""
    sweep = load_bench("sweep_criteria")
    a = [_row("off", 2, itl=10.0), _row("policy", 2, itl=12.0),  # ITL miss in both runs
         _row("off", 8, tpot=10.0), _row("policy", 8, tpot=11.0),  # TPOT miss in a only
         _row("policy-yield", 8, tpot=5.0)]  # fmt: skip
    b = [_row("off", 2, itl=10.0), _row("policy", 2, itl=11.0),
         _row("off", 8, tpot=10.0), _row("policy", 8, tpot=10.2)]  # fmt: skip
    rep = sweep.replicated_misses(a, b)
    assert (rep["misses"], rep["replicated"]) == (2, 1)
    by_metric = {m["metric"]: m for m in rep["checks"]}
    assert by_metric["itl_p99_ms"]["replicated"] and by_metric["itl_p99_ms"]["rate"] == 2
    assert by_metric["itl_p99_ms"]["repeat_ratio"] == pytest.approx(1.1)
    assert not by_metric["tpot_p99_ms"]["replicated"]
    lines = sweep.replicated_lines(rep)
    assert lines[0] == "misses replicated in the repeat: 1 of 2" and len(lines) == 2
    assert "itl_p99_ms: 1.20 and 1.10" in lines[1]


def test_http_policy_against_vllm_server_rows() -> None:
    """With vLLM's server driven by the same client, the HTTP policy rows are judged against
    those rows (labels ``policy-http`` / ``vllm-http``), not against in-process vLLM."""
    report = load_bench("sweep_report")
    ours = {"sweep": [_row("policy", 2)]}
    vllm = [{"sweep": [_row("vllm", 2, ttft=500.0, itl=50.0, tpot=50.0)]}]  # beaten in-process
    http = [{"sweep": [_row("policy-http", 2, ttft=80.0, itl=19.0, tpot=9.0),
                       _row("vllm-http", 2, ttft=70.0, itl=25.0, tpot=10.0)]}]  # fmt: skip
    merged = report.merge(ours, vllm, http)
    crit = merged["criteria"]["http_policy_ahead_of_vllm"]
    assert crit["vllm_front"] == "http" and crit["verdict"] == "MISS"
    assert crit["checks"][0]["ttft_p99_ms"] == {"policy": 80.0, "vllm": 70.0}
    assert any("HTTP policy rows vs http" in line for line in report.report_lines(merged))
    # A variant of our server (e.g. --engine-process) is judged on its own, beside it.
    http[0]["sweep"].append(_row("policy-http-proc", 2, ttft=60.0, itl=19.0, tpot=9.0))
    merged = report.merge(ours, vllm, http)
    variant = merged["criteria"]["http_variants_ahead_of_vllm"]["policy-http-proc"]
    assert variant["verdict"] == "PASS" and variant["checks"][0]["ttft_p99_ms"]["policy"] == 60.0
    assert merged["criteria"]["http_policy_ahead_of_vllm"]["verdict"] == "MISS"
    lines = report.report_lines(merged)
    assert any("HTTP policy-http-proc rows vs http" in line for line in lines)


def test_engine_process_rows_are_judged_against_their_own_front() -> None:
    """``policy-proc`` (``--engine-process``) is judged against ``off-proc`` and the other
    ``-proc`` modes, the in-process ``policy`` against the in-process modes only; the merged
    report carries each variant's criteria and prints them."""
    sweep, report = load_bench("sweep_criteria"), load_bench("sweep_report")
    rows = [_row("off", 2, itl=5.0, p50=4.0), _row("policy", 2, itl=5.1, p50=2.0),
            _row("off-proc", 2, itl=9.0, p50=8.0), _row("policy-proc", 2, itl=9.2, p50=4.0),
            _row("policy-proc", 8), _row("off-proc", 8, ttft=90.0)]  # fmt: skip
    assert sweep.front_of("policy-proc") == "-proc" and sweep.front_of("off") == ""
    mine = sweep.criteria(rows)  # against off (5.0), not off-proc's 9.0
    assert mine["policy_within_5pct_of_best"]["verdict"] == "PASS"
    assert {c["best_mode"] for c in mine["policy_within_5pct_of_best"]["checks"]} == {"off"}
    assert mine["light_load_tpot_p50_1p5x_off"]["checks"][0]["speedup"] == 2.0
    proc = sweep.criteria(rows, "policy-proc")
    within = proc["policy_within_5pct_of_best"]
    assert {c["best_mode"] for c in within["checks"]} == {"off-proc"}
    (miss,) = [c for c in within["checks"] if not c["ok"]]  # TTFT 100 against 90 at 8 req/s
    assert (miss["rate"], miss["metric"]) == (8, "ttft_p99_ms")
    light = proc["light_load_tpot_p50_1p5x_off"]
    assert light["checks"][0]["off_tpot_p50_ms"] == 8.0 and light["verdict"] == "PASS"
    lone = sweep.criteria([_row("policy-proc", 2), _row("off", 2)], "policy-proc")
    assert lone["light_load_tpot_p50_1p5x_off"]["reason"].endswith("'off-proc'")
    merged = report.merge({"sweep": rows}, [], [])
    assert merged["criteria_variants"]["policy-proc"] == proc
    lines = report.report_lines(merged)
    at = lines.index("policy-proc:")
    assert lines[at + 1].startswith("  MISS policy_within_5pct_of_best: 7/8 checks ok")
    assert "criteria_variants" not in report.merge({"sweep": rows[:2]}, [], [])


def test_in_process_policy_variants_against_vllm() -> None:
    """Each in-process ``policy-NAME`` mode (e.g. the backlog lift, ``policy-burst``) is judged
    against vLLM on its own, beside the policy; without vLLM rows, none is."""
    report = load_bench("sweep_report")
    ours = {"sweep": [_row("off", 14), _row("policy", 14, ttft=121.0, itl=22.0, tpot=8.0),
                      _row("policy-burst", 14, ttft=94.0, itl=25.0, tpot=8.0)]}  # fmt: skip
    vllm = [{"sweep": [_row("vllm", 14, ttft=100.0, itl=32.0, tpot=9.0)]}]
    merged = report.merge(ours, vllm, [])
    assert merged["criteria"]["policy_ahead_of_vllm"]["verdict"] == "MISS"  # TTFT 121 > 100
    variant = merged["criteria"]["variants_ahead_of_vllm"]["policy-burst"]
    assert variant["verdict"] == "PASS" and variant["checks"][0]["ttft_p99_ms"]["policy"] == 94.0
    assert list(merged["criteria"]["variants_ahead_of_vllm"]) == ["policy-burst"]
    lines = report.report_lines(merged)
    assert any(line.startswith("PASS policy ahead of vLLM (in-process, policy-burst rows)")
               for line in lines)  # fmt: skip
    assert "variants_ahead_of_vllm" not in report.merge(ours, [], [])["criteria"]


def test_peer_sweep_replays_the_same_traces(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """peer_vllm.py sweep (here through verifypd without speculation: the vLLM path differs
    only in its front) replays the plan of a mixed.py sweep JSON with its engine sizes."""
    sweep = load_bench("sweep")
    plan = sweep.SweepPlan(
        mix=sweep.Mix((4, 12), (2, 4), (20, 30), (2, 3), 0.25), vocab=256, seed=1,
        rates=(30.0, 60.0), profiles=("uniform-0.6", "hetero"), temperatures=(0.0, 0.7),
        num_requests=3, run_seconds=0.0, drain_timeout=30.0, slo_ttft_ms=500.0,
        slo_tpot_ms=50.0, burn_in_s=1.0,
    )  # fmt: skip
    ours = {
        "sweep_config": plan.to_dict(),
        "params": {
            "model": "dummy:tiny",
            "num_kv_blocks": 96,
            "max_num_seqs": 4,
            "max_model_len": 128,
            "max_num_batched_tokens": 256,
        },
    }
    src = tmp_path / "ours.json"
    src.write_text(json.dumps(ours))
    resets = count_cache_resets(monkeypatch)
    handed: list[str] = []
    inner = AsyncEngine.generate

    def generate(self, request_id, prompt, params):
        handed.append(request_id.split("-")[0])
        return inner(self, request_id, prompt, params)

    monkeypatch.setattr(AsyncEngine, "generate", generate)
    data = load_bench("peer_vllm").main(
        [
            "sweep",
            "--engine",
            "verifypd",
            "--device",
            "cpu",
            "--from",
            str(src),
            "--out",
            str(tmp_path),
        ]
    )
    assert data["device"] == "cpu" and data["git_commit"]
    assert data["engine_info"]["num_kv_blocks"] == 96 and data["engine_info"]["max_num_seqs"] == 4
    rows = data["sweep"]
    assert len(rows) == 2 * 2 * 2 and {r["mode"] for r in rows} == {"verifypd-off"}
    for r in rows:
        assert r["trace_fingerprint"] == sweep.plan_fingerprint(
            plan, r["rate"], r["acceptance_profile"]
        )
        assert r["num_finished"] == 3
        assert r["ttft_p99_ms"] > 0 and r["goodput_rps"] > 0
    assert (tmp_path / "peer_vllm-cpu-verifypd-sweep.json").is_file()
    assert resets == [0] * 4  # every (rate, temperature) run starts with an empty cache
    # the plan's burn-in (its requests' ids: burn-N) after the warm-up, before the runs
    assert handed == ["warm"] * 16 + ["burn"] * 3 + ["req"] * 12, handed
    assert not any("engine_steps" in r for r in rows)  # vLLM's step log only


def test_vllm_step_log_keeps_each_run_s_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """peer_engines.StepLog (vLLM's per-step stats, peer_vllm.py --trace-steps): a run's steps
    with their times from its start and from the step before; steps outside the run and stats
    without an iteration are dropped; missing fields do not fail the run."""
    peer = load_bench("peer_engines")
    log = peer.StepLog()
    clock = iter([9.0, 10.010, 10.030, 10.032, 11.5])
    monkeypatch.setattr(peer.time, "perf_counter", lambda: next(clock))
    it = lambda gen, ttfts, prompt: SimpleNamespace(  # noqa: E731
        num_generation_tokens=gen, time_to_first_tokens_iter=ttfts, num_prompt_tokens=prompt
    )
    sched = SimpleNamespace(num_running_reqs=3, num_waiting_reqs=1)
    log.record(sched, it(2, [], 0))  # 9.0: before the run
    log.record(sched, it(3, [0.1, 0.2], 2800))  # 10.010
    log.record(None, None)  # no iteration: not a step (no clock read)
    log.record(sched, it(4, [], 0))  # 10.030
    log.record(None, SimpleNamespace())  # 10.032: fields missing
    log.record(sched, it(5, [], 0))  # 11.5: after the run
    steps = log.between(10.0, 11.0)
    assert [s["t_ms"] for s in steps] == [10.0, 30.0, 32.0]
    assert [s["step_ms"] for s in steps] == [None, 20.0, 2.0]
    assert steps[0] == {"t_ms": 10.0, "step_ms": None, "gen_tokens": 3, "prompts_done": 2,
                        "prompt_tokens_done": 2800, "running": 3, "waiting": 1}  # fmt: skip
    assert steps[2]["gen_tokens"] == 0 and steps[2]["running"] is None


def test_http_replay_sends_each_alpha(tmp_path: Path) -> None:
    """mixed.py --sweep --http against a real ``verifypd serve --synthetic-acceptance``: rows in
    the sweep format under --mode-label, each request's alpha sent as a body field (a server
    in synthetic mode accepts it; the same replay without it is refused request by request)."""
    cmd = verifypd_serve_command(
        "--model", "dummy:tiny", "--draft-model", "dummy:tiny", "--device", "cpu",
        "--num-kv-blocks", "256", "--max-model-len", "256", "--synthetic-acceptance", "0.5",
        "--log-request-timing",
    )  # fmt: skip
    argv = [a for a in SWEEP_TINY if a not in ("--num-kv-blocks", "256")]
    argv[argv.index("off,three-fixed,policy")] = "off"  # one mode label; --modes does not apply
    # One profile at two temperatures: the second run of a rate replays the first's prompts.
    argv[argv.index("uniform-0.8,hetero")] = "hetero"
    argv[argv.index("--temperatures") + 1] = "0,0.7"
    with start_server_process(cmd, timeout=120) as server:
        data = load_bench("mixed").main([*argv, "--http", server.url, "--mode-label", "policy",
                                         "--http-extra", '{"user": "sweep"}',
                                         "--out", str(tmp_path)])  # fmt: skip
        # Without a salt per run, the same replay hits the prompts cached at temperature 0.
        unsalted = load_bench("mixed").main([*argv, "--http", server.url, "--mode-label",
                                             "policy", "--no-http-cache-salt", "--rates", "20",
                                             "--out", str(tmp_path / "unsalted")])  # fmt: skip
        server.stop()
        server_log = "\n".join(server.stderr)
    hits = {r["temperature"]: r["server"]["server_prefix_cache_hits_tokens"]
            for r in unsalted["sweep"]}  # fmt: skip
    assert hits[0.0] == 0 and hits[0.7] > 0
    assert unsalted["sweep_engines"]["policy"]["cache_salt_per_run"] is False
    rows = data["sweep"]
    assert [r["server"]["server_prefix_cache_hits_tokens"] for r in rows] == [0.0] * 4
    assert data["sweep_engines"]["policy"]["cache_salt_per_run"] is True
    assert len(rows) == 2 * 2 and {r["mode"] for r in rows} == {"policy"}
    for r in rows:
        assert ROW_KEYS - {"num_drafted", "num_accepted", "num_preemptions", "num_ahead_steps",
                           "num_ahead_held", "num_deltas_ahead",
                           "num_kernel_compiles", "num_decode_rows_fused"} <= set(r)  # fmt: skip
        assert r["server"]["server_kernel_compiles"] == 0.0  # the CPU never compiles
        assert r["server"]["server_decode_rows_fused"] == 0.0  # not set: never fused
        assert r["front"] == "http" and r["num_finished"] == r["num_requests"] > 0
        # The server's own first-token mean, from its /metrics around the run, lies inside
        # the client's (which adds the HTTP front and the network).
        server = r["server"]
        assert 0 < server["server_ttft_mean_ms"] <= server["client_ttft_mean_ms"]
        assert 0 <= server["server_loop_lag_late_share"] <= 1
        assert 0 <= server["server_queue_mean_ms"] <= server["server_ttft_mean_ms"]
    assert data["sweep_engines"]["policy"]["send_alpha"] is True
    info = data["sweep_engines"]["policy"]["server_info"]  # the server's own settings, recorded
    assert info["engine_client"] == "AsyncEngine" and info["engine_config"]["model"] == "dummy:tiny"
    assert info["engine_config"]["cache"]["num_blocks"] == 256
    http = load_bench("http_load").HttpEngine("http://x", "m")
    sent = http.body([1, 2], SamplingParams(max_tokens=2, synthetic_acceptance=0.6))
    assert sent["synthetic_acceptance"] == 0.6
    assert "synthetic_acceptance" not in http.body([1, 2], SamplingParams(max_tokens=2))
    assert http.body([1], SamplingParams(max_tokens=2, cache_salt="s"))["cache_salt"] == "s"
    assert "cache_salt" not in http.body([1], SamplingParams(max_tokens=2))
    assert data["criteria"]["policy_within_5pct_of_best"]["verdict"] == "N/A"
    # Each request's first token, split between the client and the server's timing log.
    log = tmp_path / "server.log"
    log.write_text(server_log)
    times = load_bench("request_times")
    lines = times.server_lines(log)
    for r in rows:
        split = times.splits(r["request_times"], lines)
        assert len(split) == r["num_requests"]
        _parts_add_up(split, times.PARTS, without={"pipe"})  # no engine process here
    (result,) = tmp_path.glob("mixed-*.json")
    split_path = tmp_path / "split.json"
    assert times.main([str(result), "--server-log", str(log), "--top", "2",
                       "--out", str(split_path)]) == 0  # fmt: skip
    split = json.loads(split_path.read_text())["rows"]
    assert len(split) == len(rows) and all(len(r["slowest"]) == 2 for r in split)
    assert split[0]["parts"]["ttft"]["p50"] <= split[0]["parts"]["ttft"]["p90"]
    assert split_path.with_suffix(".png").exists()


def _parts_add_up(split: list[dict], parts: tuple[str, ...], without: set[str]) -> None:
    """Every part of each first token is there (but ``without``), none is negative (one clock
    on one host), and they add up to its TTFT."""
    for row in split:
        assert all(row[p] is None for p in without), row
        got = [row[p] for p in parts if p not in without]
        assert None not in got and min(got) >= -0.01, row
        assert sum(got) == pytest.approx(row["ttft"], abs=0.05), row


def test_max_wall_skips_runs_that_would_overrun(tmp_path: Path) -> None:
    argv = [*SWEEP_TINY, "--out", str(tmp_path), "--max-wall-s", "5", "--run-seconds", "0"]
    argv[argv.index("off,three-fixed,policy")] = "off"
    argv[argv.index("20,40")] = "20,0.5"  # 4 requests at 0.5/s: estimated 12 s, over 5 s
    data = load_bench("mixed").main(argv)
    assert {r["rate"] for r in data["sweep"]} == {20.0} and len(data["sweep"]) == 2
    assert [(s["rate"], s["mode"]) for s in data["skipped"]] == [(0.5, "off")] * 2
    assert data["estimate_s"] > 0 and "throwaway_engine" not in data  # none by default
    assert data["criteria"]["policy_within_5pct_of_best"]["verdict"] == "N/A"


def test_server_histogram_totals_of_both_servers() -> None:
    """verifypd's and vLLM's first-token and queue histograms, summed over label sets; the
    means between two scrapes."""
    http = load_bench("http_load")
    page = """# HELP x
verifypd_time_to_first_token_seconds_bucket{le="0.1",model="m"} 3.0
verifypd_time_to_first_token_seconds_sum{model="m"} 0.5
verifypd_time_to_first_token_seconds_count{model="m"} 4.0
vllm:request_queue_time_seconds_sum{engine="0",model_name="m"} 0.25
vllm:request_queue_time_seconds_sum{engine="1",model_name="m"} 0.25
vllm:request_queue_time_seconds_count{engine="0",model_name="m"} 5.0
verifypd_time_to_first_token_seconds_created{model="m"} 1.7e9
"""
    before = http.histogram_totals(page)
    assert before == {"ttft": (0.5, 4.0), "queue": (0.5, 5.0)}
    after = {"ttft": (0.9, 6.0), "queue": (0.5, 5.0)}
    assert http.server_means(before, after) == {
        "server_ttft_mean_ms": pytest.approx(200.0),
        "server_queue_mean_ms": None,  # no request between the scrapes
    }
    assert http.server_means({}, after) == {}
    counters = """verifypd_prefix_cache_hits_total{model="m"} 32.0
verifypd_prefix_cache_queries_total{model="m"} 80.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 16.0
vllm:prefix_cache_hits_total{engine="1",model_name="m"} 16.0
vllm:prefix_cache_hits_created{engine="0",model_name="m"} 1.7e9
verifypd_kernel_compiles_total{model="m"} 1.0
"""
    totals = http.counter_totals(counters)
    assert totals == {"prefix_cache_hits": 64.0, "prefix_cache_queries": 80.0,
                      "kernel_compiles": 1.0}  # fmt: skip
    later = {"prefix_cache_hits": 64.0, "prefix_cache_queries": 120.0, "kernel_compiles": 3.0}
    assert http.server_means(totals, later) == {
        "server_prefix_cache_hits_tokens": 0.0,
        "server_prefix_cache_queries_tokens": 40.0,
        "server_kernel_compiles": 2.0,
    }
    lag = """verifypd_event_loop_lag_seconds_bucket{le="0.002",model="m"} 70.0
verifypd_event_loop_lag_seconds_bucket{le="0.005",model="m"} 90.0
verifypd_event_loop_lag_seconds_bucket{le="0.01",model="m"} 99.0
verifypd_event_loop_lag_seconds_sum{model="m"} 0.2
verifypd_event_loop_lag_seconds_count{model="m"} 100.0
verifypd_engine_loop_lag_seconds_bucket{le="0.005",model="m"} 48.0
verifypd_engine_loop_lag_seconds_sum{model="m"} 0.1
verifypd_engine_loop_lag_seconds_count{model="m"} 50.0
"""
    first = {**http.histogram_totals(lag), **http.counter_totals(lag)}
    assert first == {"loop_lag": (0.2, 100.0), "loop_lag_on_time": 90.0,
                     "engine_loop_lag": (0.1, 50.0), "engine_loop_lag_on_time": 48.0}  # fmt: skip
    then = {"loop_lag": (0.5, 200.0), "loop_lag_on_time": 150.0,
            "engine_loop_lag": (0.1, 50.0), "engine_loop_lag_on_time": 48.0}  # fmt: skip
    assert http.server_means(first, then) == {
        "server_loop_lag_mean_ms": pytest.approx(3.0),
        "server_loop_lag_late_share": pytest.approx(0.4),  # 40 of 100 probes >= 5 ms late
        "server_engine_loop_lag_mean_ms": None,  # no probe between the two scrapes
        "server_engine_loop_lag_late_share": None,
    }


def test_a_runs_policy_view_counts_from_its_start():
    sweep = load_bench("mixed_sweep")
    base = {"num_steps": 100, "decisions_catch_up": 7, "decisions": {"speculate": 5, "no_gain": 2},
            "drafter_eager_steps": 3, "cadence_spec_steps": 40, "cadence_spec_s": 0.01,
            "num_requests": 4, "population_acceptance": 0.6}  # fmt: skip
    now = {"num_steps": 130, "decisions_catch_up": 9, "decisions": {"speculate": 25, "no_gain": 2},
           "drafter_eager_steps": 3, "cadence_spec_steps": 52, "cadence_spec_s": 0.011,
           "num_requests": 6, "population_acceptance": 0.7}  # fmt: skip
    out = sweep.since(lambda: now, base)
    assert out == {"num_steps": 30, "decisions_catch_up": 2,
                   "decisions": {"speculate": 20, "no_gain": 0}, "drafter_eager_steps": 0,
                   "cadence_spec_steps": 12, "num_requests": 6,
                   "population_acceptance": 0.7}  # fmt: skip


def test_a_columnar_timeline_reads_back_as_its_snapshots():
    report = load_bench("sweep_report")
    samples = [
        {"t_s": 0.0, "num_steps": 3},
        {"t_s": 0.25, "num_steps": 5, "last_reason": "no_gain"},
    ]
    stored = report.columnar(samples)
    assert stored == {"columns": ["t_s", "num_steps", "last_reason"],
                      "values": [[0.0, 3, None], [0.25, 5, "no_gain"]]}  # fmt: skip
    assert report.timeline_samples({"rate": 2.0, **stored}) == samples
    assert report.timeline_samples({"rate": 2.0, "samples": samples}) == samples  # the old form


def test_the_report_names_compiles_and_fused_rows():
    report = load_bench("sweep_report")
    cell = {"mode": "policy", "acceptance_profile": "hetero", "temperature": 0.0, "rate": 14.0}
    rows = [
        {**cell, "num_kernel_compiles": 2, "num_decode_rows_fused": 0},
        {**cell, "mode": "http:policy-http",
         "server": {"server_kernel_compiles": 0.0, "server_decode_rows_fused": 96.0}},
        {**cell, "mode": "off", "num_kernel_compiles": 0},
        {**cell, "mode": "http:vllm-http", "server": {}},
    ]  # fmt: skip
    assert report.event_lines(rows) == [
        "STALL policy hetero T=0.0 14.0/s: 2 Triton compiles under traffic",
        "fused http:policy-http hetero T=0.0 14.0/s: 96 decode rows inside prompt steps",
    ]


def test_engine_process_sweep_drives_a_remote_engine(tmp_path: Path) -> None:
    """mixed.py --sweep --engine-process: each mode's engine in its own process (RemoteEngine,
    as vLLM's AsyncLLM runs its core), rows labelled MODE-proc in the sweep format, every
    request finished; each run's requests carry a cache salt of their own."""
    argv = [*SWEEP_TINY, "--out", str(tmp_path), "--engine-process"]
    argv[argv.index("off,three-fixed,policy")] = "off,policy"
    argv[argv.index("uniform-0.8,hetero")] = "hetero"
    argv[argv.index("20,40")] = "20"
    data = load_bench("mixed").main(argv)
    rows = data["sweep"]
    assert [r["mode"] for r in rows] == ["off-proc", "policy-proc"]
    for r in rows:
        assert r["front"] == "engine-process" and r["num_finished"] == r["num_requests"] > 0
        assert r["ttft_p99_ms"] > 0 and r["tpot_p99_ms"] > 0
    engines = data["sweep_engines"]
    assert engines["policy-proc"]["engine_process"] is True and engines["policy-proc"]["controller"]
    assert engines["off-proc"]["cache_salt_per_run"] is True
    times = load_bench("request_times")
    for r in rows:  # the RemoteEngine's stamps: no HTTP front, no chunk written
        split = times.splits(r["request_times"], {})
        assert len(split) == r["num_requests"]
        _parts_add_up(split, times.PARTS, without={"to_front", "write"})

    class Recorder:
        def generate(self, request_id, prompt_token_ids, params, timing):
            self.got, self.timing = params, timing
            return "deltas"

    inner = Recorder()
    salted = load_bench("front_sweeps").SaltedEngine(inner, "run-1")
    original = SamplingParams(max_tokens=2, temperature=0.5)
    assert salted.generate("r", [1], original) == "deltas"
    assert inner.got.cache_salt == "run-1" and inner.got.temperature == 0.5
    assert salted.timings["r"] is inner.timing
    assert original.cache_salt is None  # the trace's own params are left as they were


def test_rate_plots_read_goodput_at_a_tpot_target(tmp_path: Path) -> None:
    """``goodput@Y`` panels read ``goodput_by_tpot_slo``; a row without the ladder has no
    point there; one PNG per (profile, temperature) with or without them."""
    plots = load_bench("sweep_plots")
    row = {"rate": 2.0, "acceptance_profile": "hetero", "temperature": 0.0, "mode": "policy",
           "itl_p99_ms": 5.0, "ttft_p99_ms": 40.0, "goodput_rps": 2.0,
           "goodput_by_tpot_slo": {"4": 1.5, "5": 2.0}}  # fmt: skip
    assert plots.panel_value(row, "goodput@4") == 1.5
    assert plots.panel_value(row, "goodput@3") is None
    assert plots.panel_value(row, "itl_p99_ms") == 5.0
    bare = {k: v for k, v in row.items() if k != "goodput_by_tpot_slo"}
    assert plots.panel_value(bare, "goodput@4") is None
    rows = [row, dict(bare, mode="off", rate=8.0), dict(row, rate=8.0)]
    paths = plots.plot_rates(tmp_path / "sweep", rows, tpot_slos=("4", "5"))
    assert [p.name for p in paths] == ["sweep-hetero-t0.0.png"] and paths[0].stat().st_size > 0
