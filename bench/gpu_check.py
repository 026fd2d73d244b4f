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
    csv_list,
    error_record,
    format_table,
    progress,
    release_memory,
    start_run,
)
from decode_timing import VARIANTS, measure_decode  # noqa: E402
from harness import (  # noqa: E402
    blocks_for,
    engine_config,
    engine_info,
    random_prompts,
    run_generate,
)

SCRIPT = "gpu_check"


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
    p.add_argument("--no-margins", action="store_true", help="skip the fp32 logit gaps")
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
        max_model_len=args.max_model_len,
        num_blocks=blocks_for(args.num_prompts, args.max_prompt_len + args.num_new + 8),
        prefix_caching=False, use_triton=False, cuda_graphs=False,
    )  # fmt: skip
    llm = LLM(config=cfg)
    prompts = check_prompts(args, llm.core.model_config.vocab_size)
    tokens = [o.token_ids for o in run_generate(llm, prompts, args.num_new)]
    model = llm.core.loaded.model
    record = {
        "engine": engine_info(llm),
        "tokens": tokens,
        "prompt_lens": [len(p) for p in prompts],
    }
    del llm
    release_memory()
    return record, prompts, model


class ReferenceScorer:
    """fp32 next-token logits of the CPU reference model for any context (one plain prefill
    into a private KV tensor), to tell bf16 near-ties from real disagreements."""

    def __init__(self, model: torch.nn.Module, block_size: int = 16) -> None:
        self.model, self.block_size = model, block_size

    @torch.no_grad()
    def logits(self, ids: list[int]) -> torch.Tensor:
        from verifypd.kernels.metadata import AttentionMetadata

        cfg, n, bs = self.model.cfg, len(ids), self.block_size
        num_blocks = -(-n // bs)
        kv = torch.zeros(cfg.num_layers, 2, num_blocks, bs, cfg.num_kv_heads, cfg.head_dim)
        i32 = torch.int32
        meta = AttentionMetadata(
            slot_mapping=torch.arange(n), query_start_loc=torch.tensor([0, n], dtype=i32),
            seq_lens=torch.tensor([n], dtype=i32),
            block_tables=torch.arange(num_blocks, dtype=i32)[None],
            max_query_len=n, max_seq_len=n, query_lens_cpu=[n], seq_lens_cpu=[n],
        )  # fmt: skip
        hidden = self.model(torch.tensor(ids), torch.arange(n), kv.to(self._dtype), meta)
        return self.model.compute_logits(hidden[-1:])[0]

    @property
    def _dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def margin(self, context: list[int], ref_pick: int, other_pick: int) -> dict[str, Any]:
        """How far apart the two picks are in the fp32 logits after ``context``."""
        logits = self.logits(context)
        top2 = logits.topk(2).values
        return {
            "ref_pick": ref_pick,
            "other_pick": other_pick,
            "fp32_argmax_is_ref_pick": int(logits.argmax()) == ref_pick,
            "top1_minus_top2": float(top2[0] - top2[1]),
            "ref_pick_minus_other_pick": float(logits[ref_pick] - logits[other_pick]),
            "other_pick_rank": int((logits > logits[other_pick]).sum()),
            "logit_std": float(logits.std()),
        }


def add_margins(cmp, prompts, tokens, reference, scorer: ReferenceScorer | None) -> None:
    """At each first divergence: the fp32 logit gap between the two picks on the shared prefix."""
    if scorer is None:
        return
    for c, prompt, got, ref in zip(cmp, prompts, tokens, reference, strict=True):
        d = c["first_divergence"]
        if d is None or d >= min(len(got), len(ref)):
            continue
        try:
            c["fp32_margin"] = scorer.margin(prompt + ref[:d], ref[d], got[d])
        except Exception as exc:  # noqa: BLE001 - the margin is a diagnostic, not the check
            c["fp32_margin"] = error_record(exc)


@torch.no_grad()
def copy_weights(model: torch.nn.Module, source: torch.nn.Module) -> int:
    """Copies (and casts) the reference weights into ``model``'s parameters in place."""
    own, params = dict(model.named_parameters()), dict(source.named_parameters())
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


def run_variant(args, variant: str, prompts, source, reference, device) -> dict[str, Any]:
    from verifypd.llm import LLM

    cfg = engine_config(
        args.model, args.device, args.dtype, args.seed, max_num_seqs=max_seqs(args),
        max_model_len=args.max_model_len,
        max_num_batched_tokens=max(8192, max_seqs(args) * args.speed_prompt_len),
        num_blocks=num_blocks(args), prefix_caching=False, **VARIANTS[variant],
    )  # fmt: skip
    llm = LLM(config=cfg)
    record: dict[str, Any] = {"engine": engine_info(llm)}
    record["num_params_copied"] = copy_weights(llm.core.loaded.model, source)
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


def add_gpu_path_comparisons(variants: dict[str, Any], prompts, scorer) -> None:
    """Triton/graph variants against the GPU torch path (same bf16 weights, greedy)."""
    base = variants.get("eager", {}).get("tokens")
    for name, rec in variants.items():
        if name == "eager" or base is None or "tokens" not in rec or "vs_gpu_eager" in rec:
            continue
        rec["vs_gpu_eager"] = compare(rec["tokens"], base)
        add_margins(rec["vs_gpu_eager"], prompts, rec["tokens"], base, scorer)


def headers(speed_batches: list[int]) -> list[str]:
    speed_cols = [f"B={b} tok/s" for b in speed_batches]
    return ["variant", "match vs cpu fp32", "first div", "fp32 gap/std at div", "same as gpu eager",
            *speed_cols]  # fmt: skip


def summary_rows(report: dict[str, Any], speed_batches: list[int]) -> list[list[Any]]:
    rows = []
    for name, rec in report["variants"].items():
        if "error" in rec:
            rows.append([name, rec["error"][:70], None, None, None, *[None] * len(speed_batches)])
            continue
        cmp, eager = rec["vs_cpu_fp32"], rec.get("vs_gpu_eager")
        prefixes = "/".join(str(c["matching_prefix"]) for c in cmp)
        divs = "/".join("-" if c["first_divergence"] is None else str(c["first_divergence"])
                        for c in cmp)  # fmt: skip
        same = None if eager is None else all(c["identical"] for c in eager)
        speeds = [rec["speed"].get(str(b), {}).get("decode_tok_s") for b in speed_batches]
        gaps = "/".join(_gap(c) for c in cmp)
        rows.append([name, f"{prefixes} of {cmp[0]['num_tokens']}", divs, gaps, same, *speeds])
    return rows


def _gap(c: dict[str, Any]) -> str:
    """The fp32 logit gap between the two picks at the divergence, in logit standard deviations
    (near 0: a near-tie that bf16 rounding can flip)."""
    m = c.get("fp32_margin") or {}
    if "ref_pick_minus_other_pick" not in m:
        return "-"
    return f"{m['ref_pick_minus_other_pick'] / max(m['logit_std'], 1e-12):.2g}"


METHOD = (
    "reference = our engine on CPU, fp32, torch ops; each variant = our engine on --device in "
    "--dtype with the reference's parameters copied in (cast); greedy, EOS ignored; "
    "matching_prefix = leading tokens equal to the reference; bf16 drift is expected; "
    "fp32_margin = the CPU fp32 model's logits on the shared prefix at the first divergence: "
    "a gap between the two picks that is small against logit_std means a near-tie (drift)"
)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    run = start_run(SCRIPT, argv, parse_args, METHOD)
    args, report, device = run.args, run.report, run.device
    del report["results"]  # this report's measurements are "reference" and "variants"
    reference, prompts, source = reference_run(args)
    scorer = None if args.no_margins else ReferenceScorer(source)
    report["reference"], report["variants"] = reference, {}
    run.save()
    for variant in args.variants:
        try:
            rec = run_variant(args, variant, prompts, source, reference["tokens"], device)
        except Exception as exc:  # noqa: BLE001 - record and go on with the next variant
            rec = error_record(exc)
        release_memory()
        if "vs_cpu_fp32" in rec:
            add_margins(rec["vs_cpu_fp32"], prompts, rec["tokens"], reference["tokens"], scorer)
        report["variants"][variant] = rec
        prefixes = [c["matching_prefix"] for c in rec.get("vs_cpu_fp32", [])]
        progress(
            SCRIPT,
            variant,
            {"matching_prefix_vs_cpu": prefixes or None, **rec},
            ["matching_prefix_vs_cpu"],
        )
        add_gpu_path_comparisons(report["variants"], prompts, scorer)
        run.save()  # a killed run keeps what it measured
    table = format_table(headers(args.speed_batches), summary_rows(report, args.speed_batches))
    run.finish(f"{table}\nprompt lens {reference['prompt_lens']}, {args.num_new} new tokens")
    return report


if __name__ == "__main__":
    main()
