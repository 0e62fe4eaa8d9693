"""FlashAttention forward: one fused Triton kernel (tiled QK^T, softcap, mask, ALiBi, online softmax,
dropout, PV, LSE), its launcher, input validation, and a small kernel that materialises the
attention probabilities for ``return_attn_probs``.

Layouts (flash-attn 2.x): padded batches ``q (batch, seqlen_q, nheads, d)``, ``k/v (batch, seqlen_k,
nheads_k, d)`` with ``lse (batch, nheads, seqlen_q)``; or packed varlen ``q (total_q, nheads, d)``,
``k/v (total_k, nheads_k, d)`` with ``cu_seqlens_q/k`` int32 ``(batch + 1,)`` and ``lse (nheads,
total_q)``. Query head ``h`` reads KV head ``h // (nheads // nheads_k)``. Only the last dim must be
contiguous; all other strides are passed to the kernel.

Kernel structure (grid ``(cdiv(max_seqlen_q, BLOCK_M), batch * nheads)``): a program owns ``BLOCK_M``
query rows of one (sequence, head). Scores are computed in base 2: ``log2(e) * softmax_scale`` is
folded into one multiply (or into the softcap's output scale), so the online softmax uses ``exp2``.
The visible key range of the tile (bottom-right aligned causal / sliding window) is split on the host
side of the loop into three parts: ``[lo, fs)`` tiles crossing the window's left edge (masked),
``[fs, fe)`` tiles every row sees entirely (the hot loop: no mask arithmetic, no bounds checks) and
``[fe, hi)`` the diagonal / right-window / sequence-end tiles (masked). Tiles wholly outside the
window are never visited. With causal masking the programs start with the heaviest (last) row tiles
of each head (not of all heads at once: the programs running together then share no K/V in L2). Padded unmasked problems
whose row tiles end in a partial wave split that wave's key ranges over all SMs (:class:`TailSplit`).

Masked rows: a query row with no visible key keeps ``m = -inf`` and ``l = 0``; it outputs zeros and
``lse = -inf`` (the reference's definition).

Dropout: element ``(b, h, i, j)`` is kept iff ``tl.rand(seed, ((b * nheads + h) * Sq + i) * Sk + j)
>= p`` (``Sq/Sk`` = the padded or max sequence lengths), a function of the element only, so the
forward, the backward and :func:`attention_probs` agree for any tiling. ``seed`` comes from torch's
default generator (see :mod:`flashpage.ops.flash_attn`).

TMA: with ``FwdConfig.use_tma`` (Hopper, power-of-two head dim, 16-byte aligned row strides) Q/K/V
tiles are loaded through 2-D host tensor descriptors over the ``(rows, nheads * d)`` view; rows past a
sequence's end read the neighbour's (finite) rows or TMA zero fill and are masked exactly like the
pointer path's out-of-range rows. The output is always stored with masked pointer stores.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from flashpage.ops.attn_math import (
    LN2,
    LOG2E,
    attn_scores,
    dropout_keep,
    key_range,
    key_visible,
    load_rows,
    row_offset,
    seq_bounds,
    tail_ws_offsets,
)
from flashpage.ops.backend import interpreter_enabled
from flashpage.ops.flash_configs import (
    BwdConfig,
    FwdConfig,
    autotune,
    autotune_enabled,
    fwd_candidates,
    fwd_config,
    padded_head_dim,
)
from flashpage.ops.launch_cache import KERNEL_OPTIONS, LaunchCache, Memo, aligned, int_spec, kernel_launches
from flashpage.ops.utils import cdiv, programs_per_sm, tma_supported, ws_supported

__all__ = [
    "AttnProblem",
    "TailSplit",
    "attention_probs",
    "check_attention_inputs",
    "flash_fwd",
    "fwd_uses_tma",
    "make_row_descriptor",
    "plan_tail_split",
    "tma_row_view_ok",
    "ws_applies",
]

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MIN_HEAD_DIM, MAX_HEAD_DIM = 8, 256


# ----------------------------------------------------------------------------------------------
# Forward kernel
# ----------------------------------------------------------------------------------------------
@triton.jit
def _fwd_tiles(
    acc, l_i, m_i, q, k_ptr, v_ptr, desc_k, desc_v, k_row0, kv_col,
    lo, hi, offs_m, offs_d, stride_kn, stride_vn, sq, sk, off,
    qk_scale, cap_in, cap_out, slope2, window_left, window_right,
    dropout_p, seed, rng_base, rng_sk,
    MASKED: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    DROPOUT: tl.constexpr, USE_TMA: tl.constexpr, PLAIN_SCORES: tl.constexpr, DOT_PREC: tl.constexpr,
):  # fmt: skip
    """Online-softmax over key tiles ``[lo, hi)``; ``MASKED=False`` tiles are fully visible."""
    offs_n0 = tl.arange(0, BLOCK_N)
    for n0 in range(lo, hi, BLOCK_N):
        n0 = tl.multiple_of(n0, BLOCK_N)
        offs_n = n0 + offs_n0
        k = load_rows(k_ptr, desc_k, k_row0 + n0, kv_col, offs_n, offs_d, stride_kn, sk,
                       HEAD_DIM, BLOCK_D, MASKED, USE_TMA)  # fmt: skip
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
        if MASKED:
            s, _t = attn_scores(qk, offs_m[:, None], offs_n[None, :], off, qk_scale, cap_in, cap_out, slope2,
                            SOFTCAP, HAS_ALIBI)  # fmt: skip
            vis = key_visible(offs_m[:, None], offs_n[None, :], off, sq, sk, window_left, window_right,
                           HAS_LEFT, HAS_RIGHT, False)  # fmt: skip
            s = tl.where(vis, s, float("-inf"))
            m_ij = tl.maximum(m_i, tl.max(s, 1))
            # A row with nothing visible yet keeps m = -inf: subtract 0 instead (p = 0, no NaN).
            m_use = tl.where(m_ij == float("-inf"), 0.0, m_ij)
            p = tl.math.exp2(s - m_use[:, None])
        elif PLAIN_SCORES:
            # Hot path: scale folded into one FMA per score, row max taken before scaling.
            m_ij = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            m_use = m_ij
            p = tl.math.exp2(qk * qk_scale - m_use[:, None])
        else:
            s, _t = attn_scores(qk, offs_m[:, None], offs_n[None, :], off, qk_scale, cap_in, cap_out, slope2,
                            SOFTCAP, HAS_ALIBI)  # fmt: skip
            m_ij = tl.maximum(m_i, tl.max(s, 1))
            m_use = m_ij
            p = tl.math.exp2(s - m_use[:, None])
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        v = load_rows(v_ptr, desc_v, k_row0 + n0, kv_col, offs_n, offs_d, stride_vn, sk,
                       HEAD_DIM, BLOCK_D, MASKED, USE_TMA)  # fmt: skip
        if DROPOUT:
            keep = dropout_keep(seed, rng_base, offs_m[:, None], offs_n[None, :], rng_sk, dropout_p)
            p = tl.where(keep, p, 0.0)
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PREC)
        m_i = m_ij
    return acc, l_i, m_i


@triton.jit
def _fwd_rows(
    Q, K, V, ALIBI, desc_q, desc_k, desc_v,
    stride_qb, stride_qm, stride_qh, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh,
    stride_ab, nheads, group, seqlen_q, seqlen_k,
    qk_scale, cap_in, cap_out, window_left, window_right, dropout_p, seed,
    b, h, q_start, sq, k_start, sk, m0, n_lo, n_hi,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    VARLEN: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, DROPOUT: tl.constexpr, USE_TMA: tl.constexpr, PLAIN_SCORES: tl.constexpr,
    DOT_PREC: tl.constexpr, KEY_SLICE: tl.constexpr,
):  # fmt: skip
    """Unnormalised online-softmax state ``(acc (BLOCK_M, BLOCK_D), l (BLOCK_M,), m (BLOCK_M,))`` of
    query rows ``[m0, m0 + BLOCK_M)`` of sequence ``b``, head ``h`` over its visible keys inside
    ``[n_lo, n_hi)`` (multiples of ``BLOCK_N``; ``[0, sk)`` for a whole row tile). ``m`` is the base-2
    row max (``-inf`` for rows that saw no key), ``l`` the row sum of ``exp2(s - m)``.
    ``KEY_SLICE=False``: the whole visible range (``n_lo`` / ``n_hi`` unused)."""
    hk = h // group
    q_ptr = Q + row_offset(q_start, b, stride_qm, stride_qb, VARLEN) + h * stride_qh
    k_ptr = K + row_offset(k_start, b, stride_kn, stride_kb, VARLEN) + hk * stride_kh
    v_ptr = V + row_offset(k_start, b, stride_vn, stride_vb, VARLEN) + hk * stride_vh
    off = sk - sq  # query i sits at key position i + off (bottom-right alignment)

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q = load_rows(q_ptr, desc_q, q_start + m0, h * HEAD_DIM, offs_m, offs_d, stride_qm, sq,
                   HEAD_DIM, BLOCK_D, True, USE_TMA)  # fmt: skip

    slope2 = 0.0
    if HAS_ALIBI:
        slope2 = tl.load(ALIBI + b * stride_ab + h).to(tl.float32) * LOG2E
    rng_base = (b * nheads + h).to(tl.int64) * seqlen_q

    # Visible key range [lo, hi) of this row tile and its mask-free middle [fs, fe), cut to [n_lo, n_hi).
    lo, fs, fe, hi = key_range(m0, sk, off, window_left, window_right, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    if KEY_SLICE:  # a constexpr: the clamps cost the whole-tile loops ~30 registers (sm_90, triton 3.6)
        lo = tl.maximum(lo, n_lo)
        fs = tl.maximum(fs, n_lo)
        fe = tl.minimum(fe, n_hi)
        hi = tl.minimum(hi, n_hi)

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if HAS_LEFT:  # tiles crossing the window's left edge
        acc, l_i, m_i = _fwd_tiles(
            acc, l_i, m_i, q, k_ptr, v_ptr, desc_k, desc_v, k_start, hk * HEAD_DIM,
            lo, tl.minimum(fs, hi), offs_m, offs_d, stride_kn, stride_vn, sq, sk, off,
            qk_scale, cap_in, cap_out, slope2, window_left, window_right, dropout_p, seed, rng_base, seqlen_k,
            True, HEAD_DIM, BLOCK_D, BLOCK_N, HAS_LEFT, HAS_RIGHT, SOFTCAP, HAS_ALIBI, DROPOUT, USE_TMA,
            PLAIN_SCORES, DOT_PREC,
        )  # fmt: skip
    acc, l_i, m_i = _fwd_tiles(  # fully visible tiles: no masks
        acc, l_i, m_i, q, k_ptr, v_ptr, desc_k, desc_v, k_start, hk * HEAD_DIM,
        fs, fe, offs_m, offs_d, stride_kn, stride_vn, sq, sk, off,
        qk_scale, cap_in, cap_out, slope2, window_left, window_right, dropout_p, seed, rng_base, seqlen_k,
        False, HEAD_DIM, BLOCK_D, BLOCK_N, HAS_LEFT, HAS_RIGHT, SOFTCAP, HAS_ALIBI, DROPOUT, USE_TMA,
        PLAIN_SCORES, DOT_PREC,
    )  # fmt: skip
    acc, l_i, m_i = _fwd_tiles(  # diagonal / right-window / sequence-end tiles
        acc, l_i, m_i, q, k_ptr, v_ptr, desc_k, desc_v, k_start, hk * HEAD_DIM,
        tl.maximum(fe, fs), hi, offs_m, offs_d, stride_kn, stride_vn, sq, sk, off,
        qk_scale, cap_in, cap_out, slope2, window_left, window_right, dropout_p, seed, rng_base, seqlen_k,
        True, HEAD_DIM, BLOCK_D, BLOCK_N, HAS_LEFT, HAS_RIGHT, SOFTCAP, HAS_ALIBI, DROPOUT, USE_TMA,
        PLAIN_SCORES, DOT_PREC,
    )  # fmt: skip
    return acc, l_i, m_i


@triton.jit
def _store_rows(o_base, lse_base, acc, l_i, m_i, offs_m, sq, stride_om, drop_scale, col0,
                HEAD_DIM: tl.constexpr, COLS: tl.constexpr, DROPOUT: tl.constexpr):  # fmt: skip
    """Epilogue of a row tile: ``out = acc / l`` (``acc``: columns ``[col0, col0 + COLS)``) into
    ``o_base + row * stride_om`` and, from the program holding column 0, the natural-log LSE into
    ``lse_base + row``, for rows ``< sq``; rows with no visible key (l = 0) get 0 and -inf."""
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    if DROPOUT:
        acc = acc * drop_scale
    out = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * LN2)
    offs_d = col0 + tl.arange(0, COLS)
    row_ok = offs_m < sq
    o_ptrs = o_base + offs_m[:, None] * stride_om + offs_d[None, :]
    tl.store(o_ptrs, out.to(o_base.dtype.element_ty), mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM))
    if col0 == 0:
        tl.store(lse_base + offs_m, lse, mask=row_ok)


@triton.jit
def _tile_coords(tile, n_m, nheads):
    """``(pid_m, b, h)`` of row tile ``tile`` of a 1-D grid (row tiles fastest, as the 2-D grid)."""
    pid_bh = tile // n_m
    return tile - pid_bh * n_m, pid_bh // nheads, pid_bh % nheads


# Per-step lengths are not specialised on (divisibility by 16, == 1): varying max_seqlen values in
# the engine would otherwise compile a new variant of this large kernel mid-run; nor are the tail
# split's numbers, so the kernel compiled to learn its occupancy is the one every split runs.
@triton.jit(
    do_not_specialize=["seed", "seqlen_q", "seqlen_k", "n_main", "tail_work", "piece_len", "max_pieces"]
)
def _attn_fwd_kernel(
    Q, K, V, O, LSE, ALIBI, CU_Q, CU_K, desc_q, desc_k, desc_v, ACC_WS, ML_WS,
    stride_qb, stride_qm, stride_qh, stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh, stride_ob, stride_om, stride_oh,
    stride_lb, stride_lh, stride_ab,
    nheads, group, seqlen_q, seqlen_k,
    qk_scale, cap_in, cap_out, window_left, window_right, dropout_p, drop_scale, seed,
    n_main, tail_work, piece_len, max_pieces,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    VARLEN: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, DROPOUT: tl.constexpr, USE_TMA: tl.constexpr, REVERSE_M: tl.constexpr,
    PLAIN_SCORES: tl.constexpr, DOT_PREC: tl.constexpr, TAIL: tl.constexpr,
):  # fmt: skip
    if TAIL:
        # 1-D grid: programs [0, n_main) own one whole row tile each; the others share the key
        # ranges of the remaining row tiles (see TailSplit) and leave partial states in ACC_WS / ML_WS.
        pid = tl.program_id(0)
        n_m = tl.cdiv(seqlen_q, BLOCK_M)
        if pid >= n_main:
            j = pid - n_main
            kv_tiles = tl.cdiv(seqlen_k, BLOCK_N)
            it0 = j * piece_len
            it1 = tl.minimum(it0 + piece_len, tail_work)
            for t in range(it0 // kv_tiles, (it1 - 1) // kv_tiles + 1):
                pm, bt, ht = _tile_coords(n_main + t, n_m, nheads)
                t0 = t * kv_tiles
                acc, l_i, m_i = _fwd_rows(
                    Q, K, V, ALIBI, desc_q, desc_k, desc_v,
                    stride_qb, stride_qm, stride_qh, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn,
                    stride_vh, stride_ab, nheads, group, seqlen_q, seqlen_k,
                    qk_scale, cap_in, cap_out, window_left, window_right, dropout_p, seed,
                    bt, ht, bt * seqlen_q, seqlen_q, bt * seqlen_k, seqlen_k, pm * BLOCK_M,
                    (tl.maximum(it0, t0) - t0) * BLOCK_N, (tl.minimum(it1, t0 + kv_tiles) - t0) * BLOCK_N,
                    HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, VARLEN, HAS_LEFT, HAS_RIGHT, SOFTCAP, HAS_ALIBI,
                    DROPOUT, USE_TMA, PLAIN_SCORES, DOT_PREC, True,
                )  # fmt: skip
                slot = t * max_pieces + j - t0 // piece_len
                acc_offs, m_offs, l_offs = tail_ws_offsets(slot, 0, BLOCK_M, BLOCK_D, BLOCK_D)
                tl.store(ACC_WS + acc_offs, acc)
                tl.store(ML_WS + m_offs, m_i)
                tl.store(ML_WS + l_offs, l_i)
            return
        pid_m, b, h = _tile_coords(pid, n_m, nheads)
    else:
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1)
        if REVERSE_M:  # causal: heaviest row tiles first
            pid_m = tl.num_programs(0) - 1 - pid_m
        b = pid_bh // nheads
        h = pid_bh % nheads
    q_start, sq, k_start, sk = seq_bounds(b, CU_Q, CU_K, seqlen_q, seqlen_k, VARLEN)
    m0 = pid_m * BLOCK_M
    if m0 >= sq:
        return
    acc, l_i, m_i = _fwd_rows(
        Q, K, V, ALIBI, desc_q, desc_k, desc_v,
        stride_qb, stride_qm, stride_qh, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh,
        stride_ab, nheads, group, seqlen_q, seqlen_k,
        qk_scale, cap_in, cap_out, window_left, window_right, dropout_p, seed,
        b, h, q_start, sq, k_start, sk, m0, 0, sk,
        HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, VARLEN, HAS_LEFT, HAS_RIGHT, SOFTCAP, HAS_ALIBI, DROPOUT,
        USE_TMA, PLAIN_SCORES, DOT_PREC, False,
    )  # fmt: skip
    o_base = O + row_offset(q_start, b, stride_om, stride_ob, VARLEN) + h * stride_oh
    lse_base = LSE + row_offset(q_start, b, 1, stride_lb, VARLEN) + h * stride_lh
    _store_rows(o_base, lse_base, acc, l_i, m_i, m0 + tl.arange(0, BLOCK_M), sq, stride_om, drop_scale, 0,
                HEAD_DIM, BLOCK_D, DROPOUT)  # fmt: skip


@triton.jit(do_not_specialize=["seqlen_q", "n_main", "kv_tiles", "piece_len", "max_pieces"])
def _fwd_tail_combine_kernel(
    O, LSE, ACC_WS, ML_WS, stride_ob, stride_om, stride_oh, stride_lb, stride_lh,
    nheads, seqlen_q, n_main, kv_tiles, piece_len, max_pieces, drop_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, COLS: tl.constexpr,
    DROPOUT: tl.constexpr,
):  # fmt: skip
    """Grid ``(split row tiles, BLOCK_D // COLS)``: merges the pieces' partial states of one row tile
    (in a fixed order: bit-identical run to run) for ``COLS`` output columns and writes them (and the
    LSE) like the forward's epilogue. Padded batches only."""
    t = tl.program_id(0)
    col0 = tl.program_id(1) * COLS
    pid_m, b, h = _tile_coords(n_main + t, tl.cdiv(seqlen_q, BLOCK_M), nheads)
    n_pieces = ((t + 1) * kv_tiles - 1) // piece_len - (t * kv_tiles) // piece_len + 1
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    for p in range(n_pieces):
        _a, m_offs, _l = tail_ws_offsets(t * max_pieces + p, col0, BLOCK_M, BLOCK_D, COLS)
        m_i = tl.maximum(m_i, tl.load(ML_WS + m_offs))
    m_use = tl.where(m_i == float("-inf"), 0.0, m_i)
    acc = tl.zeros([BLOCK_M, COLS], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    for p in range(n_pieces):
        acc_offs, m_offs, l_offs = tail_ws_offsets(t * max_pieces + p, col0, BLOCK_M, BLOCK_D, COLS)
        w = tl.math.exp2(tl.load(ML_WS + m_offs) - m_use)
        acc += tl.load(ACC_WS + acc_offs) * w[:, None]
        l_i += tl.load(ML_WS + l_offs) * w
    o_base = O + b.to(tl.int64) * stride_ob + h * stride_oh
    lse_base = LSE + b.to(tl.int64) * stride_lb + h * stride_lh
    _store_rows(o_base, lse_base, acc, l_i, m_i, pid_m * BLOCK_M + tl.arange(0, BLOCK_M), seqlen_q, stride_om,
                drop_scale, col0, HEAD_DIM, COLS, DROPOUT)  # fmt: skip


# ----------------------------------------------------------------------------------------------
# Probabilities (S_dmask) kernel: small sizes only, for return_attn_probs / tests
# ----------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["seed"])
def _attn_probs_kernel(
    Q, K, LSE, P, ALIBI, CU_Q, CU_K,
    stride_qb, stride_qm, stride_qh, stride_kb, stride_kn, stride_kh,
    stride_lb, stride_lh, stride_ab, stride_pb, stride_ph, stride_pm,
    nheads, group, seqlen_q, seqlen_k,
    qk_scale, cap_in, cap_out, window_left, window_right, dropout_p, seed,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    VARLEN: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, DROPOUT: tl.constexpr, DOT_PREC: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_bh = tl.program_id(2)
    b = pid_bh // nheads
    h = pid_bh % nheads
    hk = h // group
    q_start, sq, k_start, sk = seq_bounds(b, CU_Q, CU_K, seqlen_q, seqlen_k, VARLEN)
    q_off = row_offset(q_start, b, stride_qm, stride_qb, VARLEN)
    k_off = row_offset(k_start, b, stride_kn, stride_kb, VARLEN)
    lse_off = row_offset(q_start, b, 1, stride_lb, VARLEN)
    off = sk - sq
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q = load_rows(Q + q_off + h * stride_qh, Q, 0, 0, offs_m, offs_d, stride_qm, sq,
                   HEAD_DIM, BLOCK_D, True, False)  # fmt: skip
    k = load_rows(K + k_off + hk * stride_kh, K, 0, 0, offs_n, offs_d, stride_kn, sk,
                   HEAD_DIM, BLOCK_D, True, False)  # fmt: skip
    lse = tl.load(LSE + lse_off + h * stride_lh + offs_m, mask=offs_m < sq, other=0.0)
    slope2 = 0.0
    if HAS_ALIBI:
        slope2 = tl.load(ALIBI + b * stride_ab + h).to(tl.float32) * LOG2E
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
    s, _t = attn_scores(qk, offs_m[:, None], offs_n[None, :], off, qk_scale, cap_in, cap_out, slope2,
                    SOFTCAP, HAS_ALIBI)  # fmt: skip
    vis = key_visible(offs_m[:, None], offs_n[None, :], off, sq, sk, window_left, window_right,
                   HAS_LEFT, HAS_RIGHT, True)  # fmt: skip
    p = tl.where(vis, tl.math.exp2(s - lse[:, None] * LOG2E), 0.0)
    if DROPOUT:
        rng_base = (b * nheads + h).to(tl.int64) * seqlen_q
        keep = dropout_keep(seed, rng_base, offs_m[:, None], offs_n[None, :], seqlen_k, dropout_p)
        p = tl.where(keep, p, -p)  # flash-attn convention: negative (sign bit) = dropped
    ptrs = P + b.to(tl.int64) * stride_pb + h * stride_ph + offs_m[:, None] * stride_pm + offs_n[None, :]
    tl.store(ptrs, p, mask=(offs_m[:, None] < sq) & (offs_n[None, :] < sk))


# ----------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AttnProblem:
    """Validated, normalised description of one attention call (shared by forward and backward).

    ``window_left/right`` are ``-1`` for an unbounded side; ``causal`` sets ``window_right = 0``.
    ``seqlen_q/k`` are the padded lengths (batched) or ``max_seqlen_q/k`` (varlen).
    """

    batch: int
    nheads: int
    nheads_k: int
    head_dim: int
    seqlen_q: int
    seqlen_k: int
    varlen: bool
    softmax_scale: float
    causal: bool
    window_left: int
    window_right: int
    softcap: float
    dropout_p: float

    @property
    def group(self) -> int:
        return self.nheads // self.nheads_k

    @property
    def block_d(self) -> int:
        return padded_head_dim(self.head_dim)

    @property
    def heavy_last(self) -> bool:
        """Later query row tiles see more keys (a right window without a left one: causal); the
        forward and dQ launches then start with the last row tiles (``REVERSE_M``)."""
        return self.window_right >= 0 and self.window_left < 0

    def lse_shape(self, total_q: int) -> tuple[int, ...]:
        return (self.nheads, total_q) if self.varlen else (self.batch, self.nheads, self.seqlen_q)


def _check_cu(name: str, cu: Any, device: torch.device, total: int, max_len: int, validate: bool) -> int:
    if not isinstance(cu, Tensor):
        raise TypeError(f"{name} must be an int32 tensor, got {type(cu).__name__}")
    if cu.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {cu.dtype}")
    if cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(f"{name} must be a 1-D (batch + 1,) tensor, got shape {tuple(cu.shape)}")
    if cu.device != device:
        raise ValueError(f"{name} is on {cu.device}, expected {device}")
    if cu.stride(0) != 1:
        raise ValueError(f"{name} must be contiguous")
    if validate:  # one host sync; the engine's hot path passes validate=False
        vals = cu.tolist()
        if vals[0] != 0:
            raise ValueError(f"{name} must start at 0, got {vals[0]}")
        lens = [b - a for a, b in itertools.pairwise(vals)]
        if min(lens) < 0:
            raise ValueError(f"{name} must be monotone non-decreasing, got {vals}")
        if vals[-1] > total:
            raise ValueError(f"{name}[-1]={vals[-1]} exceeds the packed length {total}")
        if max(lens) > max_len:
            raise ValueError(f"max_seqlen for {name} is {max_len} but a sequence has {max(lens)} tokens")
    return cu.numel() - 1


# Validated padded (non-varlen) problems by the metadata they were derived from (_padded_key).
_PADDED_PROBLEMS = Memo(1024)
_SCALAR_TYPES = (bool, int, float, type(None))


def _padded_key(
    q: Any, k: Any, v: Any, softmax_scale: Any, causal: Any, window_size: Any, softcap: Any,
    alibi_slopes: Any, dropout_p: Any, kernel_device: bool,
) -> tuple[object, ...] | None:  # fmt: skip
    """Everything :func:`check_attention_inputs` reads from a padded call (shapes, strides,
    dtypes, devices, option values and their types), or None when an argument is not what a valid
    call passes (the full check then runs, and raises)."""
    if not (isinstance(q, Tensor) and isinstance(k, Tensor) and isinstance(v, Tensor)):
        return None
    if alibi_slopes is None:
        alibi: object = None
    elif isinstance(alibi_slopes, Tensor):
        alibi = (alibi_slopes.shape, alibi_slopes.dtype, alibi_slopes.device)
    else:
        return None
    if not isinstance(window_size, tuple):
        return None
    # Plain Python scalars only: a tensor scale (read by value) must be checked on every call.
    if not all(
        isinstance(x, _SCALAR_TYPES) for x in (softmax_scale, causal, softcap, dropout_p, *window_size)
    ):
        return None
    dev = q.device
    # The CPU-device check also depends on the interpreter switch.
    device_ok = not kernel_device or dev.type == "cuda" or interpreter_enabled()
    return (
        q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, k.dtype, v.dtype, dev,
        k.device, v.device, device_ok, softmax_scale, type(softmax_scale), causal, type(causal),
        window_size, tuple(type(w) for w in window_size), softcap, type(softcap), dropout_p,
        type(dropout_p), alibi,
    )  # fmt: skip


def check_attention_inputs(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    cu_seqlens_q: Tensor | None = None,
    cu_seqlens_k: Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
    dropout_p: float = 0.0,
    validate: bool = True,
    kernel_device: bool = True,
) -> AttnProblem:
    """Validate flash-attn style inputs and return the normalised :class:`AttnProblem`.

    Padded calls are remembered by their metadata (shapes, strides, dtypes, devices, options): a
    repeated eager call skips the checks (they read nothing else), ~6 us of host time.

    Varlen when ``cu_seqlens_q`` is given: ``q (total_q, nheads, d)``, ``k/v (total_k, nheads_k, d)``.
    ``validate=False`` skips the checks that read device values (cu_seqlens monotonicity).
    ``kernel_device=True`` also requires a device the Triton kernels can run on.

    Raises:
        TypeError: non-tensor inputs, unsupported or mismatched dtypes, non-int32 cu_seqlens.
        ValueError: wrong ranks or shapes, nheads % nheads_k != 0, head dim outside [8, 256],
            non-contiguous last dim, CPU tensors without ``TRITON_INTERPRET=1``, bad cu_seqlens,
            dropout_p outside [0, 1), negative softcap, bad alibi_slopes, bad window_size.
    """
    opts = (softmax_scale, causal, window_size, softcap, alibi_slopes, dropout_p)
    if cu_seqlens_q is None and cu_seqlens_k is None and max_seqlen_q is None and max_seqlen_k is None:
        key = _padded_key(q, k, v, *opts, kernel_device)
        if key is not None:
            return _PADDED_PROBLEMS.get(
                key, lambda: _check_inputs(q, k, v, None, None, None, None, *opts, True, kernel_device)
            )  # type: ignore[no-any-return]
    return _check_inputs(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *opts, validate, kernel_device
    )


def _check_inputs(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor | None, cu_seqlens_k: Tensor | None,
    max_seqlen_q: int | None, max_seqlen_k: int | None, softmax_scale: float | None, causal: bool,
    window_size: tuple[int, int], softcap: float, alibi_slopes: Tensor | None, dropout_p: float,
    validate: bool, kernel_device: bool,
) -> AttnProblem:  # fmt: skip
    """:func:`check_attention_inputs` without the memo."""
    varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        want = 3 if varlen else 4
        if t.dim() != want:
            layout = "(total, nheads, d)" if varlen else "(batch, seqlen, nheads, d)"
            raise ValueError(f"{name} must be {want}-D {layout}, got shape {tuple(t.shape)}")
        if t.dtype not in _SUPPORTED_DTYPES:
            raise TypeError(f"{name} has unsupported dtype {t.dtype}; use float16, bfloat16 or float32")
        if t.stride(-1) != 1:
            raise ValueError(
                f"{name} must have a contiguous last dimension (stride(-1) == 1), got {t.stride()}"
            )
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if kernel_device and q.device.type != "cuda" and not interpreter_enabled():
        raise ValueError(
            f"q is on {q.device}: the Triton kernels need CUDA tensors, or TRITON_INTERPRET=1 set before "
            "triton is imported (or FLASHPAGE_BACKEND=torch)"
        )
    d = q.shape[-1]
    if k.shape[-1] != d or v.shape[-1] != d:
        raise ValueError(f"head dim mismatch: q {d}, k {k.shape[-1]}, v {v.shape[-1]}")
    if not MIN_HEAD_DIM <= d <= MAX_HEAD_DIM:
        raise ValueError(f"head dim {d} is unsupported: must be in [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}]")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have one shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    h, hk = q.shape[-2], k.shape[-2]
    if hk == 0 or h % hk != 0:
        raise ValueError(f"nheads ({h}) must be divisible by nheads_k ({hk})")
    if varlen:
        if cu_seqlens_q is None or cu_seqlens_k is None:
            raise ValueError("varlen attention needs both cu_seqlens_q and cu_seqlens_k")
        if max_seqlen_q is None or max_seqlen_k is None:
            raise ValueError("varlen attention needs max_seqlen_q and max_seqlen_k")
        for name, val in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
            if not isinstance(val, int) or isinstance(val, bool) or val < 0:
                raise TypeError(f"{name} must be a non-negative int, got {val!r}")
        batch = _check_cu("cu_seqlens_q", cu_seqlens_q, q.device, q.shape[0], max_seqlen_q, validate)
        batch_k = _check_cu("cu_seqlens_k", cu_seqlens_k, q.device, k.shape[0], max_seqlen_k, validate)
        if batch_k != batch:
            raise ValueError(f"cu_seqlens_q has {batch} sequences but cu_seqlens_k has {batch_k}")
        sq, sk = max_seqlen_q, max_seqlen_k
    else:
        batch, sq = q.shape[0], q.shape[1]
        if k.shape[0] != batch:
            raise ValueError(f"batch mismatch: q has {batch}, k/v have {k.shape[0]}")
        sk = k.shape[1]
    if not isinstance(dropout_p, (int, float)) or not 0.0 <= float(dropout_p) < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p!r}")
    if not isinstance(softcap, (int, float)) or softcap < 0:
        raise ValueError(f"softcap must be a float >= 0, got {softcap!r}")
    if len(window_size) != 2 or not all(isinstance(w, int) for w in window_size):
        raise ValueError(f"window_size must be a pair of ints (-1 = unbounded), got {window_size!r}")
    if alibi_slopes is not None:
        if not isinstance(alibi_slopes, Tensor):
            raise TypeError(f"alibi_slopes must be a tensor, got {type(alibi_slopes).__name__}")
        if alibi_slopes.dtype != torch.float32:
            raise TypeError(f"alibi_slopes must be float32, got {alibi_slopes.dtype}")
        if tuple(alibi_slopes.shape) not in ((h,), (batch, h)):
            raise ValueError(
                f"alibi_slopes must be ({h},) or ({batch}, {h}), got {tuple(alibi_slopes.shape)}"
            )
        if alibi_slopes.device != q.device:
            raise ValueError(f"alibi_slopes is on {alibi_slopes.device}, expected {q.device}")
    # In-sequence offsets (row * row stride) are int32 in the kernels; the sequence base is int64.
    for name, t, n in (("q", q, sq), ("k", k, sk), ("v", v, sk)):
        row_stride = t.stride(0) if varlen else t.stride(1)
        if n * row_stride >= 2**31:
            raise ValueError(f"{name}: one sequence spans {n} x {row_stride} elements (>= 2^31); split it")
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(d)
    left, right = window_size
    left = left if left >= 0 else -1
    right = 0 if causal else (right if right >= 0 else -1)
    return AttnProblem(
        batch=batch, nheads=h, nheads_k=hk, head_dim=d, seqlen_q=sq, seqlen_k=sk, varlen=varlen,
        softmax_scale=scale, causal=bool(causal), window_left=left, window_right=right,
        softcap=float(softcap), dropout_p=float(dropout_p),
    )  # fmt: skip


# ----------------------------------------------------------------------------------------------
# Launch helpers
# ----------------------------------------------------------------------------------------------
def _rows_view(t: Tensor, varlen: bool) -> tuple[int, int]:
    """(number of rows, row stride) of ``t`` seen as a ``(rows, nheads * d)`` matrix."""
    if varlen:
        return t.shape[0], t.stride(0)
    return t.shape[0] * t.shape[1], t.stride(1)


def tma_row_view_ok(t: Tensor, varlen: bool, head_dim: int) -> bool:
    """Can ``t`` be read through a 2-D ``(rows, nheads * d)`` TMA descriptor with ``[rows, d]`` boxes?"""
    if padded_head_dim(head_dim) != head_dim:
        return False
    shape, st = t.shape, t.stride()  # one call each: this runs on every eager launch
    if st[-2] != head_dim and shape[-2] > 1:
        return False
    if varlen:
        rows, row_stride = shape[0], st[0]
    else:
        rows, row_stride = shape[0] * shape[1], st[1]
        if shape[0] > 1 and st[0] != shape[1] * st[1]:
            return False
    return rows > 0 and t.numel() > 0 and (row_stride * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0


@functools.cache
def _descriptor_prototype(block_rows: int, head_dim: int) -> tuple[type, dict[str, Any]]:
    """The TensorDescriptor class and the field values of a validated ``[block_rows, head_dim]``
    descriptor (over a small CPU tensor): the template :func:`make_row_descriptor` copies."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    probe = torch.empty(block_rows, head_dim)
    desc = TensorDescriptor(probe, [block_rows, head_dim], [head_dim, 1], [block_rows, head_dim])
    fields = dict(vars(desc))
    del fields["base"], fields["shape"], fields["strides"]
    return TensorDescriptor, fields


def make_row_descriptor(
    t: Tensor, varlen: bool, block_rows: int, head_dim: int, checked: bool = False
) -> Any:
    """2-D TMA descriptor over ``t`` as ``(rows, nheads * d)`` with ``[block_rows, d]`` boxes.

    ``checked=True``: the caller has verified :func:`tma_row_view_ok` for ``t``, so the descriptor
    is filled in from a validated prototype (same fields, same class) instead of running
    ``TensorDescriptor``'s checks again: ~3 us less host time per descriptor on every launch.
    """
    rows, row_stride = _rows_view(t, varlen)
    if checked:
        cls, fields = _descriptor_prototype(block_rows, head_dim)
        desc = object.__new__(cls)
        vars(desc).update(fields, base=t, shape=[rows, t.shape[-2] * head_dim], strides=[row_stride, 1])
        return desc
    from triton.tools.tensor_descriptor import TensorDescriptor

    # Positional arguments: the constructor's keyword set differs between triton 3.6 and 3.9.
    return TensorDescriptor(t, [rows, t.shape[-2] * head_dim], [row_stride, 1], [block_rows, head_dim])


def needs_interpreter_upcast(t: Tensor) -> bool:
    """The Triton interpreter (3.9) computes ``tl.dot`` on bfloat16 operands wrongly (it sees their
    uint16 storage); on CPU, bfloat16 inputs are therefore run in float32 and cast back."""
    return t.device.type != "cuda" and t.dtype == torch.bfloat16


def dot_precision(dtype: torch.dtype) -> str:
    """float32 inputs use IEEE dots (reference-grade accuracy); 16-bit inputs ignore the setting."""
    return "ieee" if dtype == torch.float32 else "tf32"


def launch_common(prob: AttnProblem, alibi_slopes: Tensor | None) -> dict[str, Any]:
    """Scalar kernel arguments shared by the forward, probs and backward kernels."""
    log2e = 1.4426950408889634
    cap = prob.softcap
    return {
        "qk_scale": prob.softmax_scale * log2e,
        "cap_in": prob.softmax_scale / cap if cap > 0 else 0.0,
        "cap_out": cap * log2e,
        "window_left": max(prob.window_left, 0),
        "window_right": max(prob.window_right, 0),
        "HAS_LEFT": prob.window_left >= 0,
        "HAS_RIGHT": prob.window_right >= 0,
        "SOFTCAP": cap > 0,
        "HAS_ALIBI": alibi_slopes is not None,
        "DROPOUT": prob.dropout_p > 0,
    }


def alibi_args(alibi_slopes: Tensor | None, dummy: Tensor) -> tuple[Tensor, int]:
    """(pointer, batch stride) of the slopes: ``(nheads,)`` broadcasts over the batch (stride 0)."""
    if alibi_slopes is None:
        return dummy, 0
    a = alibi_slopes.contiguous()
    return a, (a.stride(0) if a.dim() == 2 else 0)


def lse_strides(prob: AttnProblem, lse: Tensor) -> tuple[int, int]:
    """(batch stride, head stride) of the LSE / delta buffers (varlen: batch stride unused)."""
    if prob.varlen:
        return 0, lse.stride(0)
    return lse.stride(0), lse.stride(1)


def bsh_strides(t: Tensor, varlen: bool) -> tuple[int, int, int]:
    """(batch, row, head) strides of a (batch, seq, heads, d) or packed (total, heads, d) tensor."""
    if varlen:
        return 0, t.stride(0), t.stride(1)
    return t.stride(0), t.stride(1), t.stride(2)


def fwd_uses_tma(cfg: FwdConfig, prob: AttnProblem, q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether a forward launch with ``cfg`` takes the TMA-descriptor path (else pointer loads)."""
    return (
        cfg.use_tma
        and tma_supported(q.device)
        and all(tma_row_view_ok(t, prob.varlen, prob.head_dim) for t in (q, k, v))
    )


@dataclass(frozen=True)
class TailSplit:
    """Stream-K split of the last, partial wave of a launch's equal tiles.

    With one tile per program and ``P`` programs resident at once, ``n_tiles`` tiles of equal work
    take ``ceil(n_tiles / P)`` waves; the last one is partial (d=128 forward at 16k tokens on the
    H200: 2048 row tiles = 15.5 waves of 132, run in 16). The split runs the ``n_main`` tiles of the
    full waves whole and deals the ``steps`` steps of each remaining tile (forward: its key tiles;
    backward dK/dV: its (query head, query tile) pairs; dQ: its key tiles), ``tail_work`` in tile
    order, out in ``n_tail`` pieces of ``piece_len`` steps (the last one shorter): the tail takes
    ``piece_len / steps`` of a wave. Each piece leaves a float32 partial per tile it touches in a
    workspace slot (``max_pieces`` slots per tile), which a small kernel merges in a fixed order.
    """

    n_main: int
    n_tail: int
    tail_tiles: int
    steps: int
    piece_len: int
    max_pieces: int

    @property
    def tail_work(self) -> int:
        return self.tail_tiles * self.steps


def plan_tail_split(n_tiles: int, steps: int, resident: int, min_piece: int = 2) -> TailSplit | None:
    """The :class:`TailSplit` of ``n_tiles`` tiles of ``steps`` equal steps each with ``resident``
    programs at once, or ``None`` when it would not shorten the run: no partial wave, or pieces (at
    least ``min_piece`` steps) longer than 3/4 of a tile."""
    if resident < 1 or n_tiles < 1:
        return None
    tail_tiles = n_tiles % resident
    if tail_tiles == 0:
        return None
    work = tail_tiles * steps
    n_tail = min(resident, work // max(1, min_piece))
    if n_tail <= tail_tiles:
        return None
    piece_len = cdiv(work, n_tail)
    if 4 * piece_len > 3 * steps:
        return None
    # A tile's consecutive steps meet at most this many pieces.
    max_pieces = (steps + piece_len - 2) // piece_len + 1
    return TailSplit(n_tiles - tail_tiles, cdiv(work, piece_len), tail_tiles, steps, piece_len, max_pieces)


_PLACEHOLDER_SPLIT = TailSplit(0, 1, 1, 2, 1, 2)  # numbers for the occupancy compile (not specialised on)


def plan_split_launch(
    cache: LaunchCache,
    key: Hashable,
    slots: tuple[int, ...],
    placeholder: Callable[
        [TailSplit], tuple[tuple[Any, ...], Callable[[], tuple[list[Any], dict[str, Any]]]]
    ],
    n_tiles: int,
    steps: int,
    resident: int | None,
    device: torch.device,
) -> TailSplit | None:
    """The :class:`TailSplit` of a tail-capable launch (``key``: its tail variant in ``cache``;
    ``placeholder(split)``: its values and build function for ``split``), or None. ``resident=None``
    on CUDA: the SM count when one program of the compiled tail variant fills an SM (with several
    per SM, an SM left with fewer programs in the last wave runs them faster, and the split's extra
    loads, partial stores and combine launch cost more than the wave saves: H200, d=128 at 1k
    tokens with 64 x 64 tiles, 3 programs per SM: 2.5% slower split), else no split."""
    if resident is None and device.type == "cuda":

        def sms_if_one_per_sm() -> int:
            vals, build = placeholder(_PLACEHOLDER_SPLIT)
            kernel = cache.compiled(key, slots, vals, build)
            if kernel is None or programs_per_sm(kernel, device) != 1:
                return 0
            return int(torch.cuda.get_device_properties(device).multi_processor_count)

        resident = cache.remembered(key, sms_if_one_per_sm)  # once per launch key
    return plan_tail_split(n_tiles, steps, resident) if resident else None


def tail_split_numbers(split: TailSplit | None) -> tuple[int, int, int, int]:
    """The tail kernels' ``(n_main, tail_work, piece_len, max_pieces)`` arguments (no split: unused)."""
    if split is None:
        return (0, 0, 1, 1)
    return (split.n_main, split.tail_work, split.piece_len, split.max_pieces)


def tail_split_applies(cfg: FwdConfig | BwdConfig, prob: AttnProblem) -> bool:
    """Whether the forward of ``prob`` may take a :class:`TailSplit`: every row tile must do the
    same work (padded batch, no causal / window mask)."""
    return cfg.split_tail and not prob.varlen and prob.window_left < 0 and prob.window_right < 0


def ws_applies(
    cfg: FwdConfig, prob: AttnProblem, q: Tensor, k: Tensor, v: Tensor, out: Tensor, alibi_slopes: Tensor | None
) -> bool:  # fmt: skip
    """Whether ``cfg`` asks for, and ``prob`` fits, the Gluon warp-specialized forward
    (``flash_fwd_ws``; its module doc gives the scope): sm_90, bf16/fp16, d 64 or 128, padded
    batch, sequence lengths multiples of 128, no dropout / softcap / ALiBi / window other than
    causal (with ``seqlen_k >= seqlen_q``), 2-D TMA-readable q, k, v and out."""
    if not cfg.ws_stages or prob.varlen or q.dtype not in (torch.bfloat16, torch.float16):
        return False
    d, sq, sk = prob.head_dim, prob.seqlen_q, prob.seqlen_k
    if d not in (64, 128) or sq % 128 or sk % 128 or sq == 0 or sk == 0 or prob.softmax_scale <= 0:
        return False
    if prob.dropout_p > 0 or prob.softcap > 0 or alibi_slopes is not None or prob.window_left >= 0:
        return False
    if prob.causal and sk < sq:
        return False
    if not prob.causal and prob.window_right >= 0:
        return False
    return ws_supported(q.device) and all(tma_row_view_ok(t, False, d) for t in (q, k, v, out))


def _launch_ws(
    prob: AttnProblem, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cfg: FwdConfig,
    resident: int | None,
) -> None:  # fmt: skip
    """The warp-specialized forward, with the tail split of :func:`_launch_fwd` (its CTAs fill an
    SM each: 164 KB of shared memory at 2 stages, so ``resident`` defaults to the SM count)."""
    from flashpage.ops.flash_fwd_ws import WS_BLOCK_M, WS_BLOCK_N, launch_ws_fwd

    split = None
    if tail_split_applies(cfg, prob):  # non-causal here: the scope admits no other mask
        if resident is None:
            resident = torch.cuda.get_device_properties(q.device).multi_processor_count
        n_tiles = prob.batch * prob.nheads * (prob.seqlen_q // WS_BLOCK_M)
        split = plan_tail_split(n_tiles, prob.seqlen_k // WS_BLOCK_N, resident)
    common = {"softmax_scale": prob.softmax_scale, "causal": prob.causal, "stages": cfg.ws_stages}
    if split is None:
        launch_ws_fwd(q, k, v, out, lse, **common)
        return
    acc_ws, ml_ws = _tail_workspaces(split, WS_BLOCK_M, prob.head_dim, q.device)
    tail = (split.n_main, split.n_tail, split.tail_work, split.piece_len, split.max_pieces)
    launch_ws_fwd(q, k, v, out, lse, tail=tail, acc_ws=acc_ws, ml_ws=ml_ws, **common)
    _launch_tail_combine(prob, out, lse, acc_ws, ml_ws, split, WS_BLOCK_M)


def _tail_workspaces(
    split: TailSplit, block_m: int, block_d: int, device: torch.device
) -> tuple[Tensor, Tensor]:
    """The float32 partial states of a :class:`TailSplit`: ``acc (slots, block_m, block_d)`` and
    ``m, l (slots, 2, block_m)``."""
    slots = split.tail_tiles * split.max_pieces
    acc_ws = torch.empty((slots, block_m, block_d), dtype=torch.float32, device=device)
    ml_ws = torch.empty((slots, 2, block_m), dtype=torch.float32, device=device)
    return acc_ws, ml_ws


# Compiled launches live on each kernel (kernel_launches). Positions of the per-call arguments of ``_attn_fwd_kernel`` (LaunchCache slots): the thirteen
# tensor / descriptor arguments, the LSE strides, seqlen_q, seqlen_k, the dropout seed and the
# tail split's numbers.
_FWD_SLOTS = (*range(13), 25, 26, 30, 31, 39, 40, 41, 42, 43)
_COMBINE_SLOTS = (0, 1, 2, 3, 7, 8, 10, 11, 12, 13, 14)


def _launch_fwd(
    prob: AttnProblem,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    cu_q: Tensor | None,
    cu_k: Tensor | None,
    alibi_slopes: Tensor | None,
    seed: int,
    cfg: FwdConfig,
    resident: int | None = None,
) -> None:
    """Launch the forward. ``resident``: programs the GPU holds at once, for the tail split
    (default: see :func:`flash_fwd`'s ``resident_programs``)."""
    if ws_applies(cfg, prob, q, k, v, out, alibi_slopes):
        _launch_ws(prob, q, k, v, out, lse, cfg, resident)
        return
    d = prob.head_dim
    use_tma = fwd_uses_tma(cfg, prob, q, k, v)
    if use_tma:
        desc_q = make_row_descriptor(q, prob.varlen, cfg.block_m, d, checked=True)
        desc_k = make_row_descriptor(k, prob.varlen, cfg.block_n, d, checked=True)
        desc_v = make_row_descriptor(v, prob.varlen, cfg.block_n, d, checked=True)
    else:
        desc_q, desc_k, desc_v = q, k, v
    alibi, stride_ab = alibi_args(alibi_slopes, q)
    cq = cu_q if cu_q is not None else q
    ck = cu_k if cu_k is not None else q
    stride_lb, stride_lh = lse_strides(prob, lse)
    sq, sk = prob.seqlen_q, prob.seqlen_k
    n_m = cdiv(sq, cfg.block_m)
    key = (
        prob.nheads, prob.nheads_k, d, prob.varlen, prob.softmax_scale, prob.window_left,
        prob.window_right, prob.softcap, prob.dropout_p, cfg, use_tma, q.dtype, q.device.index,
        q.stride(), k.stride(), v.stride(), out.stride(), stride_ab, alibi_slopes is None,
        aligned(q, k, v, out, lse, alibi, cq, ck), int_spec(stride_lb), int_spec(stride_lh),
        int_spec(sq), int_spec(sk), int_spec(seed),
    )  # fmt: skip

    def values(split: TailSplit | None, acc_ws: Tensor, ml_ws: Tensor) -> tuple[Any, ...]:
        return (q, k, v, out, lse, alibi, cq, ck, desc_q, desc_k, desc_v, acc_ws, ml_ws, stride_lb, stride_lh,
                sq, sk, seed, *tail_split_numbers(split))  # fmt: skip

    def builder(vals: tuple[Any, ...], tail: bool) -> Callable[[], tuple[list[Any], dict[str, Any]]]:
        def build() -> tuple[list[Any], dict[str, Any]]:
            common = launch_common(prob, alibi_slopes)
            args = [
                *vals[:13],
                *bsh_strides(q, prob.varlen), *bsh_strides(k, prob.varlen), *bsh_strides(v, prob.varlen),
                *bsh_strides(out, prob.varlen), stride_lb, stride_lh, stride_ab,
                prob.nheads, prob.group, sq, sk,
                common["qk_scale"], common["cap_in"], common["cap_out"], common["window_left"],
                common["window_right"], prob.dropout_p, 1.0 / (1.0 - prob.dropout_p), seed, *vals[18:],
            ]  # fmt: skip
            kwargs = {
                "HEAD_DIM": d, "BLOCK_D": prob.block_d, "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n,
                "VARLEN": prob.varlen, "HAS_LEFT": common["HAS_LEFT"], "HAS_RIGHT": common["HAS_RIGHT"],
                "SOFTCAP": common["SOFTCAP"], "HAS_ALIBI": common["HAS_ALIBI"], "DROPOUT": common["DROPOUT"],
                "USE_TMA": use_tma, "REVERSE_M": prob.heavy_last,
                "PLAIN_SCORES": prob.softmax_scale > 0 and not common["SOFTCAP"] and alibi_slopes is None,
                "DOT_PREC": dot_precision(q.dtype), "TAIL": tail,
                "num_warps": cfg.num_warps, "num_stages": cfg.num_stages,
            }  # fmt: skip
            return args, kwargs

        return build

    def placeholder(
        split: TailSplit,
    ) -> tuple[tuple[Any, ...], Callable[[], tuple[list[Any], dict[str, Any]]]]:
        ws = lse.new_empty(4)
        vals = values(split, ws, ws)
        return vals, builder(vals, True)

    split = None
    if tail_split_applies(cfg, prob):
        split = plan_split_launch(
            kernel_launches(_attn_fwd_kernel), (*key, True), _FWD_SLOTS, placeholder, n_m * prob.batch * prob.nheads,
            cdiv(sk, cfg.block_n), resident, q.device,
        )  # fmt: skip
    if split is None:
        vals = values(None, lse, lse)
        kernel_launches(_attn_fwd_kernel).launch(
            (*key, False), (n_m, prob.batch * prob.nheads), _FWD_SLOTS, vals, builder(vals, False)
        )
        return
    acc_ws, ml_ws = _tail_workspaces(split, cfg.block_m, prob.block_d, q.device)
    vals = values(split, acc_ws, ml_ws)
    kernel_launches(_attn_fwd_kernel).launch(
        (*key, True), (split.n_main + split.n_tail,), _FWD_SLOTS, vals, builder(vals, True)
    )
    _launch_tail_combine(prob, out, lse, acc_ws, ml_ws, split, cfg.block_m)


def _launch_tail_combine(
    prob: AttnProblem, out: Tensor, lse: Tensor, acc_ws: Tensor, ml_ws: Tensor, split: TailSplit, block_m: int
) -> None:  # fmt: skip
    """Merge a :class:`TailSplit`'s partial states (``block_m``-row tiles) into ``out`` and ``lse``."""
    stride_lb, stride_lh = lse_strides(prob, lse)
    sq, d = prob.seqlen_q, prob.head_dim
    ob, om, oh = bsh_strides(out, False)
    cvals = (out, lse, acc_ws, ml_ws, stride_lb, stride_lh, sq, split.n_main, split.steps, split.piece_len,
             split.max_pieces)  # fmt: skip

    # 64-column slices: <= 64 accumulator elements per thread (a 128 x 256 tile in one program spills).
    cols = min(64, prob.block_d)

    def build_combine() -> tuple[list[Any], dict[str, Any]]:
        args = [out, lse, acc_ws, ml_ws, ob, om, oh, stride_lb, stride_lh, prob.nheads, sq, split.n_main,
                split.steps, split.piece_len, split.max_pieces, 1.0 / (1.0 - prob.dropout_p)]  # fmt: skip
        kwargs = {"HEAD_DIM": d, "BLOCK_D": prob.block_d, "BLOCK_M": block_m, "DROPOUT": prob.dropout_p > 0,
                  "COLS": cols, "num_warps": 4, "num_stages": 1}  # fmt: skip
        return args, kwargs

    ckey = (prob.nheads, d, block_m, prob.dropout_p, out.dtype, out.device.index, out.stride(),
            aligned(out, lse), int_spec(stride_lb), int_spec(stride_lh))  # fmt: skip
    kernel_launches(_fwd_tail_combine_kernel).launch(
        ckey, (split.tail_tiles, prob.block_d // cols), _COMBINE_SLOTS, cvals, build_combine
    )


def _bucket(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def problem_key(prob: AttnProblem, q: Tensor, alibi: bool) -> tuple[object, ...]:
    """Autotuning key: everything that changes the compiled kernel or its best tile shape."""
    return (
        torch.cuda.get_device_name(q.device) if q.device.type == "cuda" else "cpu",
        q.dtype, prob.head_dim, prob.group, prob.varlen, prob.causal, prob.window_left >= 0,
        prob.window_right >= 0, prob.softcap > 0, alibi, prob.dropout_p > 0,
        _bucket(prob.seqlen_q), _bucket(prob.seqlen_k),
    )  # fmt: skip


def flash_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    cu_seqlens_q: Tensor | None = None,
    cu_seqlens_k: Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
    dropout_p: float = 0.0,
    seed: int = 0,
    config: FwdConfig | None = None,
    validate: bool = True,
    out: Tensor | None = None,
    problem: AttnProblem | None = None,
    resident_programs: int | None = None,
) -> tuple[Tensor, Tensor]:
    """FlashAttention forward (no autograd).

    Args:
        q: ``(batch, seqlen_q, nheads, d)`` or packed ``(total_q, nheads, d)`` with cu_seqlens.
        k, v: ``(batch, seqlen_k, nheads_k, d)`` or ``(total_k, nheads_k, d)``.
        cu_seqlens_q, cu_seqlens_k: int32 ``(batch + 1,)`` prefix sums (varlen only).
        seed: philox seed of the dropout mask (used when ``dropout_p > 0``).
        config: tile configuration; default: the tuned table / autotuner (flash_configs).
        validate: run the host-sync checks of cu_seqlens values.
        out: optional preallocated output like ``q``.
        problem: the :func:`check_attention_inputs` result for exactly these arguments, when the
            caller has already validated them (the eager API's path: skips a second check).
        resident_programs: programs the GPU runs at once, which sizes the :class:`TailSplit` of
            padded unmasked problems (default on CUDA: the SM count when one program fills an SM,
            else no split; no split under the interpreter unless given).

    Returns:
        ``out`` like ``q`` and ``lse`` float32 (natural log, ``-inf`` for rows with no visible key):
        ``(batch, nheads, seqlen_q)`` or varlen ``(nheads, total_q)``.
    """
    prob = problem
    if prob is None:
        prob = check_attention_inputs(
            q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
            softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p, validate=validate,
        )  # fmt: skip
    if needs_interpreter_upcast(q):
        o32, lse = flash_fwd(
            q.float(), k.float(), v.float(), cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
            max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, softmax_scale=softmax_scale, causal=causal,
            window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p,
            seed=seed, config=config, validate=False, resident_programs=resident_programs,
        )  # fmt: skip
        if out is None:
            return o32.to(q.dtype), lse
        return out.copy_(o32), lse
    if out is None:
        out = q.new_empty(q.shape)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be a {tuple(q.shape)} {q.dtype} tensor with stride(-1) == 1")
    lse = torch.empty(prob.lse_shape(q.shape[0]), dtype=torch.float32, device=q.device)
    if q.numel() == 0 or prob.batch == 0 or prob.seqlen_q == 0:
        lse.fill_(float("-inf"))
        out.zero_()
        return out, lse
    if prob.varlen:
        # Rows of packed tensors beyond cu_seqlens[-1] (padding) are not written by the kernel.
        lse.fill_(float("-inf"))
    args = (prob, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, seed)
    if config is None:
        if autotune_enabled() and q.device.type == "cuda":
            config = autotune(  # type: ignore[assignment]
                ("fwd", *problem_key(prob, q, alibi_slopes is not None)),
                fwd_candidates(prob.head_dim, q.device),
                lambda cfg: _launch_fwd(*args, cfg, resident_programs),  # type: ignore[arg-type]
            )
        else:
            config = fwd_config(prob.head_dim, q.dtype, prob.causal, q.device, prob.seqlen_k)
    assert config is not None
    _launch_fwd(*args, config, resident_programs)
    return out, lse


def attention_probs(
    q: Tensor,
    k: Tensor,
    lse: Tensor,
    prob: AttnProblem,
    *,
    cu_seqlens_q: Tensor | None = None,
    cu_seqlens_k: Tensor | None = None,
    alibi_slopes: Tensor | None = None,
    seed: int = 0,
) -> Tensor:
    """Materialise the attention probabilities of a finished forward (``S_dmask``; small sizes only).

    Returns ``(batch, nheads, seqlen_q, seqlen_k)`` float32 (varlen: ``max_seqlen_q/k``, zero padded):
    ``P = exp(scores - lse)`` (0 where masked). With dropout the dropout pattern is encoded in the sign
    as in flash-attn: entries whose sign bit is set (``torch.signbit``, ``-P`` incl. ``-0.0``) were
    dropped, the others kept; the kept probabilities before the ``1/(1-p)`` scaling are ``P.clamp(min=0)``.
    """
    if needs_interpreter_upcast(q):
        q, k = q.float(), k.float()
    p_out = torch.zeros(
        prob.batch, prob.nheads, prob.seqlen_q, prob.seqlen_k, dtype=torch.float32, device=q.device
    )
    if p_out.numel() == 0:
        return p_out
    bm, bn = (16, 16) if interpreter_enabled() and q.device.type != "cuda" else (32, 32)
    alibi, stride_ab = alibi_args(alibi_slopes, q)
    stride_lb, stride_lh = lse_strides(prob, lse)
    c = launch_common(prob, alibi_slopes)
    grid = (cdiv(prob.seqlen_q, bm), cdiv(prob.seqlen_k, bn), prob.batch * prob.nheads)
    qs, ks = bsh_strides(q, prob.varlen), bsh_strides(k, prob.varlen)
    _attn_probs_kernel[grid](
        q, k, lse, p_out, alibi, cu_seqlens_q if cu_seqlens_q is not None else q,
        cu_seqlens_k if cu_seqlens_k is not None else q,
        *qs, *ks, stride_lb, stride_lh, stride_ab, p_out.stride(0), p_out.stride(1), p_out.stride(2),
        prob.nheads, prob.group, prob.seqlen_q, prob.seqlen_k,
        c["qk_scale"], c["cap_in"], c["cap_out"], c["window_left"], c["window_right"], prob.dropout_p, seed,
        HEAD_DIM=prob.head_dim, BLOCK_D=prob.block_d, BLOCK_M=bm, BLOCK_N=bn, VARLEN=prob.varlen,
        HAS_LEFT=c["HAS_LEFT"], HAS_RIGHT=c["HAS_RIGHT"], SOFTCAP=c["SOFTCAP"], HAS_ALIBI=c["HAS_ALIBI"],
        DROPOUT=c["DROPOUT"], DOT_PREC=dot_precision(q.dtype), num_warps=4, num_stages=1, **KERNEL_OPTIONS,
    )  # fmt: skip
    return p_out
