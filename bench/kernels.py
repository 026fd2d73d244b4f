"""Kernel microbenchmarks: each Triton kernel against the measured ceilings of the same GPU.

Measures the device-to-device copy bandwidth and a bf16 matmul TFLOP/s ceiling, then checks
every kernel against its torch reference (bf16) and times it with ``triton.testing.do_bench``
(median). Bytes count the fewest a kernel must move (K/V read once, q and out once), so
"% ceiling" is achieved GB/s over copy GB/s (memory-bound kernels) or TFLOP/s over matmul
TFLOP/s (prefill). Headline: paged decode attention at batch 64, context 2048, Qwen2.5-7B heads
(28 q heads, 4 KV heads, D=128, block 16); target >= 70% of copy bandwidth.

    python bench/kernels.py
    python bench/kernels.py --dry-run   # CPU, Triton interpreter, tiny shapes: logic check only
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

import torch  # noqa: E402  (torch does not import triton; TRITON_INTERPRET is set in main)
from kernel_shapes import (  # noqa: E402
    DECODE_TILE_SWEEP,
    DRY_SHAPES,
    GPU_SHAPES,
    PREFILL_TILE_SWEEP,
    Shapes,
    attention_bytes,
    attention_flops,
)

SCRIPT = "kernels"


class Bench:
    """Timing, ceilings and result rows of one run."""

    def __init__(self, device: torch.device, dry_run: bool, ceilings: dict[str, Any]) -> None:
        self.device, self.dry_run, self.ceilings = device, dry_run, ceilings
        self.dtype = torch.float32 if dry_run else torch.bfloat16
        self.rows: list[dict[str, Any]] = []
        l2 = torch.cuda.get_device_properties(device).L2_cache_size if not dry_run else 1 << 20
        self.l2_bytes = l2

    def measure(self, fn: Callable[[], Any]) -> dict[str, float | None]:
        """ms: GPU time per call from CUDA-graph replay (median), how the engine runs decode;
        eager_ms: plain launches (do_bench, median, L2 flushed), which adds the Python and
        Triton launch cost wherever that exceeds the kernel; cpu_us: host time per launch."""
        if self.dry_run:  # the interpreter: a smoke test of the logic, not a measurement
            fn()
            start = time.perf_counter()
            fn()
            return {"ms": (time.perf_counter() - start) * 1e3, "eager_ms": None, "cpu_us": None}
        import triton.testing

        graph_ms = triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median")
        eager_ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(20):
            fn()
        cpu_us = (time.perf_counter() - start) / 20 * 1e6
        torch.cuda.synchronize()
        return {"ms": float(graph_ms), "eager_ms": float(eager_ms), "cpu_us": cpu_us}

    def copies_for(self, nbytes: int) -> int:
        """Rotate this many input copies so that one pass overflows L2 four times (graph
        replay does not flush L2 between calls)."""
        return max(1, min(256, -(-4 * self.l2_bytes // max(nbytes, 1))))

    def add(self, kernel: str, shape: str, timing: dict, *, nbytes=0, flops=0, **extra) -> dict:
        ms = timing["ms"]
        row = {"kernel": kernel, "shape": shape, **timing, **extra}
        row["gbps"] = nbytes / ms / 1e6 if nbytes else None
        row["tflops"] = flops / ms / 1e9 if flops else None
        copy, mm = self.ceilings.get("copy_gbps"), self.ceilings.get("bf16_matmul_tflops")
        if flops and mm:
            row["frac_ceiling"] = row["tflops"] / mm
        elif nbytes and copy:
            row["frac_ceiling"] = row["gbps"] / copy
        else:
            row["frac_ceiling"] = None
        self.rows.append(row)
        return row

    def check(self, out: torch.Tensor, ref: torch.Tensor) -> dict[str, Any]:
        tol = 1e-4 if self.dry_run else 2e-2
        err = (out.float() - ref.float()).abs().max().item() if out.numel() else 0.0
        ok = bool(torch.allclose(out.float(), ref.float(), rtol=tol, atol=tol))
        return {"max_abs_err": err, "ok": ok}


# ----------------------------------------------------------------------------- paged batches
def paged_batch(b: Bench, s: Shapes, batch: int, query_len: int, context: int, copies: int = 1):
    """q, a KV pool of ``copies`` layers (rotated for L2), metadata with shuffled block tables."""
    from verifypd.kernels.metadata import AttentionMetadata

    dev, bs = b.device, s.block_size
    blocks_per_seq = -(-context // bs)
    num_blocks = batch * blocks_per_seq + 1
    table = torch.randperm(num_blocks)[: batch * blocks_per_seq].view(batch, blocks_per_seq)
    positions = torch.arange(context - query_len, context)
    slots = table[:, positions // bs] * bs + positions % bs  # [B, query_len]
    meta = AttentionMetadata(
        slot_mapping=slots.flatten().to(dev),
        query_start_loc=torch.arange(0, batch + 1, dtype=torch.int32, device=dev) * query_len,
        seq_lens=torch.full((batch,), context, dtype=torch.int32, device=dev),
        block_tables=table.to(torch.int32).to(dev),
        max_query_len=query_len,
        max_seq_len=context,
    )
    pool_shape = (copies, 2, num_blocks, bs, s.num_kv_heads, s.head_dim)
    pool = torch.randn(pool_shape, dtype=b.dtype, device=dev)
    q = torch.randn(batch * query_len, s.num_q_heads, s.head_dim, dtype=b.dtype, device=dev)
    return q, pool, meta


def rotating(fn: Callable[[int], Any], copies: int) -> Callable[[], Any]:
    state = {"i": 0}

    def call() -> Any:
        state["i"] = (state["i"] + 1) % copies
        return fn(state["i"])

    return call


def bench_split_kv(b: Bench, s: Shapes, batch: int, query_len: int, context: int, **kw) -> dict:
    """The split-K kernel: decode (query_len 1) or verify (1 + L)."""
    import triton

    from verifypd.kernels import reference
    from verifypd.kernels.triton_decode_attention import choose_num_splits, decode_attention

    elem = torch.finfo(b.dtype).bits // 8
    nbytes = attention_bytes(s, batch, query_len, context, elem)
    copies = b.copies_for(nbytes)
    q, pool, meta = paged_batch(b, s, batch, query_len, context, copies)
    scale = s.head_dim**-0.5
    out = decode_attention(q, pool[0, 0], pool[0, 1], meta, scale, **kw)
    check = b.check(out, reference.paged_attention(q, pool[0, 0], pool[0, 1], meta, scale))
    timing = b.measure(
        rotating(lambda i: decode_attention(q, pool[i, 0], pool[i, 1], meta, scale, **kw), copies)
    )
    group = s.num_q_heads // s.num_kv_heads
    block_m = max(16, triton.next_power_of_2(query_len * group))
    splits = kw.get("num_splits") or choose_num_splits(
        batch, s.num_kv_heads, context, block_m, b.device
    )
    tiles = kw.get("tiles")
    extra = {"splits": splits, "tiles": None if tiles is None else vars(tiles).copy()}
    name, shape = ("decode_attn", "") if query_len == 1 else ("verify_attn", f" q={query_len}")
    shape = f"B={batch}{shape} ctx={context}"
    return b.add(name, shape, timing, nbytes=nbytes, **extra, **check)


def own_rows(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, slots: torch.Tensor):
    """The new tokens' keys and values as the model hands them to the prompt attention: [T,
    Hkv, D] views of one [T, 2 Hkv D] buffer (row stride as in a fused qkv projection), holding
    what the cache holds at their slots."""
    num_tokens, (num_kv_heads, head_dim) = q.shape[0], kc.shape[2:]
    buf = q.new_empty(num_tokens, 2, num_kv_heads, head_dim)
    buf[:, 0] = kc.flatten(0, 1)[slots]
    buf[:, 1] = vc.flatten(0, 1)[slots]
    return buf[:, 0], buf[:, 1]


def bench_prefill(
    b: Bench, s: Shapes, name: str, batch: int, query_len: int, context: int, pages=False, **kw
):
    """The prompt attention as the engine runs it: the step's own keys and values from their
    rows (``pages``: every key through the block table, the path before ef86447)."""
    from verifypd.kernels import reference
    from verifypd.kernels.triton_prefill_attention import prefill_attention

    q, pool, meta = paged_batch(b, s, batch, query_len, context)
    kc, vc, scale = pool[0, 0], pool[0, 1], s.head_dim**-0.5
    if not pages:
        kw["k_new"], kw["v_new"] = own_rows(q, kc, vc, meta.slot_mapping)
    check = b.check(
        prefill_attention(q, kc, vc, meta, scale, **kw),
        reference.paged_attention(q, kc, vc, meta, scale),
    )
    timing = b.measure(lambda: prefill_attention(q, kc, vc, meta, scale, **kw))
    tiles = kw.get("tiles")
    extra = {"tiles": None if tiles is None else vars(tiles).copy()}
    extra["keys"] = "pages" if pages else "own rows"
    if name.startswith("verify"):  # memory-bound: a few query rows per K/V byte
        elem = torch.finfo(b.dtype).bits // 8
        extra["nbytes"] = attention_bytes(s, batch, query_len, context, elem)
    else:
        extra["flops"] = attention_flops(s, batch, query_len, context)
    shape = f"B={batch} q={query_len} ctx={context}"
    return b.add(f"{name}_attn", shape, timing, **extra, **check)


def bench_op(b: Bench, kernel: str, shape: str, make_args: Callable, nbytes: int, view=None):
    """Check ``triton_ops.<kernel>`` against the reference on identical inputs, then time it
    over rotating input copies. ``make_args(seed)`` builds the arguments; ``view(out, args)``
    picks what to compare (default: the output, or its first element)."""
    from verifypd.kernels import reference, triton_ops

    name = kernel.removesuffix("+res")
    view = view or (lambda out, args: out[0] if isinstance(out, tuple) else out)
    args, ref_args = make_args(0), make_args(0)
    check = b.check(
        view(getattr(triton_ops, name)(*args), args),
        view(getattr(reference, name)(*ref_args), ref_args),
    )
    sets = [make_args(seed) for seed in range(1, 1 + b.copies_for(nbytes))]
    op = getattr(triton_ops, name)
    timing = b.measure(rotating(lambda i: op(*sets[i]), len(sets)))
    return b.add(kernel, shape, timing, nbytes=nbytes, **check)


def bench_pointwise(b: Bench, s: Shapes, num_tokens: int) -> None:
    """store_kv, rms_norm (+residual), rope, silu_and_mul at ``num_tokens`` tokens."""
    elem = torch.finfo(b.dtype).bits // 8
    hq, hkv, d, bs, t = s.num_q_heads, s.num_kv_heads, s.head_dim, s.block_size, num_tokens

    def rand(seed: int, *shape: int, dtype: torch.dtype = b.dtype) -> torch.Tensor:
        gen = torch.Generator(b.device).manual_seed(seed)
        return torch.randn(shape, generator=gen, device=b.device, dtype=dtype)

    num_blocks = -(-t // bs) + 1
    slots = torch.randperm(num_blocks * bs, device=b.device)[:t]

    def store_args(seed: int) -> tuple:
        caches = torch.zeros(2, num_blocks, bs, hkv, d, device=b.device, dtype=b.dtype)
        return rand(seed, t, hkv, d), rand(seed + 1, t, hkv, d), caches[0], caches[1], slots

    caches_view = lambda out, args: torch.stack(args[2:4])
    bench_op(b, "store_kv", f"T={t}", store_args, 4 * t * hkv * d * elem + 8 * t, caches_view)

    weight = rand(7, s.hidden)
    norm_args = lambda seed: (rand(seed, t, s.hidden), weight, 1e-6, rand(seed + 1, t, s.hidden))
    bench_op(b, "rms_norm+res", f"T={t} N={s.hidden}", norm_args, 4 * t * s.hidden * elem)

    positions = torch.randint(0, 4096, (t,), device=b.device)
    cos_sin = rand(8, 4096, d, dtype=torch.float32)
    rope_args = lambda seed: (rand(seed, t, hq, d), rand(seed + 1, t, hkv, d), positions, cos_sin)
    nbytes = 2 * t * (hq + hkv) * d * elem + t * (d * 4 + 8)
    bench_op(b, "rope", f"T={t} Hq={hq} Hkv={hkv}", rope_args, nbytes)

    silu_args = lambda seed: (rand(seed, t, 2 * s.inter),)
    bench_op(b, "silu_and_mul", f"T={t} I={s.inter}", silu_args, 3 * t * s.inter * elem)


# ----------------------------------------------------------------------------- run
def run_all(b: Bench, s: Shapes) -> dict[str, Any]:
    from verifypd.kernels.triton_decode_attention import DecodeTiles
    from verifypd.kernels.triton_prefill_attention import PrefillTiles

    headline = bench_split_kv(b, s, s.headline[0], 1, s.headline[1])
    for batch in s.decode_batches:
        for context in s.decode_contexts:
            if (batch, context) != s.headline:
                bench_split_kv(b, s, batch, 1, context)
    for batch, query_len, context in s.split_sweep_cases:
        for splits in s.split_sweep:
            bench_split_kv(b, s, batch, query_len, context, num_splits=splits)
    for block_n, warps, stages in DECODE_TILE_SWEEP[: 1 if b.dry_run else None]:
        tiles = DecodeTiles(block_n, warps, stages)
        bench_split_kv(b, s, s.headline[0], 1, s.headline[1], tiles=tiles)
        bench_split_kv(b, s, *s.verify_tile_case, tiles=tiles)
    for case in s.verify_cases:
        bench_split_kv(b, s, *case)
    for case in s.prefill_cases:
        bench_prefill(b, s, *case)
    bench_prefill(b, s, *s.prefill_cases[0], pages=True)  # the gather it replaced
    for tiles in PREFILL_TILE_SWEEP[: 1 if b.dry_run else None]:
        bench_prefill(b, s, *s.prefill_cases[0], tiles=PrefillTiles(*tiles))
    for num_tokens in s.token_counts:
        bench_pointwise(b, s, num_tokens)
    sweep = [r for r in b.rows if r["kernel"] == "decode_attn" and r["shape"] == headline["shape"]]
    best = max(sweep, key=lambda r: r["gbps"] or 0.0)
    return {"default": headline, "best_config": best, "target_frac_of_copy": 0.70}


def print_table(rows: list[dict[str, Any]]) -> None:
    from common import format_table

    headers = ["kernel", "shape", "keys", "splits", "tiles", "ms", "eager ms", "cpu us", "GB/s"]
    headers += ["TFLOP/s", "% ceil", "ok"]
    body = [
        [
            r["kernel"], r["shape"], r.get("keys"), r.get("splits"), _tiles_str(r.get("tiles")),
            r["ms"],
            r["eager_ms"], r["cpu_us"], r["gbps"], r["tflops"],
            None if r["frac_ceiling"] is None else 100 * r["frac_ceiling"], r["ok"],
        ]
        for r in rows
    ]  # fmt: skip
    print(format_table(headers, body))
    print("ms: CUDA-graph replay (GPU time); eager ms: plain launches, includes launch cost")


def _tiles_str(tiles: dict[str, int] | None) -> str | None:
    if not tiles:
        return None
    m = f"m{tiles['block_m']}/" if "block_m" in tiles else ""
    return f"{m}n{tiles['block_n']}/w{tiles['num_warps']}/s{tiles['num_stages']}"


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default=None, help="default: bench/results/kernels/")
    p.add_argument("--dry-run", action="store_true", help="CPU interpreter, tiny shapes")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported
    elif not torch.cuda.is_available():
        print("no GPU: run with --dry-run for a CPU logic check", file=sys.stderr)
        return 2
    from common import hardware_ceilings, metadata, result_path, write_json

    device = torch.device("cpu" if args.dry_run else "cuda")
    torch.manual_seed(0)
    ceilings = hardware_ceilings(device)
    bench = Bench(device, args.dry_run, ceilings)
    shapes = DRY_SHAPES if args.dry_run else GPU_SHAPES
    headline = run_all(bench, shapes)
    print_table(bench.rows)
    out_dir = args.out or (tempfile.mkdtemp() if args.dry_run else None)
    record = {
        **metadata(SCRIPT, argv, vars(args), device),
        "ceilings": ceilings,
        "shapes": vars(shapes),
        "headline": headline,
        "rows": bench.rows,
    }
    path = write_json(result_path(out_dir, SCRIPT, device, "json"), record)
    print(f"headline decode: {_headline_line(headline)}")
    print(f"wrote {path}")
    return 0 if all(r["ok"] for r in bench.rows) else 1


def _headline_line(headline: dict[str, Any]) -> str:
    row = headline["default"]
    frac = row["frac_ceiling"]
    pct = "n/a" if frac is None else f"{100 * frac:.0f}% of copy bandwidth (target 70%)"
    return f"{row['shape']}: {row['ms']:.3f} ms, {row['gbps']:.0f} GB/s, {pct}"


if __name__ == "__main__":
    sys.exit(main())
