"""AsyncEngine: the asyncio front of the engine core.

``generate`` is an async iterator of ``RequestOutput`` deltas. A background task drives the
lane dispatcher; steps launch through the device's executor strategy (``lanes.executor``: CUDA
streams on GPU, one worker thread on CPU), so the event loop never blocks on the device. The KV
cache allocator and the scheduler are touched only from the event-loop thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from verifypd.config import EngineConfig
from verifypd.engine.core import EngineCore
from verifypd.lanes.dispatcher import LaneDispatcher
from verifypd.lanes.executor import executor_for
from verifypd.lanes.prompt_ahead import prompt_ahead_on
from verifypd.lanes.spec_policy import SpeculationPolicy
from verifypd.types import Observer, RequestOutput, RequestTiming, SamplingParams

logger = logging.getLogger("verifypd")


class AsyncEngine:
    """Serves requests concurrently from one event loop."""

    def __init__(self, config: EngineConfig, observer: Observer | None = None) -> None:
        self.config = config
        self.observer = observer or Observer()
        self.core = EngineCore(config, self.observer)
        self.policy = SpeculationPolicy(self.core)
        self._frozen = self.core.gc_freeze
        self.model_name = self.core.model_name
        self.tokenizer = self.core.tokenizer
        # One request may hold at most its share of the KV pool (max_request_kv_share): the
        # effective context (what the server defaults max_tokens to and reports) is the smaller.
        self.max_model_len = self.core.max_choice_len(1)
        self.vocab_size = self.core.model_config.vocab_size
        self._sinks: dict[str, Callable[[RequestOutput], None]] = {}  # id -> where deltas go
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self.executor = executor_for(self.core, self.policy, config.lane_streams)
        self.streams = self.executor.streams
        self.dispatcher = LaneDispatcher(
            self.core,
            self.executor.launch,
            self._deliver,
            ttft_budget_s=config.scheduler.ttft_budget_s,
            single_lane=config.lane_mode == "single",
            lane_context=self.streams.context,
            # A GPU launch only enqueues: make a landed step's deltas after the next launch.
            # EngineConfig.emit_after_launch=False turns that off (A/B runs).
            emit_after_launch=self.executor.enqueues and config.emit_after_launch,
            deliver_before_drafting=config.deliver_before_drafting,
            policy=self.policy,
            decode_ahead=self.core.decode_ahead,
            ahead_beside_prefill=config.decode_ahead_beside_prefill,
            ahead_waits_for_prompts=config.decode_ahead_waits_for_prompts,
            background_lanes=self.executor.background_lanes,
            decode_gap_beside_prefill_s=config.decode_gap_beside_prefill_s,
            prompt_in_decode_tokens=self.core.prompt_in_decode_tokens,
            fuse_decode_backlog_s=config.fuse_decode_backlog_s,
            fuse_decode_backlog_tokens=config.fuse_decode_backlog_tokens,
            fuse_decode_hold_tokens=config.fuse_decode_hold_tokens,
            fuse_rounds_rows=config.fuse_rounds_rows,
            prompt_ahead=prompt_ahead_on(config.prompt_ahead, self.executor.enqueues),
            steps_land=not self.executor.enqueues,
        )
        if self.dispatcher.decode_ahead:
            logger.info("decode-ahead on: the next decode step is launched while one runs")
        if self.dispatcher.prompt_ahead.enabled:
            logger.info("prompt-ahead on: the next prompt step is launched while one runs "
                        "(--no-prompt-ahead turns it off)")  # fmt: skip
        if self._frozen:
            _freeze_heap()  # after everything start-up made (EngineConfig.gc_freeze)

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        if self._task is None:
            self._wakeup = asyncio.Event()
            self._task = asyncio.create_task(self._run(), name="verifypd-engine")

    async def pause(self) -> None:
        """Ends the dispatch task once no step is in flight; ``generate`` starts it again.
        The offline ``LLM`` pauses after each call, so its private loop holds no pending task
        between calls."""
        while self.dispatcher.in_flight or self.executor.busy:
            await asyncio.sleep(0)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def stop(self) -> None:
        for rid in list(self._sinks):
            self.abort(rid)
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        self.dispatcher.cancel_launches()
        self.executor.close()
        self.core.compiles.close()
        if self._frozen:  # frozen objects are never collected: give this engine's back
            self._frozen = False
            gc.unfreeze()

    # ------------------------------------------------------------------ requests
    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        timing: RequestTiming | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yields deltas for every choice of the request; aborts it if the consumer leaves.
        ``arrival_time``: ``submit``'s. ``timing``: its arrival and first delta are stamped."""
        await self.start()
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        if timing is not None:
            timing.arrival = time.monotonic() if arrival_time is None else arrival_time
            arrival_time = timing.arrival
        self.submit(request_id, prompt_token_ids, params, queue.put_nowait, arrival_time)
        remaining = params.n
        try:
            while remaining:
                out = await queue.get()
                remaining -= out.finished
                if timing is not None and timing.first_out is None:
                    timing.first_out = time.monotonic()
                yield out
        finally:
            if remaining:  # the consumer left early
                self._sinks.pop(request_id, None)
                self.core.abort_request(request_id)
                self._report_depths()

    def submit(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        sink: Callable[[RequestOutput], None],
        arrival_time: float | None = None,
    ) -> None:
        """Admit a request whose deltas go to ``sink`` until its last choice finishes
        (``generate`` hands them to its iterator; the engine process's relay,
        ``serve.engine_worker``, to its socket). Raises ``ParamError`` for input that can
        never be served; ``abort`` ends it. Call after ``start``. ``arrival_time``
        (``time.monotonic()``, None: now): when it reached the front, where that is not this
        loop (``serve.engine_process`` stamps it there: this loop may be held by a launch)."""
        self.core.add_request(request_id, list(prompt_token_ids), params, arrival_time)
        remaining = params.n

        def take(out: RequestOutput) -> None:
            nonlocal remaining
            remaining -= out.finished
            if not remaining:
                self._sinks.pop(request_id, None)
            sink(out)

        self._sinks[request_id] = take
        self._wakeup.set()

    def max_choice_len(self, n: int) -> int:
        """The longest prompt + max_tokens each choice of an ``n``-choice request may have."""
        return self.core.max_choice_len(n)

    def abort(self, request_id: str) -> None:
        for out in self.core.abort_request(request_id):
            self._deliver(out)

    @property
    def num_running(self) -> int:
        return self.core.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        return self.core.scheduler.num_waiting

    @property
    def kv_usage(self) -> float:
        return self.core.kv.usage

    @property
    def kv_blocks_free(self) -> int:
        """Free KV blocks, prefix-cached (evictable) ones included."""
        return self.core.kv.num_free_blocks

    def check_integrity(self) -> None:
        self.core.check_integrity()

    def policy_snapshot(self) -> dict[str, Any] | None:
        """The speculation policy's state now, None without one: its controller's
        ``snapshot()`` (estimates, cost levels, decisions by reason, the last plan) with the
        drafter's step counts (graph replays against eager forwards), what it was fed behind
        prompt steps (``SpecConfig.follow_prefill``), and its rows drafted behind verifies
        against those the next round took (``DraftChainer``). Benchmarks sample it into
        timelines."""
        controller = self.core.controller
        if controller is None:
            return None
        snap = controller.snapshot()
        drafter = self.core.spec.drafter
        if drafter is not None:
            follower = drafter.follower
            snap |= {
                "drafter_graph_steps": drafter.runner.num_graph_steps,
                "drafter_eager_steps": drafter.runner.num_eager_steps,
                "drafter_followed_tokens": follower.num_followed_tokens,
                "drafter_follows_stopped": follower.num_follows_stopped,
                "drafter_follow_replays": follower.num_follow_replays,
                "drafter_chained_rows": drafter.chainer.num_chained_rows,
                "drafter_adopted_rows": drafter.chainer.num_adopted_rows,
            }
        return snap

    # ------------------------------------------------------------------ loop
    async def _run(self) -> None:
        while True:
            try:
                await self._loop()
            except Exception:  # a bug in a step must not leave every request waiting forever
                logger.exception("engine step loop failed; ending live requests with 'error'")
                self._fail_all()
                self._wakeup.clear()
                await self._wakeup.wait()  # resume with the next request, not in a tight loop

    def _fail_all(self) -> None:
        """End every live request with "error"; free the blocks of steps lost in the crash."""
        d = self.dispatcher
        queued = [e.seq for f in d.flights() for e in f.plan.seqs]
        queued += [e.seq for e in d.verify_queue]  # these steps still land and fold back in
        for rid in list(self._sinks):
            seqs = [st.seq for st in self.core.requests.get(rid, [])]
            for out in self.core.abort_request(rid, "error"):
                self._deliver(out)
            for seq in seqs:
                if seq.in_flight and not any(seq is q for q in queued):
                    self.core.free_lost(seq)
        self._report_depths()

    async def _loop(self) -> None:
        d = self.dispatcher
        while True:
            if await d.tick():
                await asyncio.sleep(0)
            elif d.in_flight:
                await asyncio.sleep(0)  # poll the lanes' CUDA events without blocking
            elif d.has_work():
                await asyncio.sleep(0.001)  # work exists but nothing fits right now
            else:
                self._wakeup.clear()
                await self._wakeup.wait()

    def _deliver(self, out: RequestOutput) -> None:
        sink = self._sinks.get(out.request_id)
        if sink is not None:
            sink(out)

    def _report_depths(self) -> None:
        self.observer.requests(self.num_running, self.num_waiting)


def _freeze_heap() -> None:
    """Collect once, then freeze what is left (``EngineConfig.gc_freeze``): the weights' Python
    objects, graphs and tables stay out of every later collection. Process-wide; ``stop``
    thaws it (``gc.unfreeze``) so a stopped engine's memory can be collected again."""
    gc.collect()
    gc.freeze()
