"""Baseline for ``flashpage bench attention``: the Triton tutorial's FlashAttention-2 forward.

A re-implementation of the algorithm of Triton's ``06-fused-attention`` tutorial (forward only) so the
benchmark can time "a plain Triton FA2 kernel" in the same run as flashpage: contiguous
``(batch, nheads, seqlen, d)`` tensors seen as ``(batch * nheads * seqlen, d)`` rows, K/V tiles
through TMA tensor descriptors where Triton and the GPU have them (pointer loads otherwise), online
softmax in base 2 with the scale folded into one multiply, causal masking as the tutorial does it: a
mask-free loop over the tiles left of the diagonal, then a masked loop over the diagonal tile.

Against flashpage's kernel it differs in the layout (flashpage reads flash-attn's ``(batch, seqlen,
nheads, d)``, whose rows of one head are ``nheads * d`` elements apart) and in having none of the
features (GQA, windows, softcap, ALiBi, dropout, varlen, LSE, masks for ragged lengths): it needs
``seqlen`` to be a multiple of both tile sizes and a power-of-two head dim.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from flashpage.ops.flash_fwd import make_row_descriptor
from flashpage.ops.launch_cache import KERNEL_OPTIONS
from flashpage.ops.utils import tma_supported

__all__ = ["TUTORIAL_CONFIGS", "tutorial_attention"]

# (BLOCK_M, BLOCK_N, num_warps, num_stages): the tutorial's Hopper autotuning space, narrowed to the
# two tiles that win it at d <= 128; d = 256 uses 64-key tiles (the 128 x 128 accumulators do not fit).
TUTORIAL_CONFIGS: dict[int, list[tuple[int, int, int, int]]] = {
    64: [(128, 128, 8, 3), (128, 64, 4, 3)],
    128: [(128, 128, 8, 3), (128, 64, 4, 3)],
    256: [(128, 64, 8, 2), (64, 64, 4, 2)],
}


@triton.jit
def _load(desc, ptr, row, offs_r, offs_d, D: tl.constexpr, USE_TMA: tl.constexpr):
    if USE_TMA:
        return desc.load([row, 0])
    return tl.load(ptr + (row + offs_r)[:, None] * D + offs_d[None, :])


@triton.jit
def _tiles(acc, l_i, m_i, q, desc_k, desc_v, K, V, row0, lo, hi, offs_m, qk_scale,
           D: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, USE_TMA: tl.constexpr):  # fmt: skip
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    for n0 in range(lo, hi, BLOCK_N):
        n0 = tl.multiple_of(n0, BLOCK_N)
        k = _load(desc_k, K, row0 + n0, offs_n0, offs_d, D, USE_TMA)
        qk = tl.dot(q, tl.trans(k))
        if MASKED:
            qk = tl.where(offs_m[:, None] >= (n0 + offs_n0)[None, :], qk * qk_scale, -1.0e6)
            m_ij = tl.maximum(m_i, tl.max(qk, 1))
            p = tl.math.exp2(qk - m_ij[:, None])
        else:
            m_ij = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            p = tl.math.exp2(qk * qk_scale - m_ij[:, None])
        alpha = tl.math.exp2(m_i - m_ij)
        l_ij = tl.sum(p, 1)
        acc = acc * alpha[:, None]
        v = _load(desc_v, V, row0 + n0, offs_n0, offs_d, D, USE_TMA)
        acc = tl.dot(p.to(v.dtype), v, acc)
        l_i = l_i * alpha + l_ij
        m_i = m_ij
    return acc, l_i, m_i


@triton.jit
def _tutorial_fwd_kernel(desc_q, desc_k, desc_v, Q, K, V, O, seqlen, qk_scale,
                         D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         CAUSAL: tl.constexpr, USE_TMA: tl.constexpr):  # fmt: skip
    pid_m = tl.program_id(0)
    row0 = tl.program_id(1) * seqlen  # first row of this (batch, head)
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    q = _load(desc_q, Q, row0 + m0, tl.arange(0, BLOCK_M), offs_d, D, USE_TMA)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32) + 1.0  # the tutorial's start: exp2(-inf) * 1 = 0
    hi = m0 if CAUSAL else seqlen
    acc, l_i, m_i = _tiles(acc, l_i, m_i, q, desc_k, desc_v, K, V, row0, 0, hi, offs_m, qk_scale,
                           D, BLOCK_N, False, USE_TMA)  # fmt: skip
    if CAUSAL:
        acc, l_i, m_i = _tiles(acc, l_i, m_i, q, desc_k, desc_v, K, V, row0, m0, m0 + BLOCK_M, offs_m,
                               qk_scale, D, BLOCK_N, True, USE_TMA)  # fmt: skip
    out = acc / l_i[:, None]
    tl.store(O + (row0 + offs_m)[:, None] * D + offs_d[None, :], out.to(O.dtype.element_ty))


def tutorial_attention(
    q: Tensor, k: Tensor, v: Tensor, causal: bool, config: tuple[int, int, int, int]
) -> Tensor:
    """``softmax(q k^T / sqrt(d)) v`` for contiguous ``(batch, nheads, seqlen, d)`` q/k/v (one dtype).

    ``config = (BLOCK_M, BLOCK_N, num_warps, num_stages)``; ``seqlen`` must be a multiple of both tile
    sizes (and of ``BLOCK_M`` a multiple of ``BLOCK_N`` when causal). Returns ``(batch, nheads,
    seqlen, d)``.
    """
    bm, bn, warps, stages = config
    b, h, s, d = q.shape
    if k.shape != q.shape or v.shape != q.shape or not all(t.is_contiguous() for t in (q, k, v)):
        raise ValueError(
            "tutorial_attention takes contiguous q, k, v of one (batch, nheads, seqlen, d) shape"
        )
    if s % bm or s % bn or bm % bn or d & (d - 1):
        raise ValueError(f"seqlen {s} must be a multiple of the {bm} x {bn} tiles, d={d} a power of two")
    out = torch.empty_like(q)
    # (rows, 1 head, d): flashpage's packed row view, so its TMA descriptor helper applies.
    rows = [t.view(b * h * s, 1, d) for t in (q, k, v)]
    use_tma = tma_supported(q.device)
    descs: list[Any] = list(rows)
    if use_tma:
        descs = [make_row_descriptor(t, True, blk, d) for t, blk in zip(rows, (bm, bn, bn))]
    _tutorial_fwd_kernel[(s // bm, b * h)](
        *descs, *rows, out, s, d**-0.5 * 1.4426950408889634,
        D=d, BLOCK_M=bm, BLOCK_N=bn, CAUSAL=causal, USE_TMA=use_tma, num_warps=warps, num_stages=stages, **KERNEL_OPTIONS,
    )  # fmt: skip
    return out
