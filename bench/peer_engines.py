"""The engines of ``peer_vllm.py``'s runs: a batch of prompts run to completion through either
engine's async ``generate`` (``Batch``), vLLM's ``AsyncLLM`` behind our ``AsyncEngine``'s
interface (``VllmFront``) with its engine steps recorded (``StepLog``), its speculation
counters, and the model directory vLLM loads with dummy weights (``write_model_dir``)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path
from typing import Any

from hf_reference import hf_config

from verifypd.config import PRESETS
from verifypd.types import SamplingParams


def greedy(n: int, detokenize: bool = False) -> SamplingParams:
    # No text by default: vLLM runs with skip_tokenizer_init (ids in, ids out), so neither
    # engine detokenizes.
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, detokenize=detokenize)


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
