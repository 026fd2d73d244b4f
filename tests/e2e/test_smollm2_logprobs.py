"""Log-probabilities on the embedded SmolLM2 (CPU, fp32) against transformers: generated-token
and prompt log-probs (top-N ids and values included) equal log_softmax of transformers' logits
over the same tokens, with and without speculation (n-gram, draft model), through chunked
prefill, prefix caching and the three-lane dispatcher."""

from __future__ import annotations

import asyncio

import pytest
import torch

from verifypd.config import EngineConfig, SchedulerConfig, SpecConfig
from verifypd.lanes.async_engine import AsyncEngine
from verifypd.llm import LLM
from verifypd.types import ParamError, SamplingParams, TokenLogprob

pytestmark = pytest.mark.slow

TOL = 1e-3
NUM_NEW = 12
NUM_TOP = 4
PROMPTS = [
    "The capital of France is",
    "1, 2, 3, 4, 5, 6, 7, 8,",
    "Repeat after me: the quick brown fox jumps over the lazy dog. The quick brown fox",
]


def _params(**kw) -> SamplingParams:
    base = dict(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True, logprobs=NUM_TOP)
    return SamplingParams(**{**base, **kw})


@torch.inference_mode()
def _hf_logp(model, ids: list[int]) -> torch.Tensor:
    """[len(ids), V]: row i is log_softmax of the logits after ids[: i + 1]."""
    return torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), dim=-1)


def _assert_token(lp: TokenLogprob, row: torch.Tensor, token: int, num_top: int) -> None:
    assert lp.token_id == token
    assert abs(lp.logprob - float(row[token])) <= TOL, (lp.logprob, float(row[token]))
    want_values, want_ids = row.topk(num_top)
    assert len(lp.top) == num_top
    got_values = torch.tensor([v for _, v in lp.top])
    assert torch.allclose(got_values, want_values, atol=TOL, rtol=0)
    for (got_id, _), want_id in zip(lp.top, want_ids.tolist(), strict=True):
        assert got_id == want_id or abs(float(row[got_id] - row[want_id])) <= TOL


def _assert_output(hf, prompt_ids, token_ids, logprobs, prompt_logprobs=None, num_top=NUM_TOP):
    ids = list(prompt_ids) + list(token_ids)
    ref = _hf_logp(hf, ids)
    n = len(prompt_ids)
    assert len(logprobs) == len(token_ids)
    for j, lp in enumerate(logprobs):
        _assert_token(lp, ref[n - 1 + j], ids[n + j], num_top)
    if prompt_logprobs is not None:
        assert len(prompt_logprobs) == n and prompt_logprobs[0] is None
        for i in range(1, n):
            _assert_token(prompt_logprobs[i], ref[i - 1], ids[i], num_top)


@pytest.fixture(scope="module")
def llm() -> LLM:
    # Small prefill chunks: prompt log-probs are gathered across several chunks.
    sched = SchedulerConfig(max_prefill_chunk=8)
    return LLM(config=EngineConfig(model="default", device="cpu", scheduler=sched))


@pytest.fixture(scope="module")
def plain(llm) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(PROMPTS, _params())]


def test_generated_and_prompt_logprobs_match_transformers(llm, hf_smollm):
    outs = llm.generate(PROMPTS, _params(prompt_logprobs=NUM_TOP))
    for out in outs:
        choice = out.outputs[0]
        _assert_output(hf_smollm, out.prompt_token_ids, choice.token_ids, choice.logprobs,
                       choice.prompt_logprobs)  # fmt: skip
    llm.core.check_integrity()
    assert llm.core.kv.usage == 0


def test_logprobs_are_raw_under_temperature_and_top_k(llm, hf_smollm):
    """Sampled tokens are scored by the model's own distribution, not the sampling one."""
    params = _params(temperature=1.7, top_k=5, seed=7, logprobs=2)
    out = llm.generate(PROMPTS[0], params)[0]
    _assert_output(hf_smollm, out.prompt_token_ids, out.token_ids, out.outputs[0].logprobs,
                   num_top=2)  # fmt: skip


def test_prompt_logprobs_bypass_the_prefix_cache(llm, hf_smollm):
    """A repeated prompt would hit the prefix cache and skip positions; with prompt log-probs
    asked it is computed in full, and a plain request after it still hits the cache."""
    prompt = PROMPTS[2] + " jumps over the lazy dog again and again"
    params = _params(max_tokens=2, logprobs=None, prompt_logprobs=1)
    first, second = (llm.generate(prompt, params)[0] for _ in range(2))
    assert len(first.prompt_token_ids) > llm.core.block_size
    assert second.num_cached_tokens == 0
    for out in (first, second):
        choice = out.outputs[0]
        assert choice.logprobs is None
        ref = _hf_logp(hf_smollm, out.prompt_token_ids)
        for i in range(1, len(out.prompt_token_ids)):
            _assert_token(choice.prompt_logprobs[i], ref[i - 1], out.prompt_token_ids[i], 1)
    again = llm.generate(prompt, _params(max_tokens=2, logprobs=None))[0]
    assert again.num_cached_tokens > 0


def test_too_many_logprobs_is_a_param_error(llm):
    with pytest.raises(ParamError) as err:
        llm.core.add_request("too-many", [1, 2, 3], _params(logprobs=21))
    assert err.value.param == "logprobs"


def test_speculation_with_a_rejecting_drafter_keeps_target_logprobs(plain, hf_smollm):
    """A tiny random drafter: its drafts are mostly rejected and the resampled (target) token
    must carry the target's log-probs, never the drafter's."""
    spec = SpecConfig(method="draft", draft_model="dummy:tiny", controller=False)
    llm = LLM(config=EngineConfig(model="default", device="cpu", spec=spec))
    outs = llm.generate(PROMPTS, _params())
    assert llm.core.spec.num_verifies > 0
    for out, want in zip(outs, plain, strict=True):
        assert out.token_ids == want
        _assert_output(hf_smollm, out.prompt_token_ids, out.token_ids, out.outputs[0].logprobs)


async def _generate_async(config: EngineConfig, params: SamplingParams):
    engine = AsyncEngine(config)
    tok = engine.tokenizer

    async def one(i: int, prompt: str):
        ids, logprobs = tok.encode(prompt), []
        new = []
        async for out in engine.generate(f"r{i}", ids, params):
            new += out.new_token_ids
            logprobs += out.logprobs
        return ids, new, logprobs

    try:
        outs = await asyncio.wait_for(asyncio.gather(*map(one, range(3), PROMPTS)), 300)
        engine.check_integrity()
        return outs, engine.core.spec
    finally:
        await engine.stop()


@pytest.mark.parametrize(
    "spec",
    [
        SpecConfig(method="ngram", controller=False),
        # the drafter accepts (almost) all; fixed L: the goodput policy may rightly not speculate
        SpecConfig(method="draft", draft_model="default", controller=False),
    ],
    ids=["ngram", "draft-self"],
)
async def test_speculation_keeps_greedy_output_and_target_logprobs(plain, hf_smollm, spec):
    config = EngineConfig(model="default", device="cpu", lane_mode="three", spec=spec)
    outs, stats = await _generate_async(config, _params())
    assert stats.num_verifies > 0 and stats.num_accepted > 0
    for (prompt_ids, new, logprobs), want in zip(outs, plain, strict=True):
        assert new == want
        _assert_output(hf_smollm, prompt_ids, new, logprobs)
