"""AsyncEngine over the lane dispatcher, on CPU with dummy weights: lossless speculation in
three-lane and single-lane modes, aborts, and clean caches afterwards."""

from __future__ import annotations

import asyncio

import pytest
from helpers import collect, generate_all, hang_up_partway, tiny_config, tiny_draft_spec

from verifypd.config import CacheConfig, SchedulerConfig, SpecConfig
from verifypd.lanes.async_engine import AsyncEngine
from verifypd.types import SamplingParams

PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3], [7] * 40, list(range(10, 60)), [9, 8, 7]]


def _engine(lane_mode="three", spec=SpecConfig(), **kw) -> AsyncEngine:
    cfg = tiny_config(lane_mode=lane_mode, spec=spec, **kw)
    return AsyncEngine(cfg)


async def _run_all(engine: AsyncEngine, params) -> list[list[int]]:
    return await generate_all(engine, PROMPTS, params, timeout=60)


GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
SPECS = [
    SpecConfig(method="ngram"),
    tiny_draft_spec(),
    tiny_draft_spec(controller=True),
]


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    return asyncio.run(_run_all(_engine("single"), GREEDY))


@pytest.mark.parametrize("lane_mode", ["three", "single"])
@pytest.mark.parametrize("spec", SPECS, ids=["ngram", "draft-fixed", "draft-controller"])
async def test_speculative_greedy_is_token_identical(reference, lane_mode, spec):
    engine = _engine(lane_mode, spec)
    got = await _run_all(engine, GREEDY)
    for i, (a, b) in enumerate(zip(got, reference, strict=True)):
        first = next((j for j, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
        assert first is None, f"prompt {i} diverges at token {first}: {a} vs {b}"
    if spec.method == "draft":  # the draft is the target itself: every draft is accepted
        assert engine.core.spec.num_drafted > 0
        assert engine.core.spec.num_accepted == engine.core.spec.num_drafted


@pytest.mark.parametrize("lane_mode", ["three", "single"])
@pytest.mark.parametrize("controller", [False, True], ids=["fixed", "controller"])
@pytest.mark.parametrize("before", [True, False], ids=["before-drafting", "after-every-launch"])
async def test_deltas_after_the_next_launch_lose_nothing(reference, lane_mode, controller, before):
    """The GPU ordering (a landed step's deltas made after the next launch) on CPU: the same
    tokens, every request finished, clean caches (``_run_all`` checks). With the controller a
    round follows plain steps, and with ``deliver_before_drafting`` deltas go out ahead of it
    (fixed drafting drafts every step: never)."""
    spec = tiny_draft_spec(controller=controller)
    engine = _engine(lane_mode, spec, deliver_before_drafting=before)
    engine.dispatcher.deltas.after_launch = True
    assert await _run_all(engine, GREEDY) == reference
    assert (engine.dispatcher.deltas.num_ahead > 0) == (controller and before)


async def test_three_lane_plain_matches_single_lane(reference):
    assert await _run_all(_engine("three"), GREEDY) == reference


async def test_seeded_sampling_is_identical_with_speculation():
    params = SamplingParams(max_tokens=16, temperature=0.8, seed=5, ignore_eos=True)
    plain = await _run_all(_engine("three"), params)
    spec = tiny_draft_spec()
    assert len(await _run_all(_engine("three", spec), params)) == len(plain)


@pytest.mark.parametrize("chain", [False, True], ids=["fresh-drafts", "chained-drafts"])
async def test_abort_mid_stream_frees_blocks_in_every_lane(chain):
    spec = tiny_draft_spec(chain_drafts=chain)
    engine = _engine("three", spec, cache=CacheConfig(num_blocks=64, block_size=16))
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    await hang_up_partway(engine, PROMPTS, params, every=5)
    assert engine.dispatcher.verify_queue == []
    engine.check_integrity()
    assert engine.kv_usage == 0 and engine.num_running == engine.num_waiting == 0
    assert engine.core.spec.drafter.kv.usage == 0
    assert (engine.core.spec.drafter.num_adopted > 0) == chain  # chains were in flight
    await engine.stop()


@pytest.mark.parametrize("lane_mode", ["three", "single"])
async def test_n_choices_finishing_in_one_step_all_get_their_last_delta(lane_mode):
    # Regression: the request used to be forgotten when its first choice finished, so the
    # other choices finishing in the same step lost their final delta and generate() hung.
    engine = _engine(lane_mode)
    params = SamplingParams(max_tokens=5, temperature=0.8, seed=3, n=3, ignore_eos=True)
    outs = [o async for o in _bounded(engine.generate("n3", PROMPTS[0], params), 30)]
    finals = sorted((o.index, o.finish_reason, o.num_output_tokens) for o in outs if o.finished)
    assert finals == [(0, "length", 5), (1, "length", 5), (2, "length", 5)]
    assert sum(len(o.new_token_ids) for o in outs) == 15
    engine.check_integrity()
    assert engine.kv_usage == 0 and engine.core.requests == {}
    await engine.stop()


async def _bounded(agen, seconds: float):
    async with asyncio.timeout(seconds):
        async for item in agen:
            yield item


async def test_padded_mixed_length_verify_is_lossless(reference):
    """Different L per request in one verify batch (drafts cut at each request's max_tokens),
    padded to the longest as the GPU does to replay one graph: greedy output is unchanged."""
    spec = tiny_draft_spec(always_pad_verify=True)
    engine = _engine("three", spec)
    assert engine.core.runner.inputs.always_pad_verify  # the config field reaches the runner
    padded_steps = []
    launch = engine.core.runner.launch

    def spy(plan):
        lens = {len(s.draft_token_ids) for s in plan.seqs if s.draft_token_ids}
        padded_steps.append(len(lens) > 1)
        return launch(plan)

    engine.core.runner.launch = spy
    max_tokens = [10, 13, 17, 24]
    try:
        jobs = [
            collect(
                engine, f"p{i}", p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
            )
            for i, (p, n) in enumerate(zip(PROMPTS, max_tokens, strict=True))
        ]
        got = await asyncio.wait_for(asyncio.gather(*jobs), 60)
        engine.check_integrity()
    finally:
        await engine.stop()
    assert got == [r[:n] for r, n in zip(reference, max_tokens, strict=True)]
    assert any(padded_steps)


async def test_single_lane_prefill_joining_speculating_decodes(reference):
    """A prompt whose last prefill chunk shares a fused step with speculating decodes gets no
    drafts (its blocks cover only the prompt); outputs stay exact."""
    spec = tiny_draft_spec()
    chunked = SchedulerConfig(max_prefill_chunk=8, max_num_batched_tokens=16)
    engine = _engine("single", spec, scheduler=chunked)

    async def late(i: int, delay_tokens: int, first: asyncio.Event) -> list[int]:
        await first.wait()
        return await collect(engine, f"late{i}", PROMPTS[i], GREEDY)

    first = asyncio.Event()

    async def early() -> list[int]:
        ids: list[int] = []
        async for out in engine.generate("early", PROMPTS[0], GREEDY):
            ids += out.new_token_ids
            first.set()
        return ids

    try:
        got = await asyncio.wait_for(
            asyncio.gather(early(), *(late(i, 2, first) for i in range(1, 4))), 60
        )
        engine.check_integrity()
    finally:
        await engine.stop()
    assert got == reference


def test_max_model_len_is_capped_by_the_kv_pool():
    # The server defaults max_tokens to the rest of max_model_len: it must fit in the pool,
    # and in the share of it one request may hold (max_request_kv_share, default 0.5).
    whole = SchedulerConfig(max_request_kv_share=1.0)
    engine = _engine(cache=CacheConfig(num_blocks=4, block_size=16), scheduler=whole)
    assert engine.core.max_model_len > 64 and engine.max_model_len == 64
    assert engine.kv_blocks_free == 4
    assert _engine(cache=CacheConfig(num_blocks=4, block_size=16)).max_model_len == 32


async def test_a_crashing_step_loop_ends_requests_with_error_and_keeps_serving():
    # Regression: an exception in the step loop (here: folding a step back in) killed the
    # loop task silently and every request waited forever.
    engine = _engine()
    apply_step, calls = engine.core.apply_step, []

    def fail_once(plan, token_ids):
        calls.append(plan.lane)
        if len(calls) == 1:
            raise RuntimeError("boom")
        return apply_step(plan, token_ids)

    engine.core.apply_step = fail_once
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    outs = [o async for o in _bounded(engine.generate("bad", PROMPTS[0], params), 30)]
    assert [(o.finished, o.finish_reason) for o in outs] == [(True, "error")]
    assert len(await asyncio.wait_for(collect(engine, "ok", PROMPTS[1], params), 30)) == 4
    assert engine.num_running == engine.num_waiting == 0 and engine.core.requests == {}
    engine.check_integrity()
    assert engine.kv_usage == 0
    await engine.stop()


async def test_controller_signals_reach_the_observer():
    """Draft lengths, drafter temperature, spec tokens and lane steps are all exported."""
    from verifypd.types import Observer

    class Recorder(Observer):
        def __init__(self) -> None:
            self.calls: dict[str, list] = {}

        def __getattribute__(self, name):
            if name in ("draft_length", "drafter_temperature", "spec_tokens", "lane_step"):
                return lambda *a: self.calls.setdefault(name, []).append(a)
            return super().__getattribute__(name)

    rec = Recorder()
    engine = AsyncEngine(tiny_config(spec=tiny_draft_spec()), rec)
    params = SamplingParams(max_tokens=12, temperature=0.7, seed=3, ignore_eos=True)
    try:
        await asyncio.wait_for(collect(engine, "s", PROMPTS[0], params), 60)
    finally:
        await engine.stop()
    assert {"draft_length", "drafter_temperature", "spec_tokens", "lane_step"} <= set(rec.calls)
    assert all(0 < t <= 0.7 for (t,) in rec.calls["drafter_temperature"])


def test_async_engine_is_the_servers_engine_client():
    """The real engine implements the server's seam (``serve.engine_client``), and its
    effective context is the one-choice limit of the engine's request rule."""
    from verifypd.serve.engine_client import EngineClient

    engine = _engine()
    assert isinstance(engine, EngineClient)
    assert engine.max_model_len == engine.max_choice_len(1) == engine.core.limits.max_choice_len(1)


async def test_cpu_steps_run_in_the_worker_thread_off_the_loop():
    """The executor strategy on CPU: every forward runs in the one worker thread (the event
    loop stays free), and deltas are made as steps land (a CPU launch does not only enqueue)."""
    import threading

    from verifypd.lanes.executor import ThreadExecutor

    engine = _engine("three", tiny_draft_spec())
    assert isinstance(engine.executor, ThreadExecutor)
    assert not engine.dispatcher.deltas.after_launch
    threads: set[str] = set()
    launch = engine.core.launch

    def spy(plan):
        threads.add(threading.current_thread().name)
        return launch(plan)

    engine.core.launch = spy
    await _run_all(engine, GREEDY)
    assert threads and threading.main_thread().name not in threads
    assert len(threads) == 1


@pytest.mark.parametrize("spec", [SpecConfig(), tiny_draft_spec()], ids=["plain", "draft"])
async def test_cpu_prompt_beside_a_decoding_request_does_not_wait_for_it(spec):
    """On CPU a step runs to its end before the next is chosen, so strict lane priority left a
    prompt arriving beside a decoding request waiting for the TTFT budget (0.5 s by default),
    and its later chunks until that request ended: with a budget of a minute here, b's first
    token comes after a few of a's steps, not after a's 300 tokens."""
    engine = _engine("three", spec, scheduler=SchedulerConfig(
        ttft_budget_s=60.0, max_prefill_chunk=16, max_num_batched_tokens=16))  # fmt: skip
    await engine.start()
    a_tokens: list[int] = []

    async def a() -> None:
        params = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)
        async for out in engine.generate("a", [5, 6, 7], params):
            a_tokens.extend(out.new_token_ids)

    try:
        task = asyncio.create_task(a())
        while len(a_tokens) < 3:
            await asyncio.sleep(0.001)
        before = len(a_tokens)
        first = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        async for _ in engine.generate("b", list(range(10, 74)), first):  # 4 chunks of 16
            break
        assert len(a_tokens) - before <= 4 * 5 + 5, (before, len(a_tokens))  # a's steps meanwhile
        await asyncio.wait_for(task, 60)
    finally:
        await engine.stop()
    engine.core.check_integrity()
