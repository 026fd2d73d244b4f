"""GPU correctness check (issue 2): greedy output on the GPU in bf16 against our CPU fp32 run of
the very same dummy weights, plus Triton/graph variants against the GPU torch path.

Random generation differs between CPU and CUDA, so the weights are made once: the CPU fp32 engine
loads ``dummy:PRESET``, then every GPU engine gets a bf16 copy of those parameters (copied in
place, so buffers captured by CUDA graphs stay valid). Later bf16 drift is expected and reported
(matching prefix and first divergence per prompt), never hidden. Also records decode tok/s at
batch 1 and 64 for each GPU variant as a starting point.

    python bench/gpu_check.py
    python bench/gpu_check.py --model dummy:tiny --device cpu --variants eager --num-new 4 \
        --speed-batches 1 2 --speed-max-tokens 4 --speed-prompt-len 8
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

import numpy as np  # noqa: E402
import torch  # noqa: E402
from common import (  # noqa: E402
    add_common_args,
    argv_or_sys,
    csv_list,
    error_record,
    format_table,
    hardware_ceilings,
    metadata,
    release_memory,
    resolve_device,
    result_path,
    write_json,
)
from harness import (  # noqa: E402
    blocks_for,
    engine_config,
    engine_info,
    measure_decode,
    random_prompts,
    run_generate,
)

SCRIPT = "gpu_check"
VARIANTS = {
    "eager": {"use_triton": False, "cuda_graphs": False},
    "triton": {"use_triton": True, "cuda_graphs": False},
    "graphs": {"use_triton": True, "cuda_graphs": True},
}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="dummy:qwen2.5-1.5b")
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--min-prompt-len", type=int, default=16)
    p.add_argument("--max-prompt-len", type=int, default=200)
    p.add_argument("--num-new", type=int, default=32)
    p.add_argument("--variants", type=csv_list, default=list(VARIANTS), help="eager,triton,graphs")
    p.add_argument("--speed-batches", type=int, nargs="*", default=[1, 64])
    p.add_argument("--speed-prompt-len", type=int, default=128)
    p.add_argument("--speed-max-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=2)
    add_common_args(p)
    p.set_defaults(device="cuda", dtype="bfloat16")
    args = p.parse_args(argv)
    unknown = set(args.variants) - set(VARIANTS)
    if unknown:
        p.error(f"unknown variants {sorted(unknown)}; choose from {list(VARIANTS)}")
    return args


def check_prompts(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(args.seed)
    lens = rng.integers(args.min_prompt_len, args.max_prompt_len + 1, size=args.num_prompts)
    return random_prompts(rng, lens, vocab)


def num_blocks(args: argparse.Namespace) -> int:
    check = blocks_for(args.num_prompts, args.max_prompt_len + args.num_new + 8)
    speed = blocks_for(
        max(args.speed_batches, default=1), args.speed_prompt_len + args.speed_max_tokens + 8
    )
    return max(check, speed)


def max_seqs(args: argparse.Namespace) -> int:
    return max([args.num_prompts, *args.speed_batches])


def reference_run(args: argparse.Namespace):
    """CPU fp32 torch path: the reference tokens, and the weights every GPU run copies."""
    from verifypd.llm import LLM

    cfg = engine_config(
        args.model, "cpu", "float32", args.seed, max_num_seqs=args.num_prompts,
        num_blocks=blocks_for(args.num_prompts, args.max_prompt_len + args.num_new + 8),
        prefix_caching=False, use_triton=False, cuda_graphs=False,
    )  # fmt: skip
    llm = LLM(config=cfg)
    prompts = check_prompts(args, llm.core.model_config.vocab_size)
    tokens = [o.token_ids for o in run_generate(llm, prompts, args.num_new)]
    params = {name: p.detach() for name, p in llm.core.loaded.model.named_parameters()}
    record = {
        "engine": engine_info(llm),
        "tokens": tokens,
        "prompt_lens": [len(p) for p in prompts],
    }
    del llm
    release_memory()
    return record, prompts, params


@torch.no_grad()
def copy_weights(model: torch.nn.Module, params: dict[str, torch.Tensor]) -> int:
    """Copies (and casts) the reference weights into ``model``'s parameters in place."""
    own = dict(model.named_parameters())
    if set(own) != set(params):
        missing, extra = sorted(set(own) - set(params)), sorted(set(params) - set(own))
        raise ValueError(f"parameter names differ: missing {missing[:5]}, extra {extra[:5]}")
    for name, p in own.items():
        if p.shape != params[name].shape:
            raise ValueError(f"{name}: shape {tuple(p.shape)} != {tuple(params[name].shape)}")
        p.copy_(params[name])
    return sum(p.numel() for p in own.values())


def compare(tokens: list[list[int]], reference: list[list[int]]) -> list[dict[str, Any]]:
    out = []
    for got, ref in zip(tokens, reference, strict=True):
        n = min(len(got), len(ref))
        prefix = next((i for i in range(n) if got[i] != ref[i]), n)
        diverged = prefix < max(len(got), len(ref))
        out.append({
            "num_tokens": len(ref),
            "matching_prefix": prefix,
            "first_divergence": prefix if diverged else None,
            "identical": not diverged,
        })  # fmt: skip
    return out


def run_variant(args, variant: str, prompts, params, reference, device) -> dict[str, Any]:
    from verifypd.llm import LLM

    cfg = engine_config(
        args.model, args.device, args.dtype, args.seed, max_num_seqs=max_seqs(args),
        max_num_batched_tokens=max(8192, max_seqs(args) * args.speed_prompt_len),
        num_blocks=num_blocks(args), prefix_caching=False, **VARIANTS[variant],
    )  # fmt: skip
    llm = LLM(config=cfg)
    record: dict[str, Any] = {"engine": engine_info(llm)}
    record["num_params_copied"] = copy_weights(llm.core.loaded.model, params)
    tokens = [o.token_ids for o in run_generate(llm, prompts, args.num_new)]
    record["tokens"] = tokens
    record["vs_cpu_fp32"] = compare(tokens, reference)
    record["speed"] = speed(args, llm, device)
    del llm
    release_memory()
    return record


def speed(args, llm, device) -> dict[str, Any]:
    rng = np.random.default_rng(args.seed + 7)
    out = {}
    for batch in args.speed_batches:
        try:
            out[str(batch)] = measure_decode(
                llm, rng, batch, args.speed_prompt_len, args.speed_max_tokens, args.repeats, device
            )
        except Exception as exc:  # noqa: BLE001
            out[str(batch)] = error_record(exc)
    return out


def add_gpu_path_comparisons(variants: dict[str, Any]) -> None:
    """Triton/graph variants against the GPU torch path (same bf16 weights, greedy)."""
    base = variants.get("eager", {}).get("tokens")
    for name, rec in variants.items():
        if name != "eager" and base is not None and "tokens" in rec:
            rec["vs_gpu_eager"] = compare(rec["tokens"], base)


def headers(speed_batches: list[int]) -> list[str]:
    speed_cols = [f"B={b} tok/s" for b in speed_batches]
    return ["variant", "match vs cpu fp32", "first div", "same as gpu eager", *speed_cols]


def summary_rows(report: dict[str, Any], speed_batches: list[int]) -> list[list[Any]]:
    rows = []
    for name, rec in report["variants"].items():
        if "error" in rec:
            rows.append([name, rec["error"][:70], None, None, *[None] * len(speed_batches)])
            continue
        cmp, eager = rec["vs_cpu_fp32"], rec.get("vs_gpu_eager")
        prefixes = "/".join(str(c["matching_prefix"]) for c in cmp)
        divs = "/".join("-" if c["first_divergence"] is None else str(c["first_divergence"])
                        for c in cmp)  # fmt: skip
        same = None if eager is None else all(c["identical"] for c in eager)
        speeds = [rec["speed"].get(str(b), {}).get("decode_tok_s") for b in speed_batches]
        rows.append([name, f"{prefixes} of {cmp[0]['num_tokens']}", divs, same, *speeds])
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = argv_or_sys(argv)
    args = parse_args(argv)
    device = resolve_device(args.device)
    report = metadata(SCRIPT, argv, vars(args), device)
    report["ceilings"] = hardware_ceilings(device, args.no_ceilings)
    report["method"] = (
        "reference = our engine on CPU, fp32, torch ops; each variant = our engine on --device in "
        "--dtype with the reference's parameters copied in (cast); greedy, EOS ignored; "
        "matching_prefix = leading tokens equal to the reference; bf16 drift is expected"
    )
    reference, prompts, params = reference_run(args)
    report["reference"] = reference
    report["variants"] = {}
    for variant in args.variants:
        try:
            rec = run_variant(args, variant, prompts, params, reference["tokens"], device)
        except Exception as exc:  # noqa: BLE001 - record and go on with the next variant
            release_memory()
            rec = error_record(exc)
        report["variants"][variant] = rec
    add_gpu_path_comparisons(report["variants"])
    json_path = write_json(result_path(args.out, SCRIPT, device, "json"), report)
    print(format_table(headers(args.speed_batches), summary_rows(report, args.speed_batches)))
    print(f"prompt lens {reference['prompt_lens']}, {args.num_new} new tokens; wrote {json_path}")
    return report


if __name__ == "__main__":
    main()
