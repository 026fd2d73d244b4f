"""The goodput policy's knobs (``GoodputPolicy`` in ``verifypd.controller.goodput`` reads
them; the module docstring there says what each rule does): one frozen dataclass, checked once
in ``__post_init__``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GoodputConfig:
    latency_slack: float = 0.10  # ε of the latency guard
    gain_margin: float = 0.02  # a plan must beat plain tokens/s by this fraction
    accept_floor: float = 0.15  # population α below this: parked (drafted only in probes)
    max_catch_up: int = 64  # most tokens a drafter catches up on for one request per step
    probe_min_steps: int = 64  # first probe interval; doubles while probes find nothing
    probe_max_steps: int = 4096
    probe_alpha: float = 0.5  # α a probed request is planned with
    # Probe requests with no verify of their own, at ``probe_alpha``, also while the population
    # is not parked but nothing has drafted for a probe interval: new requests start at the
    # population's α, and a population α below what pays (yet above the floor) otherwise
    # holds every request back for good, since only drafts move it (an H100 sweep, 978a2b8:
    # stuck at 0.41 after a run of low-α hetero requests, the policy drafted nothing for the
    # engine's remaining three runs, uniform α = 0.8 included).
    probe_when_stale: bool = True
    population_weight: float = 0.02  # EWMA weight of one verify in the population's α
    # The population's prior α (ControllerConfig.initial_acceptance) counts as this many
    # verifies, not as the EWMA's whole memory: a drafter that does not predict the traffic
    # parks the policy after a round or two of verifies instead of ~80 (each speculative step
    # of a drafter that accepts nothing is a slow step for its whole batch).
    population_prior_count: float = 4.0
    request_weight: float = 0.15  # EWMA weight of one verify in a request's α̂
    # A new request's α̂ starts at the population's, which counts as this many verifies (its
    # own first ones then move it fast); None: the EWMA starts from it at ``request_weight``.
    request_prior_count: float | None = None
    # A request with no verify of its own is planned at this α at least (None: at its α̂,
    # the population's): under load, plans at a hetero population's α (0.33-0.45 on an H200,
    # 8-14 req/s) do not pay, so a new request is never drafted for and its α never learnt.
    # Not while the population is parked (the drafter does not predict the traffic).
    explore_alpha: float | None = None
    prefill_wait_guard_s: float | None = None  # None: no prefill-pressure rule
    max_spec_rows: int | None = None  # None: no row limit (no verify graphs, e.g. CPU)
    alpha_bucket: float = 0.05  # α̂ within one bucket enter the speculating set together
    # Plain rows of a fused step are padded to the verify width (one graph replay, the
    # engine's runner with CUDA graphs); False: a fused step with plain rows runs eager.
    padded_fused: bool = False
    # A drafter further behind than max_catch_up (a request fresh from its prefill) catches
    # up in a catch-up round: at most one every this many steps (arrivals batch into one
    # eager drafter forward), its one-off cost left out of the latency guard.
    catch_up_every_steps: int = 8
    # A first draft step that cannot replay a graph (some drafter more than
    # ``graph_catch_up`` tokens behind: after plain steps, or a catch-up) runs eager: mostly
    # host time.
    eager_draft_s: float = 4e-3
    # Most tokens a drafter may be behind and still start with a graph replay (the drafter's
    # largest catch-up graph, ``SpecConfig.catch_up_graphs``; 2 without them).
    graph_catch_up: int = 2
    # Most tokens a drafter may be behind and still catch up in chunk-graph replays
    # (``SpecConfig.catch_up_chunk``); 0 without them. Neither kind pays the eager one-off.
    # With chunk graphs, a drafter further behind (a long prompt) is not drafted for at all:
    # its eager catch-up is ~10 ms of host time that stalls every lane.
    chunk_catch_up: int = 0
    # No speculating step may take longer than this many plain steps (None: no cap). The
    # guard above bounds the expected time per token; this bounds the step itself, which is
    # the inter-token gap a request sees when its first draft is rejected (the ITL tail); a
    # catch-up round's one-off context feed counts in its step.
    max_step_ratio: float | None = None
    # One-off costs (catch-up, eager first step) count in a plan's tokens/s spread over this
    # many steps: an investment the following steps pay back. (With 8, on an H200 at 5 req/s
    # and up, long prompts' catch-ups never paid, every drafter fell far behind during plain
    # steps, and the policy stopped speculating for good.)
    amortize_steps: int = 32
    # ... or over fewer: at most the rounds the request has left (its tokens left over the
    # most a round yields), so a long prompt a few tokens from its end is not caught up on
    # (``plan_search.catch_up_rounds``; ``SpecConfig.amortize_within_request``).
    amortize_within_request: bool = False
    # Plain rows riding in a speculating step (a request waiting for its catch-up round, or
    # one that may not speculate) may wait up to (1 + rider_slack) plain steps.
    rider_slack: float = 0.25
    # Hysteresis: after a speculating step, keep speculating unless the plan falls below
    # plain decoding's tokens/s by this fraction (stopping makes the next resume eager).
    keep_margin: float = 0.02
    # A "no gain" verdict of the full plan search stands for up to this many steps while the
    # batch's candidates stay the same (rows, who, α̂ bucket, far/last/probe): the search reads
    # nothing else that changes in between but the costs' online levels. The search took
    # ~0.5 ms of host time per step at 24 rows on an H100 host (measured at c78e11c), which
    # a drafter that never paid cost every decode step. 1: search every step.
    no_gain_hold_steps: int = 8
    # No speculation while prompt work is in flight or queued: a prefill chunk on its own
    # stream shares the GPU with the decode round, and a round with drafts then stretches the
    # decode tail most (the ITL p99 where `off` won the sweep). ``SpecConfig.yield_to_prefill``
    # sets it for the engine (off by default: not measurably better yet).
    yield_to_prefill: bool = False
    # Rows waiting for their drafter's catch-up round (far behind, within reach of the catch-up
    # graphs) ride in a speculating step outside the rider bound: they speculate themselves
    # within ``catch_up_every_steps``. Without it, one fresh request keeps the whole batch
    # plain until its round (the uniform-0.8 sweeps: "no_gain" on most steps at 8+ req/s).
    waiting_riders_exempt: bool = False
    # Host time a speculative round pays and a plain decode step does not: with decode-ahead a
    # plain step is launched while the one before runs, while a drafting step needs its
    # tokens landed first (fold-back, planning, upload between GPU steps). Added to every
    # speculative plan's step time (value and guard). 0: not charged.
    round_overhead_s: float = 0.0
    # The ITL tail: a round whose first draft is rejected hands each of its requests one token
    # after the whole step, so the step itself is the inter-token gap in the tail. Among the
    # plans within this fraction of the best tokens/s, the one with the shortest step wins
    # (a shorter L, or fewer speculators); 0: the best tokens/s always.
    tail_tolerance: float = 0.0
    # Most context tokens one catch-up round feeds the drafters (the first far request is
    # always taken, so a long prompt is not starved): a round's catch-up runs on the decode
    # stream ahead of its drafts, and with chunk graphs it holds no host time but all of it is
    # GPU time every row of the step waits for (at 14 req/s on an H100, rounds that fed 15
    # prompts at once took 90-150 ms). The rest wait for the next round (counted as waiting
    # riders). None: no limit.
    catch_up_round_tokens: int | None = None
    # No catch-up round while prompt work is in flight or queued (``LoadSignals``): its
    # context feed then shares the GPU with a prompt step, and every row of the step waits
    # for both (the slowest tokens at 5 req/s on an H100 with chunk graphs: 90 ms steps).
    # The far requests wait, as riders, for a round with the GPU to itself.
    catch_up_yields_to_prefill: bool = False
    # A separate round's drafts run beside the plain rows' decode step (on the verify lane's
    # stream, ``SpecConfig.drafts_beside_decode``): its plain rows wait for decode(B - |S|)
    # only, and the rider bound reads that; the round's time is still charged in full.
    drafts_beside_decode: bool = False
    # With ``waiting_riders_exempt``: a row rides outside the rider bound for at most this many
    # decisions from when it began waiting for its drafter (None: as long as it waits). Then it
    # is a plain rider again, so others' rounds may not stretch its gaps past the bound until
    # its catch-up round: with uniform 0.8 at 11-14 req/s on an H100 the slowest TPOTs were
    # long prompts riding others' rounds at 15-21 ms a token while they waited.
    waiting_rider_max_steps: int | None = None
    # While prompt work is in flight or queued (``LoadSignals.prefill_running``), plans are
    # priced with the cost model's contended levels (``BatchCostModel.level_of``): what decode,
    # verify, mixed and draft steps measured beside prompt steps. A round beside a prompt chunk
    # is judged on what it costs there, not on the GPU to itself.
    contention_costs: bool = False
    # A row's second token (its first decode step) comes from a step that waits for no drafts
    # beyond the rider bound: the row neither speculates nor catches up in it, and rides
    # inside the bound (not ``waiting_riders_exempt`` yet). At light load the slowest tokens
    # under the policy were such second tokens: the round in flight, then a round drafted
    # afresh for the others (chaining pauses while a prompt waits) or the row's own catch-up
    # round, 15-24 ms against 8 for `off` (H200, 93d1756).
    second_token_plain: bool = False
    # The drafter catches up behind plain decode steps (``SpecConfig.follow_decode_max_rows``)
    # only for requests whose own α̂ is at least this: at one draft (L = 1, a round of ~1.3
    # plain steps with a 0.5B drafter beside a 7B target) a request accepting less yields no
    # more tokens per second than plain decoding, and its drafter's forwards would be wasted.
    follow_min_alpha: float = 0.3
    # The ITL tail's budget (``verifypd.controller.tail_budget``; None: none): at most about
    # this share of the tokens delivered may come later than ``tail_ratio`` plain steps after
    # the one before because of speculation (a round whose drafts are rejected, a plain row
    # riding in a round). Plans whose expected late tokens exceed the credit are not taken;
    # the credit grows by the share per token delivered and holds at most
    # share · ``tail_window_tokens`` late tokens.
    tail_budget: float | None = None
    tail_ratio: float = 1.05
    tail_window_tokens: int = 2048
    # The deployment's TPOT target (goodput's Y; None: none). While a plain step is predicted
    # slower than it, every row misses it at its plain rate, so neither the latency guard nor
    # the rider bound holds a plan back: the most tokens per second, for whoever it speeds up.
    tpot_target_s: float | None = None
    # ... the plain step taken as the slower of the predicted one and the one requests are
    # measured to see (``GoodputPolicy.cadence.plain_seen_s``: an EWMA of the gap from one plain
    # decision to the next, prompt steps beside it included). False: the predicted one only.
    tpot_target_measured: bool = True
    # With a target: plans ranked by the share of rows whose expected time per token meets it
    # (goodput's own measure; ``tpot_goal.TargetGoal``), then by tokens a second, not by
    # tokens a second alone: a round that brings some rows under the target beats a plain step
    # that leaves all above it, even where it slows the batch.
    tpot_objective: bool = False
    # ... each row against what its request has left of the target (``SeqView.tpot_need_s``:
    # the mean time per token over its tokens left that keeps its TPOT within it), not the
    # target itself.
    tpot_deadlines: bool = False
    # ... tokens a second over plain decoding's weighed against that share
    # (``TargetGoal.tokens_weight``; None: ``TargetGoal.TIE_WEIGHT``, rows first).
    tpot_tokens_weight: float | None = None
    # ... the target replaces the latency guard and the rider bound: neither applies even
    # while the plain step meets the target (the objective then keeps rows under it).
    tpot_unguarded: bool = False

    def __post_init__(self) -> None:
        checks = [
            (self.latency_slack >= 0.0 and self.gain_margin >= 0.0, "slack, margin >= 0"),
            (0.0 <= self.accept_floor < 1.0, "accept_floor in [0, 1)"),
            (self.max_catch_up >= 2, "max_catch_up >= 2"),
            (1 <= self.probe_min_steps <= self.probe_max_steps, "1 <= probe min <= max"),
            (0.0 < self.probe_alpha < 1.0, "probe_alpha in (0, 1)"),
            (0.0 < self.population_weight <= 1.0, "population_weight in (0, 1]"),
            (self.population_prior_count > 0.0, "population_prior_count > 0"),
            (0.0 < self.request_weight <= 1.0, "request_weight in (0, 1]"),
            (
                self.request_prior_count is None or self.request_prior_count > 0.0,
                "request_prior_count > 0",
            ),  # fmt: skip
            (
                self.explore_alpha is None or 0.0 < self.explore_alpha < 1.0,
                "explore_alpha in (0, 1)",
            ),  # fmt: skip
            (0.0 < self.alpha_bucket <= 1.0, "alpha_bucket in (0, 1]"),
            (self.catch_up_every_steps >= 1, "catch_up_every_steps >= 1"),
            (self.eager_draft_s >= 0.0 and self.amortize_steps >= 1, "eager >= 0, amortize >= 1"),
            (0.0 <= self.keep_margin < 1.0, "keep_margin in [0, 1)"),
            (self.no_gain_hold_steps >= 1, "no_gain_hold_steps >= 1"),
            (self.round_overhead_s >= 0.0, "round_overhead_s >= 0"),
            (0.0 <= self.tail_tolerance < 1.0, "tail_tolerance in [0, 1)"),
            (0.0 <= self.follow_min_alpha <= 1.0, "follow_min_alpha in [0, 1]"),
            (
                self.tail_budget is None or 0.0 <= self.tail_budget < 1.0,
                "tail_budget in [0, 1) or None",
            ),  # fmt: skip
            (
                self.tail_ratio >= 1.0 and self.tail_window_tokens >= 1,
                "tail ratio >= 1, window >= 1",
            ),
            (self.rider_slack >= 0.0, "rider_slack >= 0"),
            (self.tpot_target_s is None or self.tpot_target_s > 0.0, "tpot_target_s > 0"),
            (isinstance(self.probe_when_stale, bool), "probe_when_stale a bool"),
            (isinstance(self.tpot_target_measured, bool), "tpot_target_measured a bool"),
            (isinstance(self.tpot_objective, bool), "tpot_objective a bool"),
            (
                self.tpot_objective is False or self.tpot_target_s is not None,
                "tpot_objective needs tpot_target_s",
            ),  # fmt: skip
            (
                self.tpot_deadlines is False or self.tpot_objective is True,
                "tpot_deadlines needs tpot_objective",
            ),  # fmt: skip
            (
                self.tpot_tokens_weight is None or self.tpot_tokens_weight > 0.0,
                "tpot_tokens_weight > 0",
            ),  # fmt: skip
            (
                self.tpot_unguarded is False or self.tpot_objective is True,
                "tpot_unguarded needs tpot_objective",
            ),  # fmt: skip
            (isinstance(self.amortize_within_request, bool), "amortize_within_request a bool"),
            (self.graph_catch_up >= 1 and self.chunk_catch_up >= 0, "catch-up reaches >= 0"),
            (self.max_step_ratio is None or self.max_step_ratio >= 1.0, "max_step_ratio >= 1"),
            (
                self.catch_up_round_tokens is None or self.catch_up_round_tokens >= 1,
                "catch_up_round_tokens >= 1",
            ),  # fmt: skip
            (
                self.waiting_rider_max_steps is None or self.waiting_rider_max_steps >= 1,
                "waiting_rider_max_steps >= 1",
            ),  # fmt: skip
        ]
        for ok, rule in checks:
            if not ok:
                raise ValueError(f"GoodputConfig: need {rule}")
