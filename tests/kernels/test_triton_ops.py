"""triton_ops: the reference signatures, and decode/prefill dispatch of paged_attention."""

from __future__ import annotations

import inspect

import pytest
import torch

from verifypd.config import KernelConfig
from verifypd.kernels import REFERENCE_OPS, get_ops, reference, triton_ops
from verifypd.kernels.metadata import AttentionMetadata, split_decode_rows, uniform_pieces

OPS = [
    "store_kv", "paged_attention", "rms_norm", "rope", "silu_and_mul", "rope_store_kv",
    "linear", "rms_norm_linear", "silu_mul_linear", "mlp",
]  # fmt: skip


@pytest.mark.parametrize("name", OPS)
def test_same_signature_as_reference(name):
    """The reference's parameters; a kernel may add keyword-only launch options (``use_pdl``)
    with defaults, which callers through ``Ops`` never pass."""
    params = inspect.signature(getattr(triton_ops, name)).parameters.values()
    ours = [p for p in params if p.kind is not p.KEYWORD_ONLY]
    assert all(p.default is not p.empty for p in params if p.kind is p.KEYWORD_ONLY)
    theirs = inspect.signature(getattr(reference, name)).parameters.values()
    assert [p.name for p in ours] == [p.name for p in theirs]
    assert [p.default for p in ours] == [p.default for p in theirs]


@pytest.mark.parametrize("pdl", [False, True])
def test_get_ops_dispatches_by_kernel_config(pdl):
    """``get_ops`` builds the Triton table under the given ``KernelConfig``; the torch
    references ignore it."""
    knobs = KernelConfig(gemv_max_rows=1, fuse_silu_epilogue=False, pdl=pdl)
    ops = get_ops(use_triton=True, knobs=knobs)
    assert ops.linear.__self__.knobs == knobs and ops.mlp.__self__.gemv_max_rows == 1
    assert (ops.rms_norm is triton_ops.rms_norm) == pdl  # PDL on: the kernel itself
    assert get_ops(use_triton=False, knobs=knobs) is REFERENCE_OPS


def test_two_op_tables_keep_their_own_dispatch(monkeypatch):
    """Two tables built from different ``KernelConfig``s in one process, called in turn, each
    dispatch (and launch with PDL) as their own config says: no shared switch between them."""
    launches = []

    def record(kind):
        def launch(x, weight, *args, use_pdl=True, **kw):
            launches.append((kind, x.shape[0], use_pdl))
            return torch.zeros(x.shape[0], weight.shape[0])

        return launch

    def rms_norm(x, weight, eps, *, use_pdl=True):
        launches.append(("rms_norm", x.shape[0], use_pdl))
        return x, x

    def rms_norm_gemv(x, norm_weight, eps, weight, bias=None, *, use_pdl=True, prefetch="off"):
        return record("norm_gemv")(x, weight, use_pdl=use_pdl)

    monkeypatch.setattr(triton_ops, "gemv", record("gemv"))
    monkeypatch.setattr(triton_ops, "rms_norm_gemv", rms_norm_gemv)
    monkeypatch.setattr(triton_ops, "rms_norm", rms_norm)
    fused = get_ops(True, KernelConfig(gemv_max_rows=4, pdl=True))
    cublas = get_ops(True, KernelConfig(gemv_max_rows=0, fuse_norm=False, pdl=False))
    x, w, nw = torch.randn(1, 8), torch.randn(6, 8), torch.ones(8)
    for ops in (fused, cublas, fused, cublas):
        ops.linear(x, w)
        ops.rms_norm_linear(x, nw, 1e-6, w)
        ops.linear(torch.randn(5, 8), w)  # past gemv_max_rows=4 (and 0): cuBLAS in both
    per_round = [("gemv", 1, True), ("norm_gemv", 1, True)]  # cublas: no kernel but the norm
    assert launches == (per_round + [("rms_norm", 1, False)]) * 2


BATCHES = [([1, 1, 1], [3, 300, 41]), ([1, 5], [9, 60]), ([1, 20], [9, 60])]  # last: prefill path


@pytest.mark.parametrize("query_lens,seq_lens", BATCHES)
def test_store_then_attend_matches_reference(target, paged_case, query_lens, seq_lens):
    """One layer's attention step: store the new K/V, then attend over the paged cache."""
    case = paged_case(target, query_lens, seq_lens, 8, 2, 32, block_size=8)
    gen = torch.Generator().manual_seed(5)
    k = torch.randn(case.q.shape[0], 2, 32, generator=gen).to(case.q.dtype).to(case.q.device)
    v = torch.randn_like(k)
    ref_pool = case.pool.clone()
    reference.store_kv(k, v, ref_pool[1, 0], ref_pool[1, 1], case.meta.slot_mapping)
    ref = reference.paged_attention(case.q, ref_pool[1, 0], ref_pool[1, 1], case.meta, 0.2)

    triton_ops.store_kv(k, v, case.k_cache, case.v_cache, case.meta.slot_mapping)
    out = triton_ops.paged_attention(case.q, case.k_cache, case.v_cache, case.meta, 0.2)
    torch.testing.assert_close(case.pool, ref_pool, rtol=0, atol=0)
    torch.testing.assert_close(out.float(), ref.float(), rtol=target.rtol, atol=target.atol)


@pytest.mark.parametrize("query_lens,seq_lens", [([1, 1, 1, 24], [3, 300, 41, 24]),
                                                 ([1, 1, 40], [77, 9, 90]),
                                                 ([1, 1, 24, 13], [300, 41, 24, 40])])  # fmt: skip
def test_split_attention_matches_the_whole_steps_reference(target, paged_case, query_lens,
                                                            seq_lens):  # fmt: skip
    """Decode rows then prompt chunks (``AttentionMetadata.split``, ``split_decode_rows``):
    the decode rows on the split-K kernel, the chunks on the prefill kernel (reading the new
    keys from k_new; the last case's second chunk after a context of its own), the same output
    as the reference over the whole step; without the split's prompt part the chunks' rows
    would be left unwritten."""
    case = paged_case(target, query_lens, seq_lens, 8, 2, 32, block_size=8, seed=3)
    gen = torch.Generator().manual_seed(9)
    k = torch.randn(case.q.shape[0], 2, 32, generator=gen).to(case.q.dtype).to(case.q.device)
    v = torch.randn_like(k)
    triton_ops.store_kv(k, v, case.k_cache, case.v_cache, case.meta.slot_mapping)
    ref = reference.paged_attention(case.q, case.k_cache, case.v_cache, case.meta, 0.2)
    n = query_lens.index(max(query_lens))  # the one-token rows come first
    case.meta.split = split_decode_rows(case.meta, n, max(seq_lens[:n]))
    assert case.meta.split.prompt.num_seqs == len(query_lens) - n
    ops = triton_ops.TritonOps()
    out = ops.paged_attention(case.q, case.k_cache, case.v_cache, case.meta, 0.2, k, v)
    torch.testing.assert_close(out.float(), ref.float(), rtol=target.rtol, atol=target.atol)
    # The reference reads the whole step, split or not.
    assert reference.paged_attention(case.q, case.k_cache, case.v_cache, case.meta, 0.2).equal(ref)


def test_uniform_pieces_cut_each_sequence_into_short_sequences() -> None:
    """Two sequences of 10 query tokens in pieces of 4: the same rows in order, each piece's
    context ending at its last row, over its own sequence's blocks."""
    tables = torch.tensor([[5, 6, 7], [1, 2, 3]], dtype=torch.int32)
    meta = AttentionMetadata(
        torch.arange(20), torch.tensor([0, 10, 20], dtype=torch.int32),
        torch.tensor([30, 12], dtype=torch.int32), tables, 10, 30,
    )  # fmt: skip
    pieces = uniform_pieces(meta, 4)
    assert pieces.query_start_loc.tolist() == [0, 4, 8, 10, 14, 18, 20]
    assert pieces.seq_lens.tolist() == [24, 28, 30, 6, 10, 12]
    assert pieces.block_tables.tolist() == [[5, 6, 7]] * 3 + [[1, 2, 3]] * 3
    assert pieces.max_query_len == 4 and pieces.max_seq_len == 30
    assert pieces.slot_mapping is meta.slot_mapping
    assert pieces.query_start_loc.dtype == pieces.seq_lens.dtype == torch.int32


@pytest.mark.parametrize("rows,q,context", [(1, 24, 300), (2, 40, 170), (3, 33, 64)])
def test_uniform_step_in_pieces_matches_the_reference(target, paged_case, monkeypatch, rows, q,
                                                      context):  # fmt: skip
    """A uniform step (a drafter's catch-up chunk: every row feeds q tokens, more than the
    split-K kernel holds whole) whose attention runs in pieces of 16 on that kernel
    (``AttentionMetadata.pieces``) gives the reference's output over the whole step, and the
    prefill kernel never runs."""
    case = paged_case(target, [q] * rows, [context + 7 * i for i in range(rows)], 16, 4, 32,
                      block_size=8, seed=rows)  # fmt: skip
    ref = reference.paged_attention(case.q, case.k_cache, case.v_cache, case.meta, 0.2)
    case.meta.pieces = uniform_pieces(case.meta, 64 // 4)
    monkeypatch.setattr(triton_ops, "prefill_attention", None)  # called: a TypeError
    ops = triton_ops.TritonOps()
    out = torch.full_like(case.q, float("nan"))
    out.copy_(ops.paged_attention(case.q, case.k_cache, case.v_cache, case.meta, 0.2))
    torch.testing.assert_close(out.float(), ref.float(), rtol=target.rtol, atol=target.atol)
    assert reference.paged_attention(case.q, case.k_cache, case.v_cache, case.meta, 0.2).equal(ref)
