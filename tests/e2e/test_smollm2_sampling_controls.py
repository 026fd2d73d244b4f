"""Sampling controls on the embedded SmolLM2 (CPU, fp32, greedy): penalties, logit_bias,
bad_words and min_tokens equal a step-by-step transformers reference (transformers' logits,
transformers' logits processors where it has them, then argmax), in one batch of requests with
different settings; with n-gram and draft-model speculation the output is token-identical."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    MinNewTokensLengthLogitsProcessor,
    NoBadWordsLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from verifypd.config import EngineConfig, SpecConfig
from verifypd.engine.sampling_controls import resolve_bad_words
from verifypd.engine.tokenizer import load_tokenizer
from verifypd.llm import LLM
from verifypd.types import SamplingParams

pytestmark = pytest.mark.slow

NUM_NEW = 14
FRANCE_CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def _cases(tok) -> list[tuple[str, str, SamplingParams]]:
    """(name, prompt, params): one feature each, then all at once, then none."""
    chat = tok.apply_chat_template(FRANCE_CHAT, tokenize=False, add_generation_prompt=True)
    greedy = dict(max_tokens=NUM_NEW, temperature=0.0)
    return [
        ("frequency", "The capital of France is", SamplingParams(frequency_penalty=2.0, **greedy)),
        ("presence", "List the days of the week: Monday, Tuesday,",
         SamplingParams(presence_penalty=1.5, **greedy)),
        ("repetition", "1, 2, 3, 4, 5, 6,", SamplingParams(repetition_penalty=1.3, **greedy)),
        ("negative", "1, 2, 3, 4, 5, 6,",
         SamplingParams(frequency_penalty=-0.5, repetition_penalty=0.9, **greedy)),
        ("logit_bias", "def fibonacci(n):",
         SamplingParams(logit_bias={198: -100, 260: 6}, **greedy)),
        ("bad_words", "Repeat after me: the quick brown fox jumps over the lazy dog. The quick",
         SamplingParams(bad_words=["fox", "brown fox", "lazy dog"], **greedy)),
        ("min_tokens", chat, SamplingParams(min_tokens=12, stop_token_ids=[30], **greedy)),
        ("all", chat, SamplingParams(
            frequency_penalty=0.5, presence_penalty=0.3, repetition_penalty=1.2,
            logit_bias={28: 2.0}, bad_words=["Paris"], min_tokens=10, **greedy)),
        ("none", "The capital of France is", SamplingParams(**greedy)),
    ]  # fmt: skip


def _encode(tok, prompt: str) -> list[int]:
    return tok.encode(prompt, add_special_tokens=not prompt.startswith("<|im_start|>"))


@torch.inference_mode()
def _hf_processed_greedy(model, prompt: list[int], params: SamplingParams, eos: set[int]):
    """transformers' logits each step, the controls applied in vLLM's order, argmax."""
    stops = set(params.stop_token_ids) | (set() if params.ignore_eos else eos)
    output: list[int] = []
    past, inp = None, torch.tensor([prompt])
    while len(output) < params.max_tokens:
        res = model(input_ids=inp, past_key_values=past, use_cache=True)
        past = res.past_key_values
        scores = _process(res.logits[:, -1].float(), prompt, output, params, stops)
        token = int(scores.argmax())
        output.append(token)
        if token in stops:
            break
        inp = torch.tensor([[token]])
    return output


def _process(scores, prompt, output, params: SamplingParams, stops: set[int]):
    # Bad words are matched against the output only (vLLM), so a prefix longer than it never is.
    words = [w for w in params.bad_words_token_ids or [] if len(w) - 1 <= len(output)]
    if words:
        scores = NoBadWordsLogitsProcessor(words)(torch.tensor([output or [0]]), scores)
    if params.logit_bias:
        bias = [[[t], b] for t, b in params.logit_bias.items()]
        scores = SequenceBiasLogitsProcessor(bias)(torch.tensor([prompt + output]), scores)
    if params.min_tokens:
        every = torch.tensor([prompt + output])
        proc = MinNewTokensLengthLogitsProcessor(len(prompt), params.min_tokens, sorted(stops))
        scores = proc(every, scores)
    if params.repetition_penalty != 1:
        rep = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)
        scores = rep(torch.tensor([prompt + output]), scores)
    counts = torch.bincount(torch.tensor(output, dtype=torch.int64), minlength=scores.shape[-1])
    scores = scores - params.frequency_penalty * counts.float()
    return scores - params.presence_penalty * (counts > 0).float()


@pytest.fixture(scope="module")
def cases():
    tok = load_tokenizer("default")
    return [(name, _encode(tok, prompt), params) for name, prompt, params in _cases(tok)]


@pytest.fixture(scope="module")
def plain(cases) -> dict[str, list[int]]:
    return _run(cases, SpecConfig())


def _run(cases, spec: SpecConfig) -> dict[str, list[int]]:
    llm = LLM(config=EngineConfig(model="default", device="cpu", spec=spec))
    outs = llm.generate([ids for _, ids, _ in cases], [params for *_, params in cases])
    llm.core.check_integrity()
    assert llm.core.kv.usage == 0
    if spec.method != "off":
        assert llm.core.spec.num_verifies > 0 and llm.core.spec.num_accepted > 0
    return {name: out.token_ids for (name, _, _), out in zip(cases, outs, strict=True)}


def test_controls_equal_the_transformers_reference(hf_smollm, cases, plain):
    tok = load_tokenizer("default")
    eos = {tok.eos_token_id}
    for name, ids, params in cases:
        resolve_bad_words(params, tok)
        want = _hf_processed_greedy(hf_smollm, ids, params, eos)
        assert plain[name] == want, name
    assert plain["frequency"] != plain["none"]  # the controls change the output
    # Unheld, the greedy answer ends within 12 tokens (test_serve_sampling_controls checks it).
    assert len(plain["min_tokens"]) >= 12 and 30 not in plain["min_tokens"][:12]
    assert 7042 not in plain["all"] and 7042 in plain["none"]  # " Paris" is a bad word there


@pytest.mark.parametrize(
    "spec",
    [  # fixed L: on CPU the goodput policy may rightly find speculation does not pay
        SpecConfig(method="ngram", controller=False),
        SpecConfig(method="draft", draft_model="default", controller=False),
    ],
    ids=["ngram", "draft"],
)
def test_speculation_is_token_identical_for_every_control(cases, plain, spec):
    got = _run(cases, spec)
    for name, *_ in cases:
        assert got[name] == plain[name], name
