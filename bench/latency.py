"""Decode speed at fixed batch sizes against the memory-bandwidth floor.

Prompt 128 tokens, 256 new tokens, greedy. Decode step time = (T(256 tokens) - T(1 token)) / 255;
the floor reads every weight and every cached K/V once per step at the measured copy bandwidth.
Variants: eager (torch ops, no graphs), triton (Triton kernels), graphs (Triton + CUDA graphs).

    python bench/latency.py --models dummy:qwen2.5-7b dummy:qwen2.5-1.5b
    python bench/latency.py --device cpu --models dummy:tiny --batches 1 2 --max-tokens 4 \
        --variants eager
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
    add_front_args,
    bar_panels,
    csv_list,
    error_record,
    format_table,
    progress,
    release_memory,
    start_run,
)
from decode_timing import VARIANTS, decode_floor, measure_decode  # noqa: E402
from harness import (  # noqa: E402
    attach_recorder,
    blocks_for,
    build_engine,
    close_engine,
    engine_config,
    engine_info,
)

SCRIPT = "latency"


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--models", nargs="+", default=["dummy:qwen2.5-7b", "dummy:qwen2.5-1.5b"])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=2, help="median over this many runs")
    p.add_argument("--variants", type=csv_list, default=list(VARIANTS), help="eager,triton,graphs")
    add_common_args(p)
    add_front_args(p)
    args = p.parse_args(argv)
    unknown = set(args.variants) - set(VARIANTS)
    if unknown:
        p.error(f"unknown variants {sorted(unknown)}; choose from {list(VARIANTS)}")
    return args


def bench_variant(args, model: str, variant: str, device, gbps) -> dict[str, Any]:
    max_batch = max(args.batches)
    cfg = engine_config(
        model,
        args.device,
        args.dtype,
        args.seed,
        max_num_seqs=max_batch,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=max(8192, max_batch * args.prompt_len),
        num_blocks=blocks_for(max_batch, args.prompt_len + args.max_tokens + 8),
        prefix_caching=False,
        lane_mode=args.lane_mode,
        **VARIANTS[variant],
    )
    llm = build_engine(cfg, args.front)
    try:
        return measure_variant(args, llm, device, gbps, variant)
    finally:
        close_engine(llm)


def measure_variant(args, llm, device, gbps, variant: str) -> dict[str, Any]:
    recorder = attach_recorder(llm)
    rng = np.random.default_rng(args.seed)
    elem = llm.core.dtype.itemsize
    record: dict[str, Any] = {"engine": engine_info(llm), "batches": {}}
    for batch in args.batches:
        try:
            m = measure_decode(
                llm, rng, batch, args.prompt_len, args.max_tokens, args.repeats, device, recorder
            )
            f = decode_floor(
                llm.core.model_config, elem, batch, args.prompt_len, args.max_tokens, gbps
            )
            m["floor"] = f
            m["fraction_of_floor"] = m["decode_tok_s"] / f["floor_tok_s"] if gbps else None
        except Exception as exc:  # noqa: BLE001 - one batch failing must not hide the rest
            m = error_record(exc)
        record["batches"][str(batch)] = m
        progress(SCRIPT, f"{record['engine']['model']} {variant} B={batch}", m)
    return record


def bench_model(args, model: str, device, gbps, out: dict[str, Any], save) -> None:
    """Fills ``out`` variant by variant, calling ``save()`` after each."""
    for variant in args.variants:
        try:
            out[variant] = bench_variant(args, model, variant, device, gbps)
        except Exception as exc:  # noqa: BLE001 - record and go on with the next variant
            out[variant] = error_record(exc)
        release_memory()
        save()


HEADERS = ["model", "variant", "batch", "step ms", "decode tok/s", "floor tok/s", "of floor",
           "e2e tok/s", "note"]  # fmt: skip


def summary_rows(results: dict[str, Any]) -> list[list[Any]]:
    rows = []
    for model, variants in results.items():
        for variant, rec in variants.items():
            if "error" in rec:
                rows.append([model, variant, "-", None, None, None, None, None, "failed"])
                continue
            for batch, m in rec["batches"].items():
                rows.append(_row(model, variant, batch, m))
    return rows


def _row(model: str, variant: str, batch: str, m: dict[str, Any]) -> list[Any]:
    if "error" in m:
        return [model, variant, batch, None, None, None, None, None, "failed"]
    frac = m.get("fraction_of_floor")
    return [
        model,
        variant,
        batch,
        m["decode_step_s"] * 1e3,
        m["decode_tok_s"],
        m["floor"]["floor_tok_s"],
        f"{frac:.0%}" if frac is not None else None,
        m["e2e_tok_s"],
        "",
    ]


def plot(path: Path, results: dict[str, Any], batches: list[int]) -> Path | None:
    panels = []
    labels = [f"B={b}" for b in batches]
    for model, variants in results.items():
        tok, frac = {}, {}
        for variant, rec in variants.items():
            per = [rec.get("batches", {}).get(str(b), {}) for b in batches]
            tok[variant] = [m.get("decode_tok_s") for m in per]
            frac[variant] = [m.get("fraction_of_floor") for m in per]
        panels.append((f"{model}: decode tok/s", "tokens / s", labels, tok))
        panels.append((f"{model}: fraction of bandwidth floor", "measured / floor", labels, frac))
    return bar_panels(path, panels)


METHOD = (
    "decode_step_s = (median T(max_tokens) - median T(1)) / (max_tokens - 1), fresh random "
    "prompts per run, greedy, EOS ignored, prefix caching off; floor = (weights read + KV "
    "read) / copy bandwidth; observed_decode_step_s = engine's own step timer"
)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    run = start_run(SCRIPT, argv, parse_args, METHOD)
    args, results = run.args, run.report["results"]
    gbps = run.report["ceilings"]["copy_gbps"]
    run.report["variants"] = {v: VARIANTS[v] for v in args.variants}
    for m in args.models:  # saved after every variant: a killed run keeps what it measured
        results[m] = {}
        bench_model(args, m, run.device, gbps, results[m], run.save)
    table = format_table(HEADERS, summary_rows(results))
    run.finish(table, lambda png: plot(png, results, args.batches))
    return run.report


if __name__ == "__main__":
    main()
