"""Short prompts computed inside a decode step (``EngineConfig.prompt_in_decode_tokens``).

On CPU the ``PromptInDecodeGraphs`` are not captured: they run the same forward over the same
static buffers eagerly, so the layout (decode rows padded to a graph batch, then the chunk
padded to q rows, the attention split in two) and the dispatcher's rules are checked here;
tests/engine/test_gpu_prompt_in_decode.py replays the captured graphs on a GPU.
"""

from __future__ import annotations

import pytest
from helpers import serve_arrivals, tiny_config, triton_on_cpu

from verifypd.config import PROMPT_IN_DECODE_SIZES, EngineConfig
from verifypd.engine.core import EngineCore
from verifypd.engine.prompt_in_decode import PromptInDecodeGraphs
from verifypd.lanes.dispatcher import LaneDispatcher
from verifypd.lanes.lane_steps import InFlight
from verifypd.lanes.prompt_rides import MAX_RIDE_WAIT_S
from verifypd.types import SamplingParams, ScheduledSeq, SeqStatus, StepPlan

Q = 32
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=8, temperature=0.9, seed=11, ignore_eos=True)


def _core(sizes: tuple[int, ...] = (Q,), use_triton: bool = False) -> EngineCore:
    core = EngineCore(tiny_config(prompt_in_decode_tokens=sizes, use_triton=use_triton))
    assert core.runner.inputs.prompt_in_decode == []  # CPU: nothing captured
    for q in sizes:  # as setup does on a GPU, without the capture
        runner = core.runner
        graphs = PromptInDecodeGraphs(
            runner.model, runner.pool.kv, core.kv.block_size, 8, core.max_model_len, q
        )
        runner.inputs.prompt_in_decode.append(graphs)
    return core


def _decoding(core: EngineCore, rid: str, n: int) -> ScheduledSeq:
    """A sequence past its prompt of ``n`` tokens with one sampled token: a decode row."""
    (seq,) = core.add_request(rid, list(range(3, 3 + n)), GREEDY)
    seq.token_ids.append(7)
    seq.num_computed_tokens = n
    core.scheduler._remove_waiting(seq)
    core.scheduler.running.append(seq)
    seq.status = SeqStatus.DECODING
    assert core.kv.allocate(seq.block_table, n + 1)
    return ScheduledSeq(seq, 1)


def _prompt(core: EngineCore, rid: str, n: int, params=GREEDY) -> ScheduledSeq:
    (seq,) = core.add_request(rid, list(range(5, 5 + n)), params)
    assert core.kv.allocate(seq.block_table, n)
    return ScheduledSeq(seq, n)


def test_decode_rows_then_the_chunk_padded_to_graph_shapes() -> None:
    core = _core()
    rows = [_decoding(core, f"d{i}", n) for i, n in enumerate((5, 17, 40))]
    chunk = _prompt(core, "p", 20)
    inputs = core.runner.prepare(StepPlan("decode", [*rows, chunk]))
    meta, b = inputs.meta, 4  # three rows padded to the graphs' batch of 4
    assert inputs.in_decode is core.runner.inputs.prompt_in_decode[0]
    assert meta.split.num_decode_rows == b and inputs.input_ids.shape == (b + Q,)
    assert meta.query_start_loc.tolist() == [0, 1, 2, 3, 4, 4 + Q]
    assert meta.seq_lens.tolist() == [6, 18, 41, 1, Q]  # the pad row: a context of one
    assert inputs.positions[:4].tolist() == [5, 17, 40, 0]
    assert inputs.positions[b : b + 20].tolist() == list(range(20))
    assert inputs.input_ids[:3].tolist() == [7, 7, 7]
    assert inputs.input_ids[b : b + 20].tolist() == list(range(5, 25))
    assert meta.slot_mapping[3] == -1 and (meta.slot_mapping[b + 20 :] == -1).all()
    assert (meta.slot_mapping[:3] >= 0).all() and (meta.slot_mapping[b : b + 20] >= 0).all()
    assert meta.block_tables.shape[0] == b + 1 and (meta.block_tables[3] == 0).all()
    assert inputs.sample_rows == [0, 1, 2, b + 19] and inputs.sample_seqs == [0, 1, 2, 3]
    split = meta.split
    assert split.decode.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert split.decode.max_query_len == 1 and split.decode.seq_lens.tolist() == [6, 18, 41, 1]
    assert split.prompt.query_start_loc.tolist() == [b, b + Q]  # rows of the whole step
    assert split.prompt.seq_lens.tolist() == [Q] and split.prompt.max_query_len == Q


def test_only_plain_decode_steps_with_one_short_chunk_last_take_the_graphs() -> None:
    core = _core((16, Q))
    pick = core.runner.inputs.prompt_in_decode_graphs
    small, big = core.runner.inputs.prompt_in_decode
    row = _decoding(core, "d", 9)
    assert pick(StepPlan("decode", [row, _prompt(core, "p10", 10)])) is small
    assert pick(StepPlan("decode", [row, _prompt(core, "p20", 20)])) is big  # the smallest q
    assert pick(StepPlan("decode", [row, _prompt(core, "long", Q + 1)])) is None
    assert pick(StepPlan("decode", [_prompt(core, "alone", 8)])) is None  # no decode row
    assert pick(StepPlan("decode", [row, _decoding(core, "d2", 3)])) is None  # no chunk
    assert pick(StepPlan("prefill", [row, _prompt(core, "lane", 8)])) is None
    assert pick(StepPlan("decode", [_prompt(core, "first", 8), row])) is None  # chunk last
    nine = [_decoding(core, f"r{i}", 4) for i in range(9)]  # more than the graphs hold (8)
    assert pick(StepPlan("decode", [*nine, _prompt(core, "p", 8)])) is None
    drafted = _decoding(core, "drafted", 6)
    drafted.draft_token_ids = [1, 2]
    assert pick(StepPlan("decode", [drafted, _prompt(core, "q", 8)])) is None
    scored = SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=1)
    assert pick(StepPlan("decode", [row, _prompt(core, "scored", 8, scored)])) is None


def _serve(sizes: tuple[int, ...], prompts, abort_fused: bool = False, use_triton=False,
           **dispatch):  # fmt: skip
    """Arrivals one per tick through the lane dispatcher (decode first: the TTFT budget is
    never reached); returns each request's tokens, the core, the requests whose prompt ran
    inside a decode step, and the one aborted there."""
    core = _core(sizes, use_triton) if sizes else EngineCore(tiny_config(use_triton=use_triton))
    got: list = []
    plans: list[StepPlan] = []
    inside: list[str] = []  # the prompts launched inside a decode step, in order

    async def launch(lane, plan):
        plans.append(plan)
        if plan.carries_prompt:  # (read at launch: the chunk's sequence is prefilling)
            ahead = " ahead" if plan.prev_ids is not None else ""
            inside.append(plan.seqs[-1].seq.request_id + ahead)
        for e in plan.seqs:  # a second token planned behind the step computing the prompt
            if e.is_ahead and e.seq.status is SeqStatus.PREFILLING:
                inside.append(e.seq.request_id + " second ahead")
        return core.launch(plan)

    d = LaneDispatcher(core, launch, got.append, 60.0,
                       prompt_in_decode_tokens=max(sizes, default=0), **dispatch)  # fmt: skip
    aborted: set[str] = set()

    def abort_one_inside() -> None:
        if abort_fused and not aborted and inside:  # its step is in flight (not folded)
            aborted.add(inside[0])
            core.abort_request(inside[0])

    arrivals = [(rid, ids, p) for rid, (ids, p) in prompts.items()]
    serve_arrivals(core, d, arrivals, 400, abort_one_inside)
    assert not core.has_unfinished() and not d.in_flight
    core.check_integrity()
    assert core.kv.num_free_blocks == core.kv.num_blocks  # no block leaked
    tokens: dict[str, list] = {}
    for o in got:
        tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
        if o.logprobs:  # the sampled tokens' log-probs, to 4 places
            tokens.setdefault(o.request_id + " logprobs", []).extend(
                round(lp.logprob, 4) for lp in o.logprobs
            )
    return tokens, core, inside, aborted


PROMPTS = {
    "first": (list(range(3, 15)), GREEDY),  # alone: a prompt step
    "short": (list(range(4, 13)), GREEDY),
    "full": (list(range(5, 5 + Q)), GREEDY),
    "sampled": (list(range(9, 29)), SAMPLED),
    "long": (list(range(7, 7 + 3 * Q)), GREEDY),  # longer than every graph: prompt steps
    "prefix": (list(range(40, 72)) + [1, 2, 3], GREEDY),
    "prefix-hit": (list(range(40, 72)) + [4, 5, 6, 7], GREEDY),  # 4 new tokens after 32
}


@pytest.mark.parametrize(
    "sizes,use_triton",
    [((Q,), False), ((16, Q), False), pytest.param((Q,), True, marks=triton_on_cpu)],
)
def test_prompts_inside_decode_steps_change_no_token(sizes, use_triton) -> None:
    """Token-identical to prompt steps; with the Triton kernels (interpreted) the step's
    attention runs split (the decode rows on the split-K kernel, the chunk on the prefill
    kernel), with the torch reference over the whole step."""
    names = ("first", "short", "full") if use_triton else PROMPTS  # (interpreted: slow)
    prompts = {name: PROMPTS[name] for name in names}
    want, _, plain_inside, _ = _serve((), prompts, use_triton=use_triton)
    got, core, inside, _ = _serve(sizes, prompts, use_triton=use_triton)
    assert got == want and all(len(t) == 8 for t in got.values())
    # "prefix" is longer than Q; "prefix-hit" too, before its cached blocks count (a waiting
    # prompt is judged by its whole length, which a prefix hit only shortens).
    assert plain_inside == [] and inside == ["short", "full", "sampled"][: len(prompts) - 1]
    replays = [r for g in core.runner.inputs.prompt_in_decode for r in g.replays]
    assert len(replays) == len(inside)
    if sizes == (16, Q):  # "short" (9 tokens) in the 16-row graphs
        assert len(core.runner.inputs.prompt_in_decode[0].replays) == 1


def test_with_decode_ahead_and_log_probs_no_token_changes() -> None:
    """A prompt rides in a decode step launched ahead (its rows' inputs read on the device),
    a riding prompt's second token is planned ahead behind the step computing its first, and
    rows that ask for log-probs get the same ones from a step carrying a prompt."""
    scored = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=2)
    prompts = {name: PROMPTS[name] for name in ("first", "short")}
    prompts["scored"] = (list(range(6, 26)), scored)
    prompts["after"] = (list(range(8, 20)), GREEDY)  # rides beside the scored rows
    prompts.update((name, PROMPTS[name]) for name in ("full", "long", "sampled"))
    want, _, plain_inside, _ = _serve((), prompts, decode_ahead=True)
    got, _, inside, _ = _serve((Q,), prompts, decode_ahead=True)
    assert got == want and len(got["scored logprobs"]) == 8
    assert plain_inside == [] and any(r.endswith(" ahead") for r in inside)
    assert {r.split()[0] for r in inside} >= {"short", "scored", "after", "full"}
    # A riding prompt's second token is planned behind the step computing it, not after the
    # next step ("scored" asks for log-probs: it waits for the host like any such row).
    seconds = {r.split()[0] for r in inside if r.endswith(" second ahead")}
    assert seconds and "scored" not in seconds


def _last_chunk_inside(sizes: tuple[int, ...]) -> tuple[list[int], list[int], EngineCore]:
    """A decoding row, then a 120-token prompt in chunks of 48: its last 24 tokens (positions
    96-119) in the decode step beside the row, then both decode; each request's tokens."""
    core = _core(sizes) if sizes else EngineCore(tiny_config())
    sched = core.scheduler
    (row,) = core.add_request("row", list(range(3, 15)), GREEDY)
    (long,) = core.add_request("long", list(range(12, 132)), GREEDY)

    def step(plan: StepPlan) -> None:
        sched.begin_step(plan)
        core.finish_step(plan, core.launch(plan).result())

    step(StepPlan("prefill", sched.plan_prefill(12, 8, pack=0)))  # the row's prompt
    for _ in range(2):
        step(StepPlan("prefill", sched.plan_prefill(48, 8, pack=0)))  # two chunks of 48
    assert long.num_computed_tokens == 96
    entries = sched.plan_decode()
    entries.append(sched.plan_prompt_end(32))
    assert entries[-1].seq is long and entries[-1].num_new_tokens == 24
    step(StepPlan("decode", entries))
    for _ in range(5):
        step(StepPlan("decode", sched.plan_decode()))
    core.check_integrity()
    return row.output_token_ids, long.output_token_ids, core


def test_a_long_prompts_last_chunk_inside_a_decode_step_keeps_its_positions() -> None:
    want_row, want_long, _ = _last_chunk_inside(())
    got_row, got_long, core = _last_chunk_inside((Q,))
    assert (got_row, got_long) == (want_row, want_long) and len(got_long) == 6
    assert core.runner.inputs.prompt_in_decode[0].replays == [1]  # the graph took the step


def test_a_request_aborted_inside_a_decode_step_ends_alone() -> None:
    want, *_ = _serve((), PROMPTS)
    got, core, inside, aborted = _serve((Q,), PROMPTS, abort_fused=True)
    assert aborted == {"short"}  # the first prompt computed inside a decode step
    assert got.get("short", []) == []
    assert {r: t for r, t in got.items() if r != "short"} == {
        r: t for r, t in want.items() if r != "short"
    }


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_prefill_lane_leaves_a_short_prompt_to_a_plain_decode_step_in_flight() -> None:
    core = _core()
    clock = _Clock()

    async def launch(lane, plan):
        return core.launch(plan)

    d = LaneDispatcher(core, launch, lambda o: None, 60.0, clock=clock,
                       prompt_in_decode_tokens=Q)  # fmt: skip
    waits = d._prompt_waits_for_decode
    assert d.rides.max_rows == 8  # the graphs' batch: a step of more rows takes no prompt
    row = _decoding(core, "d", 9)
    (seq,) = core.add_request("p", list(range(5, 25)), GREEDY)
    seq.arrival_time = clock.now
    assert not waits()  # no decode step in flight: nothing to ride in
    d.in_flight["decode"] = InFlight(StepPlan("decode", [row]), None, clock.now)
    assert waits()
    d.deltas.drafted_last = True  # the step in flight drafted: the next may too
    assert not waits()
    d.deltas.drafted_last = False
    clock.now += MAX_RIDE_WAIT_S
    assert not waits()  # waited long enough: a prompt step
    clock.now -= MAX_RIDE_WAIT_S
    d.verify_queue.append(row)
    assert not waits()
    d.verify_queue.clear()
    (long,) = core.add_request("long", list(range(5, 5 + Q + 1)), GREEDY)
    core.scheduler.waiting.remove(seq)  # the long prompt is next now
    core.scheduler._waiting_keys.pop(0)
    assert core.scheduler.waiting == [long] and not waits()
    d.rides.max_tokens = 0
    assert not waits()


def test_plan_prompt_end_plans_only_a_prompt_that_ends_within_the_tokens() -> None:
    core = EngineCore(tiny_config())
    sched = core.scheduler
    (long,) = core.add_request("long", list(range(3, 43)), GREEDY)
    assert sched.plan_prompt_end(32) is None and sched.waiting == [long]  # nothing planned
    entry = sched.plan_prompt_end(40)
    assert entry is not None and entry.seq is long and entry.num_new_tokens == 40
    assert long.status is SeqStatus.PREFILLING and sched.waiting == []
    scored = SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=1)
    core.add_request("scored", [3, 4, 5], scored)
    assert sched.plan_prompt_end(32) is None
    # A long prompt's last chunk: part-prefilled prompts come first, as in plan_prefill.
    core2 = EngineCore(tiny_config())
    (seq,) = core2.add_request("chunked", list(range(3, 53)), GREEDY)
    (first,) = core2.scheduler.plan_prefill(32, 8)
    core2.scheduler.begin_step(StepPlan("prefill", [first]))
    core2.scheduler.update(StepPlan("prefill", [first]), [[]])
    assert seq.num_computed_tokens == 32
    core2.add_request("next", [3, 4], GREEDY)
    entry = core2.scheduler.plan_prompt_end(32)
    assert entry is not None and entry.seq is seq and entry.num_new_tokens == 18


def test_prompt_in_decode_tokens_is_validated() -> None:
    assert EngineConfig().prompt_in_decode_tokens == PROMPT_IN_DECODE_SIZES  # on by default
    assert PROMPT_IN_DECODE_SIZES == (64, 96, 128, 160, 192, 224, 256)
    assert EngineCore(tiny_config()).prompt_in_decode_tokens == 0  # no graphs on a CPU
    built = tiny_config(prompt_in_decode_tokens=PROMPT_IN_DECODE_SIZES, prompt_in_decode_eager=True)
    eager = EngineCore(built)  # the graphs built, not captured (tests)
    assert eager.prompt_in_decode_tokens == 256 and eager.prompt_in_decode_rows == 64
    assert tiny_config(prompt_in_decode_tokens=()).prompt_in_decode_tokens == ()
    assert tiny_config(prompt_in_decode_tokens=(64, 256)).prompt_in_decode_tokens == (64, 256)
    for bad in ((256, 64), (64, 64), (8,), (5000,), 64, (True,)):
        with pytest.raises(ValueError, match="prompt_in_decode_tokens"):
            tiny_config(prompt_in_decode_tokens=bad)
