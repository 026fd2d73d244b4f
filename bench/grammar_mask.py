"""Per-step cost of structured output: the host mask fill and the device mask apply.

1. Engine choice: time to fill one next-token bitmask for a JSON schema, token by token along
   a valid output, with xgrammar and (if installed) llguidance, on the SmolLM2 tokenizer.
2. verifypd's two halves at batch B: ``engine.grammar.fill_step_masks`` (host: catch up each
   matcher by one token and fill its row) and ``apply_token_bitmask`` (device: bitmask ->
   -inf on [B, V] logits).

    python bench/grammar_mask.py [--device cpu|cuda] [--batch 1,32]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from common import csv_list, format_table, metadata, resolve_device, result_path, write_json

from verifypd.engine.grammar import (
    GrammarCompiler,
    GrammarTable,
    apply_token_bitmask,
    bitmask_words,
    fill_step_masks,
)
from verifypd.engine.tokenizer import load_tokenizer
from verifypd.types import SamplingParams, ScheduledSeq, Sequence, StructuredOutput

VOCAB = 49152
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
}
OUTPUT = json.dumps({"name": "Alice Smith", "age": 42, "tags": ["a", "bb", "ccc"], "ok": True})


def _summary(seconds: list[float]) -> dict:
    us = sorted(s * 1e6 for s in seconds)
    return {"median_us": statistics.median(us), "mean_us": statistics.fmean(us),
            "p90_us": us[int(0.9 * (len(us) - 1))], "max_us": us[-1], "n": len(us)}  # fmt: skip


def xgrammar_fill(tok, ids: list[int]) -> list[float]:
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=VOCAB)
    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA)))
    bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
    times = []
    for t in ids:
        start = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask)
        times.append(time.perf_counter() - start)
        assert matcher.accept_token(t)
    return times


def llguidance_fill(tok, ids: list[int]) -> list[float] | None:
    try:
        import llguidance
        import llguidance.hf
        import llguidance.numpy as lnp
    except ImportError:
        return None
    lt = llguidance.hf.from_tokenizer(tok, n_vocab=VOCAB)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    matcher = llguidance.LLMatcher(lt, grammar)
    bitmask = lnp.allocate_token_bitmask(1, lt.vocab_size)
    times = []
    for t in ids:
        start = time.perf_counter()
        lnp.fill_next_token_bitmask(matcher, bitmask, 0)
        times.append(time.perf_counter() - start)
        assert matcher.consume_token(t)
    return times


def step_halves(tok, ids: list[int], batch: int, device: torch.device) -> dict:
    """Per step at ``batch`` constrained sequences: the host fill and the device apply."""
    table = GrammarTable(GrammarCompiler(tok, VOCAB, [tok.eos_token_id]))
    so = StructuredOutput("json", json.dumps(SCHEMA))
    compiled = table.compile(so)
    entries = []
    for i in range(batch):
        seq = Sequence(f"r{i}", [1], SamplingParams(max_tokens=len(ids) + 1, structured=so))
        table.add(seq, compiled)
        entries.append((ScheduledSeq(seq, 1), 1))
    logits = torch.randn(batch, VOCAB, device=device)
    fill, apply = [], []
    for t in ids:
        start = time.perf_counter()
        bitmask = fill_step_masks(table, entries, {})
        fill.append(time.perf_counter() - start)
        start = time.perf_counter()
        apply_token_bitmask(logits, bitmask.to(device, non_blocking=True))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        apply.append(time.perf_counter() - start)
        for entry, _ in entries:
            entry.seq.token_ids.append(t)
    assert bitmask.shape == (batch, bitmask_words(VOCAB))
    return {"batch": batch, "host_fill": _summary(fill), "device_apply": _summary(apply)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch", type=csv_list, default=["1", "32"])
    p.add_argument("--out", default=None, help="output folder (default: bench/results/api/)")
    args = p.parse_args(argv)
    device = resolve_device(args.device)
    tok = load_tokenizer("default")
    ids = tok.encode(OUTPUT, add_special_tokens=False)
    engines = {"xgrammar": xgrammar_fill(tok, ids), "llguidance": llguidance_fill(tok, ids)}
    fills = {k: _summary(v) for k, v in engines.items() if v is not None}
    steps = [step_halves(tok, ids, int(b), device) for b in args.batch]
    rows = [
        [k, "1", v["median_us"], v["mean_us"], v["p90_us"], v["max_us"]] for k, v in fills.items()
    ]
    for s in steps:
        for half in ("host_fill", "device_apply"):
            v = s[half]
            rows.append([f"verifypd {half}", s["batch"], v["median_us"], v["mean_us"], v["p90_us"], v["max_us"]])  # fmt: skip  # noqa: E501
    print(format_table(["what", "batch", "median us", "mean us", "p90 us", "max us"], rows))
    record = metadata("grammar_mask", argv or sys.argv[1:], vars(args), device)
    record.update({"tokens": len(ids), "engine_fill": fills, "steps": steps})
    print(write_json(result_path(args.out, "grammar_mask", device, "json"), record))


if __name__ == "__main__":
    main()
