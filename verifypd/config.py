"""Frozen configuration dataclasses, validated once in ``__post_init__``.

Top-level objects (engine, runner, scheduler) take these configs; leaf objects (allocators,
kernels, samplers) take plain values.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

# The environment overrides, the model shapes and the speculation knobs live in modules of
# their own; every config is imported from here.
from verifypd.env_config import env_overrides, spec_env_overrides  # noqa: F401
from verifypd.model_config import ARCHITECTURES, PRESETS, ModelConfig  # noqa: F401
from verifypd.spec_config import SpecConfig, SpecMethod  # noqa: F401


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    num_blocks: int | None = None  # None: sized from memory (GPU fraction or a CPU byte budget)
    gpu_memory_utilization: float = 0.85
    cpu_kv_bytes: int = 1 << 30
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError("block_size must be a positive power of two")
        if self.num_blocks is not None and self.num_blocks <= 0:
            raise ValueError("num_blocks must be positive")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192  # token budget of one step (prefill chunks + decodes)
    # One request's prefill chunk per step. With prefill_pack_tokens (below), a prompt of up
    # to 4,096 tokens heads one step of its own, as vLLM (no per-request cap) runs a prompt
    # that arrives alone. On an H200 (ff5a0ce-b5c9bba, hetero, three 8-second sweeps) 4,096 +
    # pack 512 against 2,048 + FCFS packing: the policy's TTFT p99 -7..-10 / -17..-21 /
    # -13..-15 % at 5 / 8 / 11 req/s, +6..+10 % at 14, ITL p99 +13..+36 % at 5-14 req/s in 11
    # of 12 cells (decode steps beside a 4k-token prompt step wait longer for the SMs), TPOT
    # p99 within 7 %. The ITL-first setting of before: max_prefill_chunk=2048,
    # prefill_pack_tokens=None.
    max_prefill_chunk: int = 4096
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    ttft_budget_s: float = 0.5  # a prefill that waited this long beats decode/verify once
    # Sarathi-style bound: a prefill step's tokens are what the cost model predicts to run in
    # this many seconds (at least min_prefill_budget; only where step costs are measured);
    # None: max_num_batched_tokens. Off by default: on an H100 (dummy 7B + 0.5B drafter,
    # hetero traffic, f52259d) 20 ms cut the policy's ITL p99 at 3 and 8 req/s (16.5 and 29.5
    # ms against 24.1 and 37.9) but chunked long prompts so finely that TTFT p99 reached
    # 314-549 ms where unbounded it was 93-142 ms, and goodput at 11 req/s fell by half.
    prefill_step_target_s: float | None = None
    min_prefill_budget: int = 256
    # The bound is lifted while the oldest waiting prompt has waited more than this fraction
    # of ttft_budget_s (a backlog: prefill throughput first).
    prefill_bound_lift: float = 0.25
    # Prompt steps packed FCFS up to max_num_batched_tokens (None), or: beside a step's first
    # chunk only chunks that end their prompt ride along, up to this many tokens in all (the
    # prefill lane; the single lane always packs to the budget, as vLLM does), so a prompt
    # never waits for the next long prompt's chunk in its own step. With 2,048-token chunks it
    # lost (H100, 390e365: TTFT p99 +11 % at 8-14 req/s, a long prompt's two chunks each
    # beside decode steps); with 4,096 it is the default (above).
    prefill_pack_tokens: int | None = 512
    # While the oldest queued prompt has waited longer than this (a burst: prompts queue
    # behind one another), the limit above is lifted and prompt steps pack FCFS up to the
    # budget: fewer, fuller prompt steps drain the queue sooner. None: never lifted. Off: a
    # packed prompt waits for the others in its step, so a burst's slowest first token comes
    # later even where TTFT p99 falls (1e38db6, H200: 168.6 against 131.3 ms at 14 req/s).
    prefill_pack_backlog_s: float | None = None
    # The most of the KV pool one request may need (n choices at full length): beyond it,
    # the request is refused up front, so that one request cannot starve the rest.
    max_request_kv_share: float = 0.5

    def __post_init__(self) -> None:
        if self.max_num_seqs <= 0 or self.max_num_batched_tokens <= 0:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        if not 0.0 < self.max_request_kv_share <= 1.0:
            raise ValueError("max_request_kv_share must be in (0, 1]")
        if self.max_prefill_chunk <= 0:
            raise ValueError("max_prefill_chunk must be positive")
        if self.prefill_step_target_s is not None and self.prefill_step_target_s <= 0.0:
            raise ValueError("prefill_step_target_s must be positive (or None)")
        if self.min_prefill_budget <= 0:
            raise ValueError("min_prefill_budget must be positive")
        if not 0.0 <= self.prefill_bound_lift <= 1.0:
            raise ValueError("prefill_bound_lift must be in [0, 1]")
        backlog = self.prefill_pack_backlog_s
        number = isinstance(backlog, (int, float)) and not isinstance(backlog, bool)
        if backlog is not None and not (number and backlog >= 0.0):
            raise ValueError(f"prefill_pack_backlog_s must be >= 0 (or None), got {backlog!r}")
        pack = self.prefill_pack_tokens
        if pack is not None and (type(pack) is not int or pack < 0):
            raise ValueError(f"prefill_pack_tokens must be an int >= 0 or None, got {pack!r}")


@dataclass(frozen=True)
class KernelConfig:
    """Which Triton kernel runs where (GPU; the torch references ignore it). Handed to the
    kernels once, when an engine builds its op table (``kernels.get_ops``).

    Measured on an H200 (bench/gemv.py, bench/latency.py): at one row the GEMV kernel beats
    cuBLAS on every Qwen2.5 projection (cuBLAS also adds split-K reduction launches); at 2..16
    rows (batched decode, verify of 1 + L tokens) its tensor-core path beats cuBLAS on most of
    them. Every GEMV program re-reads its input and a fused prologue widens that re-read: the
    fused norm won on the narrow q/k/v projection and lost on gate_up (thousands of programs),
    the fused SwiGLU broke even or won, both only at one row (on the tensor-core path every
    fused prologue lost). Programmatic dependent launch (PDL, Hopper and newer) overlaps each
    decode-path kernel's launch with the tail of its predecessor.
    """

    gemv_max_rows: int = 16  # rows up to which a projection may run on the GEMV kernel
    fuse_norm: bool = True  # one row: RMSNorm folded into the projection's GEMV ...
    fuse_norm_max_n: int = 8192  # ... for projections of at most this many outputs
    fuse_silu: bool = True  # one row: SwiGLU folded into the down projection's GEMV
    fuse_silu_epilogue: bool = True  # 2..16 rows: SwiGLU on gate_up's GEMV epilogue
    pdl: bool = True  # programmatic dependent launch where the GPU and Triton support it
    # One-row GEMV programs that read their first K tile of weights before they wait for the
    # previous kernel (under PDL, while that kernel still runs) and each later tile one step
    # ahead: none ("off"), those with K tiles of 1,024 ("auto": the small models' latency-
    # bound projections), or all ("all"). H200, interleaved graph replays at a1a9b29: "auto"
    # takes a 0.5B step from 0.656 to 0.617 ms and a 1.5B step from 1.312 to 1.233 ms and
    # leaves the 7B's alone; "all" also slows the 7B by 2 % (bench/profile_decode.py --ab).
    weight_prefetch: str = "auto"
    # Sampling noise on a GPU as Triton kernels (kernels/triton_noise_race.py: the uniforms in
    # one launch, a draw in two) instead of ~50 torch ops per draw. The same bits. H200
    # (bench/sample_cost.py, 3c00bd8), a sampled drafter step's sampling at 1-16 rows: 77 torch
    # ops, 0.74-1.02 ms of host and 0.50-0.84 ms of GPU time, against 7 ops, 0.09-0.16 and
    # 0.05-0.07 ms.
    fused_sampling_noise: bool = True
    # A projection over more rows than this (a long prompt step, eager) runs as one GEMM per
    # block of this many rows (0: one GEMM): the same sums in shorter kernels, between which a
    # decode stream's kernels reach the SMs (beside a 2,048-row GEMM a decode step waits ~3x
    # its own time on an H200).
    gemm_split_rows: int = 0

    def __post_init__(self) -> None:
        rows, max_n = self.gemv_max_rows, self.fuse_norm_max_n
        if type(rows) is not int or not 0 <= rows <= 16:
            raise ValueError(f"gemv_max_rows must be an int in [0, 16], got {rows!r}")
        split = self.gemm_split_rows
        if type(split) is not int or not (split == 0 or split >= 64):
            raise ValueError(f"gemm_split_rows must be 0 (off) or an int >= 64, got {split!r}")
        if type(max_n) is not int or max_n <= 0:
            raise ValueError(f"fuse_norm_max_n must be a positive int, got {max_n!r}")
        if self.weight_prefetch not in ("off", "auto", "all"):
            raise ValueError(
                f"weight_prefetch must be 'off', 'auto' or 'all', got {self.weight_prefetch!r}"
            )
        for name in ("fuse_norm", "fuse_silu", "fuse_silu_epilogue", "pdl", "fused_sampling_noise"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")


LANES = ("decode", "prefill", "verify")
LANE_PRIORITIES = ("decode-first", "prefill-first", "equal")
# EngineConfig.prefill_sm_carveout below this: a prompt step keeps some SMs on any GPU that
# runs our kernels (an H100 SXM has 132); the device's own count is checked at start-up.
MAX_SM_CARVEOUT = 128
# The prompt-in-decode sizes measured on H200s (EngineConfig.prompt_in_decode_tokens).
PROMPT_IN_DECODE_SIZES = tuple(range(64, 257, 32))


@dataclass(frozen=True)
class EngineConfig:
    model: str = "default"  # default | PATH (HF dir or .gguf) | dummy:PRESET
    tokenizer: str | None = None  # None: the model's own
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"  # auto (bf16 on GPU, fp32 on CPU) | float32 | bfloat16 | float16
    seed: int = 0
    use_triton: bool | None = None  # None: Triton kernels on GPU, torch references on CPU
    cuda_graphs: bool | None = None  # None: on for GPU
    lane_mode: Literal["three", "single"] = "three"
    kernels: KernelConfig = field(default_factory=KernelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    spec: SpecConfig = field(default_factory=SpecConfig)
    max_logprobs: int = 20  # the most top log-probs a request may ask for (per token)
    # The lanes that get a CUDA stream of their own (DESIGN.md: all three); () = none.
    lane_streams: tuple[str, ...] = LANES
    # Which lane's stream the GPU's block scheduler serves first when several have kernels
    # waiting (CUDA stream priorities; ``lanes.executor.lane_priorities``): decode-first (the
    # design: decode > verify > prefill > the drafter following prompts), prefill-first (the
    # mirror; every build before 2026-11-26 ran this by mistake, having read CUDA's priority
    # range the wrong way round) or equal (the default priority for all).
    lane_priorities: Literal["decode-first", "prefill-first", "equal"] = "decode-first"
    # On GPU, make a landed step's deltas after the next launch (off only for A/B runs).
    emit_after_launch: bool = True
    # ... but before a launch that drafts after a plain one (``lanes.deltas``): drafting holds
    # the host for 1.5-8 ms (a drafter catching up on a prompt the longest), which the deltas,
    # whose previous tokens waited only behind a plain launch, would otherwise wait for too.
    # On H200s (0c415e7 and e507ac2, hetero, four same-call runs) the policy's ITL p99 at 2 req/s
    # was 4-8 % lower with it, at 5-26 req/s (where it seldom fires) within the runs' noise.
    # False: after every launch (A/B runs).
    deliver_before_drafting: bool = True
    # Decode-ahead: while a decode step runs, launch the next one behind it with its input
    # tokens read on the device, so the host's fold-back and planning overlap the GPU (while
    # the speculation policy speculates for no one; ``LaneDispatcher``). None = on where
    # launches only enqueue (GPU).
    decode_ahead: bool | None = None
    # ... also while a prompt step is in flight. False: no step ahead then, so the decode
    # stream has the host's turnaround between steps, in which the prompt step's kernels have
    # the GPU (with decode-first stream priorities a decode stream that always has kernels
    # queued leaves a prompt step only what decode does not use). On by default: one H100 run
    # (37c3964, hetero 16 s) gave `off` a 35-45 % lower TTFT p50 and 4-24 % lower TTFT p99
    # without it, the decode tail unchanged, and the policy no change beyond noise.
    decode_ahead_beside_prefill: bool = True
    # ... except while a prompt step that ends prompts is predicted (step cost model) to land
    # before the decode step in flight: a step ahead could not take the new rows, whose second
    # token would wait one decode step more (beside the next prompt of a burst, 20-40 ms). The
    # step then goes ahead as the prompt lands, with them (the rows in flight lose nothing
    # unless the prompt lands late). On an H200 (f4f5e3d, hetero, 2 and 5 req/s, 24 s) ITL p99
    # -3..-7 % in 3 of 4 cells (+1 % in the fourth), TPOT p99 level or lower
    # (docs/performance.md). False: launch ahead anyway.
    decode_ahead_waits_for_prompts: bool = True
    # While a prompt step of 1,024 tokens or more is in flight, a decode step is launched no
    # sooner than this many seconds after the last one, and none ahead (0 = back to back): the
    # prompt step has the GPU in between (a long prompt computes at ~28 ms per 1k tokens beside
    # a decode stream that is never idle, 23-24 fused). Trades ITL and TPOT for TTFT. Off: on an
    # H100 (0bdc8c4, hetero 8-second sweep at 5-14 req/s) 10 and 14 ms moved TTFT p99 both ways
    # within the run's noise (the slowest first token at 14 req/s, a 2.8k prompt in a burst of
    # six, took 198-200 ms in every mode) and 14 ms cost the policy ITL p99 6-27 %.
    decode_gap_beside_prefill_s: float = 0.0
    # While the oldest queued prompt has waited longer than this (a burst of prompts), the
    # decode rows ride inside the next prompt step (one forward, on the prefill lane's
    # stream, as vLLM runs every step) instead of decode steps beside it; their next token
    # then waits for that whole step (``lanes.backlog_fuse``). None: never. On an H200
    # (bench/burst.py, 31edae2) six prompts took 221 ms alone, 253 beside 32 decoding rows,
    # 238 with the rows inside. Alone (any backlog) 0.05 took 4-22 % off the policy's TTFT p99
    # at 14 req/s, but cost ITL p99 6 % in-process (bc38d9a) and, in one HTTP run of two
    # (60f94b1), ~20 % on ITL p99 at 2 req/s and TPOT p99 at 26: with the token floor below
    # (4eb6609, docs/performance.md) it fuses only in bursts, and is the default. 0.02 with
    # the floor (46bd48d, d53a4d3: two H200 runs) fuses the step before a burst's long prompt
    # too: TTFT p99 at 14 req/s -16 / -11 % against 0.05, ITL p99 +3-6 % at 26 at most.
    fuse_decode_backlog_s: float | None = 0.02
    # ... and only while the queued prompts hold at least this many tokens (0: any backlog):
    # a burst, not one long prompt whose wait a fused step shortens little while its decode
    # rows each wait a whole prompt step for their token. With 4,096 (4eb6609, H200, hetero
    # 2-26 req/s): in-process TTFT p99 at 14 req/s -3 % and ITL p99 no worse at any rate
    # than without fusing; over HTTP (--engine-process, two runs) TTFT p99 at 14 req/s 106-107
    # against 117-127 ms unfused and vLLM's 114.
    fuse_decode_backlog_tokens: int = 4096
    # Once a prompt step has carried the decode rows, the next ones do too, without the wait,
    # while the queue holds at least this many prompt tokens (None: every step decides anew).
    # A burst's later prompts then compute at the fused rate instead of beside decode steps.
    # Opt-in: two same-call H200 runs (5351e6e) showed no gain beyond the runs' noise, and at
    # 26 req/s 2-3.5x the rows fused for TTFT p99 -3 %, ITL p99 +3-6 % (docs/performance.md).
    fuse_decode_hold_tokens: int | None = None
    # From this many decoding rows, while a prompt waits for a prompt step, the rows ride in
    # it too, with the policy's drafts verified inside (every fused step then drafts): three
    # lanes while the batch is small, the single lane's fused rounds under load. None: never.
    fuse_rounds_rows: int | None = None
    # Prompt-ahead: while a prompt step runs, plan and launch the next one behind it on the
    # prefill lane's stream, so the host's fold-back, planning, input upload and first launches
    # overlap the GPU instead of sitting between two prompt steps (``lanes.prompt_ahead``;
    # it takes only prompts the step in flight does not hold, and none while the decode rows
    # are to ride in the next prompt step). On an H200 (dummy 7B, bench/burst.py --trace,
    # f1cbf6c) the GPU sat idle 14 ms of a six-prompt burst's 209 ms between prompt steps.
    # None = on where launches only enqueue (GPU). In five same-call H200 sweeps (a923aee,
    # ce1bd8f; hetero) it took TTFT p99 down 3-9 % at 8 and 26 req/s in all five, and ITL p99
    # up 9-19 % at 14 req/s in four and 12-14 % at 26 in three: it trades the decode tail, on
    # which this engine leads vLLM by ~20 % there, for the first token's, on which it trailed
    # vLLM at 20-26 req/s (six sittings, 762d7d1; docs/performance.md).
    prompt_ahead: bool | None = None
    # An eager prompt step is enqueued this many layers at a time, the event loop free in
    # between (GPU; 0 = the whole step at once). Its launch is host-bound: on an H200 the
    # dummy 7B's eager prefill took 12-20 ms of host time to enqueue against ~5 ms of GPU work
    # for a 200-token chunk, and while one was enqueued in one piece no decode step could be
    # launched or folded back in: that was the decode lanes' ITL p99 (17-25 ms).
    prefill_slice_layers: int = 4
    # While decode rows are running, a prompt step's cuBLAS GEMMs (and those of the drafter's
    # forward behind it) leave this many SMs to the decode and verify streams (cuBLASLt's SM
    # count target, ``lanes.executor.gemm_sm_carveout``; GPU; 0 = all SMs). A GEMM that fills
    # every SM holds them for its whole length, however high the decode stream's priority,
    # and a decode step beside a prompt step waits for the SMs between the prompt's kernels:
    # on an H200 (dummy 7B, a 16-row decode graph beside a 2,048-token prompt step) 4.4 ms
    # alone, 22 beside; leaving 16 SMs: 11 ms, for 15 % on the prompt step.
    prefill_sm_carveout: int = 0
    # ... also while other prompts wait behind the prompt step (a backlog). False (the
    # default): a prompt step with prompts queued behind it takes every SM, since the first
    # token's tail is made in bursts (on an H200 a fixed carve-out cost TTFT p99 2-45 % at
    # 5-14 req/s); the carve-out is decided again for each piece of a step (prefill_slice_layers).
    prefill_sm_carveout_in_backlog: bool = False
    # An eager prompt step's token count is padded up to a multiple of this (GPU; 0 = never;
    # the pad rows store no KV and are never read): cuBLAS chooses a kernel for every GEMM
    # shape it has not seen, and on an H200 the first GEMM of a new row count took 0.1-2 ms
    # of host time against ~14 us once seen, in every prompt step (its token count is new).
    prompt_token_bucket: int = 64
    # At start-up, run the target's projections once at every row count a padded prompt step
    # can have (``engine.gemm_warmup``; GPU, with prompt_token_bucket): otherwise each count's
    # first prompt step pays cuBLAS's kernel choice (~2.2 ms a GEMM of its first layer on an
    # H200), over a fresh server's first traffic. 128 counts for 8,192 tokens, 1.1 s. On an
    # H200 (15d5fbf) a first engine without it was 11-13 % slower on TTFT p99 at 2 req/s and
    # on its long prompt steps; with it, level with a second engine (docs/performance.md).
    # False: skip it.
    warm_prompt_gemms: bool = True
    # Prompt steps whose chunks are all at most this many tokens (and at most two of them)
    # replay a CUDA graph captured for this many tokens a row, each chunk padded at its end,
    # instead of an eager forward whose launch is host-bound (GPU with CUDA graphs; 0 = never;
    # prompt log-probs always run eager). The graph's activations (two rows of 256 tokens of a
    # 7B: tens of MB) fit the headroom kv_budget leaves. On an H100 (56f79c0, hetero, one
    # 8-second sweep and one 16-second run): TTFT p50 9-45 % lower for `off` and the policy
    # in every one of 16 cells (a short prompt step 15.5 ms from plan to fold-back against
    # 17-22: it still waits behind decode kernels), TTFT p99 within the runs' noise (0.73-1.19x),
    # ITL and TPOT p99 unchanged.
    prompt_graph_tokens: int = 256
    # A prompt whose rest is at most this many tokens is computed inside the decode lane's
    # next plain step instead of in a prompt step beside it (three lanes, GPU with CUDA graphs;
    # ``engine.prompt_in_decode``): one graph per size here (ascending; the chunk padded to the
    # smallest that holds it) and per decode batch up to 64 rows. Beside a decode step a
    # prompt step reads every weight again and slows the step (a 7B's 4.1 ms to 7.0 on an
    # H200); inside, its rows share the step's weight reads. Same-call A/Bs (hetero, dummy
    # 7B, 2-20 req/s; H200 at 53c2531, bc9a744 and 40722a3, H100 at 9dcab75) without
    # speculation: ITL p99 at 2 req/s 16-24 % lower in all four (H200 7.3 -> 5.6 ms), TPOT
    # p99 lower in 12 of 13 cells, TTFT p99 lower or level (the earlier runs' TTFT cells at
    # 2 req/s carried the sweep's first-mode bias, docs/performance.md), ITL p99 at 8-20 req/s
    # from 5 % lower to 11 % higher; the policy within its runs' noise either way. `verifypd
    # serve` with it checked on an H200 and, with default flags, on an 80 GB H100 (33
    # requests, streamed, with log-probs, no errors). () = never.
    prompt_in_decode_tokens: tuple[int, ...] = PROMPT_IN_DECODE_SIZES
    # Tests: the prompt-in-decode graphs built without CUDA graphs (each step runs the same
    # forward over their buffers eagerly), so prompts ride in decode steps on a CPU too.
    prompt_in_decode_eager: bool = False
    # After start-up, move every object the process holds out of the garbage collector's
    # reach (``gc.freeze``, as vLLM does): a full collection then scans only what serving
    # created, not the start-up heap (on a GPU a full collection of it stalled the step loop
    # for about 100 ms every second or two at batch 256). The serving front (AsyncEngine, so
    # the server and LLM) freezes after start-up and unfreezes in stop()/close(): an engine
    # dropped without them keeps its memory until the process ends. None = on for CUDA (a
    # CPU process, e.g. the test suite building engine after engine, collects normally).
    gc_freeze: bool | None = None
    # Time target and drafter forwards at start-up into ``EngineCore.cost_table``
    # (``engine.calibrate``, ~1.5 s on an H200), the step costs the speculation policy, the
    # prefill bound and decode-ahead's wait for a landing prompt plan with. None = on for CUDA
    # where one of them reads it (``engine.setup.calibration_wanted``: with or without a drafter).
    calibrate_costs: bool | None = None

    def __post_init__(self) -> None:
        if set(self.lane_streams) - set(LANES):
            raise ValueError(f"lane_streams must be a subset of {LANES}, got {self.lane_streams}")
        if self.lane_priorities not in LANE_PRIORITIES:
            got = self.lane_priorities
            raise ValueError(f"lane_priorities must be one of {LANE_PRIORITIES}, got {got!r}")
        if not isinstance(self.kernels, KernelConfig):
            raise ValueError(f"kernels must be a KernelConfig, got {self.kernels!r}")
        if self.max_logprobs < 0:
            raise ValueError("max_logprobs must be >= 0")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be auto|cpu|cuda, got {self.device!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto|float32|bfloat16|float16, got {self.dtype!r}")
        if self.lane_mode not in ("three", "single"):
            raise ValueError("lane_mode must be three|single")
        if self.prompt_ahead is not None and type(self.prompt_ahead) is not bool:
            raise ValueError(f"prompt_ahead must be a bool or None, got {self.prompt_ahead!r}")
        if type(self.prefill_slice_layers) is not int or self.prefill_slice_layers < 0:
            got = self.prefill_slice_layers
            raise ValueError(f"prefill_slice_layers must be an int >= 0, got {got!r}")
        carve = self.prefill_sm_carveout
        if type(carve) is not int or not 0 <= carve < MAX_SM_CARVEOUT:
            raise ValueError(
                f"prefill_sm_carveout must be an int in [0, {MAX_SM_CARVEOUT}), got {carve!r}"
            )
        if type(self.prompt_token_bucket) is not int or self.prompt_token_bucket < 0:
            got = self.prompt_token_bucket
            raise ValueError(f"prompt_token_bucket must be an int >= 0, got {got!r}")
        gap = self.decode_gap_beside_prefill_s
        if not isinstance(gap, (int, float)) or isinstance(gap, bool) or not 0.0 <= gap < 1.0:
            raise ValueError(f"decode_gap_beside_prefill_s must be in [0, 1) s, got {gap!r}")
        fuse = self.fuse_decode_backlog_s
        number = isinstance(fuse, (int, float)) and not isinstance(fuse, bool)
        if fuse is not None and not (number and 0.0 <= fuse < 10.0):
            raise ValueError(f"fuse_decode_backlog_s must be in [0, 10) s (or None), got {fuse!r}")
        least = self.fuse_decode_backlog_tokens
        if not isinstance(least, int) or isinstance(least, bool) or least < 0:
            raise ValueError(f"fuse_decode_backlog_tokens must be an int >= 0, got {least!r}")
        hold = self.fuse_decode_hold_tokens
        if hold is not None and (type(hold) is not int or hold < 0):
            raise ValueError(f"fuse_decode_hold_tokens must be an int >= 0 (or None), got {hold!r}")
        rows = self.fuse_rounds_rows
        if rows is not None and (type(rows) is not int or rows < 1):
            raise ValueError(f"fuse_rounds_rows must be an int >= 1 (or None), got {rows!r}")
        sizes = self.prompt_in_decode_tokens
        ints = isinstance(sizes, tuple) and all(
            isinstance(n, int) and not isinstance(n, bool) and 16 <= n <= 4096 for n in sizes
        )
        if not ints or list(sizes) != sorted(set(sizes)):
            raise ValueError(
                "prompt_in_decode_tokens must be ascending distinct ints in [16, 4096],"
                f" got {sizes!r}"
            )
        q = self.prompt_graph_tokens
        if type(q) is not int or not (q == 0 or 32 <= q <= 4096):  # above every verify width
            raise ValueError(f"prompt_graph_tokens must be 0 or an int in [32, 4096], got {q!r}")
        if self.calibrate_costs not in (None, True, False):
            got = self.calibrate_costs
            raise ValueError(f"calibrate_costs must be a bool or None, got {got!r}")

    def replace(self, **changes: Any) -> EngineConfig:
        return dataclasses.replace(self, **changes)
