"""A short prompt computed inside a decode step (``EngineConfig.prompt_in_decode_tokens``).

Beside a decode step on another stream, a prompt step reads every weight a second time and the
decode step slows by about as much as it would if it computed the prompt's rows itself (on an
H200, a 7B decode step of 4.1 ms took 7.0 ms beside prompt steps). Inside the decode step the
prompt's rows share the weight reads: its GEMMs grow from a few rows to a few hundred, which
costs little while they stay memory-bound. The step is a CUDA graph of ``b`` decode rows (padded
to the decode graphs' batch sizes) followed by one chunk of up to ``q`` rows (padded at its end,
as a prompt graph pads): each part's attention on its own kernel (``AttentionMetadata.split``),
everything else over all the rows. The graph computes no logits: the rows that sample get theirs
from its hidden states (the decode rows and the chunk's last real row).

``PromptInDecodeGraphs`` holds the static buffers and the graphs (captured on a GPU; on a CPU it
runs the same forward on the same buffers eagerly, so the layout is tested without a GPU).
"""

from __future__ import annotations

import torch

from verifypd.engine.cuda_graphs import graph_batch_sizes
from verifypd.kernels.metadata import AttentionMetadata, AttentionSplit

MAX_DECODE_ROWS = 64  # decode rows a graph holds: beyond it the prompt takes a prompt step


class PromptInDecodeGraphs:
    """Graphs of ``b`` decode rows + one chunk of ``q`` rows, keyed by the padded ``b``."""

    with_logits = False

    def __init__(self, model, kv: torch.Tensor, block_size: int, max_batch: int, max_len: int,
                 q: int) -> None:  # fmt: skip
        self.model, self.kv, self.q, self.max_len = model, kv, q, max_len
        self.sizes = graph_batch_sizes(min(max_batch, MAX_DECODE_ROWS))
        self.max_batch = self.sizes[-1]
        rows, tokens = self.max_batch + 1, self.max_batch + q
        device = kv.device
        self.input_ids = torch.zeros(tokens, dtype=torch.int64, device=device)
        self.positions = torch.zeros(tokens, dtype=torch.int64, device=device)
        self.slots = torch.full((tokens,), -1, dtype=torch.int64, device=device)
        self.query_start_loc = torch.arange(rows + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(rows, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(
            rows, -(-max_len // block_size), dtype=torch.int32, device=device
        )
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.hidden: dict[int, torch.Tensor] = {}
        self.replays: list[int] = []  # padded decode rows of each run (tests, benchmarks)

    def padded_size(self, num_decode_rows: int) -> int:
        return next(s for s in self.sizes if s >= num_decode_rows)

    def metadata(self, b: int, max_seq_len: int | None = None) -> AttentionMetadata:
        """The metadata of ``b`` (padded) decode rows and the chunk, over the static buffers."""
        q, max_seq_len = self.q, max_seq_len or self.max_len
        t = b + q
        slots, starts, lens = self.slots, self.query_start_loc, self.seq_lens
        tables = self.block_tables
        decode = AttentionMetadata(slots[:b], starts[: b + 1], lens[:b], tables[:b], 1, max_seq_len)
        prompt = AttentionMetadata(slots[b:t], starts[b : b + 2], lens[b : b + 1],
                                   tables[b : b + 1], q, max_seq_len)  # fmt: skip
        return AttentionMetadata(slots[:t], starts[: b + 2], lens[: b + 1], tables[: b + 1], q,
                                 max_seq_len, split=AttentionSplit(decode, prompt, b))  # fmt: skip

    def _forward(self, b: int) -> torch.Tensor:
        t = b + self.q
        return self.model(self.input_ids[:t], self.positions[:t], self.kv, self.metadata(b))

    @torch.inference_mode()
    def capture(self, pool=None) -> None:
        """One graph per padded decode batch, largest first (the smaller reuse its memory);
        ``pool``: a graph memory pool shared with other sizes' graphs (captured largest
        first): they all replay on the decode stream, one at a time, and a replay's hidden
        states are read before the next."""
        pool = torch.cuda.graph_pool_handle() if pool is None else pool
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for b in reversed(self.sizes):
                self.query_start_loc[b + 1] = b + self.q  # inert until a run writes it
                for _ in range(2):  # compile the kernels and warm the allocator
                    self._forward(b)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=side):
                    self.hidden[b] = self._forward(b)
                self.graphs[b] = graph
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata):
        """Copies a step laid out by ``StepInputBuilder`` (``meta.split``: its padded decode
        rows) into the static buffers and replays; the hidden states of every row, [b + q, H]."""
        b = meta.split.num_decode_rows
        t, width = b + self.q, meta.block_tables.shape[1]
        self.input_ids[:t].copy_(input_ids, non_blocking=True)
        self.positions[:t].copy_(positions, non_blocking=True)
        self.slots[:t].copy_(meta.slot_mapping, non_blocking=True)
        self.query_start_loc[: b + 2].copy_(meta.query_start_loc, non_blocking=True)
        self.seq_lens[: b + 1].copy_(meta.seq_lens, non_blocking=True)
        self.block_tables[: b + 1, :width].copy_(meta.block_tables, non_blocking=True)
        self.replays.append(b)
        if b in self.graphs:
            self.graphs[b].replay()
            return self.hidden[b]
        with torch.inference_mode():  # not captured (CPU): the same forward, eagerly
            return self._forward(b)
