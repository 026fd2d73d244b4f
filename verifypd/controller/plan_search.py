"""The goodput policy's plan search: over the requests that may speculate this step
(``Candidate``, picked by ``GoodputPolicy``), in runs of one α̂ bucket (``CandidateGroup``), for
the draft length L and speculating set S with the most tokens per second within the latency
guard (``PlanSearch``; the rules are in ``verifypd.controller.goodput``'s docstring). Plain data
in, a ``Plan`` or None out: it reads the policy's knobs and the cost model, and keeps no state."""

from __future__ import annotations

import math
from bisect import bisect_left
from dataclasses import dataclass, field

from verifypd.batch_costs import BatchCostModel
from verifypd.controller.goodput_config import GoodputConfig
from verifypd.controller.policy import expected_tokens
from verifypd.controller.tail_budget import late_tokens
from verifypd.controller.tpot_goal import TargetGoal


@dataclass
class Plan:
    value: float  # tokens per second
    step_s: float
    tokens: float
    k: int
    draft_len: int
    fused: bool
    late: float = 0.0  # expected tokens later than the tail's bound (``tail_budget``)


@dataclass
class Candidate:
    seq_id: int
    alpha: float
    behind: int
    tokens_left: int
    probe: bool = False
    far: bool = False  # its drafter catches up beyond max_catch_up (a catch-up round)
    last: bool = False  # its last token: drafts are cut, and the guard does not apply


@dataclass
class CandidateGroup:
    """Candidates [.., end) up to one α̂ bucket, with the totals of everything before it."""

    end: int  # k: the set size when this group is the last one in
    count: int = 0  # speculating rows of this group (not on their last token)
    mean_alpha: float = 0.0
    min_alpha: float = 1.0
    last_gain: float = 0.0  # rows on their last token yield nothing more
    steady: int = 0  # cumulative: catch-up tokens of steady drafters (beyond two)
    far: int = 0  # cumulative: context tokens of drafters in a catch-up round
    # cumulative: those tokens, each over the rounds its request can pay it back in
    # (``catch_up_rounds``; ``far / amortize_steps`` when no request's end is near)
    far_per_round: float = 0.0
    eager: bool = False  # cumulative: some drafter further behind than its graphs reach


def catch_up_rounds(c: Candidate, amortize_steps: int, max_draft_len: int | None) -> float:
    """The rounds a catch-up of ``c``'s drafter is spread over: ``amortize_steps``, or with
    ``max_draft_len`` (``GoodputConfig.amortize_within_request``) at most the rounds its
    request has left, ``tokens_left`` over the most tokens a round of it yields (E(α̂, L) at
    the longest L): a long prompt with a few tokens to go cannot pay back its feed."""
    if max_draft_len is None:
        return float(amortize_steps)
    rounds = c.tokens_left / expected_tokens(c.alpha, max_draft_len)
    return min(float(amortize_steps), max(1.0, rounds))


def group_candidates(
    cands: list[Candidate],
    bucket: float,
    graph_catch_up: int,
    amortize_steps: int = 32,
    max_draft_len: int | None = None,
) -> list[CandidateGroup]:
    """Runs of candidates in one α̂ bucket (they enter the speculating set together); a group
    is ``eager`` once some drafter in or before it is more than ``graph_catch_up`` behind.
    ``amortize_steps`` and ``max_draft_len``: the rounds each far drafter's catch-up is
    spread over (``catch_up_rounds``)."""
    out: list[CandidateGroup] = []
    steady = far = 0
    far_per_round = 0.0
    eager = False
    alphas: list[float] = []
    for i, c in enumerate(cands):
        steady += 0 if c.far else max(0, c.behind - 2)
        far += c.behind if c.far else 0
        if c.far:
            far_per_round += c.behind / catch_up_rounds(c, amortize_steps, max_draft_len)
        eager = eager or c.behind > graph_catch_up
        if not c.last:
            alphas.append(c.alpha)
        nxt = cands[i + 1] if i + 1 < len(cands) else None
        if nxt is not None and not nxt.last and not c.last:
            if math.floor(c.alpha / bucket) == math.floor(nxt.alpha / bucket):
                continue
        if nxt is not None and nxt.last and c.last:
            continue
        grp = CandidateGroup(
            i + 1, len(alphas), steady=steady, far=far, far_per_round=far_per_round, eager=eager
        )
        if alphas:
            grp.mean_alpha, grp.min_alpha = sum(alphas) / len(alphas), min(alphas)
        out.append(grp)
        alphas = []
    return out


def split_by_round_budget(
    cands: list[Candidate], budget: int | None
) -> tuple[list[Candidate], list[Candidate]]:
    """(taken, deferred): far candidates past ``budget`` context tokens in one catch-up round
    (in α̂ order, the first always in) are deferred to the next round. None: no limit."""
    if budget is None:
        return cands, []
    out, deferred, fed = [], [], 0
    for c in cands:
        if c.far and fed and fed + c.behind > budget:
            deferred.append(c)
            continue
        fed += c.behind if c.far else 0
        out.append(c)
    return out, deferred


@dataclass(frozen=True)
class PlanSearch:
    """One step's plan search, every step priced by ``costs`` (``contended``: at the levels
    measured beside prompt work). Built per search: it reads the policy's knobs as they are."""

    goodput: GoodputConfig
    costs: BatchCostModel
    max_draft_len: int
    contended: bool = False

    def best(
        self,
        rows: int,
        cands: list[Candidate],
        t0: float,
        floor: float,
        waiting: int,
        outside: int = 0,
        tail: Tail | None = None,
        seen: float | None = None,
        needs: dict[int, float] | None = None,
    ) -> Plan | None:
        """The plan over L = 1..L_max and the speculating sets S = the first k candidates, k at
        the ends of the α̂ buckets, with the most tokens per second (or, with
        ``tail_tolerance``, the shortest step among those close to it), if it beats ``floor``
        tokens per second (None: none does); ``waiting`` rows wait for their drafter, and
        ``outside`` more rows ride outside the rider bound whatever the setting. With a
        ``tail`` (the ITL tail's budget), a plan whose expected late tokens exceed its credit
        is not taken (counted in ``tail.refused``). ``seen``: the plain step requests are
        measured to see, read against the TPOT target (default ``t0``). ``needs``: each row's
        ``tpot_need_s`` by seq id (``GoodputConfig.tpot_deadlines``). Work per step is
        O(buckets · L_max), not O(B · L_max): it runs on the host before every decode step
        (with a ``tail``, O(buckets² · L_max) on rounds longer than its bound)."""
        g, c = self.goodput, self.contended
        limit, rider_bound = self._bounds(t0, t0 if seen is None else seen)
        cap = math.inf if g.max_step_ratio is None else g.max_step_ratio * t0
        exempt = (waiting if g.waiting_riders_exempt else 0) + outside
        groups = group_candidates(
            cands, g.alpha_bucket, max(g.graph_catch_up, g.chunk_catch_up), g.amortize_steps,
            self.max_draft_len if g.amortize_within_request else None,
        )  # fmt: skip
        goal = self._goal(rows, t0, t0 if seen is None else seen, needs)
        if goal is not None and floor > 0.0:
            floor = goal.floor(floor)
        # (rows, mean α̂) of the groups speculating so far, kept only where it is read: the
        # tail's pricing and the TPOT objective share one list; with deadlines, beside it each
        # group's rows' needs, sorted
        in_set = tail.groups if tail is not None else [] if goal is not None else None
        group_needs = None
        if goal is not None and needs is not None:
            group_needs, start = [], 0
            for grp in groups:
                group_needs.append(sorted(needs[c.seq_id] for c in cands[start:grp.end]
                                          if not c.last))  # fmt: skip
                start = grp.end
        best: Plan | None = None
        # With a tail tolerance every plan is kept (the shortest close one wins); without, only
        # the best so far (the search runs on the host before decode steps).
        plans: list[Plan] | None = [] if g.tail_tolerance else None
        # What a group's set costs whatever L: (one-off, its share a round, one drafter step,
        # steady catch-up, the other rows' decode step), priced once, not at every L.
        fixed = [
            (
                *self._one_off(grp),
                self.costs.draft(grp.end, c),
                self.costs.catch_up(grp.steady, c),
                self.costs.decode(rows - grp.end, c),
            )
            for grp in groups
        ]
        for L in range(1, self.max_draft_len + 1):
            tokens, least = float(rows), math.inf
            if in_set is not None:
                in_set.clear()
            whole = self.costs.verify(rows, 1 + L, c)  # every row's verify: once per L
            for grp, (one_off, share, draft_step_s, steady_s, others_s) in zip(
                groups, fixed, strict=True
            ):
                k = grp.end
                tokens += grp.count * (expected_tokens(grp.mean_alpha, L) - 1.0) + grp.last_gain
                if in_set is not None:
                    in_set.append((grp.count, grp.mean_alpha))
                least = min(least, expected_tokens(grp.min_alpha, L))  # the slowest speculator
                draft_s = L * draft_step_s + steady_s
                bound = min(limit * least, cap)
                # plain rows wait for their one token: the whole step, or (drafts beside the
                # decode step) their own decode step
                riders = rider_bound if k + exempt < rows else math.inf
                for fused, step_s in self._step_times(rows, k, L, draft_s, others_s, whole):
                    step_s += g.round_overhead_s
                    wait = step_s
                    if g.drafts_beside_decode and not fused:
                        wait = others_s + g.round_overhead_s
                    if goal is None:
                        value = tokens / (step_s + share)
                    else:
                        value = goal.value(rows, in_set, L, tokens, step_s + share, wait,
                                           group_needs)  # fmt: skip
                    # the cap bounds the whole step: a catch-up round's context feed too
                    if step_s > bound or step_s + one_off > cap or wait > riders or value <= floor:
                        continue
                    if plans is None and best is not None and value <= best.value:
                        continue  # the first of equals stays: deterministic
                    late = 0.0
                    if tail is not None:  # riders beside a fused round wait for its feed too
                        gap = wait if wait < step_s else step_s + one_off
                        late = tail.late(k, L, step_s + one_off, gap)
                        if late > tail.credit:
                            tail.refused += 1
                            tail.least_refused = min(tail.least_refused, late)
                            continue
                    plan = Plan(value, step_s + one_off, tokens, k, L, fused, late)
                    if best is None or value > best.value:
                        best = plan
                    if plans is not None:
                        plans.append(plan)
        if not plans or best is None:
            return best
        close = (p for p in plans if p.value >= (1.0 - g.tail_tolerance) * best.value)
        return min(close, key=lambda p: (p.step_s, -p.value))

    def _bounds(self, t0: float, seen: float) -> tuple[float, float]:
        """(latency guard, rider bound): a speculating request's expected time per token at
        most (1 + latency_slack)·t0, a plain row riding in a round waiting at most
        (1 + rider_slack)·t0 for its token. Neither while the plain step ``seen`` (``t0``, or
        the one requests are measured to see) misses the TPOT target
        (``GoodputConfig.tpot_target_s``): every row misses it at its plain rate, so the plan
        with the most tokens per second speeds up whoever it can; nor at all with
        ``tpot_unguarded``."""
        g = self.goodput
        if g.tpot_target_s is not None and (seen > g.tpot_target_s or g.tpot_unguarded):
            return math.inf, math.inf
        return (1.0 + g.latency_slack) * t0, (1.0 + g.rider_slack) * t0

    def _goal(
        self, rows: int, t0: float, seen: float, needs: dict[int, float] | None
    ) -> TargetGoal | None:
        """The TPOT target's ranking of plans (``GoodputConfig.tpot_objective``), or None;
        with ``needs``, each row against its own (``tpot_deadlines``)."""
        g = self.goodput
        if not g.tpot_objective or g.tpot_target_s is None:
            return None
        y, inflation = g.tpot_target_s, max(1.0, seen / t0)
        weight = TargetGoal.TIE_WEIGHT if g.tpot_tokens_weight is None else g.tpot_tokens_weight
        if needs is None:
            return TargetGoal(y, inflation, float(seen <= y), rows / t0, None, weight)
        ordered = tuple(sorted(needs.values()))
        plain = (len(ordered) - bisect_left(ordered, seen)) / max(1, rows)
        return TargetGoal(y, inflation, plain, rows / t0, ordered, weight)

    def _one_off(self, grp: CandidateGroup) -> tuple[float, float]:
        """(seconds, seconds a round) of a group's set's one-off: its far drafters' context
        feed, each request's share spread over the rounds it can pay it back in
        (``far_per_round``), and an eager first step's host time over ``amortize_steps``."""
        g = self.goodput
        feed = self.costs.catch_up(grp.far, self.contended)
        eager = g.eager_draft_s if grp.eager else 0.0
        share = feed * grp.far_per_round / grp.far if grp.far else 0.0
        return feed + eager, share + eager / g.amortize_steps

    def _step_times(
        self, rows: int, k: int, L: int, draft_s: float, others_s: float, whole_s: float
    ) -> tuple[tuple[bool, float], tuple[bool, float]]:
        """(fused, seconds) of one round: the fused step and the separate decode + verify
        (``others_s``: the other rows' decode step; ``whole_s``: all rows' verify at 1 + L)."""
        c, busy = self.costs, self.contended
        uniform = k == rows or self.goodput.padded_fused
        fwd = whole_s if uniform else c.mixed(rows, rows + k * L, busy)
        separate = draft_s + others_s + c.verify(k, 1 + L, busy)
        return (True, draft_s + fwd), (False, separate)


@dataclass
class Tail:
    """One search's pricing of late tokens (``verifypd.controller.tail_budget``): tokens that
    come more than ``bound_s`` after the one before, at most ``credit`` of them a plan.
    ``groups``: (speculating rows, mean α̂) of the groups in the set so far, at the L being
    searched; ``refused``: plans that passed every other rule but cost more than the credit,
    the cheapest of them ``least_refused`` late tokens."""

    bound_s: float
    rows: int
    credit: float
    groups: list[tuple[int, float]] = field(default_factory=list)
    refused: int = 0
    least_refused: float = math.inf

    def late(self, k: int, L: int, step_s: float, wait_s: float) -> float:
        """Late tokens of the first ``k`` candidates speculating with ``L`` in a round of
        ``step_s``: speculators whose round gives too few tokens for its length, rows at
        their last token (one token after the round), and plain riders waiting ``wait_s``."""
        late = float(self.rows - k) if wait_s > self.bound_s else 0.0
        if step_s <= self.bound_s:
            return late
        spec = sum(n for n, _ in self.groups)
        ratio = step_s / self.bound_s
        return late + (k - spec) + sum(n * late_tokens(a, L, ratio) for n, a in self.groups)
