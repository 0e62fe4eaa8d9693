"""Fixtures of the server tests: the embedded model loaded once, and servers started on free
loopback ports (uvicorn in a thread of the test process, so tests can inspect the engine)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Running:
    """A server under test."""

    url: str
    engine: Any
    metrics: Any

    @property
    def v1(self) -> str:
        return self.url + "/v1"


@contextlib.contextmanager
def run_server(
    loaded: Any, timeout_s: float = 60.0, engine_kwargs: dict[str, Any] | None = None, **config: Any
) -> Iterator[Running]:
    """Serve ``loaded`` (a load_model() result) on a free port until the block exits."""
    import uvicorn

    from flashpage.engine.async_llm import AsyncLLM
    from flashpage.engine.engine_core import EngineConfig, EngineCore
    from flashpage.serve.api_server import ServerConfig, build_app
    from flashpage.serve.metrics import ServerMetrics

    port = free_port()
    metrics = ServerMetrics("smollm2-135m-instruct")
    kw: dict[str, Any] = {"max_num_seqs": 64, "kv_cache_bytes": 64 * 2**20, **(engine_kwargs or {})}
    core = EngineCore(EngineConfig(model="smollm2-135m-instruct", **kw), loaded=loaded)
    engine = AsyncLLM.from_engine(core, observer=metrics.observe)
    app = build_app(engine, ServerConfig(port=port, **config), metrics)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield Running(f"http://127.0.0.1:{port}", engine, metrics)
    finally:
        server.should_exit = True
        thread.join(timeout_s)
        engine.shutdown()


@pytest.fixture(scope="session")
def smollm_loaded() -> Any:
    from flashpage.models.loader import load_model

    return load_model("smollm2-135m-instruct", dtype=torch.float32, device="cpu")


@pytest.fixture(scope="module")
def server(smollm_loaded: Any) -> Iterator[Running]:
    with run_server(smollm_loaded) as s:
        yield s
