"""``bench/mixed.py``'s A/B modes of the engine's scheduling and kernels (prompt chunking and
packing, backlog fusing, prompt-ahead, carve-outs, decode-ahead's rules, sliced prompt steps)
and of the policy's catch-up and contention rules, each ``off-NAME`` / ``policy-NAME`` where
both were run; ``mixed_modes.MODES`` holds them beside the rest."""

from __future__ import annotations

from mixed_mode import (
    CHUNK2K_FCFS,
    CHUNK2K_PACK512,
    CHUNK4K_FCFS,
    CHUNK4K_PACK512,
    SPLIT1K,
    Mode,
    fuse,
    pair,
    policy_with,
    with_engine,
)

from verifypd.config import KernelConfig

AB_MODES = {
    # Prompt chunking and packing, each setting spelled out (the default since a41665c is
    # 4,096-token chunks with pack 512, the sweep's longest prompt being 3,072 tokens).
    # chunk2k: the default before it (2,048-token chunks packed FCFS to the token budget).
    **pair("chunk2k", sched=CHUNK2K_FCFS),
    # chunk4k: a long prompt in one chunk, packed FCFS.
    **pair("chunk4k", sched=CHUNK4K_FCFS),
    # Decode steps spaced 10 / 14 ms apart while a prompt step of 1k+ tokens is in flight
    # (EngineConfig.decode_gap_beside_prefill_s; off by default).
    **pair("gap10", engine=(("decode_gap_beside_prefill_s", 0.010),)),
    **pair("gap14", engine=(("decode_gap_beside_prefill_s", 0.014),)),
    # Short prompt steps eager (EngineConfig.prompt_graph_tokens = 0, as before it; by default
    # they replay a CUDA graph of 256 tokens a row).
    **pair("nopgraph", engine=(("prompt_graph_tokens", 0),)),
    # pack512: 2,048-token chunks; beside a prompt step's first chunk only chunks that end
    # their prompt, up to 512 tokens (SchedulerConfig.prefill_pack_tokens).
    **pair("pack512", sched=CHUNK2K_PACK512),
    # chunk4k-pack512: both, a long prompt heading a step of its own in one chunk (as vLLM,
    # with no per-request cap, runs a prompt that arrives alone): the default since a41665c.
    **pair("chunk4k-pack512", sched=CHUNK4K_PACK512),
    # A backlog lifts the pack limit: while the oldest queued prompt has waited 50 ms or more,
    # prompt steps pack FCFS up to the budget (SchedulerConfig.prefill_pack_backlog_s).
    **pair("burst", sched=(("prefill_pack_backlog_s", 0.05),)),
    # In any such backlog (50 / 20 ms) the decode rows ride in the prompt steps, one forward
    # (EngineConfig.fuse_decode_backlog_s; lanes/backlog_fuse.py); no token floor.
    **pair("fuse50", engine=fuse(0.05, 0)),
    **pair("fuse20", engine=fuse(0.02, 0)),
    # ... only while 4,096 queued prompt tokens wait (a burst; fuse_decode_backlog_tokens):
    # after 50 ms, the default from 4eb6609 to 2026-11-29; after 20 ms, the default since, so
    # `policy` itself; at once; from 2,048 tokens; and both modes never fusing, as before.
    "policy-fuse50-4k": policy_with(engine=fuse(0.05, 4096)),
    "policy-fuse20-4k": policy_with(engine=fuse(0.02, 4096)),
    "policy-fuse20-2k": policy_with(engine=fuse(0.02, 2048)),
    "policy-fuse0-4k": policy_with(engine=fuse(0.0, 4096)),
    # ... after 10 ms: the engine's arrival stamps lag the client's by up to ~20 ms while a
    # prompt step is enqueued, and at 14 req/s the 20 ms rule then read 10-18 ms for a
    # prompt that had waited ~31 (bench/burst_windows.py, docs/performance.md).
    "policy-fuse10-4k": policy_with(engine=fuse(0.01, 4096)),
    # ... and, once fused, held fused while any prompt token queues (fuse_decode_hold_tokens).
    **pair("fusehold", engine=(("fuse_decode_hold_tokens", 1),)),
    # The next prompt step launched behind the one in flight (EngineConfig.prompt_ahead: on a
    # GPU by default since 2026-11-30; "pahead" forces it, "no-pahead" turns it off).
    **pair("pahead", engine=(("prompt_ahead", True),)),
    **pair("no-pahead", engine=(("prompt_ahead", False),)),
    **pair("nofuse", engine=fuse(None, 0)),
    # Prompt steps' projections in GEMMs of at most 1,024 rows (KernelConfig.gemm_split_rows):
    # shorter kernels, between which the decode stream's kernels reach the SMs.
    **pair("split1k", engine=SPLIT1K),
    "off-chunk4k-pack512-split1k": Mode(
        "three", False, sched_options=CHUNK4K_PACK512, engine_options=SPLIT1K
    ),
    "policy-chunk4k-pack512-split1k": policy_with(sched=CHUNK4K_PACK512, engine=SPLIT1K),
    # One-row GEMVs reading their weight tiles ahead, the first before the PDL wait
    # (KernelConfig.weight_prefetch): not at all (the default until 2026-11-28), or every GEMV (by
    # default only those over K tiles of 1,024: the drafter's projections, none of the 7B's).
    **{
        f"{base}-wpf-{mode}": with_engine(base, (("kernels", KernelConfig(weight_prefetch=mode)),))
        for mode in ("off", "all")
        for base in ("off", "policy")
    },
    # Sampling noise as torch ops (~50 launches a draw), as before the Triton kernels became the
    # default (KernelConfig.fused_sampling_noise).
    **{
        f"{base}-torch-noise": with_engine(
            base, (("kernels", KernelConfig(fused_sampling_noise=False)),)
        )
        for base in ("off", "policy")
    },
    # While decode rows run and no prompt waits behind the step, prompt steps' GEMMs leave 8 /
    # 16 / 32 SMs to the decode and verify streams (EngineConfig.prefill_sm_carveout; 0, all
    # SMs, by default); "-always": with prompts waiting too (prefill_sm_carveout_in_backlog),
    # as every carve-out ran before 2026-11-27.
    **{
        f"{base}-carve{n}": with_engine(base, (("prefill_sm_carveout", n),))
        for n in (8, 16, 32)
        for base in ("off", "policy")
    },
    **{
        f"{base}-carve{n}-always": with_engine(
            base, (("prefill_sm_carveout", n), ("prefill_sm_carveout_in_backlog", True))
        )
        for n in (8, 16, 32)
        for base in ("off", "policy")
    },
    # Without decode-ahead (EngineConfig.decode_ahead, on by default on a GPU since 4118e0a):
    # the plain and policy rows as they ran before it, for A/Bs in the same run.
    **pair("noahead", engine=(("decode_ahead", False),)),
    # ... and decode-ahead paused while a prompt step is in flight
    # (EngineConfig.decode_ahead_beside_prefill = False).
    "off-ahead-yields": Mode(
        "three", False, engine_options=(("decode_ahead_beside_prefill", False),)
    ),
    "policy-ahead-yields": policy_with(engine=(("decode_ahead_beside_prefill", False),)),
    # ... and a step launched ahead even when a prompt step that ends prompts is predicted to
    # land before the decode step in flight (EngineConfig.decode_ahead_waits_for_prompts =
    # False, as before 2026-11-27): the prompt's rows then wait for the step ahead too.
    "off-ahead-nowait": Mode(
        "three", False, engine_options=(("decode_ahead_waits_for_prompts", False),)
    ),
    "policy-ahead-nowait": policy_with(engine=(("decode_ahead_waits_for_prompts", False),)),
    # Prompt steps enqueued whole (EngineConfig.prefill_slice_layers = 0, as before it; the
    # default enqueues them 4 layers at a time, the event loop free in between), and 1 layer
    # at a time, for A/Bs in the same run.
    **pair("whole", engine=(("prefill_slice_layers", 0),)),
    "policy-slice1": policy_with(engine=(("prefill_slice_layers", 1),)),
    "policy-slice2": policy_with(engine=(("prefill_slice_layers", 2),)),
    "policy-slice4": policy_with(engine=(("prefill_slice_layers", 4),)),
    # Prompt steps not padded to a 64-row bucket (EngineConfig.prompt_token_bucket = 0, as
    # before it), for A/Bs in the same run.
    **pair("nobucket", engine=(("prompt_token_bucket", 0),)),
    # The policy charging each speculative round the host turnaround that decode-ahead hides
    # from plain steps (SpecConfig.round_overhead_s; 1.2 ms: the 7B batch-64 turnaround).
    "policy-overhead": policy_with(spec=(("round_overhead_s", 1.2e-3),)),
    # ... and 2.5 ms: a speculating launch's host time at 2 req/s on an H200 (2.5-3.8 ms,
    # itl_anatomy's "launch decode N/k speculate" events at f4f5e3d).
    "policy-overhead25": policy_with(spec=(("round_overhead_s", 2.5e-3),)),
    # The goodput policy yielding to prompt work (SpecConfig.yield_to_prefill), and without
    # the chunked catch-up graphs (SpecConfig.catch_up_chunk = 0: a long prompt's drafter then
    # catches up eagerly in a catch-up round instead of never drafting and keeping the batch
    # plain while it rides along). policy-noyield: the policy with yield_to_prefill off, for
    # runs at commits where it was on by default (9039577).
    "policy-yield": policy_with(spec=(("yield_to_prefill", True),)),
    "policy-noyield": policy_with(spec=(("yield_to_prefill", False),)),
    "policy-eager": policy_with(spec=(("catch_up_chunk", 0),)),
    # The policy as it was before 2026-11-26: every far drafter caught up eagerly, no limit on
    # a catch-up round's context.
    "policy-old": policy_with(
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
    "policy-chunks": policy_with(
        spec=(
            ("catch_up_chunk", (16, 64, 256)),
            ("catch_up_chunks", 16),
            ("catch_up_round_tokens", None),
        )
    ),
    # ... and at most 1024 context tokens fed per catch-up round (the first far request always;
    # the default since 2026-11-26).
    "policy-chunks1k": policy_with(
        spec=(
            ("catch_up_chunk", (16, 64, 256)),
            ("catch_up_chunks", 16),
            ("catch_up_round_tokens", 1024),
        )
    ),
    # A separate round's drafts made beside the plain rows' decode step, on the verify lane's
    # stream (SpecConfig.drafts_beside_decode): riders do not wait for them.
    "policy-beside": policy_with(spec=(("drafts_beside_decode", True),)),
    # ... and no catch-up round while prompt work is in flight or queued.
    "policy-chunks1k-cy": policy_with(
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
    "policy-cu2": policy_with(spec=(("catch_up_every_steps", 2),)),
    "policy-cu4": policy_with(spec=(("catch_up_every_steps", 4),)),
    # Riders waiting for their drafter exempt from the rider bound for at most 16 steps
    # (SpecConfig.waiting_rider_max_steps): then the others' rounds may not stretch their gaps.
    # The default since 2026-11-26; policy-nowait is the policy before it.
    "policy-wait16": policy_with(spec=(("waiting_rider_max_steps", 16),)),
    "policy-nowait": policy_with(spec=(("waiting_rider_max_steps", None),)),
    "policy-cu2-cy": policy_with(
        spec=(("catch_up_every_steps", 2), ("catch_up_yields_to_prefill", True))
    ),
    # Plans beside prompt work priced with what steps measured there (SpecConfig.
    # contention_costs: the cost model's contended levels), alone and with the variants that
    # let the policy speculate more under load (the drafter following prompt steps, catch-up
    # rounds every 2 steps), which cost the ITL tail when priced on the GPU to itself.
    "policy-contend": policy_with(spec=(("contention_costs", True),)),
    "policy-nocontend": policy_with(spec=(("contention_costs", False),)),
    "policy-follow-contend": policy_with(
        spec=(("follow_prefill", True), ("contention_costs", True))
    ),
    "policy-cu2-contend": policy_with(
        spec=(("catch_up_every_steps", 2), ("contention_costs", True))
    ),
    # ... and with riders waiting for their catch-up round outside the rider bound
    # (SpecConfig.waiting_riders_exempt), alone and with the eager catch-up.
    "policy-riders": policy_with(spec=(("waiting_riders_exempt", True),)),
    "policy-riders-eager": policy_with(
        spec=(("waiting_riders_exempt", True), ("catch_up_chunk", 0))
    ),
}
