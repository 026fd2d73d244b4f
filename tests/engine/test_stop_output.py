"""Stop handling of the sampling controls: include_stop_str_in_output for stop strings and stop
tokens, and min_tokens holding stop strings (and stop tokens) back."""

from __future__ import annotations

import pytest

from verifypd.engine.detokenizer import IncrementalDetokenizer, StopChecker, push_output
from verifypd.engine.scheduler import Scheduler
from verifypd.kvcache import KVCacheManager
from verifypd.types import SamplingParams, Sequence


class CharTokenizer:
    """Token i is the letter chr(ord('a') + i); token 25 ('z') is special (EOS)."""

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
        return "".join(chr(97 + i) for i in ids if not (skip_special_tokens and i == 25))


def _ids(text: str) -> list[int]:
    return [ord(c) - 97 for c in text]


def _run(output: str, params: SamplingParams, finish_reason: str | None = None, chunk: int = 2):
    """Streams ``output`` in chunks through push_output; returns (text, stop string hit)."""
    seq = Sequence("r", [0], params)
    detok = IncrementalDetokenizer(CharTokenizer(), [0])
    stop = StopChecker(params.stop, params.include_stop_str_in_output)
    ids, text = _ids(output), ""
    for start in range(0, len(ids), chunk):
        new = ids[start : start + chunk]
        seq.token_ids += new
        if start + chunk >= len(ids):
            seq.finish_reason = finish_reason
        piece, hit = push_output(detok, stop, new, start, seq)
        text += piece
        if hit:
            return text, True
    return text + stop.flush(), False


@pytest.mark.parametrize(("include", "want"), [(False, "abc"), (True, "abcxy")])
def test_stop_string_text_is_kept_only_when_asked(include, want):
    params = SamplingParams(stop=["xy", "q"], include_stop_str_in_output=include)
    assert _run("abcxyqrs", params) == (want, True)


@pytest.mark.parametrize(("include", "want"), [(False, "abc"), (True, "abcd")])
def test_stop_token_text_is_kept_only_when_asked(include, want):
    params = SamplingParams(stop_token_ids=[3], include_stop_str_in_output=include)
    assert _run("abcd", params, finish_reason="stop") == (want, False)


def test_a_length_finish_keeps_its_last_token():
    assert _run("abcd", SamplingParams(stop_token_ids=[3]), finish_reason="length")[0] == "abcd"


def test_stop_strings_are_not_looked_for_before_min_tokens():
    """The text of the first min_tokens tokens is never searched: 'xy' at tokens 2-3 is passed
    over with min_tokens 4, the one at tokens 6-7 stops."""
    params = SamplingParams(stop=["xy"], min_tokens=4)
    assert _run("axyabbxyc", params) == ("axyabb", True)
    assert _run("axyabbxyc", SamplingParams(stop=["xy"])) == ("a", True)


def test_the_scheduler_never_stops_before_min_tokens():
    sched = Scheduler(KVCacheManager(16, 4, False), max_num_seqs=4, max_num_batched_tokens=64,
                      max_prefill_chunk=64, max_model_len=64, eos_token_ids=[25])  # fmt: skip
    seq = Sequence("r", [0], SamplingParams(max_tokens=8, min_tokens=3, stop_token_ids=[5]))
    assert sched._append(seq, [25, 5]) is None  # outputs 1 and 2: too early to stop
    assert sched._append(seq, [1, 5]) == "stop"  # output 4 may stop
    assert seq.num_output_tokens == 4
