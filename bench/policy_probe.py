"""One decision of the goodput policy, taken apart: for a batch of requests of given
acceptance (each taught a history; the estimates learnt are printed), on a run's measured cost
table (``bench/mixed.py`` result, ``--from``), every draft length's predicted round, tokens,
tokens per second and the rows whose time per token meets the TPOT target, beside what the
policy decides. No engine runs; prints a table.

    python bench/policy_probe.py \\
        --from bench/results/mixed/mixed-nvidia-h200-head5dl-fd5f69c.json \\
        --engine-mode policy-head-tpot5-obj --alphas 0.9,0.9,0.9,0.6,0.6,0.6,0.6,0.2,0.2,0.2 \\
        --draft-level 0.53 --seen-ratio 1.3 \\
        --spec tpot_target_s=0.005,tpot_objective=true,request_prior_count=2.0,explore_alpha=0.8

It found why the TPOT objective drafts short with the head-cost drafter (docs/performance.md,
0c30213): on that batch (α̂ 0.87-0.91, 0.40-0.67, 0.04-0.30) one draft a round keeps the α̂
0.30 row within 5 ms, four drafts give 1.27x the tokens a second and leave it out, and rows
within rank first.

Each request is taught ``--verifies`` verifies of L = 4 at its α (the same history for equal
α), so its estimate is what the policy learns, not the α itself; the whole speculating set
is the batch (the fused round) in the table. ``--seen-ratio``: the plain step requests are
measured to see over the predicted one (the engine's ``plain_seen_s``).
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

from common import csv_list, format_table  # noqa: E402
from policy_sim import DraftScaled, _Clock, load_table, spec_config  # noqa: E402

from verifypd.config import SchedulerConfig  # noqa: E402
from verifypd.controller import BatchCostModel, SeqView, build_policy, expected_tokens  # noqa: E402
from verifypd.lanes.spec_policy import goodput_config_for  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--from", dest="source", required=True, help="a bench/mixed.py result")
    p.add_argument("--engine-mode", default="policy", help="whose cost_table (sweep_engines)")
    p.add_argument("--alphas", type=csv_list, required=True, help="each row's acceptance")
    p.add_argument("--verifies", type=int, default=40, help="verifies each row is taught")
    p.add_argument("--draft-level", type=float, default=1.0, help="drafter steps x the table's")
    p.add_argument("--seen-ratio", type=float, default=None, help="plain step seen / predicted")
    p.add_argument("--max-draft-len", type=int, default=4)
    p.add_argument("--spec", type=csv_list, default=[], help="SpecConfig overrides KEY=VALUE")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def probe(args: argparse.Namespace) -> dict[str, Any]:
    """The decision and, per L, the fused round over every row: step (s), tokens, tokens/s,
    and the rows within the TPOT target (None without one)."""
    table = DraftScaled(load_table(args.source, args.engine_mode), args.draft_level)
    spec = spec_config(args.spec, args.max_draft_len)
    goodput = goodput_config_for(SchedulerConfig(), spec, graphs=True, decode_ahead=True)
    policy = build_policy(spec, BatchCostModel(table), goodput, _Clock())
    alphas = [float(a) for a in args.alphas]
    rng = random.Random(args.seed)
    for i, alpha in enumerate(alphas):
        policy.add_request(i, True, 0.0, True)
        for _ in range(args.verifies):
            k = 0
            while k < 4 and rng.random() < alpha:
                k += 1
            policy.observe_acceptance(i, 4, k)
    rows, costs = len(alphas), policy.costs
    t0 = costs.decode(rows)
    seen = t0 if args.seen_ratio is None else args.seen_ratio * t0
    if args.seen_ratio is not None:
        policy.cadence.plain_seen_s = seen
    estimates = [policy.acceptance(i) for i in range(rows)]
    decision = policy.decide([SeqView(i, 1) for i in range(rows)])
    speculating = sum(1 for n in decision.draft_lens.values() if n)
    target = spec.tpot_target_s
    plans = []
    for L in range(1, args.max_draft_len + 1):
        step = L * costs.draft(rows) + costs.verify(rows, 1 + L)
        tokens = sum(expected_tokens(a, L) for a in estimates)
        within = None
        if target is not None:
            inflation = max(1.0, seen / t0)
            within = sum(inflation * step <= target * expected_tokens(a, L) for a in estimates)
        plans.append({"draft_len": L, "step_s": step, "tokens": tokens,
                      "tokens_per_s": tokens / step, "within": within})  # fmt: skip
    return {"estimates": estimates, "plain_step_s": t0, "seen_s": seen, "plans": plans,
            "decision": {"draft_len": decision.draft_len, "reason": decision.reason,
                         "fused": decision.fused, "speculating": speculating}}  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, Any]:
    out = probe(parse_args(argv))
    plain = len(out["estimates"]) / out["plain_step_s"]
    rows = [["plain", f"{out['plain_step_s'] * 1e3:.2f}", len(out["estimates"]), f"{plain:.0f}",
             "-"]]  # fmt: skip
    rows += [[p["draft_len"], f"{p['step_s'] * 1e3:.2f}", f"{p['tokens']:.2f}",
              f"{p['tokens_per_s']:.0f}", "-" if p["within"] is None else p["within"]]
             for p in out["plans"]]  # fmt: skip
    print("α̂:", ", ".join(f"{a:.2f}" for a in out["estimates"]))
    print(format_table(["L", "round ms", "tokens", "tokens/s", "rows within"], rows))
    print("decision:", out["decision"])
    return out


if __name__ == "__main__":
    main()
