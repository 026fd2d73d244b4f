"""Short prompt steps replayed in a prompt graph (``EngineConfig.prompt_graph_tokens``, GPU):
each chunk padded at its end to the graph's q rows, its sample taken at its last real row, the
logits made outside the graph from its hidden states. On CPU an eager stand-in holds the place
of the captured graph (same contract: static q, a row cap, hidden states out), so the padding
and the runner's path are checked here; tests/engine/test_gpu_prompt_graph.py replays the real
graph on a GPU."""

from __future__ import annotations

import pytest
import torch
from helpers import serve_arrivals, tiny_config

from verifypd.engine.core import EngineCore
from verifypd.lanes.dispatcher import LaneDispatcher
from verifypd.types import SamplingParams, ScheduledSeq, StepPlan

Q = 32
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


class EagerPromptGraph:
    """What ``StepGraphs(query_len=Q, with_logits=False)`` offers the runner, run eagerly."""

    with_logits = False

    def __init__(self, core: EngineCore, q: int = Q, max_batch: int = 2) -> None:
        self.core, self.q, self.max_batch = core, q, max_batch
        self.max_len = core.max_model_len
        self.replays: list[int] = []  # rows of each replay

    def can_run(self, meta, num_seqs: int) -> bool:
        return (
            meta.max_query_len == self.q
            and meta.slot_mapping.shape[0] == num_seqs * self.q
            and num_seqs <= self.max_batch
            and meta.max_seq_len <= self.max_len
        )

    def run(self, input_ids, positions, meta):
        self.replays.append(meta.num_seqs)
        runner = self.core.runner
        return runner.model(input_ids, positions, runner.pool.kv, meta)


def _core(q: int = Q) -> tuple[EngineCore, EagerPromptGraph | None]:
    core = EngineCore(tiny_config())
    assert core.runner.inputs.prompt_graph_tokens == 0  # CPU: nothing captured
    if not q:
        return core, None
    graph = EagerPromptGraph(core, q)
    core.runner.graphs[q] = graph
    core.runner.inputs.prompt_graph_tokens = q  # as setup does once it is captured
    return core, graph


def _entry(core: EngineCore, rid: str, n: int, params=GREEDY) -> ScheduledSeq:
    (seq,) = core.add_request(rid, list(range(3, 3 + n)), params)
    assert core.kv.allocate(seq.block_table, n)
    return ScheduledSeq(seq, n)


def test_each_chunk_is_padded_to_the_graph_rows_and_samples_at_its_last_real_row() -> None:
    core, _ = _core()
    a, b = _entry(core, "a", 20), _entry(core, "b", Q)
    inputs = core.runner.prepare(StepPlan("prefill", [a, b]))
    meta = inputs.meta
    assert inputs.input_ids.shape == meta.slot_mapping.shape == (2 * Q,)
    assert meta.query_start_loc.tolist() == [0, Q, 2 * Q] and meta.max_query_len == Q
    assert meta.seq_lens.tolist() == [Q, Q]  # the padding counts: real tokens keep positions
    assert inputs.positions[:20].tolist() == list(range(20))
    assert inputs.positions[Q:].tolist() == list(range(Q))
    assert (meta.slot_mapping[20:Q] == -1).all() and (meta.slot_mapping[:20] >= 0).all()
    assert (meta.slot_mapping[Q:] >= 0).all()
    assert inputs.input_ids[:20].tolist() == list(range(3, 23))
    assert inputs.sample_rows == [19, 2 * Q - 1] and inputs.sample_seqs == [0, 1]


def test_only_short_plain_prompt_steps_take_the_graph() -> None:
    core, graph = _core()
    width = core.runner.inputs.prompt_graph_width
    assert width(StepPlan("prefill", [_entry(core, "a", Q)])) == Q
    assert width(StepPlan("prefill", [_entry(core, "long", Q + 1)])) == 0
    three = [_entry(core, f"r{i}", 4) for i in range(3)]
    assert width(StepPlan("prefill", three)) == 0  # more rows than the graph holds
    assert width(StepPlan("prefill", three[:2])) == Q
    assert width(StepPlan("mixed", three[:1])) == 0  # only the prefill lane
    scored = SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=1)
    assert width(StepPlan("prefill", [_entry(core, "scored", 5, scored)])) == 0
    graph.max_len = 40  # no room for Q positions after this chunk's start (40 - 32 < 10)
    (seq,) = core.add_request("late", list(range(3, 23)), GREEDY)
    assert core.kv.allocate(seq.block_table, 20)
    seq.num_computed_tokens = 10
    assert width(StepPlan("prefill", [ScheduledSeq(seq, 10)])) == 0
    graph.max_len = core.max_model_len
    assert width(StepPlan("prefill", [ScheduledSeq(seq, 10)])) == Q
    graph.with_logits = True  # a graph that makes logits is not a prompt graph
    assert width(StepPlan("prefill", [ScheduledSeq(seq, 10)])) == 0


def _serve(q: int, prompts: dict[str, tuple[list[int], SamplingParams]]):
    core, graph = _core(q)
    got: list = []

    async def launch(lane, plan):
        return core.launch(plan)

    d = LaneDispatcher(core, launch, got.append, 0.0)  # a waiting prompt goes first

    # one arrival per tick: steps of one and of two prompts
    serve_arrivals(core, d, [(rid, ids, p) for rid, (ids, p) in prompts.items()], 400)
    assert not core.has_unfinished()
    tokens: dict[str, list[int]] = {}
    for o in got:
        tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    core.check_integrity()
    return tokens, core.runner.pool.kv.clone(), graph


def test_the_prompt_graph_changes_no_token_and_no_kv() -> None:
    sampled = SamplingParams(max_tokens=8, temperature=0.9, seed=11, ignore_eos=True)
    shared = list(range(40, 72))  # two full blocks of 16: the second prompt reuses them
    prompts = {  # arriving one per tick, they are prefilled alone or in pairs, in this order
        "short": (list(range(3, 12)), GREEDY),
        "full": (list(range(5, 5 + Q)), GREEDY),
        "sampled": (list(range(9, 29)), sampled),
        "long": (list(range(7, 7 + 3 * Q)), GREEDY),  # longer than Q: eager
        "prefix": (shared + [1, 2, 3], GREEDY),
        "prefix-hit": (shared + [4, 5, 6, 7], GREEDY),  # 4 new tokens after 32 cached
    }
    want, want_kv, _ = _serve(0, prompts)
    got, got_kv, graph = _serve(Q, prompts)
    assert got == want and all(len(t) == 8 for t in got.values())
    assert graph.replays == [1, 2, 1]  # short; full + sampled; the prefix hit
    torch.testing.assert_close(got_kv, want_kv, rtol=0, atol=1e-5)


def test_prompt_graph_tokens_is_validated() -> None:
    assert tiny_config().prompt_graph_tokens == 256
    assert tiny_config(prompt_graph_tokens=0).prompt_graph_tokens == 0
    for bad in (-1, 8, 17, 5000, 256.0):
        with pytest.raises(ValueError, match="prompt_graph_tokens"):
            tiny_config(prompt_graph_tokens=bad)
