"""Output processing: what reaches the clients. Per request choice, a detokenizer and a stop
checker turn the tokens a landed step appended into text deltas (``RequestOutput``); a stop
string ends the sequence; finished and aborted choices get their last delta, their timing
metrics, and their per-sequence state released (``release``: drafter, grammar, policy)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from verifypd.engine.detokenizer import IncrementalDetokenizer, StopChecker, push_output
from verifypd.engine.logprobs import attach_logprobs
from verifypd.engine.scheduler import Scheduler
from verifypd.types import Observer, RequestOutput, Sequence

logger = logging.getLogger("verifypd")


@dataclass
class SeqOutputState:
    """Per-sequence output bookkeeping: detokenizer, stop strings, what was emitted."""

    seq: Sequence
    detok: IncrementalDetokenizer | None  # None: SamplingParams.detokenize is off
    stop: StopChecker
    num_emitted: int = 0
    pending_ids: list[int] = field(default_factory=list)
    is_done: bool = False  # its final delta was emitted


class OutputProcessor:
    """The live requests' output states (``requests``: request id -> one per choice)."""

    def __init__(
        self,
        scheduler: Scheduler,
        observer: Observer,
        release: Callable[[Sequence], None],
    ) -> None:
        self.scheduler = scheduler
        self.observer = observer
        self._release = release
        self.requests: dict[str, list[SeqOutputState]] = {}

    def live_seqs(self) -> list[Sequence]:
        """Every choice whose last delta is still due."""
        return [st.seq for states in self.requests.values() for st in states if not st.is_done]

    def add(self, request_id: str, states: list[SeqOutputState]) -> None:
        self.requests[request_id] = states

    def process(self, seqs: list[Sequence]) -> list[RequestOutput]:
        """The deltas of the sequences a landed step changed."""
        return [out for seq in seqs for out in self._process_isolated(seq)]

    def abort(self, request_id: str, reason: str = "abort") -> list[RequestOutput]:
        """Ends every choice of a request whose last delta is still due, with ``reason``
        ("abort", or "error" for a failure); frees blocks now (or when its step lands)."""
        states = self.requests.pop(request_id, [])
        outputs = []
        for st in states:
            if not st.is_done:
                self._end(st, reason)
                outputs.append(self._delta(st, "", finished=True))
                self._report_finished(st.seq)
            self._release(st.seq)
        return outputs

    def _end(self, st: SeqOutputState, reason: str) -> None:
        st.is_done = True
        if not st.seq.status.is_finished:
            self.scheduler.finish(st.seq, reason)
        st.seq.finish_reason = reason  # a finish whose delta was never sent is lost as well

    def _state(self, seq: Sequence) -> SeqOutputState | None:
        states = self.requests.get(seq.request_id)
        return states[seq.index] if states else None

    def _process_isolated(self, seq: Sequence) -> list[RequestOutput]:
        """``_process``; a failure there (detokenizing, stop strings) is its request's own: it
        ends that request with "error" and frees its blocks, and its batch-mates go on."""
        try:
            out = self._process(seq)
        except Exception:
            logger.exception("output processing failed; ending request %s", seq.request_id)
            return self.abort(seq.request_id, "error")
        return [] if out is None else [out]

    def _process(self, seq: Sequence) -> RequestOutput | None:
        st = self._state(seq)
        if st is None:
            return None
        first = st.num_emitted
        new_ids = seq.output_token_ids[first:]
        st.num_emitted = seq.num_output_tokens
        self._report_tokens(seq, len(new_ids))
        if st.detok is None:  # ids only: no text, so no stop strings (refused without text)
            text, hit = "", False
        else:
            text, hit = push_output(st.detok, st.stop, new_ids, first, seq)
        if hit:
            self.scheduler.finish(seq, "stop")
        elif seq.status.is_finished:
            text += st.stop.flush()
        out = self._delta(st, text, finished=seq.status.is_finished, new_ids=new_ids)
        attach_logprobs(out, seq, first)
        if seq.status.is_finished:
            st.is_done = True
            self._report_finished(seq)
            self._forget(seq)
        return out

    def _delta(
        self, st: SeqOutputState, text: str, finished: bool, new_ids: list[int] | None = None
    ) -> RequestOutput:
        seq = st.seq
        return RequestOutput(
            request_id=seq.request_id,
            index=seq.index,
            new_token_ids=new_ids or [],
            new_text=text,
            finished=finished,
            finish_reason=seq.finish_reason if finished else None,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens,
            num_cached_tokens=seq.num_cached_tokens,
        )

    def _forget(self, seq: Sequence) -> None:
        self._release(seq)
        states = self.requests.get(seq.request_id)
        # Not seq.status: choices that finished in this same step still need their last delta.
        if states and all(s.is_done for s in states):
            del self.requests[seq.request_id]

    def _report_tokens(self, seq: Sequence, num_new: int) -> None:
        now = time.monotonic()
        if seq.first_token_time is None and num_new:
            seq.first_token_time = now
            self.observer.first_token(now - seq.arrival_time)
        elif seq.last_token_time is not None and num_new:
            self.observer.inter_token((now - seq.last_token_time) / num_new)
        seq.last_token_time = now

    def _report_finished(self, seq: Sequence) -> None:
        self.observer.request_finished(
            seq.finish_reason or "abort",
            time.monotonic() - seq.arrival_time,
            seq.num_prompt_tokens,
            seq.num_output_tokens,
        )
