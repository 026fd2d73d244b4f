"""Iteration-level scheduler: plans steps, never touches tensors.

The scheduler owns the waiting and running sequences and the KV cache manager. Each planning
call returns plain-data ``ScheduledSeq`` lists; the runner executes them; ``update`` folds the
result back in. Lanes (decode, verify, prefill) call the planning methods separately; the
single-lane loop merges them into one mixed step.

Preemption is by recompute: a victim's blocks are freed, its progress reset to zero, and it
goes back to the front of the waiting queue (its full blocks stay in the prefix cache, so the
recompute often hits them).
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Iterable

from verifypd.kvcache import KVCacheManager
from verifypd.types import (
    NO_SPECULATION,
    Observer,
    ScheduledSeq,
    SeqStatus,
    Sequence,
    SpecDecision,
    StepPlan,
)


def _waiting_key(seq: Sequence) -> tuple[int, float, int]:
    return (-seq.params.priority, seq.arrival_time, seq.seq_id)


class Scheduler:
    """Admission, chunked prefill, decode slots, preemption and finishing."""

    def __init__(
        self,
        kv: KVCacheManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_prefill_chunk: int,
        max_model_len: int,
        eos_token_ids: Iterable[int] = (),
        observer: Observer | None = None,
        prefill_pack_tokens: int | None = None,
        prefill_pack_backlog_s: float | None = None,
    ) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_prefill_chunk = max_prefill_chunk
        self.prefill_pack_tokens = prefill_pack_tokens  # the prefill lane's ``pack``
        self.prefill_pack_backlog_s = prefill_pack_backlog_s  # ... lifted past this wait
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.observer = observer or Observer()
        self.waiting: list[Sequence] = []  # sorted by _waiting_key
        self._waiting_keys: list[tuple[int, float, int]] = []
        self.running: list[Sequence] = []  # admitted (prefilling or decoding), admission order
        self.num_preemptions = 0

    # ------------------------------------------------------------------ queues
    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        key = _waiting_key(seq)
        i = bisect.bisect(self._waiting_keys, key)
        self._waiting_keys.insert(i, key)
        self.waiting.insert(i, seq)

    def _remove_waiting(self, seq: Sequence) -> None:
        i = self.waiting.index(seq)
        del self.waiting[i]
        del self._waiting_keys[i]

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_prefilling(self) -> int:
        """Part-prefilled sequences whose next chunk is not in flight."""
        return sum(map(_awaits_chunk, self.running))

    def prompts_waiting(self) -> bool:
        """A prompt waits for a prompt step: queued, or part-prefilled and not in flight."""
        return bool(self.waiting) or any(map(_awaits_chunk, self.running))

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def live_tables(self) -> list[list[int]]:
        return [s.block_table for s in self.running if s.block_table]

    # ------------------------------------------------------------------ planning
    def plan_decode(self, spec: SpecDecision = NO_SPECULATION) -> list[ScheduledSeq]:
        """One token (plus its drafts, if any) for every decoding sequence not in flight, each
        entry carrying its draft length from ``spec``; every one reserves ``spec.reserve``
        draft slots (a verify needs 1 + L).

        Makes room by preempting the lowest-priority, newest sequences when blocks run out."""
        planned: list[ScheduledSeq] = []
        for seq in sorted(self._decodable(), key=_waiting_key):
            if seq.status is not SeqStatus.DECODING:
                continue  # preempted while making room for an earlier one
            if self._reserve(seq, seq.num_tokens + spec.reserve, planned):
                planned.append(ScheduledSeq(seq, 1, draft_len=spec.lens.get(seq.seq_id, 0)))
        return planned

    def plan_ahead(self, prev: StepPlan, sampled_at: Callable[[int], int]) -> list[ScheduledSeq]:
        """Decode-ahead: the next token of every entry of ``prev`` (a decode step still in
        flight) that may run before ``prev`` lands: its input is the token ``prev`` samples,
        read on the device (``sampled_at(i)``: entry i's index in ``prev``'s packed result, -1
        for none). An entry qualifies when nothing about the next step depends on the host
        seeing that token first: a plain one-token decode (or a prompt's last chunk computed
        inside the decode step, ``EngineConfig.prompt_in_decode_tokens``: its first token; so
        its second does not wait for the step ahead and then its own), no logits controls
        (penalties, bias, min_tokens, bad words count tokens on the host), no log-probs, no
        grammar, and not at its length limit. Its slot is reserved now; no one is preempted for
        a step ahead (a sequence that does not fit waits for the ordinary path). If ``prev``
        ends a sequence (EOS, a stop), the step ahead computes one token that is dropped when
        it lands, and the sequence's blocks are freed then (``in_flight``)."""
        planned: list[ScheduledSeq] = []
        for i, e in enumerate(prev.seqs):
            seq, params = e.seq, e.seq.params
            row = e.num_new_tokens == 1 and seq.status is SeqStatus.DECODING
            ends_prompt = prev.lane == "decode" and seq.status is SeqStatus.PREFILLING
            if (
                e.draft_token_ids
                or not (row or ends_prompt)
                or not e.samples
                or seq.in_flight != 1
                or params.uses_logits_controls
                or params.logprobs is not None
                or params.structured is not None
                or seq.num_output_tokens + 1 >= params.max_tokens
                or seq.num_tokens + 1 >= self.max_model_len
            ):
                continue
            index = sampled_at(i)
            position = e.sample_position  # where prev's token lands: this step's input
            if index < 0 or not self.kv.allocate(seq.block_table, position + 1):
                continue
            planned.append(ScheduledSeq(seq, 1, ahead_index=index, ahead_position=position))
        return planned

    def decodable(self) -> list[Sequence]:
        """Decoding sequences not in a step: the next decode batch."""
        return [s for s in self.running if s.status is SeqStatus.DECODING and not s.in_flight]

    _decodable = decodable

    def _reserve(self, seq: Sequence, num_slots: int, planned: list[ScheduledSeq]) -> bool:
        """Grow ``seq``'s block table to ``num_slots`` tokens, preempting others if needed."""
        while not self.kv.allocate(seq.block_table, num_slots):
            victim = self._pick_victim(exclude={p.seq.seq_id for p in planned})
            if victim is None or victim is seq:
                self.preempt(seq)
                return False
            self.preempt(victim)
        return True

    def _pick_victim(self, exclude: set[int]) -> Sequence | None:
        """Lowest priority first, then newest; never one in flight or already planned."""
        candidates = [s for s in self.running if not s.in_flight and s.seq_id not in exclude]
        if not candidates:
            return None
        return max(candidates, key=lambda s: (-s.params.priority, s.arrival_time, s.seq_id))

    def prefill_pack(self, now: float | None = None) -> int | None:
        """The prefill lane's ``pack`` for its next step: ``prefill_pack_tokens``, or None
        (FCFS up to the budget) while the oldest queued prompt has waited longer than
        ``prefill_pack_backlog_s``."""
        lift = self.prefill_pack_backlog_s
        if lift is not None and self.waiting:
            now = time.monotonic() if now is None else now
            if now - min(s.arrival_time for s in self.waiting) > lift:
                return None
        return self.prefill_pack_tokens

    def plan_prefill(
        self, token_budget: int, num_running_budget: int, pack: int | None = None
    ) -> list[ScheduledSeq]:
        """Chunks of prompts: first the ones already prefilling, then new admissions.

        ``num_running_budget`` caps how many sequences may be running after admission.
        ``pack`` (``SchedulerConfig.prefill_pack_tokens``; None: no limit): beside the first
        chunk, only chunks that end their prompt join, up to this many tokens in all, so a
        prompt's last chunk never waits for another prompt's long chunk in the same step (a
        short prompt rides along; a long one heads a step of its own)."""
        planned: list[ScheduledSeq] = []
        room = pack  # tokens open to chunks beside the step's first (None: no limit)

        def rides(num_tokens: int, ends: bool) -> bool:
            return not planned or room is None or (ends and num_tokens <= room)

        for seq in self.running:
            if token_budget <= 0:
                return planned
            if seq.status is not SeqStatus.PREFILLING or seq.in_flight:
                continue
            chunk = self._chunk(seq, token_budget)
            if not rides(chunk, chunk == seq.num_tokens - seq.num_computed_tokens):
                continue  # the head of a later step
            if self.kv.allocate(seq.block_table, seq.num_computed_tokens + chunk):
                if planned and room is not None:
                    room -= chunk
                planned.append(ScheduledSeq(seq, chunk))
                token_budget -= chunk
        for seq in list(self.waiting):
            if token_budget <= 0 or len(self.running) >= num_running_budget:
                break
            whole = seq.num_tokens  # before any prefix hit: a hit only shortens it
            if not rides(whole, whole <= min(token_budget, self.max_prefill_chunk)):
                continue  # the head of a later step
            sched = self._admit(seq, token_budget)
            if sched is None:
                break  # head of line waits for room; lower priorities do not jump it
            if planned and room is not None:
                room -= sched.num_new_tokens
            planned.append(sched)
            token_budget -= sched.num_new_tokens
        return planned

    def plan_prompt_end(self, max_tokens: int) -> ScheduledSeq | None:
        """The prompt the next prompt step would start with, planned alone (admitted, its
        slots reserved) when its rest is at most ``max_tokens`` (a whole short prompt, or a
        long one's last chunk) and it asks for no prompt log-probs: for a decode step to
        compute (``EngineConfig.prompt_in_decode_tokens``). None (nothing planned) otherwise."""
        if not self.prompt_end_fits(max_tokens):
            return None
        entries = self.plan_prefill(max_tokens, self.max_num_seqs, pack=0)
        return entries[0] if entries else None

    def prompt_end_fits(self, max_tokens: int) -> bool:
        """``plan_prompt_end`` would plan the next prompt: its rest fits ``max_tokens``."""
        seq = next((s for s in self.running if _awaits_chunk(s)), None)
        if seq is None and self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
        if seq is None or seq.needs_prompt_logprobs:
            return False
        rest = seq.num_tokens - seq.num_computed_tokens  # (0 computed while waiting)
        return rest <= min(max_tokens, self.max_prefill_chunk)

    def _chunk(self, seq: Sequence, token_budget: int) -> int:
        remaining = seq.num_tokens - seq.num_computed_tokens
        return min(remaining, token_budget, self.max_prefill_chunk)

    def _admit(self, seq: Sequence, token_budget: int) -> ScheduledSeq | None:
        # Prompt log-probs need the logits of every prompt position: no prefix reuse then.
        salt = seq.params.cache_salt
        cached = [] if seq.needs_prompt_logprobs else self.kv.match_prefix(seq.token_ids, salt)
        num_cached = len(cached) * self.kv.block_size
        seq.num_computed_tokens = num_cached
        chunk = self._chunk(seq, token_budget)
        if not self.kv.allocate(seq.block_table, num_cached + chunk, cached, salt):
            seq.num_computed_tokens = 0
            return None
        self.observer.prefix_cache(seq.num_tokens, num_cached)
        if seq.num_output_tokens == 0:
            seq.num_cached_tokens = num_cached
        self._remove_waiting(seq)
        seq.status = SeqStatus.PREFILLING
        if seq.first_scheduled_time is None:
            seq.first_scheduled_time = time.monotonic()
            self.observer.request_queued(seq.first_scheduled_time - seq.arrival_time)
        self.running.append(seq)
        return ScheduledSeq(seq, chunk)

    def schedule_mixed(
        self,
        spec: SpecDecision = NO_SPECULATION,
        token_budget: int | None = None,
        pack: int | None = None,
    ) -> StepPlan | None:
        """Single-lane step (the vLLM-style baseline): all decodes (with room for drafts),
        then prefill chunks, in one batch of ``token_budget`` tokens (None:
        ``max_num_batched_tokens``), the chunks packed by ``pack`` (``plan_prefill``). Also
        decode rows inside a prompt step (``lanes.backlog_fuse``)."""
        decodes = self.plan_decode(spec)
        budget = self.max_num_batched_tokens if token_budget is None else token_budget
        prefills = self.plan_prefill(budget - len(decodes), self.max_num_seqs, pack)
        seqs = decodes + prefills
        return StepPlan("mixed", seqs) if seqs else None

    # ------------------------------------------------------------------ state changes
    def preempt(self, seq: Sequence) -> None:
        """Recompute preemption: free the blocks, reset progress, requeue at the front."""
        self.kv.free(seq.block_table)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.running.remove(seq)
        self.add(seq)
        seq.status = SeqStatus.PREEMPTED
        self.num_preemptions += 1
        self.observer.preemption()

    def finish(self, seq: Sequence, reason: str) -> None:
        """Ends a sequence (stop, length, abort, error) and frees its blocks unless in flight."""
        if seq.status.is_finished:
            return
        seq.status = SeqStatus.ABORTED if reason in ("abort", "error") else SeqStatus.FINISHED
        seq.finish_reason = reason
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self._remove_waiting(seq)
        if not seq.in_flight:
            self.kv.free(seq.block_table)

    def begin_step(self, plan: StepPlan) -> None:
        for s in plan.seqs:
            s.seq.in_flight += 1

    def abandon(self, plan: StepPlan) -> None:
        """A step that failed: nothing it computed is kept (no progress, nothing cached)."""
        for sched in plan.seqs:
            sched.seq.in_flight -= 1

    def update(self, plan: StepPlan, token_ids: list[list[int]]) -> list[Sequence]:
        """Folds a finished step back in; returns the sequences that got new tokens."""
        changed: list[Sequence] = []
        for sched, new_ids in zip(plan.seqs, token_ids, strict=True):
            seq = sched.seq
            seq.in_flight -= 1
            if seq.status.is_finished:
                if not seq.in_flight:
                    self.kv.free(seq.block_table)  # deferred free of an aborted seq
                continue
            if self._apply(sched, new_ids):
                changed.append(seq)
        return changed

    def _apply(self, sched: ScheduledSeq, new_ids: list[int]) -> bool:
        seq = sched.seq
        num_accepted = max(len(new_ids) - 1, 0) if sched.draft_token_ids else 0
        seq.num_computed_tokens += sched.num_new_tokens + num_accepted
        if not new_ids:
            self.kv.cache_blocks(
                seq.block_table, seq.token_ids, seq.num_computed_tokens, seq.params.cache_salt
            )
            return False
        if seq.status in (SeqStatus.PREFILLING, SeqStatus.VERIFYING):
            seq.status = SeqStatus.DECODING
        reason = self._append(seq, new_ids)
        self.kv.cache_blocks(
            seq.block_table, seq.token_ids, seq.num_computed_tokens, seq.params.cache_salt
        )
        if reason is not None:
            self.finish(seq, reason)
        elif sched.draft_token_ids or len(seq.block_table) * self.kv.block_size >= (
            seq.num_tokens + self.kv.block_size
        ):  # release slots reserved for rejected (or never proposed) drafts; a plain step
            # that holds no block past its tokens has nothing to release (most decode steps)
            self.kv.truncate(seq.block_table, seq.num_tokens)
        return True

    def _append(self, seq: Sequence, new_ids: list[int]) -> str | None:
        """Appends tokens one by one, stopping at the first stop condition."""
        params = seq.params
        for tok in new_ids:
            seq.token_ids.append(tok)
            can_stop = seq.num_output_tokens > params.min_tokens  # the sampler masks them too
            if can_stop and tok in params.stop_token_ids:
                return "stop"
            if can_stop and not params.ignore_eos and tok in self.eos_token_ids:
                return "stop"
            if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
                return "length"
        return None


def _awaits_chunk(seq: Sequence) -> bool:
    """Part-prefilled, its next chunk not in flight."""
    return seq.status is SeqStatus.PREFILLING and not seq.in_flight
