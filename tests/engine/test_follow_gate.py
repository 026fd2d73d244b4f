"""``SpecConfig.follow_prefill_max_rows``: the drafter follows prompt steps only at light load,
with no other prompt waiting and at most that many sequences decoding (``EngineCore.
follow_items``, read as a prompt step is launched)."""

from __future__ import annotations

import pytest
from helpers import tiny_config, tiny_draft_spec

from verifypd.config import SchedulerConfig, SpecConfig
from verifypd.engine.core import EngineCore
from verifypd.types import SamplingParams, StepPlan

PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _core(most: int | None) -> EngineCore:
    spec = tiny_draft_spec(follow_prefill=True, follow_prefill_max_rows=most)
    return EngineCore(tiny_config(spec=spec))


def _decoding(core: EngineCore, n: int) -> None:
    """``n`` requests prefilled and landed: they decode next."""
    if not n:
        return
    for i in range(n):
        core.add_request(f"d{i}", [1 + i, 2, 3, 4], PARAMS)
    plan = StepPlan("prefill", core.scheduler.plan_prefill(1 << 12, 8))
    core.scheduler.begin_step(plan)
    core.apply_step(plan, core.launch(plan).result())


def _followed(core: EngineCore, prompts: int, rows: int = 8) -> list[str]:
    """The request ids the drafter would follow behind a prompt step of at most ``rows`` of
    ``prompts`` new prompts (the policy expecting to speculate for everyone)."""
    for i in range(prompts):
        core.add_request(f"p{i}", list(range(10 + i, 40 + i)), PARAMS)
    plan = StepPlan("prefill", core.scheduler.plan_prefill(1 << 12, rows))
    core.scheduler.begin_step(plan)
    return [seq.request_id for seq, _ in core.follow_items(plan, lambda seq_id: True)]


@pytest.mark.parametrize(
    "most,decoding,prompts,rows,followed",
    [
        (None, 3, 1, 8, ["p0"]),  # at any load
        (2, 2, 1, 8, ["p0"]),  # light: two decoding, nothing else waiting
        (2, 3, 1, 8, []),  # three decoding
        (2, 0, 2, 8, ["p0", "p1"]),  # both prompts in this step: none waits
        (2, 0, 2, 1, []),  # the second prompt waits for the next step
        (0, 0, 1, 8, ["p0"]),  # nothing decoding at all
    ],
)
def test_the_drafter_follows_prompt_steps_only_at_light_load(
    most, decoding, prompts, rows, followed
):
    core = _core(most)
    _decoding(core, decoding)
    assert _followed(core, prompts, rows) == followed


def test_a_part_prefilled_prompt_not_in_the_step_counts_as_waiting():
    """A long prompt whose next chunk is not in this step (part-prefilled, not in flight)
    waits like a queued one: no follow behind a step of another prompt; in flight, it does
    not wait."""
    spec = tiny_draft_spec(follow_prefill=True, follow_prefill_max_rows=4)
    core = EngineCore(tiny_config(spec=spec, scheduler=SchedulerConfig(max_prefill_chunk=32)))
    core.add_request("long", list(range(1, 101)), PARAMS)
    first = StepPlan("prefill", core.scheduler.plan_prefill(1 << 12, 8))
    assert [e.num_new_tokens for e in first.seqs] == [32]
    core.scheduler.begin_step(first)
    core.apply_step(first, core.launch(first).result())
    core.add_request("short", [5, 6, 7], PARAMS)
    both = core.scheduler.plan_prefill(1 << 12, 8)  # the long one's next chunk, the short one
    assert [e.seq.request_id for e in both] == ["long", "short"]
    short = StepPlan("prefill", [e for e in both if e.seq.request_id == "short"])
    core.scheduler.begin_step(short)  # the short one's step in flight, read as it launches
    assert core.follow_items(short, lambda seq_id: True) == []
    core.scheduler.begin_step(StepPlan("prefill", [both[0]]))  # the long chunk in flight
    assert [s.request_id for s, _ in core.follow_items(short, lambda seq_id: True)] == ["short"]


@pytest.mark.parametrize("bad", [-1, 1.5, True, "4"])
def test_follow_prefill_max_rows_is_validated(bad):
    with pytest.raises(ValueError, match="follow_prefill_max_rows"):
        SpecConfig(follow_prefill_max_rows=bad)
    assert SpecConfig(follow_prefill_max_rows=None).follow_prefill_max_rows is None


@pytest.mark.parametrize("bad", ["decode", "", None, 1])
def test_follow_prefill_stream_is_follow_or_prefill(bad):
    assert SpecConfig(follow_prefill_stream="prefill").follow_prefill_stream == "prefill"
    with pytest.raises(ValueError, match="follow_prefill_stream"):
        SpecConfig(follow_prefill_stream=bad)
