"""Environment variables some A/B scripts set, mapped onto ``EngineConfig`` and ``SpecConfig``
fields (``env_overrides``, ``spec_env_overrides``). Only entry points (``verifypd serve``, the
benchmarks) read them; both are re-exported from ``verifypd.config``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# Environment variables that older A/B scripts set; only entry points map them (env_overrides).
ENV_LANE_STREAMS = "VERIFYPD_LANE_STREAMS"
ENV_LANE_PRIORITIES = "VERIFYPD_LANE_PRIORITIES"
ENV_EMIT_AFTER_LAUNCH = "VERIFYPD_EMIT_AFTER_LAUNCH"
ENV_DELIVER_BEFORE_DRAFTING = "VERIFYPD_DELIVER_BEFORE_DRAFTING"
ENV_DECODE_AHEAD = "VERIFYPD_DECODE_AHEAD"
ENV_GC_FREEZE = "VERIFYPD_GC_FREEZE"
ENV_PREFILL_SLICE_LAYERS = "VERIFYPD_PREFILL_SLICE_LAYERS"
ENV_PROMPT_TOKEN_BUCKET = "VERIFYPD_PROMPT_TOKEN_BUCKET"
ENV_PREFILL_SM_CARVEOUT = "VERIFYPD_PREFILL_SM_CARVEOUT"
ENV_FOLLOW_PREFILL = "VERIFYPD_FOLLOW_PREFILL"
ENV_FOLLOW_PREFILL_MAX_ROWS = "VERIFYPD_FOLLOW_PREFILL_MAX_ROWS"
ENV_FOLLOW_DECODE_MAX_ROWS = "VERIFYPD_FOLLOW_DECODE_MAX_ROWS"
ENV_FOLLOW_DECODE_TOKENS = "VERIFYPD_FOLLOW_DECODE_TOKENS"
ENV_TAIL_TOLERANCE = "VERIFYPD_TAIL_TOLERANCE"
ENV_YIELD_TO_PREFILL = "VERIFYPD_YIELD_TO_PREFILL"
ENV_PROMPT_IN_DECODE_EAGER = "VERIFYPD_PROMPT_IN_DECODE_EAGER"
ENV_WARM_PROMPT_GEMMS = "VERIFYPD_WARM_PROMPT_GEMMS"


def env_overrides(environ: Mapping[str, str]) -> dict[str, Any]:
    """EngineConfig fields from ``VERIFYPD_LANE_STREAMS`` (comma list, "0" = none),
    ``VERIFYPD_LANE_PRIORITIES`` (``EngineConfig.lane_priorities``),
    ``VERIFYPD_EMIT_AFTER_LAUNCH``, ``VERIFYPD_DELIVER_BEFORE_DRAFTING``,
    ``VERIFYPD_DECODE_AHEAD``, ``VERIFYPD_GC_FREEZE``, ``VERIFYPD_PROMPT_IN_DECODE_EAGER`` and
    ``VERIFYPD_WARM_PROMPT_GEMMS`` ("0" = off, "1" = on),
    ``VERIFYPD_PREFILL_SLICE_LAYERS``, ``VERIFYPD_PROMPT_TOKEN_BUCKET`` and
    ``VERIFYPD_PREFILL_SM_CARVEOUT`` (ints, 0 = off), for the CLI and benchmarks to pass on."""
    out: dict[str, Any] = {}
    if ENV_LANE_STREAMS in environ:
        names = [n.strip() for n in environ[ENV_LANE_STREAMS].split(",")]
        out["lane_streams"] = tuple(n for n in names if n and n != "0")
    if ENV_LANE_PRIORITIES in environ:
        out["lane_priorities"] = environ[ENV_LANE_PRIORITIES].strip()
    for name, field_name in ((ENV_EMIT_AFTER_LAUNCH, "emit_after_launch"),
                             (ENV_DELIVER_BEFORE_DRAFTING, "deliver_before_drafting"),
                             (ENV_DECODE_AHEAD, "decode_ahead"),
                             (ENV_GC_FREEZE, "gc_freeze"),
                             (ENV_PROMPT_IN_DECODE_EAGER, "prompt_in_decode_eager"),
                             (ENV_WARM_PROMPT_GEMMS, "warm_prompt_gemms")):  # fmt: skip
        if name in environ:
            out[field_name] = environ[name] != "0"
    out.update(_env_ints(environ, ((ENV_PREFILL_SLICE_LAYERS, "prefill_slice_layers"),
                                   (ENV_PROMPT_TOKEN_BUCKET, "prompt_token_bucket"),
                                   (ENV_PREFILL_SM_CARVEOUT, "prefill_sm_carveout"))))  # fmt: skip
    return out


def _env_ints(environ: Mapping[str, str], fields: tuple[tuple[str, str], ...]) -> dict[str, int]:
    """The (variable, field) pairs set in ``environ``, each an int >= 0 (else ValueError)."""
    out = {}
    for name, field_name in fields:
        if name in environ:
            text = environ[name].strip()
            if not text.isdigit():
                raise ValueError(f"{name} must be an int >= 0, got {text!r}")
            out[field_name] = int(text)
    return out


def spec_env_overrides(environ: Mapping[str, str]) -> dict[str, Any]:
    """SpecConfig fields from ``VERIFYPD_FOLLOW_PREFILL`` and ``VERIFYPD_YIELD_TO_PREFILL``
    ("0" = off, "1" = on),
    ``VERIFYPD_FOLLOW_PREFILL_MAX_ROWS``, ``VERIFYPD_FOLLOW_DECODE_MAX_ROWS`` and
    ``VERIFYPD_FOLLOW_DECODE_TOKENS`` (ints >= 0) and ``VERIFYPD_TAIL_TOLERANCE`` (a float),
    for A/Bs against a server (``verifypd serve --spec-follow-prefill-rows`` sets the first two
    and wins over them; the others have no flag)."""
    out: dict[str, Any] = {}
    if ENV_FOLLOW_PREFILL in environ:
        out["follow_prefill"] = environ[ENV_FOLLOW_PREFILL] != "0"
    if ENV_YIELD_TO_PREFILL in environ:
        out["yield_to_prefill"] = environ[ENV_YIELD_TO_PREFILL] != "0"
    rows = ((ENV_FOLLOW_PREFILL_MAX_ROWS, "follow_prefill_max_rows"),
            (ENV_FOLLOW_DECODE_MAX_ROWS, "follow_decode_max_rows"),
            (ENV_FOLLOW_DECODE_TOKENS, "follow_decode_tokens"))  # fmt: skip
    out.update(_env_ints(environ, rows))
    if ENV_TAIL_TOLERANCE in environ:
        text = environ[ENV_TAIL_TOLERANCE].strip()
        try:
            out["tail_tolerance"] = float(text)
        except ValueError:
            raise ValueError(f"{ENV_TAIL_TOLERANCE} must be a float, got {text!r}") from None
    return out
