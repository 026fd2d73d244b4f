"""bench/policy_sim.py: the goodput policy alone on simulated time reaches the best fixed draft
length for a request decoding alone, every configuration of one seed sees the same requests,
and the report (JSON and plot) comes from a mixed.py result's cost table."""

from __future__ import annotations

import json

import pytest
from helpers import load_bench

from verifypd.config import SpecConfig
from verifypd.costs import CostTable

# A memory-bound GPU in miniature (seconds): a target forward reads the weights and pays a
# little per token; a drafter step is a fifth of a plain step.
TABLE = {
    "context_len": 512,
    "mixed_draft_len": 4,
    "target": [
        {"rows": r, "query_len": q, "seconds": 4e-3 + 40e-6 * r * q}
        for r in (1, 2, 4, 8)
        for q in (1, 2, 3, 4, 5)
    ],  # fmt: skip
    "prefill": [],
    "draft": [{"rows": r, "seconds": 0.8e-3 + 50e-6 * r} for r in (1, 2, 4, 8)],
    "meta": {},
}


def _simulate(batching, spec=None, requests=90, profile="hetero"):
    sim = load_bench("policy_sim")
    spec = spec or SpecConfig(max_draft_len=4, initial_draft_len=4)
    table = CostTable.from_dict(TABLE)
    return sim.simulate(table, profile, batching, requests, (64, 128), spec, seed=3)


def test_alone_the_policy_reaches_the_best_fixed_length_per_class() -> None:
    sim = load_bench("policy_sim")
    res = _simulate(sim.Batching(concurrency=1))
    assert res["num_requests"] == 90 and res["mean_rows"] == pytest.approx(1.0)
    high, low = res["by_class"]["0.9"], res["by_class"]["0.2"]
    assert high["best_fixed_len"] == 4 and high["best_fixed_speedup"] > 1.8
    # the policy learns each request's α from the population and gets most of the bound
    assert (
        0.93 * high["best_fixed_speedup"] < high["speedup_p50"] < 1.05 * high["best_fixed_speedup"]
    )
    assert high["drafts_per_step"] > 3.0
    # α ≈ 0.2 does not pay here: the policy leaves it (nearly) plain, never much slower
    assert low["best_fixed_len"] == 0 and 0.95 < low["speedup_p50"] <= 1.01
    assert low["drafts_per_step"] < 0.5
    # a round that accepts nothing gives one token after more than a plain step: the tail
    assert res["itl_p99_ms"] > 1.2 * res["plain_itl_p99_ms"]


def test_an_oracle_of_each_requests_alpha_skips_the_learning() -> None:
    """With every request's α known before its first step, an α ≈ 0.2 request never probes:
    it drafts far less than one whose estimate starts at the population's."""
    sim = load_bench("policy_sim")
    spec = sim.spec_config([], 4)
    learned = _simulate(sim.Batching(concurrency=1), spec)
    known = sim.simulate(CostTable.from_dict(TABLE), "hetero", sim.Batching(concurrency=1), 90,
                         (64, 128), spec, seed=3, known_alpha=True)  # fmt: skip
    assert known["by_class"]["0.2"]["drafts_per_step"] < 0.3 * learned["by_class"]["0.2"][
        "drafts_per_step"]  # fmt: skip
    assert (
        known["by_class"]["0.9"]["speedup_p50"] > 0.98 * learned["by_class"]["0.9"]["speedup_p50"]
    )


def test_a_tail_budget_keeps_the_tail_and_gives_up_the_speedup() -> None:
    """As the engine measured it (fae4262): with a 0.2 % budget of late tokens the policy
    speculates so rarely that the ITL p99 stays a plain step's, and so does the speed."""
    sim = load_bench("policy_sim")
    spec = sim.spec_config(["tail_budget=0.002"], 4)
    res = _simulate(sim.Batching(concurrency=1), spec)
    assert res["itl_p99_ms"] < 1.05 * res["plain_itl_p99_ms"]
    assert res["speedup_p50"] < 1.1


def test_the_same_requests_under_every_configuration() -> None:
    """Requests come from their own generator: another rider bound changes the speed, not the
    requests; a batch of two rows gives each class less than alone (one L a round)."""
    sim = load_bench("policy_sim")
    two = sim.Batching(concurrency=2)
    default = _simulate(two)
    loose = _simulate(two, SpecConfig(max_draft_len=4, initial_draft_len=4, rider_slack=0.5))
    assert {a: c["num"] for a, c in default["by_class"].items()} == {
        a: c["num"] for a, c in loose["by_class"].items()
    }
    alone = _simulate(sim.Batching(concurrency=1))
    assert default["mean_rows"] == pytest.approx(2.0, abs=0.05)
    assert default["by_class"]["0.9"]["speedup_p50"] < alone["by_class"]["0.9"]["speedup_p50"]
    arrivals = _simulate(sim.Batching(rate=50.0))
    assert 1.0 < arrivals["mean_rows"] and arrivals["num_requests"] == 90


def test_report_from_a_mixed_result(tmp_path) -> None:
    sim = load_bench("policy_sim")
    source = tmp_path / "mixed.json"
    source.write_text(json.dumps({"sweep_engines": {"policy": {"engine": {"cost_table": TABLE}}}}))
    path = sim.main(["--from", str(source), "--device", "cpu", "--no-ceilings", "--requests", "30",
                     "--concurrency", "1", "--rates", "4", "--spec", "rider_slack=0.25",
                     "--out", str(tmp_path), "--tag", "t"])  # fmt: skip
    saved = json.loads(path.read_text())
    assert set(saved["results"]) == {"1 rows", "4/s"} and saved["complete"]
    assert saved["spec_config"]["rider_slack"] == 0.25 and saved["cost_table"] == TABLE
    assert (tmp_path / "policy_sim-cpu-t.png").stat().st_size > 0
    with pytest.raises(SystemExit):
        sim.main(["--from", str(source), "--device", "cpu", "--spec", "no_such_knob=1"])
    (tmp_path / "empty.json").write_text("{}")
    with pytest.raises(SystemExit):
        sim.main(["--from", str(tmp_path / "empty.json"), "--device", "cpu"])


def test_a_tpot_target_below_the_plain_step_and_the_fixed_baseline() -> None:
    """With a TPOT target below a plain step (4.04 ms here), plain rows miss it anyway: the
    policy told so lets more requests meet it than the default policy does, the α ≈ 0.2 ones
    never. The fixed baseline drafts L for every row, every step; at a rate the goodput is
    the share meeting the target times the rate."""
    sim = load_bench("policy_sim")
    table, four, target = CostTable.from_dict(TABLE), sim.Batching(concurrency=4), 3.5e-3

    def run(overrides, batching=four, **kw):
        spec = sim.spec_config(overrides, 4)
        kw.setdefault("tpot_target_s", target)
        return sim.simulate(table, "hetero", batching, 120, (64, 128), spec, seed=3, **kw)

    default, aimed = run([]), run(["tpot_target_s=0.0035"])
    assert 0.0 <= default["meets_target"] < aimed["meets_target"] <= 1.0
    assert aimed["by_class"]["0.2"]["meets_target"] == 0.0
    assert default["goodput_rps"] is None  # rows kept busy: no rate to scale by
    fixed = run([], fixed_len=4)
    assert fixed["by_class"]["0.2"]["drafts_per_step"] == pytest.approx(4.0)
    assert fixed["by_class"]["0.9"]["meets_target"] > 0.9
    arrivals = run(["tpot_target_s=0.0035"], sim.Batching(rate=8.0))
    assert arrivals["goodput_rps"] == pytest.approx(8.0 * arrivals["meets_target"])
    assert run([], tpot_target_s=None)["meets_target"] is None


def test_a_dearer_drafter_scales_its_steps_only_and_speculation_falls() -> None:
    """``--draft-level``: the drafter's steps ``level`` times the table's (as truth and as the
    policy's model), the target's unchanged; with drafts five times dearer the policy drafts
    less per step than at the table's cost."""
    sim = load_bench("policy_sim")
    table = CostTable.from_dict(TABLE)
    dear = sim.DraftScaled(table, 5.0)
    assert dear.draft_time(4) == pytest.approx(5.0 * table.draft_time(4))
    assert dear.target_time(4, 3) == table.target_time(4, 3)
    spec, two = SpecConfig(max_draft_len=4, initial_draft_len=4), sim.Batching(concurrency=2)
    cheap = sim.simulate(table, "uniform-0.8", two, 60, (64, 128), spec, seed=3)
    costly = sim.simulate(dear, "uniform-0.8", two, 60, (64, 128), spec, seed=3)
    drafts = [r["by_class"]["0.8"]["drafts_per_step"] for r in (cheap, costly)]
    assert drafts[0] > drafts[1] >= 0.0
    assert costly["speedup_p50"] < cheap["speedup_p50"]


def test_steps_slower_than_predicted_scale_the_truth_only() -> None:
    """``--plain-level`` / ``--round-level``: steps take that many times their predicted time,
    the cost model unchanged. Both doubled: every time doubles and the fixed baseline's speedup
    (its rounds over plain steps of the same batches) stays; rounds alone doubled: it falls,
    and the policy's speedup with it."""
    sim = load_bench("policy_sim")
    table, two = CostTable.from_dict(TABLE), sim.Batching(concurrency=2)
    spec = SpecConfig(max_draft_len=4, initial_draft_len=4)

    def run(levels, fixed_len=None):
        return sim.simulate(table, "uniform-0.8", two, 40, (64, 128), spec, seed=3,
                            fixed_len=fixed_len, levels=levels)  # fmt: skip

    base, both, rounds = (run(lv, fixed_len=2) for lv in ((1.0, 1.0), (2.0, 2.0), (1.0, 2.0)))
    assert both["speedup_p50"] == pytest.approx(base["speedup_p50"])
    assert both["itl_p99_ms"] == pytest.approx(2.0 * base["itl_p99_ms"])
    assert both["plain_itl_p99_ms"] == pytest.approx(2.0 * base["plain_itl_p99_ms"])
    assert rounds["speedup_p50"] == pytest.approx(base["speedup_p50"] / 2.0)
    assert run((1.0, 2.0))["speedup_p50"] < run((1.0, 1.0))["speedup_p50"]
