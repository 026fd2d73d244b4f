"""Real acceptance against the drafter's context window (``SpecConfig.draft_window``).

The embedded SmolLM2-135M-Instruct drafts for itself (the only real model here: with the whole
context every greedy draft is the target's own token, so acceptance is ~1), at a fixed L, over
chat prompts of 500-1,100 tokens: a passage of this repository's docs followed by a question
about it (summarize it, or quote its first sentence: the quote needs the passage's beginning,
which a window leaves out). Per window: the acceptance rate, and whether the output is
token-identical to plain greedy decoding (it must be, whatever the window).

REAL ACCEPTANCE, of a drafter that is the target itself: it shows what the window costs in
acceptance when the drafter would otherwise be perfect, not what a smaller drafter accepts.

    python bench/draft_window.py [--windows none,32,64,128,256] [--max-tokens 48]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

from common import add_common_args, csv_list, format_table, progress, start_run  # noqa: E402

from verifypd.config import EngineConfig, SpecConfig  # noqa: E402
from verifypd.lanes.async_engine import AsyncEngine  # noqa: E402
from verifypd.types import SamplingParams  # noqa: E402

SCRIPT = "draft_window"
ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("docs/design.md", "docs/performance.md", "docs/api.md")
QUESTIONS = (
    "Summarize the text above in three sentences.",
    "Quote the first sentence of the text above exactly.",
)
METHOD = (
    "SmolLM2-135M-Instruct drafting for itself (real acceptance of a perfect drafter cut to a "
    "window), fixed L, greedy, fp32; one engine per window, the same prompts"
)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_common_args(p)
    p.add_argument("--model", default="default", help="target, drafting for itself")
    p.add_argument("--windows", type=csv_list, default=["none", "32", "64", "128", "256"])
    p.add_argument("--sink", type=int, default=4, help="SpecConfig.draft_window_sink")
    p.add_argument("--draft-len", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--passage-chars", type=int, nargs="+", default=[2000, 4000])
    return p.parse_args(argv)


def passages(chars: list[int]) -> list[str]:
    """The opening ``chars`` characters of each source, cut at a paragraph end."""
    out = []
    for name in SOURCES:
        text = (ROOT / name).read_text()
        for n in chars:
            cut = text[:n]
            out.append(cut[: cut.rfind("\n\n")].strip() if "\n\n" in cut else cut)
    return out


def prompts(tok, chars: list[int]) -> list[list[int]]:
    msgs = [
        [{"role": "user", "content": f"{p}\n\n{q}"}] for p in passages(chars) for q in QUESTIONS
    ]
    chats = [tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in msgs]
    return [tok.encode(c, add_special_tokens=False) for c in chats]


def config(args: argparse.Namespace, window: int | None, speculate: bool) -> EngineConfig:
    spec = SpecConfig(
        method="draft", draft_model=args.model, controller=False, max_draft_len=args.draft_len,
        initial_draft_len=args.draft_len, draft_window=window, draft_window_sink=args.sink,
    ) if speculate else SpecConfig()  # fmt: skip
    return EngineConfig(model=args.model, device=args.device, dtype="float32", spec=spec)


async def generate(engine: AsyncEngine, ids: list[list[int]], max_tokens: int):
    """Each prompt's tokens, one prompt at a time, and the drafted / accepted counts of each."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    spec, outs, counts = engine.core.spec, [], []
    try:
        for i, prompt in enumerate(ids):
            drafted, accepted = spec.num_drafted, spec.num_accepted
            out: list[int] = []
            async for o in engine.generate(f"w{i}", prompt, params):
                out += o.new_token_ids
            outs.append(out)
            counts.append((spec.num_drafted - drafted, spec.num_accepted - accepted))
        return outs, counts
    finally:
        await engine.stop()


def run_window(args, window: int | None, ids: list[list[int]], plain: list[list[int]]) -> dict:
    engine = AsyncEngine(config(args, window, True))
    got, counts = asyncio.run(generate(engine, ids, args.max_tokens))
    per_prompt = [
        {"prompt_tokens": len(p), "question": QUESTIONS[i % len(QUESTIONS)], "drafted": d,
         "accepted": a}
        for i, (p, (d, a)) in enumerate(zip(ids, counts, strict=True))
    ]  # fmt: skip
    by_question = {}
    for q in QUESTIONS:
        rows = [p for p in per_prompt if p["question"] == q]
        d = sum(p["drafted"] for p in rows)
        by_question[q] = sum(p["accepted"] for p in rows) / d if d else None
    drafted = sum(d for d, _ in counts)
    return {
        "window": window,
        "acceptance": sum(a for _, a in counts) / drafted if drafted else None,
        "acceptance_by_question": by_question,
        "drafted": drafted,
        "accepted": sum(a for _, a in counts),
        "lossless": got == plain,
        "per_prompt": per_prompt,
    }


def main(argv: list[str] | None = None) -> Path:
    run = start_run(SCRIPT, argv, parse_args, METHOD)
    args, report = run.args, run.report
    engine = AsyncEngine(config(args, None, False))
    ids = prompts(engine.tokenizer, args.passage_chars)
    plain, _ = asyncio.run(generate(engine, ids, args.max_tokens))
    report["prompt_tokens"] = [len(p) for p in ids]
    report["acceptance_kind"] = "real (the target drafting for itself)"
    results: dict[str, Any] = {}
    for w in args.windows:
        window = None if w == "none" else int(w)
        results[w] = run_window(args, window, ids, plain)
        progress(SCRIPT, f"window {w}", results[w], ("acceptance", "lossless"))
    report["results"] = results
    rows = [[w, r["acceptance"], *r["acceptance_by_question"].values(), r["lossless"]]
            for w, r in results.items()]  # fmt: skip
    table = format_table(["window", "acceptance", "summarize", "quote", "lossless"], rows)
    return run.finish(table, lambda png: plot(png, results))


def plot(path: Path, results: dict[str, dict]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(results)
    fig, ax = plt.subplots(figsize=(7, 4))
    for q in QUESTIONS:
        vals = [results[w]["acceptance_by_question"][q] or 0.0 for w in labels]
        ax.plot(labels, vals, marker="o", label=q.split(" the")[0])
    ax.plot(labels, [results[w]["acceptance"] or 0.0 for w in labels], "k--", label="all")
    ax.set_xlabel("draft_window (tokens; sink 4)")
    ax.set_ylabel("acceptance (accepted / drafted)")
    ax.set_ylim(0, 1.05)
    ax.set_title("SmolLM2-135M drafting for itself: acceptance by drafter window (real)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


if __name__ == "__main__":
    main()
