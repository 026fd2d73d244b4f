"""Engine core: model + KV pool + scheduler + runner + output processing, driven step by step.

``EngineCore.step()`` is the synchronous single-lane loop body (plan, execute, update). The
async front end and the lane dispatcher reuse the same pieces: ``plan_*`` on the scheduler,
``runner.launch``, ``apply_step`` and ``emit`` (``finish_step`` is both).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from verifypd.config import EngineConfig, ModelConfig
from verifypd.controller import (
    BatchCostModel,
    GoodputConfig,
    GoodputPolicy,
    LoadSignals,
    SeqView,
    build_policy,
)
from verifypd.costs import CostTable
from verifypd.engine.admission import RequestLimits, check_synthetic_acceptance
from verifypd.engine.calibrate import measure_costs
from verifypd.engine.cuda_graphs import warm_up_eager
from verifypd.engine.detokenizer import IncrementalDetokenizer, StopChecker, push_output
from verifypd.engine.grammar import GrammarCompiler, GrammarTable
from verifypd.engine.kv_sizing import KVSizing, draft_graph_headroom, kv_budget, size_kv
from verifypd.engine.loader import LoadedModel, load_model
from verifypd.engine.logprobs import attach_logprobs, check_num_logprobs, fold_logprobs
from verifypd.engine.runner import ModelRunner, PendingStep
from verifypd.engine.sampling_controls import resolve_bad_words
from verifypd.engine.scheduler import Scheduler
from verifypd.engine.speculative import DraftModelProposer, SpecDecoder
from verifypd.engine.timing import Span
from verifypd.kernels import get_ops
from verifypd.kvcache import KVCacheManager, KVPool
from verifypd.types import (
    Observer,
    ParamError,
    RequestOutput,
    SamplingParams,
    ScheduledSeq,
    SeqStatus,
    Sequence,
    StepPlan,
)

logger = logging.getLogger("verifypd")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


@dataclass
class SeqOutputState:
    """Per-sequence output bookkeeping: detokenizer, stop strings, what was emitted."""

    seq: Sequence
    detok: IncrementalDetokenizer
    stop: StopChecker
    num_emitted: int = 0
    pending_ids: list[int] = field(default_factory=list)
    is_done: bool = False  # its final delta was emitted


class EngineCore:
    """Owns one target model and everything needed to serve it."""

    def __init__(self, config: EngineConfig, observer: Observer | None = None) -> None:
        self.config = config
        self.observer = observer or Observer()
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        use_triton = config.use_triton if config.use_triton is not None else self._is_cuda
        self.ops = get_ops(use_triton, config.kernels)
        self.loaded: LoadedModel = load_model(
            config.model,
            self.device,
            self.dtype,
            self.ops,
            seed=config.seed,
            tokenizer=config.tokenizer,
        )
        self.model_config = self.loaded.config
        self.tokenizer = self.loaded.tokenizer
        self.model_name = self.loaded.name
        self.max_model_len = config.scheduler.max_model_len or (
            self.model_config.max_position_embeddings
        )
        self.block_size = config.cache.block_size
        self.use_cuda_graphs = (
            config.cuda_graphs if config.cuda_graphs is not None else self._is_cuda and use_triton
        )
        # The drafter's weights load before the pools are sized: both pools share one budget.
        draft = self._load_drafter()
        self.kv_sizing = self._size_kv(draft.config if draft is not None else None)
        self.pool = KVPool(
            self.model_config.num_layers,
            self.kv_sizing.num_blocks,
            self.block_size,
            self.model_config.num_kv_heads,
            self.model_config.head_dim,
            self.dtype,
            self.device,
        )
        self.kv = KVCacheManager(
            self.pool.num_blocks, self.block_size, config.cache.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            self.kv,
            max_num_seqs=config.scheduler.max_num_seqs,
            max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
            max_prefill_chunk=config.scheduler.max_prefill_chunk,
            max_model_len=self.max_model_len,
            eos_token_ids=self.eos_token_ids,
            observer=self.observer,
        )
        self.runner = ModelRunner(
            self.loaded.model,
            self.pool,
            self.block_size,
            self.device,
            synthetic_acceptance=config.spec.synthetic_acceptance,
            always_pad_verify=config.spec.always_pad_verify,
        )
        self.runner.logits_processor.eos_token_ids = frozenset(self.eos_token_ids)
        self.grammars = GrammarTable(
            GrammarCompiler(self.tokenizer, self.model_config.vocab_size, self.eos_token_ids)
        )
        self.runner.grammars = self.grammars
        self.spec = SpecDecoder(config.spec, self._drafter(draft))
        if self.use_cuda_graphs:
            self._capture_graphs()
        self.cost_table: CostTable | None = self._calibrate()
        # Step costs (shape from the start-up calibration when there is one, level learned
        # online) for the speculation policy and the prefill chunk bound.
        self.costs = BatchCostModel(self.cost_table)
        self.controller = build_policy(config.spec, self.costs, self._goodput_config())
        self.fused_verify = False  # the policy's last choice: verify inside the decode step
        chain = config.spec.chain_drafts
        self.chain_drafts = (self._is_cuda if chain is None else chain) and (
            self.spec.drafter is not None
        )
        self._draft_span: tuple[Span, int, int] | None = None  # a proposal not yet observed
        self.requests: dict[str, list[SeqOutputState]] = {}
        self.limits = RequestLimits(
            self.model_config.vocab_size,
            self.max_model_len,
            self.kv.num_blocks,
            self.block_size,
            config.scheduler.max_request_kv_share,
            config.spec.max_draft_len if self.spec.enabled else 0,
        )

    def _capture_graphs(self) -> None:
        if not self._is_cuda:
            raise ValueError("cuda_graphs needs device=cuda")
        logger.info(
            "capturing CUDA graphs (batch sizes up to %d)", self.config.scheduler.max_num_seqs
        )
        max_batch = self.config.scheduler.max_num_seqs
        warm_up_eager(self.loaded.model, self.pool.kv, self.block_size, self.max_model_len)
        if self.spec.drafter is not None:
            drafter = self.spec.drafter
            warm_up_eager(
                drafter.runner.model, drafter.pool.kv, self.block_size, self.max_model_len
            )
        self.runner.capture_graphs(1, max_batch, self.max_model_len)
        if not self.spec.enabled:
            return
        verify_batch = min(max_batch, 64)  # larger verify batches are compute-bound: eager
        for draft_len in range(1, self.config.spec.max_draft_len + 1):
            self.runner.capture_graphs(1 + draft_len, verify_batch, self.max_model_len)
        drafter = self.spec.drafter
        if drafter is not None:
            drafter.runner.capture_graphs(1, max_batch, self.max_model_len)
            drafter.runner.capture_graphs(2, max_batch, self.max_model_len)
            drafter.warm_up_chain()

    def _calibrate(self) -> CostTable | None:
        """Step costs measured after graph capture (``engine.calibrate``), or None when off."""
        on = self.config.calibrate_costs
        if on is None:
            on = self._is_cuda and self.spec.enabled
        if not on:
            return None
        try:
            table = measure_costs(self)
        except Exception:  # the policy falls back to its prior shape; serving goes on
            logger.exception("step-cost calibration failed; the policy learns costs online")
            return None
        logger.info("%s (calibrated in %.2f s)", table.summary(), table.meta["seconds"])
        return table

    def _goodput_config(self) -> GoodputConfig:
        """The goodput policy's limits from the engine's: no speculation for more rows than the
        verify graphs hold (an eager verify of a large batch costs more than it yields), and
        none while a prompt has waited half its TTFT budget for its prefill."""
        graphs = self.use_cuda_graphs and self.spec.enabled
        return GoodputConfig(
            prefill_wait_guard_s=self.config.scheduler.ttft_budget_s / 2,
            max_spec_rows=min(self.config.scheduler.max_num_seqs, 64) if graphs else None,
            padded_fused=graphs,
        )

    def _load_drafter(self) -> LoadedModel | None:
        spec = self.config.spec
        if spec.method != "draft":
            return None
        draft = load_model(
            spec.draft_model, self.device, self.dtype, self.ops, seed=self.config.seed
        )
        if draft.config.vocab_size > self.model_config.vocab_size:
            raise ValueError(
                f"draft model vocab ({draft.config.vocab_size}) is larger than the target's "
                f"({self.model_config.vocab_size}): they must share a tokenizer"
            )
        return draft

    def _drafter(self, draft: LoadedModel | None) -> DraftModelProposer | None:
        """The drafter over its own pool of as many blocks as the target's (sized together)."""
        if draft is None:
            return None
        return DraftModelProposer(
            draft, self.pool.num_blocks, self.block_size, self.device, self.dtype
        )

    @property
    def _is_cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def eos_token_ids(self) -> set[int]:
        ids = set(self.model_config.eos_token_ids)
        tok_eos = getattr(self.tokenizer, "eos_token_id", None)
        if tok_eos is not None:
            ids.add(tok_eos)
        return ids

    def _size_kv(self, draft: ModelConfig | None) -> KVSizing:
        """Both pools' block count (``engine.kv_sizing``); logged with the split."""
        cfg = self.config.cache
        # Never more than every running sequence at full length could use.
        max_seqs = self.config.scheduler.max_num_seqs
        cap = max_seqs * (self.max_model_len // self.block_size + 1)
        budget = None
        if cfg.num_blocks is None:
            draft_headroom = 0
            if draft is not None and self.use_cuda_graphs:
                draft_headroom = draft_graph_headroom(draft, max_seqs, self.dtype)
            budget = kv_budget(self.device, cfg, draft_headroom)
        sizing = size_kv(
            self.model_config, draft, self.block_size, self.dtype, budget, cap, cfg.num_blocks
        )
        logger.info(sizing.describe())
        return sizing

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
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> list[Sequence]:
        if request_id in self.requests:
            raise ParamError(None, f"duplicate request id {request_id!r}")
        self.validate(prompt_token_ids, params)
        resolve_bad_words(params, self.tokenizer)
        grammar = self.grammars.compile(params.structured)  # ParamError when it is invalid
        now = time.monotonic()
        states = []
        for i in range(params.n):
            seq = Sequence(request_id, prompt_token_ids, params, index=i, arrival_time=now)
            if grammar is not None:
                self.grammars.add(seq, grammar)
            detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids)
            stop = StopChecker(params.stop, params.include_stop_str_in_output)
            states.append(SeqOutputState(seq, detok, stop))
            self.scheduler.add(seq)
            if self.spec.enabled:
                self.controller.add_request(
                    seq.seq_id, params.is_greedy, params.temperature, params.speculate
                )
        self.requests[request_id] = states
        return [s.seq for s in states]

    def abort_request(self, request_id: str, reason: str = "abort") -> list[RequestOutput]:
        """Ends every choice of a request whose last delta is still due, with ``reason``
        ("abort", or "error" for a failure); frees blocks now (or when its step lands)."""
        states = self.requests.pop(request_id, [])
        outputs = []
        for st in states:
            if not st.is_done:
                self._end(st, reason)
                outputs.append(self._delta(st, "", finished=True))
                self._report_finished(st.seq)
            self.spec.forget(st.seq)
            self.grammars.forget(st.seq.seq_id)
            self.controller.remove_request(st.seq.seq_id)
        return outputs

    def _end(self, st: SeqOutputState, reason: str) -> None:
        st.is_done = True
        if not st.seq.status.is_finished:
            self.scheduler.finish(st.seq, reason)
        st.seq.finish_reason = reason  # a finish whose delta was never sent is lost as well

    def has_unfinished(self) -> bool:
        return bool(self.requests) or self.scheduler.has_work()

    # ------------------------------------------------------------------ stepping
    def step(self) -> list[RequestOutput]:
        """One single-lane step: plan (decodes with drafts, verifies and prefill chunks fused
        in one batch), execute, fold back, emit deltas."""
        plan = self.plan_mixed()
        if plan is None:
            return []
        self.scheduler.begin_step(plan)
        start = time.perf_counter()
        pending = self.launch(plan)
        token_ids = pending.result()
        self.record_step(plan, pending.seconds(time.perf_counter() - start))
        return self.finish_step(plan, token_ids)

    def launch(self, plan: StepPlan) -> PendingStep:
        """Enqueues a step; behind a verify, the next round's drafting too (``chain_after``);
        behind prompt chunks, the drafter's catch-up on them (``follow_prefill``)."""
        pending = self.runner.launch(plan)
        self.chain_after(plan, pending)
        self.follow_prefill(plan)
        return pending

    def follow_prefill(self, plan: StepPlan) -> None:
        """The drafter computes its KV of the prompt chunks in ``plan`` (on the same stream,
        behind them) for the requests the policy expects to speculate for; the others' drafter
        catches up only if the policy drafts for them later. Host state: on the loop thread."""
        drafter = self.spec.drafter
        expects = getattr(self.controller, "expects_speculation", None)
        if drafter is None or expects is None or not self.config.spec.follow_prefill:
            return
        items = [
            (e.seq, e.seq.num_computed_tokens + e.num_new_tokens)
            for e in plan.seqs
            if e.seq.status is SeqStatus.PREFILLING and expects(e.seq.seq_id)
        ]
        if items:
            try:
                drafter.follow(items)
            except Exception:  # an optimization: the drafter catches up when it drafts
                logger.exception("drafter catch-up behind a prefill failed")

    def chain_after(self, plan: StepPlan, pending: PendingStep) -> None:
        """Drafts the next round behind a launched verify (``chain_drafts``), timed on the GPU
        for the controller like a proposal. It touches the drafter's block allocator and the
        controller, so it runs on the event-loop thread (on CPU the step itself runs in a
        worker thread; there the chain follows it on the loop)."""
        if self.chain_drafts and pending.verified is not None and self._gap_is_idle(plan):
            try:
                self._chain(plan, pending)
            except Exception:  # an optimization: the step itself was launched and stands
                logger.exception("chained drafting failed; turned off")
                self.chain_drafts = False
                self.spec.drafter.chained = None

    def _chain(self, plan: StepPlan, pending: PendingStep) -> None:
        self._observe_draft_cost()
        span = Span(self._is_cuda)
        rows = self.spec.chain(plan, pending.verified, self.max_model_len)
        chained = self.spec.drafter.chained
        if rows and chained is not None:
            self._draft_span = (span.stop(), rows, rows * chained.num_drafts)

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

    def _gap_is_idle(self, verify: StepPlan) -> bool:
        """Chaining fills the GPU's gap between a verify and the next round's drafting, which
        otherwise waits for the host. Where other work is queued (a prompt waiting for its
        prefill, sequences outside this verify) that gap is not idle, and a chain would take
        GPU time from that work: chain only when this verify holds every running sequence
        and no request waits."""
        if self.scheduler.num_waiting:
            return False
        in_plan = {id(e.seq) for e in verify.seqs}
        return all(id(s) in in_plan for s in self.scheduler.running)

    def draft_lens(self) -> dict[int, int]:
        """Asks the policy for each live request's L and stores it on the sequence."""
        if not self.spec.enabled:
            return {}
        if isinstance(self.controller, GoodputPolicy):
            decisions = self._decide_batch()
        else:
            decisions = self.controller.step()
            self.fused_verify = False
        running = self.scheduler.running
        for seq in running:
            seq.draft_len = decisions.get(seq.seq_id, 0)
        # Every decoding seq reserves slots for the longest L, so a verify batch (and the
        # plain rows of a decode step fused with it) can be padded to one uniform length and
        # replay a CUDA graph.
        spec = [s for s in running if s.draft_len and self.spec.wants(s)]
        longest = max((s.draft_len for s in spec), default=0)
        # One observation per step (not per sequence: at batch 24 that was ~0.1 ms of host
        # time a step, paid with speculation off too).
        self.observer.draft_length(longest)
        if not longest:
            return {}
        decoding = [s for s in self.scheduler.running if s.status is SeqStatus.DECODING]
        return {s.seq_id: longest for s in decoding}

    def _decide_batch(self) -> dict[int, int]:
        """The goodput policy's decision for this step's decode batch."""
        drafter = self.spec.drafter
        views = []
        for seq in self.scheduler.decodable():
            view = drafter.views.get(seq.seq_id) if drafter is not None else None
            behind = seq.num_tokens - view.num_computed_tokens if view else seq.num_tokens
            left = seq.params.max_tokens - seq.num_output_tokens
            views.append(SeqView(seq.seq_id, behind if drafter is not None else 1, left))
        waiting = self.scheduler.waiting
        wait = time.monotonic() - min(s.arrival_time for s in waiting) if waiting else None
        decision = self.controller.decide(views, LoadSignals(prefill_wait_s=wait))
        self.fused_verify = decision.fused
        self.observer.spec_decision(decision.reason, decision.fused, decision.draft_len)
        return decision.draft_lens

    def prefill_budget(self) -> int:
        """Prefill tokens for the next prefill step: ``max_num_batched_tokens``, or with
        ``prefill_step_target_s`` the most the cost model predicts to run within it."""
        cfg = self.config.scheduler
        high = cfg.max_num_batched_tokens
        if cfg.prefill_step_target_s is None:
            return high
        low = min(cfg.min_prefill_budget, high)
        return self.costs.prefill_tokens_within(cfg.prefill_step_target_s, low, high)

    def drafter_temps(self) -> dict[int, float]:
        temps = {
            s.seq_id: self.controller.drafter_temperature(s.seq_id)
            for s in self.scheduler.running
            if self.spec.wants(s)
        }
        if temps:  # exported as the mean over the speculating requests
            self.observer.drafter_temperature(sum(temps.values()) / len(temps))
        return temps

    def plan_mixed(self) -> StepPlan | None:
        plan = self.scheduler.schedule_mixed(self.draft_lens())
        if plan is not None and self.spec.enabled:
            decodes = [e for e in plan.seqs if e.seq.status is SeqStatus.DECODING]
            self.propose(decodes)
        return plan

    def propose(self, entries: list[ScheduledSeq]) -> None:
        """Drafts for the speculating entries; the controller learns the drafting cost (per
        drafted token) from steady proposals, as it learns decode and verify costs from steps.
        A draft model's proposal is timed on the GPU (it runs there after ``propose`` returns,
        and is observed once it has run); n-gram lookups by wall time. A proposal whose
        drafter first caught up on a whole prompt is left out: that one-off prefill would make
        drafting look several times dearer than it is."""
        self._observe_draft_cost()
        span = Span(self._is_cuda and self.spec.drafter is not None)
        self.spec.propose(entries, self.drafter_temps())
        drafted = self.spec.fresh_drafts(entries)
        if drafted and self.spec.last_proposal_was_steady:
            self._draft_span = (span.stop(), len(drafted), sum(drafted))
        self._observe_draft_cost()

    def _observe_draft_cost(self) -> None:
        if self._draft_span is None:
            return
        span, num_seqs, num_drafted = self._draft_span
        seconds = span.seconds()
        if seconds is not None:
            self._draft_span = None
            self.controller.observe_step("draft", seconds, num_seqs, num_drafted)
            steps = max(1, round(num_drafted / num_seqs))  # one proposal: L drafter steps
            self.costs.observe("draft", seconds / steps, num_seqs, num_seqs)

    def record_step(self, plan: StepPlan, seconds: float) -> None:
        self.observer.lane_step(plan.lane, seconds, plan.num_tokens)
        kind = _cost_kind(plan)
        if kind is not None:
            self.costs.observe(kind, seconds, len(plan.seqs), plan.num_tokens)
        if self.spec.enabled:
            self.controller.observe_step(plan.lane, seconds, len(plan.seqs), plan.num_tokens)

    def finish_step(self, plan: StepPlan, token_ids: list[list[int]]) -> list[RequestOutput]:
        return self.emit(self.apply_step(plan, token_ids))

    def apply_step(self, plan: StepPlan, token_ids: list[list[int]]) -> list[Sequence]:
        """Folds a landed step in: draft costs, acceptance, each sequence's tokens and KV (EOS
        and length stops included). Returns the sequences that changed; what reaches the
        clients (detokenizing, stop strings, deltas) is ``emit``'s, which the lane dispatcher
        runs after launching the next step."""
        self._observe_draft_cost()
        self._record_acceptance(plan, token_ids)
        changed = self.scheduler.update(plan, token_ids)
        fold_logprobs(plan)
        self.spec.confirm(plan, token_ids)
        return changed

    def emit(self, changed: list[Sequence]) -> list[RequestOutput]:
        outputs = [out for seq in changed for out in self._process_isolated(seq)]
        self.observer.kv_cache(self.kv.usage, self.kv.num_free_blocks)
        self.observer.requests(self.scheduler.num_running, self.scheduler.num_waiting)
        return outputs

    def _record_acceptance(self, plan: StepPlan, token_ids: list[list[int]]) -> None:
        for entry, new_ids in zip(plan.seqs, token_ids, strict=True):
            if entry.draft_token_ids and new_ids:
                num_accepted = self.spec.record(entry, new_ids)
                num_drafted = len(entry.draft_token_ids)
                self.controller.observe_acceptance(entry.seq.seq_id, num_drafted, num_accepted)
                self.observer.spec_tokens(num_drafted, num_accepted)

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
            return self.abort_request(seq.request_id, "error")
        return [] if out is None else [out]

    def _process(self, seq: Sequence) -> RequestOutput | None:
        st = self._state(seq)
        if st is None:
            return None
        first = st.num_emitted
        new_ids = seq.output_token_ids[first:]
        st.num_emitted = seq.num_output_tokens
        self._report_tokens(seq, len(new_ids))
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

    def _delta(self, st, text: str, finished: bool, new_ids: list[int] | None = None):
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
        self.spec.forget(seq)
        self.grammars.forget(seq.seq_id)
        self.controller.remove_request(seq.seq_id)
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

    # ------------------------------------------------------------------ checks
    def check_integrity(self) -> None:
        self.kv.check_integrity(self.scheduler.live_tables())


def _cost_kind(plan: StepPlan) -> str | None:
    """The cost model's kind of a landed step: prefill, decode (one token a row), verify (the
    same 1 + L a row) or mixed (rows of different lengths, no prompt chunk); None for a fused
    single-lane step carrying prompt chunks (its time says little about either)."""
    if plan.lane == "prefill":
        return "prefill"
    widths = set()
    for e in plan.seqs:
        if e.seq.status is SeqStatus.PREFILLING:
            return None
        widths.add(len(e.draft_token_ids))
    if len(widths) > 1:
        return "mixed"
    return "verify" if widths and widths != {0} else "decode"
