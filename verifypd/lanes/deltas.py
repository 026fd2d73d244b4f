"""When a landed step's deltas are made and handed out (``LaneDispatcher``'s delivery rules).

A landed step is folded in at once (tokens, KV, acceptance); its deltas (detokenizing, delivery,
metrics) are host work that may wait for the next launch so that it overlaps the GPU
(``EngineConfig.emit_after_launch``, on where a launch only enqueues), except:

- while another lane's step is in flight the GPU is busy anyway: delivery goes first (a decode
  step ahead excepted: it is launched first, the GPU being about to run out of decode work);
- first tokens go first (TTFT), and the tick that hands them out launches nothing more, so their
  consumers (a stream writer) run before the next launch, which may be a long host section;
- a request with stop strings goes first: a stop string ends it only once detokenized, and it
  must never be planned again;
- before a drafting launch that follows a plain one (``EngineConfig.deliver_before_drafting``):
  drafting holds the host for 1.5-8 ms (a catch-up the longest), which deltas whose previous
  ones waited only behind a plain launch (~0.5 ms) would otherwise wait for. Behind one drafting
  launch after another the gaps stay as long as each other, and the GPU is not left idle while
  deltas are made.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from verifypd.engine.core import EngineCore
    from verifypd.types import RequestOutput, Sequence, SpecDecision


class Deltas:
    """The sequences whose deltas are not made yet, and when to make them."""

    def __init__(
        self,
        core: EngineCore,
        deliver: Callable[[RequestOutput], None],
        after_launch: bool,
        before_drafting: bool,
    ) -> None:
        self.core = core
        self._deliver = deliver
        self.after_launch = after_launch  # EngineConfig.emit_after_launch, where launches enqueue
        self.before_drafting = before_drafting  # EngineConfig.deliver_before_drafting
        self.waiting: list[Sequence] = []
        self.drafted_last = False  # the last decode (or mixed) launch drafted
        # Deltas were just handed out ahead of the next launch (first tokens, or ahead of a
        # drafting launch): the tick returns and their consumers run before it.
        self.handed_out = False
        self.num_ahead = 0  # times deltas went out ahead of a drafting launch (tests, benchmarks)

    def landed(self, changed: list[Sequence]) -> None:
        self.waiting += changed

    def settle(self, others_in_flight: bool) -> None:
        """After landed steps were folded in: deltas go out now unless they may wait for the
        next launch (``others_in_flight``: a step other than a decode step ahead is in
        flight)."""
        waiting = self.waiting
        first = any(s.first_token_time is None for s in waiting)
        stops = any(s.params.stop for s in waiting)
        if not self.after_launch or others_in_flight or first or stops:
            self.emit()
            self.handed_out = first

    def ahead_of(self, decision: SpecDecision) -> bool:
        """Deltas go out before the launch ``decision`` plans, and its tick returns: it drafts
        and the launch before it did not. The caller keeps the decision for the next tick."""
        if not (self.before_drafting and decision.lens and self.waiting) or self.drafted_last:
            return False
        self.emit()
        self.handed_out = True
        self.num_ahead += 1
        return True

    def take_handed_out(self) -> bool:
        """Whether deltas were just handed out (once)."""
        out, self.handed_out = self.handed_out, False
        return out

    def emit(self) -> None:
        changed, self.waiting = self.waiting, []
        for out in self.core.emit(changed) if changed else ():
            self._deliver(out)
