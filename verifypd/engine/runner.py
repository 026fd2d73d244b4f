"""Model runner: turns a ``StepPlan`` into tensors, runs the forward, samples.

Execution only: it never decides admission. One host sync per step, at the very end, when the
sampled ids come back through a pinned buffer (``PendingStep.result``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Generator
from dataclasses import dataclass

import torch

from verifypd.engine.cuda_graphs import StepGraphs
from verifypd.engine.device_drafts import device_ids, drafter_probs
from verifypd.engine.grammar import GrammarTable, apply_token_bitmask, fill_step_masks, read_drafts
from verifypd.engine.logits_pipeline import LogitsProcessor
from verifypd.engine.logprobs import PromptScoring, StepLogprobs, any_asks_logprobs
from verifypd.engine.model import DecoderLM, drain
from verifypd.engine.rejection import (
    emit_accepted,
    greedy_accept,
    rejection_sample,
    synthetic_num_accepted,
)
from verifypd.engine.sampler import SamplingTensors, processed_probs, sample
from verifypd.engine.step_inputs import StepInputBuilder, StepInputs
from verifypd.engine.timing import Span
from verifypd.kvcache import KVPool
from verifypd.types import RequestFailure, ScheduledSeq, StepPlan


@dataclass
class VerifyOutputs:
    """What a launched verify leaves on the device, for drafting the next round behind it
    before the host has seen it: row ``k`` is ``plan.seqs[seqs[k]]``."""

    seqs: list[int]  # plan indices of the verified seqs
    input_ids: torch.Tensor  # [T] the verify's input ids (drafts copied in)
    first_rows: list[int]  # per seq: its row of ``input_ids`` holding its last known token
    out: torch.Tensor  # [B, 1 + L] accepted drafts, then the final token
    num_accepted: torch.Tensor  # [B] int64


@dataclass(frozen=True)
class ResultSlot:
    """Where one plan entry's tokens sit in a step's packed result (flat int64 ``[N]``).

    - no token (a prompt chunk short of the prompt's end): ``start == -1``;
    - one sampled token: ``packed[start]`` (``accepted_at == -1``);
    - a verify of L drafts: ``packed[start : start + 1 + L]`` holds the accepted drafts, then
      the final token; ``packed[accepted_at]`` says how many drafts were accepted, so the
      entry's tokens are ``packed[start : start + packed[accepted_at] + 1]``.
    """

    start: int = -1
    accepted_at: int = -1

    def tokens(self, flat: list[int]) -> list[int]:
        if self.start < 0:
            return []
        if self.accepted_at < 0:
            return [flat[self.start]]
        return flat[self.start : self.start + flat[self.accepted_at] + 1]


NO_TOKEN = ResultSlot()


class PendingStep:
    """A launched step. ``done()`` polls without blocking; ``result()`` returns token ids."""

    def __init__(
        self,
        plan: StepPlan,
        packed: torch.Tensor | None,
        layout: list[ResultSlot],
        event=None,
    ):
        self.plan = plan
        self._packed = packed  # host tensor (pinned on CUDA) filled by a non-blocking copy
        self._layout = layout  # one slot per plan entry
        self._event = event
        self.span: Span | None = None  # from when its drafts were ready (device drafts only)
        self.verified: VerifyOutputs | None = None  # a verify's results, still on the device
        self.logprobs: StepLogprobs | None = None  # log-probs riding in the same buffer
        # The packed result on the device (before its copy to the host): a decode step planned
        # ahead of this one reads its input tokens there (``sampled_at``).
        self.device_ids: torch.Tensor | None = None

    def seconds(self, wall: float) -> float:
        """The step's own duration: with drafts still being made on the GPU when it was
        launched, its GPU time after them (its launch-to-done ``wall`` time holds the drafting
        too); else ``wall``."""
        measured = self.span.seconds() if self.span is not None else None
        return wall if measured is None else measured

    def done(self) -> bool:
        return self._event is None or self._event.query()

    def sampled_at(self, i: int) -> int:
        """Where plan entry ``i``'s one sampled token sits in ``device_ids``; -1 when it has
        none or more than one (a prompt chunk short of its end, a verify)."""
        slot = self._layout[i]
        return slot.start if slot.accepted_at < 0 and self.device_ids is not None else -1

    def result(self) -> list[list[int]]:
        if self._event is not None:
            self._event.synchronize()
        flat = self._packed.tolist() if self._packed is not None else []
        out = [slot.tokens(flat) for slot in self._layout]
        if self.logprobs is not None:
            self.logprobs.unpack(self._packed, self.plan, out)
        return out


class ModelRunner:
    """Executes plans for one model over its KV pool."""

    def __init__(
        self,
        model: DecoderLM,
        pool: KVPool,
        block_size: int,
        device: torch.device,
        *,
        synthetic_acceptance: float | None = None,
        always_pad_verify: bool = False,
        prompt_token_bucket: int = 0,
    ) -> None:
        self.model = model
        self.pool = pool
        self.block_size = block_size
        self.device = device
        self.is_cuda = device.type == "cuda"
        # Benchmark only (DESIGN.md): accepted counts drawn from a truncated geometric
        # (``SpecConfig.synthetic_acceptance``).
        self.synthetic_acceptance = synthetic_acceptance
        # Plans into tensors; it holds the captured graphs (query length -> graphs, GPU only).
        self.inputs = StepInputBuilder(
            block_size, device, {}, always_pad_verify, prompt_token_bucket
        )
        self.num_graph_steps = 0
        self.num_eager_steps = 0
        self.eager_shapes: Counter[tuple[int, int]] = Counter()  # (num seqs, max query len)
        # Penalties, biases, bans between the logits and the sampler (the engine sets EOS).
        self.logits_processor = LogitsProcessor(device)
        self.grammars: GrammarTable | None = None  # structured output (engine.grammar)

    def capture_graphs(
        self, query_len: int, max_batch: int, max_len: int, with_logits: bool = True
    ) -> None:
        """Captures uniform steps of ``query_len`` tokens per sequence (1 = decode);
        ``with_logits`` False: graphs that compute no logits (a step's rows get theirs from
        its hidden states, outside the graph)."""
        self.graphs[query_len] = self.new_graphs(query_len, max_batch, max_len, with_logits)

    def new_graphs(
        self, query_len: int, max_batch: int, max_len: int, with_logits: bool = True
    ) -> StepGraphs:
        """Captured steps as ``capture_graphs``, with static buffers and a memory pool of their
        own, not in the runner's table: for a stream that replays them beside the runner's
        (``logits(graphs=...)``)."""
        graphs = StepGraphs(
            self.model, self.pool.kv, self.block_size, max_batch, max_len, query_len, with_logits
        )
        graphs.capture()
        return graphs

    @property
    def graphs(self) -> dict[int, StepGraphs]:
        """Query length -> captured graphs (GPU only)."""
        return self.inputs.graphs

    @graphs.setter
    def graphs(self, graphs: dict[int, StepGraphs]) -> None:
        self.inputs.graphs = graphs

    # ------------------------------------------------------------------ inputs
    def prepare(self, plan: StepPlan) -> StepInputs:
        return self.inputs.prepare(plan)

    def _to_device(self, data, dtype: torch.dtype) -> torch.Tensor:
        return self.inputs.to_device(data, dtype)

    # ------------------------------------------------------------------ execution
    @torch.inference_mode()
    def forward(self, inputs: StepInputs, rows: list[int]) -> torch.Tensor:
        """Runs the model over all query tokens; returns fp32 logits of ``rows`` only."""
        return drain(self.forward_iter(inputs, rows))

    @torch.inference_mode()
    def forward_iter(
        self, inputs: StepInputs, rows: list[int], every: int = 0
    ) -> Generator[None, None, torch.Tensor]:
        """``forward``, pausing after every ``every`` layers (``DecoderLM.forward_iter``)."""
        hidden = yield from self.model.forward_iter(
            inputs.input_ids, inputs.positions, self.pool.kv, inputs.meta, every
        )
        if not rows:
            return hidden.new_empty((0, 0), dtype=torch.float32)
        index = self._to_device(rows, torch.int64)
        return self.model.compute_logits(hidden.index_select(0, index))

    def launch(self, plan: StepPlan) -> PendingStep:
        """Enqueues the whole step; the only host sync happens in ``PendingStep.result``."""
        return drain(self.launch_iter(plan))

    @torch.inference_mode()
    def launch_iter(self, plan: StepPlan, every: int = 0) -> Generator[None, None, PendingStep]:
        """``launch`` as a generator: an eager forward pauses after every ``every`` layers
        (0: never), so the caller can do other work between the pieces of a long step (each
        piece is enqueued in full before the pause). Returns the ``PendingStep``."""
        deferred = any(device_ids(s) is not None for s in plan.seqs)
        span = Span(self.is_cuda) if deferred else None  # the GPU reaches it after the drafts
        inputs = self.prepare(plan)
        drafts = read_drafts(self.grammars, plan.seqs)  # before the forward is enqueued
        verify_flat = [r for rows in inputs.verify_rows for r in rows]
        logits, logprobs = yield from self._logits_and_logprobs(plan, inputs, verify_flat, every)
        logits = self.process_logits(plan, inputs, logits, drafts)  # grammar masks, draft cuts
        pieces: list[torch.Tensor] = []
        layout = [NO_TOKEN] * len(plan.seqs)
        n_plain = len(inputs.sample_rows)
        if n_plain:
            seqs = [plan.seqs[i].seq for i in inputs.sample_seqs]
            plain = self.logits_processor.process(logits[:n_plain], seqs)
            if all(s.params.is_greedy for s in seqs):  # no sampling tensors to upload
                pieces.append(plain.argmax(dim=-1))
            else:
                positions = [plan.seqs[i].sample_position for i in inputs.sample_seqs]
                t = self._sampling_tensors(seqs, positions)
                pieces.append(sample(plain, t))
            for j, i in enumerate(inputs.sample_seqs):
                layout[i] = ResultSlot(j)
        if inputs.verify_seqs:
            out, acc = self._verify(plan, inputs, logits[n_plain:])
            first_rows = [rows[0] for rows in inputs.verify_rows]
            verified = VerifyOutputs(inputs.verify_seqs, inputs.input_ids, first_rows, out, acc)
            width = out.shape[1]
            base = n_plain
            acc_base = base + out.numel()
            pieces += [out.flatten(), acc]
            for k, i in enumerate(inputs.verify_seqs):
                layout[i] = ResultSlot(base + k * width, acc_base + k)
        if logprobs is not None:  # after the ids: the layout's offsets stay as they are
            logprobs.offset = sum(p.numel() for p in pieces)
            sampled = pieces[0] if n_plain else None
            pieces += logprobs.finish(sampled, verified.out if inputs.verify_seqs else None)
        pending = self._pack(plan, pieces, layout)
        pending.logprobs = logprobs
        pending.span = span.stop() if span is not None else None
        if inputs.verify_seqs:
            pending.verified = verified
        return pending

    def _logits_and_logprobs(
        self, plan: StepPlan, inputs: StepInputs, verify_flat: list[int], every: int
    ) -> Generator[None, None, tuple[torch.Tensor, StepLogprobs | None]]:
        """The sampling rows' logits and, for the entries that ask, their log-probs (taken
        here, before any sampling-time change to the logits). Prompt rows scored for
        ``prompt_logprobs`` are computed after the sampling rows, in an eager forward."""
        rows = inputs.sample_rows + verify_flat
        if not any_asks_logprobs(plan):  # the common case: one pass over the plan, no work
            return (yield from self.logits_iter(inputs, rows, every)), None
        prompt = PromptScoring.build(plan, inputs.meta.query_lens_cpu)
        if prompt.rows:
            self.num_eager_steps += 1
            logits = yield from self.forward_iter(inputs, rows + prompt.rows, every)
        else:
            logits = yield from self.logits_iter(inputs, rows, every)
        groups = (inputs.sample_seqs, inputs.verify_seqs, [len(r) for r in inputs.verify_rows])
        logprobs = StepLogprobs.start(plan, logits, groups, prompt, self._to_device)
        return logits[: len(rows)], logprobs

    def logits(
        self, inputs: StepInputs, rows: list[int], graphs: dict[int, StepGraphs] | None = None
    ) -> torch.Tensor:
        """fp32 logits of ``rows`` (ascending): a graph replay when the step is uniform (every
        sequence feeds the same q tokens) and a graph for q was captured (in ``graphs``,
        default the runner's), else eager."""
        return drain(self.logits_iter(inputs, rows, graphs=graphs))

    def logits_iter(
        self,
        inputs: StepInputs,
        rows: list[int],
        every: int = 0,
        graphs: dict[int, StepGraphs] | None = None,
    ) -> Generator[None, None, torch.Tensor]:
        """``logits``; an eager forward pauses after every ``every`` layers."""
        graphs = (self.graphs if graphs is None else graphs).get(inputs.meta.max_query_len)
        num_seqs = inputs.meta.num_seqs
        if graphs is None or not graphs.can_run(inputs.meta, num_seqs):
            self.num_eager_steps += 1
            self.eager_shapes[(num_seqs, inputs.meta.max_query_len)] += 1
            return (yield from self.forward_iter(inputs, rows, every))
        self.num_graph_steps += 1
        full = graphs.run(inputs.input_ids, inputs.positions, inputs.meta)  # [B * q, V or H]
        if not graphs.with_logits:  # hidden states: the rows' logits outside the graph
            if not rows:
                return full[:0]
            index = self._to_device(rows, torch.int64)
            return self.model.compute_logits(full.index_select(0, index))
        if len(rows) == full.shape[0]:
            return full  # rows are always in order: the plan's seqs, then their positions
        return full.index_select(0, self._to_device(rows, torch.int64))

    def process_logits(
        self, plan: StepPlan, inputs: StepInputs, logits: torch.Tensor, drafts: dict
    ) -> torch.Tensor:
        """The logits processors, in order, over the step's sampled rows (plain rows, then each
        verify's 1 + L rows), after the forward is enqueued so their host work overlaps it:
        the grammar mask (structured output) comes last, so nothing after it can give a
        disallowed token probability again."""
        if self.grammars is not None:
            logits = self._grammar_mask(plan, inputs, logits, drafts)
        return logits

    def _grammar_mask(self, plan, inputs: StepInputs, logits: torch.Tensor, drafts: dict):
        rows = [(plan.seqs[i], 1) for i in inputs.sample_seqs]
        rows += [(plan.seqs[i], len(r)) for i, r in zip(inputs.verify_seqs, inputs.verify_rows,
                                                        strict=True)]  # fmt: skip
        bitmask = fill_step_masks(self.grammars, rows, drafts)
        if bitmask is None:
            return logits
        return apply_token_bitmask(logits, self._to_device(bitmask.numpy(), torch.int32))

    def _pack(
        self, plan: StepPlan, pieces: list[torch.Tensor], layout: list[ResultSlot]
    ) -> PendingStep:
        if not pieces:
            return PendingStep(plan, None, layout)
        packed = torch.cat([p.to(torch.int64) for p in pieces])
        if not self.is_cuda:
            pending = PendingStep(plan, packed, layout)
        else:
            host = torch.empty(packed.shape, dtype=torch.int64, pin_memory=True)
            host.copy_(packed, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            pending = PendingStep(plan, host, layout, event)
        pending.device_ids = packed
        return pending

    def execute(self, plan: StepPlan) -> list[list[int]]:
        """Synchronous convenience: launch and wait."""
        return self.launch(plan).result()

    def _sampling_tensors(self, seqs, positions: list[int]) -> SamplingTensors:
        """The step's sampling tensors. When they cannot be built, the rows that fail alone
        (on the host) name the requests at fault (``RequestFailure``); none: the step's."""
        try:
            return _build_sampling(seqs, positions, self.device)
        except Exception as exc:
            bad = {s.request_id for s, p in zip(seqs, positions, strict=True) if _fails(s, p)}
            if not bad:
                raise
            raise RequestFailure(bad, exc) from exc

    def _verify(self, plan: StepPlan, inputs: StepInputs, logits: torch.Tensor):
        """Verifies each seq's L drafts against its 1 + L target distributions: argmax match
        for all-greedy batches, rejection sampling otherwise, synthetic in benchmarks."""
        scheds = [plan.seqs[i] for i in inputs.verify_seqs]
        seqs = [s.seq for s in scheds]
        num_drafts = [len(s.draft_token_ids) for s in scheds]
        num_rows = [len(r) - 1 for r in inputs.verify_rows]  # L, or the padded width
        width = max(num_rows)
        rows = self._verify_rows(logits, num_rows, width)  # [B, L + 1, V]
        b = len(scheds)
        # Each draft is read back from its row of the input ids (where it may have been
        # copied on the device); rows past a seq's L repeat its first row (masked by L).
        draft_rows = [r[1 + min(j, n - 1)] if n else r[0]
                      for r, n in zip(inputs.verify_rows, num_rows, strict=True)
                      for j in range(width)]  # fmt: skip
        seeds_host, positions_host = [s.seed for s in seqs], [s.num_tokens for s in seqs]
        synthetic = []  # benchmark only: accepted counts drawn on the host
        if self.synthetic_acceptance is not None:
            synthetic = synthetic_num_accepted(
                self._synthetic_alphas(seqs), num_drafts, seeds_host, positions_host
            )
        small = self._to_device(  # one upload: draft rows [B * L], then [B] vectors
            draft_rows + num_drafts + seeds_host + positions_host + synthetic, torch.int64
        )
        drafts = inputs.input_ids[small[: b * width]].view(b, width)
        num_drafts_t, seeds, positions = small[b * width : b * width + 3 * b].view(3, b)
        rows = self.logits_processor.process(rows, seqs, drafts, num_drafts_t)
        if synthetic:  # real forwards; keep k drafts and the target's most likely token after
            k = small[b * width + 3 * b :]
            final = rows.argmax(-1).gather(1, k[:, None]).squeeze(1)
            return emit_accepted(drafts, k, final), k
        if all(s.params.is_greedy for s in seqs):
            return greedy_accept(rows.argmax(-1), drafts, num_drafts_t)
        rep = [s for s in seqs for _ in range(width + 1)]  # each position: its seq's settings
        pos = [s.num_tokens + j for s in seqs for j in range(width + 1)]
        t = self._sampling_tensors(rep, pos)
        target = processed_probs(rows.view(-1, rows.shape[-1]), t).view(rows.shape)
        draft_probs = self._draft_probs(scheds, width, target, drafts)
        return rejection_sample(target, draft_probs, drafts, num_drafts_t, seeds, positions)

    def _synthetic_alphas(self, seqs) -> list[float]:
        """Each row's synthetic alpha: its request's own, else the engine's global one."""
        alpha = self.synthetic_acceptance
        return [a if (a := s.params.synthetic_acceptance) is not None else alpha for s in seqs]

    @staticmethod
    def _verify_rows(logits: torch.Tensor, num_drafts: list[int], width: int) -> torch.Tensor:
        """[sum(1 + L_b), V] -> [B, 1 + L, V]; a view when every seq has L drafts."""
        if all(n == width for n in num_drafts):
            return logits.view(len(num_drafts), width + 1, -1)
        rows = logits.new_zeros(len(num_drafts), width + 1, logits.shape[-1])
        off = 0
        for k, n in enumerate(num_drafts):
            rows[k, : n + 1] = logits[off : off + n + 1]
            off += n + 1
        return rows

    def _draft_probs(
        self, scheds: list[ScheduledSeq], width: int, target: torch.Tensor, drafts: torch.Tensor
    ):
        """Drafter distributions q [B, L, V], or None for deterministic proposers (n-gram);
        a deterministic draft in a mixed batch is one-hot at its id (``drafts`` [B, L])."""
        probs = [drafter_probs(s) for s in scheds]
        if all(p is None for p in probs):
            return None
        vocab = target.shape[-1]
        out = torch.zeros(len(scheds), width, vocab, device=target.device)
        for k, (s, p) in enumerate(zip(scheds, probs, strict=True)):
            n = len(s.draft_token_ids)
            if p is None:
                out[k, :n].scatter_(1, drafts[k, :n, None], 1.0)
            else:
                out[k, :n, : p.shape[-1]] = p[:n]  # a smaller drafter vocab pads with 0
        return out


def _build_sampling(seqs, positions: list[int], device) -> SamplingTensors:
    return SamplingTensors.build(
        temperature=[s.params.temperature for s in seqs],
        top_k=[s.params.top_k for s in seqs],
        top_p=[s.params.top_p for s in seqs],
        seeds=[s.seed for s in seqs],
        positions=positions,
        device=device,
    )


def _fails(seq, position: int) -> bool:
    try:
        _build_sampling([seq], [position], "cpu")
    except Exception:
        return True
    return False
