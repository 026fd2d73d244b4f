"""Several prompts in one completions request: every prompt is added to the engine at once
(one engine request each, so they are scheduled together) and their deltas are merged into one
stream whose choice indices follow vLLM: ``prompt_index * n + choice_index``."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator

from verifypd.serve.engine_client import EngineClient
from verifypd.types import RequestOutput, RequestTiming, SamplingParams

_DONE = object()


async def start_generate(
    engine: EngineClient,
    request_id: str,
    prompt_ids: list[int],
    params: SamplingParams,
    timing: RequestTiming | None = None,
) -> AsyncIterator[RequestOutput]:
    """``engine.generate`` (an async generator, or a coroutine returning an iterator); a
    ``timing`` goes to it only when given (an engine client may not take one)."""
    extra = {} if timing is None else {"timing": timing}
    outputs = engine.generate(request_id, prompt_ids, params, **extra)
    return await outputs if inspect.isawaitable(outputs) else outputs


async def merged_outputs(
    engine: EngineClient, request_id: str, prompts: list[list[int]], params: SamplingParams
) -> AsyncIterator[RequestOutput]:
    """Deltas of every prompt's choices as they come, re-indexed. An error of any prompt
    (e.g. a ParamError when it is added) is raised here; closing this iterator closes every
    prompt's engine iterator, which aborts the unfinished ones and frees their blocks."""
    queue: asyncio.Queue = asyncio.Queue()
    tasks = [
        asyncio.create_task(_pump(engine, f"{request_id}-{i}", ids, params, i * params.n, queue))
        for i, ids in enumerate(prompts)
    ]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is _DONE:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _pump(
    engine: EngineClient,
    request_id: str,
    prompt_ids: list[int],
    params: SamplingParams,
    first_index: int,
    queue: asyncio.Queue,
) -> None:
    outputs = None
    try:
        outputs = await start_generate(engine, request_id, prompt_ids, params)
        async for out in outputs:
            out.index += first_index
            queue.put_nowait(out)
        queue.put_nowait(_DONE)
    except Exception as exc:  # handed to the consumer, which raises it
        queue.put_nowait(exc)
    finally:
        aclose = getattr(outputs, "aclose", None)
        if aclose is not None:  # on cancel: aborts the request, frees its blocks
            await aclose()
