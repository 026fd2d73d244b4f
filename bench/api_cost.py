"""Per-step cost of the API features that add work to a decode step: log-probabilities (top-N)
and grammar-constrained output, at batch 1 and 32, as a fraction of the plain step.

Step time = (T(long) - T(short)) / (long - short) through ``AsyncEngine`` (the lanes), the
median of --repeats, every variant on the same engine and prompts. A random-weight model cannot
write JSON, so the grammar variant uses a regex that every token of the vocabulary can extend,
``(<[0-9]+>)+`` over a word-level tokenizer with one token ``<i>`` per id (written at start):
the grammar engine still walks the whole vocabulary for every mask, which is the cost measured.

    python bench/api_cost.py                        # GPU: dummy:qwen2.5-7b, batches 1 32
    python bench/api_cost.py --device cpu --model dummy:tiny --batches 1 2 --lens 2 4
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

import numpy as np  # noqa: E402
from common import (  # noqa: E402
    add_common_args,
    csv_list,
    error_record,
    format_table,
    metadata,
    resolve_device,
    result_path,
    write_json,
)
from harness import AsyncLLM, engine_config, engine_info, random_prompts  # noqa: E402
from peer_engines import Batch, write_id_tokenizer  # noqa: E402

from verifypd.config import PRESETS  # noqa: E402
from verifypd.types import SamplingParams, StructuredOutput  # noqa: E402

SCRIPT = "api_cost"
REGEX = "(<[0-9]+>)+"
VARIANTS = {
    "plain": {},
    "logprobs20": {"logprobs": 20},
    "regex": {"structured": StructuredOutput("regex", REGEX)},
    "logprobs20+regex": {"logprobs": 20, "structured": StructuredOutput("regex", REGEX)},
}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="dummy:qwen2.5-7b")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    p.add_argument("--lens", type=int, nargs=2, default=[16, 144], help="short and long outputs")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--variants", type=csv_list, default=list(VARIANTS))
    add_common_args(p)
    return p.parse_args(argv)


class ParamBatch(Batch):
    """``Batch`` with the variant's sampling parameters instead of plain greedy ones."""

    def __init__(self, engine: Any, loop: Any, extra: dict[str, Any]) -> None:
        super().__init__(engine, loop)
        self.extra = extra

    async def _one(self, rid: str, prompt: list[int], n: int) -> int:
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **self.extra)
        got = 0
        async for out in self.engine.generate(rid, prompt, params):
            got += len(out.new_token_ids)
        return got


def step_ms(batch_run: ParamBatch, args, batch: int, vocab: int) -> dict[str, Any]:
    rng = np.random.default_rng(args.seed + batch)
    short, long = args.lens
    batch_run.run(random_prompts(rng, [args.prompt_len] * batch, vocab), [4] * batch)  # warm-up
    times: dict[int, list[float]] = {short: [], long: []}
    for _ in range(args.repeats):
        for n in (short, long):
            secs, got = batch_run.run(random_prompts(rng, [args.prompt_len] * batch, vocab),
                                      [n] * batch)  # fmt: skip
            if got != batch * n:
                raise RuntimeError(f"expected {batch * n} tokens, got {got}")
            times[n].append(secs)
    t_short, t_long = float(np.median(times[short])), float(np.median(times[long]))
    fallback = t_long <= t_short  # CPU noise: the end-to-end step instead
    step = t_long / long if fallback else (t_long - t_short) / (long - short)
    return {"batch": batch, "step_ms": step * 1e3, "times": times, "step_is_e2e_fallback": fallback}


def run(args, device) -> dict[str, Any]:
    vocab = PRESETS[args.model.removeprefix("dummy:")].vocab_size
    with tempfile.TemporaryDirectory(prefix="api_cost_tok_") as tok_dir:
        write_id_tokenizer(Path(tok_dir), vocab, 0)
        cfg = engine_config(args.model, device.type, args.dtype, args.seed,
                            max_num_seqs=max(args.batches), max_model_len=args.max_model_len,
                            tokenizer=tok_dir)  # fmt: skip
        llm = AsyncLLM(cfg)  # the tokenizer is read here; the folder can go after
    out: dict[str, Any] = {"engine": engine_info(llm), "variants": {}}
    try:
        for name in args.variants:
            runner = ParamBatch(llm.engine, llm.loop, VARIANTS[name])
            try:
                out["variants"][name] = [step_ms(runner, args, b, vocab) for b in args.batches]
            except Exception as exc:  # noqa: BLE001 - a failed variant is a result
                out["variants"][name] = {"error": error_record(exc)}
    finally:
        llm.close()
    return out


def rows(result: dict[str, Any], batches: list[int]) -> list[list[Any]]:
    plain = {r["batch"]: r["step_ms"] for r in result["variants"].get("plain", [])}
    table = []
    for name, res in result["variants"].items():
        if isinstance(res, dict):
            table.append([name, "-", res["error"]["error"][:60], "-"])
            continue
        for r in res:
            base = plain.get(r["batch"])
            frac = f"{(r['step_ms'] - base) / base:+.1%}" if base else "-"
            table.append([name, r["batch"], round(r["step_ms"], 3), frac])
    return table


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    device = resolve_device(args.device)
    data = {**metadata(SCRIPT, argv, vars(args), device), "result": run(args, device)}
    table = data["table"] = rows(data["result"], args.batches)
    print(format_table(["variant", "batch", "step ms", "vs plain"], table))
    path = write_json(result_path(args.out, SCRIPT, device, "json", args.tag), data)
    print(f"wrote {path}")
    return data


if __name__ == "__main__":
    main()
