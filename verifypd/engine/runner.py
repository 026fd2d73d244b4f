"""Model runner: turns a ``StepPlan`` into tensors, runs the forward, samples.

Execution only: it never decides admission. One host sync per step, at the very end, when the
sampled ids come back through a pinned buffer (``PendingStep.result``).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch

from verifypd.engine.cuda_graphs import StepGraphs
from verifypd.engine.grammar import GrammarTable, apply_token_bitmask, fill_step_masks, read_drafts
from verifypd.engine.logits_pipeline import LogitsProcessor
from verifypd.engine.logprobs import PromptScoring, StepLogprobs, any_asks_logprobs
from verifypd.engine.model import DecoderLM
from verifypd.engine.rejection import (
    emit_accepted,
    greedy_accept,
    rejection_sample,
    synthetic_num_accepted,
)
from verifypd.engine.sampler import SamplingTensors, processed_probs, sample
from verifypd.engine.timing import Span
from verifypd.kernels.metadata import AttentionMetadata
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


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    sample_rows: list[int]  # rows of [T] whose logits sample one token (plain seqs)
    sample_seqs: list[int]  # plan index of each sample row
    verify_seqs: list[int]  # plan indices of seqs with drafts
    verify_rows: list[list[int]]  # per verify seq: the 1 + L rows of [T]


class PendingStep:
    """A launched step. ``done()`` polls without blocking; ``result()`` returns token ids."""

    def __init__(self, plan: StepPlan, packed: torch.Tensor | None, layout: list, event=None):
        self.plan = plan
        self._packed = packed  # host tensor (pinned on CUDA) filled by a non-blocking copy
        self._layout = layout  # per plan seq: ("none",) | ("one", i) | ("verify", off, L, acc_i)
        self._event = event
        self.span: Span | None = None  # from when its drafts were ready (device drafts only)
        self.verified: VerifyOutputs | None = None  # a verify's results, still on the device
        self.logprobs: StepLogprobs | None = None  # log-probs riding in the same buffer

    def seconds(self, wall: float) -> float:
        """The step's own duration: with drafts still being made on the GPU when it was
        launched, its GPU time after them (its launch-to-done ``wall`` time holds the drafting
        too); else ``wall``."""
        measured = self.span.seconds() if self.span is not None else None
        return wall if measured is None else measured

    def done(self) -> bool:
        return self._event is None or self._event.query()

    def result(self) -> list[list[int]]:
        if self._event is not None:
            self._event.synchronize()
        flat = self._packed.tolist() if self._packed is not None else []
        out: list[list[int]] = []
        for entry in self._layout:
            if entry[0] == "none":
                out.append([])
            elif entry[0] == "one":
                out.append([flat[entry[1]]])
            else:
                _, off, _, acc_i = entry
                out.append(flat[off : off + flat[acc_i] + 1])
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
    ) -> None:
        self.model = model
        self.pool = pool
        self.block_size = block_size
        self.device = device
        self.is_cuda = device.type == "cuda"
        # Benchmark only (DESIGN.md): accepted counts drawn from a truncated geometric
        # (``SpecConfig.synthetic_acceptance``).
        self.synthetic_acceptance = synthetic_acceptance
        self.graphs: dict[int, StepGraphs] = {}  # query length -> captured graphs (GPU only)
        # Tests (``SpecConfig.always_pad_verify``): pad mixed-L verify batches without graphs.
        self.always_pad_verify = always_pad_verify
        self.num_graph_steps = 0
        self.num_eager_steps = 0
        self.eager_shapes: Counter[tuple[int, int]] = Counter()  # (num seqs, max query len)
        # Penalties, biases, bans between the logits and the sampler (the engine sets EOS).
        self.logits_processor = LogitsProcessor(device)
        self.grammars: GrammarTable | None = None  # structured output (engine.grammar)

    def capture_graphs(self, query_len: int, max_batch: int, max_len: int) -> None:
        """Captures uniform steps of ``query_len`` tokens per sequence (1 = decode)."""
        graphs = StepGraphs(
            self.model, self.pool.kv, self.block_size, max_batch, max_len, query_len
        )
        graphs.capture()
        self.graphs[query_len] = graphs

    # ------------------------------------------------------------------ inputs
    def prepare(self, plan: StepPlan) -> StepInputs:
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        qsl = [0]
        seq_lens: list[int] = []
        sample_rows: list[int] = []
        sample_seqs: list[int] = []
        verify_seqs: list[int] = []
        verify_rows: list[list[int]] = []
        on_device: list[tuple[int, torch.Tensor]] = []  # (row of ids, drafts on the device)
        pad_to = self._verify_width(plan)
        for i, s in enumerate(plan.seqs):
            start, toks = self._query_tokens(s, pad_to)
            end = start + len(toks)
            if s.draft_ids_device is not None and s.draft_token_ids:
                on_device.append((len(ids) + s.num_new_tokens, s.draft_ids_device))
            ids += toks
            pos += range(start, end)
            slots += self._slots(s.seq.block_table, start, end)
            qsl.append(qsl[-1] + len(toks))
            seq_lens.append(end)
            if not s.samples:
                continue
            first = qsl[-1] - len(toks) + s.num_new_tokens - 1  # the row of its last real token
            if s.draft_token_ids:
                verify_seqs.append(i)
                verify_rows.append(list(range(first, qsl[-1])))
            else:  # padded rows (a decode fused with verifies) sample where unpadded ones do
                sample_seqs.append(i)
                sample_rows.append(first)
        return self._upload(plan, ids, pos, slots, qsl, seq_lens, on_device, sample_rows,
                            sample_seqs, verify_seqs, verify_rows)  # fmt: skip

    def _upload(self, plan, ids, pos, slots, qsl, seq_lens, on_device, *rows) -> StepInputs:
        """Two host->device copies per step: one int64 buffer (ids, positions, slots) and one
        int32 buffer (query starts, seq lens, block tables), sliced into views on the device.
        Drafts still on the device are copied into their rows of the ids there (the rows ride
        along in the int64 buffer).

        Every view starts 16-byte aligned. Triton specializes pointer arguments on that
        alignment, so a view whose offset depended on the token or sequence count would make
        some steps compile a second variant of a kernel, under traffic (a stall of ~1 s)."""
        num_tokens, num_seqs = len(ids), len(seq_lens)
        width = num_tokens + num_tokens % 2  # int64 rows of an even length: 16-byte aligned
        patch_rows = [r + j for r, d in on_device for j in range(d.shape[0])]
        wide_host = np.zeros((4 if patch_rows else 3, width), dtype=np.int64)
        wide_host[:3, :num_tokens] = (ids, pos, slots)
        wide_host[3:, : len(patch_rows)] = patch_rows
        wide = self._to_device(wide_host, torch.int64)[:, :num_tokens]
        if patch_rows:
            drafts = torch.cat([d for _, d in on_device]) if len(on_device) > 1 else on_device[0][1]
            wide[0].index_copy_(0, wide[3, : len(patch_rows)], drafts)
        tables = self._tables(plan, seq_lens)
        narrow_host, (starts, lens, table) = _aligned_concat(
            [np.asarray(qsl, np.int32), np.asarray(seq_lens, np.int32), tables.ravel()]
        )
        narrow = self._to_device(narrow_host, torch.int32)
        query_lens = [b - a for a, b in zip(qsl, qsl[1:], strict=False)]
        meta = AttentionMetadata(
            slot_mapping=wide[2],
            query_start_loc=narrow[starts : starts + num_seqs + 1],
            seq_lens=narrow[lens : lens + num_seqs],
            block_tables=narrow[table : table + tables.size].view(num_seqs, -1),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
        )
        return StepInputs(wide[0], wide[1], meta, *rows)

    def _query_tokens(self, s: ScheduledSeq, pad_to: int = 0) -> tuple[int, list[int]]:
        start = s.seq.num_computed_tokens
        toks = s.seq.token_ids[start : start + s.num_new_tokens] + s.draft_token_ids
        if pad_to and len(s.draft_token_ids) < pad_to:
            toks += [0] * (pad_to - len(s.draft_token_ids))  # never accepted: num_drafts says
        return start, toks

    def _verify_width(self, plan: StepPlan) -> int:
        """Pads every verify entry to the longest L, and every plain decode entry of a step
        that also verifies (its one token's logits are read before the padding, so it samples
        exactly as unpadded), when a graph exists for that width and every padded seq has its
        slots reserved: the step replays one graph instead of running eager; 0 = no padding."""
        lens = {len(s.draft_token_ids) for s in plan.seqs}
        if len(lens) < 2:
            return 0
        if 0 in lens and not all(s.draft_token_ids or _is_decode(s) for s in plan.seqs):
            return 0  # prompt chunks are never padded
        width = max(lens)
        bs = self.block_size
        reserved = all(
            len(s.seq.block_table) * bs >= s.seq.num_computed_tokens + 1 + width for s in plan.seqs
        )
        graphed = (1 + width) in self.graphs or self.always_pad_verify
        return width if reserved and graphed else 0

    def _slots(self, block_table: list[int], start: int, end: int) -> list[int]:
        bs = self.block_size
        return [block_table[p // bs] * bs + p % bs for p in range(start, end)]

    def _tables(self, plan: StepPlan, seq_lens: list[int]) -> np.ndarray:
        """[B, max_blocks] int32: every allocated block of each seq (blocks reserved for later
        positions included, so a graph can advance on the device), padded with 0."""
        bs = self.block_size
        width = max(max(len(s.seq.block_table) for s in plan.seqs), -(-max(seq_lens) // bs))
        tables = np.zeros((len(plan.seqs), width), dtype=np.int32)
        for i, s in enumerate(plan.seqs):
            tables[i, : len(s.seq.block_table)] = s.seq.block_table
        return tables

    def _to_device(self, data, dtype: torch.dtype) -> torch.Tensor:
        t = torch.as_tensor(np.asarray(data), dtype=dtype)
        if not self.is_cuda:
            return t
        return t.pin_memory().to(self.device, non_blocking=True)

    # ------------------------------------------------------------------ execution
    @torch.inference_mode()
    def forward(self, inputs: StepInputs, rows: list[int]) -> torch.Tensor:
        """Runs the model over all query tokens; returns fp32 logits of ``rows`` only."""
        hidden = self.model(inputs.input_ids, inputs.positions, self.pool.kv, inputs.meta)
        if not rows:
            return hidden.new_empty((0, 0), dtype=torch.float32)
        index = self._to_device(rows, torch.int64)
        return self.model.compute_logits(hidden.index_select(0, index))

    @torch.inference_mode()
    def launch(self, plan: StepPlan) -> PendingStep:
        """Enqueues the whole step; the only host sync happens in ``PendingStep.result``."""
        deferred = any(s.draft_ids_device is not None for s in plan.seqs)
        span = Span(self.is_cuda) if deferred else None  # the GPU reaches it after the drafts
        inputs = self.prepare(plan)
        drafts = read_drafts(self.grammars, plan.seqs)  # before the forward is enqueued
        verify_flat = [r for rows in inputs.verify_rows for r in rows]
        logits, logprobs = self._logits_and_logprobs(plan, inputs, verify_flat)  # raw log-probs
        logits = self.process_logits(plan, inputs, logits, drafts)  # grammar masks, draft cuts
        pieces: list[torch.Tensor] = []
        layout: list = [("none",)] * len(plan.seqs)
        n_plain = len(inputs.sample_rows)
        if n_plain:
            seqs = [plan.seqs[i].seq for i in inputs.sample_seqs]
            plain = self.logits_processor.process(logits[:n_plain], seqs)
            if all(s.params.is_greedy for s in seqs):  # no sampling tensors to upload
                pieces.append(plain.argmax(dim=-1))
            else:
                t = self._sampling_tensors(seqs, [s.num_tokens for s in seqs])
                pieces.append(sample(plain, t))
            for j, i in enumerate(inputs.sample_seqs):
                layout[i] = ("one", j)
        if inputs.verify_seqs:
            out, acc = self._verify(plan, inputs, logits[n_plain:])
            first_rows = [rows[0] for rows in inputs.verify_rows]
            verified = VerifyOutputs(inputs.verify_seqs, inputs.input_ids, first_rows, out, acc)
            width = out.shape[1]
            base = n_plain
            acc_base = base + out.numel()
            pieces += [out.flatten(), acc]
            for k, i in enumerate(inputs.verify_seqs):
                layout[i] = ("verify", base + k * width, width, acc_base + k)
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
        self, plan: StepPlan, inputs: StepInputs, verify_flat: list[int]
    ) -> tuple[torch.Tensor, StepLogprobs | None]:
        """The sampling rows' logits and, for the entries that ask, their log-probs (taken
        here, before any sampling-time change to the logits). Prompt rows scored for
        ``prompt_logprobs`` are computed after the sampling rows, in an eager forward."""
        rows = inputs.sample_rows + verify_flat
        if not any_asks_logprobs(plan):  # the common case: one pass over the plan, no work
            return self.logits(inputs, rows), None
        prompt = PromptScoring.build(plan, inputs.meta.query_lens_cpu)
        if prompt.rows:
            self.num_eager_steps += 1
            logits = self.forward(inputs, rows + prompt.rows)
        else:
            logits = self.logits(inputs, rows)
        groups = (inputs.sample_seqs, inputs.verify_seqs, [len(r) for r in inputs.verify_rows])
        logprobs = StepLogprobs.start(plan, logits, groups, prompt, self._to_device)
        return logits[: len(rows)], logprobs

    def logits(self, inputs: StepInputs, rows: list[int]) -> torch.Tensor:
        """fp32 logits of ``rows`` (ascending): a graph replay when the step is uniform (every
        sequence feeds the same q tokens) and a graph for q was captured, else eager."""
        graphs = self.graphs.get(inputs.meta.max_query_len)
        num_seqs = inputs.meta.num_seqs
        if graphs is None or not graphs.can_run(inputs.meta, num_seqs):
            self.num_eager_steps += 1
            self.eager_shapes[(num_seqs, inputs.meta.max_query_len)] += 1
            return self.forward(inputs, rows)
        self.num_graph_steps += 1
        full = graphs.run(inputs.input_ids, inputs.positions, inputs.meta)  # [B * q, V]
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

    def _pack(self, plan: StepPlan, pieces: list[torch.Tensor], layout: list) -> PendingStep:
        if not pieces:
            return PendingStep(plan, None, layout)
        packed = torch.cat([p.to(torch.int64) for p in pieces])
        if not self.is_cuda:
            return PendingStep(plan, packed, layout)
        host = torch.empty(packed.shape, dtype=torch.int64, pin_memory=True)
        host.copy_(packed, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return PendingStep(plan, host, layout, event)

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
        probs = [getattr(s, "draft_probs", None) for s in scheds]
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


def _is_decode(s: ScheduledSeq) -> bool:
    """One new token at the end of a decoding sequence."""
    return s.num_new_tokens == 1 and s.seq.num_computed_tokens + 1 == s.seq.num_tokens


def _fails(seq, position: int) -> bool:
    try:
        _build_sampling([seq], [position], "cpu")
    except Exception:
        return True
    return False


def _aligned_concat(parts: list[np.ndarray], align_bytes: int = 16) -> tuple[np.ndarray, list[int]]:
    """Concatenates 1-D arrays of one dtype, each starting at a multiple of ``align_bytes``;
    returns the buffer and each part's element offset."""
    step = max(1, align_bytes // parts[0].itemsize)
    offsets, total = [], 0
    for part in parts:
        offsets.append(total)
        total += -(-part.size // step) * step
    out = np.zeros(total, dtype=parts[0].dtype)
    for off, part in zip(offsets, parts, strict=True):
        out[off : off + part.size] = part
    return out, offsets
