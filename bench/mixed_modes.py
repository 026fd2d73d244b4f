"""The modes ``bench/mixed.py`` runs (``--modes``): the issue-14 sweep's four (``off``,
``single-fixed``, ``three-fixed``, ``policy``), the older three-lane / single-lane names, and the
variants kept for A/Bs, each with what it changes and, where it was measured, what it gave (the
policy's own knobs here; the engine's scheduling and kernels in ``mixed_modes_ab``).
A mode is an engine configuration (``mixed.mode_config``); ``policy-NAME`` modes are judged
on their own against the others (``sweep_criteria``)."""

from __future__ import annotations

import dataclasses

from mixed_mode import MODES_POLICY, NOSTALE, Mode, fed_beside, pair, policy_with
from mixed_modes_ab import AB_MODES

from verifypd.config import PROMPT_IN_DECODE_SIZES

# A new request's α learnt fast (SpecConfig.request_prior_count, explore_alpha).
FAST_LEARN = (("request_prior_count", 2.0), ("explore_alpha", 0.8))
# The TPOT target of 4 ms with a new request's α learnt faster; and with the plans ranked by
# the rows they bring under the target.
TPOT4_LEARN = (("tpot_target_s", 0.004), *FAST_LEARN)
TPOT4_OBJ = (*TPOT4_LEARN, ("tpot_objective", True))
# ... at 5 ms (the head-cost drafter's modes).
TPOT5_OBJ = (("tpot_target_s", 0.005), *FAST_LEARN, ("tpot_objective", True))
# ... tokens a second weighed 1:1 with the rows within, and no guard while the plain step meets it.
TPOT5_FREE = (*TPOT5_OBJ, ("tpot_tokens_weight", 1.0), ("tpot_unguarded", True))
# ... and a fresh request's drafter caught up on the next step, all of it (no wait for a
# catch-up round every 8 steps, no 1,024-token budget a round: both set for the 0.5B drafter).
CU1 = (("catch_up_every_steps", 1), ("catch_up_round_tokens", None))
NGRAM = (("method", "ngram"), ("draft_model", None))
HEAD = (("draft_model", "dummy:qwen2.5-7b-head"),)
# ... its pass over a prompt behind the prompt step while at most 4 rows decode.
HEAD_FED = (*HEAD, ("follow_prefill", True), ("follow_prefill_max_rows", 4))
HEAD_YIELD = (*HEAD_FED, ("yield_to_prefill", True))
RIDES1, RIDES12 = (("fuse_rounds_rows", 1),), (("fuse_rounds_rows", 12),)


def carved(sms: int) -> tuple[tuple[str, int | bool], ...]:
    """``sms`` SMs left to decode beside every prompt step, prompts waiting or not."""
    return (("prefill_sm_carveout", sms), ("prefill_sm_carveout_in_backlog", True))


class ModeTable(dict):
    """The modes by name. ``NAME~K`` (K a number) is ``NAME``'s configuration under a label of
    its own: one run measuring a mode twice, e.g. first after the machine starts and last, to
    see whether its place in the run moved it."""

    def __missing__(self, name: str) -> Mode:
        base, sep, k = name.rpartition("~")
        if sep and k.isdigit() and dict.__contains__(self, base):
            return self[base]
        raise KeyError(name)

    def __contains__(self, name: object) -> bool:
        try:
            self[name]
        except KeyError:
            return False
        return True


_BY_NAME = {
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
    "policy-win64": policy_with(spec=(("draft_window", 64),)),
    "policy-win128": policy_with(spec=(("draft_window", 128),)),
    "policy-win256": policy_with(spec=(("draft_window", 256),)),
    "policy-win128-follow-light": policy_with(
        spec=(("draft_window", 128), ("follow_prefill", True), ("follow_prefill_max_rows", 4))
    ),
    "three-fixed-win128": Mode("three", True, spec_options=(("draft_window", 128),)),
    # The fixed designs at L = 2 (the sweep's fixed modes draft 4): the best fixed length in
    # policy_sim at a TPOT target below a plain step, a stronger baseline for policy-tpot4.
    "single-fixed-l2": Mode("single", True, spec_options=(("initial_draft_len", 2),)),
    "three-fixed-l2": Mode("three", True, spec_options=(("initial_draft_len", 2),)),
    # ... and at L = 1, and the policy held to L <= 1 (SpecConfig.max_draft_len): a round that
    # accepts nothing then gives its token after one drafter step and a two-token verify
    # (~1.25 plain steps), not four drafter steps (~1.9). At 2 req/s (H200, 14b3333) the ITL
    # p99 stayed the policy's (8.54 against 8.55 ms; `off` 5.49): catch-up rounds set it.
    "three-fixed-l1": Mode("three", True, spec_options=(("initial_draft_len", 1),)),
    "policy-l1": policy_with(spec=(("max_draft_len", 1), ("initial_draft_len", 1))),
    # The ITL tail's budget (SpecConfig.tail_budget, --spec-tail-budget): speculation's late
    # tokens (more than 1.05 plain steps after the one before) kept to 0.2 / 0.5 / 1 % of all.
    "policy-budget2": policy_with(spec=(("tail_budget", 0.002),)),
    "policy-budget5": policy_with(spec=(("tail_budget", 0.005),)),
    "policy-budget10": policy_with(spec=(("tail_budget", 0.01),)),
    # ... late meaning more than 1.35 plain steps (SpecConfig.tail_ratio; about `off`'s own ITL
    # p99 over its median step at 2 req/s on an H200): an L = 1 round (~1.25 predicted) costs
    # no credit (measured 2026-11-28: the ITL p99 stayed the policy's, docs/performance.md).
    "policy-r135-b5": policy_with(spec=(("tail_budget", 0.005), ("tail_ratio", 1.35))),
    "policy-r135-b10": policy_with(spec=(("tail_budget", 0.01), ("tail_ratio", 1.35))),
    # The drafter's chunk graphs with their attention on the prefill kernel, as before
    # SpecConfig.chunk_short_attention (on by default since 2026-11-28).
    "policy-prefill-chunks": policy_with(spec=(("chunk_short_attention", False),)),
    # ... and chunk graphs of 1,024 tokens too (a replay of the 0.5B drafter costs ~0.9 ms of
    # GPU whatever its q up to 64, 1.5 at 256, 2.3 at 1,024 on an H200: bench/catch_up_cost.py).
    "policy-chunk1k": policy_with(spec=(("catch_up_chunk", (16, 64, 256, 1024)),)),
    # ... and of 512 too: a context of 513-1,024 tokens in two replays of 512, not up to four
    # of 256.
    "policy-chunk512-1k": policy_with(spec=(("catch_up_chunk", (16, 64, 256, 512, 1024)),)),
    # A catch-up round's feed spread over at most the rounds each request has left
    # (SpecConfig.amortize_within_request): no catch-up for a long prompt near its end. Neither
    # these nor the chunks of 512 and 1,024 moved the light-load ITL p99 (H200, ed52da5).
    "policy-horizon": policy_with(spec=(("amortize_within_request", True),)),
    "policy-horizon-chunk1k": policy_with(
        spec=(("amortize_within_request", True), ("catch_up_chunk", (16, 64, 256, 512, 1024)))
    ),
    # Without the stale probe (SpecConfig.probe_when_stale, on by default since 2026-11-28):
    # requests with no verify of their own probed only while the population is parked.
    "policy-nostale": NOSTALE,
    # ... both with every run starting from a population α of 0.3 (below what pays on an H100
    # at 8 req/s): the stuck state that the stale probe gets out of.
    "policy-stuck": dataclasses.replace(MODES_POLICY, population_prior=0.3),
    "policy-nostale-stuck": dataclasses.replace(NOSTALE, population_prior=0.3),
    # Variants for A/Bs in the same run: the goodput policy with the looser latency guard of
    # 1dc8f53 (speculators up to 10 % slower per token than plain decoding, riders 25 %), and
    # the policy and `off` with the Sarathi-style prefill bound (20 ms; off by default).
    "policy-loose": policy_with(spec=(("guard_slack", 0.10), ("rider_slack", 0.25))),
    # The rider bound alone loosened (default 0.05): a plain row (an α ≈ 0.2 request) may wait
    # up to 1.25 / 1.5 plain steps in another's round. Measured at 2 req/s, hetero (33b7e4f,
    # mixed-nvidia-h200-rider-33b7e4f.json): no acceptance class got faster (α 0.6 at 1.22x
    # `off` in all three), the riders slower (0.92-0.94x) and TPOT p99 up to 1.34x. Not a default.
    "policy-rider25": policy_with(spec=(("rider_slack", 0.25),)),
    "policy-rider50": policy_with(spec=(("rider_slack", 0.5),)),
    # The policy taking the shortest step among the plans within 5 % / 10 % of the best
    # tokens/s (SpecConfig.tail_tolerance: the ITL tail against a little mean speed), and the
    # step cap at 1.5 plain steps (the tail a plain step has at light load).
    "policy-tail5": policy_with(spec=(("tail_tolerance", 0.05),)),
    "policy-tail10": policy_with(spec=(("tail_tolerance", 0.10),)),
    "policy-notail": policy_with(spec=(("tail_tolerance", 0.0),)),
    "policy-cap15": policy_with(spec=(("max_step_ratio", 1.5),)),
    # A TPOT target of 4 / 5 ms (SpecConfig.tpot_target_s, ``--spec-tpot-target-ms``): while a
    # plain step is slower than it, the rider bound gives way to the rows that can make it by
    # speculating. Read with the sweep's goodput at that TPOT (``goodput_by_tpot_slo``).
    "policy-tpot4": policy_with(spec=(("tpot_target_s", 0.004),)),
    "policy-tpot5": policy_with(spec=(("tpot_target_s", 0.005),)),
    # ... and learning a new request's α faster (SpecConfig.request_prior_count 2,
    # explore_alpha 0.8): under load the policy otherwise never drafts for a new request.
    "policy-tpot4-learn": policy_with(spec=TPOT4_LEARN),
    # ... on the fused single lane: prompt chunks ride in the decode step instead of beside it
    # on another stream, so the drafter's steps never share the GPU with a prompt step (on
    # three lanes they cost 1.3-1.6x their calibration there under load, 8f9f1c6).
    # Goodput at 4 ms, 2 / 8 / 14 req/s (H200, 9c9c2ec): 1.61 / 3.19 / 0.48 against
    # policy-tpot4-learn's 1.38 / 2.28 / 0.40 and single-fixed-l2's 1.61 / 3.73 / 1.67.
    "policy-single-tpot4-learn": Mode(
        "single", True, True, policy="goodput", spec_options=TPOT4_LEARN
    ),
    # ... and its plans ranked by the rows they bring under the target, then tokens a second
    # (SpecConfig.tpot_objective), on three lanes and on the fused single lane. Goodput at
    # TPOT <= 4 ms on an H200, hetero, 2 / 8 / 14 req/s (4be552b): 1.63 / 3.44 / 0.72 on three
    # lanes, 1.45 / 1.92 / 0.39 on the single lane; single-fixed-l2 1.61 / 3.65 / 2.00. With
    # rounds read at what they took over their prediction (6a4b949, fa9bc26; not kept): 1.80
    # at 8 req/s twice.
    "policy-tpot4-obj": policy_with(spec=TPOT4_OBJ),
    # ... with every step read at its prediction (tpot_target_measured off): 1.54 / 3.12 /
    # 1.12 beside single-fixed-l2's 1.61 / 3.41 / 1.92 (fa9bc26).
    "policy-tpot4-obj-pred": policy_with(spec=(*TPOT4_OBJ, ("tpot_target_measured", False))),
    "policy-single-tpot4-obj": Mode("single", True, True, policy="goodput", spec_options=TPOT4_OBJ),
    # ... with 16 / 32 SMs left to decode beside every prompt step, prompts waiting or not
    # (EngineConfig.prefill_sm_carveout, _in_backlog): a prompt step beside decode slows its
    # rounds (round_seen_ratio 1.2 at 8 req/s, 1.65 at 14), and TTFT p99 (~100 ms at 8 req/s)
    # is far inside the SLO's 300 ms. With three-fixed-l2 carved the same, for the pair.
    # Goodput at 4 ms at 2 / 8 / 14 req/s (H200, 0c4b88f, engines in their own processes):
    # carve16 1.62 / 2.96 / 0.95, carve32 1.63 / 3.12 / 0.96 against the objective's 1.54 /
    # 3.44 / 1.12; three-fixed-l2-carve32 1.61 / 3.56 / 1.51 against 1.61 / 3.33 / 1.35.
    **{
        f"policy-tpot4-obj-carve{n}": policy_with(spec=TPOT4_OBJ, engine=carved(n))
        for n in (16, 32)
    },
    "three-fixed-l2-carve32": Mode(
        "three", True, spec_options=(("initial_draft_len", 2),), engine_options=carved(32)
    ),
    # ... read against the predicted plain step only (before the measured one, 68152e4).
    "policy-tpot4-pred": policy_with(
        spec=(("tpot_target_s", 0.004), ("tpot_target_measured", False))
    ),
    # The policy with the drafter following prompt steps (SpecConfig.follow_prefill): its KV of
    # a prompt computed behind the prompt step on the follow stream (below every lane), in
    # replays of chunk graphs of its own since 2026-11-26 (eager before: 17-32 ms of host
    # time a forward), after the step's launch, instead of in a catch-up round.
    "policy-follow": policy_with(spec=(("follow_prefill", True),)),
    # ... only at light load (SpecConfig.follow_prefill_max_rows: no other prompt waiting, at
    # most 4 sequences decoding).
    "policy-follow-light": policy_with(
        spec=(("follow_prefill", True), ("follow_prefill_max_rows", 4))
    ),
    # ... with the step cap of 1.4 / 1.5 plain steps: drafters fed behind the prompt step are
    # steady, so their first round needs no catch-up feed the cap would count.
    "policy-follow-light-cap14": policy_with(
        spec=(("follow_prefill", True), ("follow_prefill_max_rows", 4), ("max_step_ratio", 1.4))
    ),
    # ... the drafter's forward on the prompt step's own stream, right behind it
    # (SpecConfig.follow_prefill_stream = "prefill"), and with the cap of 1.5.
    "policy-follow-light-onprefill": policy_with(
        spec=(
            ("follow_prefill", True),
            ("follow_prefill_max_rows", 4),
            ("follow_prefill_stream", "prefill"),
        )  # fmt: skip
    ),
    "policy-follow-light-onprefill-cap15": policy_with(
        spec=(
            ("follow_prefill", True),
            ("follow_prefill_max_rows", 4),
            ("follow_prefill_stream", "prefill"),
            ("max_step_ratio", 1.5),
        )  # fmt: skip
    ),
    "policy-follow-light-cap15": policy_with(
        spec=(("follow_prefill", True), ("follow_prefill_max_rows", 4), ("max_step_ratio", 1.5))
    ),
    # A row's second token from a step that waits for no drafts beyond the rider bound
    # (SpecConfig.second_token_plain, on by default since 2026-11-27), alone, with the
    # light-load follow, and the policy without it.
    "policy-second": policy_with(spec=(("second_token_plain", True),)),
    "policy-nosecond": policy_with(spec=(("second_token_plain", False),)),
    "policy-second-follow": policy_with(
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
    **pair("inside", engine=(("prompt_in_decode_tokens", PROMPT_IN_DECODE_SIZES),)),
    **pair("noinside", engine=(("prompt_in_decode_tokens", ()),)),
    # Without the start-up run of the prompt steps' GEMMs (EngineConfig.warm_prompt_gemms):
    # the first-mode bias's A/B (run first; H200, 15d5fbf: its long prompts 11 % slower).
    **pair("nowarm", engine=(("warm_prompt_gemms", False),)),
    # Deltas after every launch, a drafting one after a plain one included
    # (EngineConfig.deliver_before_drafting=False; on by default since 2026-11-27).
    "policy-deltas-after": policy_with(engine=(("deliver_before_drafting", False),)),
    # The GPU's block scheduler serving the prefill stream first (what every build before
    # 2026-11-26 did by mistake) or no stream first (EngineConfig.lane_priorities).
    "policy-prefill-first": policy_with(engine=(("lane_priorities", "prefill-first"),)),
    "policy-equal-prio": policy_with(engine=(("lane_priorities", "equal"),)),
    "off-prefill-first": Mode(
        "three", False, engine_options=(("lane_priorities", "prefill-first"),)
    ),
    "policy-capped": policy_with(spec=(("max_step_ratio", 1.25),)),
    # The step cap just above an L = 1 round (1.25-1.35 plain steps as calibrated on an H200,
    # 7a8c0b7), the drafter catching up behind plain decode steps at up to 8 decoding rows
    # (SpecConfig.follow_decode_max_rows: no catch-up rounds at light load), and both.
    "policy-cap14": policy_with(spec=(("max_step_ratio", 1.4),)),
    "policy-fdec": policy_with(spec=(("follow_decode_max_rows", 8),)),
    # ... 64 tokens a row a step (SpecConfig.follow_decode_tokens): less added to each plain
    # step, over more steps; and with the step cap of 1.4 plain steps.
    "policy-fdec64": policy_with(
        spec=(("follow_decode_max_rows", 8), ("follow_decode_tokens", 64))
    ),
    "policy-fdec64-cap14": policy_with(
        spec=(("follow_decode_max_rows", 8), ("follow_decode_tokens", 64), ("max_step_ratio", 1.4))
    ),
    "policy-fdec-cap14": policy_with(spec=(("follow_decode_max_rows", 8), ("max_step_ratio", 1.4))),
    # ... that feed on a stream of its own beside the decode step, at its priority
    # (SpecConfig.follow_decode_stream "beside"): the step does not wait for it; and with 1,024
    # tokens a step. The catch-up rounds leave the tail, the ITL p99 stays (H200, 3841869).
    "policy-fdec-beside": fed_beside("beside"),
    # ... 64 tokens a step (smaller grids beside the step), and below every lane instead.
    "policy-fdec-beside64": fed_beside("beside", ("follow_decode_tokens", 64)),
    "policy-fdec-below": fed_beside("below"),
    "policy-fdec-beside1k": fed_beside("beside", ("catch_up_chunk", (16, 64, 256, 512, 1024))),
    # ... below every lane with the policy held to L <= 1, or with L = 1 rounds free of a 0.2 %
    # tail budget (late: over 1.35 plain steps): at 2 req/s policy-l1 left the speculative
    # tokens' p99 at 5.4 ms (the policy's 6.8), and its tail was 59 % catch-up rounds, which
    # the feed takes out (H200, 14b3333). Together (H200, ea3fbd3, 2 req/s): ITL p99 1.33x /
    # 1.30x `off`'s (the policy 1.49x) at TPOT p50 1.02x / 1.00x (the policy 1.24x): the feed
    # below took the catch-ups out of the tail and the speedup with them.
    "policy-l1-fdec-below": fed_beside("below", ("max_draft_len", 1), ("initial_draft_len", 1)),
    # ... or L <= 1 with the catch-up in fewer, larger replays (chunk graphs up to 1,024
    # tokens: a 2k-token context in 2-3 replays, not 9 of 256; the catch-up tokens' p99 went
    # from 18.8 to 15.0 ms that way at ed52da5). At ea3fbd3: ITL p99 1.40x `off`'s at TPOT
    # p50 1.22x faster, catch-up rounds still 42 % of the tail.
    "policy-l1-chunk1k": policy_with(
        spec=(
            ("max_draft_len", 1),
            ("initial_draft_len", 1),
            ("catch_up_chunk", (16, 64, 256, 512, 1024)),
        )
    ),
    "policy-r135-b2-fdec-below": fed_beside("below", ("tail_budget", 0.002), ("tail_ratio", 1.35)),
    # The policy with a drafter that costs no GPU time: prompt lookup (SpecConfig.method
    # "ngram": no model, no catch-up; the synthetic α decides how many of its drafts are kept,
    # and only rows whose lookup matches draft at all). On the dummy 7B's output lookups
    # rarely match: at ea3fbd3 (H200, 2 / 8 req/s) 63 / 377 tokens drafted, and the rounds
    # planned for misses cost the plain steps their decode-ahead (TPOT p50 4.84 against
    # `off`'s 4.06 ms); since then a miss counts against the request's α̂.
    "policy-ngram": policy_with(spec=NGRAM),
    "three-fixed-ngram": Mode("three", True, spec_options=NGRAM),
    # ... with a stand-in lookup that always drafts (Mode.stand_in_drafts, in process only):
    # the policy's rounds with a drafter that costs no GPU time and always has L drafts.
    "policy-free-drafts": dataclasses.replace(policy_with(spec=NGRAM), stand_in_drafts=True),
    # A drafter of an EAGLE-3 head's cost for this target (``dummy:qwen2.5-7b-head``: one layer
    # of the 7B's width, the whole vocabulary read, 32,000 ids scored; its pass over a prompt
    # one layer's): the policy and the fixed designs with a cheap drafter that exists in
    # practice, in place of the 0.5B model. Random weights, synthetic acceptance, as the 0.5B.
    "policy-head": policy_with(spec=HEAD),
    # ... its catch-up in one eager forward, no chunk-graph replays (one layer's launches).
    "policy-head-eager": policy_with(spec=(*HEAD, ("catch_up_chunk", 0))),
    # ... its pass over a prompt behind the prompt step at light load (at most 4 rows decoding),
    # on the follow stream, or on the prompt step's own (as policy-follow-light[-onprefill]).
    "policy-head-follow-light": policy_with(spec=HEAD_FED),
    "policy-head-follow-onprefill": policy_with(
        spec=(*HEAD_FED, ("follow_prefill_stream", "prefill"))
    ),
    # ... and its riders allowed 1.5 plain steps (rider_slack 0.5, as policy-rider50): a round of
    # this drafter for all of a mixed batch is ~1.1 plain steps, over the default 1.05 bound.
    "policy-head-follow-light-rider50": policy_with(spec=(*HEAD_FED, ("rider_slack", 0.5))),
    # ... and no rounds while prompt work is in flight or queued (yield_to_prefill): with this
    # drafter fed, 27-36 points of the light-load tail were rounds beside prompt steps (H200,
    # df66dd5). Measured at 2 req/s (H200, 083683b, 8597e1f): ITL p99 1.07-1.34x `off`'s in four
    # runs against the fed policy's 1.14-1.45x in six; the spread between runs is wider.
    "policy-head-follow-light-yield": policy_with(spec=HEAD_YIELD),
    # ... and its rounds bounded for the ITL tail (a round whose first draft is rejected is the
    # gap its requests see): no round predicted longer than 1.25 or 1.4 plain steps
    # (max_step_ratio), or the shortest round within 10 % of the best tokens/s (tail_tolerance).
    # 2 req/s (H200, 8597e1f): ITL p99 1.28x / 1.37x / 1.34x `off`'s beside the yield's 1.31x;
    # the tolerance's TPOT p50 1.46x faster against 1.68x. The tail is rounds whose first draft
    # was rejected, of ordinary length, not long rounds.
    "policy-head-yield-cap125": policy_with(spec=(*HEAD_YIELD, ("max_step_ratio", 1.25))),
    "policy-head-yield-cap14": policy_with(spec=(*HEAD_YIELD, ("max_step_ratio", 1.4))),
    "policy-head-yield-tol10": policy_with(spec=(*HEAD_YIELD, ("tail_tolerance", 0.1))),
    # ... served to a TPOT target of 5 ms, plans ranked by the rows they bring under it and new
    # requests' α learned fast (as policy-tpot4-obj): at 5 ms the fixed designs with this
    # drafter served 1.3-5.3x the policy's requests in time at 14-20 req/s (df66dd5). With it
    # (H200, 86dff23), goodput at 5 ms at 14 / 20 req/s: 6.62 / 6.56 against three-fixed-head's
    # 7.34 / 5.86 in the same call, 7.10 / 6.11 against single-fixed-head's 5.24 / 4.38; TPOT p99
    # 1.13-1.48x `off`'s (other calls).
    "policy-head-tpot5-obj": policy_with(spec=(*HEAD_FED, *TPOT5_OBJ)),
    # ... each row held to what its request has left of the 5 ms (tpot_deadlines). At 14 / 20
    # / 26 req/s (H200, 0c30213) the target mode served 7.77 / 9.10 / 5.30 req/s within 5 ms
    # against single-fixed-head's 8.92 / 10.81 / 7.02, drafting 2.0-3.1 a round where the
    # fixed design drafts 4; the question: do rows too late to make it keep the rounds short?
    # No (fd5f69c): 7.52 / 6.56 / 5.78 against the target mode's 7.93 / 8.30 / 4.93.
    "policy-head-tpot5-dl": policy_with(spec=(*HEAD_FED, *TPOT5_OBJ, ("tpot_deadlines", True))),
    # ... tokens a second weighed 1:1 against the share of rows within the target
    # (tpot_tokens_weight): ranked rows first, one marginal row (an α̂ ~0.3 request just
    # under 5 ms at L = 1-2) held the whole batch to short rounds. Level with it in two calls
    # (61fca9e): 6.81 / 7.26 / 2.68 and 6.62 / 6.88 / 4.13 against 6.39 / 6.70 / 3.30 and
    # 7.09 / 6.88 / 2.46; single-fixed-head 8.10 / 8.55 / 3.30 where it did not run first.
    "policy-head-tpot5-w1": policy_with(spec=(*HEAD_FED, *TPOT5_OBJ, ("tpot_tokens_weight", 1.0))),
    # ... both the weight and no guard or rider bound while the plain step meets the target
    # (tpot_unguarded). On 0c30213's cost table (bench/policy_probe.py) a 16-row hetero batch
    # whose plain step meets 5 ms gets no round at all, guarded; with this, four drafts for
    # every row, 1.8x plain decoding's tokens a second. In the engine
    # (H200, 418e177, a9e4e52) it drafts 2.2-3.0, not 4: goodput at 5 ms at 14 / 20 / 26
    # req/s 8.08 / 7.67 / 4.69 and 7.19 / 7.41 / 3.82 against the target mode's 7.76 / 8.23 /
    # 4.29 and 6.95 / 5.39 / 3.75, single-fixed-head's 8.35 / 10.47 / 7.10 and 8.60 / 10.55 /
    # 7.02; at 2 req/s ITL p99 1.06-1.24x `off`'s in three runs, the target mode's 1.39-1.41x.
    "policy-head-tpot5-free": policy_with(spec=(*HEAD_FED, *TPOT5_FREE)),
    # ... both on the fused single lane (prompt chunks in the decode step, as single-fixed-head).
    # At 5 ms the designs split by lane, not by L: in 0c30213 three-fixed-head served 7.86 /
    # 7.53 / 5.45 req/s within 5 ms at 14 / 20 / 26 req/s, level with the policy, where
    # single-fixed-head served 8.92 / 10.81 / 7.02; in 418e177 the free policy (three lanes)
    # 8.08 / 7.67 / 4.69 against single-fixed-head's 8.35 / 10.47 / 7.10, drafting 2.5-3.0.
    # On the single lane the policy does worse (a9e4e52): the free one 5.07 / 4.43 / 0.08
    # (at 26 req/s L 0.51 and TTFT p99 1.4 s: drafting that little, the lane falls behind
    # the arrivals), the tokens-a-second one 0.48 / 0.15 / 0.08 (L 0.05-0.19), against
    # single-fixed-head's 5.90 / 7.75 / 6.53. With the prompt chunks riding in its steps priced
    # into its decisions (2dc48a9, reverted): 4.95 / 2.52 / 0.30 and 0.56 / 0.15 / 0.08 against
    # 6.45 / 6.28 / 6.09. Its prompt steps kept out of the latency guard (5960c7c: the guard had
    # stopped 513 of 853 decisions at 26 req/s): 4.88 / 3.42 / 0.30 against 6.06 / 7.70 / 2.35.
    "policy-single-head-tpot5-free": Mode(
        "single", True, True, policy="goodput", spec_options=(*HEAD_FED, *TPOT5_FREE)
    ),
    "policy-single-head": Mode("single", True, True, policy="goodput", spec_options=HEAD_FED),
    # ... the free one with every fresh request's drafter caught up at once (CU1), on three
    # lanes and on the single lane: at 20 req/s (H200, 5960c7c) the α ≈ 0.9 requests' TPOT p50
    # was 3.8 ms (three lanes) and 5.1 ms (single lane) under the free policy against 3.0 ms
    # under single-fixed-head, whose rows draft from their first step. With it (696e6ee,
    # ae66b45), goodput at 5 ms at 14 / 20 / 26 req/s 8.49 / 8.37 / 7.64 against the free
    # policy's 7.02 / 6.99 / 5.38 and single-fixed-head's 8.83 / 9.38 / 7.50; 7.58 / - / 4.89
    # against 6.27 / - / 2.13 and 4.26 / - / 1.21; at 20 req/s 6.46 against 5.38 and 3.88;
    # level at 2 / 8. TPOT p99 at 26 req/s 18.0 / 24.0 against 15.9 / 18.7. On the single lane
    # 6.26 / 4.54 / 4.65.
    "policy-head-tpot5-free-cu1": policy_with(spec=(*HEAD_FED, *TPOT5_FREE, *CU1)),
    "policy-single-head-tpot5-free-cu1": Mode(
        "single", True, True, policy="goodput", spec_options=(*HEAD_FED, *TPOT5_FREE, *CU1)
    ),
    "three-fixed-head": Mode("three", True, spec_options=HEAD),
    # ... with the rounds riding in prompt steps from 1 / 12 decoding rows (fuse_rounds_rows):
    # the single lane's fused rounds beside prompts under load, three lanes below. Goodput at
    # 5 ms at 14 / 20 / 26 req/s (H200, 45c7e20, 22d851b): 8.02 / 8.39 / 5.06 and 8.34 / 8.79 /
    # 6.16 against three-fixed-head's 7.78 / 7.28 / 4.60 and 7.86 / 8.08 / 5.37, single-fixed-
    # head's 7.19 / 6.77 / 5.91 and 9.17 / 10.79 / 7.97; TTFT p99 14-37 % higher at 20-26.
    # The policy riding (L_max in prompt steps, b2088a3) 6.60 / 6.81 / 2.54 against 7.20 /
    # 6.58 / 3.84 not riding; at 26 req/s its running requests peak at 77, TTFT p99 615 ms.
    "three-fixed-head-rides1": Mode("three", True, spec_options=HEAD, engine_options=RIDES1),
    "three-fixed-head-rides12": Mode("three", True, spec_options=HEAD, engine_options=RIDES12),
    "policy-head-tpot5-free-rides12": policy_with(spec=(*HEAD_FED, *TPOT5_FREE), engine=RIDES12),
    "single-fixed-head": Mode("single", True, spec_options=HEAD),
    "policy-bounded": policy_with(sched=(("prefill_step_target_s", 0.02),)),
    "off-bounded": Mode("three", False, sched_options=(("prefill_step_target_s", 0.02),)),
    **AB_MODES,
}
MODES = ModeTable(_BY_NAME)

DEFAULT_MODES = ["three-ctrl", "three-fixed", "single-fixed", "three-off"]
SWEEP_MODES = ["off", "single-fixed", "three-fixed", "policy"]
