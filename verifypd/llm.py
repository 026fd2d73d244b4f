"""Offline API: ``LLM(model="default").generate(prompts, SamplingParams(...))``.

It runs the product's own driver: an ``AsyncEngine`` (the lane dispatcher; ``lane_mode``
honoured) on a private event loop, every prompt submitted at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from verifypd.config import EngineConfig
from verifypd.lanes.async_engine import AsyncEngine
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
    """Synchronous front for batch generation: the lane dispatcher under the hood, on a private
    event loop (so ``generate`` cannot be called from inside a running loop: use
    ``AsyncEngine`` there)."""

    def __init__(self, model: str = "default", config: EngineConfig | None = None, **kw) -> None:
        config = config or EngineConfig(model=model, **kw)
        self.loop = asyncio.new_event_loop()
        self.engine = AsyncEngine(config)
        self.core = self.engine.core
        self.tokenizer = self.core.tokenizer
        self._next_id = 0

    def generate(
        self,
        prompts: str | list[int] | list[str] | list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[GenerationOutput]:
        """Submits every prompt at once and steps until all are finished."""
        _no_running_loop()
        prompts = _as_list(prompts)
        params_list = (
            params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        )
        results: dict[str, GenerationOutput] = {}
        jobs = []
        for prompt, p in zip(prompts, params_list, strict=True):
            ids = self._encode(prompt)
            rid = f"llm-{self._next_id}"
            self._next_id += 1
            results[rid] = GenerationOutput(rid, ids, [CompletionChoice(i) for i in range(p.n)])
            jobs.append(self._collect(results[rid], self.engine.generate(rid, ids, p)))
        self.run(_gather(jobs))
        return list(results.values())

    def run(self, coro):
        """Runs ``coro`` to completion on this LLM's event loop (also for tests that drive the
        engine a few deltas at a time)."""
        try:
            _no_running_loop()
        except RuntimeError:
            coro.close()
            raise
        try:
            return self.loop.run_until_complete(coro)
        finally:
            self.loop.run_until_complete(self.engine.pause())

    @staticmethod
    async def _collect(result: GenerationOutput, deltas: AsyncIterator[RequestOutput]) -> None:
        async for out in deltas:
            _merge(result, out)

    def close(self) -> None:
        """Stops the engine's task and closes the loop (aborting anything still running)."""
        if not self.loop.is_closed():
            self.loop.run_until_complete(self.engine.stop())
            self.loop.close()

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


def _no_running_loop() -> None:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return
    raise RuntimeError("LLM.generate cannot run inside a running event loop; use AsyncEngine")


async def _gather(jobs: list) -> list:
    return await asyncio.gather(*jobs)


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
