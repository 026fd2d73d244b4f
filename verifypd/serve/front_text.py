"""Detokenizing in the front process (``RemoteEngine``), as vLLM's front detokenizes and its
engine core does not: a request whose text the engine never reads (no stop strings, no
log-probs, whose tokens' text the engine would decode) is sent with ``detokenize=False``, and
the front turns its deltas' token ids into the same text deltas the engine would have made, with
the engine's own code (``engine.detokenizer.push_output``) on the same tokenizer. The engine
process's loop then spends nothing per token on text."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

from verifypd.engine.detokenizer import IncrementalDetokenizer, StopChecker, push_output
from verifypd.types import RequestOutput, SamplingParams


def front_detokenizes(params: SamplingParams) -> bool:
    """Whether the front can make this request's text: it wants text, and the engine needs none
    (stop strings end a sequence in the engine; log-probs carry each token's text)."""
    return (
        params.detokenize
        and not params.stop
        and params.logprobs is None
        and params.prompt_logprobs is None
    )


def engine_params(params: SamplingParams) -> SamplingParams:
    """What the engine process gets for a request the front detokenizes: ids only."""
    return dataclasses.replace(params, detokenize=False)


class FrontText:
    """One request's text, per choice, made in the front from the deltas' token ids."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.choices: dict[int, tuple[IncrementalDetokenizer, StopChecker]] = {}

    def fill(self, out: RequestOutput) -> RequestOutput:
        """``out`` with ``new_text`` set as the engine would have set it."""
        if out.index not in self.choices:
            detok = IncrementalDetokenizer(self.tokenizer, self.prompt_token_ids)
            self.choices[out.index] = (detok, StopChecker([]))
        detok, stop = self.choices[out.index]
        before = out.num_output_tokens - len(out.new_token_ids)
        seq = SimpleNamespace(finish_reason=out.finish_reason, params=self.params)
        text, _ = push_output(detok, stop, out.new_token_ids, before, seq)
        if out.finished:
            text += stop.flush()
            del self.choices[out.index]
        out.new_text = text
        return out
