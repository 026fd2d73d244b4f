"""serve/front_text.py: the text a ``RemoteEngine`` front makes from token ids is the text the
engine makes, delta for delta (multi-byte characters split across tokens, stop tokens with and
without their text, ``min_tokens``, several choices), and only requests whose text the engine
never reads are detokenized in the front."""

from __future__ import annotations

import pytest
from helpers import bounded, tiny_config

from verifypd.lanes.async_engine import AsyncEngine
from verifypd.serve.front_text import FrontText, engine_params, front_detokenizes
from verifypd.types import SamplingParams


def test_only_requests_whose_text_the_engine_never_reads() -> None:
    assert front_detokenizes(SamplingParams(max_tokens=4))
    assert front_detokenizes(SamplingParams(max_tokens=4, stop_token_ids=[7], n=2))
    assert not front_detokenizes(SamplingParams(max_tokens=4, stop=["x"]))  # the engine stops
    assert not front_detokenizes(SamplingParams(max_tokens=4, logprobs=0))  # token texts
    assert not front_detokenizes(SamplingParams(max_tokens=4, prompt_logprobs=1))
    assert not front_detokenizes(SamplingParams(max_tokens=4, detokenize=False))  # ids only
    sent = engine_params(SamplingParams(max_tokens=4, seed=3))
    assert sent == SamplingParams(max_tokens=4, seed=3, detokenize=False)


def _key(outs) -> list[tuple]:
    return [(o.index, o.new_token_ids, o.new_text, o.finished, o.finish_reason) for o in outs]


@bounded(120)
async def test_the_front_makes_the_engines_text_delta_for_delta() -> None:
    engine = AsyncEngine(tiny_config())
    await engine.start()
    try:
        prompt = [5, 200, 17, 3, 99, 1]
        plain = SamplingParams(max_tokens=40, temperature=1.0, seed=11, ignore_eos=True)
        first = [o async for o in engine.generate("probe", prompt, plain)]
        ids = [t for o in first for t in o.new_token_ids]
        # a stop token with text of its own (a plain character, not a held-back byte)
        stop_id = next(o.new_token_ids[0] for o in first[3:] if o.new_text.isascii() and o.new_text)
        cases = [
            plain,
            SamplingParams(max_tokens=40, temperature=1.0, seed=11, n=2, ignore_eos=True),
            # a stop token mid-way, its text left out / kept, and stops not before 4 tokens
            SamplingParams(max_tokens=40, temperature=1.0, seed=11, stop_token_ids=[stop_id]),
            SamplingParams(
                max_tokens=40,
                temperature=1.0,
                seed=11,
                stop_token_ids=[stop_id],
                include_stop_str_in_output=True,
            ),  # fmt: skip
            SamplingParams(
                max_tokens=40, temperature=1.0, seed=11, stop_token_ids=[ids[1]], min_tokens=4
            ),  # fmt: skip
        ]
        texts = 0
        for i, params in enumerate(cases):
            assert front_detokenizes(params)
            mine = [o async for o in engine.generate(f"e{i}", prompt, params)]
            front = FrontText(engine.core.tokenizer, prompt, params)
            theirs = [
                front.fill(o) async for o in engine.generate(f"f{i}", prompt, engine_params(params))
            ]
            assert _key(theirs) == _key(mine), i
            texts += sum(len(o.new_text) for o in mine)
            assert not front.choices  # each choice's state goes with its last delta
        assert texts > 0  # there was text to compare
        # The tiny vocabulary maps most ids to single bytes: some delta held back a split
        # character (an empty text for a token), so the hold-back was exercised too.
        assert any(o.new_token_ids and not o.new_text for o in first)
    finally:
        await engine.stop()


def test_a_finished_choice_flushes_and_forgets() -> None:
    from verifypd.types import RequestOutput

    class Bytes:  # "é" is two bytes: the first alone decodes to U+FFFD and is held back
        def decode(self, ids, **_):
            return bytes(ids).decode("utf-8", errors="replace")

    front = FrontText(Bytes(), [104, 105], SamplingParams(max_tokens=4))
    out = front.fill(RequestOutput("r", 0, [0xC3], "", num_output_tokens=1))
    assert out.new_text == ""
    out = front.fill(RequestOutput("r", 0, [0xA9], "", num_output_tokens=2))
    assert out.new_text == "é"
    out = front.fill(RequestOutput("r", 0, [], "", True, "abort", num_output_tokens=2))
    assert (out.new_text, out.finish_reason) == ("", "abort") and not front.choices


@pytest.mark.parametrize("reason", ["stop", "length"])
def test_a_stop_token_leaves_its_text_out(reason: str) -> None:
    from verifypd.types import RequestOutput

    class Letters:
        def decode(self, ids, **_):
            return "".join(chr(i) for i in ids)

    front = FrontText(Letters(), [], SamplingParams(max_tokens=3, stop_token_ids=[ord("z")]))
    out = front.fill(RequestOutput("r", 0, [ord("a"), ord("z")], "", True, reason,
                                   num_output_tokens=2))  # fmt: skip
    assert out.new_text == ("a" if reason == "stop" else "az")
