"""The TPOT target as the goodput policy's objective (``GoodputConfig.tpot_objective``): how a
plan is valued by the rows it brings under the target (``TargetGoal``), and what a request has
left of the target (``tpot_need_s``, ``GoodputConfig.tpot_deadlines``)."""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass

from verifypd.controller.policy import expected_tokens


def tpot_need_s(target_s: float, tokens_out: int, tokens_left: int, decoding_s: float) -> float:
    """The mean time per token a request may take over its ``tokens_left`` and still have its
    TPOT (first token to last, over the tokens after the first) within ``target_s``:
    ``tokens_out`` delivered, the first of them ``decoding_s`` ago. Below zero: it is too late
    already. Before its first token, or with none left: the target."""
    if tokens_out < 1 or tokens_left < 1:
        return target_s
    return (target_s * (tokens_out + tokens_left - 1) - decoding_s) / tokens_left


@dataclass(frozen=True)
class TargetGoal:
    """Plans ranked by goodput's own measure (``GoodputConfig.tpot_objective``): first the share
    of rows whose time per token meets the TPOT target, then (weighted by ``TIE_WEIGHT``: one
    row more counts for more in batches of up to ~250 rows, at up to 4x plain decoding's
    tokens a second) tokens a second over plain decoding's; or the two weighed against each
    other (``tokens_weight``). Rows, not tokens: goodput counts requests that make the
    target, and a row far under it gains nothing by a longer draft that leaves another above
    it. A speculating group's time per token is
    the round over E(α̂, L), a plain rider's its wait; both scaled by ``inflation``, the plain
    step requests are measured to see over the predicted one (prompt steps beside decode, the
    host). Not what rounds take over their prediction (``Cadence.round_seen_ratio``): read so
    on an H200 at 8 req/s (6a4b949, fa9bc26) it drafted less and gave 1.80 req/s within 4 ms
    where this gave 3.12-3.44 (4be552b, fa9bc26's policy-tpot4-obj-pred). Plain decoding
    counts its rows only where its step meets the target (``plain_meets``): a plan that
    brings some rows under it beats one that leaves every row above it, whatever it does to
    the batch's tokens a second. With ``needs`` (``GoodputConfig.tpot_deadlines``) each row
    is held to its own need (``tpot_need_s``) in place of the target."""

    TIE_WEIGHT = 1e-3

    target_s: float
    inflation: float
    plain_meets: float  # the share of rows plain decoding brings under (without needs: 0 or 1)
    plain_rate: float  # plain decoding's tokens a second
    needs: tuple[float, ...] | None = None  # every row's need, sorted
    # tokens a second over plain decoding's, against the share of rows (GoodputConfig.
    # tpot_tokens_weight): TIE_WEIGHT ranks by rows first; 1 trades one row in a hundred
    # under the target for a 1 % gain in tokens a second
    tokens_weight: float = TIE_WEIGHT

    def floor(self, tokens_floor: float) -> float:
        """Plain decoding's value with the caller's bar on tokens a second (``tokens_floor``)."""
        return float(self.plain_meets) + self.tokens_weight * tokens_floor / self.plain_rate

    def value(
        self,
        rows: int,
        groups: list[tuple[int, float]],
        L: int,
        tokens: float,
        round_s: float,
        wait_s: float,
        group_needs: list[list[float]] | None = None,
    ) -> float:
        """A round of ``round_s`` with ``groups`` (rows, mean α̂) speculating at ``L`` and the
        other rows waiting ``wait_s`` for their one token; ``tokens`` in all. With
        ``needs``, ``group_needs`` holds every candidate group's rows' needs, sorted (the
        first ``len(groups)`` are the set's)."""
        within, spec = 0, 0
        plain_s = self.inflation * wait_s
        if self.needs is None or group_needs is None:
            for count, alpha in groups:
                spec += count
                if self.inflation * round_s <= self.target_s * expected_tokens(alpha, L):
                    within += count
            within += rows - spec if plain_s <= self.target_s else 0
        else:
            # rows whose need is at least their time per token; plain rows are every row
            # that meets the wait less the speculating ones that would
            within += len(self.needs) - bisect_left(self.needs, plain_s)
            for (_, alpha), needs in zip(groups, group_needs, strict=False):  # the set's
                per_token = self.inflation * round_s / expected_tokens(alpha, L)
                within += bisect_left(needs, plain_s) - bisect_left(needs, per_token)
        return within / rows + self.tokens_weight * tokens / round_s / self.plain_rate
