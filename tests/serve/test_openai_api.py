"""The server through the real ``openai`` client: models, completions and chat, streamed and not,
``n``, stop, seeds, usage counts and logprobs."""

from __future__ import annotations

from typing import Any

import pytest

openai = pytest.importorskip("openai")

MODEL = "smollm2-135m-instruct"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(server: Any) -> Any:
    return openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=120)


def test_models_list(client: Any, server: Any) -> None:
    models = client.models.list()
    assert [m.id for m in models] == [MODEL]
    assert models.data[0].object == "model"


def test_completion_counts_usage_exactly(client: Any, server: Any) -> None:
    prompt = "The capital of France is"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    ids = server.engine.encode(prompt)
    assert r.usage.prompt_tokens == len(ids)
    assert r.usage.completion_tokens == 8 and r.usage.total_tokens == len(ids) + 8
    assert r.choices[0].finish_reason == "length"
    assert "Paris" in r.choices[0].text
    assert r.object == "text_completion" and r.id.startswith("cmpl-")


def test_completion_stream_equals_non_stream(client: Any) -> None:
    kw = {"model": MODEL, "prompt": "def fibonacci(n):", "max_tokens": 12, "temperature": 0}
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_chat_stream_and_non_stream(client: Any) -> None:
    full = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10, temperature=0)
    assert full.choices[0].message.role == "assistant"
    assert "Paris" in full.choices[0].message.content
    stream = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_n_and_several_prompts_index_their_choices(client: Any) -> None:
    r = client.completions.create(
        model=MODEL, prompt=["1, 2, 3,", "a, b, c,"], n=2, max_tokens=4, temperature=0
    )
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    by = {c.index: c.text for c in r.choices}
    assert by[0] == by[1] and by[2] == by[3] and by[0] != by[2]  # greedy: copies agree per prompt
    assert r.usage.completion_tokens == 16
    chat = client.chat.completions.create(
        model=MODEL, messages=CHAT, n=3, max_tokens=6, temperature=1.0, seed=5
    )
    assert sorted(c.index for c in chat.choices) == [0, 1, 2]
    stream = client.completions.create(
        model=MODEL, prompt="x y z", n=2, max_tokens=5, temperature=0, stream=True
    )
    texts: dict[int, str] = {0: "", 1: ""}
    for c in stream:
        texts[c.choices[0].index] += c.choices[0].text
    assert texts[0] == texts[1] != ""


def test_stop_string_ends_and_is_cut(client: Any) -> None:
    r = client.completions.create(
        model=MODEL, prompt="1, 2, 3, 4,", max_tokens=20, temperature=0, stop=[" 7"]
    )
    assert r.choices[0].finish_reason == "stop"
    assert " 7" not in r.choices[0].text and "6" in r.choices[0].text


def test_seed_reproduces_sampling(client: Any) -> None:
    kw = {"model": MODEL, "messages": CHAT, "max_tokens": 12, "temperature": 1.0, "seed": 1234}
    a = client.chat.completions.create(**kw).choices[0].message.content
    b = client.chat.completions.create(**kw).choices[0].message.content
    c = client.chat.completions.create(**{**kw, "seed": 99}).choices[0].message.content
    assert a == b
    assert a != c


def test_completion_logprobs(client: Any) -> None:
    r = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=5, temperature=0, logprobs=3
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert "".join(lp.tokens) == r.choices[0].text
    for tok, v, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert v <= 0 and len(top) == 3
        assert max(top.values()) == pytest.approx(v, abs=1e-5)  # greedy: the chosen token is the top one
        assert tok in top
    assert lp.text_offset == sorted(lp.text_offset)


def test_echo_returns_the_prompt(client: Any) -> None:
    prompt = "The capital of France is"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, echo=True)
    assert r.choices[0].text.startswith(prompt) and len(r.choices[0].text) > len(prompt)
    # With logprobs the prompt's tokens come first, the first one without a logprob (vLLM's shape).
    r = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=1
    )
    lp = r.choices[0].logprobs
    n_prompt = r.usage.prompt_tokens
    assert len(lp.tokens) == n_prompt + 3 and "".join(lp.tokens) == r.choices[0].text
    assert lp.token_logprobs[0] is None and all(v <= 0 for v in lp.token_logprobs[1:])


def test_chat_logprobs(client: Any) -> None:
    r = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert "".join(e.token for e in content) == r.choices[0].message.content
    for e in content:
        assert len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob == pytest.approx(e.logprob, abs=1e-5)
        assert bytes(e.bytes).decode() == e.token


def test_token_id_prompts(client: Any, server: Any) -> None:
    ids = server.engine.encode("The capital of France is")
    a = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0)
    b = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0)
    assert a.choices[0].text == b.choices[0].text
    assert a.usage.prompt_tokens == len(ids)


SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "population": {"type": "integer"},
        "size": {"type": "string", "enum": ["small", "medium", "large"]},
    },
    "required": ["city", "population", "size"],
    "additionalProperties": False,
}


def _check_schema(obj: Any) -> None:
    assert set(obj) == {"city", "population", "size"}
    assert isinstance(obj["city"], str) and len(obj["city"]) <= 20
    assert isinstance(obj["population"], int) and not isinstance(obj["population"], bool)
    assert obj["size"] in ("small", "medium", "large")


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_response_format_json_schema(client: Any, temperature: float) -> None:
    pytest.importorskip("xgrammar")
    import json

    messages = [{"role": "user", "content": "Describe Paris as JSON."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}
    r = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        response_format=fmt,
        max_tokens=80,
        temperature=temperature,
        seed=3,
        n=2,
    )
    for c in r.choices:
        assert c.finish_reason == "stop", c
        _check_schema(json.loads(c.message.content))
    stream = client.completions.create(
        model=MODEL,
        prompt="A city as JSON: ",
        max_tokens=80,
        temperature=temperature,
        seed=4,
        stream=True,
        extra_body={"response_format": fmt},
    )
    _check_schema(json.loads("".join(c.choices[0].text for c in stream)))


def test_response_format_json_object_and_guided_regex(client: Any) -> None:
    pytest.importorskip("xgrammar")
    import json
    import re

    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Give me a JSON object."}],
        response_format={"type": "json_object"},
        max_tokens=60,
        temperature=0.7,
        seed=1,
    )
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = client.completions.create(
        model=MODEL,
        prompt="A date: ",
        max_tokens=20,
        temperature=1.0,
        seed=2,
        extra_body={"guided_regex": r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]"},
    )
    assert re.fullmatch(r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]", r.choices[0].text), r.choices[0].text


def test_bad_schema_is_a_400(client: Any) -> None:
    pytest.importorskip("xgrammar")
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL,
            messages=CHAT,
            max_tokens=5,
            extra_body={"guided_regex": "(unclosed"},
        )
    assert e.value.body["param"] == "guided_regex"
