"""``bench/mixed.py``'s modes, the parts: ``Mode`` (an engine configuration, built by
``mixed.mode_config``) and the helpers the mode tables (``mixed_modes``, ``mixed_modes_ab``)
are written with."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from verifypd.config import KernelConfig


@dataclass(frozen=True)
class Mode:
    lane_mode: str  # three | single
    speculate: bool
    controller: bool = False
    chain_drafts: bool | None = None  # None: the engine's default (on for GPU)
    policy: str | None = None  # SpecConfig.policy; None: its default
    spec_options: tuple[
        tuple[str, float | bool | str | tuple | None], ...
    ] = ()  # SpecConfig fields
    sched_options: tuple[tuple[str, float | None], ...] = ()  # SchedulerConfig fields set
    # EngineConfig fields set
    engine_options: tuple[tuple[str, bool | int | str | tuple | KernelConfig | None], ...] = ()
    # Benchmark only: the goodput policy's population α reset to this at the start of every
    # run (a population stuck below what pays, forced; None: as the engine left it).
    population_prior: float | None = None
    # Benchmark only, in process: prompt lookup's proposer replaced by a stand-in that always
    # drafts L copies of the last token (no GPU time, never a miss; ``mixed.stand_in_drafts``),
    # so with synthetic acceptance the rounds are those of a drafter that costs nothing.
    stand_in_drafts: bool = False


CHUNK2K_FCFS = (("max_prefill_chunk", 2048), ("prefill_pack_tokens", None))
CHUNK4K_FCFS = (("max_prefill_chunk", 4096), ("prefill_pack_tokens", None))
CHUNK2K_PACK512 = (("max_prefill_chunk", 2048), ("prefill_pack_tokens", 512))
CHUNK4K_PACK512 = (("max_prefill_chunk", 4096), ("prefill_pack_tokens", 512))
SPLIT1K = (("kernels", KernelConfig(gemm_split_rows=1024)),)


def policy_with(
    spec: tuple[tuple[str, float | bool | tuple | None], ...] = (),
    sched: tuple[tuple[str, float | None], ...] = (),
    engine: tuple[tuple[str, bool | int | str | KernelConfig | None], ...] = (),
) -> Mode:
    """The goodput policy on three lanes with some settings changed: a variant for A/Bs."""
    return Mode("three", True, True, policy="goodput", spec_options=spec, sched_options=sched,
                engine_options=engine)  # fmt: skip


def with_engine(base: str, engine: tuple[tuple[str, Any], ...]) -> Mode:
    """``off`` or ``policy`` with EngineConfig fields set."""
    if base == "off":
        return Mode("three", False, engine_options=engine)
    return policy_with(engine=engine)


def pair(
    name: str,
    sched: tuple[tuple[str, Any], ...] = (),
    engine: tuple[tuple[str, Any], ...] = (),
) -> dict[str, Mode]:
    """``off-NAME`` and ``policy-NAME``: both with the same scheduler and EngineConfig fields."""
    return {f"off-{name}": Mode("three", False, sched_options=sched, engine_options=engine),
            f"policy-{name}": policy_with(sched=sched, engine=engine)}  # fmt: skip


MODES_POLICY = Mode("three", True, True, policy="goodput")
NOSTALE = policy_with(spec=(("probe_when_stale", False),))


def fuse(seconds: float | None, tokens: int) -> tuple[tuple[str, Any], ...]:
    """EngineConfig's backlog fusing: after ``seconds`` (None: never), from ``tokens`` queued."""
    return (("fuse_decode_backlog_s", seconds), ("fuse_decode_backlog_tokens", tokens))


def fed_beside(stream: str, *extra: tuple[str, Any]) -> Mode:
    """The policy with the drafter fed behind plain decode steps at up to 8 rows, on the feed
    stream ``stream`` (SpecConfig.follow_decode_stream), and ``extra`` spec settings."""
    return policy_with(
        spec=(("follow_decode_max_rows", 8), ("follow_decode_stream", stream), *extra)
    )
