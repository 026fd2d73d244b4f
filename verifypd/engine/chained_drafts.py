"""Chained drafting: the next round's drafts made on the device right behind a verify, before
the host has seen it (the GPU's gap between a verify and the next round's first draft step is
otherwise idle while the host turns around), and adopted by the next proposal where the verify
left the sequence exactly as the chain assumed.

Sampled drafting chains too: its noise is a function of (seed, position), and each row's
positions after the verify are found on the device from the accepted count, so a chained draft
is the draft a fresh proposal would sample there (at the view's last drafter temperature), and
it keeps the distribution it was drawn from for the verify.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np
import torch

from verifypd.engine.device_drafts import DeviceDrafts
from verifypd.engine.draft_follow import wait_for_follow
from verifypd.engine.draft_view import draft_sampling
from verifypd.engine.runner import VerifyOutputs
from verifypd.engine.sampler import sample_with_probs
from verifypd.engine.step_inputs import StepInputs
from verifypd.kernels.metadata import AttentionMetadata
from verifypd.kernels.triton_advance import advance_reference, chain_inputs, chain_inputs_reference
from verifypd.types import DRAFT_ON_DEVICE, ScheduledSeq, StepPlan

if TYPE_CHECKING:
    from verifypd.engine.speculative import DraftModelProposer


@dataclass
class ChainedDrafts:
    """The next round's drafts, made on the device right behind a verify (``chain``), before
    the host knows how many drafts it accepted. A sequence adopts its row once the verify has
    landed and it has exactly the tokens that verify gave it (``confirmed``)."""

    verify: StepPlan  # the verify it follows
    matrix: torch.Tensor  # [B, L] drafts on the device
    ready: object | None  # CUDA event after the drafting
    rows: dict[int, int]  # seq id -> row of ``matrix``
    base: dict[int, tuple[int, int]]  # seq id -> (its tokens before the verify, the verify's L)
    confirmed: dict[int, int] = field(default_factory=dict)  # seq id -> its tokens after it
    probs: torch.Tensor | None = None  # [B, L, V] the sampled rows' draft distributions

    @property
    def num_drafts(self) -> int:
        return self.matrix.shape[1]


class DraftChainer:
    """A drafter's chained rounds: drafts behind a verify (``chain``), confirmed when the verify
    lands (``confirm``), adopted by the next proposal (``adopt``)."""

    def __init__(self, drafter: DraftModelProposer) -> None:
        self.drafter = drafter
        self.chained: ChainedDrafts | None = None
        self.num_adopted = 0  # proposals served by chained drafts (tests, benchmarks)
        # Rows drafted behind a verify, and rows their next proposal took: the rest were
        # drafted for nothing (the request finished, or its next step did not speculate).
        self.num_chained_rows = 0
        self.num_adopted_rows = 0

    @torch.inference_mode()
    def chain(
        self, verify: StepPlan, verified: VerifyOutputs, num_drafts: int, max_len: int
    ) -> int:
        """Drafts the next round of the verified sequences on the device, behind the verify:
        each row feeds the token before the verify's final one and the final one (both found on
        the device from the accepted count; re-feeding a token whose KV is stored writes the
        same KV), then ``num_drafts - 1`` single-token steps. Every row reserves drafter blocks
        for the most the verify can accept. Returns the rows drafted."""
        self.chained = None
        if num_drafts < 1:
            return 0
        picks = []  # (row of verified, view, tokens before the verify, the verify's L)
        for k, i in enumerate(verified.seqs):
            e = verify.seqs[i]
            view = self.drafter.views.get(e.seq.seq_id)
            if view is None:
                continue
            n, width = view.local(e.seq.num_tokens), len(e.draft_token_ids)  # the view's count
            if (
                n + width + num_drafts > max_len
                or view.num_computed_tokens < n + width - 1
                or not self.drafter.kv.allocate(view.block_table, n + width + num_drafts)
            ):
                continue
            picks.append((k, view, n, width))
        if not picks:
            return 0
        self.drafter._follow_last_work()
        wait_for_follow([v for _, v, _, _ in picks])
        host = np.array(
            [[k for k, *_ in picks], [verified.first_rows[k] for k, *_ in picks],
             [n - 1 for _, _, n, _ in picks]],
            dtype=np.int64,
        )  # fmt: skip
        rows = self.drafter.runner._to_device(
            host, torch.int64
        )  # verify row, first input, position
        tables = self.drafter._tables([v for _, v, _, _ in picks])
        pick = self._picker([v for _, v, _, _ in picks], rows, verified)
        probs: list[torch.Tensor] = []
        if self._chain_fits_graphs(len(picks), tables.shape[1], max_len):
            drafted = [pick(self._chain_graph_step(rows, tables, verified), 0, probs)]
            next_step = self.drafter.runner.graphs[1].run_next
        else:
            logits, base = self._chain_eager_step(rows, tables, verified, max_len)
            drafted = [pick(logits, 0, probs)]
            next_step = lambda prev: self._chain_eager_next_step(base, prev)  # noqa: E731
        for j in range(1, num_drafts):
            drafted.append(pick(next_step(drafted[-1]), j, probs))
        matrix = torch.stack(drafted, dim=1)
        self.chained = ChainedDrafts(
            verify=verify,
            matrix=matrix,
            ready=self.drafter._record_work(),
            rows={v.seq_id: r for r, (_, v, _, _) in enumerate(picks)},
            base={v.seq_id: (v.seq_end(n), w) for _, v, n, w in picks},
            probs=torch.stack(probs, dim=1) if probs else None,
        )
        self.drafter._graph_ready = False
        self.num_chained_rows += len(picks)
        return len(picks)

    def _picker(self, views, rows: torch.Tensor, verified: VerifyOutputs):
        """``pick(logits, j, probs)``: the rows' draft j, greedy, or sampled at the views' last
        drafter temperatures (then its distribution appended to ``probs``). A sampled row's
        draft j lies at its count after the verify plus j: the position before the verify
        (``rows[2]``) + 2 + the accepted count, found on the device."""
        temps = [v.draft_temp for v in views]
        if all(t == 0 for t in temps):
            return lambda logits, j, probs: self.drafter._greedy(logits)
        built = draft_sampling(views, temps, [0] * len(views), rows.device)
        first = rows[2] + 2 + verified.num_accepted.to(torch.int64)[rows[0]]

        def pick(logits, j, probs):
            tokens, q = sample_with_probs(logits, replace(built, positions=first + j))
            probs.append(q)
            return tokens

        return pick

    def warm_up_chain(self) -> None:
        """Compiles the chain's input kernel at start-up (every argument that changes from call
        to call is unspecialized, so one call covers all), not under traffic."""
        dev = self.drafter.runner.device
        one = torch.zeros(1, dtype=torch.int64, device=dev)
        step = [torch.zeros(2, dtype=torch.int64, device=dev) for _ in range(3)]
        step.append(torch.zeros(1, dtype=torch.int32, device=dev))
        chain_inputs(
            torch.zeros(3, 1, dtype=torch.int64, device=dev), one, one, one.view(1, 1),
            torch.zeros(1, 1, dtype=torch.int32, device=dev), step,
            (one.clone(), step[3].clone()), 1, self.drafter.input_vocab, self.drafter.block_size,
        )  # fmt: skip

    def _chain_fits_graphs(self, num_rows: int, width: int, max_len: int) -> bool:
        graphs = [self.drafter.runner.graphs.get(q) for q in (1, 2)]
        return all(
            g is not None
            and num_rows <= g.max_batch
            and width <= g.block_tables.shape[1]
            and max_len <= g.max_len
            for g in graphs
        )

    def _chain_graph_step(self, rows, tables, verified: VerifyOutputs) -> torch.Tensor:
        """The two-token step on its graph, its inputs written into the graph's buffers by one
        kernel (``kernels.triton_advance.chain_inputs``), which also seeds the single-token
        graph's ``run_next``; returns the logits of each row's last token."""
        two, one = self.drafter.runner.graphs[2], self.drafter.runner.graphs[1]
        b = rows.shape[1]
        padded = two.padded_size(b)
        for g in (two, one):
            g.set_tables(tables)
        chain_inputs(
            rows, verified.num_accepted, verified.input_ids, verified.out, tables,
            two.step_buffers(), (one.positions, one.seq_lens), padded, self.drafter.input_vocab,
            self.drafter.block_size,
        )  # fmt: skip
        self.drafter.runner.num_graph_steps += 1
        return two.replay(b)[1::2]

    def _chain_eager_step(self, rows, tables, verified: VerifyOutputs, max_len: int):
        """``_chain_graph_step`` with the torch reference of its input kernel and an eager
        forward (CPU, or a batch past the graphs); also returns the buffers the single-token
        steps continue from."""
        b, dev = rows.shape[1], rows.device
        step = _step_buffers(2 * b, b, dev)
        base = _step_buffers(b, b, dev)  # input ids, positions, slots, lengths of the next steps
        chain_inputs_reference(
            rows, verified.num_accepted, verified.input_ids, verified.out, tables, step,
            (base[1], base[3]), b, self.drafter.input_vocab, self.drafter.block_size,
        )  # fmt: skip
        logits = self._eager_forward(step, tables, 2, max_len, list(range(1, 2 * b, 2)))
        return logits, (base, tables, max_len)

    def _chain_eager_next_step(self, base, prev: torch.Tensor) -> torch.Tensor:
        """One single-token step of every chained row, its inputs advanced on the device."""
        step, tables, max_len = base
        advance_reference(prev, *step[:2], step[3], tables, step[2], self.drafter.block_size)
        return self._eager_forward(step, tables, 1, max_len, list(range(prev.shape[0])))

    def _eager_forward(self, step, tables, q: int, max_len: int, rows: list[int]):
        ids, positions, slots, seq_lens = step
        b = seq_lens.shape[0]
        meta = AttentionMetadata(
            slot_mapping=slots,
            query_start_loc=torch.arange(b + 1, dtype=torch.int32, device=ids.device) * q,
            seq_lens=seq_lens,
            block_tables=tables,
            max_query_len=q,
            max_seq_len=max_len,
        )
        return self.drafter.runner.forward(StepInputs(ids, positions, meta, [], [], [], []), rows)

    def confirm(self, plan: StepPlan, token_ids: list[list[int]]) -> None:
        """A verify landed (and was applied): its chained rows whose sequences took all of its
        tokens and go on may be adopted by their next proposal."""
        c = self.chained
        if c is None or c.verify is not plan:
            return
        for e, new_ids in zip(plan.seqs, token_ids, strict=True):
            sid = e.seq.seq_id
            if sid not in c.base or e.seq.status.is_finished:
                continue
            n, width = c.base[sid]
            if 1 <= len(new_ids) <= width + 1 and e.seq.num_tokens == n + len(new_ids):
                c.confirmed[sid] = e.seq.num_tokens

    def adopt(self, entries: list[ScheduledSeq], lens: list[int]) -> set:
        """Serves entries from the chained drafts where they are still valid: the sequence has
        exactly the tokens of the verify they followed. Sampled rows bring the distributions
        their drafts were drawn from (at the temperature of the proposal before: any drafter
        distribution keeps the verify lossless)."""
        c = self.chained
        if c is None or not c.confirmed:
            return set()
        adopted = set()
        for e, n in zip(entries, lens, strict=True):
            sid = e.seq.seq_id
            if n <= 0 or c.confirmed.get(sid) != e.seq.num_tokens:
                continue
            del c.confirmed[sid]
            m = min(n, c.num_drafts)
            e.draft_token_ids = [DRAFT_ON_DEVICE] * m
            row = c.rows[sid]
            q = None
            if c.probs is not None and self.drafter.views[sid].draft_temp > 0:
                q = c.probs[row, :m]
            e.drafts = DeviceDrafts(c.matrix[row, :m], q, c.ready)
            view = self.drafter.views[sid]
            view.draft_start = view.local(e.seq.num_tokens)
            view.num_computed_tokens = view.draft_start + c.num_drafts - 1
            adopted.add(id(e))
        self.num_adopted += bool(adopted)
        self.num_adopted_rows += len(adopted)
        return adopted


def _step_buffers(num_tokens: int, num_seqs: int, device) -> tuple[torch.Tensor, ...]:
    """Input ids, positions, slots [num_tokens] int64 and context lengths [num_seqs] int32."""
    longs = (torch.zeros(num_tokens, dtype=torch.int64, device=device) for _ in range(3))
    return (*longs, torch.zeros(num_seqs, dtype=torch.int32, device=device))
