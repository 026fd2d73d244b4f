"""A small fake engine for the lane dispatcher: the real scheduler and KV block manager (pure
Python), no model. A step "runs" at once: a decode yields ``last token + 1``, a verify accepts
the drafts up to the first one that differs from that rule, then one more token; a prompt
chunk that reaches the prompt's end yields its first token. A launched step lands at the
dispatcher's second look at it. The fake policy speculates with a
fixed L for every decoding sequence and drafts by the same rule (so every draft is accepted)
unless told to draft wrong.
"""

from __future__ import annotations

from verifypd.engine.scheduler import Scheduler
from verifypd.kvcache.manager import KVCacheManager
from verifypd.types import (
    NO_SPECULATION,
    Observer,
    RequestOutput,
    SamplingParams,
    ScheduledSeq,
    Sequence,
    SpecDecision,
    StepPlan,
)


class FakePending:
    """A launched step (``PendingStep``'s surface). It is done from its second poll on, so a
    step stays in flight while the dispatcher launches another lane, as on a GPU."""

    def __init__(self, token_ids: list[list[int]]) -> None:
        self.token_ids = token_ids
        self.polls = 0

    def done(self) -> bool:
        self.polls += 1
        return self.polls > 1

    def result(self) -> list[list[int]]:
        return self.token_ids

    def seconds(self, wall: float) -> float:
        return wall


def next_tokens(entry: ScheduledSeq) -> list[int]:
    """What the fake model produces for one plan entry."""
    seq = entry.seq
    end = seq.num_computed_tokens + entry.num_new_tokens
    if end < seq.num_tokens:
        return []  # a prompt chunk short of the prompt's end
    out, last = [], seq.token_ids[-1]
    for d in entry.draft_token_ids:
        if d != last + 1:
            break
        out.append(d)
        last = d
    return [*out, last + 1]


class FakeCore:
    """The engine surface the dispatcher uses, over a real scheduler."""

    def __init__(self, num_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 8) -> None:
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False)
        self.observer = Observer()
        self.scheduler = Scheduler(
            self.kv,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=16,
            max_prefill_chunk=8,
            max_model_len=1024,
        )
        self.seqs: dict[str, Sequence] = {}
        self.launched: list[StepPlan] = []
        self.sent: dict[str, int] = {}  # request id -> output tokens delivered
        self.recorded: list[tuple[str, bool]] = []  # (lane, contended) of each timed step

    def add_request(self, rid: str, prompt: list[int], max_tokens: int) -> None:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        seq = self.seqs[rid] = Sequence(rid, prompt, params)
        self.scheduler.add(seq)

    # the dispatcher's verbs
    def decodable(self) -> list[Sequence]:
        return self.scheduler.decodable()

    def prefill_budget(self) -> int:
        return self.scheduler.max_num_batched_tokens

    def launch(self, plan: StepPlan) -> FakePending:
        self.launched.append(plan)
        return FakePending([next_tokens(e) for e in plan.seqs])

    def record_step(self, plan: StepPlan, seconds: float, contended: bool = False) -> None:
        self.recorded.append((plan.lane, contended))

    def apply_step(self, plan: StepPlan, token_ids: list[list[int]]) -> list[Sequence]:
        return self.scheduler.update(plan, token_ids)

    def emit(self, changed: list[Sequence]) -> list[RequestOutput]:
        outs = []
        for seq in changed:
            sent = self.sent.get(seq.request_id, 0)
            new = seq.token_ids[seq.num_prompt_tokens + sent :]
            self.sent[seq.request_id] = sent + len(new)
            if new and seq.first_token_time is None:
                seq.first_token_time = 0.0  # (the dispatcher tells first tokens by it)
            done = seq.status.is_finished
            outs.append(RequestOutput(seq.request_id, 0, new, "", done, seq.finish_reason))
        return outs

    def abort_request(self, rid: str, reason: str = "abort") -> list[RequestOutput]:
        seq = self.seqs[rid]
        if seq.status.is_finished:
            return []
        self.scheduler.finish(seq, reason)
        return [RequestOutput(rid, 0, [], "", True, reason)]


class FakePolicy:
    """Fixed L for every decoding sequence; drafts the fake model's own continuation."""

    enabled = True
    reads_prompt_work = True  # the dispatcher tells it of prompt work (a test checks that)

    def __init__(self, core: FakeCore, draft_len: int = 3, fused: bool = False) -> None:
        self.core, self.draft_len, self.fused = core, draft_len, fused
        self.proposed: list[list[int]] = []  # seq ids per proposal
        self.proposed_contended: list[bool] = []  # whether a prompt step ran beside each
        self.wrong_from = None  # draft index from which drafts are wrong (None: all right)
        self.prefill_seen: list[bool] = []  # what each decision was told of prompt work

    def decide(self, prefill_running: bool = False) -> SpecDecision:
        self.prefill_seen.append(prefill_running)
        if not self.draft_len:
            return NO_SPECULATION
        lens = {s.seq_id: self.draft_len for s in self.core.decodable()}
        return SpecDecision(lens, self.fused)

    def propose(self, entries: list[ScheduledSeq], contended: bool = False) -> None:
        self.proposed.append([e.seq.seq_id for e in entries if e.draft_len])
        self.proposed_contended.append(contended)
        for e in entries:
            last = e.seq.token_ids[-1]
            drafts = [last + 1 + k for k in range(e.draft_len)]
            if self.wrong_from is not None:
                drafts[self.wrong_from :] = [-1] * len(drafts[self.wrong_from :])
            e.draft_token_ids = drafts

    def verify_queue(self, depth: int) -> None:
        pass

    def step_landed(self, plan: StepPlan, seconds: float) -> None:
        pass
