"""SamplingParams.detokenize=False (vLLM's field): the same tokens, no text, stop strings refused,
stop tokens and EOS still honoured, and nothing left behind in the KV cache."""

from __future__ import annotations

import pytest
from helpers import tiny_config

from verifypd.llm import LLM
from verifypd.types import ParamError, SamplingParams

PROMPTS = [[5, 9, 13, 2, 7], [3, 1, 4, 1, 5, 9, 2, 6], [11] * 20]


@pytest.fixture(scope="module")
def llm():
    engine = LLM(config=tiny_config())
    yield engine
    engine.close()


def _params(**kw) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 10, "temperature": 0.0, "ignore_eos": True, **kw})


def test_stop_strings_need_text():
    with pytest.raises(ParamError) as err:
        SamplingParams(stop=["x"], detokenize=False)
    assert err.value.param == "stop"
    assert "detokenize" in str(err.value)


@pytest.mark.parametrize("seeded", [False, True])
def test_same_tokens_without_text(llm, seeded):
    sampled = {"temperature": 0.8, "seed": 7} if seeded else {}
    with_text = llm.generate(PROMPTS, _params(**sampled))
    ids_only = llm.generate(PROMPTS, _params(detokenize=False, **sampled))
    for a, b in zip(with_text, ids_only, strict=True):
        assert a.token_ids == b.token_ids and len(a.token_ids) == 10
        assert a.outputs[0].finish_reason == b.outputs[0].finish_reason == "length"
        assert a.text != "" and b.text == ""
    assert llm.engine.core.kv.num_free_blocks == llm.engine.core.kv.num_blocks


def test_stop_tokens_still_end_a_request(llm):
    free = llm.generate(PROMPTS[:1], _params(detokenize=False))[0].token_ids
    stop_at = free[3]
    out = llm.generate(PROMPTS[:1], _params(detokenize=False, stop_token_ids=[stop_at]))[0]
    assert out.outputs[0].finish_reason == "stop"
    assert out.token_ids == free[: free.index(stop_at) + 1]
