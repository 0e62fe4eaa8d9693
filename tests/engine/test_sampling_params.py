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
    ],
)
def test_invalid_values_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field} "):
        SamplingParams(**kwargs)
