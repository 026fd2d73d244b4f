"""Model runner: turns a ``StepPlan`` into tensors, runs the forward, samples.

Execution only: it never decides admission. One host sync per step, at the very end, when the
sampled ids come back through a pinned buffer (``PendingStep.result``). The result types live
in ``engine.pending`` and the verify in ``engine.verify_step``; the types stay importable here.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Generator

import torch

from verifypd.engine.cuda_graphs import StepGraphs
from verifypd.engine.device_drafts import device_ids
from verifypd.engine.grammar import GrammarTable, apply_token_bitmask, fill_step_masks, read_drafts
from verifypd.engine.logits_pipeline import LogitsProcessor
from verifypd.engine.logprobs import PromptScoring, StepLogprobs, any_asks_logprobs
from verifypd.engine.model import DecoderLM, drain
from verifypd.engine.pending import NO_TOKEN, PendingStep, ResultSlot, VerifyOutputs  # re-exported
from verifypd.engine.sampler import sample
from verifypd.engine.step_inputs import StepInputBuilder, StepInputs
from verifypd.engine.timing import Span
from verifypd.engine.verify_step import DraftVerifier, sampling_tensors
from verifypd.kvcache import KVPool
from verifypd.types import StepPlan


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
        # Plans into tensors; it holds the captured graphs (query length -> graphs, GPU only).
        self.inputs = StepInputBuilder(
            block_size, device, {}, always_pad_verify, prompt_token_bucket
        )
        self.num_graph_steps = 0
        self.num_eager_steps = 0
        self.eager_shapes: Counter[tuple[int, int]] = Counter()  # (num seqs, max query len)
        # Penalties, biases, bans between the logits and the sampler (the engine sets EOS).
        self.logits_processor = LogitsProcessor(device)
        # Drafts against target distributions (``synthetic_acceptance``: benchmark only).
        self.verifier = DraftVerifier(
            device, self.inputs.to_device, self.logits_processor, synthetic_acceptance
        )
        self.grammars: GrammarTable | None = None  # structured output (engine.grammar)

    def capture_graphs(self, query_len: int, max_batch: int, max_len: int, **options) -> None:
        """Captures uniform steps of ``query_len`` tokens per sequence (1 = decode) into the
        runner's table; ``options`` as ``new_graphs``."""
        self.graphs[query_len] = self.new_graphs(query_len, max_batch, max_len, **options)

    def new_graphs(
        self,
        query_len: int,
        max_batch: int,
        max_len: int,
        with_logits: bool = True,
        short_attention: bool = False,
    ) -> StepGraphs:
        """Captured uniform steps of ``query_len`` tokens per sequence, with static buffers and
        a memory pool of their own (``capture_graphs`` puts them in the runner's table; kept
        apart, a stream replays them beside the runner's: ``logits(graphs=...)``).
        ``with_logits`` False: graphs that compute no logits (a step's rows get theirs from its
        hidden states, outside the graph); ``short_attention``: the attention in short pieces
        on the split-K kernel (``StepGraphs.piece``)."""
        graphs = StepGraphs(
            self.model, self.pool.kv, self.block_size, max_batch, max_len, query_len, with_logits,
            short_attention,
        )  # fmt: skip
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
                t = sampling_tensors(seqs, positions, self.device)
                pieces.append(sample(plain, t))
            for j, i in enumerate(inputs.sample_seqs):
                layout[i] = ResultSlot(j)
        if inputs.verify_seqs:
            out, acc = self.verifier.verify(plan, inputs, logits[n_plain:])
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
        if inputs.in_decode is not None:  # its prompt asks for none (padded rows: no build)
            prompt = PromptScoring()
        else:
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
        if inputs.in_decode is not None and graphs is None:  # a prompt inside a decode step
            self.num_graph_steps += 1
            hidden = inputs.in_decode.run(inputs.input_ids, inputs.positions, inputs.meta)
            return self._hidden_logits(hidden, rows)
        graphs = (self.graphs if graphs is None else graphs).get(inputs.meta.max_query_len)
        num_seqs = inputs.meta.num_seqs
        if graphs is None or not graphs.can_run(inputs.meta, num_seqs):
            self.num_eager_steps += 1
            self.eager_shapes[(num_seqs, inputs.meta.max_query_len)] += 1
            return (yield from self.forward_iter(inputs, rows, every))
        self.num_graph_steps += 1
        full = graphs.run(inputs.input_ids, inputs.positions, inputs.meta)  # [B * q, V or H]
        if not graphs.with_logits:  # hidden states: the rows' logits outside the graph
            return self._hidden_logits(full, rows)
        if len(rows) == full.shape[0]:
            return full  # rows are always in order: the plan's seqs, then their positions
        return full.index_select(0, self._to_device(rows, torch.int64))

    def _hidden_logits(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """fp32 logits of ``rows`` of a graph's hidden states."""
        if not rows:
            return hidden[:0]
        index = self._to_device(rows, torch.int64)
        return self.model.compute_logits(hidden.index_select(0, index))

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
