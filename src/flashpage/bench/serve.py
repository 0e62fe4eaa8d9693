"""``flashpage bench serve``: the OpenAI server under load, beside offline ``LLM.generate``.

Like vLLM's ``benchmark_serving``: N streaming completion requests at a fixed concurrency (or a
Poisson request rate) against a running server, reporting request throughput, output tokens/s and
TTFT / ITL / end-to-end latency at p50 / p90 / p99. Each level's requests are then run offline with
``LLM.generate`` on the same GPU in the same run, and the row carries ``ratio_vs_offline``.

Workloads (token-id prompts, ``ignore_eos`` so every request produces exactly its output length):

* GPU: the Llama-3-8B-shaped dummy model on the 256-request workload of ``bench throughput``
  (inputs U[64, 1024], outputs U[32, 512], seed 0), concurrency 1, 16, 64 and 256; a level runs
  ``clamp(4 x concurrency, 16, 256)`` requests, the first of the workload.
* CPU: the embedded SmolLM2-135M, short prompts and outputs, concurrency 1, 4 and 8.

Without ``--url`` the benchmark starts ``flashpage serve`` itself on a free loopback port and stops it
(SIGTERM) before the offline runs, so both get the whole GPU.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["RequestResult", "Workload", "main", "summarize"]


@dataclass
class Workload:
    """Token-id prompts and output lengths of one benchmark."""

    model: str
    load_format: str
    prompts: list[list[int]]
    output_lens: list[int]
    dtype: str
    engine_args: list[str] = field(default_factory=list)

    def take(self, n: int) -> tuple[list[list[int]], list[int]]:
        return self.prompts[:n], self.output_lens[:n]


@dataclass
class RequestResult:
    """One request as the client saw it (seconds, ``time.perf_counter``)."""

    ok: bool
    start: float
    ttft: float | None = None
    end: float | None = None
    output_tokens: int = 0
    itls: list[float] = field(default_factory=list)
    error: str | None = None


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def summarize(results: list[RequestResult], wall_s: float) -> dict[str, Any]:
    """Throughput and latency percentiles (ms) of one level."""
    ok = [r for r in results if r.ok]
    out: dict[str, Any] = {
        "requests": len(results),
        "failed": len(results) - len(ok),
        "wall_s": wall_s,
        "requests_per_s": len(ok) / wall_s if wall_s > 0 else None,
        "output_tokens": sum(r.output_tokens for r in ok),
        "tokens_per_s": sum(r.output_tokens for r in ok) / wall_s if wall_s > 0 else None,
    }
    series = {
        "ttft": [r.ttft * 1e3 for r in ok if r.ttft is not None],
        "itl": [x * 1e3 for r in ok for x in r.itls],
        "e2e": [(r.end - r.start) * 1e3 for r in ok if r.end is not None],
    }
    for name, xs in series.items():
        for q in (50, 90, 99):
            out[f"{name}_ms_p{q}"] = _pct(xs, q)
    return out


# ---------------------------------------------------------------------------- the client


async def _one(session: Any, url: str, model: str, prompt: list[int], max_tokens: int) -> RequestResult:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    res = RequestResult(ok=False, start=time.perf_counter())
    last = None
    try:
        async with session.post(url + "/v1/completions", json=body) as resp:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return res
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    res.ok = True
                    break
                ev = json.loads(data)
                if "error" in ev:
                    res.error = ev["error"].get("message")
                    break
                now = time.perf_counter()
                if ev.get("choices"):
                    if res.ttft is None:
                        res.ttft = now - res.start
                    elif last is not None:
                        res.itls.append(now - last)
                    last = now
                if ev.get("usage"):
                    res.output_tokens = int(ev["usage"]["completion_tokens"])
    except Exception as e:  # a failed request is a result, not the end of the benchmark
        res.error = f"{type(e).__name__}: {e}"
    res.end = time.perf_counter()
    res.ok = res.ok and res.error is None
    return res


async def run_level(
    url: str, model: str, prompts: list[list[int]], out_lens: list[int], concurrency: int, rate: float | None
) -> tuple[list[RequestResult], float]:
    """Send every request, at most ``concurrency`` at once (and at ``rate`` per second, Poisson)."""
    import aiohttp

    sem = asyncio.Semaphore(concurrency)
    rng = random.Random(0)
    timeout = aiohttp.ClientTimeout(total=3600)
    conn = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(timeout=timeout, connector=conn) as session:

        async def guarded(p: list[int], n: int) -> RequestResult:
            async with sem:
                return await _one(session, url, model, p, n)

        t0 = time.perf_counter()
        tasks = []
        for p, n in zip(prompts, out_lens):
            tasks.append(asyncio.create_task(guarded(p, n)))
            if rate:
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - t0


# ---------------------------------------------------------------------------- the server process


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def launched_server(w: Workload, log_path: Path, timeout_s: float = 900.0) -> Iterator[str]:
    """``flashpage serve`` for the workload's model on a free loopback port; SIGTERM on exit."""
    import urllib.request

    port = _free_port()
    cmd = [
        sys.executable, "-m", "flashpage.cli", "serve", "--model", w.model, "--load-format", w.load_format,
        "--dtype", w.dtype, "--port", str(port), "--max-queue", "100000", "--graceful-shutdown", "5",
        *w.engine_args,
    ]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"}
        )
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"flashpage serve exited with {proc.returncode}; see {log_path}")
                try:
                    with urllib.request.urlopen(url + "/health", timeout=2) as r:
                        if r.status == 200:
                            break
                except OSError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"flashpage serve did not start in {timeout_s:.0f} s; see {log_path}")
                time.sleep(0.5)
            yield url
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(30)


def _served_model(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url + "/v1/models", timeout=10) as r:
        return str(json.load(r)["data"][0]["id"])


# ---------------------------------------------------------------------------- offline


def offline_tokens_per_s(
    w: Workload, sizes: list[int], engine_kwargs: dict[str, Any]
) -> dict[int, dict[str, float]]:
    """``LLM.generate`` over the first ``n`` requests for each ``n``: output tokens/s and wall time."""
    import torch

    from flashpage.engine.llm import LLM
    from flashpage.engine.sampling_params import SamplingParams

    llm = LLM(model=w.model, load_format=w.load_format, dtype=w.dtype, **engine_kwargs)
    out: dict[int, dict[str, float]] = {}
    try:
        warm = [SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)] * 2
        llm.generate(w.prompts[:2], warm, use_tqdm=False)
        for n in sorted(set(sizes)):
            prompts, lens = w.take(n)
            params = [SamplingParams(temperature=0.0, max_tokens=k, ignore_eos=True) for k in lens]
            llm.engine.block_manager.reset_prefix_cache()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            toks = sum(len(o.outputs[0].token_ids) for o in outs)
            out[n] = {"tokens_per_s": toks / dt, "wall_s": dt, "requests_per_s": n / dt}
            print(f"[offline] {n} requests: {toks / dt:.0f} output tok/s ({dt:.2f} s)", flush=True)
    finally:
        llm.close()
    return out


# ---------------------------------------------------------------------------- workloads


def gpu_workload_8b() -> Workload:
    from flashpage.bench.throughput import gpu_workload
    from flashpage.models.config import get_builtin_config

    cfg = get_builtin_config("llama-3-8b")
    _, outs, prompts = gpu_workload(256, cfg.vocab_size)
    return Workload("llama-3-8b", "dummy", prompts, outs, "bfloat16", ["--max-model-len", "2048"])


def cpu_workload(n: int, out_len: int) -> Workload:
    import torch

    from flashpage.models.loader import load_model

    loaded = load_model("smollm2-135m-instruct", dtype=torch.float32, device="cpu")
    tok = loaded.tokenizer
    rng = random.Random(0)
    topics = [
        "the sea",
        "a library",
        "mountains",
        "a city at night",
        "trains",
        "gardens",
        "the moon",
        "bread",
    ]
    prompts = [list(tok.encode(f"Write a short story about {rng.choice(topics)}:")) for _ in range(n)]
    del loaded
    return Workload(
        "smollm2-135m-instruct", "auto", prompts, [out_len] * n, "float32",
        ["--device", "cpu", "--kv-cache-bytes", str(128 * 2**20)],
    )  # fmt: skip


def level_size(concurrency: int, total: int) -> int:
    """Requests a level runs: four per slot, at least 16, at most the workload."""
    return max(1, min(total, max(16, 4 * concurrency)))


# ---------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    import torch

    from flashpage.bench.common import env_info, write_results

    p = argparse.ArgumentParser(prog="flashpage bench serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default=None, help="a running server (default: start flashpage serve here)")
    p.add_argument(
        "--concurrency", default=None, help="comma-separated levels (GPU default 1,16,64,256; CPU 1,4,8)"
    )
    p.add_argument(
        "--request-rate", type=float, default=None, help="requests per second (Poisson; default: all at once)"
    )
    p.add_argument(
        "--num-prompts", type=int, default=None, help="requests per level (default: clamp(4 x c, 16, 256))"
    )
    p.add_argument("--skip-offline", action="store_true", help="leave out the offline LLM.generate baseline")
    p.add_argument("--quick", action="store_true", help="GPU: levels 1,16,64 and fewer requests")
    p.add_argument("--out", type=Path, default=None, help="results directory (default: benchmarks/results)")
    args = p.parse_args(argv)

    gpu = torch.cuda.is_available()
    if gpu:
        w = gpu_workload_8b()
        default_levels = "1,16,64" if args.quick else "1,16,64,256"
        offline_kwargs: dict[str, Any] = {"max_model_len": 2048}
    else:
        w = cpu_workload(16, 16)
        default_levels = "1,4,8"
        offline_kwargs = {"device": "cpu", "kv_cache_bytes": 128 * 2**20}
    try:
        levels = [int(x) for x in (args.concurrency or default_levels).split(",")]
    except ValueError:
        print(
            f"flashpage bench serve: --concurrency must be comma-separated ints, got {args.concurrency!r}",
            file=sys.stderr,
        )
        return 2
    if any(c < 1 for c in levels):
        print("flashpage bench serve: --concurrency levels must be >= 1", file=sys.stderr)
        return 2
    sizes = {c: args.num_prompts or level_size(c, len(w.prompts)) for c in levels}
    if args.quick and gpu:
        sizes = {c: min(n, 64) for c, n in sizes.items()}

    out_dir = args.out or Path("benchmarks/results")
    out_dir.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    base = {"bench": "serve", "impl": "flashpage", "model": w.model + (" (dummy)" if w.load_format == "dummy" else ""),
            "dtype": w.dtype}  # fmt: skip
    # The server's log goes beside the results only when they go to a scratch directory (--out).
    log_path = (args.out if args.out else Path(tempfile.gettempdir())) / "serve-server.log"
    server_ctx = contextlib.nullcontext(args.url) if args.url else launched_server(w, log_path)
    with server_ctx as url:
        model = _served_model(url)
        asyncio.run(run_level(url, model, w.prompts[:2], [4, 4], 2, None))  # warm-up
        for c in levels:
            prompts, lens = w.take(sizes[c])
            results, wall = asyncio.run(run_level(url, model, prompts, lens, c, args.request_rate))
            s = summarize(results, wall)
            errs = [r.error for r in results if r.error]
            print(
                f"[server] concurrency {c}: {s['requests']} requests, {s['tokens_per_s']:.0f} output tok/s, "
                f"TTFT p50 {s['ttft_ms_p50'] or 0:.0f} ms, ITL p50 {s['itl_ms_p50'] or 0:.1f} ms, failed {s['failed']}"
                + (f" (first error: {errs[0]})" if errs else ""),
                flush=True,
            )
            rows.append({**base, "mode": "server", "concurrency": c, "request_rate": args.request_rate, **s})
    if not args.skip_offline and args.url is None:
        try:
            off = offline_tokens_per_s(w, list(sizes.values()), offline_kwargs)
        except Exception as e:  # reported, never the end of the run
            rows.append({**base, "mode": "offline", "status": "failed", "reason": f"{type(e).__name__}: {e}"})
        else:
            for r in rows:
                o = off.get(r["requests"])
                if o:
                    r["offline_tokens_per_s"] = o["tokens_per_s"]
                    r["ratio_vs_offline"] = r["tokens_per_s"] / o["tokens_per_s"]
            for n, o in sorted(off.items()):
                rows.append({**base, "mode": "offline", "requests": n, **o})
    env = env_info(None, None)
    env["workload"] = {
        "requests": len(w.prompts),
        "prompt_tokens": sum(map(len, w.prompts)),
        "output_tokens": sum(w.output_lens),
        "mean_input": statistics.mean(map(len, w.prompts)),
        "mean_output": statistics.mean(w.output_lens),
        "engine_args": w.engine_args,
    }
    cols = ["mode", "concurrency", "requests", "tokens_per_s", "offline_tokens_per_s", "ratio_vs_offline",
            "requests_per_s", "ttft_ms_p50", "ttft_ms_p99", "itl_ms_p50", "itl_ms_p99", "e2e_ms_p50", "failed"]  # fmt: skip
    note = (
        "Streaming completions over HTTP at fixed concurrency against `flashpage serve`, beside `LLM.generate` "
        "of the same requests in the same run (`ratio_vs_offline`)."
    )
    path = write_results("serve", rows, env, table_columns=cols, out_dir=args.out, note=note)
    print(f"results -> {path}")
    return 1 if any(r.get("failed") for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
