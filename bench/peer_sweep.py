"""``peer_vllm.py sweep --from OURS.json``: the rate sweep of a ``bench/mixed.py --sweep`` run
replayed through vLLM's ``AsyncLLM`` (``--engine vllm``, no speculation, rows of mode ``vllm``)
or through verifypd's ``AsyncEngine`` without speculation (``--engine verifypd``: the same
path, testable on CPU). The plan (mix, seed, rates, temperatures, SLO, request count and time
bound) and the engine sizes (max_num_seqs, max_num_batched_tokens, KV blocks, context) are read
from OURS.json, so every request is identical. No speculation means no acceptance: one run per
(rate, temperature), its row repeated for every acceptance profile of the plan
(``shared_across_profiles``). vLLM is imported only on the vLLM path."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

from loadgen import make_requests, run_load
from sweep import SweepPlan, burn_in, plan_fingerprint, run_trace, summary_row

from verifypd.types import SamplingParams

ENGINE_KNOBS = ("model", "max_num_seqs", "max_num_batched_tokens", "num_kv_blocks",
                "max_model_len", "seed")  # fmt: skip


def sweep_args(args, ours: dict[str, Any]) -> argparse.Namespace:
    """``args`` with the engine knobs of the verifypd sweep (the same sizes on both sides)."""
    merged = argparse.Namespace(**vars(args))
    for key in ENGINE_KNOBS:
        if ours["params"].get(key) is not None:
            setattr(merged, key, ours["params"][key])
    return merged


def run_sweep(args, device, peer) -> dict[str, Any]:
    """``peer``: the peer_vllm module (its engines and model-directory writer)."""
    ours = json.loads(Path(args.source).read_text())
    plan = SweepPlan.from_dict(ours["sweep_config"])
    args = sweep_args(args, ours)
    t0 = time.perf_counter()
    front, loop, close, info = _front(args, device, peer)
    reset = _cache_reset(front, loop)
    out: dict[str, Any] = {"source": args.source, "sweep_config": plan.to_dict(),
                           "startup_s": time.perf_counter() - t0, "engine_info": info,
                           "sweep": []}  # fmt: skip
    mode = "vllm" if args.engine == "vllm" else "verifypd-off"
    try:
        warm = make_requests(plan.mix, plan.vocab, plan.seed + 1, 8, None, prefix="warm")
        for temp in plan.temperatures:
            params = lambda i, r, t=temp: _params(r, t, i)  # noqa: E731
            loop.run_until_complete(run_load(front, warm, params, 120.0))
        loop.run_until_complete(burn_in(front, plan, send_alpha=False))  # as our throwaway engine
        for rate in plan.rates:
            for temp in plan.temperatures:
                reset()  # a replayed trace must not hit the last run's prefix cache
                out["sweep"] += _rows(loop, front, plan, rate, temp, mode)
                print(f"[peer_vllm] sweep {mode} T={temp} {rate}/s: ttft_p99_ms="
                      f"{out['sweep'][-1].get('ttft_p99_ms')}", flush=True)  # fmt: skip
    finally:
        close()
    return out


def _rows(loop, front, plan: SweepPlan, rate: float, temp: float, mode: str) -> list[dict]:
    """One run, its row repeated per profile; with a ``StepLog`` on the front (vLLM,
    ``--trace-steps``) the run's engine steps ride on the first profile's row only."""
    first = plan.profiles[0]
    res = loop.run_until_complete(run_trace(front, plan, rate, first, temp, send_alpha=False))
    row = summary_row(res, plan, rate, first, temp, mode, shared_across_profiles=True)
    steps = getattr(front, "steps", None)
    logged = steps.between(res["t_start"], time.perf_counter()) if steps is not None else None
    return [
        {
            **row,
            "acceptance_profile": p,
            "mean_alpha": None,
            "trace_fingerprint": plan_fingerprint(plan, rate, p),
            **({"engine_steps": logged} if logged is not None and p == first else {}),
        }
        for p in plan.profiles
    ]


def _params(req, temperature: float, index: int) -> SamplingParams:
    return SamplingParams(max_tokens=req.max_tokens, temperature=temperature, seed=index,
                          ignore_eos=True)  # fmt: skip


def _cache_reset(front, loop):
    """Empties the front's prefix cache between runs (vLLM: ``AsyncLLM.reset_prefix_cache``;
    verifypd: the KV manager's) while it is idle."""
    engine = getattr(front, "engine", None)
    if engine is not None and hasattr(engine, "reset_prefix_cache"):  # vLLM
        return lambda: loop.run_until_complete(engine.reset_prefix_cache())
    return front.core.kv.reset_prefix_cache


def _front(args, device, peer) -> tuple[Any, asyncio.AbstractEventLoop, Any, dict[str, Any]]:
    """(front with ``generate``, the loop it runs on, its closer, what it is)."""
    if args.engine == "vllm":
        import vllm

        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        root = Path(os.environ.get("PEER_MODEL_DIR", "/tmp/peer_models"))
        target = peer.write_model_dir(args, args.model, root)
        steps = peer.StepLog() if args.trace_steps else None
        front = peer.VllmFront(args, target, None, args.max_num_seqs, steps)
        info = {"vllm_version": vllm.__version__, "engine_args": front.engine_args}

        def close() -> None:
            front.close()
            loop.close()

        return front, loop, close, info
    llm = peer.AsyncLLM(peer.verifypd_config(args, device, "mixed", args.max_num_seqs))
    return llm.engine, llm.loop, llm.close, peer.engine_info(llm)
