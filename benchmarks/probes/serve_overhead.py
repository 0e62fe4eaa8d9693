"""Host overhead of the HTTP path: a tiny random model (its step is almost all Python, as the
8B model's is on a GPU at high concurrency) served over loopback against ``LLM.generate`` of the
same requests, in one process run.

    PYTHONPATH=src python benchmarks/probes/serve_overhead.py [--requests 128] [--tokens 64]

Prints output tokens/s of both and their ratio; the server runs uvicorn in a thread of this process
and the client (aiohttp) in a subprocess, as ``flashpage bench serve --url`` does.
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

import torch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--requests", type=int, default=128)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--profile", default=None, help="write a cProfile of the server process here")
    args = p.parse_args()
    torch.set_num_threads(1)
    import uvicorn

    from flashpage import LLM, SamplingParams
    from flashpage.engine.async_llm import AsyncLLM
    from flashpage.engine.engine_core import EngineConfig, EngineCore
    from flashpage.models.config import ModelConfig
    from flashpage.models.loader import load_model
    from flashpage.serve.api_server import ServerConfig, build_app
    from flashpage.serve.metrics import ServerMetrics

    cfg = ModelConfig(architecture="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                      num_heads=2, num_kv_heads=1, head_dim=32, max_position_embeddings=1024)  # fmt: skip
    loaded = load_model("tiny", dtype=torch.float32, device="cpu", load_format="dummy", config=cfg, seed=0)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 512, (int(n),), generator=g).tolist() for n in torch.randint(16, 64, (args.requests,), generator=g)]
    kw = {"max_num_seqs": args.requests, "kv_cache_bytes": 64 * 2**20}
    sp = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    llm = LLM(model=loaded, **kw)
    llm.generate(prompts[:2], sp, use_tqdm=False)
    t0 = time.perf_counter()
    llm.generate(prompts, sp, use_tqdm=False)
    offline = args.requests * args.tokens / (time.perf_counter() - t0)
    llm.close()

    metrics = ServerMetrics("tiny")
    engine = AsyncLLM.from_engine(EngineCore(EngineConfig(model="tiny", **kw), loaded=loaded), observer=metrics.observe)
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(build_app(engine, ServerConfig(port=port), metrics), port=port, log_level="warning"))
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    while not server.started:
        time.sleep(0.02)
    with tempfile.TemporaryDirectory() as d:
        req = os.path.join(d, "req.json")
        json.dump({"prompts": prompts, "tokens": args.tokens}, open(req, "w"))
        client = (
            "import asyncio, json, sys, time\n"
            "from flashpage.bench.serve import run_level, summarize\n"
            "w = json.load(open(sys.argv[2]))\n"
            "asyncio.run(run_level(sys.argv[1], 'tiny', w['prompts'][:2], [2, 2], 2, None))\n"
            "res, wall = asyncio.run(run_level(sys.argv[1], 'tiny', w['prompts'], [w['tokens']] * len(w['prompts']), len(w['prompts']), None))\n"
            "print(json.dumps(summarize(res, wall)))\n"
        )
        prof = None
        if args.profile:
            import cProfile

            prof = cProfile.Profile()
            prof.enable()
        out = subprocess.run([sys.executable, "-c", client, f"http://127.0.0.1:{port}", req], capture_output=True, text=True, check=True)
        if prof is not None:
            prof.disable()
            prof.dump_stats(args.profile)
    s = json.loads(out.stdout.strip().splitlines()[-1])
    server.should_exit = True
    th.join(10)
    engine.shutdown()
    print(f"offline {offline:.0f} tok/s; server {s['tokens_per_s']:.0f} tok/s (ITL p50 {s['itl_ms_p50']:.1f} ms); ratio {s['tokens_per_s'] / offline:.2f}")


if __name__ == "__main__":
    main()
