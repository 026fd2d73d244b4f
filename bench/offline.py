"""Offline throughput, the nano-vllm workload: 256 requests, input and output lengths uniform in
[100, 1024], random prompt ids, EOS ignored, all submitted at once. Our engine against
transformers' continuous batching (``generate_batch``) on the same architecture, same run.

    python bench/offline.py --models dummy:qwen3-0.6b dummy:qwen2.5-7b
    python bench/offline.py --device cpu --models dummy:tiny --num-requests 4 --max-len 16 --skip-hf
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
    bar_chart,
    error_record,
    format_table,
    gpu_memory_gb,
    progress,
    release_memory,
    start_run,
    timed,
)
from harness import (  # noqa: E402
    build_engine,
    close_engine,
    engine_config,
    engine_info,
    random_prompts,
    run_generate,
)

SCRIPT = "offline"


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--models", nargs="+", default=["dummy:qwen3-0.6b", "dummy:qwen2.5-7b"])
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--min-len", type=int, default=100, help="input/output length lower bound")
    p.add_argument("--max-len", type=int, default=1024, help="input/output length upper bound")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=16384)
    p.add_argument("--skip-hf", action="store_true", help="skip transformers' generate_batch")
    p.add_argument("--hf-timeout", type=float, default=420.0, help="seconds per HF run")
    p.add_argument(
        "--hf-warmup-run",
        action="store_true",
        help="an extra short HF run first (its own CUDA-graph warm-up is excluded anyway)",
    )
    add_common_args(p)
    add_front_args(p)
    args = p.parse_args(argv)
    args.min_len = min(args.min_len, args.max_len)
    return args


def workload(args: argparse.Namespace, vocab: int) -> tuple[list[list[int]], list[int]]:
    """default_rng(seed): input lengths, output lengths, then the prompt ids."""
    rng = np.random.default_rng(args.seed)
    n, lo, hi = args.num_requests, args.min_len, args.max_len
    in_lens = rng.integers(lo, hi + 1, size=n)
    out_lens = rng.integers(lo, hi + 1, size=n)
    return random_prompts(rng, in_lens, vocab), [int(x) for x in out_lens]


def warmup_prompts(vocab: int, seed: int, num: int) -> list[list[int]]:
    """Short prompts, as many as the real run batches, so large-batch paths get warmed too."""
    rng = np.random.default_rng(seed + 1)
    return random_prompts(rng, rng.integers(16, 97, size=num), vocab)


def run_ours(args: argparse.Namespace, model: str, device) -> tuple[dict[str, Any], Any]:
    cfg = engine_config(
        model,
        args.device,
        args.dtype,
        args.seed,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        lane_mode=args.lane_mode,
    )
    llm = build_engine(cfg, args.front)
    try:
        return _measure_ours(args, llm, device)
    finally:
        close_engine(llm)


def _measure_ours(args: argparse.Namespace, llm, device) -> tuple[dict[str, Any], Any]:
    vocab = llm.core.model_config.vocab_size
    prompts, out_lens = workload(args, vocab)
    warm = warmup_prompts(vocab, args.seed, min(args.num_requests, args.max_num_seqs))
    warm_s, _ = timed(lambda: run_generate(llm, warm, 8), device)
    seconds, outs = timed(lambda: run_generate(llm, prompts, out_lens), device)
    num_in = sum(len(p) for p in prompts)
    num_out = sum(len(o.token_ids) for o in outs)
    record = {
        "engine": engine_info(llm),
        "warmup_seconds": warm_s,
        "seconds": seconds,
        "input_tokens": num_in,
        "output_tokens": num_out,
        "requested_output_tokens": sum(out_lens),
        "output_tok_s": num_out / seconds,
        "total_tok_s": (num_in + num_out) / seconds,
    }
    return record, (llm.core.model_config, llm.core.dtype, prompts, out_lens)


def run_hf(args, device, model_config, dtype, prompts, out_lens) -> dict[str, Any]:
    from hf_batch import run_transformers

    vocab = model_config.vocab_size
    mem_before = gpu_memory_gb(device)  # what our (deleted) engine may still hold
    rec = run_transformers(
        model_config,
        prompts,
        out_lens,
        device,
        dtype,
        args.hf_timeout,
        warmup_prompts(vocab, args.seed, 4) if args.hf_warmup_run else None,
    )
    if rec.get("seconds"):
        num_in = sum(len(p) for p in prompts)
        rec["output_tok_s"] = rec["output_tokens"] / rec["seconds"]
        rec["total_tok_s"] = (num_in + rec["output_tokens"]) / rec["seconds"]
        rec["requested_output_tokens"] = sum(out_lens)
    rec["gpu_memory_before_gb"] = mem_before
    return rec


def bench_model(args: argparse.Namespace, model: str, device) -> dict[str, Any]:
    try:
        ours, (model_config, dtype, prompts, out_lens) = run_ours(args, model, device)
    except Exception as exc:  # noqa: BLE001 - record and go on with the next model
        return {"ours": error_record(exc), "transformers": None}
    finally:
        release_memory()  # the engine is gone once run_ours returned
    if args.skip_hf:
        return {"ours": ours, "transformers": {"skipped": True}}
    try:
        hf = run_hf(args, device, model_config, dtype, prompts, out_lens)
    except Exception as exc:  # noqa: BLE001
        hf = error_record(exc)
    out = {"ours": ours, "transformers": hf}
    if hf.get("output_tok_s"):
        out["ratio_output_tok_s"] = ours["output_tok_s"] / hf["output_tok_s"]
        out["ratio_total_tok_s"] = ours["total_tok_s"] / hf["total_tok_s"]
    return out


def summary_rows(results: dict[str, Any]) -> list[list[Any]]:
    rows = []
    for model, r in results.items():
        ours, hf = r["ours"], r.get("transformers") or {}
        note = "ours failed" if "error" in ours else ""
        if hf.get("error"):
            note = "hf failed"
        elif hf.get("method", "").startswith("uniform"):
            note = f"hf uniform max_new={hf.get('uniform_max_new_tokens')}"
        elif hf.get("timed_out"):
            note = "hf timed out (partial)"
        rows.append([
            model,
            ours.get("output_tok_s"),
            ours.get("total_tok_s"),
            hf.get("output_tok_s"),
            hf.get("total_tok_s"),
            r.get("ratio_output_tok_s"),
            hf.get("attn_implementation_used"),
            note,
        ])  # fmt: skip
    return rows


HEADERS = ["model", "ours out tok/s", "ours total tok/s", "hf out tok/s", "hf total tok/s",
           "ours/hf (out)", "hf attn", "note"]  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, Any]:
    run = start_run(SCRIPT, argv, parse_args)
    args, report = run.args, run.report
    report["workload"] = {
        "num_requests": args.num_requests,
        "input_len_range": [args.min_len, args.max_len],
        "output_len_range": [args.min_len, args.max_len],
        "rng": f"numpy default_rng({args.seed}): input lens, output lens, prompt ids",
        "sampling": "greedy, EOS ignored, all requests submitted at once",
        "timing": "after a warm-up run; perf_counter between device syncs",
    }
    for m in args.models:  # saved after every model: a killed run keeps what it measured
        report["results"][m] = bench_model(args, m, run.device)
        progress(SCRIPT, f"{m} ours", report["results"][m]["ours"])
        progress(SCRIPT, f"{m} transformers", report["results"][m]["transformers"] or {})
        run.save()
    rows = summary_rows(report["results"])
    series = {"verifypd": [r[1] for r in rows], "transformers generate_batch": [r[3] for r in rows]}
    title = f"offline throughput, {args.num_requests} requests ({report['device']})"
    plot = lambda png: bar_chart(png, [r[0] for r in rows], series, "output tokens / s", title)
    run.finish(format_table(HEADERS, rows), plot)
    return report


if __name__ == "__main__":
    main()
