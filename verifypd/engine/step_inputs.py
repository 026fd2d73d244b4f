"""Step inputs: a ``StepPlan`` turned into the tensors of one forward (ids, positions, slots,
attention metadata) and the rows that sample, uploaded in two host->device copies. Plain rows of
a step fused with verifies are padded to the verify width where a CUDA graph exists for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from verifypd.engine.cuda_graphs import StepGraphs
from verifypd.engine.device_drafts import device_ids
from verifypd.engine.prompt_in_decode import PromptInDecodeGraphs
from verifypd.kernels.metadata import AttentionMetadata, AttentionSplit, split_decode_rows
from verifypd.kvcache.slots import block_slots, positions_and_slots
from verifypd.types import ScheduledSeq, SeqStatus, StepPlan

# Prompt steps of at most this many tokens are never padded (their GEMMs are GEMV-sized; at
# most 16 rows never reach cuBLAS): EngineConfig.prompt_token_bucket.
UNPADDED_ROWS = 16


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    sample_rows: list[int]  # rows of [T] whose logits sample one token (plain seqs)
    sample_seqs: list[int]  # plan index of each sample row
    verify_seqs: list[int]  # plan indices of seqs with drafts
    verify_rows: list[list[int]]  # per verify seq: the 1 + L rows of [T]
    # The graphs that replay a decode step carrying a prompt chunk (laid out for them).
    in_decode: PromptInDecodeGraphs | None = None


class StepInputBuilder:
    """Builds ``StepInputs`` for one model's runner (its block size, device and graphs)."""

    def __init__(
        self,
        block_size: int,
        device: torch.device,
        graphs: dict[int, StepGraphs],
        always_pad_verify: bool = False,
        prompt_token_bucket: int = 0,
    ) -> None:
        self.block_size = block_size
        self.device = device
        self.is_cuda = device.type == "cuda"
        self.graphs = graphs  # the runner's: query length -> captured graphs
        # Tests (``SpecConfig.always_pad_verify``): pad mixed-L verify batches without graphs.
        self.always_pad_verify = always_pad_verify
        # A prompt step's token count is padded to a multiple of this (EngineConfig.
        # prompt_token_bucket): its GEMMs then see row counts cuBLAS has seen before.
        self.prompt_token_bucket = prompt_token_bucket
        # Prompt steps whose chunks are all this short replay a captured graph of this many
        # tokens a row (EngineConfig.prompt_graph_tokens; set once it is captured; 0 = none).
        self.prompt_graph_tokens = 0
        # Graphs of a decode step with a prompt chunk inside, ascending chunk rows (EngineConfig.
        # prompt_in_decode_tokens; set once captured; empty = none).
        self.prompt_in_decode: list[PromptInDecodeGraphs] = []

    def prepare(self, plan: StepPlan) -> StepInputs:
        """The step's input tensors (ids, positions, attention metadata) and which rows sample."""
        if q := self.prompt_graph_width(plan):
            return self._prepare_prompt_graph(plan, q)
        if graphs := self.prompt_in_decode_graphs(plan):
            return self._prepare_prompt_in_decode(plan, graphs)
        ids: list[int] = []
        starts: list[int] = []  # each entry's first query position
        qsl = [0]
        seq_lens: list[int] = []
        sample_rows: list[int] = []
        sample_seqs: list[int] = []
        verify_seqs: list[int] = []
        verify_rows: list[list[int]] = []
        on_device: list[tuple[int, torch.Tensor]] = []  # (row of ids, drafts on the device)
        ahead: list[tuple[int, int]] = []  # (row of ids, index in plan.prev_ids)
        pad_to = self.verify_width(plan)
        for i, s in enumerate(plan.seqs):
            start, toks = self._query_tokens(s, pad_to)
            end = start + len(toks)
            if (drafts := device_ids(s)) is not None and s.draft_token_ids:
                on_device.append((len(ids) + s.num_new_tokens, drafts))
            if s.is_ahead:
                ahead.append((len(ids), s.ahead_index))
            ids += toks
            starts.append(start)
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
        tables = self._tables(plan, seq_lens)
        block_tables = [s.seq.block_table for s in plan.seqs]
        pos, slots = positions_and_slots(block_tables, tables, starts, qsl, self.block_size)
        pad = self._prompt_padding(len(ids)) if _pads(plan) else 0
        # rows past query_start_loc[B] (``pad``): no sequence's, never read, KV stored nowhere
        inputs = self._upload(plan, ids, pos, slots, qsl, seq_lens, (on_device, ahead),
                              sample_rows, sample_seqs, verify_seqs, verify_rows,
                              tables=tables, pad=pad)  # fmt: skip
        if n := _decode_rows_first(plan):  # the rows on the decode kernel, the chunks apart
            inputs.meta.split = split_decode_rows(inputs.meta, n, max(seq_lens[:n]))
        return inputs

    def prompt_graph_width(self, plan: StepPlan) -> int:
        """q when ``plan`` is a prompt step the captured prompt graph holds: every chunk at
        most q tokens (no drafts, no prompt log-probs, which score every prompt row), at most
        the graph's rows, and room for q positions after each chunk's start; else 0."""
        q = self.prompt_graph_tokens
        graphs = self.graphs.get(q) if q and plan.lane == "prefill" else None
        if graphs is None or graphs.with_logits or len(plan.seqs) > graphs.max_batch:
            return 0
        for s in plan.seqs:
            seq = s.seq
            if s.num_new_tokens > q or s.draft_token_ids or s.is_ahead or seq.needs_prompt_logprobs:
                return 0
            if seq.num_computed_tokens + q > graphs.max_len:
                return 0
        return q

    def _prepare_prompt_graph(self, plan: StepPlan, q: int) -> StepInputs:
        """``prepare`` for a prompt step replayed in the prompt graph: each chunk of n tokens
        is padded to q rows at its end. The padding's KV is stored nowhere (slot -1) and its
        rows come after every real row of their sequence, so causal attention keeps them out
        of the real rows (they read whatever the pool holds there: zeros or stored K/V, always
        finite); the sequence's length counts them, so each real token keeps its position.
        Each prompt samples at its last real row."""
        ids, pos, slots, seq_lens = [], [], [], []
        for s in plan.seqs:
            self._pad_chunk(s, q, ids, pos, slots, seq_lens)
        qsl = [i * q for i in range(len(plan.seqs) + 1)]
        sample_seqs = [i for i, s in enumerate(plan.seqs) if s.samples]
        sample_rows = [i * q + plan.seqs[i].num_new_tokens - 1 for i in sample_seqs]
        return self._upload(plan, ids, pos, slots, qsl, seq_lens, ([], []),
                            sample_rows, sample_seqs, [], [])  # fmt: skip

    def _pad_chunk(self, s: ScheduledSeq, q: int, ids, pos, slots, seq_lens) -> tuple[int, int]:
        """Appends a prompt chunk's rows padded at its end to q (the padding stores no KV and
        sits after the real rows; the length counts it, so real tokens keep their positions);
        returns the chunk's start and its real token count."""
        start, toks = self._query_tokens(s)
        n = len(toks)
        ids += toks + [0] * (q - n)
        pos += [*range(start, start + n)] + [start + n - 1] * (q - n)
        slots += block_slots(s.seq.block_table, start, start + n, self.block_size) + [-1] * (q - n)
        seq_lens.append(start + q)
        return start, n

    def prompt_in_decode_graphs(self, plan: StepPlan) -> PromptInDecodeGraphs | None:
        """The prompt-in-decode graphs that hold ``plan`` (the fewest chunk rows that do): a
        decode step of one-token rows (no drafts), then one prompt chunk of at most q tokens
        (no drafts, no prompt log-probs, room for q positions after its start); else None."""
        if not self.prompt_in_decode or plan.lane != "decode" or len(plan.seqs) < 2:
            return None
        *rows, chunk = plan.seqs
        if not all(s.is_ahead or _is_plain(s) for s in rows):
            return None
        if chunk.is_ahead or _is_decode(chunk) or chunk.draft_token_ids:
            return None  # (a decode row last: a decode step, for the decode graphs)
        if chunk.seq.needs_prompt_logprobs:
            return None
        for graphs in self.prompt_in_decode:
            if chunk.num_new_tokens > graphs.q or len(rows) > graphs.max_batch:
                continue
            fits = chunk.seq.num_computed_tokens + graphs.q <= graphs.max_len
            return graphs if fits else None
        return None

    def _prepare_prompt_in_decode(self, plan: StepPlan, graphs: PromptInDecodeGraphs) -> StepInputs:
        """``prepare`` for a decode step carrying a prompt chunk, laid out for ``graphs``: the
        decode rows, padded to a graph's batch with inert rows (no KV slot, a context of one
        token), then the chunk padded at its end to q rows as a prompt graph pads it. The
        metadata carries the two parts (``AttentionMetadata.split``)."""
        q = graphs.q
        *rows, chunk = plan.seqs
        b = graphs.padded_size(len(rows))
        ids, pos, slots, seq_lens, ahead = [], [], [], [], []
        for i, s in enumerate(rows):
            start, toks = self._query_tokens(s)
            if s.is_ahead:
                ahead.append((i, s.ahead_index))
            ids += toks
            pos.append(start)
            slots += block_slots(s.seq.block_table, start, start + 1, self.block_size)
            seq_lens.append(start + 1)
        pad = b - len(rows)
        ids, pos, slots = ids + [0] * pad, pos + [0] * pad, slots + [-1] * pad
        seq_lens += [1] * pad
        start, n = self._pad_chunk(chunk, q, ids, pos, slots, seq_lens)
        qsl = [*range(b + 1), b + q]
        sample_seqs = [i for i, s in enumerate(plan.seqs) if s.samples]
        sample_rows = [i if i < len(rows) else b + n - 1 for i in sample_seqs]
        tables = self._tables(plan, seq_lens)
        tables = np.concatenate([tables[:-1], np.zeros((pad, tables.shape[1]), np.int32),
                                 tables[-1:]])  # fmt: skip
        inputs = self._upload(plan, ids, pos, slots, qsl, seq_lens, ([], ahead),
                              sample_rows, sample_seqs, [], [], tables=tables)  # fmt: skip
        meta = inputs.meta
        decode = AttentionMetadata(
            meta.slot_mapping[:b], meta.query_start_loc[: b + 1], meta.seq_lens[:b],
            meta.block_tables[:b], 1, max(seq_lens[:b]),
        )  # fmt: skip
        prompt = AttentionMetadata(
            meta.slot_mapping[b:], meta.query_start_loc[b : b + 2], meta.seq_lens[b:],
            meta.block_tables[b:], q, start + q,
        )  # fmt: skip
        meta.split = AttentionSplit(decode, prompt, b)
        inputs.in_decode = graphs
        return inputs

    def prompt_rows(self, max_tokens: int) -> list[int]:
        """Every row count past ``UNPADDED_ROWS`` that an eager prompt step of at most
        ``max_tokens`` tokens has once padded (``_prompt_padding``), ascending; [] when steps
        are not padded."""
        bucket = self.prompt_token_bucket
        if not bucket:
            return []
        first = UNPADDED_ROWS + 1 + self._prompt_padding(UNPADDED_ROWS + 1)
        return list(range(first, max_tokens + self._prompt_padding(max_tokens) + 1, bucket))

    def _prompt_padding(self, num_tokens: int) -> int:
        """Rows to add to a prompt step of ``num_tokens`` tokens: up to the next multiple of
        ``prompt_token_bucket`` past the GEMV-sized steps (``UNPADDED_ROWS``); 0 when off."""
        bucket = self.prompt_token_bucket
        if not bucket or num_tokens <= UNPADDED_ROWS:
            return 0
        return -num_tokens % bucket

    def _upload(self, plan, ids, pos, slots, qsl, seq_lens, patches, *rows,
                tables: np.ndarray | None = None, pad: int = 0) -> StepInputs:  # fmt: skip
        """Two host->device copies per step: one int64 buffer (ids, positions, slots) and one
        int32 buffer (query starts, seq lens, block tables), sliced into views on the device.
        Drafts still on the device, and the input tokens of entries planned ahead (the last
        step's sampled tokens, ``plan.prev_ids``), are copied into their rows of the ids there
        (the rows and source indices ride along in the int64 buffer). ``pad`` rows are added
        after the last sequence's: id 0, position 0, slot -1 (their KV is stored nowhere).

        Every view starts 16-byte aligned. Triton specializes pointer arguments on that
        alignment, so a view whose offset depended on the token or sequence count would make
        some steps compile a second variant of a kernel, under traffic (a stall of ~1 s)."""
        on_device, ahead = patches
        real, num_seqs = len(ids), len(seq_lens)
        num_tokens = real + pad
        width = num_tokens + num_tokens % 2  # int64 rows of an even length: 16-byte aligned
        patch_rows = [r + j for r, d in on_device for j in range(d.shape[0])]
        extra = [patch_rows] if patch_rows else []
        if ahead:
            extra += [[r for r, _ in ahead], [k for _, k in ahead]]
        wide_host = np.zeros((3 + len(extra), width), dtype=np.int64)
        for k, row in enumerate((ids, pos, slots)):
            wide_host[k, :real] = row
        wide_host[2, real:num_tokens] = -1
        for k, row in enumerate(extra):
            wide_host[3 + k, : len(row)] = row
        wide = self.to_device(wide_host, torch.int64)[:, :num_tokens]
        if patch_rows:
            drafts = torch.cat([d for _, d in on_device]) if len(on_device) > 1 else on_device[0][1]
            wide[0].index_copy_(0, wide[3, : len(patch_rows)], drafts)
        if ahead:
            at, n = 3 + bool(patch_rows), len(ahead)
            wide[0].index_copy_(0, wide[at, :n], plan.prev_ids.index_select(0, wide[at + 1, :n]))
        tables = self._tables(plan, seq_lens) if tables is None else tables
        narrow_host, (starts, lens, table) = _aligned_concat(
            [np.asarray(qsl, np.int32), np.asarray(seq_lens, np.int32), tables.ravel()]
        )
        narrow = self.to_device(narrow_host, torch.int32)
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
        if s.is_ahead:  # its token is still on the device: patched in by _upload
            return s.ahead_position, [0]
        start = s.seq.num_computed_tokens
        toks = s.seq.token_ids[start : start + s.num_new_tokens] + s.draft_token_ids
        if pad_to and len(s.draft_token_ids) < pad_to:
            toks += [0] * (pad_to - len(s.draft_token_ids))  # never accepted: num_drafts says
        return start, toks

    def verify_width(self, plan: StepPlan) -> int:
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

    def _tables(self, plan: StepPlan, seq_lens: list[int]) -> np.ndarray:
        """[B, max_blocks] int32: every allocated block of each seq (blocks reserved for later
        positions included, so a graph can advance on the device), padded with 0."""
        bs = self.block_size
        width = max(max(len(s.seq.block_table) for s in plan.seqs), -(-max(seq_lens) // bs))
        tables = np.zeros((len(plan.seqs), width), dtype=np.int32)
        for i, s in enumerate(plan.seqs):
            tables[i, : len(s.seq.block_table)] = s.seq.block_table
        return tables

    def to_device(self, data, dtype: torch.dtype) -> torch.Tensor:
        t = torch.as_tensor(np.asarray(data), dtype=dtype)
        if not self.is_cuda:
            return t
        return t.pin_memory().to(self.device, non_blocking=True)


def _is_plain(s: ScheduledSeq) -> bool:
    """A one-token decode row without drafts."""
    return _is_decode(s) and not s.draft_token_ids


def _is_decode(s: ScheduledSeq) -> bool:
    """One new token at the end of a decoding sequence."""
    return s.num_new_tokens == 1 and s.seq.num_computed_tokens + 1 == s.seq.num_tokens


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


def _pads(plan: StepPlan) -> bool:
    """A step padded to the prompt bucket: a prompt step, or a mixed one carrying a prompt
    chunk (single lane; decode rows inside a prompt step, ``lanes.backlog_fuse``)."""
    if plan.lane == "prefill":
        return True
    return plan.lane == "mixed" and plan.has_prompt_chunk


def _decode_rows_first(plan: StepPlan) -> int:
    """n when ``plan`` is a mixed step of n one-token decode rows, then prompt chunks (decode
    rows inside a prompt step, ``lanes.backlog_fuse``; the single lane without drafts); else
    0. Their attention then runs as two kernels (``AttentionMetadata.split``): on the prefill
    kernel the rows each took a program per query tile of the longest chunk, and on an H200
    32 rows beside a 2k-token chunk made that kernel several times slower."""
    if plan.lane != "mixed":
        return 0
    n = 0
    for s in plan.seqs:
        if s.seq.status is SeqStatus.PREFILLING:
            break
        if s.num_query_tokens != 1 or s.draft_token_ids or s.is_ahead:
            return 0
        n += 1
    rest = plan.seqs[n:]
    if not n or not rest or any(s.seq.status is not SeqStatus.PREFILLING for s in rest):
        return 0
    return n
