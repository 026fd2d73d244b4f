"""A fake engine implementing ``EngineClient`` (serve/engine_client.py), for server tests.

It generates one character-token per sequence per step on a timer and keeps a waiting queue
(``max_num_seqs`` running at most, by priority). What it shares with the real engine, so that
the server is tested against the engine's own rules: requests are refused by
``admission.RequestLimits``, stop strings are cut by ``StopChecker``, and KV blocks come from a
``KVCacheManager`` (prefix caching off), so leak tests are meaningful: a request that is
aborted, finished or disconnected must give back every block, and ``check_integrity``
cross-checks the pool against the live block tables.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from verifypd.config import EngineConfig
from verifypd.engine.admission import RequestLimits
from verifypd.engine.detokenizer import StopChecker
from verifypd.kvcache import KVCacheManager
from verifypd.types import Observer, RequestOutput, SamplingParams

TEXT = "the quick brown fox jumps over the lazy dog "
EOS_ID = 0


class FakeTokenizer:
    """One token per character (token id = code point); id 0 is EOS."""

    eos_token_id = EOS_ID

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids if i != EOS_ID or not skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict], tokenize: bool = False, add_generation_prompt: bool = True
    ) -> str:
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


@dataclass
class FakeSeq:
    request_id: str
    index: int
    num_prompt: int
    params: SamplingParams
    offset: int  # where in TEXT its output starts (0 when greedy, seeded otherwise)
    stop: StopChecker
    blocks: list[int] = field(default_factory=list)
    output: list[int] = field(default_factory=list)
    unsent: str = ""  # text past the stop-string check, not yet in a delta
    ids_sent: int = 0  # output tokens already in a delta
    prefill_left: int = 0
    finish_reason: str | None = None
    last_token_at: float | None = None

    @property
    def num_tokens(self) -> int:
        return self.num_prompt + len(self.output)

    @property
    def max_tokens(self) -> int:
        return self.num_prompt + self.params.max_tokens


@dataclass
class FakeRequest:
    request_id: str
    seqs: list[FakeSeq]
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    arrival: float = field(default_factory=time.monotonic)
    num_cached: int = 0

    @property
    def is_finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.seqs)


class FakeEngine:
    """Implements ``EngineClient``; ``calls``, ``aborted`` and ``check_integrity`` for tests."""

    def __init__(
        self,
        model_name: str = "fake-model",
        *,
        max_model_len: int = 512,
        num_blocks: int = 512,
        block_size: int = 16,
        max_num_seqs: int = 8,
        step_s: float = 0.005,
        prefill_steps: int = 2,
        eos_after: int | None = None,
        fail_after: int | None = None,
        observer: Observer | None = None,
    ) -> None:
        self.config = EngineConfig(model=model_name)
        self.model_name = model_name
        self.tokenizer = FakeTokenizer()
        self.vocab_size = 0x110000  # token id = code point
        self.max_model_len = max_model_len
        self.limits = RequestLimits(self.vocab_size, max_model_len, num_blocks, block_size, 1.0)
        self.max_num_seqs = max_num_seqs
        self.step_s = step_s
        self.prefill_steps = prefill_steps
        self.eos_after = eos_after
        self.fail_after = fail_after  # finish every seq with reason "error" after this many tokens
        self.observer = observer or Observer()
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False)
        self.calls: list[tuple[str, list[int], SamplingParams]] = []
        self.aborted: list[str] = []
        self._requests: dict[str, FakeRequest] = {}
        self._waiting: list[FakeSeq] = []
        self._running: list[FakeSeq] = []
        self._seen_prompts: set[tuple[int, ...]] = set()
        self._task: asyncio.Task | None = None

    # -- EngineClient ----------------------------------------------------------------------

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        for request_id in list(self._requests):
            self.abort(request_id)
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        self.calls.append((request_id, list(prompt_token_ids), params))
        self.limits.validate(prompt_token_ids, params)
        request = self._add_request(request_id, prompt_token_ids, params)
        num_finished = 0
        try:
            while num_finished < params.n:
                out = await request.queue.get()
                num_finished += out.finished
                yield out
        finally:
            if not request.is_finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        request = self._requests.get(request_id)
        if request is None:
            return
        self.aborted.append(request_id)
        for seq in request.seqs:
            if seq.finish_reason is None:
                self._finish(request, seq, "abort")

    def max_choice_len(self, n: int) -> int:
        return self.limits.max_choice_len(n)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def kv_usage(self) -> float:
        return self.kv.usage

    @property
    def kv_blocks_free(self) -> int:
        return self.kv.num_free_blocks

    def check_integrity(self) -> None:
        self.kv.check_integrity([s.blocks for s in self._running])
        for seq in self._running:
            assert self.kv.num_blocks_needed([], seq.num_tokens) == len(seq.blocks), seq
        assert not any(seq.blocks for seq in self._waiting), "waiting seq holds blocks"

    # -- request bookkeeping -----------------------------------------------------------------

    def _add_request(
        self, request_id: str, prompt: list[int], params: SamplingParams
    ) -> FakeRequest:
        seqs = [self._new_seq(request_id, i, len(prompt), params) for i in range(params.n)]
        request = FakeRequest(request_id, seqs)
        key = tuple(prompt)
        if key in self._seen_prompts:
            request.num_cached = len(prompt) // self.kv.block_size * self.kv.block_size
        self._seen_prompts.add(key)
        self.observer.prefix_cache(len(prompt), request.num_cached)
        self._requests[request_id] = request
        self._waiting.extend(seqs)
        self._waiting.sort(key=lambda s: -s.params.priority)  # stable: FIFO within a priority
        return request

    def _new_seq(
        self, request_id: str, index: int, num_prompt: int, params: SamplingParams
    ) -> FakeSeq:
        if params.is_greedy:
            offset = 0
        else:
            seed = None if params.seed is None else params.seed * 1_000_003 + index
            offset = random.Random(seed).randrange(len(TEXT))
        stop = StopChecker(params.stop, params.include_stop_str_in_output)
        return FakeSeq(
            request_id, index, num_prompt, params, offset, stop, prefill_left=self.prefill_steps
        )

    def _finish(self, request: FakeRequest, seq: FakeSeq, reason: str) -> None:
        seq.finish_reason = reason
        self.kv.free(seq.blocks)
        for queue in (self._running, self._waiting):
            if seq in queue:
                queue.remove(seq)
        request.queue.put_nowait(self._delta(request, seq, finished=True))
        if request.is_finished:
            del self._requests[request.request_id]
            num_generated = sum(len(s.output) for s in request.seqs)
            e2e = time.monotonic() - request.arrival
            self.observer.request_finished(reason, e2e, seq.num_prompt, num_generated)

    def _delta(self, request: FakeRequest, seq: FakeSeq, finished: bool = False) -> RequestOutput:
        tail = seq.stop.flush() if finished else ""
        new_text, seq.unsent = seq.unsent + tail, ""
        new_ids, seq.ids_sent = seq.output[seq.ids_sent :], len(seq.output)
        return RequestOutput(
            request.request_id, seq.index, new_ids, new_text, finished,
            seq.finish_reason if finished else None, seq.num_prompt, len(seq.output),
            request.num_cached,
        )  # fmt: skip

    # -- the step loop -------------------------------------------------------------------------

    async def _run(self) -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(self.step_s)
            now = time.monotonic()
            self._admit(now)
            self._step(now, now - last)
            self._report()
            last = now

    def _admit(self, now: float) -> None:
        """Admit waiting seqs in order while their whole worst case fits next to the running
        seqs' (blocks they may still claim before max_tokens)."""
        while self._waiting and len(self._running) < self.max_num_seqs:
            seq = self._waiting[0]
            reserved = sum(self.kv.num_blocks_needed(s.blocks, s.max_tokens) for s in self._running)
            if self.kv.num_free_blocks - reserved < self.kv.num_blocks_needed([], seq.max_tokens):
                return
            self._waiting.pop(0)
            assert self.kv.allocate(seq.blocks, seq.num_prompt), "admission reserved these"
            self._running.append(seq)
            self.observer.request_queued(now - self._requests[seq.request_id].arrival)

    def _step(self, now: float, dt: float) -> None:
        prefill = [s for s in self._running if s.prefill_left > 0]
        for seq in prefill:
            seq.prefill_left -= 1
        decode = [s for s in self._running if s.prefill_left == 0]
        for seq in decode:
            self._decode_one(seq, now)
        if prefill:
            self.observer.lane_step("prefill", dt, sum(s.num_prompt for s in prefill))
        if decode:
            self.observer.lane_step("decode", dt * 0.6, len(decode))
            self._fake_speculation(decode, dt)

    def _decode_one(self, seq: FakeSeq, now: float) -> None:
        request = self._requests[seq.request_id]
        token = self._next_token(seq)
        assert self.kv.allocate(seq.blocks, seq.num_tokens + 1), "admission reserved these"
        seq.output.append(token)
        if seq.last_token_at is None:
            self.observer.first_token(now - request.arrival)
        else:
            self.observer.inter_token(now - seq.last_token_at)
        seq.last_token_at = now
        reason = self._append_text(seq, token)
        if self.fail_after is not None and len(seq.output) >= self.fail_after:
            reason = "error"
        if reason is not None:
            self._finish(request, seq, reason)
        elif seq.unsent:
            request.queue.put_nowait(self._delta(request, seq))

    def _next_token(self, seq: FakeSeq) -> int:
        if self.eos_after is not None and len(seq.output) >= self.eos_after:
            if not seq.params.ignore_eos:
                return EOS_ID
        return ord(TEXT[(seq.offset + len(seq.output)) % len(TEXT)])

    def _append_text(self, seq: FakeSeq, token: int) -> str | None:
        """Add the token's text; return a finish reason when the sequence is done."""
        if token == EOS_ID or token in seq.params.stop_token_ids:
            return "stop"
        text, hit = seq.stop.push(chr(token))
        seq.unsent += text
        if hit:
            return "stop"
        return "length" if len(seq.output) >= seq.params.max_tokens else None

    def _fake_speculation(self, decode: list[FakeSeq], dt: float) -> None:
        draft_len = 1 + len(decode) % 4
        self.observer.draft_length(draft_len)
        self.observer.spec_tokens(draft_len * len(decode), (draft_len * len(decode) * 2) // 3)
        self.observer.lane_step("verify", dt * 1.5, len(decode) * (1 + draft_len))
        self.observer.drafter_temperature(0.7)

    def _report(self) -> None:
        prefilling = sum(1 for s in self._running if s.prefill_left > 0)
        self.observer.queue_depths(
            {"prefill": len(self._waiting) + prefilling, "decode": len(self._running) - prefilling,
             "verify": (len(self._running) - prefilling) // 2}
        )  # fmt: skip
        self.observer.requests(len(self._running), len(self._waiting))
        self.observer.kv_cache(self.kv_usage, self.kv_blocks_free)
