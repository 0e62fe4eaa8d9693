"""Probe (not part of the library): do programs that read whole pages (every KV head of a page,
one contiguous 32 KiB run per page at GQA 32/8, d=128, block size 16) stream the paged cache
faster than the library's one-KV-head programs (256-byte rows strided by ``nheads_k * d``)?
Issue #5's last 1-3% to cuDNN.

Rows, per decode shape and block table (``rand`` / ``seq`` / ``bm`` as in ``decode_page_order``),
interleaved in round-robin rounds (fastest kept), % of cuDNN on a contiguous cache in the same run:

* ``cudnn``: SDPA cuDNN on a contiguous ``(b, hk, ctx, d)`` cache (the target);
* ``decode``: the library's ``run_decode`` at the planner's split count;
* ``read-head``: a pure read with the library's tiling (one KV head per program, 64-token tiles);
* ``read-page``: a pure read of whole pages (all KV heads of ``PPT`` pages per tile);
* ``mh``: a multi-KV-head decode kernel, ``HPP`` KV heads per program. The tile is ``PPT`` pages
  of ``HPP`` heads as ``(PPT * page * HPP, d)`` rows in memory order, so with ``HPP = nheads_k``
  each page is one contiguous run; ``Q K^T`` runs over all ``HPP * G`` query rows against all
  rows and masks the pairs of different heads (block-diagonal: ``HPP``-fold wasted MMA and exp
  work, which decode's ~1 FLOP/byte leaves room for). Partials go to a float32 workspace; the
  split combine is done by torch for the check and left out of the timing (the library's PDL
  combine costs ~1.6 us at b1/128k, <0.1% elsewhere).

Measured (H100, torch 2.11, triton 3.6, 2026-12-05; % of cuDNN, random / block-manager tables):

| shape | decode (1 head) | read-head | read-page | mh 4 heads, 16-token tiles | mh 8 heads |
|---|---|---|---|---|---|
| b32/32k | 96.9 / 97.8 | 95.4 / 96.6 | 98.4-98.9 / 100.0-100.6 | 98.2-98.4 / 98.8-99.3 | 98.1 / 98.9 |
| b64/4k | 98.0 / 98.3 | 97.2-97.5 / 97.4-97.5 | 99.2-100.0 / 100.6-101.7 | 98.4-98.7 / 99.5-100.3 | 98.2 / 99.3 |
| b256/4k | 98.9-99.0 / 99.6-99.8 | 99.6-99.8 / 100.4 | 99.4-99.8 / 100.9-101.3 | 99.1 / 99.8 | 99.2 / 99.8 |
| b1/128k | 97.9 / 98.4-98.5 | 99.6-99.8 / 100.9-101.2 | 100.3-101.7 / 102.3-103.1 | 100.0-100.8 / 100.6-100.7 | 99.5 / 100.6 |

(mh rows without their split combine, best split count of those tried; 4 heads x 16 tokens: 96
registers, 5 programs per SM; 8 heads: 164 registers, 2 per SM; 8 warps or a third stage no
better, the V load beside the K load no different.) Whole-page reads are 1.5-3.5% faster than the
one-head tiling's reads at the split shapes; the 4-head decode program keeps about half of that.
In the library (``PagedAttnConfig.heads_per_program``) the gain at the planner's split counts was
smaller: see :func:`flashpage.roofline.planner.choose_heads_per_program`.

Run on the GPU: ``PYTHONPATH=src:benchmarks/probes python benchmarks/probes/decode_multihead.py``;
``DEV=cpu TRITON_INTERPRET=1`` with ``--tiny`` checks it on a CPU.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl
from decode_page_order import SHAPE, decode_inputs, read_all, run_probe, table_case, tables, time_rows
from torch import Tensor

from flashpage.ops.launch_cache import KERNEL_OPTIONS
from flashpage.ops.paged_plan import plan_decode, run_decode


@triton.jit
def _read_page_kernel(K, V, Out, BT, SeqlensK, num_splits, stride_kb, stride_btb,
                      PAGE: tl.constexpr, PPT: tl.constexpr, HK: tl.constexpr, D: tl.constexpr):  # fmt: skip
    """Grid ``(num_splits, batch)``: sum of every K/V element of the split's pages."""
    split = tl.program_id(0)
    b = tl.program_id(1)
    ROWS: tl.constexpr = PPT * PAGE * HK
    ctx = tl.load(SeqlensK + b)
    n_tiles = ctx // (PPT * PAGE)
    per = tl.cdiv(n_tiles, num_splits)
    lo = split * per
    hi = tl.minimum(lo + per, n_tiles)
    r = tl.arange(0, ROWS)
    offs_d = tl.arange(0, D)
    acc = tl.zeros([ROWS, D], dtype=tl.float32)
    bt = BT + b.to(tl.int64) * stride_btb
    for t in range(lo, hi):
        blk = tl.load(bt + t * PPT + r // (PAGE * HK))
        off = blk * stride_kb + (r % (PAGE * HK)) * D
        k = tl.load(K + off[:, None] + offs_d[None, :])
        v = tl.load(V + off[:, None] + offs_d[None, :])
        acc += k.to(tl.float32) + v.to(tl.float32)
    tl.store(Out + (b * num_splits + split) * D + offs_d, tl.sum(acc, 0))


@triton.jit
def _mh_decode_kernel(Q, K, V, MidO, MidL, BT, SeqlensK, num_splits, qk_scale,
                      stride_kb, stride_kt, stride_btb,
                      PAGE: tl.constexpr, PPT: tl.constexpr, HPP: tl.constexpr, G: tl.constexpr,
                      HK: tl.constexpr, D: tl.constexpr, EARLY_V: tl.constexpr):  # fmt: skip
    """Grid ``(num_splits, nheads_k // HPP, batch)``. ``Q`` ``(batch, nheads, d)``; ``MidO``
    ``(batch, nheads, splits, d)`` and ``MidL`` ``(batch, nheads, splits)`` float32 (base-2 LSE)."""
    split = tl.program_id(0)
    hg = tl.program_id(1)
    b = tl.program_id(2)
    ROWS: tl.constexpr = HPP * G
    TOK: tl.constexpr = PPT * PAGE
    COLS: tl.constexpr = TOK * HPP
    ctx = tl.load(SeqlensK + b)
    n_tiles = ctx // TOK
    per = tl.cdiv(n_tiles, num_splits)
    lo = split * per
    hi = tl.minimum(lo + per, n_tiles)
    r = tl.arange(0, ROWS)
    c = tl.arange(0, COLS)
    offs_d = tl.arange(0, D)
    head0 = hg * ROWS
    q = tl.load(Q + (b * (HK * G) + head0 + r)[:, None] * D + offs_d[None, :])
    same = (r // G)[:, None] == (c % HPP)[None, :]
    col_in = (c // HPP) % PAGE * stride_kt + (hg * HPP + c % HPP) * D
    m_i = tl.full([ROWS], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, D], dtype=tl.float32)
    bt = BT + b.to(tl.int64) * stride_btb
    for t in range(lo, hi):
        blk = tl.load(bt + t * PPT + c // (HPP * PAGE))
        off = blk * stride_kb + col_in
        k = tl.load(K + off[:, None] + offs_d[None, :])
        if EARLY_V:
            v = tl.load(V + off[:, None] + offs_d[None, :])
        s = tl.dot(q, tl.trans(k)) * qk_scale
        s = tl.where(same, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if not EARLY_V:
            v = tl.load(V + off[:, None] + offs_d[None, :])
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    empty = l_i == 0.0
    o = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
    row = (b * (HK * G) + head0 + r) * num_splits + split
    tl.store(MidO + row[:, None] * D + offs_d[None, :], o)
    tl.store(MidL + row, lse)


def mh_decode(q: Tensor, k: Tensor, v: Tensor, bt: Tensor, seqlens: Tensor, splits: int,
              hpp: int, ppt: int, warps: int, stages: int, early_v: int, maxnreg: int,
              mid_o: Tensor, mid_l: Tensor) -> Any:  # fmt: skip
    b, h, d = q.shape
    page, hk = k.shape[1], k.shape[2]
    extra = {"maxnreg": maxnreg} if maxnreg and q.device.type == "cuda" else {}
    return _mh_decode_kernel[(splits, hk // hpp, b)](
        q, k, v, mid_o, mid_l, bt, seqlens, splits, d**-0.5 * 1.4426950408889634,
        k.stride(0), k.stride(1), bt.stride(0),
        PAGE=page, PPT=ppt, HPP=hpp, G=h // hk, HK=hk, D=d, EARLY_V=bool(early_v),
        num_warps=warps, num_stages=stages, **extra, **KERNEL_OPTIONS,
    )  # fmt: skip


def occupancy(kern: Any, warps: int) -> int:
    """Resident programs per SM of a compiled kernel (registers and shared memory; CUDA only)."""
    if not torch.cuda.is_available():
        return 1
    props = torch.cuda.get_device_properties(0)
    regs = max(1, kern.n_regs) * 32 * warps
    smem = getattr(props, "shared_memory_per_multiprocessor", 233472)
    by_smem = smem // max(1, kern.metadata.shared + 1024)
    return max(1, min(65536 // regs, by_smem, 64 // warps))


def merge(mid_o: Tensor, mid_l: Tensor) -> Tensor:
    """``(b, h, splits, d)`` partials and base-2 LSEs -> ``(b, h, d)`` float32."""
    w = torch.softmax(mid_l * 0.6931471805599453, dim=-1)
    return (w.unsqueeze(-1) * mid_o).sum(2)


def probe_shape(
    b: int,
    ctx: int,
    mh_splits: tuple[int, ...],
    dev: torch.device,
    gen: torch.Generator,
    tiny: bool,
    bench: Callable[[Callable[[], Any]], float],
) -> list[dict[str, Any]]:
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float16  # the interpreter's bf16 dot is wrong
    h, hk, d, bs = SHAPE
    kc, vc, seqlens, q, kv_bytes = decode_inputs(b, ctx, dev, dt)
    rows: list[tuple[dict[str, Any], Callable[[], Any]]] = []
    keep = os.environ.get("TABLES", "rand,seq,bm").split(",")
    n_sms = torch.cuda.get_device_properties(0).multi_processor_count if dev.type == "cuda" else 4
    # (heads per program, pages per tile, warps, stages, early V, maxnreg)
    mh_cfgs = [(8, 1, 4, 2, 0, 0), (4, 2, 4, 2, 0, 0)]
    if os.environ.get("MH"):  # e.g. MH=8:1:8:3:1:0,4:2:4:2:0:168
        mh_cfgs = [tuple(int(x) for x in s.split(":")) for s in os.environ["MH"].split(",")]
    for name, t in tables(b, ctx, bs, gen).items():
        if name not in keep:
            continue
        bt, ref, per_head = table_case(q, kc, vc, t, rows)
        want_read = per_head.sum(1)  # (b, d)
        plan = plan_decode(b, h, hk, d, block_size=bs, max_seqlen_k=ctx, q_dtype=dt, device=dev)
        err = (run_decode(plan, q, kc, vc, bt, seqlens).float() - ref).abs().max().item()
        assert err < 2e-2, ("decode", name, err)
        rows.append(({"impl": "decode", "table": name, "splits": plan.num_splits},
                     lambda plan=plan, bt=bt: run_decode(plan, q, kc, vc, bt, seqlens)))  # fmt: skip
        ns = plan.num_splits
        buf = torch.empty(b * hk * ns * d, device=dev, dtype=torch.float32)
        got = read_all(kc, vc, bt, seqlens, ns, buf).view(b, hk * ns, d).sum(1)
        assert torch.allclose(got, want_read, atol=1e-1 * (ctx**0.5)), ("read-head", name)
        rows.append(({"impl": "read-head", "table": name, "splits": ns},
                     lambda bt=bt, ns=ns, buf=buf: read_all(kc, vc, bt, seqlens, ns, buf)))  # fmt: skip
        for ppt in (1, 2) if not os.environ.get("NOREAD") else ():
            for sp in mh_splits:
                out = torch.empty(b * sp * d, device=dev, dtype=torch.float32)

                def rp(bt: Tensor = bt, sp: int = sp, out: Tensor = out, ppt: int = ppt) -> Tensor:
                    _read_page_kernel[(sp, b)](kc, vc, out, bt, seqlens, sp, kc.stride(0), bt.stride(0),
                                               PAGE=bs, PPT=ppt, HK=hk, D=d, num_warps=8, num_stages=2, **KERNEL_OPTIONS)  # fmt: skip
                    return out

                got = rp().view(b, sp, d).sum(1)
                assert torch.allclose(got, want_read, atol=1e-1 * (ctx**0.5)), ("read-page", name)
                rows.append(({"impl": "read-page", "table": name, "splits": sp, "ppt": ppt}, rp))
        for cfg in mh_cfgs:
            hpp = cfg[0]
            groups = hk // hpp
            probe_o = torch.empty(b, h, 1, d, device=dev, dtype=torch.float32)
            probe_l = torch.empty(b, h, 1, device=dev, dtype=torch.float32)
            try:
                kern = mh_decode(q, kc, vc, bt, seqlens, 1, *cfg, probe_o, probe_l)
            except Exception as e:  # a config that does not compile (shared memory) is a row lost
                print(cfg, f"{type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            occ = occupancy(kern, cfg[2])
            info = {"regs": getattr(kern, "n_regs", 0), "spills": getattr(kern, "n_spills", 0), "occ": occ}
            one_wave = max(1, occ * n_sms // (b * groups))
            split_set = (
                sorted({max(1, one_wave // 2), one_wave} | set(mh_splits)) if not tiny else list(mh_splits)
            )
            for sp in split_set:
                mid_o = torch.empty(b, h, sp, d, device=dev, dtype=torch.float32)
                mid_l = torch.empty(b, h, sp, device=dev, dtype=torch.float32)

                def mh(bt: Tensor = bt, sp: int = sp, cfg: tuple[int, ...] = cfg,
                       mid_o: Tensor = mid_o, mid_l: Tensor = mid_l) -> None:  # fmt: skip
                    mh_decode(q, kc, vc, bt, seqlens, sp, *cfg, mid_o, mid_l)

                label = {"impl": "mh", "table": name, "splits": sp, "cfg": "h{}p{}w{}s{}e{}r{}".format(*cfg),
                         **info}  # fmt: skip
                mh()
                err = (merge(mid_o, mid_l) - ref).abs().max().item()
                assert err < 2e-2, (label, err)
                rows.append((label, mh))

    return time_rows(rows, b, ctx, kv_bytes, bench, tiny)


def main() -> None:
    run_probe(probe_shape, [(32, 32768, (4, 8, 16)), (64, 4096, (2, 4, 8)), (256, 4096, (1, 2)),
                            (1, 131072, (128, 256, 512))], "decode_multihead")  # fmt: skip


if __name__ == "__main__":
    main()
