"""Engine core: model + KV pool + scheduler + runner + output processing: mechanism only.

The driver above it (``lanes.dispatcher.LaneDispatcher``) plans with the scheduler
(``plan_*``, given the policy's ``SpecDecision`` as data), launches (``draft``, ``launch``),
folds landed steps back in (``record_step``, ``apply_step``) and emits deltas (``emit``;
``finish_step`` is both). Every speculative decision comes from the speculation policy
(``lanes.spec_policy``), handed down as per-step data and through narrow verbs (``draft``,
``chain``, ``follow_prefill``); the engine reports back through a ``SpecListener`` and never
imports the policy or its controller.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Generator
from typing import Any

from verifypd.batch_costs import BatchCostModel
from verifypd.config import EngineConfig
from verifypd.engine.admission import RequestLimits, arrival_of, check_synthetic_acceptance
from verifypd.engine.compile_watch import CompileReporter
from verifypd.engine.detokenizer import IncrementalDetokenizer, StopChecker
from verifypd.engine.draft_follow import decode_follow_items, prompt_follow_items
from verifypd.engine.logprobs import check_num_logprobs, fold_logprobs
from verifypd.engine.model import drain
from verifypd.engine.outputs import OutputProcessor, SeqOutputState
from verifypd.engine.runner import PendingStep
from verifypd.engine.sampling_controls import resolve_bad_words
from verifypd.engine.setup import build_engine, decode_ahead_on, resolve_device, resolve_dtype
from verifypd.engine.timing import step_cost_kind
from verifypd.types import (
    Observer,
    ParamError,
    RequestOutput,
    SamplingParams,
    ScheduledSeq,
    Sequence,
    SpecListener,
    StepPlan,
)

__all__ = ["EngineCore", "SeqOutputState", "resolve_device", "resolve_dtype"]

logger = logging.getLogger("verifypd")


class EngineCore:
    """Owns one target model and everything needed to serve it (built by ``setup``)."""

    def __init__(self, config: EngineConfig, observer: Observer | None = None) -> None:
        self.config = config
        self._observer = observer or Observer()
        parts = build_engine(config, self._observer)
        self.device, self.dtype, self.ops = parts.device, parts.dtype, parts.ops
        self.loaded = parts.loaded
        self.model_config = parts.loaded.config
        self.tokenizer = parts.loaded.tokenizer
        self.model_name = parts.loaded.name
        self.max_model_len = parts.max_model_len
        self.block_size = parts.block_size
        self.use_cuda_graphs = parts.use_cuda_graphs
        self.kv_sizing, self.pool, self.kv = parts.kv_sizing, parts.pool, parts.kv
        self.scheduler, self.runner, self.grammars = parts.scheduler, parts.runner, parts.grammars
        self.spec = parts.spec
        self.cost_table = parts.cost_table
        # Step costs (shape from the start-up calibration when there is one, level learned
        # online) for the speculation policy and the prefill chunk bound.
        self.costs = BatchCostModel(self.cost_table)
        # Whether drafts may be chained behind a verify (a chain that fails turns it off);
        # when to chain is the speculation policy's decision.
        chain = config.spec.chain_drafts
        self.chain_drafts = (self._is_cuda if chain is None else chain) and (
            self.spec.drafter is not None
        )
        # The speculation policy (``lanes.spec_policy``) attaches itself here to hear about
        # requests and acceptance; the engine never imports it.
        self.listener = SpecListener()
        self.outputs = OutputProcessor(self.scheduler, self._observer, self._release)
        self.limits = RequestLimits(
            self.model_config.vocab_size,
            self.max_model_len,
            self.kv.num_blocks,
            self.block_size,
            config.scheduler.max_request_kv_share,
            config.spec.max_draft_len if self.spec.enabled else 0,
        )
        self.compiles = CompileReporter(watch=self._is_cuda)  # from here on

    @property
    def observer(self) -> Observer:
        return self._observer

    @observer.setter
    def observer(self, observer: Observer) -> None:  # benchmarks swap in a recorder
        self._observer = self.outputs.observer = observer

    @property
    def requests(self) -> dict[str, list[SeqOutputState]]:
        """Live requests' output states (request id -> one per choice)."""
        return self.outputs.requests

    @property
    def _is_cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def gc_freeze(self) -> bool:
        """Whether the serving front freezes the start-up heap (``EngineConfig.gc_freeze``;
        None: on a GPU, where the host loop's pauses idle the device)."""
        freeze = self.config.gc_freeze
        return self._is_cuda if freeze is None else freeze

    @property
    def decode_ahead(self) -> bool:
        """Whether decode steps run ahead (``EngineConfig.decode_ahead``; None: on a GPU, where
        a launch only enqueues). The lane dispatcher and the speculation policy both read it."""
        return decode_ahead_on(self.config, self._is_cuda)

    @property
    def prompt_in_decode_tokens(self) -> int:
        """The longest prompt rest a decode step computes (``EngineConfig.
        prompt_in_decode_tokens``, where its graphs were captured: three lanes on a GPU with
        CUDA graphs; 0 elsewhere, where prompts take prompt steps)."""
        return max((g.q for g in self.runner.inputs.prompt_in_decode), default=0)

    @property
    def prompt_in_decode_rows(self) -> int:
        """The most decode rows a step computing a prompt may have (its graphs' batch)."""
        return min((g.max_batch for g in self.runner.inputs.prompt_in_decode), default=0)

    # ------------------------------------------------------------------ requests
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raises ParamError for input that can never be served (or would take more than its
        share of the KV pool): ``admission.RequestLimits``."""
        self.limits.validate(prompt_token_ids, params)
        check_num_logprobs(params, self.config.max_logprobs)
        check_synthetic_acceptance(params, self.config.spec.synthetic_acceptance)

    def max_choice_len(self, n: int = 1) -> int:
        """The longest prompt + max_tokens each choice of an ``n``-choice request may have."""
        return self.limits.max_choice_len(n)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> list[Sequence]:
        """``arrival_time`` (``time.monotonic()``; None: now): when the request reached the
        front, read by the queue's rules (``admission.arrival_of``)."""
        if request_id in self.requests:
            raise ParamError(None, f"duplicate request id {request_id!r}")
        self.validate(prompt_token_ids, params)
        resolve_bad_words(params, self.tokenizer)
        grammar = self.grammars.compile(params.structured)  # ParamError when it is invalid
        now = arrival_of(arrival_time, time.monotonic())
        states = []
        for i in range(params.n):
            seq = Sequence(request_id, prompt_token_ids, params, index=i, arrival_time=now)
            if grammar is not None:
                self.grammars.add(seq, grammar)
            detok = (
                IncrementalDetokenizer(self.tokenizer, prompt_token_ids)
                if params.detokenize
                else None
            )
            stop = StopChecker(params.stop, params.include_stop_str_in_output)
            states.append(SeqOutputState(seq, detok, stop))
            self.scheduler.add(seq)
            self.listener.request_added(seq)
        self.outputs.add(request_id, states)
        return [s.seq for s in states]

    def abort_request(self, request_id: str, reason: str = "abort") -> list[RequestOutput]:
        """Ends every choice of a request whose last delta is still due, with ``reason``
        ("abort", or "error" for a failure); frees blocks now (or when its step lands)."""
        return self.outputs.abort(request_id, reason)

    def free_lost(self, seq: Sequence) -> None:
        """``seq``'s step never comes back (its driver crashed): free what it held now."""
        seq.in_flight = 0
        self.kv.free(seq.block_table)

    def has_unfinished(self) -> bool:
        return bool(self.requests) or self.scheduler.has_work()

    # ------------------------------------------------------------------ policy hooks
    def attach_listener(self, listener: SpecListener) -> None:
        """The speculation policy hears of every live sequence (those already admitted now)."""
        self.listener = listener
        for seq in self.outputs.live_seqs():
            listener.request_added(seq)

    @property
    def controller(self) -> Any:
        """The attached speculation policy's controller (benchmarks, tests); None without."""
        return getattr(self.listener, "controller", None)

    @property
    def running(self) -> list[Sequence]:
        return self.scheduler.running

    @property
    def waiting(self) -> list[Sequence]:
        return self.scheduler.waiting

    def decodable(self) -> list[Sequence]:
        """Running sequences that a decode step may take now."""
        return self.scheduler.decodable()

    # ------------------------------------------------------------------ drafting verbs
    def drafter_behind(self, seq: Sequence) -> int:
        """Tokens the draft model must feed for ``seq`` before it drafts (its whole context,
        or window, when it never has); 1 without a draft model (n-gram lookup has nothing to
        catch up)."""
        drafter = self.spec.drafter
        if drafter is None:
            return 1
        return drafter.behind(seq)

    @property
    def drafts_on_device(self) -> bool:
        """Drafting runs on the GPU (a draft model on CUDA): time it with events."""
        return self._is_cuda and self.spec.drafter is not None

    def draft(self, entries: list[ScheduledSeq], temps: dict[int, float]) -> tuple[list[int], bool]:
        """Attaches drafts to the speculating ``entries``. Returns the draft lengths this call
        drafted itself (not adopted from a chain) and whether the drafter's start was steady
        (no catch-up on a whole prompt)."""
        self.spec.propose(entries, temps)
        return self.spec.fresh_drafts(entries), self.spec.last_proposal_was_steady

    def can_chain(self, pending: PendingStep) -> bool:
        """Drafts may be chained behind this launched step (a verify, chaining on)."""
        return self.chain_drafts and pending.verified is not None

    def chain(self, plan: StepPlan, pending: PendingStep) -> tuple[int, int]:
        """Drafts the next round behind the launched verify ``pending`` on the device. Returns
        (rows, drafted tokens); (0, 0) when nothing was chained. It touches the drafter's block
        allocator, so it runs on the event-loop thread. A failure turns chaining off."""
        try:
            rows = self.spec.chain(plan, pending.verified, self.max_model_len)
        except Exception:  # an optimization: the step itself was launched and stands
            logger.exception("chained drafting failed; turned off")
            self.chain_drafts = False
            self.spec.drafter.chained = None
            return 0, 0
        chained = self.spec.drafter.chained
        if not rows or chained is None:
            return 0, 0
        return rows, rows * chained.num_drafts

    def follow_prefill(self, plan: StepPlan, expects: Callable[[int], bool]) -> None:
        """The drafter computes its KV of the prompt chunks in ``plan`` (on the same stream,
        behind them) for the sequences ``expects`` names (by seq_id); the others' drafter
        catches up only if they draft later. Host state: on the loop thread."""
        drain(self.follow_iter(self.follow_items(plan, expects)))

    def follow_items(
        self, plan: StepPlan, expects: Callable[[int], bool]
    ) -> list[tuple[Sequence, int]]:
        """(sequence, its prompt tokens once ``plan`` has run) for each prompt chunk of
        ``plan`` the drafter follows (``SpecConfig.follow_prefill``, only at light load with
        ``follow_prefill_max_rows``); read at launch."""
        spec = self.config.spec
        if self.spec.drafter is None or not spec.follow_prefill:
            return []
        return prompt_follow_items(self.scheduler, plan, expects, spec.follow_prefill_max_rows)

    def follow_decode_items(
        self, plan: StepPlan, wants: Callable[[int], bool]
    ) -> list[tuple[Sequence, int]]:
        """(sequence, where its drafter's catch-up ends) for the plain rows of the launched step
        ``plan`` the drafter catches up behind (``draft_follow.decode_follow_items``)."""
        if self.spec.drafter is None or plan.lane == "prefill":
            return []
        return decode_follow_items(self.spec.drafter, self.scheduler, plan, wants,
                                   self.config.spec, self.use_cuda_graphs)  # fmt: skip

    def follow_iter(
        self,
        items: list[tuple[Sequence, int]],
        every: int = 0,
        on_decode: bool = False,
        beside: bool = False,
    ) -> Generator[None, None, None]:
        """The drafter's forward over ``items`` (``follow_items``, ``follow_decode_items``:
        ``on_decode``, run on the decode stream in the proposer's chunk graphs, or ``beside``
        it on the feed stream in the feed's own), pausing after every ``every`` layers (0: in
        one piece). An optimization: if it fails, the drafter catches up when it drafts."""
        if not items:
            return
        drafter = self.spec.drafter
        graphs = None  # the follow stream's own
        if on_decode:
            graphs = drafter.follower.feed_graphs if beside else drafter.chunk_graphs()
        try:
            fed = yield from drafter.follow_iter(items, every, graphs)
        except Exception:
            logger.exception("drafter catch-up behind a prefill failed")
            return
        if fed:
            self.observer.drafter_prompt_tokens(fed)

    def drafter_busy(self, seq: Sequence) -> bool:
        """The drafter is being fed ``seq``'s prompt behind its prefill (``follow_iter``):
        nothing may draft for it until that has run (``DraftView.following_now``)."""
        drafter = self.spec.drafter
        view = drafter.views.get(seq.seq_id) if drafter is not None else None
        return view is not None and view.following_now()

    def launch(self, plan: StepPlan) -> PendingStep:
        """Enqueues a step (``ModelRunner.launch``); the caller waits on the result."""
        return self.runner.launch(plan)

    def launch_iter(self, plan: StepPlan, every: int) -> Generator[None, None, PendingStep]:
        """``launch`` in pieces: an eager forward pauses after every ``every`` layers
        (``ModelRunner.launch_iter``); returns the ``PendingStep``."""
        return self.runner.launch_iter(plan, every)

    def prefill_budget(self, now: float | None = None) -> int:
        """Prefill tokens for the next prefill step: ``max_num_batched_tokens``, or with
        ``prefill_step_target_s`` the most the cost model predicts to run within it, unless
        the oldest waiting prompt has waited past ``prefill_bound_lift`` of the TTFT budget.
        The bound needs measured step costs (start-up calibration, on a GPU): without them the
        budget is not bounded."""
        cfg = self.config.scheduler
        high = cfg.max_num_batched_tokens
        if cfg.prefill_step_target_s is None or not self.costs.measured:
            return high
        waiting = self.scheduler.waiting
        if waiting:
            now = time.monotonic() if now is None else now
            oldest = min(s.arrival_time for s in waiting)
            if now - oldest > cfg.prefill_bound_lift * cfg.ttft_budget_s:
                return high
        low = min(cfg.min_prefill_budget, high)
        return self.costs.prefill_tokens_within(cfg.prefill_step_target_s, low, high)

    def spec_stats(self) -> dict:
        """Speculation counters (benchmarks, debugging)."""
        drafter = self.spec.drafter
        return {
            "verifies": self.spec.num_verifies,
            "drafted": self.spec.num_drafted,
            "accepted": self.spec.num_accepted,
            "chain_drafts": self.chain_drafts,
            "chained_proposals": drafter.num_adopted if drafter is not None else 0,
        }

    def record_step(self, plan: StepPlan, seconds: float, contended: bool = False) -> None:
        """A landed step's time, for the metrics and the cost model (``contended``: prompt
        work was in flight beside it)."""
        self.observer.lane_step(plan.lane, seconds, plan.num_tokens)
        kind = step_cost_kind(plan)
        if kind is not None:
            self.costs.observe(kind, seconds, len(plan.seqs), plan.num_tokens, contended)

    def finish_step(self, plan: StepPlan, token_ids: list[list[int]]) -> list[RequestOutput]:
        return self.emit(self.apply_step(plan, token_ids))

    def apply_step(self, plan: StepPlan, token_ids: list[list[int]]) -> list[Sequence]:
        """Folds a landed step in: acceptance, each sequence's tokens and KV (EOS and length
        stops included). Returns the sequences that changed; what reaches the clients
        (detokenizing, stop strings, deltas) is ``emit``'s, which the lane dispatcher runs
        after launching the next step."""
        self._record_acceptance(plan, token_ids)
        changed = self.scheduler.update(plan, token_ids)
        fold_logprobs(plan)
        self.spec.confirm(plan, token_ids)
        return changed

    def emit(self, changed: list[Sequence]) -> list[RequestOutput]:
        outputs = self.outputs.process(changed)
        self.compiles.report(self.observer)
        self.observer.kv_cache(self.kv.usage, self.kv.num_free_blocks)
        self.observer.requests(self.scheduler.num_running, self.scheduler.num_waiting)
        return outputs

    def _release(self, seq: Sequence) -> None:
        """A finished sequence's drafter state, grammar and policy entry go."""
        self.spec.forget(seq)
        self.grammars.forget(seq.seq_id)
        self.listener.request_removed(seq)

    def _record_acceptance(self, plan: StepPlan, token_ids: list[list[int]]) -> None:
        for entry, new_ids in zip(plan.seqs, token_ids, strict=True):
            if entry.draft_token_ids and new_ids:
                num_accepted = self.spec.record(entry, new_ids)
                num_drafted = len(entry.draft_token_ids)
                self.listener.accepted(entry.seq, num_drafted, num_accepted)
                self.observer.spec_tokens(num_drafted, num_accepted)
            elif entry.draft_missed and new_ids:
                self.listener.no_drafts(entry.seq)
                self.observer.draft_missed()

    # ------------------------------------------------------------------ checks
    def check_integrity(self) -> None:
        self.kv.check_integrity(self.scheduler.live_tables())
