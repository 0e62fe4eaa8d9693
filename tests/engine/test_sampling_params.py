"""SamplingParams: DESIGN.md defaults and ValueError naming the field."""

from __future__ import annotations

import pytest

from flashpage.engine.sampling_params import SamplingParams


def test_defaults_match_design() -> None:
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.seed, p.max_tokens) == (
        1,
        1.0,
        1.0,
        -1,
        0.0,
        None,
        16,
    )
    assert (p.stop, p.stop_token_ids, p.ignore_eos, p.logprobs) == (None, None, False, None)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert not p.greedy and not p.has_penalties and p.stop_strings == () and p.effective_top_k == -1
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(stop="x").stop_strings == ("x",)
    assert SamplingParams(stop=["a", "b"], stop_token_ids=[3]).stop_token_set == {3}


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"n": 0}, "n"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.1}, "min_p"),
        ({"seed": 1.5}, "seed"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"stop": 3}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": 21}, "logprobs"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 17}, "min_tokens"),  # > max_tokens=16
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"logit_bias": [1]}, "logit_bias"),
        ({"guided_regex": ""}, "guided_regex"),
        ({"guided_json": 3}, "guided_json"),
        ({"guided_json_object": "yes"}, "guided_json_object"),
    ],
)
def test_invalid_values_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field} "):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"logit_bias": {"x": 1.0}}, "logit_bias"),
        ({"logit_bias": {3: 101}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_json": "[1]"}, "guided_json"),
        ({"guided_json": {"type": "object"}, "guided_regex": "a+"}, "guided_json"),
        ({"guided_regex": "a+", "guided_json_object": True}, "guided_regex"),
    ],
)
def test_new_fields_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}: "):
        SamplingParams(**kwargs)


def test_new_fields_defaults_and_normal_forms() -> None:
    p = SamplingParams()
    assert (p.min_tokens, p.logit_bias, p.prompt_logprobs) == (0, None, None)
    assert (p.guided_json, p.guided_regex, p.guided_json_object, p.guided) == (None, None, False, None)
    # OpenAI JSON sends logit_bias keys as strings.
    assert SamplingParams(logit_bias={"5": -100, 7: 2.5}).logit_bias_map == {5: -100.0, 7: 2.5}
    assert SamplingParams(guided_json={"type": "object"}).guided == ("guided_json", '{"type": "object"}')
    assert SamplingParams(guided_regex="a+").guided == ("guided_regex", "a+")
    assert SamplingParams(guided_json_object=True).guided == ("guided_json_object", "")
    assert SamplingParams(min_tokens=5, max_tokens=None).min_tokens == 5
    # Positional order of the existing fields is kept (new fields come after them).
    assert SamplingParams(2, 0.5).n == 2 and SamplingParams(2, 0.5).temperature == 0.5
