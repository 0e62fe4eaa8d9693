"""Structured output (xgrammar): every output parses and satisfies its schema or regex, greedy and
sampled, on a random model with SmolLM2's tokenizer (left alone, it would never write valid JSON)."""

from __future__ import annotations

import json
import re
import sys
from typing import Any

import pytest

from flashpage.engine.llm import LLM
from flashpage.engine.sampling_params import SamplingParams
from flashpage.engine.structured import StructuredOutputs

pytest.importorskip("xgrammar")

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "color"],
}
NUMBERS = {
    "type": "array",
    "items": {"type": "integer", "minimum": 0, "maximum": 99},
    "minItems": 1,
    "maxItems": 4,
}
NESTED = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["ok", "tags"],
}
EMAIL = r"[a-z]{1,8}@[a-z]{1,8}\.(com|org)"


def conforms(schema: dict[str, Any], value: Any) -> bool:
    """The JSON-schema subset used here (type, enum, properties/required without extra keys,
    string maxLength, integer bounds, array items/minItems/maxItems)."""
    if "enum" in schema:
        return value in schema["enum"]
    t = schema["type"]
    if t == "object":
        props = schema["properties"]
        return (
            isinstance(value, dict)
            and set(schema["required"]) <= set(value)
            and set(value) <= set(props)
            and all(conforms(props[k], v) for k, v in value.items())
        )
    if t == "array":
        return (
            isinstance(value, list)
            and schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", 1 << 30)
            and all(conforms(schema["items"], v) for v in value)
        )
    if t == "integer":
        return (
            isinstance(value, int)
            and not isinstance(value, bool)
            and schema.get("minimum", -(1 << 62)) <= value <= schema.get("maximum", 1 << 62)
        )
    if t == "string":
        return isinstance(value, str) and len(value) <= schema.get("maxLength", 1 << 30)
    if t == "boolean":
        return isinstance(value, bool)
    raise AssertionError(f"schema type {t} not covered")


@pytest.fixture(scope="module")
def llm(tiny_tok: Any) -> LLM:
    return LLM(model=tiny_tok, kv_cache_bytes=4 << 20)


def test_json_schemas_greedy_and_sampled(llm: LLM) -> None:
    prompts = ["Describe a person.", "Some numbers:", "Tags?", "Another person"]
    params = [
        SamplingParams(temperature=0, max_tokens=80, guided_json=PERSON),
        SamplingParams(temperature=1.0, n=3, seed=1, max_tokens=80, guided_json=json.dumps(NUMBERS)),
        SamplingParams(temperature=1.0, n=2, seed=2, max_tokens=80, guided_json=NESTED),
        SamplingParams(temperature=1.0, n=2, seed=3, max_tokens=80, guided_json=PERSON),
    ]
    outs = llm.generate(prompts, params, use_tqdm=False)
    schemas = [PERSON, NUMBERS, NESTED, PERSON]
    for out, schema in zip(outs, schemas):
        for c in out.outputs:
            # Bounded grammars: each completion ends because its grammar is complete.
            assert c.finish_reason == "stop", (c.text, c.token_ids)
            assert conforms(schema, json.loads(c.text)), c.text
    sampled = [c.text for c in outs[1].outputs]
    assert len(set(sampled)) > 1, sampled  # sampling still samples within the grammar
    # Unconstrained, the same random model writes no JSON.
    (free,) = llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)
    with pytest.raises(ValueError):
        json.loads(free.outputs[0].text)


def test_regex_and_json_object(llm: LLM) -> None:
    outs = llm.generate(
        ["Email:", "Object:"],
        [
            SamplingParams(temperature=1.0, n=3, seed=5, max_tokens=40, guided_regex=EMAIL),
            SamplingParams(temperature=0, max_tokens=40, guided_json_object=True, logit_bias={"125": 5}),
        ],
        use_tqdm=False,
    )
    for c in outs[0].outputs:
        assert c.finish_reason == "stop" and re.fullmatch(EMAIL, c.text), c.text
    obj = outs[1].outputs[0]
    if obj.finish_reason == "stop":  # json_object is unbounded: only a complete one must parse
        assert isinstance(json.loads(obj.text), dict)
    else:
        assert obj.text.startswith("{")


def test_streamed_constrained_request_beside_free_ones(llm: LLM) -> None:
    core = llm.engine
    core.add_request("c", "x", SamplingParams(temperature=1.0, seed=7, max_tokens=60, guided_json=PERSON))
    core.add_request("f", "y", SamplingParams(temperature=1.0, seed=7, max_tokens=8, ignore_eos=True))
    text: dict[str, str] = {"c": "", "f": ""}
    final: dict[str, Any] = {}
    while core.has_unfinished():
        for o in core.step():
            text[o.request_id] += o.outputs[0].delta_text
            if o.finished:
                final[o.request_id] = o
    assert conforms(PERSON, json.loads(text["c"])) and final["c"].outputs[0].finish_reason == "stop"
    assert len(final["f"].outputs[0].token_ids) == 8


def test_bad_constraints_name_the_field(llm: LLM, tiny_loaded: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match=r"^guided_regex: cannot compile"):
        llm.generate(["x"], SamplingParams(guided_regex="(["), use_tqdm=False)
    with pytest.raises(ValueError, match=r"^guided_json: cannot compile .*nonsense"):
        llm.generate(["x"], SamplingParams(guided_json={"type": "nonsense"}), use_tqdm=False)
    assert not llm.engine.has_unfinished()
    no_tok = LLM(model=tiny_loaded, kv_cache_bytes=1 << 20)
    with pytest.raises(
        ValueError, match=r"^guided_json_object: structured output needs a model with a tokenizer"
    ):
        no_tok.generate([[1, 2]], SamplingParams(guided_json_object=True), use_tqdm=False)
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import fails as if not installed
    fresh = StructuredOutputs(llm.engine.tokenizer, llm.engine.vocab_size, frozenset([2]))
    with pytest.raises(ValueError, match=r"^guided_json: structured output needs the 'xgrammar' package"):
        fresh.compile(("guided_json", "{}"))
