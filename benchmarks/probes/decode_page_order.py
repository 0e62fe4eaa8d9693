"""Probe (not part of the library): how much of paged decode's gap to cuDNN is page order, how much
is split count / wave tail, and how much is the attention math over a pure read (issue #5).

For each decode shape (GQA 32/8, d=128, bf16, block size 16) and several block tables over the same
cache, in one run on one GPU, interleaved in round-robin rounds (fastest round kept):

* ``cudnn``: SDPA cuDNN on a contiguous ``(b, hk, ctx, d)`` cache, the target (timed once per shape);
* ``decode``: the library's ``run_decode`` (default tiles) at several split counts, and at the
  planner's split count with 80 registers, 128- or 32-token tiles or 8 warps (``variant``);
* ``read``: a pure-read Triton kernel with the decode kernel's grid and tiles (64-token tiles
  gathered from the table, K and V summed, no attention math): the ceiling of that access pattern.

Block tables: ``rand`` (a random permutation: the bench's worst case), ``seq`` (ascending ids),
``run8`` / ``run64`` (runs of 8 / 64 consecutive blocks in random run order), ``grp64`` (each
aligned group of 64 blocks, 2 MiB of K at this shape, in random order inside the group, groups in
order: TLB reach kept, DRAM row order lost), ``bm`` (the tables :class:`~flashpage.kv.BlockManager`
hands out when ``batch`` sequences with prompts of a quarter of ``ctx`` then decode in lockstep:
``flashpage.bench.decode.block_manager_table``).

Measured (H200, torch 2.11, triton 3.6, 2026-12-05, at e871274's kernels; % of cuDNN in the same
run, fastest of two rounds). Decode at the planner's split count:

| shape (splits) | rand | seq | run8 | run64 | grp64 | bm |
|---|---|---|---|---|---|---|
| b32/32k (2) | 97.2 | 98.2 | 97.6 | 98.4 | 97.8 | 98.3 |
| b64/4k (1) | 98.3 | 98.9 | 98.7 | 99.0 | 99.1 | 99.4 |
| b256/4k (1) | 98.5 | 99.8 | 99.1 | 99.5 | 99.2 | 99.5 |
| b1/128k (64) | 98.1 | 99.5 | 99.4 | 99.3 | 98.3 | 99.5 |

Other split counts (rand / seq) were all slower: b32/32k 1: 87/90, 3: 77/77, 4: 93/95, 8: 92/93,
16: 95/96; b64/4k 2: 92/94, 3: 89/90, 4: 89/90, 8: 91/92; b256/4k 2: 94/94, 4: 94/95; b1/128k 32:
84/86, 128: 95/96. The planner's count (the smallest power of two giving >= 2 programs per SM) is the
best of them everywhere; a program count just past one wave (3 splits at b32/32k: 768 programs for
~660 slots) costs a quarter. Tile variants at the planner's count (rand / seq): 80 registers 97.0 /
98.2, 98.1 / 98.5, 91.3 / 92.2, 97.9 / 99.0 (b32/32k, b64/4k, b256/4k, b1/128k); 128-token tiles
96.8 / 98.3, 87.8 / 87.9, 98.5 / 99.0, 96.1 / 97.0; 32-token tiles 83-95; 8 warps 74-89. The read rows
of that run reduced every tile (a per-tile ``tl.sum``) and read 70-90%: not a ceiling; the kernel
now accumulates the tile and reduces once.

H100 (same day, seq / rand tables, that read kernel): decode 97.9 / 96.9 at b32/32k (3.02 TB/s,
cuDNN 3.09), read 97.2 / 95.4; b64/4k decode 98.5 / 97.7, read 98.2 / 97.2; b256/4k decode 99.8 /
99.0, read 100.5 / 99.8. Batch sizes that fill the SMs more evenly (b33/32k: 528 programs = 4 per
SM; b66/4k) moved decode by +0.3-0.6% and cuDNN by as much; at b41/32k decode read 104% of cuDNN
only because cuDNN fell to 2.93 TB/s (its own wave quantization) while decode stayed at 3.05.

So: (1) page order is worth 0.6-1.4% (random vs ascending), and the tables the block manager hands
out (ascending runs, one block per sequence per round while decoding) read like ascending pages;
(2) a pure pointer-load read of the same tiles is no faster than the decode kernel, so the
attention math is not what is left: the last 0.2-1.8% to cuDNN is how this tiling streams pages.

Run on the GPU: ``PYTHONPATH=src python benchmarks/probes/decode_page_order.py [out.json]``;
``DEV=cpu TRITON_INTERPRET=1`` with ``--tiny`` checks the script on a CPU. ``SHAPES=b:ctx:s1/s2,...``,
``TABLES=rand,seq``, ``NOVAR=1`` (no tile variants) and ``VARIANTS=r96,r104`` (which ones) narrow a run.
A split count of 0 in ``SHAPES`` is the planner's. A given count also makes the library's automatic
heads per program take its widest choice (4 KV heads at GQA 32/8), so small counts launch few programs:
``SHAPES=32:32768:2`` read 72% of cuDNN on the H100 (2026-12-06) where the planner's 8 splits read 98%.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from flashpage.bench.common import do_bench_ms, round_robin
from flashpage.bench.decode import block_manager_table
from flashpage.ops.launch_cache import KERNEL_OPTIONS
from flashpage.ops.paged_decode import default_decode_config
from flashpage.ops.paged_plan import plan_decode, run_decode


@triton.jit
def _read_kernel(K, V, Out, BT, SeqlensK, num_splits, stride_kb, stride_kt, stride_kh, stride_btb,
                 PAGE: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr):  # fmt: skip
    kvh = tl.program_id(0)
    split = tl.program_id(1)
    b = tl.program_id(2)
    ctx = tl.load(SeqlensK + b)
    n_tiles = tl.cdiv(ctx, BLOCK_N)
    per = tl.cdiv(n_tiles, num_splits)
    lo = split * per * BLOCK_N
    hi = tl.minimum(lo + per * BLOCK_N, ctx)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    acc = tl.zeros([BLOCK_N, D], dtype=tl.float32)
    bt = BT + b.to(tl.int64) * stride_btb
    for s in range(lo, hi, BLOCK_N):
        j = s + offs_n
        blk = tl.load(bt + j // PAGE)
        off = blk * stride_kb + (j % PAGE) * stride_kt + kvh * stride_kh
        k = tl.load(K + off[:, None] + offs_d[None, :])
        v = tl.load(V + off[:, None] + offs_d[None, :])
        acc += k.to(tl.float32) + v.to(tl.float32)  # reduced once at the end: no per-tile shuffles
    tl.store(Out + ((b * tl.num_programs(0) + kvh) * num_splits + split) * D + offs_d, tl.sum(acc, 0))


def read_all(k: Tensor, v: Tensor, bt: Tensor, seqlens: Tensor, splits: int, out: Tensor) -> Tensor:
    b, hk, d, page = bt.shape[0], k.shape[2], k.shape[3], k.shape[1]
    _read_kernel[(hk, splits, b)](k, v, out, bt, seqlens, splits, k.stride(0), k.stride(1), k.stride(2),
                                  bt.stride(0), PAGE=page, BLOCK_N=64, D=d, num_warps=4, num_stages=2, **KERNEL_OPTIONS)  # fmt: skip
    return out


def tables(b: int, ctx: int, bs: int, gen: torch.Generator) -> dict[str, Tensor]:
    """The block tables (``(b, ctx // bs)`` int64 on the CPU) this probe compares."""
    n = b * ctx // bs
    out: dict[str, Tensor] = {"rand": torch.randperm(n, generator=gen), "seq": torch.arange(n)}
    for r in (8, 64):
        runs = torch.randperm(n // r, generator=gen)
        out[f"run{r}"] = (runs[:, None] * r + torch.arange(r)).flatten()
    grp = torch.stack([torch.randperm(64, generator=gen) for _ in range(n // 64)])
    out["grp64"] = (grp + torch.arange(n // 64)[:, None] * 64).flatten()
    out["bm"] = block_manager_table(b, ctx, bs).flatten().long()
    return {k: v.view(b, ctx // bs) for k, v in out.items()}


# Query heads, KV heads, head dim and block size of every probed shape (Llama-3 GQA 32/8).
SHAPE = (32, 8, 128, 16)


def decode_inputs(
    b: int, ctx: int, dev: torch.device, dt: torch.dtype
) -> tuple[Tensor, Tensor, Tensor, Tensor, int]:
    """Random K and V caches ``(b * ctx // page, page, hk, d)`` (every block used once), seqlens
    ``(b,)`` int32 all ``ctx``, decode queries ``(b, h, d)`` and the KV bytes one decode step reads."""
    h, hk, d, bs = SHAPE
    kc = torch.randn(b * ctx // bs, bs, hk, d, device=dev, dtype=dt)
    vc = torch.randn_like(kc)
    seqlens = torch.full((b,), ctx, dtype=torch.int32, device=dev)
    q = torch.randn(b, h, d, device=dev, dtype=dt)
    return kc, vc, seqlens, q, 2 * b * ctx * hk * d * kc.element_size()


def table_case(
    q: Tensor, kc: Tensor, vc: Tensor, t: Tensor, rows: list[tuple[dict[str, Any], Callable[[], Any]]]
) -> tuple[Tensor, Tensor, Tensor]:
    """Block table ``t`` (``(b, ctx // page)`` int64, CPU) as int32 on the caches' device, the SDPA
    reference ``(b, h, d)`` float32 over the table's logical cache, and that cache's K + V summed
    over the tokens ``(b, hk, d)`` (the read kernels' check). With no rows yet on CUDA, adds the
    ``cudnn`` row over that contiguous ``(b, hk, ctx, d)`` cache (its timing does not depend on
    which blocks were gathered)."""
    dev = kc.device
    b, ctx, hk, d = t.shape[0], t.numel() * kc.shape[1] // t.shape[0], kc.shape[2], kc.shape[3]
    kk = kc[t.to(dev)].reshape(b, ctx, hk, d).transpose(1, 2).contiguous()
    vv = vc[t.to(dev)].reshape(b, ctx, hk, d).transpose(1, 2).contiguous()
    ref = torch.nn.functional.scaled_dot_product_attention(q.unsqueeze(2), kk, vv, enable_gqa=True)
    want_read = (kk.float() + vv.float()).sum(2)
    if not rows and dev.type == "cuda":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def cudnn(kct: Tensor = kk, vct: Tensor = vv) -> Tensor:
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(
                    q.unsqueeze(2), kct, vct, enable_gqa=True
                )

        rows.append(({"impl": "cudnn"}, cudnn))
    return t.to(torch.int32).to(dev), ref[:, :, 0].float(), want_read


def add_decode_row(
    rows: list[tuple[dict[str, Any], Callable[[], Any]]],
    label: dict[str, Any],
    q: Tensor,
    kc: Tensor,
    vc: Tensor,
    bt: Tensor,
    seqlens: Tensor,
    ref: Tensor,
    ctx: int,
    **plan_kw: Any,
) -> None:
    """Plan a decode of ``q (b, h, d)`` over the paged caches with block table ``bt`` (``plan_kw`` to
    :func:`plan_decode`), check it against ``ref`` and add its timed call to ``rows`` as a ``decode``
    row labelled ``label`` and its split count."""
    b, h, d = q.shape
    hk, bs = kc.shape[2], kc.shape[1]
    plan = plan_decode(
        b, h, hk, d, block_size=bs, max_seqlen_k=ctx, q_dtype=q.dtype, device=q.device, **plan_kw
    )
    err = (run_decode(plan, q, kc, vc, bt, seqlens).float() - ref).abs().max().item()
    assert err < 2e-2, (label, err)
    fn = lambda: run_decode(plan, q, kc, vc, bt, seqlens)
    rows.append(({"impl": "decode", **label, "splits": plan.num_splits}, fn))


def probe_shape(
    b: int,
    ctx: int,
    split_list: tuple[int, ...],
    dev: torch.device,
    gen: torch.Generator,
    tiny: bool,
    bench: Callable[[Callable[[], Any]], float],
) -> list[dict[str, Any]]:
    """Rows of one ``(batch, ctx)`` shape, timed in round-robin rounds."""
    dt = torch.bfloat16
    h, hk, d, bs = SHAPE
    kc, vc, seqlens, q, kv_bytes = decode_inputs(b, ctx, dev, dt)
    rows: list[tuple[dict[str, Any], Callable[[], Any]]] = []
    tabs = tables(b, ctx, bs, gen)
    keep = os.environ.get("TABLES")
    for name, t in tabs.items():
        if keep and name not in keep.split(","):
            continue
        bt, ref, want_read = table_case(q, kc, vc, t, rows)

        def add(
            label: dict[str, Any], bt: Tensor = bt, ref: Tensor = ref, name: str = name, **plan_kw: Any
        ) -> None:
            add_decode_row(rows, {"table": name, **label}, q, kc, vc, bt, seqlens, ref, ctx, **plan_kw)

        for ns in split_list if name in ("rand", "seq") else (0,):
            add({"req": ns}, num_splits=ns)
        # Tile / register variants at the planner's split count.
        base_cfg = default_decode_config(dt, d)
        variants = {
            "r80": replace(base_cfg, maxnreg=80),
            "r96": replace(base_cfg, maxnreg=96),
            "r104": replace(base_cfg, maxnreg=104),
            "n128": replace(base_cfg, block_n=128),
            "n32": replace(base_cfg, block_n=32),
            "w8": replace(base_cfg, num_warps=8),
        }
        pick = os.environ.get("VARIANTS", "r80,n128,n32,w8").split(",")  # e.g. VARIANTS=r96,r104
        variants = {k: v for k, v in variants.items() if k in pick}
        for vname, cfg in variants.items() if name in ("rand", "seq") and not os.environ.get("NOVAR") else ():
            add({"variant": vname}, config=cfg)
        ns_r = plan_decode(b, h, hk, d, block_size=bs, max_seqlen_k=ctx, q_dtype=dt, device=dev).num_splits
        buf = torch.empty(b * hk * ns_r * d, device=dev, dtype=torch.float32)
        got = read_all(kc, vc, bt, seqlens, ns_r, buf).view(b, hk, ns_r, d).sum(2)
        assert torch.allclose(got, want_read, atol=1e-1 * (ctx**0.5)), name
        rows.append(({"impl": "read", "table": name, "splits": ns_r},
                     lambda bt=bt, ns_r=ns_r, buf=buf: read_all(kc, vc, bt, seqlens, ns_r, buf)))  # fmt: skip

    return time_rows(rows, b, ctx, kv_bytes, bench, tiny)


Row = tuple[dict[str, Any], Callable[[], Any]]
ShapeProbe = Callable[..., list[dict[str, Any]]]


def time_rows(
    rows: list[Row], b: int, ctx: int, kv_bytes: int, bench: Callable[[Callable[[], Any]], float], tiny: bool
) -> list[dict[str, Any]]:
    """Time ``rows`` in round-robin rounds (fastest kept); each labelled with its shape, times,
    TB/s and, when the first row is ``cudnn``, its % of that row. Printed as they are done."""

    def failed(item: Row, exc: Exception) -> None:
        print(f"{item[0]} b={b} ctx={ctx}: {type(exc).__name__}: {exc}", flush=True)

    times = round_robin(rows, lambda item: bench(item[1]), 1 if tiny else 2, failed)
    base = min(times[0]) if rows and rows[0][0]["impl"] == "cudnn" and times[0] else None
    results = []
    for (r, _), t in zip(rows, times, strict=True):
        if t is None:
            continue
        ms = min(t)
        r.update(batch=b, ctx=ctx, ms=ms, ms_rounds=t, tbps=kv_bytes / ms / 1e9)
        if base:
            r["pct_cudnn"] = round(100 * base / ms, 2)
        results.append(r)
        print(json.dumps(r), flush=True)
    return results


def run_probe(probe: ShapeProbe, shapes: list[tuple[int, int, tuple[int, ...]]], name: str) -> None:
    """Run ``probe(b, ctx, splits, dev, gen, tiny, bench)`` per shape (``SHAPES=b:ctx:s1/s2,...``
    overrides ``shapes``; ``--tiny`` one small shape) and write ``$OUT/<name>.json`` (or argv's
    first non-flag argument)."""
    tiny = "--tiny" in sys.argv
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    dev = torch.device(os.environ.get("DEV", "cuda"))
    if tiny:
        shapes = [(2, 512, (1, 2))]
    if os.environ.get("SHAPES"):  # e.g. SHAPES=33:32768:2,66:4096:1
        shapes = [
            (int(b), int(c), tuple(int(x) for x in s.split("/")))
            for b, c, s in (item.split(":") for item in os.environ["SHAPES"].split(","))
        ]

    def bench(fn: Callable[[], Any]) -> float:
        if dev.type != "cuda":  # the interpreter: run once, no timing
            fn()
            return 1.0
        return do_bench_ms(fn, warmup=15, rep=60)

    gen = torch.Generator().manual_seed(0)
    results: list[dict[str, Any]] = []
    for b, ctx, split_list in shapes:
        results += probe(b, ctx, split_list, dev, gen, tiny, bench)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    out = args[0] if args else os.path.join(os.environ.get("OUT", "."), f"{name}.json")
    with open(out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "rows": results},
                  f, indent=1)  # fmt: skip


def main() -> None:
    run_probe(probe_shape, [(32, 32768, (1, 2, 3, 4, 8, 16)), (64, 4096, (1, 2, 3, 4, 8)), (256, 4096, (1, 2, 4)),
                            (1, 131072, (32, 64, 128))], "decode_page_order")  # fmt: skip


if __name__ == "__main__":
    main()
