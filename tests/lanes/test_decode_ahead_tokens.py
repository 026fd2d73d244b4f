"""Decode-ahead (``EngineConfig.decode_ahead``): a decode step planned and launched behind the
one in flight, its input tokens read on the device. On CPU the worker thread runs each step
before the next tick, so every other decode step is launched ahead of the one not yet folded
back in: the same bookkeeping as on a GPU, checked token for token against the plain path.

Here whole runs: the tokens and the blocks with a stop token or an abort under a step ahead,
with a drafter (no one speculating, or some), and with a request failing in a step ahead; the
default per device, which requests a step ahead takes, and the launch log's bound. The policy's
decisions for a step ahead are in test_decode_ahead_decisions.py, steps ahead beside a prompt
step in test_decode_ahead_beside_prompts.py."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from decode_ahead_helpers import PROMPTS, _params, _run
from helpers import assert_engine_clean, collect, hang_up_partway, tiny_config, tiny_draft_spec

from verifypd.config import CacheConfig
from verifypd.engine.core import EngineCore
from verifypd.lanes.async_engine import AsyncEngine
from verifypd.types import (
    NO_SPECULATION,
    RequestFailure,
    SamplingParams,
    SeqStatus,
    StepPlan,
    StructuredOutput,
)


async def test_decode_ahead_is_token_identical_and_leaks_nothing():
    plain, none_ahead = await _run(False)
    ahead, num_ahead = await _run(True)
    assert none_ahead == 0 and num_ahead > 0
    assert ahead == plain


async def test_a_stop_token_landing_under_a_step_ahead_drops_its_token():
    plain, _ = await _run(False)
    stop = plain[1][5]  # request 1 stops at its sixth token (or earlier, at a repeat)
    ref, _ = await _run(False, stop_token=stop)
    got, num_ahead = await _run(True, stop_token=stop)
    assert num_ahead > 0
    assert got == ref
    assert got[1] == ref[1] and len(got[1]) <= 6 and got[1][-1] == stop


async def test_abort_with_a_step_ahead_in_flight_frees_every_block():
    engine = AsyncEngine(tiny_config(decode_ahead=True, cache=CacheConfig(num_blocks=64)))
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    await hang_up_partway(engine, PROMPTS, params, every=4)
    assert engine.dispatcher.num_ahead_steps > 0
    assert_engine_clean(engine)
    await engine.stop()


def test_default_is_on_only_where_launches_enqueue():
    assert AsyncEngine(tiny_config()).dispatcher.decode_ahead is False  # CPU: a worker thread
    assert AsyncEngine(tiny_config(decode_ahead=True)).dispatcher.decode_ahead is True
    spec = AsyncEngine(tiny_config(decode_ahead=True, spec=tiny_draft_spec())).dispatcher
    assert spec.decode_ahead is True  # while the policy speculates for no one
    single = AsyncEngine(tiny_config(decode_ahead=True, lane_mode="single"))
    assert single.dispatcher.decode_ahead is False


async def _run_spec(ahead: bool, speculate: list[bool]):
    """Draft-model speculation (the drafter is the target: every draft is accepted) where only
    the requests marked ``speculate`` may speculate (the fixed-L policy speculates for every
    one of them). Checks at each launch ahead that no running request may speculate."""
    engine = AsyncEngine(tiny_config(decode_ahead=ahead, spec=tiny_draft_spec()))
    launch = engine.dispatcher._launch_ahead
    speculating_at_launch: list[int] = []

    async def spy():
        running = [s for s in engine.core.scheduler.running if s.status is SeqStatus.DECODING]
        launched = await launch()
        if launched:
            speculating_at_launch.append(sum(s.params.speculate for s in running))
        return launched

    engine.dispatcher._launch_ahead = spy
    jobs = [
        collect(engine, f"r{i}", p, dataclasses.replace(_params(0), speculate=speculate[i]))
        for i, p in enumerate(PROMPTS)
    ]
    try:
        out = await asyncio.wait_for(asyncio.gather(*jobs), 60)
    finally:
        assert_engine_clean(engine)
        await engine.stop()
    return out, speculating_at_launch, engine.core.spec.num_drafted


async def test_with_a_drafter_decode_runs_ahead_while_no_one_speculates():
    """No request may speculate: the policy decides "no one" for every step, and decode runs
    ahead as without a drafter; the same tokens as without decode-ahead."""
    quiet = [False] * len(PROMPTS)
    ref, none, _ = await _run_spec(False, quiet)
    got, launches, drafted = await _run_spec(True, quiet)
    assert none == [] and len(launches) > 0 and drafted == 0
    assert got == ref


async def test_with_speculating_requests_nothing_runs_ahead_of_a_drafting_step():
    """Half the requests speculate: while any of them runs, the policy's decision for the step
    ahead speculates and nothing is launched ahead (a drafting step needs landed tokens); once
    they finish, decode runs ahead. Lossless either way."""
    mixed = [i % 2 == 0 for i in range(len(PROMPTS))]
    ref, _, drafted_ref = await _run_spec(False, mixed)
    got, launches, drafted = await _run_spec(True, mixed)
    assert got == ref
    assert drafted_ref > 0 and drafted > 0
    assert launches and all(n == 0 for n in launches)


# Greedy wherever the case allows: a prompt step sampling the end-of-text token at random
# would end the request before its decode step (the test failed that way now and then).
@pytest.mark.parametrize(
    "params,ahead",
    [
        (SamplingParams(max_tokens=50, temperature=0.0), True),
        (SamplingParams(max_tokens=50, temperature=0.7, seed=1), True),
        (SamplingParams(max_tokens=50, temperature=0.0, repetition_penalty=1.2), False),
        (SamplingParams(max_tokens=50, temperature=0.0, logit_bias={5: 1.0}), False),
        (SamplingParams(max_tokens=50, temperature=0.0, min_tokens=4), False),
        (SamplingParams(max_tokens=50, temperature=0.0, logprobs=2), False),
        ("grammar", False),  # set on the sequence below (dummy:tiny has no HF tokenizer)
        (SamplingParams(max_tokens=2, temperature=0.0), False),  # the step in flight: its last
    ],
    ids=["greedy", "seeded", "penalty", "bias", "min-tokens", "logprobs", "grammar", "last"],
)
def test_plan_ahead_takes_only_what_needs_nothing_from_the_host(params, ahead):
    grammar = params == "grammar"
    if grammar:
        params = SamplingParams(max_tokens=50, temperature=0.0)
    core = EngineCore(tiny_config())
    core.add_request("r", [1, 2, 3, 4, 5], params)
    sched = core.scheduler
    prefill = StepPlan("prefill", sched.plan_prefill(1 << 12, 8))
    sched.begin_step(prefill)
    core.apply_step(prefill, core.launch(prefill).result())
    plan = StepPlan("decode", sched.plan_decode(NO_SPECULATION))
    sched.begin_step(plan)
    pending = core.launch(plan)
    seq = plan.seqs[0].seq
    if grammar:
        seq.params = dataclasses.replace(params, structured=StructuredOutput("json_object"))

    entries = sched.plan_ahead(plan, pending.sampled_at)

    assert [e.seq for e in entries] == ([seq] if ahead else [])
    if ahead:
        (e,) = entries
        assert e.ahead_position == seq.num_tokens and e.sample_position == seq.num_tokens + 1
        assert len(seq.block_table) * core.kv.block_size >= seq.num_tokens + 1  # slot reserved


async def test_a_request_failing_in_a_step_ahead_ends_alone():
    """A launch ahead that fails for one request's own inputs (``RequestFailure``) ends that
    request with "error"; the others plan again and finish with the tokens they get without
    it; every block comes back."""
    alone, _ = await _run(True)
    engine = AsyncEngine(tiny_config(decode_ahead=True))
    launch = engine.dispatcher._launch_fn
    failed: list[int] = []

    async def poisoned(lane, plan):
        ahead = [e.seq.request_id for e in plan.seqs if e.is_ahead]
        if "r2" in ahead and not failed:
            failed.append(len(plan.seqs))
            raise RequestFailure({"r2"}, RuntimeError("poisoned input"))
        return await launch(lane, plan)

    engine.dispatcher._launch_fn = poisoned
    reasons: dict[str, str | None] = {}

    async def run(i, prompt):
        ids = []
        async for out in engine.generate(f"r{i}", prompt, _params(i)):
            ids += out.new_token_ids
            if out.finished:
                reasons[f"r{i}"] = out.finish_reason
        return ids

    try:
        jobs = [run(i, p) for i, p in enumerate(PROMPTS)]
        got = await asyncio.wait_for(asyncio.gather(*jobs), 60)
        assert failed and reasons["r2"] == "error"
        assert all(reasons[f"r{i}"] == "length" for i in range(len(PROMPTS)) if i != 2)
        others = [i for i in range(len(PROMPTS)) if i != 2]
        assert [got[i] for i in others] == [alone[i] for i in others]
        assert got[2] == alone[2][: len(got[2])]  # what it got before the failure is right
        assert_engine_clean(engine)
    finally:
        await engine.stop()


def test_the_launch_log_stays_bounded_for_launches_ahead_too():
    """A server runs for days, and with decode-ahead most decode launches go ahead."""
    d = AsyncEngine(tiny_config(decode_ahead=True)).dispatcher
    for _ in range(10_000):
        d._log_launch("decode")
    assert 2048 <= len(d.launch_log) <= 4096
