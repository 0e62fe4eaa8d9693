"""Triton math shared by the attention kernels (flash forward/backward, paged attention).

Every helper is a ``@triton.jit`` function inlined into its caller; none launches anything. Scores
are in base 2 (``exp2``), with the softmax scale and ``log2(e)`` folded into one multiplier.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = [
    "LN2",
    "LOG2E",
    "attn_scores",
    "dropout_keep",
    "key_range",
    "key_visible",
    "load_rows",
    "load_tile",
    "row_offset",
    "seq_bounds",
    "softmax_step",
    "tail_ws_offsets",
    "tanh_exp2",
]

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def tanh_exp2(x):
    """tanh via exp2: 1 - 2 / (exp(2x) + 1); exp2 overflow (inf) gives exactly +-1."""
    e = tl.math.exp2(x * 2.8853900817779268)  # 2 * log2(e)
    return 1.0 - 2.0 / (e + 1.0)


@triton.jit
def attn_scores(
    qk, qi, kj, off, qk_scale, cap_in, cap_out, slope2, SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr
):
    """Base-2 scores from raw dot products ``qk``; ``qi``/``kj`` broadcast to qk's shape (either
    orientation). Returns ``(s, t)``: ``t = tanh(...)`` of the softcap (for its derivative), else qk."""
    if SOFTCAP:
        t = tanh_exp2(qk * cap_in)  # cap_in = softmax_scale / softcap
        s = t * cap_out  # cap_out = softcap * log2(e)
    else:
        t = qk
        s = qk * qk_scale  # qk_scale = softmax_scale * log2(e)
    if HAS_ALIBI:
        s = s - slope2 * tl.abs((qi + off - kj).to(tl.float32))
    return s, t


@triton.jit
def key_visible(qi, kj, off, sq, sk, window_left, window_right,
             HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, CHECK_Q: tl.constexpr):  # fmt: skip
    """True where query ``qi`` may attend key ``kj`` (bottom-right aligned, ``off = sk - sq``)."""
    vis = kj < sk
    if CHECK_Q:
        vis = vis & (qi < sq)
    if HAS_RIGHT:
        vis = vis & (kj <= qi + off + window_right)
    if HAS_LEFT:
        vis = vis & (kj >= qi + off - window_left)
    return vis


@triton.jit
def dropout_keep(seed, rng_base, qi, kj, rng_sk, dropout_p):
    """Dropout keep mask of elements (qi, kj) of one (batch, head): tiling-independent philox."""
    idx = (rng_base + qi.to(tl.int64)) * rng_sk + kj
    return tl.rand(seed, idx) >= dropout_p


@triton.jit
def load_rows(ptr, desc, row, col, offs_r, offs_d, stride_r, r_lim,
               HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, MASK_R: tl.constexpr, USE_TMA: tl.constexpr):  # fmt: skip
    """A ``(len(offs_r), BLOCK_D)`` tile: TMA ``desc.load([row, col])`` or a (masked) pointer load of
    ``ptr + offs_r * stride_r + offs_d``. Out-of-range rows / padded columns read as zero."""
    if USE_TMA:
        x = desc.load([row, col])
    else:
        ptrs = ptr + offs_r[:, None] * stride_r + offs_d[None, :]
        if MASK_R:
            if HEAD_DIM == BLOCK_D:
                x = tl.load(ptrs, mask=offs_r[:, None] < r_lim, other=0.0)
            else:
                x = tl.load(ptrs, mask=(offs_r[:, None] < r_lim) & (offs_d[None, :] < HEAD_DIM), other=0.0)
        else:
            if HEAD_DIM == BLOCK_D:
                x = tl.load(ptrs)
            else:
                x = tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
    return x


@triton.jit
def seq_bounds(b, CU_Q, CU_K, seqlen_q, seqlen_k, VARLEN: tl.constexpr):
    """(first row of the sequence in the row-flattened tensor, its length) for q and k."""
    if VARLEN:
        q_start = tl.load(CU_Q + b)
        sq = tl.load(CU_Q + b + 1) - q_start
        k_start = tl.load(CU_K + b)
        sk = tl.load(CU_K + b + 1) - k_start
    else:
        q_start = b * seqlen_q
        sq = seqlen_q
        k_start = b * seqlen_k
        sk = seqlen_k
    return q_start, sq, k_start, sk


@triton.jit
def row_offset(start, b, stride_row, stride_batch, VARLEN: tl.constexpr):
    """int64 element offset of a sequence's first row: varlen ``start * stride_row`` (packed rows),
    padded batches ``b * stride_batch``."""
    if VARLEN:
        off = start.to(tl.int64) * stride_row
    else:
        off = b.to(tl.int64) * stride_batch
    return off


@triton.jit
def key_range(m0, sk, off, window_left, window_right,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):  # fmt: skip
    """Key tiles of the query tile at row ``m0``: ``(lo, fs, fe, hi)``, the visible range ``[lo, hi)``
    (bottom-right aligned causal / sliding window) and its mask-free middle ``[fs, fe)``, all in
    multiples of ``BLOCK_N`` except ``hi``."""
    lo = 0
    hi = sk
    if HAS_RIGHT:
        hi = tl.minimum(sk, m0 + BLOCK_M + off + window_right)
    if HAS_LEFT:
        lo = (tl.maximum(m0 + off - window_left, 0) // BLOCK_N) * BLOCK_N
    fs = lo
    if HAS_LEFT:
        fs = tl.maximum(lo, tl.cdiv(tl.maximum(m0 + BLOCK_M - 1 + off - window_left, 0), BLOCK_N) * BLOCK_N)
    fe_raw = sk
    if HAS_RIGHT:
        fe_raw = tl.minimum(sk, m0 + off + window_right + 1)
    fe = (tl.maximum(fe_raw, 0) // BLOCK_N) * BLOCK_N
    return lo, fs, fe, hi


@triton.jit
def tail_ws_offsets(slot, col0, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, COLS: tl.constexpr):
    """Element offsets of a tail workspace slot: ``acc (BLOCK_M, BLOCK_D)`` (its columns ``[col0,
    col0 + COLS)``) and ``m``, ``l`` (``(2, BLOCK_M)``: row max, then row sum)."""
    offs_r = tl.arange(0, BLOCK_M)
    offs_d = col0 + tl.arange(0, COLS)
    acc_offs = slot.to(tl.int64) * (BLOCK_M * BLOCK_D) + offs_r[:, None] * BLOCK_D + offs_d[None, :]
    m_offs = slot.to(tl.int64) * (2 * BLOCK_M) + offs_r
    return acc_offs, m_offs, m_offs + BLOCK_M


@triton.jit
def load_tile(ptrs, row_ok, d_ok, MASK_ROWS: tl.constexpr, EVEN_D: tl.constexpr):
    """Load a ``(..., rows, BLOCK_D)`` tile, masking rows and/or the padded head dim only when needed
    (``row_ok`` and ``d_ok`` already shaped to broadcast against ``ptrs``); masked elements read 0."""
    if MASK_ROWS:
        if EVEN_D:
            x = tl.load(ptrs, mask=row_ok, other=0.0)
        else:
            x = tl.load(ptrs, mask=row_ok & d_ok, other=0.0)
    else:
        if EVEN_D:
            x = tl.load(ptrs)
        else:
            x = tl.load(ptrs, mask=d_ok, other=0.0)
    return x


@triton.jit
def softmax_step(s, m_i, l_i, MASK: tl.constexpr, AXIS: tl.constexpr):
    """One online-softmax step over the keys on ``AXIS`` of the base-2 logits ``s``: returns ``(p,
    alpha, l_i, m_new)``; with ``MASK`` rows that have seen no key yet keep a zero reference, so a
    fully masked row gives ``p = 0`` instead of NaN."""
    m_new = tl.maximum(m_i, tl.max(s, AXIS))
    if MASK:
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
    else:
        m_use = m_new
    p = tl.exp2(s - tl.expand_dims(m_use, AXIS))
    alpha = tl.exp2(m_i - m_use)
    return p, alpha, l_i * alpha + tl.sum(p, AXIS), m_new
