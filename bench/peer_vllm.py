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
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

import numpy as np  # noqa: E402
from common import (  # noqa: E402
    add_common_args,
    csv_list,
    device_slug,
    error_record,
    format_table,
    metadata,
    release_memory,
    resolve_device,
    result_path,
    results_dir,
    save_figure,
    write_json,
)
from harness import AsyncLLM, engine_config, engine_info, random_prompts, spec_stats  # noqa: E402
from hf_reference import hf_config  # noqa: E402
from http_load import HttpEngine, served_model, wait_ready  # noqa: E402
from loadgen import Mix, latency_stats, load_stats, make_requests, run_load  # noqa: E402
from result_files import write_result  # noqa: E402

from verifypd.config import PRESETS, SpecConfig  # noqa: E402
from verifypd.types import SamplingParams  # noqa: E402

SCRIPT = "peer_vllm"
PARTS = ("decode", "offline", "mixed", "spec-draft", "spec-ngram")
MIXES = {
    "default": Mix((64, 256), (64, 256), (1024, 3072), (32, 128), 0.2),  # bench/mixed.py's
    "tiny": Mix((4, 16), (2, 6), (24, 48), (2, 4), 0.2),  # CPU smoke tests
}


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


# ----------------------------------------------------------------------------- workloads
def vocab_of(model: str) -> int:
    return PRESETS[model.removeprefix("dummy:")].vocab_size


def decode_prompts(args, batch: int, salt: int) -> list[list[int]]:
    rng = np.random.default_rng(args.seed * 7919 + batch * 31 + salt)
    return random_prompts(rng, [args.prompt_len] * batch, vocab_of(args.model))


def offline_workload(args) -> tuple[list[list[int]], list[int]]:
    rng = np.random.default_rng(args.seed + 17)
    lo, hi = args.offline_lens
    n = args.offline_requests
    in_lens, out_lens = rng.integers(lo, hi + 1, n), rng.integers(lo, hi + 1, n)
    return random_prompts(rng, in_lens, vocab_of(args.model)), [int(x) for x in out_lens]


def mixed_trace(args, rate: float) -> list:
    count = args.mixed_requests
    return make_requests(
        MIXES[args.mix], vocab_of(args.model), args.seed + int(rate * 1000), count, rate
    )


def greedy(n: int, detokenize: bool = False) -> SamplingParams:
    # No text by default: vLLM runs with skip_tokenizer_init (ids in, ids out), so neither
    # engine detokenizes.
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, detokenize=detokenize)


# ----------------------------------------------------------------------------- engines
class Batch:
    """Runs a list of prompts to completion through an async ``generate`` front."""

    def __init__(self, engine: Any, loop: asyncio.AbstractEventLoop) -> None:
        self.engine, self.loop, self.next_id = engine, loop, 0

    def run(self, prompts: list[list[int]], max_tokens: list[int]) -> tuple[float, int]:
        """(wall seconds, output tokens)."""
        return self.loop.run_until_complete(self._run(prompts, max_tokens))

    async def _run(self, prompts, max_tokens) -> tuple[float, int]:
        base, self.next_id = self.next_id, self.next_id + len(prompts)
        t0 = time.perf_counter()
        counts = await asyncio.gather(*(
            self._one(f"peer-{base + i}", p, n)
            for i, (p, n) in enumerate(zip(prompts, max_tokens, strict=True))
        ))  # fmt: skip
        return time.perf_counter() - t0, sum(counts)

    async def _one(self, rid: str, prompt: list[int], n: int) -> int:
        got = 0
        async for out in self.engine.generate(rid, prompt, greedy(n)):
            got += len(out.new_token_ids)
        return got


class StepLog:
    """vLLM's engine steps as its output handler sees them (the stat-logger interface: one
    ``record`` per step's outputs, in this process): when (``time.perf_counter``, the clock of
    our traces), the tokens generated, the prompts that finished (their count and tokens: vLLM
    counts a prompt's tokens at its first token, not per chunk) and the queues. Step ``i``'s
    time is the gap to step ``i - 1`` while the engine is busy: what the TTFT tail of a burst of
    long prompts is made of on the peer's side."""

    FIELDS = ("t_s", "gen_tokens", "prompts_done", "prompt_tokens_done", "running", "waiting")

    def __init__(self) -> None:
        self.rows: list[tuple[float, ...]] = []

    def record(self, scheduler_stats: Any, iteration_stats: Any, *_: Any, **__: Any) -> None:
        if iteration_stats is None:
            return
        firsts = getattr(iteration_stats, "time_to_first_tokens_iter", None) or []
        self.rows.append((
            time.perf_counter(),
            getattr(iteration_stats, "num_generation_tokens", 0),
            len(firsts),
            getattr(iteration_stats, "num_prompt_tokens", 0),
            getattr(scheduler_stats, "num_running_reqs", None),
            getattr(scheduler_stats, "num_waiting_reqs", None),
        ))  # fmt: skip

    def between(self, start: float, end: float) -> list[dict[str, Any]]:
        """The steps recorded in [start, end], ``t_ms`` from ``start`` and ``step_ms`` from the
        step before (None for the first)."""
        out: list[dict[str, Any]] = []
        last = None
        for row in self.rows:
            if start <= row[0] <= end:
                step = dict(zip(self.FIELDS, row, strict=True))
                t = step.pop("t_s")
                gap = None if last is None else round((t - last) * 1e3, 3)
                out.append({"t_ms": round((t - start) * 1e3, 3), "step_ms": gap, **step})
                last = t
        return out


def vllm_step_logger(log: StepLog) -> type:
    """A vLLM stat-logger class (its ``StatLoggerFactory``: called with the config and the
    engine index) that hands every step's stats to ``log``."""
    try:
        from vllm.v1.metrics.loggers import StatLoggerBase
    except ImportError:  # moved in later releases
        from vllm.metrics.loggers import StatLoggerBase

    class _StepLogger(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            pass

        def record(self, scheduler_stats: Any, iteration_stats: Any, *a: Any, **k: Any) -> None:
            log.record(scheduler_stats, iteration_stats)

        def log_engine_initialized(self) -> None:
            pass

    return _StepLogger


class VllmFront:
    """vLLM's ``AsyncLLM`` behind the ``generate(request_id, prompt_ids, params)`` interface of
    our ``AsyncEngine`` (deltas with ``new_token_ids``, ``finished``, ``finish_reason``).
    ``steps``: a ``StepLog`` that records vLLM's engine steps."""

    def __init__(
        self, args, model_dir: Path, spec: dict | None, max_num_seqs: int,
        steps: StepLog | None = None,
    ) -> None:  # fmt: skip
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM as VAsyncLLM

        self.engine_args = dict(
            model=str(model_dir), load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
            seed=args.seed, max_model_len=args.max_model_len, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens, block_size=16,
            num_gpu_blocks_override=args.num_kv_blocks, enable_prefix_caching=True,
            gpu_memory_utilization=args.gpu_memory_utilization, speculative_config=spec,
        )  # fmt: skip
        t0 = time.perf_counter()
        extra = {"stat_loggers": [vllm_step_logger(steps)]} if steps is not None else {}
        self.engine = VAsyncLLM.from_engine_args(AsyncEngineArgs(**self.engine_args), **extra)
        self.startup_s = time.perf_counter() - t0
        self.steps = steps

    async def generate(self, request_id: str, prompt: list[int], params: SamplingParams):
        from vllm import SamplingParams as VParams
        from vllm import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        sp = VParams(
            max_tokens=params.max_tokens, temperature=params.temperature, ignore_eos=True,
            detokenize=False, output_kind=RequestOutputKind.DELTA,
            seed=params.seed if params.temperature > 0 else None,
        )  # fmt: skip
        async for out in self.engine.generate(
            TokensPrompt(prompt_token_ids=prompt), sp, request_id
        ):
            c = out.outputs[0]
            yield _Delta(list(c.token_ids), out.finished, c.finish_reason)

    def close(self) -> None:
        self.engine.shutdown()


class _Delta:
    def __init__(self, ids: list[int], finished: bool, reason: str | None) -> None:
        self.new_token_ids, self.finished, self.finish_reason = ids, finished, reason


def vllm_spec_counters() -> dict[str, float]:
    from vllm.v1.metrics.reader import get_metrics_snapshot

    out: dict[str, float] = {}
    for m in get_metrics_snapshot():
        if m.name.startswith("vllm:spec_decode_num") and hasattr(m, "value"):
            out[m.name.removeprefix("vllm:spec_decode_")] = out.get(m.name, 0) + m.value
    return out


def write_model_dir(
    args, model: str, root: Path, tokenizer: bool = False, vocab_size: int | None = None
) -> Path:
    """An HF config directory of ``model``'s preset (vLLM loads it with dummy weights);
    ``vocab_size`` overrides the preset's (vLLM refuses a drafter whose vocabulary size differs
    from the target's, as Qwen2.5-0.5B's 151,936 does from 7B's 152,064)."""
    cfg = PRESETS[model.removeprefix("dummy:")]
    if vocab_size is not None:
        cfg = dataclasses.replace(cfg, vocab_size=vocab_size)
    path = root / model.removeprefix("dummy:")
    path.mkdir(parents=True, exist_ok=True)
    hf = hf_config(cfg)
    hf.torch_dtype = "bfloat16"
    hf.save_pretrained(path)
    if tokenizer:
        write_id_tokenizer(path, cfg.vocab_size, cfg.eos_token_ids[0] if cfg.eos_token_ids else 0)
    return path


def write_id_tokenizer(path: Path, vocab: int, eos: int) -> None:
    """A word-level tokenizer with one token ``<i>`` per id, so ``vllm serve`` can detokenize
    every id a random-weight model emits (prompts are sent as token ids)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"<{i}>": i for i in range(vocab)}, unk_token="<0>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<0>", eos_token=f"<{eos}>")
    fast.save_pretrained(path)


# ----------------------------------------------------------------------------- measurements
def measure_decode(batch_run: Batch, args, salt: int = 0) -> list[dict[str, Any]]:
    short, long = args.decode_lens
    rows = []
    for b in args.batches:
        batch_run.run(decode_prompts(args, b, salt + 99), [8] * b)  # warm-up at this batch
        times = {short: [], long: []}
        for r in range(args.repeats):
            for n in (short, long):
                secs, got = batch_run.run(decode_prompts(args, b, salt + r * 2 + n), [n] * b)
                if got != b * n:
                    raise RuntimeError(f"batch {b}: expected {b * n} tokens, got {got}")
                times[n].append(secs)
        ts, tl = float(np.median(times[short])), float(np.median(times[long]))
        # Noise can make T(long) <= T(short) on tiny CPU runs: fall back to the end-to-end step.
        fallback = tl <= ts
        step = tl / long if fallback else (tl - ts) / (long - short)
        rows.append({"batch": b, "t_short_s": ts, "t_long_s": tl, "times": times,
                     "step_ms": step * 1e3, "decode_tok_s": b / step,
                     "step_is_e2e_fallback": fallback})  # fmt: skip
    return rows


def measure_offline(run: Any, args) -> dict[str, Any]:
    prompts, out_lens = offline_workload(args)
    warm = [p[:16] for p in prompts[:8]]
    run(warm, [16] * len(warm))  # warm-up
    secs, got = run(prompts, out_lens)
    return {"num_requests": len(prompts), "wall_s": secs, "output_tokens": got,
            "requested_tokens": sum(out_lens), "input_tokens": sum(map(len, prompts)),
            "output_tok_s": got / secs}  # fmt: skip


def measure_mixed(engine: Any, loop: asyncio.AbstractEventLoop, args) -> list[dict[str, Any]]:
    rows = []
    warm = make_requests(
        MIXES[args.mix], vocab_of(args.model), args.seed + 5, 8, None, prefix="warm"
    )
    loop.run_until_complete(run_load(engine, warm, lambda i, r: greedy(r.max_tokens), 120.0))
    for rate in args.rates:
        reqs = mixed_trace(args, rate)
        traces, t0 = loop.run_until_complete(
            run_load(engine, reqs, lambda i, r: greedy(r.max_tokens), args.drain_timeout)
        )
        rows.append({"rate": rate, **mixed_stats(traces, t0, args)})
    return rows


def mixed_stats(traces: list, t_start: float, args) -> dict[str, Any]:
    load = load_stats(traces, t_start)
    ok = [t for t in traces if t.finish_reason in ("length", "stop") and t.ttft_s is not None
          and t.ttft_s * 1e3 <= args.slo_ttft_ms
          and (t.tpot_s is None or t.tpot_s * 1e3 <= args.slo_tpot_ms)]  # fmt: skip
    goodput = len(ok) / load["span_s"] if load["span_s"] else None
    return {"latency": latency_stats(traces), "load": load, "goodput_rps": goodput,
            "slo": {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms}}  # fmt: skip


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


# ----------------------------------------------------------------------------- combine
def combine(args) -> dict[str, Any]:
    parts: dict[str, dict[str, Any]] = {"verifypd": {}, "vllm": {}}
    http: dict[str, Any] = {}
    sources, meta = [], None
    for f in args.files:
        data = json.loads(Path(f).read_text())
        m = data["meta"]
        sources.append({"file": Path(f).name, "git_commit": m["git_commit"],
                        "date_utc": m["date_utc"], "device": m["device"]})  # fmt: skip
        meta = meta or data["meta"]
        if data["step"] == "http":
            http[data["engine"]] = data["result"]
        else:
            parts[data["engine"]].update(data["result"])
    rows = ratio_rows(parts, http)
    return {"meta": meta, "sources": sources, "verifypd": parts["verifypd"],
            "vllm": parts["vllm"], "http": http, "table": rows}  # fmt: skip


def _get(d: Any, *keys: Any) -> Any:
    for k in keys:
        if isinstance(d, dict):
            d = d.get(k)
        elif isinstance(d, list) and isinstance(k, int) and k < len(d):
            d = d[k]
        else:
            return None
    return d


def _decode(res: dict, part: str, batch: int) -> float | None:
    for row in _get(res, part, "decode") or []:
        if row.get("batch") == batch:
            return row["decode_tok_s"]
    return None


def ratio_rows(ours: dict, theirs: dict) -> list[dict[str, Any]]:
    """One row per comparison: (what, unit, verifypd, vLLM, verifypd / vLLM, higher_is_better)."""
    rows = []

    def add(what, unit, a, b, higher=True):
        ratio = (a / b if higher else b / a) if a and b else None
        rows.append({"what": what, "unit": unit, "verifypd": a, "vllm": b,
                     "advantage": ratio, "higher_is_better": higher})  # fmt: skip

    for part in ("decode", "spec-draft", "spec-ngram"):
        for b in (1, 64):
            add(f"{part} batch {b}", "tok/s", _decode(ours.get("verifypd", {}), part, b),
                _decode(ours.get("vllm", {}), part, b))  # fmt: skip
    off_ours = max(
        (_get(ours, "verifypd", "offline", f, "output_tok_s") or 0) for f in ("async", "llm")
    )
    add(
        "offline 256 req",
        "out tok/s",
        off_ours or None,
        _get(ours, "vllm", "offline", "async", "output_tok_s"),
    )
    for label, a_rates, b_rates in (
        (
            "in-process",
            _get(ours, "verifypd", "mixed", "rates"),
            _get(ours, "vllm", "mixed", "rates"),
        ),
        ("http", _get(theirs, "verifypd", "rates"), _get(theirs, "vllm", "rates")),
    ):
        for i, row in enumerate(a_rates or []):
            other = _get(b_rates, i)
            for key in ("ttft_ms", "itl_ms", "tpot_ms"):
                for q in ("p50", "p99"):
                    what = f"mixed {label} {row['rate']:g} req/s {key[:-3]} {q}"
                    add(what, "ms", _get(row, "latency", key, q), _get(other, "latency", key, q),
                        higher=False)  # fmt: skip
            add(f"mixed {label} {row['rate']:g} req/s goodput", "req/s", row.get("goodput_rps"),
                _get(other, "goodput_rps"))  # fmt: skip
    return rows


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


def table(rows: list[dict[str, Any]]) -> str:
    body = [
        [r["what"], r["unit"], r["verifypd"], r["vllm"],
         None if r["advantage"] is None else f"{r['advantage']:.2f}x"]
        for r in rows
    ]  # fmt: skip
    return format_table(["what", "unit", "verifypd", "vLLM", "verifypd advantage"], body)


def plot(path: Path, rows: list[dict[str, Any]]) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    good = [r for r in rows if r["advantage"]]
    fig, ax = plt.subplots(figsize=(9, 0.28 * len(good) + 1.5))
    ax.barh([r["what"] for r in good], [r["advantage"] for r in good],
            color=["tab:green" if r["advantage"] >= 1 else "tab:red" for r in good])  # fmt: skip
    ax.axvline(1.0, color="black", lw=1)
    ax.set_xlabel("verifypd advantage over vLLM (>1: verifypd better)")
    ax.invert_yaxis()
    fig.tight_layout()
    save_figure(fig, path, dpi=110)
    plt.close(fig)
    return path


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
