"""Every error case over raw HTTP: OpenAI's error shape, the status, and the field it names."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.serve.conftest import run_server

httpx = pytest.importorskip("httpx2")

MODEL = "smollm2-135m-instruct"


def _post(url: str, body: Any, headers: dict[str, str] | None = None) -> Any:
    content = body if isinstance(body, str | bytes) else json.dumps(body)
    h = {"content-type": "application/json", **(headers or {})}
    return httpx.post(url, content=content, headers=h, timeout=60)


def _error(r: Any, status: int, param: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"] and "Traceback" not in err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ("{not json", None),
        ({"model": MODEL}, "prompt"),
        ({"model": MODEL, "prompt": 3}, "prompt"),
        ({"model": MODEL, "prompt": "x", "max_tokens": "many"}, "max_tokens"),
        ({"model": MODEL, "prompt": "x", "temperature": -1}, "temperature"),
        ({"model": MODEL, "prompt": "x", "top_p": 2}, "top_p"),
        ({"model": MODEL, "prompt": "x", "presence_penalty": 5}, "presence_penalty"),
        ({"model": MODEL, "prompt": "x", "n": 0}, "n"),
        ({"model": MODEL, "prompt": "x", "n": 1000}, "n"),
        ({"model": MODEL, "prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"model": MODEL, "prompt": "x", "logprobs": 100}, "logprobs"),
        ({"model": MODEL, "prompt": "x", "stop": [""]}, "stop"),
        ({"model": MODEL, "prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
        ({"model": MODEL, "prompt": [99999999]}, "prompt"),
        ({"model": MODEL, "prompt": ""}, "prompt"),
    ],
)
def test_completion_bad_input_is_a_400_naming_the_field(server: Any, body: Any, param: str | None) -> None:
    err = _error(_post(server.v1 + "/completions", body), 400, param)
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": MODEL, "messages": []}, "messages"),
        ({"model": MODEL, "messages": [{"content": "hi"}]}, "messages"),
        ({"model": MODEL, "messages": "hi"}, "messages"),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
            "top_logprobs",
        ),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"},
            "temperature",
        ),
    ],
)
def test_chat_bad_input_is_a_400_naming_the_field(server: Any, body: Any, param: str) -> None:
    _error(_post(server.v1 + "/chat/completions", body), 400, param)


def test_context_overflow_names_the_limit(server: Any) -> None:
    limit = server.engine.max_model_len
    err = _error(
        _post(server.v1 + "/completions", {"model": MODEL, "prompt": "hello", "max_tokens": limit}),
        400,
        "max_tokens",
    )
    assert f"max_model_len={limit}" in err["message"]
    long_prompt = [1] * limit
    err = _error(
        _post(server.v1 + "/completions", {"model": MODEL, "prompt": long_prompt, "max_tokens": 1}),
        400,
        "prompt",
    )
    assert str(limit) in err["message"]


def test_unknown_model_and_route(server: Any) -> None:
    err = _error(_post(server.v1 + "/completions", {"model": "gpt-5", "prompt": "x"}), 404, "model")
    assert err["code"] == "model_not_found"
    _error(
        _post(
            server.v1 + "/chat/completions",
            {"model": "gpt-5", "messages": [{"role": "user", "content": "x"}]},
        ),
        404,
        "model",
    )
    _error(httpx.get(server.v1 + "/nothing-here"), 404)
    _error(httpx.get(server.v1 + "/completions"), 405)


def test_api_key(smollm_loaded: Any) -> None:
    with run_server(smollm_loaded, api_key="s3cret") as s:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
        assert _error(_post(s.v1 + "/completions", body), 401)["code"] == "invalid_api_key"
        _error(_post(s.v1 + "/completions", body, {"authorization": "Bearer wrong"}), 401)
        _error(_post(s.v1 + "/completions", body, {"authorization": "Basic s3cret"}), 401)
        _error(httpx.get(s.v1 + "/models"), 401)
        assert _post(s.v1 + "/completions", body, {"authorization": "Bearer s3cret"}).status_code == 200
        assert httpx.get(s.v1 + "/models", headers={"authorization": "Bearer s3cret"}).status_code == 200
        assert httpx.get(s.url + "/health").status_code == 200  # not under /v1
        assert httpx.get(s.url + "/metrics").status_code == 200


def test_body_size_and_limits(smollm_loaded: Any) -> None:
    with run_server(smollm_loaded, max_body_bytes=2048, max_n=2, max_tokens_limit=8) as s:
        big = {"model": MODEL, "prompt": "x" * 4096}
        _error(_post(s.v1 + "/completions", big), 413)
        _error(_post(s.v1 + "/completions", {"model": MODEL, "prompt": "x", "n": 3}), 400, "n")
        _error(_post(s.v1 + "/completions", {"model": MODEL, "prompt": ["a", "b", "c"]}), 400, "prompt")
        err = _error(
            _post(s.v1 + "/completions", {"model": MODEL, "prompt": "x", "max_tokens": 9}), 400, "max_tokens"
        )
        assert "8" in err["message"]
        assert (
            _post(s.v1 + "/completions", {"model": MODEL, "prompt": "x", "max_tokens": 8}).status_code == 200
        )


def test_health_and_metrics_names(server: Any) -> None:
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    _post(server.v1 + "/completions", {"model": MODEL, "prompt": "hello", "max_tokens": 3})
    text = httpx.get(server.url + "/metrics").text
    for name in (
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "prompt_tokens_total",
        "generation_tokens_total",
        "time_to_first_token_seconds_bucket",
        "inter_token_latency_seconds_bucket",
        "e2e_request_latency_seconds_bucket",
        "prefix_cache_hit_rate",
        "num_preemptions_total",
        "roofline_steps_total",
    ):
        assert f"flashpage:{name}" in text, name
    assert 'kernel="' in text and 'phase="decode"' in text
    stats = httpx.get(server.url + "/stats").json()
    assert stats["model"] == MODEL and {p["phase"] for p in stats["phases"]} >= {"decode"}
