"""Engine-side harness of the benchmarks: engine configs and fronts (``LLM`` or ``AsyncEngine``),
a step/speculation recorder, decode timing and the memory-bandwidth floor of a decode step."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from common import json_default, median, timed

from verifypd.config import (
    CacheConfig,
    EngineConfig,
    KernelConfig,
    ModelConfig,
    SchedulerConfig,
    SpecConfig,
    env_overrides,
)
from verifypd.model_config import dummy_preset
from verifypd.types import Observer, SamplingParams


def random_prompts(rng: np.random.Generator, lens: Sequence[int], vocab: int) -> list[list[int]]:
    return [rng.integers(0, vocab, size=int(n)).tolist() for n in lens]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def engine_config(
    model: str,
    device: str,
    dtype: str,
    seed: int = 0,
    *,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int = 8192,
    max_model_len: int | None = None,
    num_blocks: int | None = None,
    prefix_caching: bool = True,
    spec: SpecConfig | None = None,
    **engine_kw: Any,
) -> EngineConfig:
    return EngineConfig(
        model=model,
        device=device,
        dtype=dtype,
        seed=seed,
        cache=CacheConfig(num_blocks=num_blocks, enable_prefix_caching=prefix_caching),
        scheduler=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=_cap_model_len(model, max_model_len),
        ),
        spec=spec or SpecConfig(),
        **{**env_overrides(os.environ), **engine_kw},  # old A/B variables still work
    )


def synthetic_spec(args: Any, controller: bool = False, chain: bool | None = None) -> SpecConfig:
    """Draft-model speculation with synthetic acceptance ``args.acceptance`` at L =
    ``args.draft_len`` (the controller's L_max when ``controller``): the configuration of the
    speculation benchmarks (``common.add_spec_args``). ``chain``: ``SpecConfig.chain_drafts``."""
    return SpecConfig(
        method="draft",
        draft_model=args.draft_model,
        max_draft_len=args.draft_len,
        initial_draft_len=args.draft_len,
        controller=controller,
        synthetic_acceptance=args.acceptance,
        chain_drafts=chain,
    )


def synthetic_note(args: Any, **details: Any) -> dict[str, Any]:
    """The ``synthetic_acceptance`` block of a report whose engines run ``synthetic_spec(args)``."""
    return {
        "used": True,
        "alpha": args.acceptance,
        **details,
        "note": "accepted counts drawn from a truncated geometric with alpha; the draft and "
        "verify forwards are real: the numbers measure the mechanism, not a model's acceptance",
    }


def _cap_model_len(model: str, max_model_len: int | None) -> int | None:
    """0/None: the model's own length; never more than a dummy preset's max positions."""
    if not max_model_len:
        return None
    preset = dummy_preset(model)
    return min(max_model_len, preset.max_position_embeddings) if preset else max_model_len


def blocks_for(num_seqs: int, tokens_per_seq: int, block_size: int = 16, slack: int = 64) -> int:
    """KV blocks for ``num_seqs`` sequences of ``tokens_per_seq`` tokens, plus slack."""
    return num_seqs * (-(-tokens_per_seq // block_size) + 1) + slack


def _cost_table(core: Any) -> dict[str, Any] | None:
    table = getattr(core, "cost_table", None)
    return table.to_dict() if table is not None else None


def engine_info(llm: Any) -> dict[str, Any]:
    """What the engine actually resolved (device, dtype, kernels, graphs, KV size)."""
    from verifypd.kernels import REFERENCE_OPS

    core, cfg = llm.core, llm.core.config
    graphs = getattr(getattr(core, "runner", None), "graphs", None)
    return {
        "model": cfg.model,
        "device": str(core.device),
        "dtype": str(core.dtype).removeprefix("torch."),
        "use_triton": core.ops is not REFERENCE_OPS,
        "cuda_graphs": getattr(core, "use_cuda_graphs", cfg.cuda_graphs),
        "graph_batch_sizes": list(getattr(graphs, "sizes", []) or []) or None,
        "front": "AsyncEngine (lane dispatcher)" if isinstance(llm, AsyncLLM) else "LLM.generate",
        "lane_mode": cfg.lane_mode,
        "lane_streams": list(cfg.lane_streams),
        "emit_after_launch": cfg.emit_after_launch,
        "deliver_before_drafting": cfg.deliver_before_drafting,
        "decode_ahead": getattr(  # what the dispatcher runs (None in the config = by device)
            getattr(getattr(llm, "engine", None), "dispatcher", None), "decode_ahead", None
        ),
        "calibrate_costs": cfg.calibrate_costs,
        "cost_table": _cost_table(core),
        "spec": dataclasses.asdict(cfg.spec),
        "kernels": dataclasses.asdict(cfg.kernels),
        "max_num_seqs": cfg.scheduler.max_num_seqs,
        "max_num_batched_tokens": cfg.scheduler.max_num_batched_tokens,
        "max_model_len": getattr(core, "max_model_len", None),
        "block_size": cfg.cache.block_size,
        "num_kv_blocks": getattr(getattr(core, "kv", None), "num_blocks", None),
        "prefix_caching": cfg.cache.enable_prefix_caching,
        "num_params": core.model_config.num_params,
    }


class StepRecorder(Observer):
    """Counts engine steps per lane and speculative tokens, through the ``Observer`` hook."""

    def __init__(self) -> None:
        self.reset()

    NUM_SLOWEST = 8  # the slowest steps are kept with their lane, size and time (stalls)

    def reset(self) -> None:
        self.steps: dict[str, list[tuple[float, int]]] = {}
        self.num_spec_calls = 0
        self.num_drafted = 0
        self.num_accepted = 0
        self.num_rows_fused = 0  # decode rows inside prompt steps (fuse_decode_backlog_s)
        self.t0 = time.perf_counter()
        self.slowest: list[tuple[float, str, int, float]] = []  # (s, lane, tokens, t_end)

    def lane_step(self, lane: str, seconds: float, num_tokens: int) -> None:
        self.steps.setdefault(lane, []).append((seconds, num_tokens))
        keep_slowest(self.slowest, (seconds, lane, num_tokens, time.perf_counter() - self.t0))

    def decode_fused(self, num_rows: int) -> None:
        self.num_rows_fused += num_rows

    def spec_tokens(self, num_drafted: int, num_accepted: int) -> None:
        self.num_spec_calls += 1
        self.num_drafted += num_drafted
        self.num_accepted += num_accepted

    def summary(self) -> dict[str, Any]:
        lanes = {
            lane: {
                "num_steps": len(v),
                "mean_step_s": float(np.mean([s for s, _ in v])) if v else None,
                "mean_tokens": float(np.mean([n for _, n in v])) if v else None,
            }
            for lane, v in self.steps.items()
        }
        slowest = [
            {"seconds": s, "lane": lane, "num_tokens": n, "t_end_s": t}
            for s, lane, n, t in self.slowest
        ]
        spec = None
        if self.num_spec_calls:
            spec = {
                "num_calls": self.num_spec_calls,
                "num_drafted": self.num_drafted,
                "num_accepted": self.num_accepted,
                "acceptance_rate": self.num_accepted / max(1, self.num_drafted),
                "mean_accepted_per_call": self.num_accepted / self.num_spec_calls,
            }
        return {"lanes": lanes, "spec": spec, "slowest": slowest}


class CompileLog:
    """Every Triton JIT compile (a kernel specialization not yet in memory) with its time since
    ``reset``: a compile under traffic is a stall of every lane, so benchmarks report them."""

    def __init__(self) -> None:
        self.reset()
        self._installed = False

    def reset(self) -> None:
        self.t0 = time.perf_counter()
        self.events: list[tuple[float, str]] = []

    def install(self) -> bool:
        """Hooks Triton (``knobs.runtime.jit_cache_hook``); False on a Triton without it."""
        import triton

        runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
        if runtime is None or not hasattr(runtime, "jit_cache_hook"):
            return False
        runtime.jit_cache_hook = self._hook
        self._installed = True
        return True

    def _hook(self, *, repr: str, **_: Any) -> bool:  # noqa: A002 (Triton's keyword)
        self.events.append((time.perf_counter() - self.t0, repr[:300]))
        return False  # False: compile as usual

    def summary(self) -> dict[str, Any] | None:
        if not self._installed:
            return None
        return {
            "num": len(self.events),
            "events": [{"t_s": t, "kernel": k} for t, k in self.events],
        }


def keep_slowest(top: list[tuple], item: tuple, size: int = StepRecorder.NUM_SLOWEST) -> None:
    """Keeps ``top`` the ``size`` largest items (by their first field), largest first."""
    top.append(item)
    top.sort(key=lambda x: -x[0])
    del top[size:]


def attach_recorder(llm: Any, recorder: StepRecorder | None = None) -> StepRecorder:
    """Installs ``recorder`` (a new ``StepRecorder`` by default) as the observer of the engine
    and the parts that hold one."""
    rec = recorder if recorder is not None else StepRecorder()
    core = llm.core
    for obj in (core, getattr(core, "scheduler", None), *_spec_parts(core)):
        if obj is not None and hasattr(obj, "observer"):
            obj.observer = rec
    return rec


def _spec_parts(core: Any) -> list[Any]:
    names = ("spec", "speculator", "proposer", "drafter", "spec_decoder", "dispatcher")
    return [getattr(core, n) for n in names if getattr(core, n, None) is not None]


def spec_stats(llm: Any) -> Any:
    """The engine's own speculative-decoding statistics, where it exposes any."""
    core = llm.core
    for name in ("spec_stats", "spec_metrics", "stats"):
        value = getattr(core, name, None)
        if value is None:
            continue
        value = value() if callable(value) else value
        try:
            json.dumps(value, default=json_default)
            return value
        except (TypeError, ValueError):
            return repr(value)
    return None


def run_generate(llm: Any, prompts: list[list[int]], max_tokens: int | list[int]):
    """``llm.generate`` with greedy, EOS-ignoring params (one per prompt)."""
    if isinstance(max_tokens, int):
        max_tokens = [max_tokens] * len(prompts)
    return llm.generate(prompts, [greedy(n) for n in max_tokens])


class AsyncLLM:
    """``LLM``-shaped front of ``AsyncEngine`` (the lane dispatcher, ``lane_mode`` honoured):
    ``generate`` submits every prompt at once on a private event loop and waits for all."""

    def __init__(self, config: EngineConfig) -> None:
        from verifypd.lanes.async_engine import AsyncEngine

        self.loop = asyncio.new_event_loop()
        self.engine = AsyncEngine(config)
        self.core = self.engine.core
        self._next_id = 0

    def generate(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[Any]:
        return self.loop.run_until_complete(self._generate(prompts, params))

    async def _generate(self, prompts, params) -> list[Any]:
        base, self._next_id = self._next_id, self._next_id + len(prompts)
        jobs = [
            self._one(f"bench-{base + i}", p, sp)
            for i, (p, sp) in enumerate(zip(prompts, params, strict=True))
        ]
        return list(await asyncio.gather(*jobs))

    async def _one(self, rid: str, prompt: list[int], params: SamplingParams):
        out = AsyncOutput(rid)
        async for delta in self.engine.generate(rid, prompt, params):
            out.token_ids += delta.new_token_ids
            if delta.finished:
                out.finish_reason = delta.finish_reason
        return out

    def close(self) -> None:
        self.loop.run_until_complete(self.engine.stop())
        self.loop.close()


@dataclass
class AsyncOutput:
    request_id: str
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None


def build_engine(config: EngineConfig, front: str = "llm") -> Any:
    """``front``: "llm" (``LLM.generate``: the lane dispatcher on the LLM's private event loop) or
    "async" (``AsyncEngine`` with the lane dispatcher; ``config.lane_mode`` applies)."""
    if front == "async":
        return AsyncLLM(config)
    from verifypd.llm import LLM

    return LLM(config=config)


def close_engine(llm: Any) -> None:
    close = getattr(llm, "close", None)
    if callable(close):
        close()


# ----------------------------------------------------------------------------- decode timing
def measure_decode(
    llm: Any,
    rng: np.random.Generator,
    batch: int,
    prompt_len: int,
    max_tokens: int,
    repeats: int,
    device: torch.device,
    recorder: StepRecorder | None = None,
) -> dict[str, Any]:
    """Decode speed at a fixed batch: step time = (T(max_tokens) - T(1)) / (max_tokens - 1).

    T(1) is a run that only prefills (and samples the first token). Every run uses fresh random
    prompts, so the prefix cache cannot serve any of them. Medians over ``repeats``.
    """
    vocab = llm.core.model_config.vocab_size
    extra_tokens = []  # output tokens beyond max_tokens (should stay 0)

    def run(n: int) -> float:
        prompts = random_prompts(rng, [prompt_len] * batch, vocab)
        seconds, outs = timed(lambda: run_generate(llm, prompts, n), device)
        got = sum(len(o.token_ids) for o in outs)
        if got < batch * n:
            raise RuntimeError(f"expected {batch * n} output tokens, got {got}")
        extra_tokens.append(got - batch * n)
        return seconds

    run(min(8, max_tokens))  # warm-up at this batch size (kernels, graphs)
    prefill = [run(1) for _ in range(repeats)]
    if recorder is not None:
        recorder.reset()
    total = [run(max_tokens) for _ in range(repeats)]
    t1, tn = median(prefill), median(total)
    steps = max(1, max_tokens - 1)
    # Noise can make T(max_tokens) <= T(1) on tiny CPU runs: fall back to the end-to-end step.
    fallback = tn <= t1
    step_s = tn / max_tokens if fallback else (tn - t1) / steps
    out = {
        "batch": batch,
        "prefill_s": t1,
        "generate_s": tn,
        "prefill_s_all": prefill,
        "generate_s_all": total,
        "decode_step_s": step_s,
        "decode_step_is_e2e_fallback": fallback,
        "decode_tok_s": batch / step_s,
        "e2e_tok_s": batch * max_tokens / tn,
        "max_extra_output_tokens": max(extra_tokens),
    }
    if recorder is not None:
        out["observed_decode_step_s"] = _observed_decode_step(recorder, batch)
    return out


def _observed_decode_step(recorder: StepRecorder, batch: int) -> float | None:
    """Mean seconds of engine steps that carried exactly one token per sequence."""
    times = [s for v in recorder.steps.values() for s, n in v if n == batch]
    return float(np.mean(times)) if times else None


def kv_bytes_per_token(cfg: ModelConfig, elem_bytes: int) -> int:
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * elem_bytes


def decode_floor(
    cfg: ModelConfig, elem_bytes: int, batch: int, prompt_len: int, max_tokens: int, gbps
) -> dict[str, Any]:
    """Bandwidth floor of one decode step: every weight and every cached K/V read once.

    ``weights_read_bytes`` leaves out the input embedding table when it is not tied to the
    LM head (a decode step reads only ``batch`` rows of it); ``all_weights_bytes`` is
    ``num_params * elem_bytes``. KV: mean context over the decode steps, prompt + max_tokens/2.
    """
    all_weights = cfg.num_params * elem_bytes
    unread = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size * elem_bytes
    mean_ctx = prompt_len + max_tokens / 2
    kv = batch * mean_ctx * kv_bytes_per_token(cfg, elem_bytes)
    out = {
        "weights_read_bytes": all_weights - unread,
        "all_weights_bytes": all_weights,
        "kv_read_bytes": kv,
        "mean_context": mean_ctx,
        "copy_gbps": gbps,
        "floor_step_s": None,
        "floor_tok_s": None,
        "floor_tok_s_all_weights": None,
    }
    if gbps:
        step = (all_weights - unread + kv) / (gbps * 1e9)
        out["floor_step_s"] = step
        out["floor_tok_s"] = batch / step
        out["floor_tok_s_all_weights"] = batch * gbps * 1e9 / (all_weights + kv)
    return out


# Engine variants the latency and GPU-check benchmarks compare. The kernel choices
# (``EngineConfig.kernels``, A/B in one run): unfused = the GEMV after separate norm / SwiGLU
# kernels; cublas = no GEMV at all; gemv1 = the GEMV for one row only (cuBLAS for batched
# decode and verify); silu-separate = at 2..16 rows SwiGLU as its own kernel instead of
# gate_up's epilogue.
_GRAPHS = {"use_triton": True, "cuda_graphs": True}
VARIANTS: dict[str, dict[str, Any]] = {
    "eager": {"use_triton": False, "cuda_graphs": False},
    "triton": {"use_triton": True, "cuda_graphs": False},
    "graphs": _GRAPHS,
    "graphs-unfused": {**_GRAPHS, "kernels": KernelConfig(fuse_norm=False, fuse_silu=False)},
    "graphs-cublas": {**_GRAPHS, "kernels": KernelConfig(gemv_max_rows=0)},
    "graphs-gemv1": {**_GRAPHS, "kernels": KernelConfig(gemv_max_rows=1)},
    "graphs-silu-separate": {**_GRAPHS, "kernels": KernelConfig(fuse_silu_epilogue=False)},
}
