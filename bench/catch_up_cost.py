"""What a drafter's catch-up costs, per chunk-graph replay: the host time of launching it and
the GPU time of running it, for each chunk size q and rows 1 and 2, and the same tokens fed in
one eager forward; on a GPU each chunk size twice, its attention on the prefill kernel
(``graph``) and in short pieces on the split-K kernel (``graph-short``,
``SpecConfig.chunk_short_attention``). A catch-up round (a drafter a whole prompt behind,
``SpecConfig.catch_up_chunk``) holds the host for its replays' launches while the GPU runs
them: this says which of the two its round waits for.

Host time: the wall time of ``draft_catch_up.replay`` (inputs prepared and uploaded, the graph
replayed), the GPU idle beforehand. GPU time: CUDA events around the same replays enqueued
behind a sleep kernel (so the queue is full and the GPU never waits for the host), per replay::

    python bench/catch_up_cost.py --model dummy:qwen2.5-0.5b --sizes 16,64,256,512,1024 --out DIR

On CPU (no graphs) the chunks run eager: a smoke test of the script.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import format_table, metadata, result_path, write_json  # noqa: E402
from verifypd.engine.cuda_graphs import warm_up_eager  # noqa: E402
from verifypd.engine.draft_catch_up import replay  # noqa: E402
from verifypd.engine.draft_view import DraftView  # noqa: E402
from verifypd.engine.loader import load_model  # noqa: E402
from verifypd.engine.setup import CATCH_UP_CHUNK_BATCH, resolve_device, resolve_dtype  # noqa: E402,E501
from verifypd.engine.speculative import DraftModelProposer  # noqa: E402
from verifypd.kernels import get_ops  # noqa: E402
from verifypd.types import SamplingParams, ScheduledSeq, Sequence, StepPlan  # noqa: E402

BLOCK = 16


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="dummy:qwen2.5-0.5b", help="the drafter")
    p.add_argument("--sizes", default="16,64,256,512,1024", help="chunk sizes q")
    p.add_argument("--rows", default="1,2")
    p.add_argument("--context", type=int, default=2048, help="tokens each row feeds")
    p.add_argument("--repeats", type=int, default=5, help="timed passes (the median is kept)")
    p.add_argument("--device", default="auto")
    p.add_argument("--out", default=None, help="default: bench/results/profile/")
    p.add_argument("--tag", default="")
    return p.parse_args(argv)


def _views(drafter: DraftModelProposer, rows: int, context: int) -> list[DraftView]:
    views = []
    for i in range(rows):
        seq = Sequence(f"r{i}", [(7 * i + 3 * t) % 1000 + 1 for t in range(context)],
                       SamplingParams(max_tokens=1))  # fmt: skip
        v = drafter.view_of(seq)
        v.token_ids = list(seq.token_ids)
        assert drafter.kv.allocate(v.block_table, context)
        views.append(v)
    return views


def _feed_all(drafter: DraftModelProposer, views: list[DraftView], q: int, graphs=None) -> int:
    """Replays of q for every view from its start to one token short of its end (as a
    catch-up does), in ``graphs`` (None: eager); returns the replays."""
    for v in views:
        v.num_computed_tokens = 0
    n = 0
    while any(v.num_tokens - 1 - v.num_computed_tokens >= q for v in views):
        replay(drafter.runner, views, q, 1, graphs=graphs or {})
        n += 1
    return n


def _eager(drafter: DraftModelProposer, views: list[DraftView], tokens: int) -> None:
    for v in views:
        v.num_computed_tokens = 0
    runner = drafter.runner
    plan = StepPlan("draft", [ScheduledSeq(v, tokens) for v in views])
    runner.forward(runner.prepare(plan), [])


def _timed(fn, cuda: bool) -> tuple[float, float | None]:
    """(host seconds, GPU seconds or None): host with the GPU idle beforehand; GPU behind a
    sleep kernel long enough to cover the launches."""
    if cuda:
        torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    host = time.perf_counter() - t
    if not cuda:
        return host, None
    torch.cuda.synchronize()
    torch.cuda._sleep(int(4e6 * max(host * 1e3, 1.0)))  # ~2 ms of sleep a ms of launches
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return host, start.elapsed_time(end) / 1e3


def _median(xs: list[float | None]) -> float | None:
    vals = sorted(x for x in xs if x is not None)
    return vals[len(vals) // 2] if vals else None


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    device = resolve_device(args.device)
    dtype = resolve_dtype("auto", device)
    cuda = device.type == "cuda"
    sizes = [int(x) for x in args.sizes.split(",")]
    rows_list = [int(x) for x in args.rows.split(",")]
    max_len = args.context + max(sizes) + BLOCK
    loaded = load_model(args.model, device, dtype, get_ops(cuda, None))
    num_blocks = max(rows_list) * (-(-max_len // BLOCK)) + 8
    drafter = DraftModelProposer(loaded, num_blocks, BLOCK, device, dtype)
    graphs: dict[str, dict[int, Any]] = {}  # kind -> q -> the chunk graphs
    if cuda:
        warm_up_eager(loaded.model, drafter.pool.kv, BLOCK, max_len)
        for kind, short in (("graph", False), ("graph-short", True)):
            graphs[kind] = {
                q: drafter.runner.new_graphs(q, CATCH_UP_CHUNK_BATCH, max_len, with_logits=False,
                                             short_attention=short)
                for q in sizes
            }  # fmt: skip
    results = []
    for rows in rows_list:
        drafter.views.clear()
        drafter.kv = type(drafter.kv)(num_blocks, BLOCK, enable_prefix_caching=False)
        views = _views(drafter, rows, args.context)
        kinds = [("eager", None)] + [(k, q) for k in (graphs or {"chunks": {}}) for q in sizes]
        for kind, q in kinds:
            if kind == "eager":
                fn = functools.partial(_eager, drafter, views, args.context - 1)
                replays = 1
            else:
                chunk_graphs = graphs.get(kind)
                replays = _feed_all(drafter, views, q, chunk_graphs)  # warm
                fn = functools.partial(_feed_all, drafter, views, q, chunk_graphs)
            fn()
            timed = [_timed(fn, cuda) for _ in range(args.repeats)]
            host, gpu = _median([h for h, _ in timed]), _median([g for _, g in timed])
            fed = replays * (q or args.context - 1) * rows
            results.append({
                "kind": kind, "q": q, "rows": rows, "replays": replays, "tokens_fed": fed,
                "host_ms": round(host * 1e3, 3),
                "gpu_ms": None if gpu is None else round(gpu * 1e3, 3),
                "host_ms_per_replay": round(host * 1e3 / replays, 3),
                "gpu_ms_per_replay": None if gpu is None else round(gpu * 1e3 / replays, 3),
                "gpu_us_per_token": None if gpu is None else round(gpu * 1e6 / fed, 3),
                "host_bound": None if gpu is None else host > gpu,
            })  # fmt: skip
    report = {**metadata("catch_up_cost", argv, vars(args), device), "results": results}
    path = write_json(result_path(args.out, "catch_up_cost", device, "json", args.tag), report)
    keys = ["kind", "q", "rows", "replays", "host_ms", "gpu_ms", "host_ms_per_replay",
            "gpu_ms_per_replay", "gpu_us_per_token"]  # fmt: skip
    print(format_table(keys, [[r[k] for k in keys] for r in results]))
    print(f"wrote {path}")
    return report


if __name__ == "__main__":
    main()
