"""``EngineClient``: the seam between the HTTP server and an engine.

The server uses these members of its engine and no others. ``lanes.AsyncEngine`` implements it
over the real engine; the server tests' fake engine (tests/serve/fake_engine.py) implements it
over a timer, without a model. Everything runs on the server's event loop.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from verifypd.types import Observer, RequestOutput, RequestTiming, SamplingParams

if TYPE_CHECKING:
    from verifypd.config import EngineConfig


@runtime_checkable
class EngineClient(Protocol):
    """What the server needs of an engine."""

    config: EngineConfig  # the server reads ``model`` (the model card's root), ``max_logprobs``
    model_name: str
    tokenizer: Any  # a Hugging Face tokenizer: encode, decode, apply_chat_template
    vocab_size: int  # token ids in requests are checked against it before admission
    max_model_len: int  # the effective context: the server defaults and checks max_tokens by it
    observer: Observer  # the server installs its Prometheus observer here

    async def start(self) -> None:
        """Start stepping (idempotent)."""

    async def stop(self) -> None:
        """Abort every live request and stop stepping."""

    def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        timing: RequestTiming | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Deltas of every choice of the request; raises ``ParamError`` for input that can
        never be served; closing the iterator early aborts the request. ``arrival_time``
        (``time.monotonic()``): when the request reached the caller, if earlier than the call.
        ``timing``: the engine stamps its arrival and first delta there (``RequestTiming``)."""
        ...

    def abort(self, request_id: str) -> None:
        """End the request now (its consumer gets a final "abort" delta)."""

    def max_choice_len(self, n: int) -> int:
        """The longest prompt + max_tokens each choice of an ``n``-choice request may have
        (the context, or each choice's share of the KV pool when that is smaller)."""
        ...

    @property
    def num_running(self) -> int: ...

    @property
    def num_waiting(self) -> int: ...

    @property
    def kv_usage(self) -> float:
        """Fraction of KV blocks in use."""
        ...

    @property
    def kv_blocks_free(self) -> int: ...
