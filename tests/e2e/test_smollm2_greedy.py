"""End to end on the embedded SmolLM2-135M (CPU, fp32, greedy): our continuously batched engine
against transformers run one prompt at a time, token for token, under every scheduling path.

Cost: every generated token is a forward of the 135M model on 2 CPU cores, and every engine a
model load, so generations are 32 tokens (enough to cross two KV blocks of 16 and to preempt in
a 16-block pool) and the tests on the default configuration share one engine (each leaves it
clean: ``_assert_clean``)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from verifypd.config import CacheConfig, EngineConfig, SchedulerConfig
from verifypd.llm import LLM
from verifypd.types import SamplingParams

pytestmark = pytest.mark.slow

NUM_NEW = 32
PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "Once upon a time, in a small village at the edge of a great forest, there lived",
    "1, 2, 3, 4,",
    "Explain why the sky is blue in one paragraph. Use simple words that a child would "
    "understand, and give one everyday example.",
    "Q: What is 17 times 3?\nA:",
    "Hello",
    "The three most important inventions of the twentieth century are",
]


@pytest.fixture(scope="module")
def hf_reference(hf_smollm) -> dict[str, list[int]]:
    """Greedy continuations from transformers' own model, one prompt at a time."""
    from verifypd.engine.tokenizer import load_tokenizer

    tok = load_tokenizer("default")
    out = {}
    for prompt in PROMPTS:
        ids = torch.tensor([tok.encode(prompt)])
        out[prompt] = _hf_greedy(hf_smollm, ids, NUM_NEW)
    return out


@torch.inference_mode()
def _hf_greedy(model, ids: torch.Tensor, num_new: int) -> list[int]:
    past, new = None, []
    inp = ids
    for _ in range(num_new):
        res = model(input_ids=inp, past_key_values=past, use_cache=True)
        past = res.past_key_values
        nxt = int(res.logits[0, -1].argmax())
        new.append(nxt)
        inp = torch.tensor([[nxt]])
    return new


def _llm(decode_ahead: bool | None = None, prompt_ahead: bool | None = None, **sched) -> LLM:
    cache = sched.pop("cache", CacheConfig())
    cfg = EngineConfig(
        model="default", device="cpu", cache=cache, scheduler=SchedulerConfig(**sched),
        decode_ahead=decode_ahead, prompt_ahead=prompt_ahead,
    )  # fmt: skip
    return LLM(config=cfg)


def _greedy() -> SamplingParams:
    return SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)


def _assert_matches(llm: LLM, hf_reference) -> None:
    outs = llm.generate(PROMPTS, _greedy())
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out.token_ids == hf_reference[prompt], prompt
        assert out.finish_reason == "length"
    _assert_clean(llm)


def _assert_clean(llm: LLM) -> None:
    core = llm.core
    core.check_integrity()
    assert core.scheduler.num_running == core.scheduler.num_waiting == 0
    assert core.kv.usage == 0.0
    assert core.kv.num_free_blocks == core.kv.num_blocks


@pytest.fixture(scope="module")
def default_llm() -> LLM:
    """One engine on the default configuration for every test here that needs no other."""
    return _llm()


def test_batch_matches_transformers_then_prefix_cache_hits(default_llm, hf_reference):
    llm = default_llm
    _assert_matches(llm, hf_reference)
    hits_before = llm.core.kv.num_prefix_hit_tokens
    outs = llm.generate(PROMPTS, _greedy())
    assert llm.core.kv.num_prefix_hit_tokens > hits_before
    assert sum(o.num_cached_tokens for o in outs) > 0
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out.token_ids == hf_reference[prompt]
    _assert_clean(llm)


def test_chunked_prefill_small_chunks(hf_reference):
    _assert_matches(_llm(max_prefill_chunk=5, max_num_batched_tokens=24), hf_reference)


# Nine sequences of up to 57 tokens need 29 blocks of 16 at their longest; 16 blocks hold at
# most five of them at full length, so the scheduler must preempt (and recompute) to finish.
# With decode-ahead (a GPU default; on CPU every other decode step runs ahead) the same tokens.
@pytest.mark.parametrize("ahead", [False, True], ids=["plain", "decode-ahead"])
def test_tiny_pool_forces_preemption(hf_reference, ahead):
    cache = CacheConfig(block_size=16, num_blocks=16, enable_prefix_caching=False)
    llm = _llm(cache=cache, decode_ahead=ahead)
    _assert_matches(llm, hf_reference)
    assert llm.core.scheduler.num_preemptions > 0
    assert (llm.engine.dispatcher.num_ahead_steps > 0) == ahead


# The same with a GPU's defaults, decode-ahead and prompt-ahead, and prompt steps of at most
# 24 tokens, so that prompts (and the recomputed ones after a preemption) take several steps
# and steps go ahead; the prefix cache on.
def test_tiny_pool_preemption_with_prompts_and_decode_ahead(hf_reference):
    cache = CacheConfig(block_size=16, num_blocks=16)
    llm = _llm(cache=cache, decode_ahead=True, prompt_ahead=True, max_num_batched_tokens=24,
               max_prefill_chunk=24)  # fmt: skip
    _assert_matches(llm, hf_reference)
    d = llm.engine.dispatcher
    assert llm.core.scheduler.num_preemptions > 0
    assert d.num_ahead_steps > 0 and d.prompt_ahead.num_steps > 0
    _assert_clean(llm)


def test_tiny_pool_preemption_with_prefix_cache(hf_reference):
    llm = _llm(cache=CacheConfig(block_size=16, num_blocks=16))
    _assert_matches(llm, hf_reference)
    assert llm.core.scheduler.num_preemptions > 0


def test_no_cross_sequence_leakage_when_sampling(default_llm):
    """A seeded sampled request yields the same tokens alone and among different batch-mates."""
    llm = default_llm
    params = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    alone = llm.generate([PROMPTS[3]], params)[0].token_ids
    mates = [SamplingParams(max_tokens=30, temperature=1.0, seed=i) for i in range(5)]
    batch = llm.generate([PROMPTS[0], PROMPTS[3], *PROMPTS[4:8]], [mates[0], params, *mates[1:]])
    assert batch[1].token_ids == alone
    _assert_clean(llm)


def test_abort_mid_generation_frees_everything(default_llm):
    llm = default_llm
    ids = llm.tokenizer.encode(PROMPTS[5])
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)

    async def abort_one_mid_way():
        a = llm.engine.generate("a", ids, params)
        b = llm.engine.generate("b", ids, params)
        tail = asyncio.ensure_future(_drain(b))
        got = 0
        while got < 5:
            got += len((await anext(a)).new_token_ids)
        await a.aclose()  # the consumer leaves: "a" is aborted
        return await tail

    got_b = llm.run(abort_one_mid_way())
    assert len(got_b) == 50 and not llm.core.has_unfinished()
    _assert_clean(llm)


async def _drain(deltas) -> list[int]:
    ids = []
    async for out in deltas:
        ids += out.new_token_ids
    return ids


def test_generate_answers_capital_of_france(default_llm):
    llm = default_llm
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(max_tokens=32, temperature=0.0),
    )
    assert "Paris" in out.text
    assert out.finish_reason in ("stop", "length")


def test_generate_refuses_to_run_inside_an_event_loop(default_llm):
    async def inside():
        default_llm.generate("Hello", SamplingParams(max_tokens=2))

    with pytest.raises(RuntimeError, match="running event loop"):
        asyncio.run(inside())
