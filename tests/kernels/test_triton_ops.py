"""triton_ops: the reference signatures, and decode/prefill dispatch of paged_attention."""

from __future__ import annotations

import inspect

import pytest
import torch

from verifypd.kernels import reference, triton_ops

OPS = [
    "store_kv", "paged_attention", "rms_norm", "rope", "silu_and_mul", "rope_store_kv",
    "linear", "rms_norm_linear", "silu_mul_linear",
]  # fmt: skip


@pytest.mark.parametrize("name", OPS)
def test_same_signature_as_reference(name):
    ours = inspect.signature(getattr(triton_ops, name))
    theirs = inspect.signature(getattr(reference, name))
    assert list(ours.parameters) == list(theirs.parameters)
    defaults = [p.default for p in ours.parameters.values()]
    assert defaults == [p.default for p in theirs.parameters.values()]


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
