"""Decode speed at a fixed batch (``measure_decode``: the step from two output lengths), the
memory-bandwidth floor of a decode step (``decode_floor``) and the engine variants the latency
and GPU-check benchmarks compare (``VARIANTS``)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from common import median, timed
from harness import StepRecorder, random_prompts, run_generate

from verifypd.config import KernelConfig, ModelConfig


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
