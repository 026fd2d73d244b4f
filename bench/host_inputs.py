"""The host time of building a step's inputs (``StepInputBuilder.prepare``: ids, positions, KV
slots, attention metadata, the upload's host side), for prompt steps of 512 to 8,192 tokens and
decode steps of 1 to 256 rows; and of a landed prompt step's fold-back into the prefix cache
(``KVCacheManager.cache_blocks`` over its full blocks: nearly all of ``apply_step`` there).
Host time only: the engine is ``dummy:tiny`` on the CPU (the builder does the same work for
any model; on a GPU the two copies are enqueued, not waited for). Each case is timed in
``--rounds`` rounds of ``--calls`` calls; the median round is its figure. To compare two
versions of the code, run it at each and compare the files::

    python bench/host_inputs.py --tag before        # at the old commit
    python bench/host_inputs.py --tag after
    python bench/host_inputs.py --compare A.json B.json --out DIR --tag NAME
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (  # noqa: E402
    add_common_args,
    bar_panels,
    format_table,
    results_dir,
    start_run,
    write_json,
)
from verifypd.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from verifypd.engine.core import EngineCore  # noqa: E402
from verifypd.types import SamplingParams, ScheduledSeq, Sequence, StepPlan  # noqa: E402

SCRIPT = "host_inputs"
PROMPT_STEPS = (512, 2048, 8192)  # tokens, over six prompts (a burst's step) or one
DECODE_ROWS = (1, 8, 64, 256)  # one-token rows at a context of 300-555 tokens


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(p)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--calls", type=int, default=40, help="calls a round")
    p.add_argument("--compare", nargs=2, default=None, metavar="JSON",
                   help="two results of this script: B against A")  # fmt: skip
    return p.parse_args(argv)


def _seq(core: EngineCore, name: str, tokens: int, computed: int) -> Sequence:
    first = sum(map(ord, name))  # each sequence its own tokens: no two share a cached block
    seq = Sequence(name, [(31 * k + first) % 500 + 1 for k in range(tokens)], SamplingParams())
    if not core.kv.allocate(seq.block_table, tokens + core.kv.block_size):
        raise RuntimeError("the pool is too small for the case")
    seq.num_computed_tokens = computed
    return seq


def cases(core: EngineCore) -> dict[str, StepPlan]:
    """Each case's plan: prompt steps of six chunks (the burst's sizes, scaled) and of one
    chunk; decode steps of one-token rows."""
    plans: dict[str, StepPlan] = {}
    for total in PROMPT_STEPS:
        sizes = [total // 6] * 5 + [total - 5 * (total // 6)]
        plans[f"prompt {total} in 6"] = StepPlan(
            "prefill", [ScheduledSeq(_seq(core, f"p{total}-{i}", n, 0), n)
                        for i, n in enumerate(sizes)])  # fmt: skip
        plans[f"prompt {total} in 1"] = StepPlan(
            "prefill", [ScheduledSeq(_seq(core, f"q{total}", total, 0), total)]
        )
    for rows in DECODE_ROWS:
        seqs = [_seq(core, f"d{rows}-{i}", 300 + i, 299 + i) for i in range(rows)]
        plans[f"decode {rows} rows"] = StepPlan("decode", [ScheduledSeq(s, 1) for s in seqs])
    return plans


def time_fold_back(core: EngineCore, plan: StepPlan, rounds: int, calls: int) -> dict[str, Any]:
    """``cache_blocks`` of every prompt in ``plan`` as its step lands (each call on blocks not
    cached yet: between calls, untimed, the blocks are freed, evicted and allocated again)."""
    kv, bs, per_call = core.kv, core.kv.block_size, []
    seqs = [e.seq for e in plan.seqs]
    for _ in range(rounds):
        total = 0.0
        for _ in range(calls):
            t0 = time.perf_counter()
            for s in seqs:
                kv.cache_blocks(s.block_table, s.token_ids, s.num_tokens, None)
            total += time.perf_counter() - t0
            if kv.prefix_cache.num_registered != sum(s.num_tokens // bs for s in seqs):
                raise RuntimeError("the fold-back did not register every full block")
            for s in seqs:
                kv.free(s.block_table)
            kv.reset_prefix_cache()
            for s in seqs:
                kv.allocate(s.block_table, s.num_tokens + bs)
        per_call.append(total / calls * 1e3)
    return {"tokens": plan.num_tokens, "rows": len(plan.seqs), "blocks": plan.num_tokens // bs,
            "ms": statistics.median(per_call), "rounds_ms": per_call}  # fmt: skip


def time_case(core: EngineCore, plan: StepPlan, rounds: int, calls: int) -> dict[str, Any]:
    prepare = core.runner.prepare
    prepare(plan)  # warm
    per_call = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            prepare(plan)
        per_call.append((time.perf_counter() - t0) / calls * 1e3)
    return {"tokens": plan.num_tokens, "rows": len(plan.seqs),
            "ms": statistics.median(per_call), "rounds_ms": per_call}  # fmt: skip


def compare(a_path: str, b_path: str, out: str | None, tag: str) -> dict[str, Any]:
    a, b = (json.loads(Path(p).read_text()) for p in (a_path, b_path))
    ra, rb = a["results"]["cases"], b["results"]["cases"]
    names = [n for n in ra if n in rb]
    rows = [[n, round(ra[n]["ms"], 4), round(rb[n]["ms"], 4), round(rb[n]["ms"] / ra[n]["ms"], 3)]
            for n in names]  # fmt: skip
    labels = tuple(f"{k} {r['params'].get('tag') or r['git_commit']}"
                   for k, r in (("A", a), ("B", b)))  # fmt: skip
    keys = ("git_commit", "git_dirty", "date_utc", "device", "host", "command")
    report = {
        "script": SCRIPT, "compare": [a_path, b_path],
        "a": {k: a.get(k) for k in keys}, "b": {k: b.get(k) for k in keys},
        "table": [{"case": r[0], "a_ms": r[1], "b_ms": r[2], "b_over_a": r[3]} for r in rows],
    }  # fmt: skip
    print(format_table(["case", f"{labels[0]} ms", f"{labels[1]} ms", "B / A"], rows))
    base = Path(out) if out else results_dir(SCRIPT)
    stem = base / f"{SCRIPT}-compare{'-' + tag if tag else ''}"
    write_json(stem.with_suffix(".json"), report)
    bar_panels(stem.with_suffix(".png"), [
        ("prepare: host ms a call", "ms", names, {labels[0]: [ra[n]["ms"] for n in names],
                                                  labels[1]: [rb[n]["ms"] for n in names]})],
        ncols=1)  # fmt: skip
    print(f"wrote {stem}.json and .png")
    return report


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    if (args := parse_args(argv)).compare:
        return compare(*args.compare, args.out, args.tag)
    run = start_run(SCRIPT, argv, parse_args, method=__doc__.split("\n\n")[0])
    config = EngineConfig(
        model="dummy:tiny", device="cpu", dtype="float32",
        cache=CacheConfig(num_blocks=16384),
        scheduler=SchedulerConfig(
            max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=8300
        ),
    )  # fmt: skip
    core = EngineCore(config)
    results = run.report["results"] = {"block_size": core.kv.block_size, "cases": {}}
    plans = cases(core)
    for name, plan in plans.items():
        results["cases"][name] = time_case(core, plan, run.args.rounds, run.args.calls)
        run.save()
    for total in PROMPT_STEPS[1:]:
        results["cases"][f"fold-back {total} in 6"] = time_fold_back(
            core, plans[f"prompt {total} in 6"], run.args.rounds, run.args.calls
        )
        run.save()
    table = [[n, r["tokens"], r["rows"], round(r["ms"], 4)] for n, r in results["cases"].items()]
    run.finish(format_table(["case", "tokens", "rows", "host ms"], table))
    return run.report


if __name__ == "__main__":
    main()
