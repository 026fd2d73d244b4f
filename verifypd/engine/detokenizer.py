"""Incremental detokenization and stop-string matching for streaming.

``IncrementalDetokenizer`` decodes a sliding window of tokens (the prefix/read offset technique):
``ids[prefix_offset:read_offset]`` is text already emitted and serves as left context (so
tokenizers that drop a leading space or merge bytes decode the window like the full sequence),
and ``ids[read_offset:]`` is new. Each push decodes two short windows, never the whole sequence.
"""

from __future__ import annotations

from typing import Any

from verifypd.types import Sequence

REPLACEMENT_CHAR = "\ufffd"  # what a decoder yields for an incomplete UTF-8 sequence
_PROMPT_CONTEXT_TOKENS = 5  # left context taken from the end of the prompt


class IncrementalDetokenizer:
    """Turns a growing stream of output token ids into text deltas.

    Text is held back while the decoded window ends in U+FFFD (a multi-byte character split
    across tokens); it comes out with the token that completes it.
    """

    def __init__(
        self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool = True
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = list(prompt_token_ids)
        self.read_offset = len(self.token_ids)  # tokens before this are emitted (or prompt)
        self.prefix_offset = max(self.read_offset - _PROMPT_CONTEXT_TOKENS, 0)
        self.text = ""  # all output text emitted so far

    def _decode(self, start: int, end: int | None = None) -> str:
        return self.tokenizer.decode(
            self.token_ids[start:end],
            skip_special_tokens=self.skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )

    def push(self, token_ids: list[int]) -> str:
        """Append output tokens; return the newly decodable text (possibly empty)."""
        if not token_ids:
            return ""
        self.token_ids.extend(token_ids)
        prefix_text = self._decode(self.prefix_offset, self.read_offset)
        window_text = self._decode(self.prefix_offset)
        if len(window_text) <= len(prefix_text) or window_text.endswith(REPLACEMENT_CHAR):
            return ""  # nothing new yet, or a character is still incomplete
        new_text = window_text[len(prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        self.text += new_text
        return new_text


class StopChecker:
    """Cuts a text stream at the first occurrence of any stop string (OpenAI semantics: the
    stop string itself is not emitted, unless ``include_stop``).

    A tail that could be the start of a stop string is held back, so a stop string split across
    pushes is never streamed.
    """

    def __init__(self, stop: list[str], include_stop: bool = False) -> None:
        self.stop = [s for s in stop if s]
        self.include_stop = include_stop
        self.held = ""  # received but not yet emitted
        self.hit = False

    def _held_len(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best

    def push(self, new_text: str, check: bool = True) -> tuple[str, bool]:
        """Feed new text; return (text safe to emit now, whether a stop string was hit).
        ``check=False``: text that is never searched for stop strings (before min_tokens)."""
        if self.hit:
            return "", True
        if not check:
            return new_text, False
        text = self.held + new_text
        found = [(i, -len(s)) for s in self.stop if (i := text.find(s)) >= 0]
        if found:
            self.hit, self.held = True, ""
            start, neg_len = min(found)  # the first stop string (the longest at one place)
            return text[: start - neg_len if self.include_stop else start], True
        num_held = self._held_len(text)
        self.held = text[len(text) - num_held :]
        return text[: len(text) - num_held], False

    def flush(self) -> str:
        """At a finish without a hit: return (and clear) the held-back tail."""
        held, self.held = self.held, ""
        return held


def push_output(
    detok: IncrementalDetokenizer,
    stop: StopChecker,
    new_ids: list[int],
    num_before: int,
    seq: Sequence,
) -> tuple[str, bool]:
    """The text of ``seq``'s new output tokens (``num_before`` were pushed before) and whether
    a stop string was hit. The first ``min_tokens`` output tokens are never searched for stop
    strings (vLLM); a stop token (or EOS) that ended the sequence leaves its text out unless
    ``include_stop_str_in_output``."""
    params = seq.params
    if seq.finish_reason == "stop" and new_ids and not params.include_stop_str_in_output:
        new_ids = new_ids[:-1]  # "stop" here is a stop token: strings are matched below
    num_free = min(len(new_ids), max(params.min_tokens - num_before, 0))
    text = stop.push(detok.push(new_ids[:num_free]), check=False)[0] if num_free else ""
    more, hit = stop.push(detok.push(new_ids[num_free:]))
    return text + more, hit
