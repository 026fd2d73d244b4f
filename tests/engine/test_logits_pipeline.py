"""The logits pipeline (penalties, logit_bias, min_tokens, bad_words) against a one-row
reference, position by position, for plain rows and for verify rows with drafts."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from logits_reference import reference_row

from verifypd.engine.logits_pipeline import LogitsProcessor
from verifypd.engine.logits_stages import with_drafts
from verifypd.types import ParamError, SamplingParams, SeqStatus, Sequence

V = 11
EOS = frozenset({10})


def _seq(prompt: list[int], output: list[int], params: SamplingParams) -> Sequence:
    seq = Sequence("r", prompt, params)
    seq.token_ids += output
    return seq


tokens = st.lists(st.integers(0, V - 1), max_size=6)
params_strategy = st.builds(
    SamplingParams,
    max_tokens=st.just(32),
    presence_penalty=st.sampled_from([0.0, 0.0, 1.5, -0.5]),
    frequency_penalty=st.sampled_from([0.0, 0.0, 0.7, -1.0]),
    repetition_penalty=st.sampled_from([1.0, 1.0, 1.3, 0.8]),
    logit_bias=st.one_of(st.none(), st.dictionaries(st.integers(0, V - 1), st.floats(-100, 100))),
    min_tokens=st.sampled_from([0, 0, 2, 5]),
    stop_token_ids=st.lists(st.integers(0, V - 1), max_size=2),
    ignore_eos=st.booleans(),
    bad_words_token_ids=st.one_of(st.none(), st.lists(st.lists(st.integers(0, V - 1),
                                                               min_size=1, max_size=3))),
)  # fmt: skip


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    rows=st.lists(st.tuples(tokens.filter(bool), tokens, params_strategy, tokens), min_size=1,
                  max_size=4),
    seed=st.integers(0, 2**31),
)  # fmt: skip
def test_each_verify_position_is_processed_as_if_its_drafts_were_output(rows, seed):
    """Position j of a verify equals the reference applied after output + drafts[:j]; rows of
    requests without any control are returned bit for bit."""
    seqs = [_seq(prompt, output, params) for prompt, output, params, _ in rows]
    width = max(len(d) for *_, d in rows)
    drafts = torch.tensor([d + [0] * (width - len(d)) for *_, d in rows], dtype=torch.int64)
    num_drafts = torch.tensor([len(d) for *_, d in rows])
    logits = torch.randn(len(rows), width + 1, V, generator=torch.Generator().manual_seed(seed))
    raw = logits.clone()
    out = LogitsProcessor(torch.device("cpu"), EOS).process(logits, seqs, drafts, num_drafts)
    assert torch.equal(logits, raw), "the raw logits must not be modified"
    for b, (prompt, output, params, d) in enumerate(rows):
        for j in range(len(d) + 1):
            want = reference_row(raw[b, j], prompt, output + d[:j], params, EOS)
            torch.testing.assert_close(out[b, j], want, rtol=0, atol=1e-5)


def test_no_control_is_the_fast_path():
    seqs = [_seq([1, 2], [3], SamplingParams(temperature=0))]
    logits = torch.randn(1, V)
    assert LogitsProcessor(torch.device("cpu")).process(logits, seqs) is logits


def test_only_requests_with_a_control_are_processed():
    plain = _seq([1, 2], [3, 3], SamplingParams())
    penalised = _seq([1, 2], [3, 3], SamplingParams(frequency_penalty=1.0))
    logits = torch.randn(2, V)
    out = LogitsProcessor(torch.device("cpu")).process(logits, [plain, penalised])
    assert torch.equal(out[0], logits[0])
    assert out[1, 3] == logits[1, 3] - 2.0


def test_counts_follow_each_step_and_rows_are_reused():
    """Counts are updated with each step's new tokens only, and a finished sequence's row goes
    to the next sequence, zeroed."""
    proc = LogitsProcessor(torch.device("cpu"))
    params = SamplingParams(presence_penalty=1.0, repetition_penalty=1.5)
    first = _seq([4, 5], [], params)
    for step_tokens in ([1], [1, 2], [7]):  # a plain step, then a verify that accepted one
        first.token_ids += step_tokens
        proc.process(torch.zeros(1, V), [first])
        counts = proc.counts.output[proc.counts.rows[first.seq_id].index]
        assert counts.tolist() == torch.bincount(torch.tensor(first.output_token_ids),
                                                 minlength=V).float().tolist()  # fmt: skip
    row = proc.counts.rows[first.seq_id].index
    first.status = SeqStatus.FINISHED
    second = _seq([6], [9], params)
    proc.process(torch.zeros(1, V), [second])
    assert proc.counts.rows[second.seq_id].index == row and first.seq_id not in proc.counts.rows
    assert proc.counts.output[row].nonzero().flatten().tolist() == [9]
    assert proc.counts.prompt[row].nonzero().flatten().tolist() == [6]


def test_with_drafts_counts_only_earlier_real_drafts():
    base = torch.tensor([[0.0, 1.0, 0.0], [2.0, 0.0, 0.0]])
    drafts = torch.tensor([[1, 2], [0, 0]])
    got = with_drafts(base, drafts, torch.tensor([2, 1]))
    assert got.tolist() == [
        [[0, 1, 0], [0, 2, 0], [0, 2, 1]],
        [[2, 0, 0], [3, 0, 0], [3, 0, 0]],  # its second draft is padding
    ]


@pytest.mark.parametrize(
    ("field", "value"),
    [("presence_penalty", 2.01), ("frequency_penalty", -3), ("repetition_penalty", 0.0),
     ("repetition_penalty", float("inf")), ("min_tokens", -1), ("min_tokens", 17),
     ("logit_bias", {1: 100.5}), ("logit_bias", {1: float("nan")})],
)  # fmt: skip
def test_out_of_range_values_name_their_field(field, value):
    with pytest.raises(ParamError) as err:
        SamplingParams(max_tokens=16, **{field: value})
    assert err.value.param == field
