"""A fake AsyncEngine with the real engine's API, for server tests.

It generates one character-token per sequence per step on a timer, keeps a waiting queue
(``max_num_seqs`` running at most), and tracks fake KV blocks per sequence in a block pool, so
leak tests are meaningful: a request that is aborted, finished or disconnected must give back
every block, and ``check_integrity`` cross-checks the pool against the live block tables.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from verifypd.types import Observer, ParamError, RequestOutput, SamplingParams

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


class FakeBlockPool:
    """Fixed pool of block ids; every used block has exactly one owner sequence."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free: list[int] = list(range(num_blocks))
        self.owner: dict[int, int] = {}  # block id -> seq id

    def allocate(self, seq_id: int) -> int | None:
        if not self.free:
            return None
        block = self.free.pop()
        self.owner[block] = seq_id
        return block

    def release(self, blocks: list[int]) -> None:
        for block in blocks:
            del self.owner[block]
            self.free.append(block)
        blocks.clear()

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)


_ids = iter(range(1 << 62))


@dataclass
class FakeSeq:
    request_id: str
    index: int
    num_prompt: int
    params: SamplingParams
    offset: int
    seq_id: int = field(default_factory=lambda: next(_ids))
    blocks: list[int] = field(default_factory=list)
    output: list[int] = field(default_factory=list)
    text: str = ""
    num_emitted: int = 0  # characters of ``text`` already sent
    prefill_left: int = 0
    finish_reason: str | None = None
    admitted_at: float | None = None
    last_token_at: float | None = None

    @property
    def num_tokens(self) -> int:
        return self.num_prompt + len(self.output)


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
    """Implements the AsyncEngine API (start/stop/generate/abort + properties + observer)."""

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
        self.model_name = model_name
        self.tokenizer = FakeTokenizer()
        self.vocab_size = 0x110000  # token id = code point
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.step_s = step_s
        self.prefill_steps = prefill_steps
        self.eos_after = eos_after
        self.fail_after = fail_after  # finish every seq with reason "error" after this many tokens
        self.observer = observer or Observer()
        self.pool = FakeBlockPool(num_blocks, block_size)
        self.calls: list[tuple[str, list[int], SamplingParams]] = []
        self.aborted: list[str] = []
        self._requests: dict[str, FakeRequest] = {}
        self._waiting: list[FakeSeq] = []
        self._running: list[FakeSeq] = []
        self._seen_prompts: set[tuple[int, ...]] = set()
        self._task: asyncio.Task | None = None

    # -- AsyncEngine API -------------------------------------------------------------------

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
        self._validate(prompt_token_ids, params)
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

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def kv_usage(self) -> float:
        return 1.0 - len(self.pool.free) / self.pool.num_blocks

    @property
    def kv_blocks_free(self) -> int:
        return len(self.pool.free)

    def check_integrity(self) -> None:
        pool = self.pool
        assert len(pool.free) + len(pool.owner) == pool.num_blocks, "blocks lost"
        assert len(set(pool.free)) == len(pool.free), "block freed twice"
        assert not set(pool.free) & set(pool.owner), "block both free and used"
        live = {s.seq_id: s for s in self._running}
        for block, seq_id in pool.owner.items():
            assert seq_id in live and block in live[seq_id].blocks, f"block {block} leaked"
        for seq in self._running:
            assert len(seq.blocks) == pool.blocks_for(seq.num_tokens), f"bad table {seq}"
        for seq in self._waiting:
            assert not seq.blocks, "waiting seq holds blocks"

    # -- request bookkeeping -----------------------------------------------------------------

    def _validate(self, prompt: list[int], params: SamplingParams) -> None:
        if not prompt:
            raise ParamError("prompt", "prompt is empty")
        total = len(prompt) + params.max_tokens
        if total > self.max_model_len:
            raise ParamError("prompt", f"{total} tokens exceed max_model_len {self.max_model_len}")
        if self.pool.blocks_for(total) * params.n > self.pool.num_blocks:
            raise ParamError("prompt", "request can never fit in the KV cache")

    def _add_request(
        self, request_id: str, prompt: list[int], params: SamplingParams
    ) -> FakeRequest:
        seqs = [self._new_seq(request_id, i, len(prompt), params) for i in range(params.n)]
        request = FakeRequest(request_id, seqs)
        key = tuple(prompt)
        if key in self._seen_prompts:
            request.num_cached = len(prompt) // self.pool.block_size * self.pool.block_size
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
        return FakeSeq(
            request_id, index, num_prompt, params, offset, prefill_left=self.prefill_steps
        )

    def _finish(self, request: FakeRequest, seq: FakeSeq, reason: str) -> None:
        seq.finish_reason = reason
        self.pool.release(seq.blocks)
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
        end = len(seq.text) if finished else len(seq.text) - _holdback(seq.text, seq.params.stop)
        new_text = seq.text[seq.num_emitted : max(end, seq.num_emitted)]
        seq.num_emitted += len(new_text)
        return RequestOutput(
            request.request_id, seq.index, [], new_text, finished,
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
        while self._waiting and len(self._running) < self.max_num_seqs:
            seq = self._waiting[0]
            need = self.pool.blocks_for(seq.num_prompt + seq.params.max_tokens)
            if len(self.pool.free) - self._reserved() < need:
                return
            self._waiting.pop(0)
            seq.admitted_at = now
            self._grow(seq, seq.num_prompt)
            self._running.append(seq)
            self.observer.request_queued(now - self._requests[seq.request_id].arrival)

    def _reserved(self) -> int:
        """Blocks that running seqs may still claim before they hit max_tokens."""
        pool = self.pool
        return sum(
            pool.blocks_for(s.num_prompt + s.params.max_tokens) - len(s.blocks)
            for s in self._running
        )

    def _grow(self, seq: FakeSeq, num_tokens: int) -> None:
        while len(seq.blocks) < self.pool.blocks_for(num_tokens):
            block = self.pool.allocate(seq.seq_id)
            assert block is not None, "admission reserved these blocks"
            seq.blocks.append(block)

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
        self._grow(seq, seq.num_tokens + 1)
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
        else:
            delta = self._delta(request, seq)
            if delta.new_text:
                request.queue.put_nowait(delta)

    def _next_token(self, seq: FakeSeq) -> int:
        if self.eos_after is not None and len(seq.output) >= self.eos_after:
            if not seq.params.ignore_eos:
                return EOS_ID
        return ord(TEXT[(seq.offset + len(seq.output)) % len(TEXT)])

    def _append_text(self, seq: FakeSeq, token: int) -> str | None:
        """Add the token's text; return a finish reason when the sequence is done."""
        params = seq.params
        if token == EOS_ID or token in params.stop_token_ids:
            return "stop"
        seq.text += chr(token)
        hits = [seq.text.find(s) for s in params.stop if s in seq.text]
        if hits:
            seq.text = seq.text[: min(hits)]
            return "stop"
        return "length" if len(seq.output) >= params.max_tokens else None

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
        self.observer.kv_cache(self.kv_usage, len(self.pool.free))


def _holdback(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of ``text`` that could still grow into a stop string."""
    best = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:k]):
                best = k
                break
    return best
