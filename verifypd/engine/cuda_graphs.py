"""CUDA-graph capture of uniform steps (q query tokens per sequence) for padded batch sizes:
q = 1 is the decode step, q = 1 + L the verify step of draft length L, q = 2 the drafter's
catch-up step.

A decode forward of a 1.5B model launches ~400 small kernels; at batch 1 their launch cost, not
the weight reads, sets the step time. Replaying a captured graph removes it. Inputs live in
static buffers the graph was captured on: each step copies the prepared tensors in, pads the
rest of the batch with rows that write nowhere (slot -1) and attend to one token, and replays.
Attention grids depend only on host-side ints (``max_seq_len`` = the model's max length at
capture), so one graph per batch size serves every context length.
"""

from __future__ import annotations

import torch

from verifypd.kernels.metadata import AttentionMetadata, split_decode_rows, uniform_pieces
from verifypd.kernels.triton_advance import advance
from verifypd.kernels.triton_decode_attention import MAX_ROWS
from verifypd.kernels.triton_prefill_attention import LONG_QUERY

# ``short_attention`` graphs cut the attention into pieces only for batches of at most this many
# query tokens: on an H200 (the 0.5B drafter over 2,048-token contexts, bench/catch_up_cost.py,
# e6e405d) pieces took a replay's GPU time from 1.28-1.47 to 0.89-1.25 ms at q = 16-64 and from
# 1.59 to 1.50 ms for one row of 256, but from 1.79 to 2.03 ms for two rows of 256.
SHORT_ATTENTION_TOKENS = 256


def graph_batch_sizes(max_batch: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, 257, 16))
    return [b for b in sizes if b <= max_batch] or [1]


class StepGraphs:
    """Captured graphs of one model for one query length ``q``, keyed by padded batch size."""

    def __init__(
        self,
        model,
        kv: torch.Tensor,
        block_size: int,
        max_batch: int,
        max_len: int,
        query_len: int = 1,
        with_logits: bool = True,
        short_attention: bool = False,
    ):
        self.model = model
        self.q = query_len
        # False: the graph computes no logits (the drafter's chunked catch-up needs none, and a
        # prompt step only its last tokens': [B * q, V] of them would be most of its memory and
        # half its work), and ``run`` returns the final hidden states, [B * q, H].
        self.with_logits = with_logits
        # True: the attention runs as pieces of at most MAX_ROWS // G tokens a row on the
        # short-query (split-K) kernel (``metadata.uniform_pieces``), for steps of a few rows
        # over long contexts (the drafter's catch-up chunks), where the prefill kernel's grid
        # is a handful of programs; in the graphs of batches of at most
        # ``SHORT_ATTENTION_TOKENS`` tokens. 0 when q already fits that kernel.
        cfg = getattr(model, "cfg", None)
        rows = MAX_ROWS // (cfg.num_heads // cfg.num_kv_heads) if cfg is not None else 0
        self.piece = rows if short_attention and 0 < rows < query_len else 0
        self.kv = kv
        self.sizes = graph_batch_sizes(max_batch)
        self.max_batch = self.sizes[-1]
        self.max_len = max_len
        device = kv.device
        n, max_blocks, q = self.max_batch, -(-max_len // block_size), query_len
        self.input_ids = torch.zeros(n * q, dtype=torch.int64, device=device)
        self.positions = torch.arange(n * q, dtype=torch.int64, device=device) % q
        self.slots = torch.full((n * q,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.full((n,), q, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device) * q
        self.block_tables = torch.zeros(n, max_blocks, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.block_size = block_size
        self._last_batch = 0  # batch of the last ``run`` (``run_next`` continues it)
        self._last_width = 0  # block-table columns copied by it

    def _meta(self, b: int) -> AttentionMetadata:
        meta = AttentionMetadata(
            slot_mapping=self.slots[: b * self.q],
            query_start_loc=self.query_start_loc[: b + 1],
            seq_lens=self.seq_lens[:b],
            block_tables=self.block_tables[:b],
            max_query_len=self.q,
            max_seq_len=self.max_len,
        )
        if self.piece and b * self.q <= SHORT_ATTENTION_TOKENS:  # read at every replay
            meta.pieces = uniform_pieces(meta, self.piece)
        return meta

    def _forward(self, b: int) -> torch.Tensor:
        t = b * self.q
        hidden = self.model(self.input_ids[:t], self.positions[:t], self.kv, self._meta(b))
        return self.model.compute_logits(hidden) if self.with_logits else hidden

    @torch.inference_mode()
    def capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for b in reversed(self.sizes):  # largest first, so smaller ones reuse its memory
                for _ in range(2):  # compile Triton kernels and warm the allocator
                    self._forward(b)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=side):
                    self.logits[b] = self._forward(b)
                self.graphs[b] = graph
            if self.q == 1:  # compile the advance kernel of ``run_next`` now, not under traffic
                bufs = (self.input_ids, self.positions, self.seq_lens, self.block_tables)
                scratch = [t[:1].clone() for t in (*bufs, self.slots)]
                advance(scratch[0].clone(), *scratch, self.block_size)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()

    def can_run(self, meta: AttentionMetadata, num_seqs: int) -> bool:
        return (
            bool(self.graphs)
            and meta.max_query_len == self.q
            and meta.slot_mapping.shape[0] == num_seqs * self.q
            and meta.block_tables.shape[1] <= self.block_tables.shape[1]
            and num_seqs <= self.max_batch
            and meta.max_seq_len <= self.max_len
        )

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata):
        """Copies one step's inputs into the static buffers and replays; [B * q, V] logits
        (without logits: the hidden states of the padded batch, [padded * q, H])."""
        q = self.q
        b = input_ids.shape[0] // q
        t = b * q
        padded = next(s for s in self.sizes if s >= b)
        self.input_ids[:t].copy_(input_ids, non_blocking=True)
        self.positions[:t].copy_(positions, non_blocking=True)
        self.slots[:t].copy_(meta.slot_mapping, non_blocking=True)
        self.slots[t : padded * q].fill_(-1)
        self.seq_lens[:b].copy_(meta.seq_lens, non_blocking=True)
        self.seq_lens[b:padded].fill_(q)
        width = meta.block_tables.shape[1]
        self.block_tables[:b, :width].copy_(meta.block_tables, non_blocking=True)
        self.graphs[padded].replay()
        self._last_batch, self._last_width = b, width
        return self.logits[padded][:t] if self.with_logits else self.logits[padded]

    def can_run_next(self, num_seqs: int, max_position: int) -> bool:
        """True if ``run_next`` may continue the last decode run: the same rows, and every
        row's blocks up to the new position were copied (the runner copies all allocated
        blocks; the drafter allocates a proposal's blocks up front)."""
        return (
            self.q == 1
            and num_seqs == self._last_batch
            and max_position // self.block_size < self._last_width
        )

    def padded_size(self, num_seqs: int) -> int:
        return next(s for s in self.sizes if s >= num_seqs)

    def step_buffers(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The static (input ids, positions, slots, context lengths) a replay reads."""
        return self.input_ids, self.positions, self.slots, self.seq_lens

    def set_tables(self, block_tables: torch.Tensor) -> None:
        """Block tables [B, W] of the next replay of B rows (on the device), the padding rows
        up to the graph's batch made inert (no KV slot, a context of q); ``run_next`` then
        continues those rows, their inputs written by the caller."""
        b, width = block_tables.shape
        q, padded = self.q, self.padded_size(b)
        self.block_tables[:b, :width].copy_(block_tables)
        self.slots[b * q : padded * q].fill_(-1)
        self.seq_lens[b:padded].fill_(q)
        self._last_batch, self._last_width = b, width

    def replay(self, num_seqs: int) -> torch.Tensor:
        """Replays the graph for ``num_seqs`` rows whose inputs (``step_buffers``, padding
        included) were written on the device; [num_seqs * q, V] logits."""
        padded = self.padded_size(num_seqs)
        self.graphs[padded].replay()
        return self.logits[padded][: num_seqs * self.q]

    def _advance(self, next_ids: torch.Tensor) -> None:
        advance(next_ids, self.input_ids, self.positions, self.seq_lens, self.block_tables,
                self.slots, self.block_size)  # fmt: skip

    def run_next(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Next decode step of the same sequences, every input advanced on the device in one
        launch (``kernels.triton_advance``): position + 1, slot from the block table, length +
        1, the new input ids."""
        b = self._last_batch
        padded = next(s for s in self.sizes if s >= b)
        self._advance(input_ids[:b])
        self.graphs[padded].replay()
        return self.logits[padded][:b]


@torch.inference_mode()
def warm_up_eager(model, kv: torch.Tensor, block_size: int, max_len: int) -> None:
    """Runs eager forwards over a spread of (num seqs, query len) shapes once at startup.

    Triton specializes integer arguments (== 1, divisible by 16), so the first eager step of
    a new kind compiles kernels for hundreds of milliseconds: a tail-latency stall if it
    happens under traffic. Writes go to slot -1 (nowhere); reads stay inside block 0. The
    query lengths cover every tile height of the short-query attention kernel (q * G rounded
    up to 16, 32 or 64 rows: a verify of any draft length) and the prefill kernel, each over a
    long context (split-K) and a short one (a single split writes the output directly).
    """
    device = kv.device
    query_lens = (1, 2, 3, 4, 5, 9, 17, 33, 64)
    shapes = [(b, q, ctx) for b in (1, 2, 3, 16, 17) for q in query_lens for ctx in (4096, q)]
    for num_seqs, q, max_seq_len in shapes:
        t = num_seqs * q
        meta = AttentionMetadata(
            slot_mapping=torch.full((t,), -1, dtype=torch.int64, device=device),
            query_start_loc=torch.arange(num_seqs + 1, dtype=torch.int32, device=device) * q,
            seq_lens=torch.full((num_seqs,), q, dtype=torch.int32, device=device),
            block_tables=torch.zeros(
                num_seqs, -(-q // block_size), dtype=torch.int32, device=device
            ),  # fmt: skip
            max_query_len=q,
            max_seq_len=min(max_len, max_seq_len),
            query_lens_cpu=[q] * num_seqs,
            seq_lens_cpu=[q] * num_seqs,
        )
        ids = torch.zeros(t, dtype=torch.int64, device=device)
        pos = torch.arange(t, device=device) % q
        model.compute_logits(model(ids, pos, kv, meta)[-1:])
    for rows, q, ctx in split_warm_shapes(max_len):  # decode rows, then a prompt chunk
        _warm_split(model, kv, block_size, rows, q, min(max_len, ctx))
    torch.cuda.synchronize()


def split_warm_shapes(max_len: int) -> list[tuple[int, int, int]]:
    """(decode rows, prompt tokens, context) of the split steps warmed at start-up: the decode
    part's row counts (== 1, divisible by 16 or neither) over a long and a short context, then
    the prompt part at every tile of the prefill kernel (``default_prefill_tiles``: a row tile
    of q * G rounded up to 16-128 rows, three stages from ``LONG_QUERY`` tokens), whatever the
    GQA group G. A prompt part of 9 tokens beside decode rows compiled under traffic before."""
    shapes = [(b, q, ctx) for b in (1, 3, 16, 17) for q in (17, 64) for ctx in (4096, 1)]
    prompt_lens = [1, 2, 3, 4, 5, 9, 33, 128] + ([LONG_QUERY] if max_len >= LONG_QUERY else [])
    return shapes + [(1, q, 4096) for q in prompt_lens if q <= max_len]


def _warm_split(model, kv: torch.Tensor, block_size: int, rows: int, q: int, ctx: int) -> None:
    """One eager step of ``rows`` decode rows, then a chunk of ``q`` tokens, its attention split
    (``split_decode_rows``: decode rows inside a prompt step), the rows' context read as
    ``ctx`` long (the split-K kernel's split count); as ``warm_up_eager``, nothing stored."""
    device = kv.device
    t = rows + q
    i32 = {"dtype": torch.int32, "device": device}
    meta = AttentionMetadata(
        slot_mapping=torch.full((t,), -1, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor([*range(rows + 1), t], **i32),
        seq_lens=torch.tensor([1] * rows + [q], **i32),
        block_tables=torch.zeros(rows + 1, -(-q // block_size), **i32),
        max_query_len=q,
        max_seq_len=q,
        query_lens_cpu=[1] * rows + [q],
        seq_lens_cpu=[1] * rows + [q],
    )
    meta.split = split_decode_rows(meta, rows, ctx)
    ids = torch.zeros(t, dtype=torch.int64, device=device)
    pos = torch.cat([torch.zeros(rows, dtype=torch.int64, device=device),
                     torch.arange(q, device=device)])  # fmt: skip
    model.compute_logits(model(ids, pos, kv, meta)[-1:])
