"""Probe (not part of the library): host time per eager decode call, and where it goes (issue #5).

Each entry point is called ``N`` times back to back on a small decode (GQA 32/8, d=128, bf16, block
size 16, batch 1), with no synchronisation inside the loop: the GPU work per call (a few us) is far
shorter than the host's, so wall time over ``N`` calls is the host time of one call. Rows: the
library's decode entry points with and without a split-KV combine, PyTorch SDPA on a contiguous
cache, and an empty Triton kernel launched through ``JITFunction[grid]`` and through
``CompiledKernel[grid]`` (what :class:`~flashpage.ops.launch_cache.LaunchCache` uses), i.e. the
floor Triton sets. Then a ``cProfile`` of ``run_decode`` by own time.

The rows ``(unbound)`` take the full launch path on every call (what a call on a new tensor layout
pays); the others relaunch a bound launch. Measured figures: ``docs/perf-notes.md``.

Run: ``PYTHONPATH=src python benchmarks/probes/decode_host.py [out.json]`` on a GPU machine;
``DEV=cpu TRITON_INTERPRET=1 ... --tiny`` checks the script on a CPU.
"""

from __future__ import annotations

import cProfile
import io
import json
import os
import pstats
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl

from flashpage import flash_attn_with_kvcache
from flashpage.ops.paged_decode import paged_decode
from flashpage.ops.paged_launch import PagedProblem, eager_launcher
from flashpage.ops.paged_plan import plan_decode, run_decode


@triton.jit
def _empty_kernel(X):
    pid = tl.program_id(0)
    if pid < 0:  # never true: the kernel does nothing but must keep its argument
        tl.store(X, 0.0)


def host_us(fn: Callable[[], Any], n: int, dev: torch.device) -> float:
    """Median over 5 rounds of the host time per call of ``n`` back-to-back calls of ``fn``."""
    fn()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    rounds = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        rounds.append((time.perf_counter() - t0) / n * 1e6)
        if dev.type == "cuda":
            torch.cuda.synchronize()
    rounds.sort()
    return rounds[len(rounds) // 2]


def ctx_rows(ctx: int, n: int, dev: torch.device, tiny: bool) -> list[dict[str, Any]]:
    """Host time of each entry point at one context length (batch 1), and a profile of run_decode."""
    hq, hk, d, bs = 32, 8, 128, 16
    dt = torch.bfloat16
    rows: list[dict[str, Any]] = []
    nblk = ctx // bs
    kc = torch.randn(nblk + 1, bs, hk, d, device=dev, dtype=dt)
    vc = torch.randn_like(kc)
    bt = torch.randperm(nblk, device=dev, dtype=torch.int32)[None]
    seqlens = torch.full((1,), ctx, dtype=torch.int32, device=dev)
    q = torch.randn(1, hq, d, device=dev, dtype=dt)
    q4 = q[:, None]
    plan = plan_decode(1, hq, hk, d, block_size=bs, max_seqlen_k=ctx, q_dtype=dt, device=dev)
    out = torch.empty_like(q)
    kfull = kc[bt[0].long()].reshape(1, ctx, hk, d).transpose(1, 2).repeat_interleave(hq // hk, 1)
    vfull = vc[bt[0].long()].reshape(1, ctx, hk, d).transpose(1, 2).repeat_interleave(hq // hk, 1)
    qs = q[:, :, None]
    cases: dict[str, Callable[[], Any]] = {
        "run_decode": lambda: run_decode(plan, q, kc, vc, bt, seqlens, out=out),
        "run_decode (new out)": lambda: run_decode(plan, q, kc, vc, bt, seqlens),
        # What run_decode pays on a new tensor layout: the full launch path (binding included).
        "PagedLauncher.bind (unbound)": lambda: eager_launcher().bind(
            PagedProblem(q, kc, vc, out, seqlens, 1, plan.softmax_scale, block_table=bt),
            plan.config,
            plan.num_splits,
            plan.workspace,
        ),
        "paged_decode validate=False": lambda: paged_decode(q, kc, vc, bt, seqlens, validate=False),
        "flash_attn_with_kvcache validate=False": lambda: flash_attn_with_kvcache(
            q4, kc, vc, cache_seqlens=seqlens, block_table=bt, validate=False
        ),
        # An eager call that finds no bound launch (the eager launcher emptied first).
        "flash_attn_with_kvcache validate=False (unbound)": lambda: (
            eager_launcher().clear(),
            flash_attn_with_kvcache(q4, kc, vc, cache_seqlens=seqlens, block_table=bt, validate=False),
        ),
        "flash_attn_with_kvcache": lambda: flash_attn_with_kvcache(
            q4, kc, vc, cache_seqlens=seqlens, block_table=bt
        ),
        "sdpa (contiguous, expanded GQA)": lambda: torch.nn.functional.scaled_dot_product_attention(
            qs, kfull, vfull
        ),
    }
    ref = torch.nn.functional.scaled_dot_product_attention(qs.float(), kfull.float(), vfull.float())[:, :, 0]
    got = run_decode(plan, q, kc, vc, bt, seqlens).float()
    err = (got - ref).abs().max().item()
    if err > 2e-2:
        raise SystemExit(f"run_decode disagrees with the reference at ctx {ctx}: max error {err}")
    for name, fn in cases.items():
        us = host_us(fn, n, dev)
        rows.append({"ctx": ctx, "splits": plan.num_splits, "case": name, "host_us": round(us, 2)})
        print(f"ctx {ctx:5d} splits {plan.num_splits:2d}  {name:50s} {us:8.2f} us", flush=True)
    if not tiny:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(n):
            run_decode(plan, q, kc, vc, bt, seqlens, out=out)
        prof.disable()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(18)
        print(s.getvalue(), flush=True)
    return rows


def main() -> None:
    tiny = "--tiny" in sys.argv
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    dev = torch.device(os.environ.get("DEV", "cuda"))
    n = 3 if tiny else 2000
    rows: list[dict[str, Any]] = []
    for ctx in (256,) if tiny else (256, 4096):
        rows += ctx_rows(ctx, n, dev, tiny)
    x = torch.zeros(1, device=dev)
    jit_launch = lambda: _empty_kernel[(1,)](x)
    rows.append(
        {"case": "empty triton kernel, JITFunction[grid]", "host_us": round(host_us(jit_launch, n, dev), 2)}
    )
    compiled = _empty_kernel.warmup(x, grid=(1,)) if dev.type == "cuda" else None
    if compiled is not None:
        c_launch = lambda: compiled[(1, 1, 1)](x)
        rows.append(
            {
                "case": "empty triton kernel, CompiledKernel[grid]",
                "host_us": round(host_us(c_launch, n, dev), 2),
            }
        )
    for r in (r for r in rows if r["case"].startswith("empty")):
        print(f"{r['case']:50s} {r['host_us']:8.2f} us", flush=True)
    meta = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
            "torch": torch.__version__, "triton": triton.__version__, "calls": n}  # fmt: skip
    path = args[0] if args else os.path.join(os.environ.get("OUT", "."), "decode_host.json")
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
