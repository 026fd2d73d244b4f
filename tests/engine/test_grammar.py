"""Grammar masks (engine.grammar) on the embedded SmolLM2 tokenizer, without a model forward:
compile errors name their field, the device mask equals a per-token reference, and a verify's
masks and draft cut equal what a fresh matcher says after each draft prefix."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verifypd.engine.device_drafts import DeviceDrafts
from verifypd.engine.grammar import (
    GrammarCompiler,
    GrammarTable,
    apply_token_bitmask,
    bitmask_words,
    fill_step_masks,
)
from verifypd.engine.tokenizer import load_tokenizer
from verifypd.types import ParamError, SamplingParams, ScheduledSeq, Sequence, StructuredOutput

VOCAB = 49152
EOS = 2
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "n": {"type": "integer"}},
    "required": ["city", "n"],
}


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("default")


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, VOCAB, [EOS])


def _allowed(bitmask: torch.Tensor, row: int) -> set[int]:
    bits = apply_token_bitmask(torch.zeros(1, VOCAB), bitmask[row : row + 1])
    return set(torch.nonzero(bits[0] == 0).flatten().tolist())


@pytest.mark.parametrize(
    ("so", "fragment"),
    [
        (StructuredOutput("json", '{"type": "wizard"}', "response_format"), "wizard"),
        (StructuredOutput("json", '{"type": ', "response_format"), "JSON"),
        (StructuredOutput("regex", "(ab", "structured_outputs"), "parenthesis"),
        (StructuredOutput("grammar", 'root ::= "a" |', "guided_grammar"), "EBNF"),
        (StructuredOutput("choice", "[]", "structured_outputs"), "choice"),
    ],
)
def test_invalid_constraint_is_a_param_error_naming_its_field(compiler, so, fragment):
    with pytest.raises(ParamError) as err:
        compiler.compile(so)
    assert err.value.param == so.param
    assert fragment in str(err.value)
    assert "/project/cpp" not in str(err.value)  # xgrammar's source location is stripped


@settings(max_examples=25, deadline=None)
@given(
    bits=st.lists(st.integers(-(2**31), 2**31 - 1), min_size=6, max_size=6),
    vocab=st.integers(1, 6 * 32 + 7),
)
def test_apply_token_bitmask_matches_per_token_reference(bits, vocab):
    bitmask = torch.tensor([bits[:3], bits[3:]], dtype=torch.int32)  # [2, 3]: 96 tokens
    logits = torch.randn(2, vocab)
    got = apply_token_bitmask(logits, bitmask)
    for r in range(2):
        for v in range(vocab):
            ok = v < 96 and (bits[3 * r + v // 32] >> (v % 32)) & 1
            assert got[r, v].item() == (logits[r, v].item() if ok else float("-inf"))


def _entry(tokenizer, table: GrammarTable, so: StructuredOutput, output: str, drafts: list[int]):
    seq = Sequence("r", [1, 2, 3], SamplingParams(max_tokens=64, structured=so))
    seq.token_ids += tokenizer.encode(output, add_special_tokens=False)
    table.add(seq, table.compile(so))
    return ScheduledSeq(seq, 1, list(drafts))


def _fresh_allowed(tokenizer, compiler, so, text_ids: list[int]) -> set[int]:
    table = GrammarTable(compiler)
    entry = _entry(tokenizer, table, so, "", [])
    entry.seq.token_ids += text_ids
    mask = fill_step_masks(table, [(entry, 1)], {})
    return _allowed(mask, 0)


def test_verify_masks_follow_the_drafts_and_cut_at_the_first_bad_one(tokenizer, compiler):
    so = StructuredOutput("json", json.dumps(SCHEMA))
    enc = lambda s: tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    brace = tokenizer.convert_tokens_to_ids("}")
    done, good, bad = '{"city": "Paris", ', enc('"n": 1'), [brace, brace]
    drafts = good + bad  # the first "}" after `1` is grammatical, the second is not
    table = GrammarTable(compiler)
    entry = _entry(tokenizer, table, so, done, drafts)
    mask = fill_step_masks(table, [(entry, 1 + len(drafts))], {id(entry): drafts})
    assert entry.draft_token_ids == good + bad[:1]
    prefix = entry.seq.output_token_ids
    for j in range(len(entry.draft_token_ids) + 1):
        want = _fresh_allowed(tokenizer, compiler, so, prefix + drafts[:j])
        assert _allowed(mask, j) == want, j
    assert _allowed(mask, len(drafts)) == set(range(VOCAB))  # past the cut: unconstrained
    # The matcher was rolled back: the next plain step's mask is the one after the output.
    again = fill_step_masks(table, [(entry, 1)], {})
    assert _allowed(again, 0) == _fresh_allowed(tokenizer, compiler, so, prefix)


def test_sampled_drafts_keep_their_first_ungrammatical_token(tokenizer, compiler):
    """With drafter probabilities the verify must reject the bad draft (and draw from
    max(0, p - q)), not stop before it (and draw from p): the bad draft stays, masked out."""
    so = StructuredOutput("json", json.dumps(SCHEMA))
    brace = tokenizer.convert_tokens_to_ids("}")
    good = tokenizer.encode('"n": 1', add_special_tokens=False)
    drafts = good + [brace, brace, brace]
    table = GrammarTable(compiler)
    entry = _entry(tokenizer, table, so, '{"city": "Paris", ', drafts)
    entry.drafts = DeviceDrafts(probs=torch.full((len(drafts), VOCAB), 1.0 / VOCAB))
    mask = fill_step_masks(table, [(entry, 1 + len(drafts))], {id(entry): drafts})
    assert entry.draft_token_ids == good + [brace, brace]
    assert entry.drafts.probs.shape[0] == len(good) + 2
    assert brace not in _allowed(mask, len(good) + 1)  # so the kept bad draft is rejected


def test_unconstrained_steps_build_no_mask(tokenizer, compiler):
    table = GrammarTable(compiler)
    seq = Sequence("r", [1, 2, 3], SamplingParams())
    assert fill_step_masks(table, [(ScheduledSeq(seq, 1), 1)], {}) is None
    so = StructuredOutput("choice", json.dumps(["yes", "no"]))
    entry = _entry(tokenizer, table, so, "", [])
    mask = fill_step_masks(table, [(ScheduledSeq(seq, 1), 1), (entry, 1)], {})
    assert mask.shape == (2, bitmask_words(VOCAB))
    assert _allowed(mask, 0) == set(range(VOCAB))
    allowed = {tokenizer.decode([t]) for t in _allowed(mask, 1)}
    assert allowed == {"y", "ye", "yes", "n", "no"}


def test_a_finished_grammar_allows_only_eos(tokenizer, compiler):
    so = StructuredOutput("regex", "[0-9]{2}")
    table = GrammarTable(compiler)
    entry = _entry(tokenizer, table, so, "42", [])
    assert _allowed(fill_step_masks(table, [(entry, 1)], {}), 0) == {EOS}
