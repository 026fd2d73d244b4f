"""Structured output on the embedded SmolLM2 (CPU, fp32, greedy): JSON-schema output validates
on a hypothesis-drawn batch of schemas, with speculation off, n-gram and draft-model, and the
output is token-identical in all three; regex, choice and EBNF grammars hold."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from verifypd.config import CacheConfig, EngineConfig, SpecConfig
from verifypd.llm import LLM
from verifypd.types import SamplingParams, StructuredOutput

pytestmark = pytest.mark.slow

NUM_SCHEMAS = 6
MAX_TOKENS = 32
NUM_KV_BLOCKS = 160  # 10 sequences of < 200 tokens, 16-token blocks
SPECS = {
    "off": SpecConfig(),
    "ngram": SpecConfig(method="ngram", controller=False),
    "draft": SpecConfig(method="draft", draft_model="default", controller=False),
}
NAMES = ["name", "age", "city", "ok", "tags", "color", "size", "id"]
WORDS = ["red", "green", "blue", "cat", "dog", "yes"]


def _leaf() -> st.SearchStrategy[dict]:
    """Bounded leaves: every string, number and list has a length cap, so the grammar forces
    the output to end within ``MAX_TOKENS``."""
    return st.one_of(
        st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(1, 4)),
        st.builds(
            lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
            st.integers(-20, 20),
            st.integers(0, 50),
        ),
        st.just({"type": "boolean"}),
        st.just({"type": "null"}),
        st.builds(
            lambda xs: {"enum": xs}, st.lists(st.sampled_from(WORDS), min_size=1, unique=True)
        ),
    )


def _object(props: dict) -> dict:
    # No keys beyond ``props``, said explicitly: the grammar must be able to end the object.
    return {"type": "object", "properties": props, "required": sorted(props),
            "additionalProperties": False}  # fmt: skip


def json_schemas() -> st.SearchStrategy[dict]:
    values = st.recursive(
        _leaf(),
        lambda inner: st.one_of(
            st.builds(
                lambda item, n: {"type": "array", "items": item, "maxItems": n},
                inner,
                st.integers(1, 2),
            ),
            st.builds(_object, st.dictionaries(st.sampled_from(NAMES), inner, max_size=2)),
        ),
        max_leaves=2,
    )
    return st.builds(_object, st.dictionaries(st.sampled_from(NAMES), values, max_size=2))


def _engine(spec: SpecConfig) -> LLM:
    """One engine at a time, with a small KV pool: three at once do not fit a CI box."""
    cache = CacheConfig(num_blocks=NUM_KV_BLOCKS)
    return LLM(config=EngineConfig(model="default", device="cpu", spec=spec, cache=cache))


def _prompt(llm: LLM, text: str) -> list[int]:
    messages = [{"role": "user", "content": text}]
    rendered = llm.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    return llm.tokenizer.encode(rendered, add_special_tokens=False)


def _run(spec: SpecConfig, prompts: list[str], constraints: list[StructuredOutput]):
    """Greedy outputs of one batch, and the engine's speculation counters."""
    llm = _engine(spec)
    params = [
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, structured=so) for so in constraints
    ]
    outs = llm.generate([_prompt(llm, p) for p in prompts], params)
    llm.core.check_integrity()
    assert llm.core.kv.usage == 0
    return outs, llm.core.spec_stats()


# Fixed constraints that ride along in the batch: (constraint, prompt, regex of the output).
CASES = [
    (StructuredOutput("regex", r"[0-9]{3}-[a-z]{2,5}"), "Pick one.", r"[0-9]{3}-[a-z]{2,5}"),
    (
        StructuredOutput("choice", json.dumps(["Paris", "London", "New York"])),
        "What is the capital of France?",
        r"Paris|London|New York",
    ),
    (
        StructuredOutput("grammar", 'root ::= ("yes" | "no") ", " [a-z]{1,8} "."'),
        "Is it sunny?",
        r"(yes|no), [a-z]{1,8}\.",
    ),
    (StructuredOutput("json_object", ""), "Give me a JSON object.", None),
]


def _check_case(pattern: str | None, out) -> None:
    if pattern is not None:  # bounded: the grammar ends the output
        assert out.finish_reason == "stop", out.text
        assert re.fullmatch(pattern, out.text), out.text
    elif out.finish_reason == "stop":  # json_object is unbounded: complete, or cut by max_tokens
        assert isinstance(json.loads(out.text), dict), out.text
    else:
        assert out.finish_reason == "length" and len(out.token_ids) == MAX_TOKENS, out.text
        assert out.text.lstrip().startswith("{"), out.text


@settings(max_examples=1, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(schemas=st.lists(json_schemas(), min_size=NUM_SCHEMAS, max_size=NUM_SCHEMAS))
def test_constrained_output_holds_and_speculation_changes_nothing(schemas):
    """One batch per engine: NUM_SCHEMAS drawn schemas (one example keeps CI time bounded:
    the schemas, not the examples, are the sample) plus a regex, a choice, an EBNF grammar and
    a JSON object. Every output validates, with speculation off, n-gram and draft model, and
    the greedy tokens are the same in all three."""
    prompts = [f"Reply with JSON for this schema: {json.dumps(s)}" for s in schemas]
    prompts += [prompt for _, prompt, _ in CASES]
    constraints = [StructuredOutput("json", json.dumps(s), "response_format") for s in schemas]
    constraints += [so for so, _, _ in CASES]
    token_ids = {}
    for name, spec in SPECS.items():
        outs, stats = _run(spec, prompts, constraints)
        for schema, out in zip(schemas, outs[: len(schemas)], strict=True):
            assert out.finish_reason == "stop", (name, out.text)
            jsonschema.validate(json.loads(out.text), schema)
        for (_, _, pattern), out in zip(CASES, outs[len(schemas) :], strict=True):
            _check_case(pattern, out)
        token_ids[name] = [out.token_ids for out in outs]
        if name != "off":
            assert stats["accepted"] > 0, (name, stats)
    assert token_ids["ngram"] == token_ids["off"]
    assert token_ids["draft"] == token_ids["off"]
