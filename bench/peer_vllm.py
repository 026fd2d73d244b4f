"""verifypd against vLLM itself: the same workloads, the same traces, the same GPU, one sitting,
one engine at a time.

Both engines serve the same shapes with random weights (ours: ``dummy:PRESET``; vLLM:
``load_format="dummy"`` on a config directory written from the same preset), bf16, the same
``max_model_len``, ``max_num_seqs``, ``max_num_batched_tokens``, block size 16 and the same
number of KV blocks (vLLM: ``num_gpu_blocks_override``). Prompts are random token ids; greedy,
EOS ignored. vLLM runs through ``AsyncLLM`` in-process (the engine behind its server) and
through ``vllm serve``; verifypd through ``AsyncEngine`` (the lanes, its server's engine) and,
for the offline rows, ``LLM.generate`` too.

Workloads (``--parts``):
  decode      batch 1 and 64: decode tok/s = B x (288 - 32) / (T(288) - T(32)) (the method of
              the spot check that opened the vLLM-peer issue), prompt 128 tokens
  offline     256 requests, input and output lengths U[100, 1024], all submitted at once
  mixed       bench/mixed.py's request mix at --rates (Poisson, seeded, identical for both):
              TTFT / ITL / TPOT p50/p99 and goodput under the SLO (TTFT <= --slo-ttft-ms and
              TPOT <= --slo-tpot-ms), no speculation
  spec-draft  decode with a useless drafter (dummy 0.5B: real acceptance ~0), L = 4
  spec-ngram  decode with n-gram prompt lookup (L = 4) on the same prompts; acceptance as each
              engine reports it (the two engines' random weights differ, so do their outputs)
  http        --part http: the mixed trace through each OpenAI server with one HTTP client
              (bench/http_load.py), one server at a time

Steps (each writes ``peer_vllm-<device>-<engine>-<part>.json`` under --out):
    python bench/peer_vllm.py run --engine verifypd --parts decode,offline,mixed
    python bench/peer_vllm.py run --engine vllm --parts decode,offline,mixed   # vLLM installed
    python bench/peer_vllm.py http --engine verifypd      # then --engine vllm
    python bench/peer_vllm.py combine FILES...            # one JSON, the ratio table, a PNG
    python bench/peer_vllm.py sweep --engine vllm --from MIXED_SWEEP.json  # issue 14's sweep
                              # (bench/peer_sweep.py; merge with bench/sweep_report.py)
CPU smoke test of the verifypd side:
    python bench/peer_vllm.py run --engine verifypd --device cpu --model dummy:tiny \
        --parts decode --batches 1 2 --decode-lens 4 8 --prompt-len 8
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

from common import (  # noqa: E402
    add_common_args,
    csv_list,
    device_slug,
    error_record,
    metadata,
    release_memory,
    resolve_device,
    result_path,
    results_dir,
    write_json,
)
from harness import AsyncLLM, engine_config, engine_info, spec_stats  # noqa: E402
from http_load import HttpEngine, served_model, wait_ready  # noqa: E402
from loadgen import make_requests, run_load  # noqa: E402
from peer_engines import (  # noqa: E402
    Batch,
    StepLog,  # noqa: F401 (peer_sweep reads it from this module)
    VllmFront,
    greedy,
    vllm_spec_counters,
    write_model_dir,
)
from peer_report import combine, plot, table  # noqa: E402
from peer_workloads import (  # noqa: E402
    MIXES,
    measure_decode,
    measure_mixed,
    measure_offline,
    mixed_stats,
    mixed_trace,
    vocab_of,
)
from result_files import write_result  # noqa: E402

from verifypd.config import SpecConfig  # noqa: E402

SCRIPT = "peer_vllm"
PARTS = ("decode", "offline", "mixed", "spec-draft", "spec-ngram")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("step", choices=["run", "http", "combine", "sweep"])
    p.add_argument(
        "--from",
        dest="source",
        default=None,
        help="sweep: the bench/mixed.py --sweep JSON whose traces to replay",
    )
    p.add_argument("files", nargs="*", help="combine: the part JSON files")
    p.add_argument("--engine", choices=["verifypd", "vllm"], default="verifypd")
    p.add_argument("--parts", type=csv_list, default=list(PARTS[:3]))
    p.add_argument("--model", default="dummy:qwen2.5-7b")
    p.add_argument("--draft-model", default="dummy:qwen2.5-0.5b")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    p.add_argument("--decode-lens", type=int, nargs=2, default=[32, 288])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--offline-requests", type=int, default=256)
    p.add_argument("--offline-lens", type=int, nargs=2, default=[100, 1024])
    p.add_argument("--rates", type=float, nargs="+", default=[4.0, 8.0, 12.0])
    p.add_argument("--mixed-requests", type=int, default=120)
    p.add_argument("--mix", choices=sorted(MIXES), default="default", help="mixed request sizes")
    p.add_argument("--mixed-max-num-seqs", type=int, default=256)
    p.add_argument("--drain-timeout", type=float, default=30.0)
    p.add_argument("--slo-ttft-ms", type=float, default=200.0)
    p.add_argument("--slo-tpot-ms", type=float, default=15.0)
    p.add_argument("--draft-len", type=int, default=4)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--num-kv-blocks", type=int, default=16384, help="both engines, block size 16")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85, help="vLLM")
    p.add_argument("--port", type=int, default=8123)
    p.add_argument("--server-timeout", type=float, default=420.0)
    p.add_argument("--fronts", type=csv_list, default=["async", "llm"], help="verifypd offline")
    p.add_argument("--trace-steps", action="store_true",
                   help="sweep, vLLM: record its engine steps per run (StepLog)")  # fmt: skip
    add_common_args(p)
    args = p.parse_args(argv)
    if set(args.parts) - set(PARTS):
        p.error(f"--parts: choose from {PARTS}")
    if args.step == "sweep" and not args.source:
        p.error("sweep needs --from OURS.json (a bench/mixed.py --sweep result)")
    return args


# ----------------------------------------------------------------------------- run step
def run_verifypd(args, device) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for part in args.parts:
        try:
            out[part] = verifypd_part(args, device, part)
        except Exception as exc:  # noqa: BLE001 - one failed part is a result, not a crash
            out[part] = {"error": error_record(exc)}
        print_part(part, out[part])
        release_memory()
    return out


def verifypd_config(args, device, part: str, max_num_seqs: int):
    spec = None
    if part == "spec-draft":
        spec = SpecConfig(
            method="draft", draft_model=args.draft_model, max_draft_len=args.draft_len,
            initial_draft_len=args.draft_len,
        )  # fmt: skip
    elif part == "spec-ngram":
        spec = SpecConfig(method="ngram", max_draft_len=args.draft_len,
                          initial_draft_len=args.draft_len)  # fmt: skip
    return engine_config(
        args.model, device.type, args.dtype, args.seed, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
        num_blocks=args.num_kv_blocks, spec=spec,
    )  # fmt: skip


def verifypd_part(args, device, part: str) -> dict[str, Any]:
    seqs = args.mixed_max_num_seqs if part == "mixed" else args.max_num_seqs
    cfg = verifypd_config(args, device, part, seqs)
    if part == "offline":
        return {front: verifypd_offline(cfg, args, front) for front in args.fronts}
    t0 = time.perf_counter()
    llm = AsyncLLM(cfg)
    res: dict[str, Any] = {"startup_s": time.perf_counter() - t0, "engine": engine_info(llm)}
    try:
        if part == "mixed":
            res["rates"] = measure_mixed(llm.engine, llm.loop, args)
        else:
            res["decode"] = measure_decode(Batch(llm.engine, llm.loop), args)
            res["spec_stats"] = spec_stats(llm)
    finally:
        llm.close()
    return res


def verifypd_offline(cfg, args, front: str) -> dict[str, Any]:
    from verifypd.llm import LLM

    if front == "async":
        llm = AsyncLLM(cfg)
        batch = Batch(llm.engine, llm.loop)
        try:
            return measure_offline(batch.run, args)
        finally:
            llm.close()
    llm = LLM(config=cfg)

    def run(prompts, lens):
        t0 = time.perf_counter()
        outs = llm.generate(prompts, [greedy(n) for n in lens])
        return time.perf_counter() - t0, sum(len(o.token_ids) for o in outs)

    return measure_offline(run, args)


def run_vllm(args) -> dict[str, Any]:
    import vllm

    root = Path(os.environ.get("PEER_MODEL_DIR", "/tmp/peer_models"))
    target = write_model_dir(args, args.model, root)
    out: dict[str, Any] = {"vllm_version": vllm.__version__}
    groups = [("base", [p for p in args.parts if p in ("decode", "offline", "mixed")])]
    groups += [(p, [p]) for p in args.parts if p.startswith("spec-")]
    for name, parts in groups:
        if parts:
            out.update(vllm_group(args, target, root, name, parts))
    return out


def vllm_spec_config(args, root: Path, name: str) -> dict | None:
    if name == "spec-draft":
        draft = write_model_dir(args, args.draft_model, root, vocab_size=vocab_of(args.model))
        return {"method": "draft_model", "model": str(draft),
                "num_speculative_tokens": args.draft_len}  # fmt: skip
    if name == "spec-ngram":
        return {"method": "ngram", "num_speculative_tokens": args.draft_len,
                "prompt_lookup_max": 4, "prompt_lookup_min": 1}  # fmt: skip
    return None


def vllm_group(args, target: Path, root: Path, name: str, parts: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    seqs = args.mixed_max_num_seqs if parts == ["mixed"] else args.max_num_seqs
    try:
        front = VllmFront(args, target, vllm_spec_config(args, root, name), seqs)
    except Exception as exc:  # noqa: BLE001
        return {p: {"error": error_record(exc)} for p in parts}
    meta = {"startup_s": front.startup_s, "engine_args": front.engine_args}
    for part in parts:
        try:
            before = vllm_spec_counters()
            res = dict(meta)
            if part == "mixed":
                res["rates"] = measure_mixed(front, loop, args)
            elif part == "offline":
                res["async"] = measure_offline(Batch(front, loop).run, args)
            else:
                res["decode"] = measure_decode(Batch(front, loop), args)
            after = vllm_spec_counters()
            res["spec_stats"] = {k: after[k] - before.get(k, 0) for k in after}
            out[part] = res
        except Exception as exc:  # noqa: BLE001
            out[part] = {"error": error_record(exc)}
        print_part(part, out[part])
    front.close()
    loop.close()
    release_memory()
    return out


# ----------------------------------------------------------------------------- http step
def server_command(args, engine: str, model_dir: Path | None) -> list[str]:
    common = ["--port", str(args.port), "--max-num-seqs", str(args.mixed_max_num_seqs),
              "--max-model-len", str(args.max_model_len)]  # fmt: skip
    if engine == "verifypd":
        return [sys.executable, "-m", "verifypd", "serve", "--model", args.model,
                "--num-kv-blocks", str(args.num_kv_blocks), *common]  # fmt: skip
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
            str(model_dir), "--load-format", "dummy", "--dtype", "bfloat16", "--seed",
            str(args.seed), "--num-gpu-blocks-override", str(args.num_kv_blocks),
            "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--block-size", "16",
            "--gpu-memory-utilization", str(args.gpu_memory_utilization), *common]  # fmt: skip


def run_http(args) -> dict[str, Any]:
    model_dir = None
    if args.engine == "vllm":
        root = Path(os.environ.get("PEER_MODEL_DIR", "/tmp/peer_models"))
        model_dir = write_model_dir(args, args.model, root, tokenizer=True)
    cmd = server_command(args, args.engine, model_dir)
    log = open(out_dir(args) / f"{SCRIPT}-server-{args.engine}.log", "w")  # noqa: SIM115
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        return asyncio.run(http_load(args, cmd, proc, t0))
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


async def http_load(args, cmd: list[str], proc, t0: float) -> dict[str, Any]:
    base = f"http://127.0.0.1:{args.port}"
    await wait_ready(base, args.server_timeout, proc)
    res: dict[str, Any] = {"command": cmd, "startup_s": time.perf_counter() - t0, "rates": []}
    extra = {"return_token_ids": True}  # both servers: exact token counts per chunk
    async with HttpEngine(base, await served_model(base), extra) as http:
        warm = make_requests(
            MIXES[args.mix], vocab_of(args.model), args.seed + 5, 8, None, prefix="warm"
        )
        await run_load(http, warm, lambda i, r: greedy(r.max_tokens), 120.0)
        for rate in args.rates:
            traces, ts = await run_load(
                http, mixed_trace(args, rate), lambda i, r: greedy(r.max_tokens),
                args.drain_timeout,
            )  # fmt: skip
            res["rates"].append({"rate": rate, **mixed_stats(traces, ts, args)})
            print_part(f"http {rate}", {"rates": [res["rates"][-1]]})
    return res


def print_part(part: str, res: dict[str, Any]) -> None:
    if "error" in res:
        print(f"[{SCRIPT}] {part}: ERROR {res['error'].get('message', res['error'])}", flush=True)
        return
    for row in res.get("decode") or []:
        print(f"[{SCRIPT}] {part} b{row['batch']}: {row['decode_tok_s']:.1f} tok/s "
              f"({row['step_ms']:.2f} ms/step)", flush=True)  # fmt: skip
    for row in res.get("rates") or []:
        lat = row["latency"]
        print(f"[{SCRIPT}] {part} {row['rate']} req/s: TTFT p99 {lat['ttft_ms']['p99']} ITL p99 "
              f"{lat['itl_ms']['p99']} TPOT p99 {lat['tpot_ms']['p99']} goodput "
              f"{row['goodput_rps']}", flush=True)  # fmt: skip
    for front in ("async", "llm"):
        if isinstance(res.get(front), dict) and "output_tok_s" in res[front]:
            print(
                f"[{SCRIPT}] {part} {front}: {res[front]['output_tok_s']:.1f} out tok/s", flush=True
            )


# ----------------------------------------------------------------------------- main
def out_dir(args) -> Path:
    """--out, or this script's topic folder of bench/results/ (created)."""
    path = Path(args.out) if args.out else results_dir(SCRIPT)
    path.mkdir(parents=True, exist_ok=True)
    return path


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    device = resolve_device(args.device)
    if args.step == "combine":
        data = combine(args)
        tag = args.tag or "combined"
        slug = device_slug(data["meta"]["device"]) if data["meta"] else "unknown"
        path = write_json(out_dir(args) / f"{SCRIPT}-{slug}-{device_slug(tag)}.json", data)
        png = plot(path.with_suffix(".png"), data["table"])
        print(table(data["table"]))
        print(f"wrote {path}" + (f" and {png}" if png else ""))
        return data
    meta = metadata(SCRIPT, argv, vars(args), device)
    if args.step == "sweep":
        from peer_sweep import run_sweep

        data = {**meta, "engine": args.engine, **run_sweep(args, device, sys.modules[__name__])}
        tag = "-".join([args.engine, "sweep", args.tag]).strip("-")
        # --trace-steps: vLLM's engine steps go to the sidecar (result_files.py)
        path = write_result(result_path(args.out, SCRIPT, device, "json", tag), data)
        print(f"wrote {path}")
        return data
    if args.step == "http":
        result = run_http(args)
    elif args.engine == "vllm":
        result = run_vllm(args)
    else:
        result = run_verifypd(args, device)
    tag = "-".join(
        [args.engine, args.step if args.step == "http" else "+".join(args.parts), args.tag]
    )
    data = {"meta": meta, "step": args.step, "engine": args.engine, "result": result}
    path = write_json(result_path(args.out, SCRIPT, device, "json", tag.strip("-")), data)
    print(f"wrote {path}")
    return data


if __name__ == "__main__":
    main()
