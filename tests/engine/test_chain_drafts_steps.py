"""Chained drafting (``DraftModelProposer.chain``) drafts exactly what a fresh proposal drafts
after the same verify, for every accepted count from 0 (re-feed the last token) to L (feed the
last draft and the bonus), across block boundaries, batch rows of different lengths, greedy and
sampled (the same draws from the same distributions), on CPU (eager steps) and on the GPU (the
q = 2 graph fed on the device, then q = 1 graph steps)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import tiny_config, tiny_draft_spec

from verifypd.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from verifypd.engine.core import EngineCore
from verifypd.engine.cuda_graphs import StepGraphs
from verifypd.engine.runner import VerifyOutputs
from verifypd.lanes.sync_driver import SyncDriver
from verifypd.types import SamplingParams, ScheduledSeq, Sequence, StepPlan

L = 4
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _rounds(core: EngineCore, prompts, accepted, chain: bool, temps=None):
    """Each round: a proposal, then a fake verify accepting k drafts and a new token (on the
    device as the runner leaves it), chained or not, then the tokens land on the host. Returns
    each round's drafts (and, sampled, their distributions) and the counts of adopted
    proposals, rows chained and rows adopted."""
    drafter = core.spec.drafter
    device = core.device
    temps = temps or [0.0] * len(prompts)
    seqs = [Sequence(f"s{i}", p, SamplingParams(max_tokens=256, temperature=t, seed=40 + i))
            for i, (p, t) in enumerate(zip(prompts, temps, strict=True))]  # fmt: skip
    out = []
    for per_seq in accepted:
        entries = [ScheduledSeq(s, 1) for s in seqs]
        drafter.propose(entries, [L] * len(seqs), temps)
        drafts = [e.draft_ids() for e in entries]
        out.append(drafts)
        dists = [e.drafts.probs for e in entries]
        assert all((q is None) == (t == 0) for q, t in zip(dists, temps, strict=True))
        out.append([None if q is None else q.cpu() for q in dists])
        new = [d[:k] + [(d[-1] + 1 + k) % 500] for d, k in zip(drafts, per_seq, strict=True)]
        plan = StepPlan("verify", entries)
        if chain:
            ids = [t for s, d in zip(seqs, drafts, strict=True) for t in [s.token_ids[-1], *d]]
            rows = torch.tensor([n + [-1] * (L + 1 - len(n)) for n in new], device=device)
            verified = VerifyOutputs(
                seqs=list(range(len(seqs))),
                input_ids=torch.tensor(ids, device=device),
                first_rows=[i * (L + 1) for i in range(len(seqs))],
                out=rows,
                num_accepted=torch.tensor(per_seq, device=device),
            )
            assert drafter.chain(plan, verified, L, 512) == len(seqs)
        for s, n in zip(seqs, new, strict=True):
            s.token_ids += n
        drafter.confirm(plan, new)
    c = drafter.chainer
    adopted = drafter.num_adopted, c.num_chained_rows, c.num_adopted_rows
    for s in seqs:
        drafter.free(s.seq_id)
    assert drafter.kv.usage == 0
    return out, adopted


def _core(device: str) -> EngineCore:
    """A ``dummy:tiny`` engine drafting for itself at a fixed L (graphs on a GPU)."""
    spec = SpecConfig(method="draft", draft_model="dummy:tiny", max_draft_len=L,
                      initial_draft_len=L, controller=False)  # fmt: skip
    return EngineCore(EngineConfig(
        model="dummy:tiny", device=device, spec=spec, cuda_graphs=device == "cuda",
        dtype="float32",
        scheduler=SchedulerConfig(max_num_seqs=4, max_model_len=512),
        cache=CacheConfig(num_blocks=256, block_size=8, enable_prefix_caching=False),
    ))  # fmt: skip


@pytest.mark.parametrize("device", DEVICES)
def test_chained_drafts_equal_fresh_proposals(device):
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 500, n).tolist() for n in (3, 30, 61)]
    accepted = [rng.integers(0, L + 1, len(prompts)).tolist() for _ in range(20)]
    accepted[0] = [0, L, 2]  # every kind of catch-up early on
    results = []
    for chain in (True, False):
        results.append(_rounds(_core(device), prompts, accepted, chain))
    (chained, adopted), (fresh, not_adopted) = results
    n = len(accepted)  # all but the first round adopted; the last round's chain is unused
    assert adopted == (n - 1, 3 * n, 3 * (n - 1)) and not_adopted == (0, 0, 0)
    assert chained == fresh


@pytest.mark.parametrize("device", DEVICES)
def test_sampled_chained_drafts_equal_fresh_proposals(device):
    """Sampled drafting (one greedy row beside two sampled ones): a chained draft is the one a
    fresh proposal samples after the same verify, from the same distribution, its noise at the
    row's positions found on the device."""
    rng = np.random.default_rng(6)
    prompts = [rng.integers(0, 500, n).tolist() for n in (5, 30, 61)]
    accepted = [rng.integers(0, L + 1, len(prompts)).tolist() for _ in range(12)]
    accepted[0] = [0, L, 2]
    temps = [0.8, 0.0, 1.3]
    results = []
    for chain in (True, False):
        results.append(_rounds(_core(device), prompts, accepted, chain, temps))
    (chained, adopted), (fresh, not_adopted) = results
    n = len(accepted)
    assert adopted == (n - 1, 3 * n, 3 * (n - 1)) and not_adopted == (0, 0, 0)
    for got, want in zip(chained, fresh, strict=True):
        if got and isinstance(got[0], list):  # the drafts
            assert got == want
        else:  # the distributions they were drawn from
            for q, p in zip(got, want, strict=True):
                assert (q is None and p is None) or torch.allclose(q, p, atol=1e-6)


def test_chains_only_when_the_gap_after_a_verify_would_be_idle():
    """A chain fills the GPU's gap between rounds; with a prompt waiting or sequences outside
    the verify that gap has other work, and nothing is chained."""
    spec = tiny_draft_spec(chain_drafts=True)
    core = EngineCore(tiny_config(spec=spec))
    driver = SyncDriver(core)
    policy = driver.policy
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    (a,) = core.add_request("a", [1, 2, 3], params)
    (b,) = core.add_request("b", [4, 5, 6, 7], params)
    both = StepPlan("verify", [ScheduledSeq(a, 1), ScheduledSeq(b, 1)])
    assert not policy.gap_is_idle(both)  # both wait for their prefill
    for _ in range(3):
        driver.step()
    assert not core.scheduler.num_waiting and a.num_output_tokens > 1
    assert policy.gap_is_idle(both)
    assert core.spec.drafter.num_adopted > 0  # steps since the prefill were chained
    assert not policy.gap_is_idle(StepPlan("verify", [ScheduledSeq(a, 1)]))  # b is left out
    core.add_request("c", [9, 9], params)
    assert not policy.gap_is_idle(both)  # c waits for its prefill


def test_a_failing_chain_turns_chaining_off_and_the_step_stands(caplog):
    spec = tiny_draft_spec(chain_drafts=True)
    core = EngineCore(tiny_config(spec=spec))
    plain = EngineCore(tiny_config())
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)

    def broken(*args):
        raise RuntimeError("boom")

    core.spec.drafter.chain = broken
    outs = {}
    for engine in (core, plain):
        engine.add_request("r", [5, 6, 7, 8], params)
        driver, ids = SyncDriver(engine), []
        while engine.has_unfinished():
            ids += [t for out in driver.step() for t in out.new_token_ids]
        outs[engine is core] = ids
    assert outs[True] == outs[False] and len(outs[True]) == 24
    assert not core.chain_drafts and "chained drafting failed" in caplog.text
    core.check_integrity()
    assert core.kv.usage == 0


@pytest.mark.parametrize("q", [1, 2])
def test_graph_padding_rows_are_inert_after_set_tables(q):
    """A chain replays the graph for its batch padded up to a captured size: the padding rows
    must write no KV (slot -1) even where an earlier, larger batch left real slots there."""
    graphs = StepGraphs(None, torch.zeros(1), block_size=16, max_batch=8, max_len=64, query_len=q)
    graphs.slots.fill_(5)  # an earlier batch of 8 rows
    graphs.seq_lens.fill_(40)
    graphs.set_tables(torch.ones(3, 2, dtype=torch.int32))  # 3 rows, padded to 4
    assert (graphs.slots[: 3 * q] == 5).all() and (graphs.slots[3 * q : 4 * q] == -1).all()
    assert (graphs.seq_lens[:3] == 40).all() and graphs.seq_lens[3] == q
    assert (graphs.block_tables[:3, :2] == 1).all()
    assert graphs.padded_size(3) == 4 and graphs.can_run_next(3, 31) == (q == 1)
