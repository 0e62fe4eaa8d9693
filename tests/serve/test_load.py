"""The server under load: concurrent streaming clients, a third of them leaving mid-stream; a full
waiting queue; a failing step. Loopback only, bounded in count and time."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest

from tests.serve.conftest import run_server

httpx = pytest.importorskip("httpx2")

MODEL = "smollm2-135m-instruct"


def _gauge(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(f"flashpage:{name}{{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no flashpage:{name} in /metrics")


async def _stream(client: Any, url: str, body: dict[str, Any], leave_after: int | None) -> dict[str, Any]:
    """One streaming completion; with ``leave_after`` the client disconnects after that many chunks."""
    chunks, text, done, finish, usage = 0, "", False, None, None
    async with client.stream("POST", url, json=body, timeout=120) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                done = True
                break
            ev = json.loads(data)
            assert "error" not in ev, ev
            if ev["choices"]:
                chunks += 1
                text += ev["choices"][0]["text"]
                finish = ev["choices"][0]["finish_reason"] or finish
            if ev.get("usage"):
                usage = ev["usage"]
            if leave_after is not None and chunks >= leave_after:
                break  # leaving the block closes the connection mid-stream
    return {"done": done, "text": text, "finish": finish, "usage": usage, "chunks": chunks}


@pytest.mark.slow
def test_concurrent_streams_with_disconnects(smollm_loaded: Any) -> None:
    n_clients, stay_tokens, leave_tokens = 36, 16, 400
    with run_server(smollm_loaded, engine_kwargs={"max_num_seqs": 64}) as s:

        async def main() -> list[dict[str, Any]]:
            limits = httpx.Limits(max_connections=n_clients)
            async with httpx.AsyncClient(limits=limits) as client:
                jobs = []
                for i in range(n_clients):
                    leaves = i % 3 == 0
                    body = {
                        "model": MODEL,
                        "prompt": f"Request {i}: list some numbers:",
                        "max_tokens": leave_tokens if leaves else stay_tokens,
                        "temperature": 0.8,
                        "seed": i,
                        "ignore_eos": True,
                        "stream": True,
                        "stream_options": {"include_usage": True},
                    }
                    jobs.append(_stream(client, s.v1 + "/completions", body, 3 if leaves else None))
                return await asyncio.wait_for(asyncio.gather(*jobs), timeout=300)

        t0 = time.monotonic()
        results = asyncio.run(main())
        for i, r in enumerate(results):
            if i % 3:
                assert r["done"] and r["finish"] == "length", r
                assert r["usage"]["completion_tokens"] == stay_tokens
                assert r["text"]
            else:
                assert not r["done"] and r["chunks"] == 3
        # The leavers asked for 400 tokens each: only their abort brings the engine back to idle soon.
        deadline = time.monotonic() + 20
        while True:
            text = httpx.get(s.url + "/metrics").text
            running, kv = _gauge(text, "num_requests_running"), _gauge(text, "kv_cache_usage_perc")
            if (running == 0 and kv == 0) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert running == 0 and kv == 0, (running, kv)
        assert _gauge(text, "num_requests_waiting") == 0
        assert s.engine.num_unfinished() == 0
        s.engine.core.block_manager.check_integrity()
        generated = s.engine.core.stats()["generation_tokens"]
        assert generated < n_clients * leave_tokens / 3, generated  # the leavers stopped early
        assert time.monotonic() - t0 < 300


def test_full_queue_answers_429(smollm_loaded: Any) -> None:
    with run_server(smollm_loaded, max_queue=1, engine_kwargs={"max_num_seqs": 1}, retry_after_s=2) as s:

        async def main() -> list[Any]:
            async with httpx.AsyncClient() as client:
                body = {"model": MODEL, "prompt": "Count:", "max_tokens": 6, "ignore_eos": True}
                return await asyncio.gather(
                    *(client.post(s.v1 + "/completions", json=body, timeout=120) for _ in range(6))
                )

        responses = asyncio.run(main())
        codes = [r.status_code for r in responses]
        assert codes.count(200) >= 2 and 429 in codes, codes  # one running, one waiting, the rest refused
        r429 = next(r for r in responses if r.status_code == 429)
        assert r429.headers["retry-after"] == "2"
        assert r429.json()["error"]["type"] == "rate_limit_error"


def test_a_failing_step_fails_its_requests_not_the_server(smollm_loaded: Any) -> None:
    with run_server(smollm_loaded) as s:
        runner = s.engine.core.runner
        real = runner.execute
        calls = {"n": 0}

        def flaky(*a: Any, **k: Any) -> Any:
            calls["n"] += 1
            if calls["n"] == 1:  # this call's step fails
                raise RuntimeError("injected failure")
            return real(*a, **k)

        runner.execute = flaky
        body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4}
        r = httpx.post(s.v1 + "/completions", json=body, timeout=60)
        assert r.status_code == 500 and "injected" in r.json()["error"]["message"]
        assert "Traceback" not in r.text
        ok = httpx.post(s.v1 + "/completions", json=body, timeout=60)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
        # Inside a stream, once tokens have been sent: an error event, then [DONE].
        calls["n"] = -2  # the third step from now fails
        with httpx.stream("POST", s.v1 + "/completions", json={**body, "stream": True}, timeout=60) as r:
            lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
        assert r.status_code == 200 and "injected" not in lines[0]
        assert "injected" in lines[-2] and lines[-1] == "data: [DONE]"
        s.engine.core.block_manager.check_integrity()
