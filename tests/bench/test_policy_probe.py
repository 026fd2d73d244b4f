"""bench/policy_probe.py: one decision of the goodput policy beside every draft length's
predicted round, on a cost table written as a bench/mixed.py result."""

from __future__ import annotations

import json

from helpers import load_bench

from verifypd.costs import CostTable

probe_mod = load_bench("policy_probe")


def _result(tmp_path):
    """A result holding a memory-bound cost table: a forward 10 ms + 20 us a token, a drafter
    step 1 ms + 5 us a row (the goodput tests' shape)."""
    rows = (1, 2, 4, 8, 16)
    table = CostTable(
        target={(r, q): 10e-3 + 20e-6 * r * q for r in rows for q in range(1, 6)},
        prefill={n: 10e-3 + 20e-6 * n for n in (128, 512, 2048)},
        draft={r: 1e-3 + 5e-6 * r for r in rows},
        context_len=512,
        mixed_draft_len=4,
    )
    path = tmp_path / "result.json"
    path.write_text(json.dumps({"sweep_engines": {"policy": {"engine": {
        "cost_table": table.to_dict()}}}}))  # fmt: skip
    return str(path)


def test_the_decision_is_the_plan_the_table_ranks_first(tmp_path) -> None:
    """With a 9 ms target and the objective, the policy's L is the one that brings the most
    rows within, the most tokens a second among those; without a target there is no count and
    the policy takes the most tokens a second. Longer rounds give more tokens a second here."""
    source = _result(tmp_path)
    alphas = "0.9,0.9,0.9,0.9,0.3"
    out = probe_mod.main(["--from", source, "--alphas", alphas,
                          "--spec", "tpot_target_s=0.009,tpot_objective=true"])  # fmt: skip
    plans = out["plans"]
    rates = [p["tokens_per_s"] for p in plans]
    assert rates == sorted(rates) and len(plans) == 4
    best = max(plans, key=lambda p: (p["within"], p["tokens_per_s"]))
    assert out["decision"]["draft_len"] == best["draft_len"]
    assert best["within"] > plans[-1]["within"]  # the marginal row holds the rounds short
    assert out["decision"]["reason"] == "speculate" and out["decision"]["speculating"] == 5
    plain = probe_mod.main(["--from", source, "--alphas", alphas])
    assert all(p["within"] is None for p in plain["plans"])
    assert plain["decision"]["draft_len"] == 4
