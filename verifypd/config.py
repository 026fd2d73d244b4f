"""Frozen configuration dataclasses, validated once in ``__post_init__``, and model presets.

Top-level objects (engine, runner, scheduler) take these configs; leaf objects (allocators,
kernels, samplers) take plain values.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

ARCHITECTURES = ("llama", "qwen2", "qwen3")


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of one decoder-only checkpoint (Llama, Qwen2, Qwen3 families)."""

    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int = 0  # 0 = hidden_size // num_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # HF-style rope_scaling as a sorted tuple of (key, value) pairs (hashable), or None.
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.arch not in ARCHITECTURES:
            raise ValueError(f"unsupported architecture {self.arch!r}; expected {ARCHITECTURES}")
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return dict(self.rope_scaling) if self.rope_scaling else None

    @property
    def num_params(self) -> int:
        """Parameter count (embeddings counted once when tied)."""
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * d * (self.num_heads * 2 + self.num_kv_heads * 2)
        layer = attn + 3 * h * i + 2 * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.num_layers * layer + self.vocab_size * h + head + h

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face ``config.json`` dict."""
        model_type = cfg.get("model_type", "llama")
        arch = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}.get(
            model_type
        )
        if arch is None:
            raise ValueError(f"unsupported model_type {model_type!r}")
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters")
        if scaling and scaling.get("rope_type", scaling.get("type")) in (None, "default"):
            theta = scaling.get("rope_theta")
            scaling = None
        else:
            theta = None
        if theta is None:
            theta = cfg.get("rope_theta", 10000.0)
            if cfg.get("rope_parameters"):
                theta = cfg["rope_parameters"].get("rope_theta", theta)
        num_heads = cfg["num_attention_heads"]
        return cls(
            arch=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=_freeze(scaling),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", arch == "qwen2")),
            qk_norm=arch == "qwen3",
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )


def _freeze(d: dict[str, Any] | None) -> tuple[tuple[str, Any], ...] | None:
    if not d:
        return None
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in d.items()))


def _qwen2(vocab, h, i, layers, heads, kv, tie, ctx=32768, theta=1e6) -> ModelConfig:
    return ModelConfig(
        "qwen2", vocab, h, i, layers, heads, kv, rms_norm_eps=1e-6, rope_theta=theta,
        max_position_embeddings=ctx, tie_word_embeddings=tie, attention_bias=True,
        bos_token_id=151643, eos_token_ids=(151645, 151643),
    )  # fmt: skip


# Real shapes of public checkpoints, used by ``dummy:PRESET`` (random weights).
PRESETS: dict[str, ModelConfig] = {
    "smollm2-135m": ModelConfig(
        "llama", 49152, 576, 1536, 30, 9, 3, rms_norm_eps=1e-5, rope_theta=100000.0,
        max_position_embeddings=8192, tie_word_embeddings=True, bos_token_id=1,
        eos_token_ids=(2,),
    ),
    "qwen2.5-0.5b": _qwen2(151936, 896, 4864, 24, 14, 2, True),
    "qwen2.5-1.5b": _qwen2(151936, 1536, 8960, 28, 12, 2, True),
    "qwen2.5-7b": _qwen2(152064, 3584, 18944, 28, 28, 4, False),
    "qwen3-0.6b": ModelConfig(
        "qwen3", 151936, 1024, 3072, 28, 16, 8, head_dim=128, rms_norm_eps=1e-6,
        rope_theta=1e6, max_position_embeddings=40960, tie_word_embeddings=True, qk_norm=True,
        bos_token_id=151643, eos_token_ids=(151645,),
    ),
    "llama-3-8b": ModelConfig(
        "llama", 128256, 4096, 14336, 32, 32, 8, rms_norm_eps=1e-5, rope_theta=500000.0,
        max_position_embeddings=8192, bos_token_id=128000, eos_token_ids=(128001, 128009),
    ),
    # A tiny shape for fast CPU tests of the whole engine with dummy weights.
    "tiny": ModelConfig(
        "llama", 512, 64, 128, 2, 4, 2, rms_norm_eps=1e-5, max_position_embeddings=2048,
        bos_token_id=1, eos_token_ids=(2,),
    ),
}  # fmt: skip


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
    # budget: fewer, fuller prompt steps drain the queue sooner. None: never lifted.
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


SpecMethod = Literal["off", "ngram", "draft"]


@dataclass(frozen=True)
class SpecConfig:
    method: SpecMethod = "off"
    draft_model: str | None = None  # model spec for method == "draft"
    max_draft_len: int = 4  # L_max
    initial_draft_len: int = 4
    ngram_max: int = 4  # longest n-gram matched by prompt lookup
    ngram_min: int = 1
    # Benchmark only: draws the accepted count from a truncated geometric with this alpha.
    synthetic_acceptance: float | None = None
    controller: bool = True  # False: fixed L = initial_draft_len
    # With the controller on: "goodput" decides per step for the whole batch who speculates,
    # with what L and whether the verify is fused into the decode step, from measured costs
    # and a per-request latency guard; "feedback" is the older per-request feedback loop.
    policy: Literal["goodput", "feedback"] = "goodput"
    # The drafter computes its KV of each prompt chunk behind the target's prefill (goodput
    # policy, while it expects to speculate). Off by default: on an H100 with a 0.5B drafter
    # the eager drafter forward added ~20 ms of host time to every prefill step and doubled
    # the decode tail; drafters catch up in rate-limited catch-up rounds instead. Since
    # 2026-11-26, behind a prompt step launched in pieces (GPU, prefill_slice_layers), the
    # forward is queued to run after the launch has returned, in pieces too (the event loop
    # free in between, the step landing meanwhile; the request decodes plainly until it is
    # fed); since 2026-11-26 in replays of chunk graphs of its own (``catch_up_chunk``), not an
    # eager forward. Still off: on an H100 (hetero, 16-second runs, 70ea589) the policy then
    # speculated on half the tokens at 9-14 req/s, beside prompt steps, and its ITL p99 was
    # 1.35-1.58x `off`'s, TTFT p50 +11-17 ms (bench/mixed.py mode policy-follow).
    follow_prefill: bool = False
    # ... only while the GPU is lightly loaded: no other prompt waits (queued or part-prefilled)
    # and at most this many sequences decode (None: at any load). At light load the catch-up
    # rounds the follow replaces are most of the policy's slowest tokens; under load its
    # forwards share the GPU with the next prompt steps (above). On an H200 (6d65630, hetero,
    # 10-second runs) 4 rows took the catch-up rounds at 2 req/s from 18 to 2 and the policy's
    # ITL p99 there from 7.96 to 7.58 ms (`off` 6.90), level at 5-8 req/s; with prompts inside
    # decode steps (H200, 40722a3) it was worse: 8.60 against 7.57 at 2 req/s, 16.3 against
    # 15.4 at 5 (plain steps slowed by the follow's forwards beside them). Unset (mode
    # policy-follow-light; VERIFYPD_FOLLOW_PREFILL_MAX_ROWS for a server).
    follow_prefill_max_rows: int | None = None
    # Where the drafter's forward behind a prompt step runs: "follow", its own stream below
    # every lane (it then runs beside the decode steps after the prompt step); "prefill", the
    # prompt step's stream right behind it (beside the same decode steps the prompt step
    # already shares the GPU with, and ahead of the next prompt step). "prefill" was no
    # better (H200, e3d1253, mode policy-follow-light-onprefill): ITL p99 at 2 req/s 8.31 ms
    # against 8.89 on the follow stream (`off` 5.59), TTFT p99 at 5 req/s 89.6 against 72.2.
    follow_prefill_stream: Literal["follow", "prefill"] = "follow"
    # The drafter catches up behind decode steps too: right after a decode step is launched,
    # on its stream, each of its plain rows whose drafter is more than the catch-up graphs
    # reach behind (a request fresh from its prefill, one that decoded plainly for a while)
    # and that the policy may draft for (GoodputPolicy.expects_drafting: its own α̂ at least
    # GoodputConfig.follow_min_alpha) is fed the next tokens of its context, at most the
    # largest ``catch_up_chunk`` (one chunk-graph replay) a step, so its rounds start steady:
    # no catch-up round, whose whole context feed every row of its step waits for (half of the
    # policy's slowest tokens at 2 req/s, H200, 7a8c0b7). Fed on the follow stream instead
    # (below every lane, whole contexts) the policy all but stopped speculating: 20
    # speculating decisions of 2,700 at 5 req/s (H100, 5329751; rows waiting for feeds queued
    # behind back-to-back decode steps, the likely cause). Only while at most this many
    # sequences decode and no prompt waits; 0: off. Off by default: the feed moves into the
    # plain steps, and the tail with it. With 8 (bench/mixed.py mode policy-fdec, hetero,
    # a4c9fdc) the policy's ITL p99 at 2 / 5 req/s was 9.26 / 17.75 ms against 7.39 / 15.31
    # without (H200; `off` 5.50 / 14.06), 13.55 / 23.59 against 12.93 / 19.21 (H100).
    follow_decode_max_rows: int = 0
    # ... and the tokens fed to a row behind one step: one of ``catch_up_chunk``'s sizes (one
    # chunk-graph replay of that q); None: the largest. A smaller chunk adds less to each
    # plain step over more steps. 64 was no better (H200, 57beec5, mode policy-fdec64): ITL
    # p99 at 2 / 5 req/s 9.58 / 16.4 ms against the policy's 8.80 / 15.4 (`off` 5.68 / 15.5),
    # TPOT p50 at 2 req/s 3.69 against 3.32.
    follow_decode_tokens: int | None = None
    # ... and where that feed runs: "decode", right behind the decode step on its stream (the
    # next step waits for it); "beside", on a stream of its own at the decode lane's priority,
    # in a set of chunk graphs of its own, launched with the step and not waited for by it (the
    # two share the GPU's SMs and bandwidth; whatever drafts for the view waits for the feed on
    # the GPU first, ``wait_for_follow``); "below", that stream at the lowest priority (the
    # follow stream's: it takes what the lanes leave). Both took the catch-up rounds out of the
    # light-load tail but not the tail itself (H200, hetero, 2 req/s, 30-second runs, 3841869,
    # modes policy-fdec-beside / -below): catch-up rounds 9-10 % of the slowest 1 % of tokens
    # against 47 %, ITL p99 7.51 / 7.73 ms against the policy's 7.59 (`off` 5.67); the plain
    # steps beside the feed got slower (their p99 6.37 / 6.85 against 6.32), and "beside" gave
    # up the light-load speedup (TPOT p50 3.97 against 3.38 ms). Better than "decode" in the
    # same call (ed52da5, 12-second runs: ITL p99 at 2 / 8 req/s 7.95 / 16.65 against 9.23 /
    # 18.94) but not than no feed (7.23 / 15.02).
    follow_decode_stream: Literal["decode", "beside", "below"] = "decode"
    # The drafter's context window (draft model): a view of a prompt longer than
    # ``draft_window_sink`` + ``draft_window`` tokens holds its first ``draft_window_sink``
    # and last ``draft_window`` tokens (and every token after them); the middle is never fed
    # (``engine.draft_view``). The drafter's pass over a long prompt then costs at most
    # sink + window tokens; output is lossless whatever the window (the target verifies
    # against the whole context), only acceptance can fall. None: the whole context.
    draft_window: int | None = None
    draft_window_sink: int = 4
    # Draft the next round on the device right behind each verify (draft model; sampled
    # drafting too since 2026-11-28): None = on GPU, where it hides the host's turnaround
    # between rounds.
    chain_drafts: bool | None = None
    # Tests: pad a verify batch of mixed L to one width even without a CUDA graph for it.
    always_pad_verify: bool = False
    # The drafter's CUDA graphs beyond q = 1 and 2 (query lengths, ascending, up to the verify
    # batch): a drafter a few tokens behind (its request decoded plainly for a few steps)
    # catches up in one graph replay of the smallest q that covers it, not in an eager forward
    # (~10 ms of host time for a 0.5B drafter on an H100). () = none.
    catch_up_graphs: tuple[int, ...] = (4, 8)
    # A drafter further behind (a request fresh from its prefill, or one that decoded plainly
    # for a while) catches up in replays of a chunk graph of q tokens a row (for up to 8 rows;
    # they write the drafter's KV and compute no logits), q the largest of these sizes that its
    # context is longer than, at most ``catch_up_chunks`` replays (a longer context, or one no
    # longer than the smallest size: one eager forward). An int is one size; 0 = none. Default
    # since 2026-11-26: without them every new drafter caught up in an eager forward that held
    # the event loop, and so every lane, for 17-32 ms of host time on an H100 (bench/
    # itl_anatomy.py): the policy's ITL p99 was 1.14-1.44x `off`'s at 2-14 req/s (hetero),
    # 0.94-1.13x with these three sizes and ``catch_up_round_tokens`` (two same-run 16-second
    # H100 sweeps, docs/performance.md). Not better everywhere: with uniform α = 0.8 at 11-14
    # req/s the replays share the GPU with large prompt steps and lose to the eager forward
    # (TPOT p99 1.65x `off` against 0.83x at 14 req/s, a4cad54). (A single 256 chunk with 8
    # replays, e89bec0, left every context under 256 tokens eager and never drafted for one
    # over 2048.)
    # Chunks of 512 and 1,024 too (with amortize_within_request, mode policy-horizon-chunk1k)
    # made the catch-up rounds' own tokens sooner (their p99 15.0 against 18.8 ms, H200, 2
    # req/s, 40-second runs, ed52da5) but not the ITL p99 (7.58 against 7.63): they only touch
    # contexts over 512 tokens, and 80 % of the hetero prompts are 64-256.
    catch_up_chunk: int | tuple[int, ...] = (16, 64, 256)
    catch_up_chunks: int = 16
    # The chunk graphs' attention in pieces of at most 64 // G tokens a row on the split-K
    # (short-query) kernel (``kernels.metadata.uniform_pieces``), not on the prefill kernel,
    # whose grid for one or two rows of 16-256 tokens is 2-30 programs, each walking the whole
    # context; in the graphs of at most 256 tokens (``cuda_graphs.SHORT_ATTENTION_TOKENS``).
    # On an H200 a replay of the 0.5B drafter over a 2,048-token context took 1.28-1.59 ms of
    # GPU without it (q = 16-256, one row; bench/catch_up_cost.py), 3-7x the host's time to
    # launch it, and 0.89-1.50 with it. The catch-up rounds' own tokens came sooner (their p99
    # 13.5 against 15.4 ms at 2 req/s, 19.0 against 38.2 at 8, hetero, one run), the ITL p99
    # did not measurably move (mode policy-prefill-chunks; docs/performance.md).
    chunk_short_attention: bool = True
    # Most context tokens one catch-up round of the goodput policy feeds the drafters (the
    # first far request always goes): GoodputConfig.catch_up_round_tokens. None: no limit.
    # With chunk graphs a round's catch-up is GPU time every row of its step waits for
    # (unbounded, 90-150 ms steps at 9-14 req/s on an H100).
    catch_up_round_tokens: int | None = 1024
    # At most one catch-up round every this many decode steps (GoodputConfig.
    # catch_up_every_steps); the requests waiting for one ride in the others' rounds. 8 since
    # the eager catch-up, whose 17-32 ms of host time a round this limited. 2 (bench/mixed.py
    # mode policy-cu2; H100, 16-second runs, 325b986 / c1574bb): uniform 0.8 at 8-14 req/s TTFT
    # p99 0.48-0.91x and TPOT p50 0.62-0.71x `off`'s, but ITL p99 1.06-1.18x at 11-14 req/s in
    # both uniform 0.8 and hetero, so not the default.
    catch_up_every_steps: int = 8
    # ... and none while prompt work is in flight or queued
    # (GoodputConfig.catch_up_yields_to_prefill). Off: not measurably better (one H100 run).
    catch_up_yields_to_prefill: bool = False
    # A round whose verify runs on its own lane drafts on that lane's stream, beside the plain
    # rows' decode step, instead of ahead of it on the decode stream: plain rows riding in the
    # round (a third of the policy's slowest tokens in the H100 sweeps of 2026-11-26) no
    # longer wait for others' drafts, and the goodput policy's rider bound reads their own
    # step (GoodputConfig.drafts_beside_decode). Off by default: on an H100 (16-second runs,
    # 70ea589 / 415307a) level with the default in hetero at 1-14 req/s, TPOT p99 1.26x and
    # 1.70x `off`'s with uniform 0.8 at 8 and 11 req/s.
    drafts_beside_decode: bool = False
    # The goodput policy's latency guard: a speculating request's expected time per token may
    # exceed the plain step by ``guard_slack``, and a plain row riding in a speculating step
    # may wait up to (1 + ``rider_slack``) plain steps for its token.
    guard_slack: float = 0.0
    rider_slack: float = 0.05
    # ... and no speculating step may take longer than this many plain steps (None: no cap).
    # Off by default: on two H200s (hetero, 61bc74b) a cap of 1.25 did not beat no cap on the
    # sweep's criteria (9/20 and 10/20 checks within 5 % of the best mode, against 11/20 and
    # 13/20; p99s of 10-83 requests a run are noisy at that margin). 1.4 on an H100 (mode
    # policy-cap14, a4c9fdc; the cap counts a catch-up round's feed since then) was `off`:
    # 10 drafted tokens at 2-8 req/s.
    max_step_ratio: float | None = None
    # The goodput policy speculates for nobody while prompt work is in flight or queued (a
    # prefill chunk sharing the GPU with the round). Off by default: in four same-run H100
    # sweeps (2026-11-24) it was within 5 % of the best other mode in 55 of 80 checks against
    # 50 of 80 without it, and single runs swung both ways by 3-6 checks (noise of 8-second
    # runs; docs/performance.md).
    yield_to_prefill: bool = False
    # The goodput policy lets rows waiting for their drafter's catch-up round ride in a
    # speculating step outside the rider bound (GoodputConfig.waiting_riders_exempt). On by
    # default since e89bec0, with catch_up_chunk = 0 (the pair was measured together).
    waiting_riders_exempt: bool = True
    # ... for at most this many decode steps from when it began waiting (None: as long as it
    # waits; GoodputConfig.waiting_rider_max_steps). 16 by default since 2026-11-26: with
    # uniform 0.8 at 8-14 req/s the policy's TPOT p99 was 1.27-1.69x `off`'s (long prompts
    # riding others' rounds at 15-21 ms a token while they waited; in 3 of 5 H100 runs), 1.03-1.07x
    # with the bound, ITL p99 1.06-1.09x against 1.06-1.39x; hetero at 5-14 req/s ITL p99
    # 0.97-1.04x, TPOT p99 0.98-1.23x against 1.01-1.20x. It gives up speed under load (TPOT
    # p50 0.93x `off` at 11 req/s against 0.75x), and TTFT p99 was 1.17-1.21x `off` at 11-14
    # req/s with uniform 0.8 (0.85-0.92x without; one 16-second run each, 33ece2d).
    waiting_rider_max_steps: int | None = 16
    # Host time charged to each speculative round where decode-ahead runs (a plain step then
    # pays none, a drafting step still waits for its tokens): GoodputConfig.round_overhead_s.
    # 0 by default: on an H200 (20c86b4, hetero 2-26 req/s) 1.2 and 2.5 ms stopped the policy
    # speculating at all (the rider bound takes the charge too): `off` with extra steps.
    round_overhead_s: float = 0.0
    # The goodput policy takes, among the plans within this fraction of the best tokens/s, the
    # one with the shortest step: the gap a request sees when its first draft is rejected,
    # the ITL tail (GoodputConfig.tail_tolerance). 0: the best tokens/s.
    tail_tolerance: float = 0.0
    # While prompt work is in flight or queued, the goodput policy prices its plans with what
    # steps measured beside prompt steps (GoodputConfig.contention_costs; the cost model's
    # contended levels, learned online: on an H100 drafter steps 2.7-4.5x their calibration
    # there, plain decode 1.0-1.5x). Off: in four same-call H100 sweeps (0ad1347) within 5 % of
    # the best other mode in 50 of 80 checks against 60 without; with follow_prefill it cut
    # the speculative tokens beside prompt steps from 48 % to 0.7 % (ITL p99 1.15x `off`).
    contention_costs: bool = False
    # A row's second token comes from a step that waits for no drafts beyond the rider bound:
    # in its first decode step it neither speculates nor catches up, others' rounds may not
    # stretch it (GoodputConfig.second_token_plain), and a decision kept for the next step
    # while one ran (decode-ahead) is not used once a row has joined since. On by default since
    # 2026-11-27: at 2-8 req/s (hetero, two same-call H200 runs at 1473918) the riders' slowest
    # gaps fell from 16-46 ms to 0-18 ms, the policy's ITL p99 at 5 req/s from 17.8 / 17.0 to
    # 14.5 / 14.3 ms (`off` 15.8 / 14.9), its misses of "within 5 % of `off`" at 2-8 req/s
    # from 4 / 2 of 12 to 2 / 1; 14-26 req/s level; the light-load TPOT p50 1.25 / 1.20x `off`
    # against 1.28 / 1.28x. Two more runs at 2-26 req/s (24694fe, 9da73ad): ITL p99 at 8-26
    # req/s within 5 % or lower in 7 of 8 cells (1.09x at 14 once), not lower at 2 (the
    # light-load tail is now plain rows alone, as for `off`).
    second_token_plain: bool = True
    # The goodput policy probes requests with no verify of their own also while nothing has
    # drafted for a probe interval, not only while the population is parked
    # (GoodputConfig.probe_when_stale): a population α below what pays otherwise holds every
    # new request back for good. On by default since 2026-11-28.
    probe_when_stale: bool = True
    # The goodput policy spreads a catch-up round's feed over at most the rounds the request
    # has left (its tokens left over the most tokens a round yields), not always over
    # GoodputConfig.amortize_steps: a long prompt a few tokens from its end is not caught up
    # on (GoodputConfig.amortize_within_request). Off: no measurable change on the hetero
    # profile, whose long prompts ask for 32-128 tokens, so their catch-ups still pay (H200,
    # 2 req/s, 40-second runs, ed52da5, mode policy-horizon: catch-up rounds 2.4 % of tokens
    # either way, ITL p99 7.79 against 7.63 ms, TPOT p50 3.32 against 3.36).
    amortize_within_request: bool = False
    # The ITL tail's budget (GoodputConfig.tail_budget; None: none, the default): at most about
    # this share of all tokens may come more than ``tail_ratio`` plain steps after the one
    # before because of speculation (``--spec-tail-budget``). On an H200 with the 0.5B drafter
    # beside the 7B target, 0.002 kept the ITL p99 at 2 req/s at 1.02-1.09x `off`'s (the
    # policy: 1.39-1.62x) and gave up the light-load speedup with it (TPOT p50 1.00x `off`'s,
    # the policy's 1.24-1.64x): no round of that pair fits in 1.05 plain steps. Not the default.
    tail_budget: float | None = None
    tail_ratio: float = 1.05

    def __post_init__(self) -> None:
        if self.method not in ("off", "ngram", "draft"):
            raise ValueError(f"spec method must be off|ngram|draft, got {self.method!r}")
        if self.method == "draft" and not self.draft_model:
            raise ValueError("spec method 'draft' needs draft_model")
        if not 0 <= self.initial_draft_len <= self.max_draft_len <= 16:
            raise ValueError("need 0 <= initial_draft_len <= max_draft_len <= 16")
        if self.synthetic_acceptance is not None and not 0 <= self.synthetic_acceptance <= 1:
            raise ValueError("synthetic_acceptance must be in [0, 1]")
        if self.policy not in ("goodput", "feedback"):
            raise ValueError(f"spec policy must be goodput|feedback, got {self.policy!r}")
        if not isinstance(self.always_pad_verify, bool):
            raise ValueError(f"always_pad_verify must be a bool, got {self.always_pad_verify!r}")
        if not isinstance(self.chunk_short_attention, bool):
            raise ValueError(
                f"chunk_short_attention must be a bool, got {self.chunk_short_attention!r}"
            )
        lens = self.catch_up_graphs
        if (
            not isinstance(lens, tuple)
            or not all(isinstance(q, int) and 3 <= q <= 64 for q in lens)
            or list(lens) != sorted(set(lens))
        ):
            raise ValueError(
                f"catch_up_graphs must be ascending distinct ints in [3, 64], got {lens!r}"
            )
        chunk = self.catch_up_chunk
        sizes = chunk if isinstance(chunk, tuple) else (chunk,) if chunk else ()
        if (
            not isinstance(chunk, (int, tuple))
            or not all(isinstance(q, int) and max(lens, default=2) < q <= 1024 for q in sizes)
            or list(sizes) != sorted(set(sizes))
        ):
            raise ValueError(
                f"catch_up_chunk must be 0, or ascending distinct sizes above every"
                f" catch_up_graphs length and at most 1024, got {chunk!r}"
            )
        if not (0.0 <= self.guard_slack <= 1.0 and 0.0 <= self.rider_slack <= 1.0):
            raise ValueError("guard_slack and rider_slack must be in [0, 1]")
        if self.max_step_ratio is not None and self.max_step_ratio < 1.0:
            raise ValueError(f"max_step_ratio must be >= 1 (or None), got {self.max_step_ratio!r}")
        if self.catch_up_round_tokens is not None and self.catch_up_round_tokens < 1:
            raise ValueError(
                f"catch_up_round_tokens must be >= 1 (or None), got {self.catch_up_round_tokens!r}"
            )
        wait = self.waiting_rider_max_steps
        if wait is not None and (not isinstance(wait, int) or wait < 1):
            raise ValueError(f"waiting_rider_max_steps must be an int >= 1 or None, got {wait!r}")
        if not isinstance(self.catch_up_every_steps, int) or self.catch_up_every_steps < 1:
            raise ValueError(
                f"catch_up_every_steps must be an int >= 1, got {self.catch_up_every_steps!r}"
            )
        if self.catch_up_chunks < 0:
            raise ValueError(f"catch_up_chunks must be >= 0, got {self.catch_up_chunks!r}")
        rows = self.follow_prefill_max_rows
        if rows is not None and (not isinstance(rows, int) or isinstance(rows, bool) or rows < 0):
            raise ValueError(f"follow_prefill_max_rows must be an int >= 0 or None, got {rows!r}")
        if self.follow_prefill_stream not in ("follow", "prefill"):
            raise ValueError(
                f"follow_prefill_stream must be 'follow' or 'prefill', "
                f"got {self.follow_prefill_stream!r}"
            )
        rows = self.follow_decode_max_rows
        if not isinstance(rows, int) or isinstance(rows, bool) or rows < 0:
            raise ValueError(f"follow_decode_max_rows must be an int >= 0, got {rows!r}")
        if self.follow_decode_stream not in ("decode", "beside", "below"):
            raise ValueError(
                f"follow_decode_stream must be 'decode', 'beside' or 'below', "
                f"got {self.follow_decode_stream!r}"
            )
        feed = self.follow_decode_tokens
        if feed is not None and feed not in self.chunk_sizes:
            raise ValueError(
                f"follow_decode_tokens must be None or one of catch_up_chunk's sizes "
                f"{self.chunk_sizes}, got {feed!r}"
            )
        if not isinstance(self.probe_when_stale, bool):
            raise ValueError(f"probe_when_stale must be a bool, got {self.probe_when_stale!r}")
        if not isinstance(self.amortize_within_request, bool):
            raise ValueError(
                f"amortize_within_request must be a bool, got {self.amortize_within_request!r}"
            )
        window, sink = self.draft_window, self.draft_window_sink
        if window is not None and (type(window) is not int or window < 1):
            raise ValueError(f"draft_window must be an int >= 1 or None, got {window!r}")
        if type(sink) is not int or sink < 0:
            raise ValueError(f"draft_window_sink must be an int >= 0, got {sink!r}")
        if self.round_overhead_s < 0:
            raise ValueError(f"round_overhead_s must be >= 0, got {self.round_overhead_s!r}")
        if self.tail_budget is not None and not 0.0 <= self.tail_budget < 1.0:
            raise ValueError(f"tail_budget must be in [0, 1) or None, got {self.tail_budget!r}")
        if not self.tail_ratio >= 1.0:
            raise ValueError(f"tail_ratio must be >= 1, got {self.tail_ratio!r}")
        if not 0.0 <= self.tail_tolerance < 1.0:
            raise ValueError(f"tail_tolerance must be in [0, 1), got {self.tail_tolerance!r}")

    @property
    def feeds_beside_decode(self) -> bool:
        """The drafter's catch-up behind decode steps runs on a stream of its own
        (``follow_decode_stream`` "beside" or "below", with ``follow_decode_max_rows``)."""
        return self.follow_decode_stream != "decode" and self.follow_decode_max_rows > 0

    @property
    def chunk_sizes(self) -> tuple[int, ...]:
        """``catch_up_chunk`` as ascending sizes (() when off)."""
        chunk = self.catch_up_chunk
        return chunk if isinstance(chunk, tuple) else (chunk,) if chunk else ()


LANES = ("decode", "prefill", "verify")
# Environment variables that older A/B scripts set; only entry points map them (env_overrides).
ENV_LANE_STREAMS = "VERIFYPD_LANE_STREAMS"
ENV_LANE_PRIORITIES = "VERIFYPD_LANE_PRIORITIES"
LANE_PRIORITIES = ("decode-first", "prefill-first", "equal")
ENV_EMIT_AFTER_LAUNCH = "VERIFYPD_EMIT_AFTER_LAUNCH"
ENV_DELIVER_BEFORE_DRAFTING = "VERIFYPD_DELIVER_BEFORE_DRAFTING"
ENV_DECODE_AHEAD = "VERIFYPD_DECODE_AHEAD"
ENV_GC_FREEZE = "VERIFYPD_GC_FREEZE"
ENV_PREFILL_SLICE_LAYERS = "VERIFYPD_PREFILL_SLICE_LAYERS"
ENV_PROMPT_TOKEN_BUCKET = "VERIFYPD_PROMPT_TOKEN_BUCKET"
ENV_PREFILL_SM_CARVEOUT = "VERIFYPD_PREFILL_SM_CARVEOUT"
# EngineConfig.prefill_sm_carveout below this: a prompt step keeps some SMs on any GPU that
# runs our kernels (an H100 SXM has 132); the device's own count is checked at start-up.
MAX_SM_CARVEOUT = 128
ENV_FOLLOW_PREFILL = "VERIFYPD_FOLLOW_PREFILL"
ENV_FOLLOW_PREFILL_MAX_ROWS = "VERIFYPD_FOLLOW_PREFILL_MAX_ROWS"
ENV_FOLLOW_DECODE_MAX_ROWS = "VERIFYPD_FOLLOW_DECODE_MAX_ROWS"
ENV_FOLLOW_DECODE_TOKENS = "VERIFYPD_FOLLOW_DECODE_TOKENS"
ENV_TAIL_TOLERANCE = "VERIFYPD_TAIL_TOLERANCE"
ENV_PROMPT_IN_DECODE_EAGER = "VERIFYPD_PROMPT_IN_DECODE_EAGER"
ENV_WARM_PROMPT_GEMMS = "VERIFYPD_WARM_PROMPT_GEMMS"
# The prompt-in-decode sizes measured on H200s (EngineConfig.prompt_in_decode_tokens).
PROMPT_IN_DECODE_SIZES = tuple(range(64, 257, 32))


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
    """SpecConfig fields from ``VERIFYPD_FOLLOW_PREFILL`` ("0" = off, "1" = on),
    ``VERIFYPD_FOLLOW_PREFILL_MAX_ROWS``, ``VERIFYPD_FOLLOW_DECODE_MAX_ROWS`` and
    ``VERIFYPD_FOLLOW_DECODE_TOKENS`` (ints >= 0) and ``VERIFYPD_TAIL_TOLERANCE`` (a float),
    for A/Bs against a server (the knobs have no flag)."""
    out: dict[str, Any] = {}
    if ENV_FOLLOW_PREFILL in environ:
        out["follow_prefill"] = environ[ENV_FOLLOW_PREFILL] != "0"
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
    # (4eb6609, docs/performance.md) it fuses only in bursts, and is the default.
    fuse_decode_backlog_s: float | None = 0.05
    # ... and only while the queued prompts hold at least this many tokens (0: any backlog):
    # a burst, not one long prompt whose wait a fused step shortens little while its decode
    # rows each wait a whole prompt step for their token. With 4,096 (4eb6609, H200, hetero
    # 2-26 req/s): in-process TTFT p99 at 14 req/s -3 % and ITL p99 no worse at any rate
    # than without fusing; over HTTP (--engine-process, two runs) TTFT p99 at 14 req/s 106-107
    # against 117-127 ms unfused and vLLM's 114.
    fuse_decode_backlog_tokens: int = 4096
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
    # Time target and drafter forwards at start-up into ``EngineCore.cost_table`` (the
    # speculation policy's prior, ``engine.calibrate``): None = on for CUDA with speculation.
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
