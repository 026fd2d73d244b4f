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

from verifypd.config import EngineConfig, SpecConfig
from verifypd.llm import LLM
from verifypd.types import SamplingParams, StructuredOutput

pytestmark = pytest.mark.slow

NUM_SCHEMAS = 20
MAX_TOKENS = 64
SPECS = {
    "off": SpecConfig(),
    "ngram": SpecConfig(method="ngram"),
    "draft": SpecConfig(method="draft", draft_model="default"),
}
NAMES = ["name", "age", "city", "ok", "tags", "color", "size", "id"]
WORDS = ["red", "green", "blue", "cat", "dog", "yes"]


def _leaf() -> st.SearchStrategy[dict]:
    """Bounded leaves: every string, number and list has a length cap, so the grammar forces
    the output to end within ``MAX_TOKENS``."""
    return st.one_of(
        st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(1, 6)),
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
    return {"type": "object", "properties": props, "required": sorted(props)}


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
        max_leaves=3,
    )
    return st.builds(_object, st.dictionaries(st.sampled_from(NAMES), values, max_size=3))


@pytest.fixture(scope="module")
def engines() -> dict[str, LLM]:
    return {
        name: LLM(config=EngineConfig(model="default", device="cpu", spec=spec))
        for name, spec in SPECS.items()
    }


def _prompt(llm: LLM, text: str) -> list[int]:
    messages = [{"role": "user", "content": text}]
    rendered = llm.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    return llm.tokenizer.encode(rendered, add_special_tokens=False)


def _run(llm: LLM, prompts: list[str], constraints: list[StructuredOutput]):
    params = [
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, structured=so) for so in constraints
    ]
    outs = llm.generate([_prompt(llm, p) for p in prompts], params)
    llm.core.check_integrity()
    assert llm.core.kv.usage == 0
    return outs


@settings(max_examples=1, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(schemas=st.lists(json_schemas(), min_size=NUM_SCHEMAS, max_size=NUM_SCHEMAS))
def test_json_schema_output_validates_with_and_without_speculation(engines, schemas):
    """One batch of NUM_SCHEMAS drawn schemas per engine (one example keeps CI time bounded:
    the schemas, not the examples, are the sample)."""
    prompts = [f"Reply with JSON for this schema: {json.dumps(s)}" for s in schemas]
    constraints = [StructuredOutput("json", json.dumps(s), "response_format") for s in schemas]
    token_ids = {}
    for name, llm in engines.items():
        outs = _run(llm, prompts, constraints)
        for schema, out in zip(schemas, outs, strict=True):
            assert out.finish_reason == "stop", (name, schema, out.text)
            jsonschema.validate(json.loads(out.text), schema)
        token_ids[name] = [out.token_ids for out in outs]
    assert token_ids["ngram"] == token_ids["off"]
    assert token_ids["draft"] == token_ids["off"]
    for name in ("ngram", "draft"):
        assert engines[name].core.spec.num_accepted > 0, name


CASES = [
    (StructuredOutput("regex", r"[0-9]{3}-[a-z]{2,5}"), r"[0-9]{3}-[a-z]{2,5}"),
    (
        StructuredOutput("choice", json.dumps(["Paris", "London", "New York"])),
        r"Paris|London|New York",
    ),
    (StructuredOutput("grammar", 'root ::= ("yes" | "no") ", " [a-z]+ "."'), r"(yes|no), [a-z]+\."),
    (StructuredOutput("json_object", ""), None),
]


def test_regex_choice_grammar_and_json_object_hold(engines):
    prompts = ["Pick one.", "What is the capital of France?", "Is it sunny?", "Give me JSON."]
    outs = {name: _run(llm, prompts, [so for so, _ in CASES]) for name, llm in engines.items()}
    for (so, pattern), out in zip(CASES, outs["off"], strict=True):
        assert out.finish_reason == "stop", (so, out.text)
        if pattern is None:
            assert isinstance(json.loads(out.text), dict)
        else:
            assert re.fullmatch(pattern, out.text), (so, out.text)
    for name in ("ngram", "draft"):
        assert [o.token_ids for o in outs[name]] == [o.token_ids for o in outs["off"]], name
