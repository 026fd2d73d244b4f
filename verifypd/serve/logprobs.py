"""What a choice carries beyond its generated text: the echoed prompt (completions ``echo``)
and log-probabilities, in vLLM's and OpenAI's shapes.

Completions (legacy): ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``; each
``top_logprobs`` entry maps token text -> log-prob for the scored token and the N most likely
tokens (so N + 1 entries when the token is not among them); the first prompt token has ``null``
log-prob and top log-probs. Chat: ``{"content": [{"token", "logprob", "bytes",
"top_logprobs": [{"token", "logprob", "bytes"}, ...]}]}`` with the N most likely tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from verifypd.serve.engine_client import EngineClient
from verifypd.serve.errors import invalid_request
from verifypd.serve.schemas import ChatCompletionRequest, CompletionRequest
from verifypd.types import RequestOutput, TokenLogprob

MIN_LOGPROB = -9999.0  # JSON has no -inf; OpenAI and vLLM clamp to this

Scored = tuple[int, TokenLogprob | None]  # (token id, its log-prob or None)


@dataclass
class ChoiceExtras:
    """Per-response settings; ``n`` choices per prompt, choice index = prompt * n + choice."""

    tokenizer: Any
    n: int = 1
    num_top: int | None = None  # None: no log-probs
    prompts: list[list[int]] = field(default_factory=list)  # prompt ids (echo)
    # Echo: the text of each prompt (None: its ids, decoded when first shown); None: no echo.
    prompt_texts: list[str | None] | None = None
    echo_only: bool = False  # max_tokens 0 with echo: the one generated token is dropped
    _texts: dict[int, str] = field(default_factory=dict, init=False, repr=False)

    @property
    def echo(self) -> bool:
        return self.prompt_texts is not None

    # ------------------------------------------------------------------ completions
    def completion_text(self, index: int, text: str, first: bool) -> str:
        """The text a completion choice (or its first streamed delta) carries."""
        text = "" if self.echo_only else text
        return self._prompt_text(index // self.n) + text if self.echo and first else text

    def _prompt_text(self, prompt: int) -> str:
        """Token-id prompts are decoded only here: after the engine checked their ids."""
        if self.prompt_texts[prompt] is None:
            ids = self.prompts[prompt]
            self.prompt_texts[prompt] = self.tokenizer.decode(ids, skip_special_tokens=False)
        return self.prompt_texts[prompt]

    def completion_logprobs(self, index: int, out: ChoiceLogprobs, offset: int) -> dict | None:
        """The ``logprobs`` object of a completion choice or delta; text offsets start at
        ``offset`` (the characters of this choice already sent)."""
        if self.num_top is None:
            return None
        scored = self._scored(index, out)
        body: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": []}
        offsets = []
        for token_id, lp in scored:
            token = self._text(token_id)
            body["tokens"].append(token)
            body["token_logprobs"].append(None if lp is None else _clamp(lp.logprob))
            body["top_logprobs"].append(None if lp is None else self._top_dict(lp))
            offsets.append(offset)
            offset += len(token)
        return {**body, "text_offset": offsets}

    def _scored(self, index: int, out: ChoiceLogprobs) -> list[Scored]:
        scored: list[Scored] = []
        if self.echo and out.prompt_logprobs is not None:
            prompt = self.prompts[index // self.n]
            scored += list(zip(prompt, out.prompt_logprobs, strict=True))
        if not self.echo_only:
            scored += [(lp.token_id, lp) for lp in out.logprobs]
        return scored

    def _top_dict(self, lp: TokenLogprob) -> dict[str, float]:
        top = {self._text(lp.token_id): _clamp(lp.logprob)}
        for token_id, value in lp.top[: self.num_top]:
            top.setdefault(self._text(token_id), _clamp(value))
        return top

    # ------------------------------------------------------------------ chat
    def chat_logprobs(self, logprobs: list[TokenLogprob]) -> dict | None:
        if self.num_top is None:
            return None
        return {"content": [self._chat_entry(lp) for lp in logprobs]}

    def _chat_entry(self, lp: TokenLogprob) -> dict:
        top = [self._chat_token(t, v) for t, v in lp.top[: self.num_top]]
        return {**self._chat_token(lp.token_id, lp.logprob), "top_logprobs": top}

    def _chat_token(self, token_id: int, logprob: float) -> dict:
        token = self._text(token_id)
        return {"token": token, "logprob": _clamp(logprob), "bytes": list(token.encode())}

    def _text(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._texts[token_id] = text
        return text


@dataclass
class ChoiceLogprobs:
    """Log-probs gathered for one choice (whole response or one delta)."""

    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None

    def add(self, out: RequestOutput) -> None:
        self.logprobs += out.logprobs or []
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs

    @classmethod
    def of(cls, out: RequestOutput) -> ChoiceLogprobs:
        new = cls()
        new.add(out)
        return new


def _clamp(value: float) -> float:
    return max(value, MIN_LOGPROB)


def max_logprobs(engine: EngineClient) -> int:
    """The engine's ``max_logprobs`` (its config)."""
    return engine.config.max_logprobs


def check_logprobs_limit(value: int | None, limit: int, param: str) -> None:
    if value is not None and value > limit:
        raise invalid_request(
            f"'{param}' must be at most {limit} (the server's --max-logprobs), got {value}", param
        )


def completion_extras(
    request: CompletionRequest,
    tokenizer: Any,
    prompts: list[list[int]],
    sources: list[str | list[int]],
    echo_only: bool,
) -> ChoiceExtras | None:
    """Echo and log-prob settings of a completion request; None when it asks for neither."""
    if not request.echo and request.logprobs is None:
        return None
    texts = [s if isinstance(s, str) else None for s in sources] if request.echo else None
    return ChoiceExtras(
        tokenizer, request.n or 1, request.logprobs, prompts, texts, echo_only=echo_only
    )


def chat_extras(request: ChatCompletionRequest, tokenizer: Any) -> ChoiceExtras | None:
    if not request.logprobs:
        return None
    return ChoiceExtras(tokenizer, request.n or 1, request.top_logprobs or 0)
