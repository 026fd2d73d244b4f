"""Where a lane's step runs: the executor strategy the dispatcher launches through.

A launch must never block the event loop. On GPU a launch only enqueues kernels on the lane's
stream (``StreamExecutor``) and the dispatcher polls the step's CUDA event; an eager prompt
step, whose enqueueing alone takes many milliseconds of host time, is enqueued a few layers at
a time with the event loop free in between (``background_lanes``: the dispatcher runs such a
launch as a task of its own). On CPU the forward itself is the work, so it runs in one worker
thread (``ThreadExecutor``). Both run the policy's ``after_launch`` (chained drafts, the
drafter following prompt chunks, its catch-up behind a decode step's plain rows) on the
event-loop thread, which alone touches the scheduler and the KV allocator; behind a launch in
pieces, the drafter's forward over the prompt chunks is itself enqueued in pieces, after the
launch has returned (``busy`` until it is).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import Generator
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol, TypeVar

import torch

from verifypd.engine.core import EngineCore
from verifypd.engine.runner import PendingStep
from verifypd.lanes.spec_policy import SpeculationPolicy
from verifypd.types import SeqStatus, StepPlan

T = TypeVar("T")


def lane_priorities(least: int, greatest: int, order: str) -> dict[str, int]:
    """CUDA stream priority per stream, from the device's range (``least`` is 0, ``greatest``
    negative: a lower number is served first) and ``EngineConfig.lane_priorities``. The
    drafter's forwards behind prompt steps (``follow``) always come last: they only save
    later work, so they take what the lanes leave. Its catch-up beside decode steps (``feed``,
    ``SpecConfig.follow_decode_stream`` "beside") runs at the decode lane's priority
    (``LaneStreams`` puts "below" at the follow stream's)."""
    if order == "equal":
        return dict.fromkeys(("decode", "verify", "prefill", "follow", "feed"), least)
    levels = list(range(greatest, least + 1))  # served first .. last
    first = levels[0]
    last = levels[-2] if len(levels) > 2 else levels[-1]  # the follow stream's is below it
    out = {"verify": (first + last) // 2, "follow": least}
    if order == "decode-first":
        return {**out, "decode": first, "feed": first, "prefill": last}
    if order == "prefill-first":
        return {**out, "decode": last, "feed": last, "prefill": first}
    raise ValueError(f"unknown lane priority order {order!r}")


class LaneStreams:
    """One CUDA stream per lane, created with the lane's priority (``lane_priorities``), one
    for the drafter following prompt steps where prefill has its own, and with ``feed`` one
    for its catch-up beside decode steps (``SpecConfig.follow_decode_stream``: "beside" at
    the decode lane's priority, "below" at the follow stream's); no-ops on CPU."""

    def __init__(
        self,
        device: torch.device,
        wanted: tuple[str, ...] = ("decode", "prefill", "verify"),
        order: str = "decode-first",
        feed: str | None = None,
    ) -> None:
        self.streams: dict[str, torch.cuda.Stream] = {}
        # ``wanted`` (EngineConfig.lane_streams): the lanes that get their own stream; default
        # all three (DESIGN.md). An earlier measurement that had verify on its own stream 2.7x
        # slower was made while steps still compiled Triton variants mid-run; with that fixed
        # (H200, dummy Qwen2.5-7B + 0.5B drafter) the verify stream was 6-10 % faster than the
        # current stream at batch 1 and 8.
        if device.type == "cuda":
            least, greatest = torch.cuda.Stream.priority_range()  # (0, -N): lower runs first
            prios = lane_priorities(least, greatest, order)
            names = [*wanted, "follow"] if "prefill" in wanted else list(wanted)
            names += ["feed"] if feed else []
            if feed == "below":
                prios["feed"] = prios["follow"]
            self.streams = {n: torch.cuda.Stream(device, priority=prios[n]) for n in names}

    def context(self, lane: str):
        stream = self.streams.get(lane)
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


@contextlib.contextmanager
def gemm_sm_carveout(sms: int) -> Generator[None, None, None]:
    """cuBLAS GEMMs enqueued inside leave ``sms`` SMs to other streams: cuBLASLt's SM count
    target, which torch honours on its cuBLASLt path only, so that path is preferred inside.
    Both settings are process-wide and read when a GEMM is enqueued: they are restored on
    leaving, and nothing else may be enqueued meanwhile (the lanes enqueue from one thread).
    0: nothing changes."""
    if not sms:
        yield
        return
    blas = torch.backends.cuda.preferred_blas_library()
    carve = torch._C._get_sm_carveout_experimental()
    torch.backends.cuda.preferred_blas_library("cublaslt")
    torch._C._set_sm_carveout_experimental(sms)
    try:
        yield
    finally:
        torch._C._set_sm_carveout_experimental(carve)
        torch.backends.cuda.preferred_blas_library(blas)


PROMPT_LANES = frozenset(("prefill", "follow"))  # prompt-sized GEMMs: the carve-out's lanes
_DECODE_STATES = (SeqStatus.DECODING, SeqStatus.VERIFYING)


class StepExecutor(Protocol):
    """Launches one lane's step; ``enqueues``: a launch returns before the step has run (so a
    landed step's deltas can be made while the next one runs); ``background_lanes``: lanes
    whose launch pauses part-way (the dispatcher must not wait for it)."""

    enqueues: bool
    streams: LaneStreams
    background_lanes: frozenset[str]
    busy: bool  # work started by a launch still runs after it returned

    async def launch(self, lane: str, plan: StepPlan) -> PendingStep: ...

    def close(self) -> None: ...


class StreamExecutor:
    """GPU: a step is enqueued on its lane's stream; nothing waits for it."""

    enqueues = True

    def __init__(self, core: EngineCore, policy: SpeculationPolicy, streams: LaneStreams) -> None:
        self.core, self.policy, self.streams = core, policy, streams
        self.slice_layers = core.config.prefill_slice_layers
        self.carveout = core.config.prefill_sm_carveout
        self.carve_in_backlog = core.config.prefill_sm_carveout_in_backlog
        if self.carveout:
            if not hasattr(torch._C, "_set_sm_carveout_experimental"):  # an experimental API
                raise ValueError(f"prefill_sm_carveout: torch {torch.__version__} has no SM "
                                 "carve-out for cuBLAS (set it to 0)")  # fmt: skip
            sms = torch.cuda.get_device_properties(core.device).multi_processor_count
            if self.carveout >= sms:
                raise ValueError(
                    f"prefill_sm_carveout={self.carveout} leaves a prompt step no SMs of {sms}"
                )
        self.num_carved = 0  # prompt launches (or pieces of one) enqueued with the carve-out
        self.background_lanes = frozenset(("prefill",) if self.slice_layers else ())
        # The drafter's forwards behind prompt steps, run one after another by one task, on
        # the follow stream or the prompt step's own (SpecConfig.follow_prefill_stream).
        self._behind: collections.deque[Generator[None, None, None]] = collections.deque()
        self._behind_lane = core.config.spec.follow_prefill_stream
        self._behind_task: asyncio.Task | None = None

    async def launch(self, lane: str, plan: StepPlan) -> PendingStep:
        if lane in self.background_lanes:
            return await self._launch_in_pieces(lane, plan)
        with self._context(lane):
            if lane == "verify" and self.streams.streams:
                follow_drafts(plan, torch.cuda.current_stream())
            pending = self.core.launch(plan)
            self.policy.after_launch(plan, pending, lambda: self.streams.context("feed"))
            return pending

    async def _launch_in_pieces(self, lane: str, plan: StepPlan) -> PendingStep:
        """Enqueues the step ``slice_layers`` layers at a time, on its lane's stream, yielding
        to the event loop between the pieces (the other lanes launch and land meanwhile). The
        drafter's forward behind its prompt chunks (``SpecConfig.follow_prefill``) is queued
        to run after it, in pieces too, while the step lands and hands out its tokens."""
        pending = await self._in_pieces(lane, self.core.launch_iter(plan, self.slice_layers))
        with self.streams.context(lane):
            self.policy.chain_after(plan, pending)
        behind = self.policy.follow_behind(plan, self.slice_layers)
        if behind is not None:
            self._behind.append(behind)
            if self._behind_task is None:
                self._behind_task = asyncio.create_task(self._run_behind())
        return pending

    async def _run_behind(self) -> None:
        """Runs the queued forwards behind prompt steps in order on the follow stream, below
        every lane's priority, or on the prefill lane's (one at a time: a prompt's next chunk
        is followed once its last one has been; the first drafting for a request waits for
        its forward on the GPU)."""
        try:
            while self._behind:
                await self._in_pieces(self._behind_lane, self._behind.popleft())
        finally:
            self._behind_task = None

    def _context(self, lane: str) -> contextlib.AbstractContextManager:
        """The lane's stream and, for a prompt lane while decode rows are running, the GEMMs'
        SM carve-out (EngineConfig.prefill_sm_carveout): decode then keeps SMs the prompt's
        GEMMs do not take; with nothing decoding, or other prompts waiting behind it (unless
        ``prefill_sm_carveout_in_backlog``), the prompt step has them all. With the carve-out
        off (the default) the stream alone: nothing more on any launch."""
        carve = self.carveout and lane in PROMPT_LANES and self._decoding()
        if carve and (self.carve_in_backlog or not self.core.scheduler.prompts_waiting()):
            self.num_carved += 1
            return self._carved(lane)
        return self.streams.context(lane)

    @contextlib.contextmanager
    def _carved(self, lane: str) -> Generator[None, None, None]:
        with self.streams.context(lane), gemm_sm_carveout(self.carveout):
            yield

    def _decoding(self) -> bool:
        return any(s.status in _DECODE_STATES for s in self.core.scheduler.running)

    @property
    def busy(self) -> bool:
        """A drafter's forward behind a prompt step is queued or being enqueued."""
        return self._behind_task is not None

    async def _in_pieces(self, lane: str, pieces: Generator[None, None, T]) -> T:
        """Runs ``pieces`` on the lane's stream, a turn of the event loop after each pause."""
        while True:
            with self._context(lane):
                try:
                    next(pieces)
                except StopIteration as stop:
                    return stop.value
            await asyncio.sleep(0)

    def close(self) -> None:
        """Cancels the forwards behind prompt steps not yet enqueued (the engine stops)."""
        if self._behind_task is not None:
            self._behind_task.cancel()
        for pieces in self._behind:
            pieces.close()
        self._behind.clear()


class ThreadExecutor:
    """CPU: a step runs in one worker thread while the event loop stays free."""

    enqueues = False
    background_lanes: frozenset[str] = frozenset()
    busy = False  # nothing runs behind a step once its launch has returned

    def __init__(self, core: EngineCore, policy: SpeculationPolicy, streams: LaneStreams) -> None:
        self.core, self.policy, self.streams = core, policy, streams
        self._pool = ThreadPoolExecutor(1)

    async def launch(self, lane: str, plan: StepPlan) -> PendingStep:
        loop = asyncio.get_running_loop()
        pending = await loop.run_in_executor(self._pool, self.core.launch, plan)
        self.policy.after_launch(plan, pending)  # host state: on the loop
        return pending

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def executor_for(
    core: EngineCore, policy: SpeculationPolicy, lanes: tuple[str, ...]
) -> StepExecutor:
    """The strategy for ``core``'s device, with streams for ``lanes``
    (``EngineConfig.lane_streams``)."""
    spec = core.config.spec
    feed = spec.follow_decode_stream if spec.feeds_beside_decode else None
    streams = LaneStreams(core.device, lanes, core.config.lane_priorities, feed)
    kind = StreamExecutor if core.device.type == "cuda" else ThreadExecutor
    return kind(core, policy, streams)


def follow_drafts(plan: StepPlan, stream: torch.cuda.Stream) -> None:
    """The drafts were made on the decode stream and never synced to the host: the verify
    stream waits for them on the GPU, and the allocator may not reuse their memory before the
    verify has read them."""
    waited: set[int] = set()
    for e in plan.seqs:
        drafts = e.drafts
        if drafts is None:
            continue
        if drafts.ready is not None and id(drafts.ready) not in waited:
            waited.add(id(drafts.ready))
            stream.wait_event(drafts.ready)
        for t in (drafts.ids, drafts.probs):
            if t is not None:
                t.record_stream(stream)
