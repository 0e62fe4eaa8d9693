"""Host overhead of the HTTP path: a tiny random model (its step is almost all Python, as the
8B model's is on a GPU at high concurrency) served over loopback against ``LLM.generate`` of the
same requests, in one process run.

    PYTHONPATH=src python benchmarks/probes/serve_overhead.py [--requests 128] [--tokens 64]

Prints output tokens/s of offline generation and of the server with the engine in a thread of the
server process and in a process of its own (``flashpage serve``'s default); uvicorn runs in a thread
of this process and the client (aiohttp) in a subprocess, as ``flashpage bench serve --url`` does.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import torch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--requests", type=int, default=128)
    p.add_argument("--tokens", type=int, default=64)
    args = p.parse_args()
    torch.set_num_threads(1)

    from flashpage import LLM, SamplingParams
    from flashpage.engine.async_llm import AsyncLLM
    from flashpage.engine.engine_core import EngineConfig, EngineCore
    from flashpage.models.config import ModelConfig
    from flashpage.models.loader import load_model

    cfg = ModelConfig(architecture="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                      num_heads=2, num_kv_heads=1, head_dim=32, max_position_embeddings=1024)  # fmt: skip
    from flashpage.models.loader import save_hf_checkpoint

    loaded = load_model("tiny", dtype=torch.float32, device="cpu", load_format="dummy", config=cfg, seed=0)
    tmp = tempfile.mkdtemp(prefix="flashpage-tiny-")
    save_hf_checkpoint(loaded.model, tmp)
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(0, 512, (int(n),), generator=g).tolist()
        for n in torch.randint(16, 64, (args.requests,), generator=g)
    ]
    kw = {"max_num_seqs": args.requests, "kv_cache_bytes": 64 * 2**20}
    sp = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    llm = LLM(model=loaded, **kw)
    llm.generate(prompts[:2], sp, use_tqdm=False)
    t0 = time.perf_counter()
    llm.generate(prompts, sp, use_tqdm=False)
    offline = args.requests * args.tokens / (time.perf_counter() - t0)
    llm.close()

    for mode in ("thread", "process"):
        if mode == "thread":
            engine = AsyncLLM.from_engine(EngineCore(EngineConfig(model="tiny", **kw), loaded=loaded))
        else:
            engine = AsyncLLM(tmp, engine_process=True, dtype="float32", device="cpu", **kw)
        s = _serve_once(engine, prompts, args.tokens)
        print(f"{mode}: offline {offline:.0f} tok/s; server {s['tokens_per_s']:.0f} tok/s "
              f"(ITL p50 {s['itl_ms_p50']:.1f} ms); ratio {s['tokens_per_s'] / offline:.2f}", flush=True)  # fmt: skip


def _serve_once(engine: Any, prompts: list[list[int]], tokens: int) -> dict[str, Any]:
    import socket

    import uvicorn

    from flashpage.serve.api_server import ServerConfig, build_app
    from flashpage.serve.metrics import ServerMetrics

    metrics = ServerMetrics("tiny")
    engine._observer = metrics.observe
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    app = build_app(engine, ServerConfig(port=port, served_model_names=("tiny",)), metrics)
    server = uvicorn.Server(uvicorn.Config(app, port=port, log_level="warning"))
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    while not server.started:
        time.sleep(0.02)
    with tempfile.TemporaryDirectory() as d:
        req = os.path.join(d, "req.json")
        with open(req, "w") as f:
            json.dump({"prompts": prompts, "tokens": tokens}, f)
        client = (
            "import asyncio, json, sys\n"
            "from flashpage.bench.serve import run_level, summarize\n"
            "w = json.load(open(sys.argv[2]))\n"
            "asyncio.run(run_level(sys.argv[1], 'tiny', w['prompts'][:2], [2, 2], 2, None))\n"
            "res, wall = asyncio.run(run_level(sys.argv[1], 'tiny', w['prompts'], [w['tokens']] * len(w['prompts']), len(w['prompts']), None))\n"
            "print(json.dumps(summarize(res, wall)))\n"
        )
        out = subprocess.run(
            [sys.executable, "-c", client, f"http://127.0.0.1:{port}", req],
            capture_output=True,
            text=True,
            check=True,
        )
    server.should_exit = True
    th.join(10)
    engine.shutdown()
    return json.loads(out.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
