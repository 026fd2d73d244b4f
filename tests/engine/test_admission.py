"""RequestLimits: exact worst-case block counts and the refusals they lead to."""

from __future__ import annotations

import pytest

from verifypd.engine.admission import RequestLimits
from verifypd.types import ParamError, SamplingParams

LIMITS = RequestLimits(vocab_size=100, max_model_len=64, num_blocks=20, block_size=8,
                       kv_share=0.5, draft_slack=4)  # fmt: skip


def test_worst_case_blocks_and_the_longest_choice() -> None:
    assert LIMITS.max_request_blocks == 10
    assert LIMITS.request_blocks(num_prompt=5, max_tokens=7, n=1) == 2  # 5 + 7 + 4 = 16
    assert LIMITS.request_blocks(num_prompt=5, max_tokens=8, n=3) == 9  # 17 tokens: 3 blocks
    assert LIMITS.max_choice_len(1) == 64  # 10 blocks = 80 - 4 slots, capped by the context
    assert LIMITS.max_choice_len(3) == 3 * 8 - 4
    assert LIMITS.request_blocks(0, LIMITS.max_choice_len(3), 3) == 9


@pytest.mark.parametrize(
    ("prompt", "params", "param"),
    [
        ([], SamplingParams(), "prompt"),
        ([100], SamplingParams(), "prompt"),
        ([1], SamplingParams(stop_token_ids=[-1]), "stop_token_ids"),
        ([1], SamplingParams(top_k=101), "top_k"),
        ([1] * 60, SamplingParams(max_tokens=5), "prompt"),
        ([1], SamplingParams(max_tokens=64), "max_tokens"),
        ([1] * 64, SamplingParams(max_tokens=1), "prompt"),
        ([1] * 5, SamplingParams(max_tokens=8, n=4), "max_tokens"),  # 12 blocks > 10
    ],
)
def test_refusals_name_the_field(prompt, params, param) -> None:
    with pytest.raises(ParamError) as err:
        LIMITS.validate(prompt, params)
    assert err.value.param == param


def test_a_request_at_its_share_is_admitted() -> None:
    LIMITS.validate([1] * 5, SamplingParams(max_tokens=8, n=3, top_k=100, stop_token_ids=[99]))


@pytest.mark.parametrize(("num_prompt", "max_tokens"), [(60, 5), (64, 1), (1, 64), (0, 1)])
def test_the_server_refuses_with_the_engines_message(num_prompt, max_tokens) -> None:
    """One context rule: the server's 400 (before admission) is the engine's ParamError."""
    from verifypd.serve.errors import APIError
    from verifypd.serve.limits import resolve_max_tokens

    with pytest.raises(ParamError) as engine_err:
        LIMITS.validate([1] * num_prompt, SamplingParams(max_tokens=max_tokens))
    with pytest.raises(APIError) as serve_err:
        resolve_max_tokens(num_prompt, max_tokens, LIMITS.max_model_len, "prompt")
    assert serve_err.value.message == str(engine_err.value)
    assert serve_err.value.param == engine_err.value.param and serve_err.value.status == 400
