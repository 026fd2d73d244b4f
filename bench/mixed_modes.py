"""The modes ``bench/mixed.py`` runs (``--modes``): the issue-14 sweep's four (``off``,
``single-fixed``, ``three-fixed``, ``policy``), the older three-lane / single-lane names, and the
variants kept for A/Bs, each with what it changes and, where it was measured, what it gave.
A mode is an engine configuration (``mixed.mode_config``); ``policy-NAME`` modes are judged
on their own against the others (``sweep_criteria``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from verifypd.config import PROMPT_IN_DECODE_SIZES, KernelConfig


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


_CHUNK2K_FCFS = (("max_prefill_chunk", 2048), ("prefill_pack_tokens", None))
_CHUNK4K_FCFS = (("max_prefill_chunk", 4096), ("prefill_pack_tokens", None))
_CHUNK2K_PACK512 = (("max_prefill_chunk", 2048), ("prefill_pack_tokens", 512))
_CHUNK4K_PACK512 = (("max_prefill_chunk", 4096), ("prefill_pack_tokens", 512))
_SPLIT1K = (("kernels", KernelConfig(gemm_split_rows=1024)),)


def _policy_with(
    spec: tuple[tuple[str, float | bool | tuple | None], ...] = (),
    sched: tuple[tuple[str, float | None], ...] = (),
    engine: tuple[tuple[str, bool | int | str | KernelConfig | None], ...] = (),
) -> Mode:
    """The goodput policy on three lanes with some settings changed: a variant for A/Bs."""
    return Mode("three", True, True, policy="goodput", spec_options=spec, sched_options=sched,
                engine_options=engine)  # fmt: skip


def _with_engine(base: str, engine: tuple[tuple[str, Any], ...]) -> Mode:
    """``off`` or ``policy`` with EngineConfig fields set."""
    if base == "off":
        return Mode("three", False, engine_options=engine)
    return _policy_with(engine=engine)


def _pair(
    name: str,
    sched: tuple[tuple[str, Any], ...] = (),
    engine: tuple[tuple[str, Any], ...] = (),
) -> dict[str, Mode]:
    """``off-NAME`` and ``policy-NAME``: both with the same scheduler and EngineConfig fields."""
    return {f"off-{name}": Mode("three", False, sched_options=sched, engine_options=engine),
            f"policy-{name}": _policy_with(sched=sched, engine=engine)}  # fmt: skip


MODES_POLICY = Mode("three", True, True, policy="goodput")
_NOSTALE = _policy_with(spec=(("probe_when_stale", False),))


def _fuse(seconds: float | None, tokens: int) -> tuple[tuple[str, Any], ...]:
    """EngineConfig's backlog fusing: after ``seconds`` (None: never), from ``tokens`` queued."""
    return (("fuse_decode_backlog_s", seconds), ("fuse_decode_backlog_tokens", tokens))


def _fed_beside(stream: str, *extra: tuple[str, Any]) -> Mode:
    """The policy with the drafter fed behind plain decode steps at up to 8 rows, on the feed
    stream ``stream`` (SpecConfig.follow_decode_stream), and ``extra`` spec settings."""
    return _policy_with(
        spec=(("follow_decode_max_rows", 8), ("follow_decode_stream", stream), *extra)
    )


MODES = {
    "three-ctrl": Mode("three", True, True),
    "three-fixed": Mode("three", True),
    "single-fixed": Mode("single", True),
    "three-off": Mode("three", False),
    "single-ctrl": Mode("single", True, True),
    "single-off": Mode("single", False),
    "three-fixed-unchained": Mode("three", True, chain_drafts=False),
    "three-ctrl-unchained": Mode("three", True, True, chain_drafts=False),
    # The sweep's names (issue 14): single-fixed and three-fixed as above.
    "off": Mode("three", False),
    "policy": MODES_POLICY,
    # The drafter's context window (SpecConfig.draft_window): a prompt's first 4 and last 64 /
    # 128 / 256 tokens, so its pass over a 3k-token prompt feeds 68-260 tokens; with the light-
    # load follow behind prompt steps too (its forward then small beside the decode steps).
    "policy-win64": _policy_with(spec=(("draft_window", 64),)),
    "policy-win128": _policy_with(spec=(("draft_window", 128),)),
    "policy-win256": _policy_with(spec=(("draft_window", 256),)),
    "policy-win128-follow-light": _policy_with(
        spec=(("draft_window", 128), ("follow_prefill", True), ("follow_prefill_max_rows", 4))
    ),
    "three-fixed-win128": Mode("three", True, spec_options=(("draft_window", 128),)),
    # The ITL tail's budget (SpecConfig.tail_budget, --spec-tail-budget): speculation's late
    # tokens (more than 1.05 plain steps after the one before) kept to 0.2 / 0.5 / 1 % of all.
    "policy-budget2": _policy_with(spec=(("tail_budget", 0.002),)),
    "policy-budget5": _policy_with(spec=(("tail_budget", 0.005),)),
    "policy-budget10": _policy_with(spec=(("tail_budget", 0.01),)),
    # ... late meaning more than 1.35 plain steps (SpecConfig.tail_ratio; about `off`'s own ITL
    # p99 over its median step at 2 req/s on an H200): an L = 1 round (~1.25 predicted) costs
    # no credit (measured 2026-11-28: the ITL p99 stayed the policy's, docs/performance.md).
    "policy-r135-b5": _policy_with(spec=(("tail_budget", 0.005), ("tail_ratio", 1.35))),
    "policy-r135-b10": _policy_with(spec=(("tail_budget", 0.01), ("tail_ratio", 1.35))),
    # The drafter's chunk graphs with their attention on the prefill kernel, as before
    # SpecConfig.chunk_short_attention (on by default since 2026-11-28).
    "policy-prefill-chunks": _policy_with(spec=(("chunk_short_attention", False),)),
    # ... and chunk graphs of 1,024 tokens too (a replay of the 0.5B drafter costs ~0.9 ms of
    # GPU whatever its q up to 64, 1.5 at 256, 2.3 at 1,024 on an H200: bench/catch_up_cost.py).
    "policy-chunk1k": _policy_with(spec=(("catch_up_chunk", (16, 64, 256, 1024)),)),
    # ... and of 512 too: a context of 513-1,024 tokens in two replays of 512, not up to four
    # of 256.
    "policy-chunk512-1k": _policy_with(spec=(("catch_up_chunk", (16, 64, 256, 512, 1024)),)),
    # A catch-up round's feed spread over at most the rounds each request has left
    # (SpecConfig.amortize_within_request): no catch-up for a long prompt near its end. Neither
    # these nor the chunks of 512 and 1,024 moved the light-load ITL p99 (H200, ed52da5).
    "policy-horizon": _policy_with(spec=(("amortize_within_request", True),)),
    "policy-horizon-chunk1k": _policy_with(
        spec=(("amortize_within_request", True), ("catch_up_chunk", (16, 64, 256, 512, 1024)))
    ),
    # Without the stale probe (SpecConfig.probe_when_stale, on by default since 2026-11-28):
    # requests with no verify of their own probed only while the population is parked.
    "policy-nostale": _NOSTALE,
    # ... both with every run starting from a population α of 0.3 (below what pays on an H100
    # at 8 req/s): the stuck state that the stale probe gets out of.
    "policy-stuck": dataclasses.replace(MODES_POLICY, population_prior=0.3),
    "policy-nostale-stuck": dataclasses.replace(_NOSTALE, population_prior=0.3),
    # Variants for A/Bs in the same run: the goodput policy with the looser latency guard of
    # 1dc8f53 (speculators up to 10 % slower per token than plain decoding, riders 25 %), and
    # the policy and `off` with the Sarathi-style prefill bound (20 ms; off by default).
    "policy-loose": _policy_with(spec=(("guard_slack", 0.10), ("rider_slack", 0.25))),
    # The rider bound alone loosened (default 0.05): a plain row (an α ≈ 0.2 request) may wait
    # up to 1.25 / 1.5 plain steps in another's round. Measured at 2 req/s, hetero (33b7e4f,
    # mixed-nvidia-h200-rider-33b7e4f.json): no acceptance class got faster (α 0.6 at 1.22x
    # `off` in all three), the riders slower (0.92-0.94x) and TPOT p99 up to 1.34x. Not a default.
    "policy-rider25": _policy_with(spec=(("rider_slack", 0.25),)),
    "policy-rider50": _policy_with(spec=(("rider_slack", 0.5),)),
    # The policy taking the shortest step among the plans within 5 % / 10 % of the best
    # tokens/s (SpecConfig.tail_tolerance: the ITL tail against a little mean speed), and the
    # step cap at 1.5 plain steps (the tail a plain step has at light load).
    "policy-tail5": _policy_with(spec=(("tail_tolerance", 0.05),)),
    "policy-tail10": _policy_with(spec=(("tail_tolerance", 0.10),)),
    "policy-notail": _policy_with(spec=(("tail_tolerance", 0.0),)),
    "policy-cap15": _policy_with(spec=(("max_step_ratio", 1.5),)),
    # The policy with the drafter following prompt steps (SpecConfig.follow_prefill): its KV of
    # a prompt computed behind the prompt step on the follow stream (below every lane), in
    # replays of chunk graphs of its own since 2026-11-26 (eager before: 17-32 ms of host
    # time a forward), after the step's launch, instead of in a catch-up round.
    "policy-follow": _policy_with(spec=(("follow_prefill", True),)),
    # ... only at light load (SpecConfig.follow_prefill_max_rows: no other prompt waiting, at
    # most 4 sequences decoding).
    "policy-follow-light": _policy_with(
        spec=(("follow_prefill", True), ("follow_prefill_max_rows", 4))
    ),
    # ... with the step cap of 1.4 / 1.5 plain steps: drafters fed behind the prompt step are
    # steady, so their first round needs no catch-up feed the cap would count.
    "policy-follow-light-cap14": _policy_with(
        spec=(("follow_prefill", True), ("follow_prefill_max_rows", 4), ("max_step_ratio", 1.4))
    ),
    # ... the drafter's forward on the prompt step's own stream, right behind it
    # (SpecConfig.follow_prefill_stream = "prefill"), and with the cap of 1.5.
    "policy-follow-light-onprefill": _policy_with(
        spec=(
            ("follow_prefill", True),
            ("follow_prefill_max_rows", 4),
            ("follow_prefill_stream", "prefill"),
        )  # fmt: skip
    ),
    "policy-follow-light-onprefill-cap15": _policy_with(
        spec=(
            ("follow_prefill", True),
            ("follow_prefill_max_rows", 4),
            ("follow_prefill_stream", "prefill"),
            ("max_step_ratio", 1.5),
        )  # fmt: skip
    ),
    "policy-follow-light-cap15": _policy_with(
        spec=(("follow_prefill", True), ("follow_prefill_max_rows", 4), ("max_step_ratio", 1.5))
    ),
    # A row's second token from a step that waits for no drafts beyond the rider bound
    # (SpecConfig.second_token_plain, on by default since 2026-11-27), alone, with the
    # light-load follow, and the policy without it.
    "policy-second": _policy_with(spec=(("second_token_plain", True),)),
    "policy-nosecond": _policy_with(spec=(("second_token_plain", False),)),
    "policy-second-follow": _policy_with(
        spec=(
            ("second_token_plain", True),
            ("follow_prefill", True),
            ("follow_prefill_max_rows", 4),
        )  # fmt: skip
    ),
    # Short prompts computed inside the decode lane's plain steps, chunks of 64 to 256 tokens
    # in steps of 32 (EngineConfig.prompt_in_decode_tokens; on by default; the sweep's short
    # prompts are 64-256 tokens): `off-inside` / `policy-inside` are `off` / `policy`, and
    # `off-noinside` / `policy-noinside` run without it.
    **_pair("inside", engine=(("prompt_in_decode_tokens", PROMPT_IN_DECODE_SIZES),)),
    **_pair("noinside", engine=(("prompt_in_decode_tokens", ()),)),
    # Without the start-up run of the prompt steps' GEMMs (EngineConfig.warm_prompt_gemms):
    # the first-mode bias's A/B (run first; H200, 15d5fbf: its long prompts 11 % slower).
    **_pair("nowarm", engine=(("warm_prompt_gemms", False),)),
    # Deltas after every launch, a drafting one after a plain one included
    # (EngineConfig.deliver_before_drafting=False; on by default since 2026-11-27).
    "policy-deltas-after": _policy_with(engine=(("deliver_before_drafting", False),)),
    # The GPU's block scheduler serving the prefill stream first (what every build before
    # 2026-11-26 did by mistake) or no stream first (EngineConfig.lane_priorities).
    "policy-prefill-first": _policy_with(engine=(("lane_priorities", "prefill-first"),)),
    "policy-equal-prio": _policy_with(engine=(("lane_priorities", "equal"),)),
    "off-prefill-first": Mode(
        "three", False, engine_options=(("lane_priorities", "prefill-first"),)
    ),
    "policy-capped": _policy_with(spec=(("max_step_ratio", 1.25),)),
    # The step cap just above an L = 1 round (1.25-1.35 plain steps as calibrated on an H200,
    # 7a8c0b7), the drafter catching up behind plain decode steps at up to 8 decoding rows
    # (SpecConfig.follow_decode_max_rows: no catch-up rounds at light load), and both.
    "policy-cap14": _policy_with(spec=(("max_step_ratio", 1.4),)),
    "policy-fdec": _policy_with(spec=(("follow_decode_max_rows", 8),)),
    # ... 64 tokens a row a step (SpecConfig.follow_decode_tokens): less added to each plain
    # step, over more steps; and with the step cap of 1.4 plain steps.
    "policy-fdec64": _policy_with(
        spec=(("follow_decode_max_rows", 8), ("follow_decode_tokens", 64))
    ),
    "policy-fdec64-cap14": _policy_with(
        spec=(("follow_decode_max_rows", 8), ("follow_decode_tokens", 64), ("max_step_ratio", 1.4))
    ),
    "policy-fdec-cap14": _policy_with(
        spec=(("follow_decode_max_rows", 8), ("max_step_ratio", 1.4))
    ),
    # ... that feed on a stream of its own beside the decode step, at its priority
    # (SpecConfig.follow_decode_stream "beside"): the step does not wait for it; and with 1,024
    # tokens a step. The catch-up rounds leave the tail, the ITL p99 stays (H200, 3841869).
    "policy-fdec-beside": _fed_beside("beside"),
    # ... 64 tokens a step (smaller grids beside the step), and below every lane instead.
    "policy-fdec-beside64": _fed_beside("beside", ("follow_decode_tokens", 64)),
    "policy-fdec-below": _fed_beside("below"),
    "policy-fdec-beside1k": _fed_beside("beside", ("catch_up_chunk", (16, 64, 256, 512, 1024))),
    "policy-bounded": _policy_with(sched=(("prefill_step_target_s", 0.02),)),
    "off-bounded": Mode("three", False, sched_options=(("prefill_step_target_s", 0.02),)),
    # Prompt chunking and packing, each setting spelled out (the default since a41665c is
    # 4,096-token chunks with pack 512, the sweep's longest prompt being 3,072 tokens).
    # chunk2k: the default before it (2,048-token chunks packed FCFS to the token budget).
    **_pair("chunk2k", sched=_CHUNK2K_FCFS),
    # chunk4k: a long prompt in one chunk, packed FCFS.
    **_pair("chunk4k", sched=_CHUNK4K_FCFS),
    # Decode steps spaced 10 / 14 ms apart while a prompt step of 1k+ tokens is in flight
    # (EngineConfig.decode_gap_beside_prefill_s; off by default).
    **_pair("gap10", engine=(("decode_gap_beside_prefill_s", 0.010),)),
    **_pair("gap14", engine=(("decode_gap_beside_prefill_s", 0.014),)),
    # Short prompt steps eager (EngineConfig.prompt_graph_tokens = 0, as before it; by default
    # they replay a CUDA graph of 256 tokens a row).
    **_pair("nopgraph", engine=(("prompt_graph_tokens", 0),)),
    # pack512: 2,048-token chunks; beside a prompt step's first chunk only chunks that end
    # their prompt, up to 512 tokens (SchedulerConfig.prefill_pack_tokens).
    **_pair("pack512", sched=_CHUNK2K_PACK512),
    # chunk4k-pack512: both, a long prompt heading a step of its own in one chunk (as vLLM,
    # with no per-request cap, runs a prompt that arrives alone): the default since a41665c.
    **_pair("chunk4k-pack512", sched=_CHUNK4K_PACK512),
    # A backlog lifts the pack limit: while the oldest queued prompt has waited 50 ms or more,
    # prompt steps pack FCFS up to the budget (SchedulerConfig.prefill_pack_backlog_s).
    **_pair("burst", sched=(("prefill_pack_backlog_s", 0.05),)),
    # In any such backlog (50 / 20 ms) the decode rows ride in the prompt steps, one forward
    # (EngineConfig.fuse_decode_backlog_s; lanes/backlog_fuse.py); no token floor.
    **_pair("fuse50", engine=_fuse(0.05, 0)),
    **_pair("fuse20", engine=_fuse(0.02, 0)),
    # ... only while 4,096 queued prompt tokens wait (a burst; fuse_decode_backlog_tokens):
    # after 50 ms, the default from 4eb6609 to 2026-11-29; after 20 ms, the default since, so
    # `policy` itself; at once; from 2,048 tokens; and both modes never fusing, as before.
    "policy-fuse50-4k": _policy_with(engine=_fuse(0.05, 4096)),
    "policy-fuse20-4k": _policy_with(engine=_fuse(0.02, 4096)),
    "policy-fuse20-2k": _policy_with(engine=_fuse(0.02, 2048)),
    "policy-fuse0-4k": _policy_with(engine=_fuse(0.0, 4096)),
    # ... after 10 ms: the engine's arrival stamps lag the client's by up to ~20 ms while a
    # prompt step is enqueued, and at 14 req/s the 20 ms rule then read 10-18 ms for a
    # prompt that had waited ~31 (bench/burst_windows.py, docs/performance.md).
    "policy-fuse10-4k": _policy_with(engine=_fuse(0.01, 4096)),
    # ... and, once fused, held fused while any prompt token queues (fuse_decode_hold_tokens).
    **_pair("fusehold", engine=(("fuse_decode_hold_tokens", 1),)),
    # The next prompt step launched behind the one in flight (EngineConfig.prompt_ahead: on a
    # GPU by default since 2026-11-30; "pahead" forces it, "no-pahead" turns it off).
    **_pair("pahead", engine=(("prompt_ahead", True),)),
    **_pair("no-pahead", engine=(("prompt_ahead", False),)),
    **_pair("nofuse", engine=_fuse(None, 0)),
    # Prompt steps' projections in GEMMs of at most 1,024 rows (KernelConfig.gemm_split_rows):
    # shorter kernels, between which the decode stream's kernels reach the SMs.
    **_pair("split1k", engine=_SPLIT1K),
    "off-chunk4k-pack512-split1k": Mode(
        "three", False, sched_options=_CHUNK4K_PACK512, engine_options=_SPLIT1K
    ),
    "policy-chunk4k-pack512-split1k": _policy_with(sched=_CHUNK4K_PACK512, engine=_SPLIT1K),
    # One-row GEMVs reading their weight tiles ahead, the first before the PDL wait
    # (KernelConfig.weight_prefetch): not at all (the default until 2026-11-28), or every GEMV (by
    # default only those over K tiles of 1,024: the drafter's projections, none of the 7B's).
    **{
        f"{base}-wpf-{mode}": _with_engine(base, (("kernels", KernelConfig(weight_prefetch=mode)),))
        for mode in ("off", "all")
        for base in ("off", "policy")
    },
    # Sampling noise as torch ops (~50 launches a draw), as before the Triton kernels became the
    # default (KernelConfig.fused_sampling_noise).
    **{
        f"{base}-torch-noise": _with_engine(
            base, (("kernels", KernelConfig(fused_sampling_noise=False)),)
        )
        for base in ("off", "policy")
    },
    # While decode rows run and no prompt waits behind the step, prompt steps' GEMMs leave 8 /
    # 16 / 32 SMs to the decode and verify streams (EngineConfig.prefill_sm_carveout; 0, all
    # SMs, by default); "-always": with prompts waiting too (prefill_sm_carveout_in_backlog),
    # as every carve-out ran before 2026-11-27.
    **{
        f"{base}-carve{n}": _with_engine(base, (("prefill_sm_carveout", n),))
        for n in (8, 16, 32)
        for base in ("off", "policy")
    },
    **{
        f"{base}-carve{n}-always": _with_engine(
            base, (("prefill_sm_carveout", n), ("prefill_sm_carveout_in_backlog", True))
        )
        for n in (8, 16, 32)
        for base in ("off", "policy")
    },
    # Without decode-ahead (EngineConfig.decode_ahead, on by default on a GPU since 4118e0a):
    # the plain and policy rows as they ran before it, for A/Bs in the same run.
    **_pair("noahead", engine=(("decode_ahead", False),)),
    # ... and decode-ahead paused while a prompt step is in flight
    # (EngineConfig.decode_ahead_beside_prefill = False).
    "off-ahead-yields": Mode(
        "three", False, engine_options=(("decode_ahead_beside_prefill", False),)
    ),
    "policy-ahead-yields": _policy_with(engine=(("decode_ahead_beside_prefill", False),)),
    # ... and a step launched ahead even when a prompt step that ends prompts is predicted to
    # land before the decode step in flight (EngineConfig.decode_ahead_waits_for_prompts =
    # False, as before 2026-11-27): the prompt's rows then wait for the step ahead too.
    "off-ahead-nowait": Mode(
        "three", False, engine_options=(("decode_ahead_waits_for_prompts", False),)
    ),
    "policy-ahead-nowait": _policy_with(engine=(("decode_ahead_waits_for_prompts", False),)),
    # Prompt steps enqueued whole (EngineConfig.prefill_slice_layers = 0, as before it; the
    # default enqueues them 4 layers at a time, the event loop free in between), and 1 layer
    # at a time, for A/Bs in the same run.
    **_pair("whole", engine=(("prefill_slice_layers", 0),)),
    "policy-slice1": _policy_with(engine=(("prefill_slice_layers", 1),)),
    "policy-slice2": _policy_with(engine=(("prefill_slice_layers", 2),)),
    "policy-slice4": _policy_with(engine=(("prefill_slice_layers", 4),)),
    # Prompt steps not padded to a 64-row bucket (EngineConfig.prompt_token_bucket = 0, as
    # before it), for A/Bs in the same run.
    **_pair("nobucket", engine=(("prompt_token_bucket", 0),)),
    # The policy charging each speculative round the host turnaround that decode-ahead hides
    # from plain steps (SpecConfig.round_overhead_s; 1.2 ms: the 7B batch-64 turnaround).
    "policy-overhead": _policy_with(spec=(("round_overhead_s", 1.2e-3),)),
    # ... and 2.5 ms: a speculating launch's host time at 2 req/s on an H200 (2.5-3.8 ms,
    # itl_anatomy's "launch decode N/k speculate" events at f4f5e3d).
    "policy-overhead25": _policy_with(spec=(("round_overhead_s", 2.5e-3),)),
    # The goodput policy yielding to prompt work (SpecConfig.yield_to_prefill), and without
    # the chunked catch-up graphs (SpecConfig.catch_up_chunk = 0: a long prompt's drafter then
    # catches up eagerly in a catch-up round instead of never drafting and keeping the batch
    # plain while it rides along). policy-noyield: the policy with yield_to_prefill off, for
    # runs at commits where it was on by default (9039577).
    "policy-yield": _policy_with(spec=(("yield_to_prefill", True),)),
    "policy-noyield": _policy_with(spec=(("yield_to_prefill", False),)),
    "policy-eager": _policy_with(spec=(("catch_up_chunk", 0),)),
    # The policy as it was before 2026-11-26: every far drafter caught up eagerly, no limit on
    # a catch-up round's context.
    "policy-old": _policy_with(
        spec=(
            ("catch_up_chunk", 0),
            ("catch_up_chunks", 8),
            ("catch_up_round_tokens", None),
            ("waiting_rider_max_steps", None),
        )
    ),
    # Every far drafter (a new request's prompt, or one behind after plain steps) catching up
    # in chunk-graph replays of 16, 64 or 256 tokens, up to 16 of them (4096 tokens), instead
    # of an eager forward that holds the event loop 17-32 ms (bench/itl_anatomy.py).
    "policy-chunks": _policy_with(
        spec=(
            ("catch_up_chunk", (16, 64, 256)),
            ("catch_up_chunks", 16),
            ("catch_up_round_tokens", None),
        )
    ),
    # ... and at most 1024 context tokens fed per catch-up round (the first far request always;
    # the default since 2026-11-26).
    "policy-chunks1k": _policy_with(
        spec=(
            ("catch_up_chunk", (16, 64, 256)),
            ("catch_up_chunks", 16),
            ("catch_up_round_tokens", 1024),
        )
    ),
    # A separate round's drafts made beside the plain rows' decode step, on the verify lane's
    # stream (SpecConfig.drafts_beside_decode): riders do not wait for them.
    "policy-beside": _policy_with(spec=(("drafts_beside_decode", True),)),
    # ... and no catch-up round while prompt work is in flight or queued.
    "policy-chunks1k-cy": _policy_with(
        spec=(
            ("catch_up_chunk", (16, 64, 256)),
            ("catch_up_chunks", 16),
            ("catch_up_round_tokens", 1024),
            ("catch_up_yields_to_prefill", True),
        )
    ),
    # A catch-up round every 2 or 4 decode steps instead of 8 (SpecConfig.catch_up_every_steps):
    # fewer steps that far requests wait as riders (uniform 0.8 at 11-14 req/s: the slowest
    # TPOTs were long prompts riding others' rounds at 15-21 ms a token).
    "policy-cu2": _policy_with(spec=(("catch_up_every_steps", 2),)),
    "policy-cu4": _policy_with(spec=(("catch_up_every_steps", 4),)),
    # Riders waiting for their drafter exempt from the rider bound for at most 16 steps
    # (SpecConfig.waiting_rider_max_steps): then the others' rounds may not stretch their gaps.
    # The default since 2026-11-26; policy-nowait is the policy before it.
    "policy-wait16": _policy_with(spec=(("waiting_rider_max_steps", 16),)),
    "policy-nowait": _policy_with(spec=(("waiting_rider_max_steps", None),)),
    "policy-cu2-cy": _policy_with(
        spec=(("catch_up_every_steps", 2), ("catch_up_yields_to_prefill", True))
    ),
    # Plans beside prompt work priced with what steps measured there (SpecConfig.
    # contention_costs: the cost model's contended levels), alone and with the variants that
    # let the policy speculate more under load (the drafter following prompt steps, catch-up
    # rounds every 2 steps), which cost the ITL tail when priced on the GPU to itself.
    "policy-contend": _policy_with(spec=(("contention_costs", True),)),
    "policy-nocontend": _policy_with(spec=(("contention_costs", False),)),
    "policy-follow-contend": _policy_with(
        spec=(("follow_prefill", True), ("contention_costs", True))
    ),
    "policy-cu2-contend": _policy_with(
        spec=(("catch_up_every_steps", 2), ("contention_costs", True))
    ),
    # ... and with riders waiting for their catch-up round outside the rider bound
    # (SpecConfig.waiting_riders_exempt), alone and with the eager catch-up.
    "policy-riders": _policy_with(spec=(("waiting_riders_exempt", True),)),
    "policy-riders-eager": _policy_with(
        spec=(("waiting_riders_exempt", True), ("catch_up_chunk", 0))
    ),
}
DEFAULT_MODES = ["three-ctrl", "three-fixed", "single-fixed", "three-off"]
SWEEP_MODES = ["off", "single-fixed", "three-fixed", "policy"]
