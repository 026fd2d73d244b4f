"""Skinny-matmul sweep: our Triton GEMV (plain and with its fused prologues) against cuBLAS
(``F.linear``) on the projection shapes of the decode benchmarks, at 1..8 rows.

Weights rotate over enough copies to overflow L2 (each layer's weights are cold in a real
forward); times are CUDA-graph replays (median), the way decode runs. "% copy" is the weight
bytes read per call over the measured copy bandwidth. The sweep picks the tile config that
``choose_config`` should return; the fused rows show what one launch saves against two.

    python bench/gemv.py
    python bench/gemv.py --dry-run   # CPU, Triton interpreter, tiny shapes: logic check only
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

import torch  # noqa: E402

SCRIPT = "gemv"
MODELS = {  # name: (hidden, intermediate, q heads, kv heads, head_dim, vocab)
    "qwen2.5-0.5b": (896, 4864, 14, 2, 64, 151936),
    "qwen2.5-1.5b": (1536, 8960, 12, 2, 128, 151936),
    "qwen2.5-7b": (3584, 18944, 28, 4, 128, 152064),
}
CONFIGS_1 = [  # (block_n, block_k, num_warps, num_stages) swept at one row
    (bn, bk, w, st)
    for bn, bk, w, st in itertools.product((4, 8, 16, 32), (256, 512, 1024), (4, 8), (1, 3))
    if bn * bk <= 16384
]
CONFIGS_N = [  # swept at 2..16 rows (tensor-core tiles of 16 rows)
    (bn, bk, w, st)
    for bn, bk, w, st in itertools.product((16, 32, 64), (128, 256, 512), (4, 8), (1, 3, 4))
    if bn * bk <= 16384
]


def projections(model: str) -> dict[str, tuple[int, int]]:
    """name -> (N, K) of each decode projection."""
    hidden, inter, hq, hkv, d, vocab = MODELS[model]
    return {
        "qkv": ((hq + 2 * hkv) * d, hidden),
        "o": (hidden, hq * d),
        "gate_up": (2 * inter, hidden),
        "down": (hidden, inter),
        "lm_head": (vocab, hidden),
    }


def graph_timing(b, fn) -> dict[str, float | None]:
    """CUDA-graph replay median only (the sweep is large; eager launch cost is not the point)."""
    if b.dry_run:
        return b.measure(fn)
    import triton.testing

    return {"ms": float(triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median"))}


def weights(b, n: int, k: int) -> list[torch.Tensor]:
    copies = b.copies_for(n * k * 2)
    return [torch.randn(n, k, dtype=b.dtype, device=b.device) * 0.02 for _ in range(copies)]


def sweep_shape(b, model: str, name: str, n: int, k: int, rows: int, configs) -> dict[str, Any]:
    """Time cuBLAS and every config on one shape; returns the summary row."""
    import torch.nn.functional as F
    from kernels import rotating

    from verifypd.kernels.triton_gemv import gemv

    ws = weights(b, n, k)
    x = torch.randn(rows, k, dtype=b.dtype, device=b.device)
    nbytes = n * k * 2
    ref = F.linear(x, ws[0])
    shape = f"{model} {name} N={n} K={k} M={rows}"
    cublas = b.add("cublas", shape, b.measure(rotating(lambda i: F.linear(x, ws[i]), len(ws))),
                   nbytes=nbytes)  # fmt: skip
    best, default_row = None, None
    for bn, bk, w, st in configs:
        cfg = {"block_n": bn, "block_k": bk, "num_warps": w, "num_stages": st}
        check = b.check(gemv(x, ws[0], **cfg), ref)
        timing = graph_timing(b, rotating(lambda i, c=cfg: gemv(x, ws[i], **c), len(ws)))
        row = b.add("triton_gemv", shape, timing, nbytes=nbytes, config=cfg, **check)
        if check["ok"] and (best is None or row["ms"] < best["ms"]):
            best = row
    default_row = b.add("triton_gemv_default", shape, b.measure(
        rotating(lambda i: gemv(x, ws[i]), len(ws))), nbytes=nbytes)  # fmt: skip
    return {"shape": shape, "cublas": cublas, "best": best, "default": default_row}


def fused_rows(b, model: str, rows: int) -> list[dict[str, Any]]:
    """Each fused launch (norm+qkv+bias, norm+gate_up, SwiGLU+down+residual) over a config sweep,
    against the separate norm / SwiGLU kernel followed by the plain GEMV (default config)."""
    from kernels import rotating

    from verifypd.kernels.triton_gemv import gemv, rms_norm_gemv, silu_mul_gemv
    from verifypd.kernels.triton_rms_norm import rms_norm
    from verifypd.kernels.triton_silu_mul import silu_and_mul

    proj, out = projections(model), []
    configs = CONFIGS_1 if rows == 1 else CONFIGS_N
    configs = configs[:2] if b.dry_run else configs
    for name, prologue in (("qkv", "norm"), ("gate_up", "norm"), ("down", "silu")):
        n, k = proj[name]
        ws = weights(b, n, k)
        shape = f"{model} {prologue}+{name} M={rows}"
        if prologue == "norm":
            x = torch.randn(rows, k, dtype=b.dtype, device=b.device)
            nw = torch.rand(k, dtype=b.dtype, device=b.device) + 0.5
            bias = torch.randn(n, dtype=b.dtype, device=b.device) if name == "qkv" else None

            def fused(i, c, x=x, nw=nw, bias=bias, ws=ws):
                return rms_norm_gemv(x, nw, 1e-6, ws[i], bias, **c)

            def separate(i, x=x, nw=nw, bias=bias, ws=ws):
                return gemv(rms_norm(x, nw, 1e-6)[0], ws[i], bias)
        else:
            gu = torch.randn(rows, 2 * k, dtype=b.dtype, device=b.device)
            res = torch.randn(rows, n, dtype=b.dtype, device=b.device)

            def fused(i, c, gu=gu, res=res, ws=ws):
                return silu_mul_gemv(gu, ws[i], res, **c)

            def separate(i, gu=gu, res=res, ws=ws):
                return gemv(silu_and_mul(gu), ws[i], None, res)

        ref = separate(0)
        sep = b.add(
            "separate", shape, graph_timing(b, rotating(separate, len(ws))), nbytes=n * k * 2
        )
        best = None
        for bn, bk, w, st in configs:
            cfg = {"block_n": bn, "block_k": bk, "num_warps": w, "num_stages": st}
            check = b.check(fused(0, cfg), ref)
            timing = graph_timing(b, rotating(lambda i, c=cfg: fused(i, c), len(ws)))
            row = b.add("fused", shape, timing, nbytes=n * k * 2, config=cfg, **check)
            if check["ok"] and (best is None or row["ms"] < best["ms"]):
                best = row
        dflt = b.add("fused_default", shape, graph_timing(b, rotating(lambda i: fused(i, {}),
                     len(ws))), nbytes=n * k * 2)  # fmt: skip
        out.append({"shape": shape, "separate": sep, "fused_best": best, "fused_default": dflt})
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--models", nargs="+", default=list(MODELS))
    p.add_argument("--rows", nargs="+", type=int, default=[1])
    p.add_argument("--out", default=None, help="default: bench/results/kernels/")
    p.add_argument("--dry-run", action="store_true")
    args = p.parse_args(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
        MODELS.clear()
        MODELS["tiny"] = (64, 96, 4, 2, 16, 300)
        args.models = ["tiny"]
    from common import format_table, hardware_ceilings, metadata, result_path, write_json
    from kernels import Bench

    device = torch.device("cpu" if args.dry_run else "cuda")
    b = Bench(device, args.dry_run, hardware_ceilings(device))
    summary, table, fused_summary = [], [], []
    for model in args.models:
        for rows in args.rows:
            configs = CONFIGS_1 if rows == 1 else CONFIGS_N
            configs = configs[:2] if args.dry_run else configs
            for name, (n, k) in projections(model).items():
                s = sweep_shape(b, model, name, n, k, rows, configs)
                summary.append(s)
                best, cub, dflt = s["best"], s["cublas"], s["default"]
                table.append([s["shape"], f"{cub['ms'] * 1e3:.1f}",
                              f"{cub['frac_ceiling'] or 0:.0%}", f"{dflt['ms'] * 1e3:.1f}",
                              f"{best['ms'] * 1e3:.1f}", f"{best['frac_ceiling'] or 0:.0%}",
                              str(best["config"])])  # fmt: skip
            fused_summary.extend(fused_rows(b, model, rows))
    headers = ["shape", "cublas us", "%copy", "ours dflt us", "ours best us", "%copy", "best cfg"]
    print(format_table(headers, table))
    print(format_table(
        ["fused shape", "separate us", "fused dflt us", "fused best us", "best cfg"],
        [[f["shape"], f"{f['separate']['ms'] * 1e3:.1f}", f"{f['fused_default']['ms'] * 1e3:.1f}",
          f"{f['fused_best']['ms'] * 1e3:.1f}", str(f["fused_best"]["config"])]
         for f in fused_summary],
    ))  # fmt: skip
    report = {**metadata(SCRIPT, argv or sys.argv[1:], vars(args), device),
              "ceilings": b.ceilings, "summary": summary, "fused": fused_summary,
              "rows": b.rows}  # fmt: skip
    print("wrote", write_json(result_path(args.out, SCRIPT, device, "json"), report))


if __name__ == "__main__":
    main()
