"""Failure isolation on the real engine (CPU, dummy weights): a failure that belongs to one
request (building its sampling tensors, its stop-string check) ends that request with "error"
and frees its blocks; its batch-mates finish with the tokens they get alone, and the
``request_finished`` hook counts the failure as an error, not an abort."""

from __future__ import annotations

import asyncio

import pytest
from helpers import assert_engine_clean, tiny_config

from verifypd.config import CacheConfig, SchedulerConfig
from verifypd.engine import detokenizer, sampler
from verifypd.lanes.async_engine import AsyncEngine
from verifypd.types import Observer, ParamError, SamplingParams

POISON_SEED = 666
POISON_STOP = "\x00poison"
PROMPTS = [[5, 6, 7, 8], [9] * 20, list(range(30, 50))]
ORDINARY = [
    SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=12, temperature=0.9, top_k=50, seed=1, ignore_eos=True),
    SamplingParams(max_tokens=12, temperature=0.7, top_p=0.9, seed=2, n=2, ignore_eos=True),
]


class FinishCounter(Observer):
    def __init__(self) -> None:
        self.reasons: list[str] = []

    def request_finished(self, reason, e2e_seconds, num_prompt, num_generated) -> None:
        self.reasons.append(reason)


def _engine(observer: Observer | None = None, ahead: bool = False, **sched) -> AsyncEngine:
    cfg = tiny_config(cache=CacheConfig(num_blocks=64), scheduler=SchedulerConfig(**sched),
                      decode_ahead=ahead)  # fmt: skip
    return AsyncEngine(cfg, observer=observer)


async def _run(engine: AsyncEngine, rid: str, prompt: list[int], params: SamplingParams):
    """(token ids per choice, finish reason per choice)."""
    ids: dict[int, list[int]] = {i: [] for i in range(params.n)}
    reasons: dict[int, str | None] = {}
    async for out in engine.generate(rid, prompt, params):
        ids[out.index] += out.new_token_ids
        if out.finished:
            reasons[out.index] = out.finish_reason
    return [ids[i] for i in range(params.n)], [reasons[i] for i in range(params.n)]


async def _alone(engine: AsyncEngine) -> list:
    cases = enumerate(zip(PROMPTS, ORDINARY, strict=True))
    return [await _run(engine, f"alone{i}", p, s) for i, (p, s) in cases]


async def _with_poison(engine: AsyncEngine, poison: SamplingParams) -> tuple[list, tuple]:
    cases = enumerate(zip(PROMPTS, ORDINARY, strict=True))
    jobs = [_run(engine, f"ok{i}", p, s) for i, (p, s) in cases]
    jobs.insert(1, _run(engine, "poisoned", [11, 12, 13], poison))
    results = await asyncio.wait_for(asyncio.gather(*jobs), 60)
    return results[:1] + results[2:], results[1]


def _poisoned_build(original):
    def build(cls, temperature, top_k, top_p, seeds, positions, device):
        if POISON_SEED in seeds:
            raise OverflowError("Python int too large to convert to C long")
        return original.__func__(cls, temperature, top_k, top_p, seeds, positions, device)

    return classmethod(build)


@pytest.mark.parametrize("ahead", [False, True], ids=["plain", "decode-ahead"])
async def test_failed_sampling_tensors_end_only_their_request(monkeypatch, ahead) -> None:
    counter = FinishCounter()
    engine = _engine(counter, ahead)
    try:
        alone = await _alone(engine)
        monkeypatch.setattr(
            sampler.SamplingTensors, "build", _poisoned_build(sampler.SamplingTensors.build)
        )
        poison = SamplingParams(max_tokens=12, temperature=1.0, seed=POISON_SEED, ignore_eos=True)
        counter.reasons.clear()
        together, (_, poisoned_reasons) = await _with_poison(engine, poison)
        assert poisoned_reasons == ["error"]
        assert together == alone  # same tokens, every choice finished by length
        assert sorted(counter.reasons) == ["error"] + ["length"] * 4
        assert_engine_clean(engine)
    finally:
        await engine.stop()


@pytest.mark.parametrize("ahead", [False, True], ids=["plain", "decode-ahead"])
async def test_failed_stop_check_ends_only_its_request(monkeypatch, ahead) -> None:
    counter = FinishCounter()
    engine = _engine(counter, ahead)
    original = detokenizer.StopChecker.push

    def push(self, new_text):
        if POISON_STOP in self.stop:
            raise RuntimeError("stop check exploded")
        return original(self, new_text)

    try:
        alone = await _alone(engine)
        monkeypatch.setattr(detokenizer.StopChecker, "push", push)
        poison = SamplingParams(max_tokens=12, temperature=0.0, stop=[POISON_STOP], n=2)
        counter.reasons.clear()
        together, (_, poisoned_reasons) = await _with_poison(engine, poison)
        assert poisoned_reasons == ["error", "error"]
        assert together == alone
        assert sorted(counter.reasons) == ["error"] * 2 + ["length"] * 4
        assert_engine_clean(engine)
    finally:
        await engine.stop()


async def test_request_over_its_kv_share_is_refused_up_front() -> None:
    engine = _engine(max_request_kv_share=0.25)  # 16 of 64 blocks of 16 tokens
    try:
        assert engine.max_model_len == 16 * 16
        assert engine.max_choice_len(4) == 4 * 16
        with pytest.raises(ParamError, match="share") as err:
            await _run(engine, "big", [1] * 10, SamplingParams(max_tokens=60, n=4))
        assert err.value.param == "max_tokens"
        params = SamplingParams(max_tokens=54, n=4, ignore_eos=True)  # every choice runs to its cap
        ids, reasons = await _run(engine, "fits", [1] * 10, params)
        assert reasons == ["length"] * 4 and all(len(c) == 54 for c in ids)
        assert_engine_clean(engine)
    finally:
        await engine.stop()
