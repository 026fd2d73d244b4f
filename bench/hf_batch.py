"""transformers' continuous batching (``generate_batch`` family) as the offline baseline.

The API moves between transformers releases, so every call is defensive: arguments are
filtered by signature, several attention names are tried, and failures come back as data.
"""

from __future__ import annotations

import inspect
import time
from typing import Any

import torch
from common import error_record, release_memory, sync
from hf_reference import build_hf_model, hf_dtype_of

from verifypd.config import ModelConfig

# "paged|sdpa" is the paged SDPA name of transformers 5.x up to 5.22; older releases called it
# "sdpa_paged"; from 5.23 the prefix is gone and plain "sdpa" is paged inside generate_batch.
ATTN_CANDIDATES = ("paged|sdpa", "sdpa_paged", "sdpa")


def _call(fn, **kwargs):
    """Calls ``fn`` with the keyword arguments its signature accepts."""
    params = inspect.signature(fn).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return fn(**kwargs)
    return fn(**{k: v for k, v in kwargs.items() if k in params})


def _generation_config(max_new_tokens: int):
    from transformers import GenerationConfig

    # eos_token_id=-1: no token ever matches, so EOS is ignored like in our engine.
    return GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0
    )


def _workload_hints(prompts: list[list[int]], max_new_tokens: int):
    try:
        from transformers.generation.continuous_batching.utils import WorkloadHints
    except ImportError:
        return None
    return WorkloadHints(
        max_prompt_length=max(len(p) for p in prompts),
        max_generated_length=max_new_tokens,
        num_requests=len(prompts),
    )


def _is_finished(result: Any) -> bool:
    fn = getattr(result, "is_finished", None)
    if callable(fn):
        return bool(fn())
    status = getattr(result, "status", None)
    return getattr(status, "name", str(status)).upper() in ("FINISHED", "FAILED")


def _generated(result: Any) -> list[int]:
    return list(getattr(result, "generated_tokens", None) or [])


def generate_per_request(
    model, prompts: list[list[int]], max_new: list[int], deadline_s: float
) -> dict[str, Any]:
    """Each request with its own ``max_new_tokens`` through the context-manager API.

    Timing covers submitting all requests until the last one finishes; building the manager,
    sizing its cache and its CUDA-graph warm-up (done on entering the context) are excluded,
    like our engine's construction and warm-up.
    """
    gen_cfg = _generation_config(max(max_new))
    cm = _call(
        model.continuous_batching_context_manager,
        generation_config=gen_cfg,
        block=True,
        timeout=30,
        workload_hints=_workload_hints(prompts, max(max_new)),
    )
    results: dict[str, Any] = {}
    with cm as manager:
        attn_used = getattr(model.config, "_attn_implementation", None)
        sync(model.device)
        start = time.perf_counter()
        for i, (p, n) in enumerate(zip(prompts, max_new, strict=True)):
            manager.add_request(input_ids=p, request_id=f"bench_{i}", max_new_tokens=n)
        timed_out = _collect(manager, results, len(prompts), start + deadline_s)
        sync(model.device)
        seconds = time.perf_counter() - start
    summary = _summary(results, seconds, timed_out, "per_request_max_new_tokens", attn_used)
    summary["timing_includes_hf_warmup"] = False
    return summary


def _collect(manager, results: dict[str, Any], num: int, deadline: float) -> bool:
    """Drains results until ``num`` requests finished; True if the deadline passed first."""
    while len(results) < num:
        if time.perf_counter() > deadline:
            return True
        result = manager.get_result(timeout=1)
        if result is None:
            if hasattr(manager, "is_running") and not manager.is_running():
                raise RuntimeError("transformers' generation thread stopped unexpectedly")
            continue
        if _is_finished(result):
            results[result.request_id] = result
    return False


def generate_uniform(
    model, prompts: list[list[int]], max_new: list[int], deadline_s: float
) -> dict[str, Any]:
    """Fallback: one ``generate_batch`` call with max_new_tokens = the mean requested length
    (same total output tokens, different per-request lengths). Timing includes its warm-up."""
    mean_new = round(sum(max_new) / len(max_new))
    sync(model.device)
    start = time.perf_counter()
    out = _call(
        model.generate_batch,
        inputs=prompts,
        generation_config=_generation_config(mean_new),
        progress_bar=False,
    )
    sync(model.device)
    seconds = time.perf_counter() - start
    attn_used = getattr(model.config, "_attn_implementation", None)
    summary = _summary(out, seconds, False, "uniform_max_new_tokens_mean", attn_used)
    summary["uniform_max_new_tokens"] = mean_new
    summary["timing_includes_hf_warmup"] = True
    return summary


def _summary(results: dict[str, Any], seconds: float, timed_out: bool, method: str, attn_used):
    errors = [r.error for r in results.values() if getattr(r, "error", None)]
    return {
        "method": method,
        "seconds": seconds,
        "num_finished": len(results),
        "num_errors": len(errors),
        "first_error": str(errors[0]) if errors else None,
        "output_tokens": sum(len(_generated(r)) for r in results.values()),
        "prompt_tokens_finished": sum(
            len(getattr(r, "prompt_ids", None) or []) for r in results.values()
        ),
        "timed_out": timed_out,
        "attn_implementation_used": attn_used,
    }


def _check(summary: dict[str, Any], num: int) -> None:
    if summary["num_errors"] or (summary["num_finished"] < num and not summary["timed_out"]):
        raise RuntimeError(
            f"transformers finished {summary['num_finished']}/{num} requests, "
            f"{summary['num_errors']} errors; first: {summary['first_error']}"
        )


def run_generation(model, prompts, max_new, deadline_s, warmup_prompts) -> dict[str, Any]:
    """Per-request lengths if the API allows, else the uniform fallback; optionally a short
    warm-up run first (``warmup_prompts`` not None)."""
    attempts = []
    for fn in (generate_per_request, generate_uniform):
        try:
            if warmup_prompts:
                warm = fn(model, warmup_prompts, [8] * len(warmup_prompts), deadline_s)
                _check(warm, len(warmup_prompts))
            summary = fn(model, prompts, max_new, deadline_s)
            _check(summary, len(prompts))
            return {**summary, "failed_methods": attempts}
        except Exception as exc:  # noqa: BLE001 - try the next API shape, keep the reason
            attempts.append({"method": fn.__name__, **error_record(exc)})
    raise RuntimeError(f"no transformers continuous-batching API worked: {attempts}")


def run_transformers(
    cfg: ModelConfig,
    prompts: list[list[int]],
    max_new: list[int],
    device: torch.device,
    dtype: torch.dtype,
    deadline_s: float,
    warmup_prompts: list[list[int]] | None,
) -> dict[str, Any]:
    """Builds the same architecture in transformers (random init) and times its batch API."""
    record: dict[str, Any] = {"attn_attempts": [], "dtype": str(dtype).removeprefix("torch.")}
    model = None
    for attn in ATTN_CANDIDATES:
        try:
            model = _with_attn(model, cfg, device, dtype, attn)
            record["hf_dtype"] = hf_dtype_of(model)
            result = run_generation(model, prompts, max_new, deadline_s, warmup_prompts)
            record.update(result, attn_implementation_requested=attn)
            break
        except Exception as exc:  # noqa: BLE001 - try the next name, keep the reason
            record["attn_attempts"].append({"attn_implementation": attn, **error_record(exc)})
    else:
        record["error"] = "every attention implementation failed; see attn_attempts"
    del model
    release_memory()
    return record


def _with_attn(model, cfg: ModelConfig, device, dtype, attn: str):
    if model is not None and hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(attn)
        return model
    return build_hf_model(cfg, device, dtype, attn)
