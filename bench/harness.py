"""Engine-side harness of the benchmarks: engine configs and fronts (``LLM`` or ``AsyncEngine``)
and a step/speculation recorder. Decode timing, the memory-bandwidth floor of a decode step and
the engine variants the latency benchmarks compare are in ``decode_timing.py``."""

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
from common import json_default

from verifypd.config import (
    CacheConfig,
    EngineConfig,
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
