"""``flashpage serve`` as a process: SIGTERM during load drains and exits 0."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import pytest

from tests.serve.conftest import free_port

httpx = pytest.importorskip("httpx2")

MODEL = "smollm2-135m-instruct"


def _stream(url: str, body: dict[str, Any], out: dict[str, Any], first: threading.Event) -> None:
    out.update(chunks=0, done=False, error=None)
    try:
        with httpx.stream("POST", url, json=body, timeout=120) as r:
            out["status"] = r.status_code
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    out["done"] = True
                elif line.startswith("data: "):
                    ev = json.loads(line[6:])
                    if "error" in ev:
                        out["error"] = ev["error"]
                    else:
                        out["chunks"] += 1
                        out["finish"] = ev["choices"][0]["finish_reason"] if ev["choices"] else None
                first.set()
    except httpx.HTTPError as e:  # the connection was cut at the end of the grace period
        out["cut"] = type(e).__name__
    finally:
        first.set()


@pytest.mark.slow
def test_sigterm_drains_and_exits_zero(tmp_path: Any) -> None:
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "flashpage.cli",
        "serve",
        "--model",
        MODEL,
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--device",
        "cpu",
        "--kv-cache-bytes",
        str(64 * 2**20),
        "--graceful-shutdown",
        "10",
    ]
    with open(tmp_path / "server.log", "w+") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"}
        )
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 120
            while True:
                assert proc.poll() is None, "the server exited during start-up"
                try:
                    if httpx.get(url + "/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline, "the server did not start"
                time.sleep(0.2)
            short: dict[str, Any] = {}
            long: dict[str, Any] = {}
            events = [threading.Event(), threading.Event()]
            base = {"model": MODEL, "prompt": "Count to one hundred:", "stream": True, "ignore_eos": True}
            threads = [
                threading.Thread(
                    target=_stream,
                    args=(url + "/v1/completions", {**base, "max_tokens": 8}, short, events[0]),
                ),
                threading.Thread(
                    target=_stream,
                    args=(url + "/v1/completions", {**base, "max_tokens": 1000}, long, events[1]),
                ),
            ]
            for t in threads:
                t.start()
            for e in events:
                assert e.wait(60)
            t_term = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.5)
            with pytest.raises(httpx.HTTPError):  # no new connections while draining
                httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "x"}, timeout=5)
            rc = proc.wait(timeout=60)
            elapsed = time.monotonic() - t_term
            for t in threads:
                t.join(30)
            assert rc == 0
            assert short["done"] and short["finish"] == "length" and short["chunks"] == 8, short
            # Still running at the end of the 10 s grace period: ended with an error event, then [DONE].
            assert long["status"] == 200 and long["chunks"] > 0 and long["done"], long
            assert "shut down" in long["error"]["message"], long
            assert 9 < elapsed < 40, (elapsed, long)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
            log.seek(0)
            text = log.read()
    assert "Traceback" not in text, text[-3000:]
