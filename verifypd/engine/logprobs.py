"""Log-probabilities of sampled, verified and prompt tokens, computed on the device and read
back with the step's sampled ids.

Values are the model's raw log-probabilities: ``log_softmax`` of the logits as the forward
produced them, taken before sampling (before temperature, penalties, biases, top-k/top-p).

Which logits row scores which token:
- a plain sample row scores the token sampled from it;
- a verify's 1 + L rows score the accepted drafts and the final (bonus or resampled) token:
  the target's distributions from the verify forward, never the drafter's;
- a prompt row (a prefill chunk of a request with ``prompt_logprobs``) at position p scores
  prompt token p + 1.

No extra copy and no extra sync: the values ride in the step's one int64 buffer that brings the
sampled ids back (float32 bit-cast to int32, sign-extended), laid out as ``[R]`` log-probs of
the scored tokens, ``[R, K]`` top ids, ``[R, K]`` top log-probs, where R is the number of
scored rows and K the largest top-N asked for in the step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from verifypd.types import (
    ParamError,
    RequestOutput,
    SamplingParams,
    ScheduledSeq,
    Sequence,
    StepPlan,
    TokenLogprob,
)

ToDevice = Callable[[list[int], torch.dtype], torch.Tensor]


def any_asks_logprobs(plan: StepPlan) -> bool:
    """Whether any entry of the step asks for output or prompt log-probs."""
    return any(
        s.seq.params.logprobs is not None or s.seq.params.prompt_logprobs is not None
        for s in plan.seqs
    )


@dataclass
class PromptScoring:
    """Rows of a step's ``[T]`` query tokens that score prompt tokens, per plan entry."""

    rows: list[int] = field(default_factory=list)  # rows of [T]
    targets: list[int] = field(default_factory=list)  # the prompt token each row scores
    entries: list[tuple[int, int]] = field(default_factory=list)  # (plan index, num rows)

    @classmethod
    def build(cls, plan: StepPlan, query_lens: list[int]) -> PromptScoring:
        """Prompt positions p of each prefill chunk with prompt log-probs still missing."""
        out = cls()
        first_row = 0
        for i, (s, q) in enumerate(zip(plan.seqs, query_lens, strict=True)):
            lo, hi = _prompt_span(s)
            if hi > lo:
                start = s.seq.num_computed_tokens
                out.rows += range(first_row + lo - start, first_row + hi - start)
                out.targets += s.seq.token_ids[lo + 1 : hi + 1]
                out.entries.append((i, hi - lo))
            first_row += q
        return out


def _prompt_span(s: ScheduledSeq) -> tuple[int, int]:
    """Positions [lo, hi) of this chunk whose logits score a prompt token not yet scored."""
    seq = s.seq
    if not seq.needs_prompt_logprobs or s.draft_token_ids:
        return 0, 0
    start = seq.num_computed_tokens
    lo = max(start, len(seq.prompt_logprobs))
    hi = min(start + s.num_new_tokens, seq.num_prompt_tokens - 1)
    return lo, hi


@dataclass
class _Scored:
    """Consecutive scored rows that belong to one plan entry."""

    plan_index: int
    kind: str  # "output" (sampled or verified tokens) | "prompt"
    first: int  # first of its rows among the R scored rows
    count: int
    num_top: int
    targets: list[int] = field(default_factory=list)  # prompt: the scored token ids


class StepLogprobs:
    """The log-prob work of one launched step: ``start`` before sampling (log_softmax and
    top-K of the asked rows), ``finish`` once the tokens exist on the device (the scored
    tokens' own log-probs, and what goes into the step's buffer), ``unpack`` on the host."""

    def __init__(
        self,
        scored: list[_Scored],
        token_index: torch.Tensor,
        logp: torch.Tensor,
        top: tuple[torch.Tensor, torch.Tensor],
        prompt_targets: torch.Tensor,
    ) -> None:
        self.scored = scored
        self._token_index = token_index  # [R] into cat(sampled, verify out, prompt targets)
        self._logp = logp  # [R, V] float32
        self._top_lp, self._top_ids = top  # [R, K]
        self._prompt_targets = prompt_targets  # [P]
        self.offset = 0  # where its values start in the step's int64 buffer
        self.num_rows = logp.shape[0]

    @property
    def num_top(self) -> int:
        return self._top_ids.shape[1]

    @classmethod
    def start(
        cls,
        plan: StepPlan,
        logits: torch.Tensor,
        groups: tuple[list[int], list[int], list[int]],
        prompt: PromptScoring,
        to_device: ToDevice,
    ) -> StepLogprobs | None:
        """``logits`` [rows, V]: the plain sample rows, then each verify seq's 1 + L rows, then
        ``prompt.rows``. ``groups``: the plan indices of the sample rows, of the verify seqs,
        and each verify seq's row count. None when no row of the step asks."""
        sample_seqs, verify_seqs, verify_counts = groups
        select, token_index, scored = [], [], []
        n_plain, width = len(sample_seqs), max(verify_counts, default=0)
        num_out = n_plain + len(verify_seqs) * width  # sampled ids, then verify out [B, W]

        def add(i: int, kind: str, rows: range, tokens: range, targets=()) -> None:
            num_top = plan.seqs[i].seq.params.prompt_logprobs if kind == "prompt" else (
                plan.seqs[i].seq.params.logprobs)  # fmt: skip
            scored.append(_Scored(i, kind, len(select), len(rows), num_top, list(targets)))
            select.extend(rows)
            token_index.extend(tokens)

        for j, i in enumerate(sample_seqs):
            if plan.seqs[i].seq.params.logprobs is not None:
                add(i, "output", range(j, j + 1), range(j, j + 1))
        row = n_plain
        for k, (i, n) in enumerate(zip(verify_seqs, verify_counts, strict=True)):
            if plan.seqs[i].seq.params.logprobs is not None:
                base = n_plain + k * width
                add(i, "output", range(row, row + n), range(base, base + n))
            row += n
        at = 0
        for i, n in prompt.entries:
            rows = range(row + at, row + at + n)
            add(i, "prompt", rows, range(num_out + at, num_out + at + n), prompt.targets[at:][:n])
            at += n
        if not scored:
            return None
        return cls._compute(scored, select, token_index, prompt.targets, logits, to_device)

    @classmethod
    def _compute(cls, scored, select, token_index, targets, logits, to_device) -> StepLogprobs:
        num_rows = len(select)
        index = to_device(select + token_index + targets, torch.int64)  # one upload
        logp = torch.log_softmax(logits.index_select(0, index[:num_rows]).float(), dim=-1)
        num_top = min(max(s.num_top for s in scored), logp.shape[-1])
        top = logp.topk(num_top, dim=-1) if num_top else _empty_top(num_rows, logp.device)
        tokens = index[num_rows : 2 * num_rows]
        return cls(scored, tokens, logp, top, index[2 * num_rows :])

    def finish(self, sampled: torch.Tensor | None, verified: torch.Tensor | None) -> list:
        """Int64 pieces for the step's buffer: ``sampled`` [n_plain] ids, ``verified``
        [B, 1 + L] accepted drafts and final token (-1 padded). Frees the [R, V] rows."""
        parts = [p.reshape(-1) for p in (sampled, verified) if p is not None]
        source = torch.cat([*parts, self._prompt_targets]).to(torch.int64)
        tokens = source.index_select(0, self._token_index).clamp(min=0)  # [R]
        values = self._logp.gather(1, tokens[:, None]).squeeze(1)  # [R]
        self._logp = None
        return [_bits(values), self._top_ids.reshape(-1), _bits(self._top_lp).reshape(-1)]

    def unpack(self, packed: torch.Tensor, plan: StepPlan, token_ids: list[list[int]]) -> None:
        """Host side, after the step's sync: fills ``logprobs`` / ``prompt_logprobs`` of the
        plan entries. ``packed``: the step's int64 host buffer."""
        r, k, off = self.num_rows, self.num_top, self.offset
        values = _floats(packed[off : off + r]).tolist()
        top_ids = packed[off + r : off + r + r * k].view(r, k).tolist()
        top_lp = _floats(packed[off + r + r * k : off + r + 2 * r * k]).view(r, k).tolist()
        for s in self.scored:
            entry = plan.seqs[s.plan_index]
            tokens = s.targets if s.kind == "prompt" else token_ids[s.plan_index]
            out = [
                TokenLogprob(t, values[s.first + j], _top(top_ids, top_lp, s.first + j, s.num_top))
                for j, t in enumerate(tokens[: s.count])
            ]
            if s.kind == "prompt":
                entry.prompt_logprobs = out
            else:
                entry.logprobs = out


def _top(ids: list[list[int]], values: list[list[float]], row: int, n: int) -> list:
    return list(zip(ids[row][:n], values[row][:n], strict=True))


def _empty_top(num_rows: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        torch.empty(num_rows, 0, device=device),
        torch.empty(num_rows, 0, dtype=torch.int64, device=device),
    )


def _bits(x: torch.Tensor) -> torch.Tensor:
    """float32 -> int64 carrying the same 32 bits (sign-extended), for the int64 buffer."""
    return x.to(torch.float32).contiguous().view(torch.int32).to(torch.int64)


def _floats(x: torch.Tensor) -> torch.Tensor:
    """Inverse of ``_bits`` on the host."""
    return x.to(torch.int32).view(torch.float32)


def fold_logprobs(plan: StepPlan) -> None:
    """After the scheduler applied a landed step: each sequence keeps the log-probs of the
    tokens it actually appended (a stop condition may cut a verify's tokens short) and of the
    prompt tokens the chunk scored."""
    for entry in plan.seqs:
        seq = entry.seq
        if entry.prompt_logprobs:
            seq.prompt_logprobs += entry.prompt_logprobs
        if entry.logprobs:
            room = seq.num_output_tokens - len(seq.logprobs)
            seq.logprobs += entry.logprobs[: max(room, 0)]


def attach_logprobs(out: RequestOutput, seq: Sequence, first: int) -> None:
    """Puts the log-probs of the delta's tokens (output tokens ``first`` on) on ``out``, and
    the prompt's on a choice's first delta."""
    params = seq.params
    if params.logprobs is not None:
        out.logprobs = seq.logprobs[first : first + len(out.new_token_ids)]
    if params.prompt_logprobs is not None and first == 0:
        out.prompt_logprobs = [None, *seq.prompt_logprobs]


def check_num_logprobs(params: SamplingParams, max_logprobs: int) -> None:
    """A ParamError naming the field when more top log-probs are asked than allowed."""
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is not None and value > max_logprobs:
            raise ParamError(name, f"{name} must be <= {max_logprobs} (max_logprobs), got {value}")
