"""Log-probs through every step kind on a tiny dummy model (fast, CPU): with speculation the
verified tokens carry the same log-probs as without it, a stop inside a verify keeps one
log-prob per kept token, and prompt log-probs survive chunking, preemption and n > 1."""

from __future__ import annotations

import pytest
from helpers import tiny_config, tiny_draft_spec

from verifypd.config import CacheConfig, SchedulerConfig, SpecConfig
from verifypd.llm import LLM
from verifypd.types import SamplingParams

PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [1, 2, 3], list(range(40, 75))]
TOL = 1e-4


def _llm(spec: SpecConfig | None = None, cache: CacheConfig | None = None, **sched) -> LLM:
    config = tiny_config(
        spec=spec or SpecConfig(), scheduler=SchedulerConfig(**sched), cache=cache or CacheConfig()
    )
    return LLM(config=config)


def _params(**kw) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 12, "temperature": 0.0, "ignore_eos": True,
                             "logprobs": 3, "prompt_logprobs": 2, **kw})  # fmt: skip


def _assert_same(got, want) -> None:
    assert got.token_ids == want.token_ids
    for a, b in zip(got.logprobs, want.logprobs, strict=True):
        _assert_close(a, b)


def _assert_close(a, b) -> None:
    assert a.token_id == b.token_id and abs(a.logprob - b.logprob) <= TOL
    assert [t for t, _ in a.top] == [t for t, _ in b.top]
    assert all(abs(x - y) <= TOL for (_, x), (_, y) in zip(a.top, b.top, strict=True))


@pytest.fixture(scope="module")
def plain():
    return _llm().generate(PROMPTS, _params())


def test_shapes_of_output_and_prompt_logprobs(plain):
    for prompt, out in zip(PROMPTS, plain, strict=True):
        choice = out.outputs[0]
        assert len(choice.logprobs) == len(choice.token_ids) == 12
        assert all(len(lp.top) == 3 for lp in choice.logprobs)
        assert choice.prompt_logprobs[0] is None
        assert [lp.token_id for lp in choice.prompt_logprobs[1:]] == prompt[1:]
        assert all(len(lp.top) == 2 for lp in choice.prompt_logprobs[1:])
        # Greedy: every token is its position's most likely one.
        assert all(lp.top[0] == (lp.token_id, lp.logprob) for lp in choice.logprobs)


@pytest.mark.parametrize(
    "spec",
    [SpecConfig(method="ngram", controller=False),
     tiny_draft_spec()],
    ids=["ngram", "draft-self"],
)  # fmt: skip
def test_speculation_keeps_tokens_and_logprobs(plain, spec):
    llm = _llm(spec)
    outs = llm.generate(PROMPTS, _params())
    assert llm.core.spec.num_accepted > 0
    for got, want in zip(outs, plain, strict=True):
        _assert_same(got.outputs[0], want.outputs[0])
        assert got.outputs[0].prompt_logprobs == want.outputs[0].prompt_logprobs


def test_stop_inside_a_verify_keeps_one_logprob_per_token(plain):
    stop_at = plain[0].token_ids[6]
    spec = tiny_draft_spec()
    out = _llm(spec).generate(PROMPTS[0], _params(stop_token_ids=[stop_at]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] == stop_at
    assert len(out.logprobs) == len(out.token_ids) < 12
    for a, b in zip(out.logprobs, plain[0].outputs[0].logprobs, strict=False):
        assert a.token_id == b.token_id and abs(a.logprob - b.logprob) <= TOL


def test_prompt_logprobs_across_chunks_and_choices(plain):
    llm = _llm(max_prefill_chunk=4)
    outs = llm.generate(PROMPTS, _params(n=2))
    for got, want in zip(outs, plain, strict=True):
        for choice in got.outputs:
            _assert_same(choice, want.outputs[0])
            for a, b in zip(choice.prompt_logprobs[1:], want.outputs[0].prompt_logprobs[1:],
                            strict=True):  # fmt: skip
                assert a.token_id == b.token_id and abs(a.logprob - b.logprob) <= TOL


def test_prompt_logprobs_survive_preemption():
    """A KV cache too small for all three as they grow: sequences are preempted and
    recomputed; each prompt's log-probs are still complete, equal to an unpreempted run's."""
    prompts = [list(range(i, i + 14)) for i in (10, 100, 200)]  # 14 + 12 tokens: 2 blocks each
    want = _llm().generate(prompts, _params())
    llm = _llm(cache=CacheConfig(num_blocks=4, block_size=16))
    outs = llm.generate(prompts, _params())
    assert llm.core.scheduler.num_preemptions > 0
    for got, ref in zip(outs, want, strict=True):
        _assert_same(got.outputs[0], ref.outputs[0])
        assert got.outputs[0].prompt_logprobs == ref.outputs[0].prompt_logprobs


def test_sampled_speculation_scores_tokens_with_the_target():
    """Temperature sampling with a draft model (rejection sampling, resampled and bonus
    tokens): every output token's log-prob equals the target's score of it, taken from a plain
    engine's prompt log-probs over prompt + output."""
    spec = tiny_draft_spec()
    llm = _llm(spec)
    outs = llm.generate(PROMPTS, _params(temperature=0.8, seed=3, prompt_logprobs=None))
    assert llm.core.spec.num_verifies > 0
    scorer = _llm()
    for prompt, out in zip(PROMPTS, outs, strict=True):
        choice = out.outputs[0]
        full = prompt + choice.token_ids
        [ref] = scorer.generate([full], _params(max_tokens=1, prompt_logprobs=3))
        want = ref.outputs[0].prompt_logprobs[len(prompt) :]
        assert len(want) == len(choice.logprobs) == 12
        for a, b in zip(choice.logprobs, want, strict=True):
            _assert_close(a, b)


def test_prompt_logprobs_bypass_prefix_reuse(plain):
    """The third prompt's two full blocks are in the prefix cache after ``plain``'s run on a
    fresh engine; asking for prompt log-probs again must not skip them."""
    llm = _llm()
    first = llm.generate(PROMPTS[2], _params(prompt_logprobs=None))[0]
    assert first.num_cached_tokens == 0
    again = llm.generate(PROMPTS[2], _params())[0]
    assert again.num_cached_tokens == 0
    assert again.outputs[0].prompt_logprobs == plain[2].outputs[0].prompt_logprobs
    reused = llm.generate(PROMPTS[2], _params(prompt_logprobs=None))[0]
    assert reused.num_cached_tokens == 32  # other requests still reuse the cache
