"""TTFT anatomy (bench/ttft_anatomy.py, ``mixed.py --sweep --ttft-anatomy``): the parts of a
first token's time from a log of folded lane steps, on constructed steps and in a tiny sweep."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import load_bench
from sweep_helpers import tiny_policy_row


def _trace(loadgen, rid: str, arrival: float, first: float):
    t = loadgen.Trace(rid, "short", 8, 4, arrival)
    t.deltas.append((first, 1))
    return t


def test_anatomy_splits_ttft_and_measures_shared_time() -> None:
    ana, loadgen = load_bench("ttft_anatomy"), load_bench("loadgen")
    log = ana.StepLog()
    step = ana.FoldedStep
    log.steps = [
        step("decode", 0.00, 0.04, 4),
        step("prefill", 0.01, 0.05, 1000, [("a", 0.000, 0.010)]),
        step("decode", 0.04, 0.06, 4),
        step("prefill", 0.06, 0.10, 2000, [("b", 0.020, 0.060)]),
    ]
    log.ticks = [0.001, 0.006, 0.002]  # one tick held the loop 6 ms
    log.long_ticks = [(0.030, 0.006)]  # ... from 30 ms
    # Client TTFTs (intended arrival -> first delta): a 0.055 s, b 0.090 s; b reached the
    # engine 5 ms after its intended arrival.
    traces = [_trace(loadgen, "a", 0.0, 0.055), _trace(loadgen, "b", 0.015, 0.105)]
    out = ana.anatomy(log, traces, slow_share=0.5)
    assert out["num_requests"] == 2 and out["num_prompt_steps"] == 2
    assert out["slowest_ttft_p50_ms"] == pytest.approx(90.0)  # b alone
    assert out["slowest_queue_p50_ms"] == pytest.approx(40.0)
    assert out["slowest_prefill_p50_ms"] == pytest.approx(40.0)
    assert out["slowest_deliver_p50_ms"] == pytest.approx(10.0)
    if ana.SAME_CLOCK:  # deliver = submit (engine arrival after the intended) + emit
        assert out["slowest_submit_p50_ms"] == pytest.approx(5.0)
        assert out["slowest_emit_p50_ms"] == pytest.approx(5.0)
        assert out["all_emit_p50_ms"] == pytest.approx(5.0)
        # The window: a's arrival (0) to b's first token (105 ms), slowest first.
        win = out["window"]
        assert win["slowest"] == ["b", "a"] and win["span_ms"] == pytest.approx(105.0)
        assert win["decode_busy_share"] == pytest.approx(60 / 105)
        assert win["prompt_busy_share"] == pytest.approx(80 / 105)
        assert win["arrivals"] == [  # b reached the engine's queue 5 ms after its arrival
            "+0.0 arrive a 8 tok (TTFT 55.0 ms, queued +0.0 ms)",
            "+15.0 arrive b 8 tok (TTFT 90.0 ms, queued +5.0 ms)",
        ]
        assert win["ticks"] == ["+30.0 tick 6.0 ms"]
        assert win["prompt_steps"] == ["+10.0..+50.0 prefill 1000 tok ends a",
                                       "+60.0..+100.0 prefill 2000 tok ends b"]  # fmt: skip
        assert ana.window(log, []) is None
        assert win["elsewhere"] == []
        # a slow first token a second later is another burst: named, not spanned
        late = _trace(loadgen, "c", 1.0, 1.2)
        apart = ana.window(log, [*traces, late])
        assert apart["slowest"] == ["c"] and apart["elsewhere"] == ["b", "a"]
        assert apart["span_ms"] == pytest.approx(200.0) and apart["prompt_steps"] == []
    assert out["num_long_ticks"] == 1 and out["tick_max_ms"] == pytest.approx(6.0)
    assert out["big_prompt_step_ms_per_1k_tokens_p50"] == pytest.approx(20.0)  # b's step only
    assert out["all_queue_p50_ms"] == pytest.approx(25.0)  # median of 10 and 40
    # The first prefill shared all 40 ms with decode steps (0-40 and 40-60), the second none.
    assert out["prompt_step_shared_p50"] == pytest.approx(0.5)
    later = ana.FoldedStep("decode", 0.2, 0.3, 4)  # after both: shares nothing
    assert ana._overlap(log.steps[1], [later]) == 0.0
    assert ana._overlap(log.steps[1], [log.steps[0], later]) == pytest.approx(0.75)
    assert out["prompt_step_ms_per_1k_tokens_p50"] == pytest.approx(30.0)  # 40 and 20 ms/1k
    # The second prompt step was launched 10 ms after the first's fold-back: 10 of 90 ms idle.
    assert out["prompt_turnaround_p50_ms"] == pytest.approx(10.0)
    assert out["prompt_turnaround_share"] == pytest.approx(10 / 90)
    apart = [log.steps[1], ana.FoldedStep("prefill", 0.2, 0.3, 100)]  # 150 ms later: no run
    assert ana.prompt_turnarounds(apart) == ([], None)


def test_tiny_sweep_with_anatomy(tmp_path: Path) -> None:
    row = tiny_policy_row(tmp_path, "--ttft-anatomy")
    parts = row["ttft_anatomy"]
    assert parts["num_requests"] == row["num_finished"] == 4
    assert parts["num_prompt_steps"] >= 1 and parts["prompt_step_tokens_p50"] > 0
    for key in ("queue", "prefill", "deliver", "submit", "emit"):
        assert parts[f"all_{key}_p50_ms"] >= 0, key  # the parts lie inside the client's TTFT
    assert parts["tick_max_ms"] > 0 and parts["num_long_ticks"] >= 0
    assert parts["all_prefill_p50_ms"] > 0
    assert parts["slowest_ttft_p50_ms"] == pytest.approx(row["ttft_p99_ms"], rel=0.5)


def test_steplog_marks_prompts_ended_in_any_lane() -> None:
    """A short prompt computed inside a decode step ends there; decode rows riding in a later
    mixed step (tokens already out) are not prompts that step ended."""
    from types import SimpleNamespace as NS

    ana = load_bench("ttft_anatomy")

    def seq(rid: str, out: int):
        return NS(request_id=rid, seq_id=rid, num_output_tokens=out, arrival_time=0.0,
                  first_scheduled_time=0.001)  # fmt: skip

    def entry(s, new: int = 1):
        return NS(seq=s, draft_token_ids=None, num_new_tokens=new, draft_len=0)

    fresh, running = seq("short", 0), seq("old", 5)
    clock = iter([0.010, 0.020])

    def fold(flight, seconds):  # the engine hands each row a token
        for e in flight.plan.seqs:
            e.seq.num_output_tokens += 1

    disp = NS(_fold=fold, _launch=None, tick=None, clock=lambda: next(clock))
    log = ana.StepLog().attach(disp)
    decode = NS(lane="decode", num_tokens=9, seqs=[entry(fresh, 8), entry(running)])
    disp._fold(NS(plan=decode, start=0.005), 0.0)
    mixed = NS(lane="mixed", num_tokens=2, seqs=[entry(fresh), entry(running)])
    disp._fold(NS(plan=mixed, start=0.012), 0.0)
    assert [rid for rid, _, _ in log.steps[0].prompts_done] == ["short"]
    assert log.steps[1].prompts_done == []


def test_prompt_steps_carry_what_the_fuse_rule_read() -> None:
    """The prefill lane's planning notes the backlog-fuse rule's inputs; the prompt step
    launched from that plan carries them into the window (a decode step's plan does not)."""
    import asyncio
    from types import SimpleNamespace as NS

    ana = load_bench("ttft_anatomy")

    def seq(rid: str, tokens: int):
        return NS(request_id=rid, seq_id=rid, num_tokens=tokens, num_computed_tokens=0,
                  num_output_tokens=0, arrival_time=0.0, first_scheduled_time=0.001)  # fmt: skip

    waiting = [seq("a", 1846), seq("b", 152)]
    sched = NS(waiting=waiting, num_running=16, max_num_seqs=64, max_prefill_chunk=8192,
               kv=NS(block_size=16, num_free_blocks=116))  # fmt: skip
    clock = iter([0.030, 0.031, 0.032, 0.080, 0.081, 0.090])

    async def launch(lane, plan):
        return True

    disp = NS(sched=sched, fuse_decode_backlog_s=0.02, in_flight={"verify": object()},
              ahead=NS(step=None), _prefill_wait=lambda: 0.0296, _fold=lambda f, s: None,
              _launch=launch, tick=None, clock=lambda: next(clock),
              _plan=lambda lane: NS(lane=lane, num_tokens=1998, seqs=[]))  # fmt: skip
    log = ana.StepLog().attach(disp)
    read = "wait 29.6 ms, queued 1998 tok, room, running 16/64, verify busy"
    assert ana.fuse_inputs(disp) == read
    prompt = disp._plan("prefill")
    decode = disp._plan("decode")  # planned in between: takes nothing the prompt step read
    asyncio.run(disp._launch("decode", decode))
    asyncio.run(disp._launch("prefill", prompt))
    disp._fold(NS(plan=prompt, start=0.032), 0.05)
    assert log.steps[-1].fuse == read
    sched.kv.num_free_blocks = 115  # one short of the 1,846-token first chunk
    disp.ahead.step = object()
    assert ana.fuse_inputs(disp) == (
        "wait 29.6 ms, queued 1998 tok, no room, running 16/64, verify + decode ahead busy"
    )
    disp.fuse_decode_backlog_s = None
    assert ana.fuse_inputs(disp) is None
    if ana.SAME_CLOCK:  # the window: the step with what the rule read
        log = ana.StepLog()
        log.steps = [ana.FoldedStep("prefill", 0.0, 0.05, 1998, fuse=read)]
        traces = [_trace(load_bench("loadgen"), "a", 0.0, 0.06)]
        assert ana.window(log, traces)["prompt_steps"] == [f"+0.0..+50.0 prefill 1998 tok [{read}]"]


def test_window_lead_in_and_the_loop_probe() -> None:
    """Arrivals, ticks and late wake-ups are listed from the launch of the prompt step in
    flight as the window opens; the probe notes a loop held by a blocking call."""
    import asyncio
    import time
    from types import SimpleNamespace as NS

    ana, loadgen = load_bench("ttft_anatomy"), load_bench("loadgen")
    loop = asyncio.new_event_loop()
    disp = NS(_fold=None, _launch=None, tick=None, clock=time.perf_counter)
    log = ana.StepLog().attach(disp, loop)

    async def hold() -> None:
        await asyncio.sleep(0.01)
        time.sleep(0.03)  # holds the loop: the probe wakes ~30 ms late
        await asyncio.sleep(0.01)

    try:
        loop.run_until_complete(hold())
        log.close()
        loop.run_until_complete(asyncio.sleep(0))
    finally:
        loop.close()
    assert any(0.02 <= late < 0.2 for _, late in log.loop_lags), log.loop_lags
    if not ana.SAME_CLOCK:
        return
    # A prompt step from -40 ms ends at +10; "early" arrived at -20 and was queued 15 ms late.
    log = ana.StepLog()
    early = _trace(loadgen, "early", -0.020, 0.060)
    log.steps = [
        ana.FoldedStep("prefill", -0.040, 0.010, 1600),
        ana.FoldedStep("prefill", 0.011, 0.100, 2800, [("slow", 0.0, 0.011)]),
        ana.FoldedStep("prefill", 0.101, 0.150, 1000, [("early", -0.005, 0.101)]),
    ]
    log.long_ticks = [(-0.030, 0.004), (-0.050, 0.004)]  # the second before the lead-in
    log.loop_lags = [(-0.019, 0.015)]
    win = ana.window(log, [_trace(loadgen, "slow", 0.0, 0.101), early], k=1)
    assert win["slowest"] == ["slow"] and win["span_ms"] == pytest.approx(101.0)
    assert win["arrivals"] == [
        "-20.0 arrive early 8 tok (TTFT 80.0 ms, queued +15.0 ms)",
        "+0.0 arrive slow 8 tok (TTFT 101.0 ms, queued +0.0 ms)",
    ]
    assert win["ticks"] == ["-30.0 tick 4.0 ms"]
    assert win["loop_late"] == ["-19.0 loop 15.0 ms late"]
