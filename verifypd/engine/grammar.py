"""Structured output: grammar-constrained decoding through xgrammar.

Each constrained sequence owns an xgrammar ``GrammarMatcher``. Before a step, the host brings
the matcher up to the sequence's tokens and fills one bitmask row per logits row the step
samples from (``fill_step_masks``); the device turns the bitmask into -inf on the disallowed
logits (``apply_token_bitmask``). Only steps with a constrained sequence do any of this.

Speculation: a constrained sequence's drafts are walked through its matcher, the draft is cut
at the first ungrammatical token, and a mask is filled for every verify position (the position
after the accepted drafts d_1..d_j); then the matcher is rolled back. So the verify only ever
accepts grammatical tokens, and greedy output is the same with speculation on or off.

Why xgrammar and not llguidance: measured on this project's 2-core CPU with the SmolLM2
tokenizer (49152 tokens), filling one mask for a JSON schema took a median 4 us (mean 7-12 us)
with xgrammar against a median 24-43 us (mean 0.17-0.7 ms, spikes to 16 ms) with llguidance
(``bench/grammar_mask.py``; docs/api.md).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from verifypd.engine.device_drafts import drafter_probs
from verifypd.types import ParamError, ScheduledSeq, Sequence, StructuredOutput

JSON_OBJECT_SCHEMA = '{"type": "object"}'
_XGR_PREFIX = re.compile(r"^\[[\d:]+\] \S+?:\d+: (Check failed: \(.*?\) is false: )?")


def _import_xgrammar():
    import xgrammar

    return xgrammar


def bitmask_words(vocab_size: int) -> int:
    """int32 words per bitmask row: bit ``v % 32`` of word ``v // 32`` allows token v."""
    return (vocab_size + 31) // 32


class GrammarCompiler:
    """Compiles request constraints for one tokenizer (xgrammar caches compiled grammars).

    The tokenizer's vocabulary is analysed on first use (~0.4 s for SmolLM2), not at start-up.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self._compiler = None

    def _get(self, param: str):
        if self._compiler is None:
            xgr = _import_xgrammar()
            try:
                info = xgr.TokenizerInfo.from_huggingface(
                    self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
                )
            except Exception as exc:
                msg = f"'{param}' needs a Hugging Face tokenizer, which this model lacks: {exc}"
                raise ParamError(param, msg) from None
            self._compiler = xgr.GrammarCompiler(info)
        return self._compiler

    def compile(self, so: StructuredOutput):
        """The compiled grammar of ``so``; an invalid one is a ParamError naming ``so.param``."""
        compiler = self._get(so.param)
        try:
            return _compile(compiler, so)
        except ParamError:
            raise
        except Exception as exc:  # xgrammar reports every bad input as a RuntimeError
            msg = _XGR_PREFIX.sub("", str(exc).strip()).splitlines()[0]
            raise ParamError(so.param, f"Invalid {so.kind} in '{so.param}': {msg}") from None


def _compile(compiler, so: StructuredOutput):
    if so.kind == "json":
        return compiler.compile_json_schema(so.spec, any_whitespace=False)
    if so.kind == "json_object":
        return compiler.compile_json_schema(JSON_OBJECT_SCHEMA, any_whitespace=False)
    if so.kind == "regex":
        return compiler.compile_regex(so.spec)
    if so.kind == "grammar":
        return compiler.compile_grammar(so.spec)
    if so.kind == "choice":
        return compiler.compile_grammar(choice_ebnf(json.loads(so.spec)))
    raise ParamError(so.param, f"unknown structured output kind {so.kind!r}")


def choice_ebnf(choices: list[str]) -> str:
    """An EBNF grammar matching exactly one of ``choices`` (JSON string escapes are EBNF's)."""
    if not choices or not all(isinstance(c, str) and c for c in choices):
        raise ParamError("structured_outputs", "'choice' must be a list of non-empty strings")
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


@dataclass
class SeqGrammar:
    """One sequence's matcher; ``num_consumed``: output tokens it has accepted so far."""

    matcher: Any
    num_consumed: int = 0
    is_broken: bool = False  # a token it refused reached the sequence: stop constraining

    def catch_up(self, output_ids: list[int]) -> None:
        """Accepts the tokens the sequence got since the last step."""
        for tok in output_ids[self.num_consumed :]:
            if self.is_broken or self.matcher.is_terminated():
                break
            if not self.matcher.accept_token(tok):
                self.is_broken = True
        self.num_consumed = len(output_ids)

    def fill(self, bitmask: Tensor, row: int) -> None:
        """Row ``row`` of ``bitmask`` = the tokens allowed next (all, once terminated)."""
        if not self.is_broken and not self.matcher.is_terminated():
            self.matcher.fill_next_token_bitmask(bitmask, row)

    def fill_verify(self, drafts: list[int], bitmask: Tensor, first_row: int) -> int:
        """Masks for the verify positions after each grammatical draft prefix; returns how
        many leading drafts are grammatical (the matcher ends where it began)."""
        self.fill(bitmask, first_row)
        if self.is_broken:
            return len(drafts)
        num_valid = 0
        for tok in drafts:
            if self.matcher.is_terminated() or not self.matcher.accept_token(tok):
                break
            num_valid += 1
            self.fill(bitmask, first_row + num_valid)
        self.matcher.rollback(num_valid)
        return num_valid


@dataclass
class GrammarTable:
    """The live sequences' grammars, by seq id; the runner asks it for each step's masks."""

    compiler: GrammarCompiler
    grammars: dict[int, SeqGrammar] = field(default_factory=dict)

    @property
    def vocab_size(self) -> int:
        return self.compiler.vocab_size

    def compile(self, so: StructuredOutput | None):
        return None if so is None else self.compiler.compile(so)

    def add(self, seq: Sequence, compiled) -> None:
        xgr = _import_xgrammar()
        self.grammars[seq.seq_id] = SeqGrammar(xgr.GrammarMatcher(compiled))

    def forget(self, seq_id: int) -> None:
        self.grammars.pop(seq_id, None)

    def constrained(self, entries: list[ScheduledSeq]) -> bool:
        return bool(self.grammars) and any(e.seq.seq_id in self.grammars for e in entries)


def read_drafts(table: GrammarTable | None, entries: list[ScheduledSeq]) -> dict[int, list[int]]:
    """Host copies of the constrained entries' drafts, by ``id(entry)``. Call before the step's
    forward is enqueued: drafts still on the device cost a wait for the drafter only."""
    if table is None or not table.grammars:
        return {}
    return {
        id(e): e.draft_ids()
        for e in entries
        if e.draft_token_ids and e.seq.seq_id in table.grammars
    }


def fill_step_masks(
    table: GrammarTable,
    rows: list[tuple[ScheduledSeq, int]],
    drafts: dict[int, list[int]],
) -> Tensor | None:
    """The host half of one step: ``rows`` lists each sampling entry with its number of logits
    rows (1, or 1 + L for a verify), in logits order. Returns the [R, W] int32 bitmask (all
    ones for unconstrained rows), or None when no entry is constrained. Cuts each constrained
    entry's drafts at its first ungrammatical token (``_drafts_to_keep``)."""
    if not table.constrained([e for e, _ in rows]):
        return None
    total = sum(n for _, n in rows)
    # numpy, not torch.full: on a busy CPU torch's thread pool makes that fill take ms.
    bitmask = torch.from_numpy(np.full((total, bitmask_words(table.vocab_size)), -1, np.int32))
    row = 0
    for entry, num_rows in rows:
        grammar = table.grammars.get(entry.seq.seq_id)
        if grammar is not None:
            grammar.catch_up(entry.seq.output_token_ids)
            if num_rows == 1:
                grammar.fill(bitmask, row)
            else:
                ids = drafts.get(id(entry), [])
                entry.truncate_drafts(_drafts_to_keep(grammar.fill_verify(ids, bitmask, row),
                                                      len(ids), entry))  # fmt: skip
        row += num_rows
    return bitmask


def _drafts_to_keep(num_valid: int, num_drafts: int, entry: ScheduledSeq) -> int:
    """The grammatical drafts; a sampled draft (one with the drafter's distributions) keeps its
    first ungrammatical token too: the verify then rejects it (its masked p is 0) and draws
    from max(0, p - q), which is what keeps rejection sampling exact. Cutting it would draw
    from p instead. For
    deterministic drafts (one-hot q) the two are the same, and the cut saves verify work."""
    if drafter_probs(entry) is not None and num_valid < num_drafts:
        return num_valid + 1
    return num_valid


def apply_token_bitmask(logits: Tensor, bitmask: Tensor) -> Tensor:
    """The device half: [N, V] logits, [N, W] int32 bitmask (on the logits' device) -> logits
    with -inf wherever the token's bit is 0. Columns past the bitmask's vocabulary (a padded
    embedding) are disallowed."""
    num_rows, vocab = logits.shape
    shifts = torch.arange(32, device=logits.device, dtype=torch.int32)
    bits = ((bitmask[:, :, None] >> shifts) & 1).view(num_rows, -1)  # [N, 32 W]
    if bits.shape[1] < vocab:
        bits = torch.nn.functional.pad(bits, (0, vocab - bits.shape[1]))
    return logits.masked_fill(bits[:, :vocab] == 0, float("-inf"))
