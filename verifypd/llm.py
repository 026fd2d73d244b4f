"""Offline API: ``LLM(model="default").generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

from dataclasses import dataclass, field

from verifypd.config import EngineConfig
from verifypd.engine.core import EngineCore
from verifypd.lanes.sync_driver import SyncDriver
from verifypd.types import RequestOutput, SamplingParams, TokenLogprob


@dataclass
class CompletionChoice:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None  # params.logprobs: one per token
    prompt_logprobs: list[TokenLogprob | None] | None = None  # params.prompt_logprobs


@dataclass
class GenerationOutput:
    """One prompt's result; ``text``/``token_ids``/``finish_reason`` are choice 0's."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionChoice]
    num_cached_tokens: int = 0

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason


class LLM:
    """Synchronous engine for batch generation (continuous batching under the hood)."""

    def __init__(self, model: str = "default", config: EngineConfig | None = None, **kw) -> None:
        config = config or EngineConfig(model=model, **kw)
        self.core = EngineCore(config)
        self.driver = SyncDriver(self.core)
        self.tokenizer = self.core.tokenizer
        self._next_id = 0

    def generate(
        self,
        prompts: str | list[int] | list[str] | list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[GenerationOutput]:
        """Submits every prompt at once and steps until all are finished."""
        prompts = _as_list(prompts)
        params_list = (
            params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        )
        results: dict[str, GenerationOutput] = {}
        for prompt, p in zip(prompts, params_list, strict=True):
            ids = self._encode(prompt)
            rid = f"llm-{self._next_id}"
            self._next_id += 1
            self.core.add_request(rid, ids, p)
            choices = [CompletionChoice(i) for i in range(p.n)]
            results[rid] = GenerationOutput(rid, ids, choices)
        while self.core.has_unfinished():
            for out in self.driver.step():
                _merge(results[out.request_id], out)
        return list(results.values())

    def chat(self, messages: list[dict], params: SamplingParams | None = None) -> GenerationOutput:
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        ids = list(self.tokenizer.encode(text, add_special_tokens=False))
        return self.generate([ids], params)[0]

    def _encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt))
        return list(prompt)


def _as_list(prompts) -> list:
    if isinstance(prompts, str):
        return [prompts]
    if prompts and isinstance(prompts[0], int):
        return [prompts]
    return list(prompts)


def _merge(result: GenerationOutput, out: RequestOutput) -> None:
    choice = result.outputs[out.index]
    choice.text += out.new_text
    choice.token_ids += out.new_token_ids
    if out.logprobs is not None:
        choice.logprobs = (choice.logprobs or []) + out.logprobs
    if out.prompt_logprobs is not None:
        choice.prompt_logprobs = out.prompt_logprobs
    if out.finished:
        choice.finish_reason = out.finish_reason
    result.num_cached_tokens = out.num_cached_tokens
