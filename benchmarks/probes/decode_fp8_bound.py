"""Probe (not part of the library): what limits the fp8 decode kernel short of the 1.8x moonshot
(issue #5): the byte-wise read of V's transposed ``tl.dot`` operand, or the cross-warp traffic of
every tile?

Triton widens fp8 in the dot-operand layout, so ``P @ V`` reads V from shared memory one byte per
element (``LDS.U8``, 128 per thread per 128-token tile, ``benchmarks/probes/decode_sass.py``): the
contraction runs over tokens, and tokens are V's outer dimension. Fixing that in the kernel means
a transpose of 8-bit data in registers (PRMT), which only a hand-laid-out kernel (Gluon) can express.
Before writing one, this probe bounds what it could buy: the same decode kernel reading V from a
token-contiguous copy of the cache (``(num_blocks, nheads_k, d, page)``, a layout the library does
not use), so the V operand loads as words like K's.

The other suspect: with 16 query rows the 4 warps of a program split each tile's keys for ``Q K^T``
and the head dim for ``P V``, so every tile reduces the row maxima and sums across warps and passes
``P`` through shared memory (10 barriers per tile). ``_fp8_decode_wb`` gives each warp its own
slice of the tile's tokens (a 3-D ``tl.dot`` whose batch is the warp) with its own softmax state,
merged once after the loop; the library's former ``warp_slices`` option (since removed) was the same idea.

Kernels (``_fp8_decode``, ``_fp8_decode_wb``): one program per (KV head, split, sequence), the GQA
group's 4 query heads padded to 16 rows, 128-token tiles gathered from the block table, K and V
loaded together, fp16 dots, mask-free (contexts are multiples of 128 x splits), partial outputs and
LSEs per split (merged by torch only for the check; the timed rows are the kernel alone). Modes:
``std`` the library's V layout (calibrates the probe kernel against the library's), ``vt`` V from
the token-contiguous copy, ``pair`` V's byte pairs (below), ``wb`` prefix one slice per warp.

Offline sm_90 SASS (triton 3.9, the mask-free loop per thread per 128-token tile, 2026-12-06):

| kernel | registers | instructions | LDS.U8 | IMAD.MOV | BAR.SYNC |
|---|---|---|---|---|---|
| library fp8 default | 254 | 840 | 128 | 152 | 10 |
| probe std | 227 | 835 | 128 | 131 | 10 |
| probe vt | 113 | 611 | 0 | 121 | 10 |
| probe wbstd | 168 | 702 | 128 | 1 | 4 |
| probe wbvt | 176 | 488 | 0 | 0 | 4 |
| library ``warp_slices`` (removed) | 176 | 718 | 128 | 3 | 4 |

| probe pair | 116 | 604 | 0 | 69 | 10 |
| probe wbpair | 180 | 538 | 0 | 0 | 4 |

``pair`` reads V in the library's layout as int16 pairs of bytes (columns 2c and 2c+1 of a token):
Triton loads them with the transposing ``LDSM.16.MT88.4`` (8 per tile) into V's dot-operand layout,
where each register holds tokens t and t+1 of one pair; inline PTX (the library's ``_split_pairs``) gathers the
low bytes and the high bytes with two ``PRMT`` and widens each by one ``F2FP``, and ``P V`` runs as
two dots over the even and the odd columns (stored interleaved). No byte-wise shared loads, half
the registers of ``std``.

(``vt`` reads V with ``LDSM`` and still converts every element, 128 ``F2FP`` per tile; the
``IMAD.MOV`` of the unsliced kernels copy the ``Q`` and ``P`` operands reloaded from shared memory
into ``HMMA`` register quads.) Timings (H100, 2026-12-07): ``benchmarks/README.md``.

Rows per shape (GQA 32/8, d=128, block size 16, random page order), timed in round-robin rounds:
SDPA cuDNN on a contiguous bf16 cache; the library's bf16 default and fp8 decode at the planner's
split counts (with their combine) in the configurations of ``LIB_VARIANTS``: byte-wise (``bytes``,
the default before 2026-12-07), V as byte pairs under a 128-register cap (``vpr128``, the default
of 2026-12-07) and its 96-register and tile variants, and bf16 under a 128-register cap
(``BF16_VARIANTS``; four or five programs per SM; K as byte pairs and shared K/V offsets were timed
here too on 2026-12-07, and removed from the library since); the probe kernels of ``PROBE_VARIANTS`` (the other modes above were
timed on an H100 on 2026-12-07 and are dropped from the default list) at the fp8 planner's split
count. ``ratio_bf16`` is the library bf16 row's time over the row's time (sequences x tokens / s).

Dynamic chunks (``PROBE=pair,pairdyn4,pairdyn4f4,...``, 2026-12-07 evening): every implementation,
cuDNN included, reads a launch of 0.5-1 GB (b1/128k, b64/4k) 12-20 us slower than its large-batch
rate predicts, and at b1/128k that fixed cost is what holds fp8 under 1.8x the bf16 kernel. Part of
it may be the uneven finish of one wave of equal programs. ``pairdyn<C>`` gives the programs of one
(sequence, KV head) chunks of ``C`` tiles from an atomic counter instead of equal splits, so a program
that reads faster takes more chunks; ``f<P>`` sizes the grid to ``P`` programs per SM (b1/128k
``f4``: 66 programs per KV head, 528 in all, where equal splits must divide the context; b64/4k
``f8``: two programs per sequence and KV head, the second wave helping the first). H100 (2026-12-07
evening, triton 3.6, x the bf16 default in the same run; static ``pair`` first): b1/128k 1.84 against
1.76 (``pairdyn4``, 64 programs per KV head), 1.77 (``pairdyn4f4``, 66), 1.78 (``pairdyn2f4``), 1.77
(``pairdyn4f8``, 132); b32/32k (2 programs per sequence and KV head) 1.91 against 1.90 / 1.89 /
1.88 for chunks of 4 / 8 / 16 tiles; b64/4k 1.86 against 1.89 (``pairdyn4``, one program each: no
one to share with), 1.84 (``pairdyn4f8``, two programs); b256/4k 1.87 against 1.88. So claiming
chunks never paid where programs share work (the fixed cost is not an uneven finish); where each
program has its own (sequence, KV head) the chunked loop alone read 0.5-1.9% faster: perhaps the
loop's shape (a peeled tile and a pipeline prologue per chunk), which the library's kernel does not
have. Not ported.
``pairchunk<C>`` isolates that shape: static splits walked as an outer loop over chunks of ``C`` tiles
around an inner loop of ``C`` (no counter). Timed on an H200 (2026-12-07 night, be62ec5, triton
3.6, ``PROBE=pair,pairchunk4,pairchunk8,pairdyn4 SHAPES=64:4096:0,256:4096:0,1:131072:0``; ms,
static ``pair`` / ``pairchunk4`` / ``pairchunk8`` / ``pairdyn4``): b64/4k 0.1418 / 0.1433 / 0.1419 /
0.1425, b256/4k 0.5255 / 0.5317 / 0.5278 / 0.5327, b1/128k 0.0795 / 0.0789 / 0.0793 / 0.0826. No
shape gains more than 0.8% (b1/128k ``pairchunk4``), and there ``pairdyn4`` at one program per
(sequence, KV head) is no faster than static splits: the H100's 0.5-1.9% did not repeat, so the
library's loop keeps its shape. Offline sm_90 SASS (triton 3.6,
pair tiles): static 121 registers and one 604-instruction tile loop; ``pairchunk4`` 118 registers,
the same inner loop (three of a chunk's four tiles) and a 704-instruction outer body (the chunk's
last tile, peeled, with the next chunk's first loads); ``pairdyn4`` 125 registers, 616 + 740. All
four programs per SM, the same 40 KiB of shared memory.

Run on the GPU: ``cd benchmarks/probes && PYTHONPATH=../../src:. python decode_fp8_bound.py [out.json]``
(``SHAPES=32:32768:0,...`` for fewer shapes; ``SHAPES=64:4096:2/4`` adds the fp8 rows and the bf16
default at 2 and 4 splits; ``LIB=vpr128,bytes`` narrows the fp8 variants); ``DEV=cpu TRITON_INTERPRET=1 ... --tiny``
checks the script on a CPU.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
import triton
import triton.language as tl
from decode_page_order import SHAPE, run_probe, table_case, tables, time_rows
from torch import Tensor

from flashpage.ops.cache_write import fp8_kv_scales
from flashpage.ops.launch_cache import KERNEL_OPTIONS
from flashpage.ops.paged_kernel import split_pairs
from flashpage.ops.paged_launch import default_decode_config
from flashpage.ops.paged_plan import plan_decode, run_decode

BLOCK_N = 128
# Library configurations timed beside the defaults (fields replaced in default_decode_config).
_VPR128: dict[str, Any] = {"v_pairs": True, "maxnreg": 128}
LIB_VARIANTS: dict[str, dict[str, Any]] = {
    "bytes": {"v_pairs": False, "maxnreg": 0},
    "vpr128": _VPR128,
    "vpr96": {"v_pairs": True, "maxnreg": 96},
    # the default's pairs and cap with 64-token tiles, and / or 5 stages (two tiles in flight)
    "vpr128n64": {**_VPR128, "block_n": 64},
    "vpr128n64s5": {**_VPR128, "block_n": 64, "num_stages": 5},
    "vpr128s5": {**_VPR128, "num_stages": 5},
    # the next tile's block ids loaded one iteration ahead
    "vpr128pt": {**_VPR128, "prefetch_table": True},
}
# bf16 configurations timed beside the bf16 default.
BF16_VARIANTS: dict[str, dict[str, Any]] = {"r128": {"maxnreg": 128}}
# (V layout, warps, stages, maxnreg) of the probe kernel's rows.
PROBE_VARIANTS = (("pair", 4, 2, 0),)


def probe_variants() -> list[tuple[str, int, int, int]]:
    """``PROBE_VARIANTS``, or the modes of ``PROBE=pair,pairchunk4,pairdyn4,pairdyn2f4`` (4 warps, 2 stages, no
    register cap)."""
    env = os.environ.get("PROBE")
    return [(m, 4, 2, 0) for m in env.split(",") if m] if env else list(PROBE_VARIANTS)


def parse_probe_mode(mode: str) -> tuple[str, int, int, int]:
    """``(kernel mode, chunk, programs per SM, chunk loop)`` of a probe mode: ``pair`` static splits
    (the fp8 planner's count); ``pairdyn<C>`` the same number of programs per (sequence, KV head)
    claiming chunks of ``C`` tiles; ``pairdyn<C>f<P>`` with ``P`` programs per SM in all (at least
    one per sequence and KV head) instead; ``pairchunk<C>`` static splits walked in chunks of ``C``
    tiles."""
    if "chunk" in mode:
        base, c = mode.split("chunk")
        return base, 0, 0, int(c)
    if "dyn" not in mode:
        return mode, 0, 0, 0
    base, rest = mode.split("dyn")
    chunk, _, per_sm = rest.partition("f")
    return base, int(chunk), int(per_sm or 0), 0


@triton.jit
def _fp8_tile(s, q, acc, acc_e, acc_o, l_i, m_i, K, V, VT, bt, kvh, qk_scale,
              stride_kb, stride_kt, stride_kh, stride_vtb, stride_vth,
              BLOCK_N: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, V_MODE: tl.constexpr,
              ASM: tl.constexpr):  # fmt: skip
    """One ``BLOCK_N``-token tile from token ``s`` folded into the online-softmax state."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    offs_c = tl.arange(0, D // 2)
    j = s + offs_n
    blk = tl.load(bt + j // PAGE)
    k = tl.load(K + (blk * stride_kb + (j % PAGE) * stride_kt + kvh * stride_kh)[:, None] + offs_d[None, :])
    if V_MODE == 2:  # V as int16 pairs of bytes (strides halved by the launcher)
        v = tl.load(
            V
            + (blk * (stride_kb // 2) + (j % PAGE) * (stride_kt // 2) + kvh * (stride_kh // 2))[:, None]
            + offs_c[None, :]
        )
    elif V_MODE == 1:
        col = tl.max_contiguous(tl.multiple_of(blk * stride_vtb + j % PAGE, PAGE), PAGE)
        vt = tl.load(VT + kvh * stride_vth + offs_d[:, None] * PAGE + col[None, :])
        v = tl.trans(vt)
    else:
        v = tl.load(
            V + (blk * stride_kb + (j % PAGE) * stride_kt + kvh * stride_kh)[:, None] + offs_d[None, :]
        )
    qk = tl.dot(q, tl.trans(k.to(tl.float16))) * qk_scale
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    p = tl.exp2(qk - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    if V_MODE == 2:
        ve, vo = split_pairs(v, ASM)
        pf = p.to(tl.float16)
        acc_e = acc_e * alpha[:, None] + tl.dot(pf, ve)
        acc_o = acc_o * alpha[:, None] + tl.dot(pf, vo)
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), v.to(tl.float16))
    return acc, acc_e, acc_o, l_i, m_new


@triton.jit
def _fp8_decode(Q, K, V, VT, MidO, MidLse, BT, Ctr, qk_scale, v_scale, ctx, num_splits, epoch,
                stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_vtb, stride_vth, stride_btb,
                G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
                PAGE: tl.constexpr, V_MODE: tl.constexpr, ASM: tl.constexpr, DYN: tl.constexpr,
                CHUNK: tl.constexpr):  # fmt: skip
    """``DYN = 0``: split ``program_id(1)`` of ``num_splits`` takes the ``ctx / num_splits`` tokens
    of its index, in one loop over its tiles or (``CHUNK = c``) in an outer loop over chunks of ``c``
    tiles around an inner loop of ``c`` (a trip count the compiler knows: the loop shape of ``DYN``
    without its counter). ``DYN = c``: the programs of one (sequence, KV head) take chunks of ``c`` tiles in
    turn from an atomic counter (``Ctr``, minus ``epoch``: the counts earlier launches left there)
    until none is left, the next chunk claimed before the current one's tiles: a program that
    reads faster takes more chunks, so the programs of a wave finish within about one chunk of
    each other. Decode attention needs no token order within a split, so any set of chunks can
    fold into one partial."""
    kvh = tl.program_id(0)
    split = tl.program_id(1)
    b = tl.program_id(2)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    row_ok = offs_m < G
    head = kvh * G + offs_m
    q = tl.load(
        Q + b * stride_qb + head[:, None] * stride_qh + offs_d[None, :], mask=row_ok[:, None], other=0.0
    )
    q = q.to(tl.float16)
    bt = BT + b * stride_btb
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    acc_e = tl.zeros([BLOCK_M, D // 2], dtype=tl.float32)  # pair mode: even / odd V columns
    acc_o = tl.zeros([BLOCK_M, D // 2], dtype=tl.float32)
    offs_c = tl.arange(0, D // 2)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    if DYN:
        n_chunks = ctx // (DYN * BLOCK_N)
        ctr = Ctr + b * tl.num_programs(0) + kvh
        c = tl.atomic_add(ctr, 1, sem="relaxed") - epoch
        while c < n_chunks:
            c_next = tl.atomic_add(ctr, 1, sem="relaxed") - epoch
            lo = c * (DYN * BLOCK_N)
            for s in range(lo, lo + DYN * BLOCK_N, BLOCK_N):
                acc, acc_e, acc_o, l_i, m_i = _fp8_tile(
                    s, q, acc, acc_e, acc_o, l_i, m_i, K, V, VT, bt, kvh, qk_scale,
                    stride_kb, stride_kt, stride_kh, stride_vtb, stride_vth, BLOCK_N, D, PAGE, V_MODE, ASM,
                )  # fmt: skip
            c = c_next
    elif CHUNK:
        per = ctx // num_splits
        lo = split * per
        for c0 in range(lo, lo + per, CHUNK * BLOCK_N):
            for s in range(c0, c0 + CHUNK * BLOCK_N, BLOCK_N):
                acc, acc_e, acc_o, l_i, m_i = _fp8_tile(
                    s, q, acc, acc_e, acc_o, l_i, m_i, K, V, VT, bt, kvh, qk_scale,
                    stride_kb, stride_kt, stride_kh, stride_vtb, stride_vth, BLOCK_N, D, PAGE, V_MODE, ASM,
                )  # fmt: skip
    else:
        per = ctx // num_splits
        lo = split * per
        for s in range(lo, lo + per, BLOCK_N):
            acc, acc_e, acc_o, l_i, m_i = _fp8_tile(
                s, q, acc, acc_e, acc_o, l_i, m_i, K, V, VT, bt, kvh, qk_scale,
                stride_kb, stride_kt, stride_kh, stride_vtb, stride_vth, BLOCK_N, D, PAGE, V_MODE, ASM,
            )  # fmt: skip
    nsp = tl.num_programs(1)
    base = (b * tl.num_programs(0) * G + head) * nsp + split
    seen = l_i > 0.0  # a dynamic program may find every chunk taken
    l_div = tl.where(seen, l_i, 1.0)
    if V_MODE == 2:
        o_row = MidO + base[:, None] * D + 2 * offs_c[None, :]
        tl.store(o_row, acc_e / l_div[:, None] * v_scale, mask=row_ok[:, None])
        tl.store(o_row + 1, acc_o / l_div[:, None] * v_scale, mask=row_ok[:, None])
    else:
        tl.store(
            MidO + base[:, None] * D + offs_d[None, :], acc / l_div[:, None] * v_scale, mask=row_ok[:, None]
        )
    tl.store(MidLse + base, tl.where(seen, m_i + tl.log2(l_div), float("-inf")), mask=row_ok)


@triton.jit
def _fp8_decode_wb(Q, K, V, VT, MidO, MidLse, BT, qk_scale, v_scale, ctx, num_splits,
                   stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_vtb, stride_vth, stride_btb,
                   G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
                   PAGE: tl.constexpr, V_MODE: tl.constexpr, NW: tl.constexpr, ASM: tl.constexpr):  # fmt: skip
    """``_fp8_decode`` with the tile cut into ``NW`` slices of ``BLOCK_N // NW`` tokens, one per
    warp (a 3-D ``tl.dot`` whose batch is the slice): each slice keeps its own softmax statistics
    and accumulator, so no tile needs a cross-warp reduction or an exchange of P through shared
    memory; the slices merge once, after the loop."""
    kvh = tl.program_id(0)
    split = tl.program_id(1)
    b = tl.program_id(2)
    TN: tl.constexpr = BLOCK_N // NW
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    offs_d3 = offs_d[None, None, :]
    tok3 = tl.arange(0, NW)[:, None] * TN + tl.arange(0, TN)[None, :]  # (NW, TN) token of the tile
    row_ok = offs_m < G
    head = kvh * G + offs_m
    q = tl.load(
        Q + b * stride_qb + head[:, None] * stride_qh + offs_d[None, :], mask=row_ok[:, None], other=0.0
    )
    q3 = tl.broadcast_to(q.to(tl.float16)[None, :, :], [NW, BLOCK_M, D])
    per = ctx // num_splits
    lo = split * per
    bt = BT + b * stride_btb
    acc = tl.zeros([NW, BLOCK_M, D], dtype=tl.float32)
    acc_e = tl.zeros([NW, BLOCK_M, D // 2], dtype=tl.float32)
    acc_o = tl.zeros([NW, BLOCK_M, D // 2], dtype=tl.float32)
    offs_c3 = tl.arange(0, D // 2)[None, None, :]
    l_i = tl.zeros([NW, BLOCK_M], dtype=tl.float32)
    m_i = tl.full([NW, BLOCK_M], float("-inf"), dtype=tl.float32)
    for s in range(lo, lo + per, BLOCK_N):
        j = s + tok3
        blk = tl.load(bt + j // PAGE)
        row = blk * stride_kb + (j % PAGE) * stride_kt + kvh * stride_kh
        k = tl.load(K + row[:, :, None] + offs_d3)
        if V_MODE == 2:
            row2 = blk * (stride_kb // 2) + (j % PAGE) * (stride_kt // 2) + kvh * (stride_kh // 2)
            v = tl.load(V + row2[:, :, None] + offs_c3)
        elif V_MODE == 1:
            col = tl.max_contiguous(tl.multiple_of(blk * stride_vtb + j % PAGE, [1, PAGE]), [1, PAGE])
            v = tl.permute(tl.load(VT + kvh * stride_vth + offs_d3 * PAGE + col[:, :, None]), (0, 1, 2))
        else:
            v = tl.load(V + row[:, :, None] + offs_d3)
        qk = tl.dot(q3, tl.permute(k.to(tl.float16), (0, 2, 1))) * qk_scale  # (NW, BLOCK_M, TN)
        m_new = tl.maximum(m_i, tl.max(qk, 2))
        p = tl.exp2(qk - m_new[:, :, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 2)
        if V_MODE == 2:
            ve, vo = split_pairs(v, ASM)
            pf = p.to(tl.float16)
            acc_e = acc_e * alpha[:, :, None] + tl.dot(pf, ve)
            acc_o = acc_o * alpha[:, :, None] + tl.dot(pf, vo)
        else:
            acc = acc * alpha[:, :, None] + tl.dot(p.to(tl.float16), v.to(tl.float16))
        m_i = m_new
    m = tl.max(m_i, 0)
    w = tl.exp2(m_i - m[None, :])
    lsum = tl.sum(l_i * w, 0)
    nsp = tl.num_programs(1)
    base = (b * tl.num_programs(0) * G + head) * nsp + split
    if V_MODE == 2:
        o_row = MidO + base[:, None] * D + 2 * tl.arange(0, D // 2)[None, :]
        o_e = tl.sum(acc_e * w[:, :, None], 0) / lsum[:, None] * v_scale
        o_o = tl.sum(acc_o * w[:, :, None], 0) / lsum[:, None] * v_scale
        tl.store(o_row, o_e, mask=row_ok[:, None])
        tl.store(o_row + 1, o_o, mask=row_ok[:, None])
    else:
        o = tl.sum(acc * w[:, :, None], 0) / lsum[:, None] * v_scale
        tl.store(MidO + base[:, None] * D + offs_d[None, :], o, mask=row_ok[:, None])
    tl.store(MidLse + base, m + tl.log2(lsum), mask=row_ok)


def fp8_decode(
    q: Tensor, k8: Tensor, v8: Tensor, vt8: Tensor, bt: Tensor, ctx: int, splits: int,
    k_scale: float, v_scale: float, mid: tuple[Tensor, Tensor], mode: str, warps: int = 4, stages: int = 2, maxnreg: int = 0,
    dyn: tuple[int, Tensor, list[int]] | None = None, chunk_loop: int = 0,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """Partial outputs ``(b, h, splits, d)`` float32 and base-2 LSEs ``(b, h, splits)`` of a decode of
    ``q (b, h, d)`` over fp8 caches (one scale per cache here) with ``splits`` equal splits; ``mode``
    ``[wb]std|vt|pair``: V from ``v8``, from its token-contiguous copy ``vt8``, or from ``v8`` read as
    int16 byte pairs split into even and odd columns (``_split_pairs``); ``wb`` one slice per warp.
    ``dyn = (chunk, counters, launches)``: ``splits`` programs per (sequence, KV head) claim chunks of
    ``chunk`` tiles from ``counters`` (int32 ``(b, nheads_k)``, zero before the first launch);
    ``launches[0]`` counts the launches so far (each adds ``ctx / (chunk * BLOCK_N) + splits`` to
    every counter). ``chunk_loop = c``: static splits walked in chunks of ``c`` tiles."""
    b, h, d = q.shape
    hk, page = k8.shape[2], k8.shape[1]
    mo, ml = mid
    chunk, ctr, launches = dyn if dyn else (0, ml, [0])  # static launches never read the counters
    # Dynamic chunks need whole chunks only (any program count); static splits whole tiles (chunks).
    step = chunk * BLOCK_N if chunk else splits * BLOCK_N * max(1, chunk_loop)
    assert ctx % step == 0, (ctx, splits, chunk, chunk_loop)
    qk_scale = d**-0.5 * k_scale * 1.4426950408889634
    wb = mode.startswith("wb")
    v_mode = 2 if mode.endswith("pair") else int(mode.endswith("vt"))
    v_arg = v8.view(torch.int16) if v_mode == 2 else v8  # byte pairs: strides halved in the kernel
    kernel, extra = (
        (_fp8_decode_wb, {"NW": warps}) if wb else (_fp8_decode, {"DYN": chunk, "CHUNK": chunk_loop})
    )
    assert not (wb and (chunk or chunk_loop)), "chunks: the unsliced kernel only"
    if maxnreg:
        extra["maxnreg"] = maxnreg
    ctr_args = () if wb else (ctr,)
    epoch_args = () if wb else (launches[0] * (ctx // (chunk * BLOCK_N) + splits) if chunk else 0,)
    launches[0] += 1
    kernel[(hk, splits, b)](
        q, k8, v_arg, vt8, mo, ml, bt, *ctr_args, qk_scale, v_scale, ctx, splits, *epoch_args,
        q.stride(0), q.stride(1), k8.stride(0), k8.stride(1), k8.stride(2), vt8.stride(0), vt8.stride(1),
        bt.stride(0), G=h // hk, BLOCK_M=16, BLOCK_N=BLOCK_N, D=d, PAGE=page, V_MODE=v_mode,
        ASM=q.is_cuda,
        num_warps=warps, num_stages=stages, **extra, **KERNEL_OPTIONS,
    )  # fmt: skip
    return mo, ml


def merge(mo: Tensor, ml: Tensor) -> Tensor:
    """``(b, h, d)`` output of the partials ``mo (b, h, s, d)`` with base-2 LSEs ``ml (b, h, s)``."""
    w = torch.softmax(ml * 0.6931471805599453, dim=-1)
    return (mo * w[..., None]).sum(2)


def probe_shape(
    b: int,
    ctx: int,
    split_list: tuple[int, ...],
    dev: torch.device,
    gen: torch.Generator,
    tiny: bool,
    bench: Callable[[Callable[[], Any]], float],
) -> list[dict[str, Any]]:
    """Rows of one ``(batch, ctx)`` shape: every row at the planner's split count, plus the fp8
    variants of ``LIB`` (default: all) and the bf16 default again at each count of ``split_list``."""
    del tiny
    h, hk, d, bs = SHAPE
    dt, f8 = torch.bfloat16, torch.float8_e4m3fn
    kc = torch.randn(b * ctx // bs, bs, hk, d, device=dev, dtype=dt)
    vc = torch.randn_like(kc)
    seqlens = torch.full((b,), ctx, dtype=torch.int32, device=dev)
    q = torch.randn(b, h, d, device=dev, dtype=dt)
    ks, vs = fp8_kv_scales(kc), fp8_kv_scales(vc)
    # One scale for the whole cache in the probe kernel: the library's per-head scales set to their max.
    ks, vs = ks.max().expand(hk).contiguous(), vs.max().expand(hk).contiguous()
    k8 = (kc / ks[0]).clamp(-448, 448).to(f8)
    v8 = (vc / vs[0]).clamp(-448, 448).to(f8)
    vt8 = v8.permute(0, 2, 3, 1).contiguous()  # (num_blocks, hk, d, page): tokens contiguous
    rows: list[tuple[dict[str, Any], Callable[[], Any]]] = []
    t = tables(b, ctx, bs, gen)["rand"]
    bt, ref, _ = table_case(q, kc, vc, t, rows)  # adds the cudnn row (bf16, contiguous) on CUDA
    kd = (k8[t.to(dev)].to(dt) * ks[0].to(dt)).reshape(b, ctx, hk, d).transpose(1, 2)
    vd = (v8[t.to(dev)].to(dt) * vs[0].to(dt)).reshape(b, ctx, hk, d).transpose(1, 2)
    ref8 = torch.nn.functional.scaled_dot_product_attention(q.unsqueeze(2), kd, vd, enable_gqa=True)[:, :, 0]
    del kd, vd

    def lib(kv: str, variant: str = "default", splits: int = 0) -> tuple[dict[str, Any], Callable[[], Any]]:
        fp8 = kv == "fp8"
        cfg = default_decode_config(f8 if fp8 else dt, d)
        if variant != "default":
            cfg = replace(cfg, **(LIB_VARIANTS if fp8 else BF16_VARIANTS)[variant])
        plan = plan_decode(b, h, hk, d, block_size=bs, max_seqlen_k=ctx, q_dtype=dt, device=dev,
                           kv_dtype=f8 if fp8 else None, config=cfg, num_splits=splits)  # fmt: skip
        if fp8:
            fn = lambda: run_decode(plan, q, k8, v8, bt, seqlens, k_scale=ks, v_scale=vs)
            err = (fn().float() - ref8.float()).abs().max().item()
            assert err < 5e-2, ("lib fp8", variant, err)
        else:
            fn = lambda: run_decode(plan, q, kc, vc, bt, seqlens)
            err = (fn().float() - ref).abs().max().item()
            assert err < 2e-2, ("lib bf16", variant, err)
        return {"impl": "lib", "kv": kv, "variant": variant, "splits": plan.num_splits}, fn

    # fp8 variants spell out every field they compare, whichever the default is (the planner's
    # split count is the same: fp8 programs own one KV head either way).
    fp8_variants = [v for v in os.environ.get("LIB", ",".join(LIB_VARIANTS)).split(",") if v]
    lib_rows = (
        ("bf16", "default", 0),
        *(("fp8", v, 0) for v in fp8_variants),
        *(("bf16", v, 0) for v in BF16_VARIANTS),
        *(("fp8", v, s) for s in split_list if s > 0 for v in fp8_variants),
        *(("bf16", "default", s) for s in split_list if s > 0),
    )
    for kv, variant, n in lib_rows:
        try:  # a variant that fails to build or to match is reported, not timed
            rows.append(lib(kv, variant, n))
        except Exception as exc:
            print(
                f"b{b}/{ctx} lib {kv} {variant} s{n} skipped: {type(exc).__name__}: {exc}"[:400], flush=True
            )
    splits = next(r["splits"] for r, _ in rows if r.get("kv") == "fp8")
    while ctx % (splits * BLOCK_N):
        splits //= 2
    sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 4
    for mode, warps, stages, nreg in probe_variants():
        base_mode, chunk, per_sm, chunk_loop = parse_probe_mode(mode)
        n_prog = max(1, per_sm * sms // (b * hk)) if per_sm else splits
        if chunk:
            chunk = min(chunk, ctx // BLOCK_N)
        mid = (
            torch.empty(b, h, n_prog, d, device=dev, dtype=torch.float32),
            torch.empty(b, h, n_prog, device=dev, dtype=torch.float32),
        )
        dyn = (chunk, torch.zeros(b, hk, dtype=torch.int32, device=dev), [0]) if chunk else None
        args = (q, k8, v8, vt8, bt, ctx, n_prog, ks[0].item(), vs[0].item(), mid, base_mode, warps, stages, nreg,
                dyn, chunk_loop)  # fmt: skip
        try:  # a probe kernel that fails to build or to match is reported, not timed
            fp8_decode(*args)  # the second launch checks the dynamic counters' epoch too
            err = (merge(*fp8_decode(*args)) - ref8.float()).abs().max().item()
        except Exception as exc:
            err, why = float("inf"), f"{type(exc).__name__}: {exc}"[:300]
        else:
            why = f"max error {err:.3g}"
        if not err < 5e-2:
            print(f"b{b}/{ctx} probe {mode} w{warps} r{nreg} skipped: {why}", flush=True)
            continue
        label = {
            "impl": "probe",
            "kv": "fp8",
            "variant": f"{mode}w{warps}s{stages}" + (f"r{nreg}" if nreg else ""),
            "splits": n_prog,
        }
        rows.append((label, lambda args=args: fp8_decode(*args)))
    kv_bytes = 2 * b * ctx * hk * d * 2  # bf16 bytes: TB/s columns in bf16-equivalent units
    out = time_rows(rows, b, ctx, kv_bytes, bench, False)
    t_bf16 = next((r["ms"] for r in out if r.get("kv") == "bf16" and r.get("variant") == "default"), None)
    for r in out:
        if t_bf16:
            r["ratio_bf16"] = round(t_bf16 / r["ms"], 3)
    print(
        [(r.get("impl"), r.get("kv"), r.get("variant"), r.get("splits"), r.get("ratio_bf16")) for r in out],
        flush=True,
    )
    return out


def main() -> None:
    run_probe(
        probe_shape, [(32, 32768, ()), (64, 4096, ()), (256, 4096, ()), (1, 131072, ())], "decode_fp8_bound"
    )


if __name__ == "__main__":
    main()
