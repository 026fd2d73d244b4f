"""``SpecConfig``: speculative decoding and the speculation policy's knobs, validated once."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

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
    # both uniform 0.8 and hetero, so not the default. With a head-sized drafter (one layer's
    # catch-up), 1 and catch_up_round_tokens None (``--spec-catch-up-every-steps 1
    # --spec-catch-up-round-tokens none``; H200, 696e6ee / ae66b45, 5 ms TPOT target, the free
    # objective): goodput at 5 ms +20-130 % at 14-26 req/s, level at 2-8; TPOT p99 at 26 req/s
    # 1.13-1.28x. Not the default: the defaults are the 0.5B drafter's.
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
    # The TPOT target requests are served to (goodput's Y; GoodputConfig.tpot_target_s,
    # ``--spec-tpot-target-ms``; None: none, the default): while a plain step is slower than it,
    # the latency guard and the rider bound give way to the plan with the most tokens/s.
    tpot_target_s: float | None = None
    # ... compared with the plain step requests are measured to see (the time from one plain
    # decision to the next, prompt steps beside it included; True, the default), not only
    # the step the cost model predicts (False: at 8 req/s on an H200, 68152e4, the predicted
    # plain step hovered at the 4 ms target while requests saw 4.2-4.4 ms, and the target
    # lifted the bounds on some steps only).
    tpot_target_measured: bool = True
    # ... and the policy's plans ranked by the share of rows they bring under that target, then
    # by tokens a second (GoodputConfig.tpot_objective, ``--spec-tpot-objective``; False, the
    # default: by tokens a second, the target only lifting the bounds). On an H200 (hetero,
    # 4be552b) goodput at 4 ms 1.63 / 3.44 / 0.72 req/s at 2 / 8 / 14 req/s against the target
    # alone's 1.38 / 0.08-2.28 / 0.40-0.56, with TPOT p99 at 8 req/s 9.8 ms against 6.4 (`off`).
    tpot_objective: bool = False
    # The objective's variants, all off (GoodputConfig): tpot_deadlines, each row held to what
    # its request has left of the target; tpot_tokens_weight, tokens a second weighed against
    # the rows within; tpot_unguarded, no guard even while the plain step meets the target.
    # H200, head-cost drafter, goodput at 5 ms: the first two no gain (docs/performance.md,
    # fd5f69c, 61fca9e); the weight with the third level or ahead in 9 of 10 of the same
    # calls' cells and the light-load ITL p99 nearer plain's (418e177, a9e4e52).
    tpot_deadlines: bool = False
    tpot_tokens_weight: float | None = None
    tpot_unguarded: bool = False
    # How fast the goodput policy learns a new request's α (GoodputConfig.request_prior_count,
    # explore_alpha): its prior, the population's α, counting as this many verifies, and its
    # first verify planned at this α at least. None (the default): as before. Simulated
    # (bench/policy_sim.py --draft-level 1.5, TPOT target 4 ms: goodput at 8 / 14 req/s 2.38
    # / 1.01 req/s without, 3.12 / 3.22 with 2 and 0.8). In the engine (H200, 9c9c2ec): 2.28 /
    # 0.40 against 2.27 / 0.40, nothing (docs/performance.md).
    request_prior_count: float | None = None
    explore_alpha: float | None = None
    # The goodput policy speculates for nobody while prompt work is in flight or queued (a
    # prefill chunk sharing the GPU with the round). Off by default: in four same-run H100
    # sweeps (2026-11-24) it was within 5 % of the best other mode in 55 of 80 checks against
    # 50 of 80 without it, and single runs swung both ways by 3-6 checks (noise of 8-second
    # runs; docs/performance.md). With a drafter of an EAGLE-3 head's cost fed at light load
    # (H200, 2026-12-01): ITL p99 at 2 req/s 1.07-1.34x `off`'s in four runs against 1.14-1.45x
    # in six without it, inside the spread between runs. ``VERIFYPD_YIELD_TO_PREFILL`` for a server.
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
        if not isinstance(self.tpot_target_measured, bool):
            raise ValueError(
                f"tpot_target_measured must be a bool, got {self.tpot_target_measured!r}"
            )
        if self.request_prior_count is not None and not self.request_prior_count > 0.0:
            raise ValueError(f"request_prior_count must be > 0 or None, got "
                             f"{self.request_prior_count!r}")  # fmt: skip
        if self.explore_alpha is not None and not 0.0 < self.explore_alpha < 1.0:
            raise ValueError(f"explore_alpha must be in (0, 1) or None, got {self.explore_alpha!r}")
        if self.tpot_target_s is not None and not self.tpot_target_s > 0.0:
            raise ValueError(f"tpot_target_s must be > 0 or None, got {self.tpot_target_s!r}")
        if not isinstance(self.tpot_objective, bool):
            raise ValueError(f"tpot_objective must be a bool, got {self.tpot_objective!r}")
        if self.tpot_objective and self.tpot_target_s is None:
            raise ValueError(
                "tpot_objective needs a TPOT target (tpot_target_s, --spec-tpot-target-ms)"
            )
        for name in ("tpot_deadlines", "tpot_unguarded"):  # variants of the objective
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be a bool, got {value!r}")
            if value and not self.tpot_objective:
                raise ValueError(f"{name} needs tpot_objective (--spec-tpot-objective)")
        weight = self.tpot_tokens_weight
        if weight is not None and not (isinstance(weight, (int, float)) and weight > 0.0):
            raise ValueError(f"tpot_tokens_weight must be > 0 or None, got {weight!r}")
        if weight is not None and not self.tpot_objective:
            raise ValueError("tpot_tokens_weight needs tpot_objective (--spec-tpot-objective)")
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
