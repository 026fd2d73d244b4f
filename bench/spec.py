"""Speculative decoding speedup: draft-model speculation against plain decode of the same engine
configuration, same run. Target dummy:qwen2.5-7b, draft dummy:qwen2.5-0.5b, fixed L = 4
(controller off), greedy, 256 new tokens.

SYNTHETIC ACCEPTANCE: dummy weights accept almost nothing, so the accepted count is drawn from a
truncated geometric with alpha = --acceptance (0.8); the real draft and verify forwards run.
Numbers from this script are speed-of-mechanism numbers, not quality numbers.

    python bench/spec.py
    python bench/spec.py --device cpu --model dummy:tiny --draft-model dummy:tiny --batches 1 \
        --max-tokens 6 --prompt-len 8
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

import numpy as np  # noqa: E402
from common import (  # noqa: E402
    add_common_args,
    add_spec_args,
    bar_panels,
    error_record,
    format_table,
    progress,
    release_memory,
    start_run,
)
from decode_timing import measure_decode  # noqa: E402
from harness import (  # noqa: E402
    attach_recorder,
    blocks_for,
    build_engine,
    close_engine,
    engine_config,
    engine_info,
    spec_stats,
    synthetic_note,
    synthetic_spec,
)

from verifypd.config import SpecConfig  # noqa: E402

SCRIPT = "spec"


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_spec_args(p)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument(
        "--lane-modes",
        nargs="+",
        default=["three", "single"],
        choices=["three", "single", "sync"],
        help="three|single: AsyncEngine lane dispatcher; sync: LLM.generate (the dispatcher too)",
    )
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=2, help="median over this many runs")
    p.add_argument(
        "--chain-drafts",
        choices=["auto", "on", "off"],
        default="auto",
        help="SpecConfig.chain_drafts (auto: on for GPU)",
    )
    p.add_argument(
        "--also-unchained",
        action="store_true",
        help="also measure speculation with chain_drafts off, in the same run (A/B)",
    )
    p.add_argument("--use-triton", type=int, choices=[0, 1], default=None, help="default: engine")
    p.add_argument("--cuda-graphs", type=int, choices=[0, 1], default=None, help="default: engine")
    add_common_args(p)
    return p.parse_args(argv)


CHAIN = {"auto": None, "on": True, "off": False}


def spec_config(args: argparse.Namespace, on: bool, chain: bool | None = None) -> SpecConfig:
    return synthetic_spec(args, chain=chain) if on else SpecConfig(method="off")


def expected_tokens_per_verify(alpha: float, draft_len: int) -> float:
    """E[accepted drafts + 1 bonus] under the truncated geometric: (1 - a^(L+1)) / (1 - a)."""
    if alpha >= 1.0:
        return float(draft_len + 1)
    return (1 - alpha ** (draft_len + 1)) / (1 - alpha)


def bench_engine(
    args, device, lane_mode: str, spec_on: bool, chain: bool | None = None
) -> dict[str, Any]:
    """One engine (plain or speculative) measured at every batch size. ``lane_mode`` three or
    single drives AsyncEngine's lane dispatcher; "sync" drives LLM.generate (the same
    dispatcher, behind the offline API)."""
    max_batch = max(args.batches)
    engine_kw = {} if lane_mode == "sync" else {"lane_mode": lane_mode}
    if args.use_triton is not None:
        engine_kw["use_triton"] = bool(args.use_triton)
    if args.cuda_graphs is not None:
        engine_kw["cuda_graphs"] = bool(args.cuda_graphs)
    cfg = engine_config(
        args.model,
        args.device,
        args.dtype,
        args.seed,
        max_num_seqs=max_batch,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=max(8192, max_batch * args.prompt_len),
        num_blocks=blocks_for(max_batch, args.prompt_len + args.max_tokens + 2 * args.draft_len),
        prefix_caching=False,
        spec=spec_config(args, spec_on, chain),
        **engine_kw,
    )
    llm = build_engine(cfg, "llm" if lane_mode == "sync" else "async")
    try:
        return measure_batches(args, llm, device)
    finally:
        close_engine(llm)


def measure_batches(args, llm, device) -> dict[str, Any]:
    recorder = attach_recorder(llm)
    rng = np.random.default_rng(args.seed)
    record: dict[str, Any] = {"engine": engine_info(llm), "batches": {}}
    for batch in args.batches:
        try:
            m = measure_decode(
                llm, rng, batch, args.prompt_len, args.max_tokens, args.repeats, device, recorder
            )
            m["steps"] = recorder.summary()
            m["engine_spec_stats"] = spec_stats(llm)
        except Exception as exc:  # noqa: BLE001 - one batch failing must not hide the rest
            m = error_record(exc)
        record["batches"][str(batch)] = m
        eng = record["engine"]
        what = f"lanes={eng['lane_mode']} spec={eng['spec']['method']} B={batch}"
        progress(SCRIPT, what, m)
    return record


def bench_lane_mode(args, device, lane_mode: str, out: dict[str, Any], save) -> None:
    """Fills ``out`` engine by engine (plain, then spec), calling ``save()`` after each."""
    engines = [("plain", False, None), ("spec", True, CHAIN[args.chain_drafts])]
    if args.also_unchained:
        engines.append(("spec_unchained", True, False))
    for name, on, chain in engines:
        try:
            out[name] = bench_engine(args, device, lane_mode, on, chain)
        except Exception as exc:  # noqa: BLE001 - record and go on
            out[name] = error_record(exc)
        release_memory()
        save()
    expected = expected_tokens_per_verify(args.acceptance, args.draft_len)
    for name, *_ in engines[1:]:
        key = name.replace("spec", "speedup")
        out[key] = {str(b): _speedup(out, str(b), expected, name) for b in args.batches}


def _speedup(
    out: dict[str, Any], batch: str, expected_tokens: float, spec_key: str = "spec"
) -> dict[str, Any] | None:
    """Decode and end-to-end ratios; ``decode_at_expected`` rescales the decode ratio from the
    tokens per verify the synthetic draws gave in this run to their expectation (a run of ~80
    verifies moves them by about ±5 %)."""
    plain = out["plain"].get("batches", {}).get(batch, {})
    spec = out[spec_key].get("batches", {}).get(batch, {})
    if "decode_tok_s" not in plain or "decode_tok_s" not in spec:
        return None
    decode = spec["decode_tok_s"] / plain["decode_tok_s"]
    accepted = accepted_per_verify(spec)
    return {
        "decode": decode,
        "e2e": spec["e2e_tok_s"] / plain["e2e_tok_s"],
        "decode_at_expected": decode * expected_tokens / (1 + accepted) if accepted else None,
    }


def accepted_per_verify(m: dict[str, Any]) -> float | None:
    stats = (m.get("steps") or {}).get("spec") or {}
    return stats.get("mean_accepted_per_call")


HEADERS = ["lanes", "batch", "plain tok/s", "spec tok/s", "speedup", "e2e speedup",
           "acc/verify", "speedup at E[acc]", "note"]  # fmt: skip


def summary_rows(results: dict[str, Any], batches: list[int]) -> list[list[Any]]:
    rows = []
    for lane_mode, r in results.items():
        for b, key in (
            (b, k) for k in ("spec", "spec_unchained") if k in r for b in map(str, batches)
        ):
            plain = r["plain"].get("batches", {}).get(b, {})
            spec = r[key].get("batches", {}).get(b, {})
            sp = r[key.replace("spec", "speedup")].get(b) or {}
            failed = [k for k, v in (("plain", plain), ("spec", spec)) if "decode_tok_s" not in v]
            label = lane_mode if key == "spec" else f"{lane_mode} (unchained)"
            rows.append([
                label, b, plain.get("decode_tok_s"), spec.get("decode_tok_s"),
                sp.get("decode"), sp.get("e2e"), accepted_per_verify(spec),
                sp.get("decode_at_expected"),
                f"{'+'.join(failed)} failed" if failed else "synthetic acceptance",
            ])  # fmt: skip
    return rows


def plot(path: Path, results: dict[str, Any], batches: list[int]) -> Path | None:
    labels = [f"B={b}" for b in batches]
    panels = []
    for lane_mode, r in results.items():
        series = {
            name: [r[name].get("batches", {}).get(str(b), {}).get("decode_tok_s") for b in batches]
            for name in ("plain", "spec", "spec_unchained")
            if name in r
        }
        panels.append((f"lanes={lane_mode}: decode tok/s (synthetic acceptance)", "tok/s",
                       labels, series))  # fmt: skip
    return bar_panels(path, panels)


METHOD = (
    "decode tok/s = batch / ((median T(max_tokens) - median T(1)) / (max_tokens - 1)); "
    "e2e tok/s = batch * max_tokens / median T(max_tokens); greedy, EOS ignored, fresh "
    "random prompts per run; acc/verify = accepted drafts per Observer.spec_tokens call"
)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    run = start_run(SCRIPT, argv, parse_args, METHOD)
    args, report = run.args, run.report
    expected = expected_tokens_per_verify(args.acceptance, args.draft_len)
    report["synthetic_acceptance"] = synthetic_note(
        args, draft_len=args.draft_len, expected_tokens_per_verify=expected
    )
    for lm in args.lane_modes:  # saved after every engine: a killed run keeps what it measured
        report["results"][lm] = {}
        bench_lane_mode(args, run.device, lm, report["results"][lm], run.save)
    table = format_table(HEADERS, summary_rows(report["results"], args.batches))
    table += f"\nsynthetic acceptance alpha={args.acceptance}, L={args.draft_len} (controller off)"
    run.finish(table, lambda png: plot(png, report["results"], args.batches))
    return report


if __name__ == "__main__":
    main()
