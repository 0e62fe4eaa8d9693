"""FlashAttention backward in Triton: preprocess (delta), dK/dV kernel, dQ kernel (or both fused), launcher.

The probabilities are recomputed from the forward's LSE (``P = exp2(s * log2e - lse * log2e)``), never
stored. With ``dP = dO V^T`` (times the dropout mask and ``1/(1-p)``) and
``delta = rowsum(dO * O)`` (computed by :func:`_bwd_preprocess_kernel`), ``dS = P * (dP - delta)``;
the softcap contributes its derivative ``1 - tanh^2`` and the softmax scale is applied to ``dS`` once.

* :func:`_bwd_dkdv_kernel` — grid ``(cdiv(max_seqlen_k, block_n1), batch * nheads_k)``: a program
  keeps a ``block_n1`` tile of K and V on chip and loops over the ``nheads / nheads_k`` query heads of
  its GQA group and, per head, over the query tiles that see the KV tile (``block_m1`` rows per step;
  tiles entirely above the causal diagonal / outside the window are skipped, fully visible tiles run
  without mask arithmetic). So dK/dV of a KV head are summed over its group inside the kernel,
  without atomics. With ``dq_mode="atomic"`` it also adds ``dS K`` into a float32 dQ buffer with
  atomics (fewer FLOPs, not bit-reproducible); ``"atomic_tma"`` does that with one TMA bulk
  reduce-add per tile (Hopper+; how FlashAttention-3 accumulates dQ).
* :func:`_bwd_dq_kernel` — grid ``(cdiv(max_seqlen_q, block_m2), batch * nheads)``: a program keeps
  ``block_m2`` rows of Q, dO, LSE, delta and loops over the visible KV tiles (same three-part split as
  the forward). No atomics: ``deterministic=True`` gives bit-identical dQ/dK/dV run to run.
* :func:`_bwd_fused_kernel` (``dq_mode="fused"``) — both in one launch, grid
  ``(n_kv_tiles + group * n_q_tiles, batch * nheads_k)``: per KV head its dK/dV programs, then the dQ
  programs of its query heads (FlexAttention's layout). The bodies are the same jit helpers
  (:func:`_dkdv_program`, :func:`_dq_program`), so the gradients are bit-identical to ``"separate"``;
  the dQ programs fill the dK/dV launch's last wave (H200: +1-4% causal, -5% non-causal, see the
  tables in :mod:`flashpage.ops.flash_configs`).

Layouts and masking semantics are those of :mod:`flashpage.ops.flash_fwd` (whose jit helpers are
reused, so forward and backward agree on masks, ALiBi, softcap and the dropout pattern).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from flashpage.ops.attn_math import (
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
from flashpage.ops.flash_configs import BwdConfig, autotune, autotune_enabled, bwd_candidates, bwd_config
from flashpage.ops.flash_fwd import (
    AttnProblem,
    TailSplit,
    alibi_args,
    bsh_strides,
    check_attention_inputs,
    dot_precision,
    launch_common,
    lse_strides,
    make_row_descriptor,
    needs_interpreter_upcast,
    plan_split_launch,
    problem_key,
    tail_split_applies,
    tail_split_numbers,
    tma_row_view_ok,
)
from flashpage.ops.launch_cache import aligned, int_spec, kernel_launches
from flashpage.ops.utils import cdiv, tma_supported

__all__ = ["flash_bwd"]


@triton.jit
def _bwd_preprocess_kernel(
    O, DO, DELTA, CU_Q,
    stride_ob, stride_om, stride_oh, stride_dob, stride_dom, stride_doh, stride_lb, stride_lh,
    nheads, seqlen_q,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, VARLEN: tl.constexpr,
):  # fmt: skip
    """delta[b, h, i] = sum_d dO[i, d] * O[i, d] (float32), stored in the LSE layout."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // nheads
    h = pid_bh % nheads
    q_start, sq, _ks, _sk = seq_bounds(b, CU_Q, CU_Q, seqlen_q, seqlen_q, VARLEN)
    m0 = pid_m * BLOCK_M
    if m0 >= sq:
        return
    o_off = row_offset(q_start, b, stride_om, stride_ob, VARLEN)
    do_off = row_offset(q_start, b, stride_dom, stride_dob, VARLEN)
    l_off = row_offset(q_start, b, 1, stride_lb, VARLEN)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    o = load_rows(O + o_off + h * stride_oh, O, 0, 0, offs_m, offs_d, stride_om, sq,
                   HEAD_DIM, BLOCK_D, True, False)  # fmt: skip
    do = load_rows(DO + do_off + h * stride_doh, DO, 0, 0, offs_m, offs_d, stride_dom, sq,
                    HEAD_DIM, BLOCK_D, True, False)  # fmt: skip
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + l_off + h * stride_lh + offs_m, delta, mask=offs_m < sq)


@triton.jit
def _dkdv_tiles(
    dk, dv, k, v, q_ptr, do_ptr, desc_q, desc_do, desc_dq, q_row0, q_col, lse_ptr, delta_ptr, dq_ptr,
    lo, hi, offs_n, offs_d, stride_qm, stride_dom, stride_dqm, sq, sk, off,
    sm_scale, qk_scale, cap_in, cap_out, slope2, window_left, window_right,
    dropout_p, drop_scale, seed, rng_base, rng_sk,
    MASKED: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    DROPOUT: tl.constexpr, ATOMIC_DQ: tl.constexpr, USE_TMA: tl.constexpr, DOT_PREC: tl.constexpr,
    DO_DK: tl.constexpr, DO_DV: tl.constexpr, DQ_TMA: tl.constexpr,
):  # fmt: skip
    """Accumulate dK/dV of one KV tile over the query tiles ``[lo, hi)`` of one query head.

    Works in the transposed orientation (``[BLOCK_N, BLOCK_M]`` score tiles) so dK/dV accumulate
    with plain ``tl.dot``s. ``DO_DK`` / ``DO_DV`` select the accumulators (split mode runs the kernel
    once for each, so a program holds one ``BLOCK_N x d`` float32 accumulator instead of two)."""
    offs_m0 = tl.arange(0, BLOCK_M)
    for m0 in range(lo, hi, BLOCK_M):
        m0 = tl.multiple_of(m0, BLOCK_M)
        offs_m = m0 + offs_m0
        q = load_rows(q_ptr, desc_q, q_row0 + m0, q_col, offs_m, offs_d, stride_qm, sq,
                       HEAD_DIM, BLOCK_D, MASKED, USE_TMA)  # fmt: skip
        if MASKED:
            lse = tl.load(lse_ptr + offs_m, mask=offs_m < sq, other=0.0)
        else:
            lse = tl.load(lse_ptr + offs_m)
        qkT = tl.dot(k, tl.trans(q), input_precision=DOT_PREC)
        s, t = attn_scores(qkT, offs_m[None, :], offs_n[:, None], off, qk_scale, cap_in, cap_out, slope2,
                       SOFTCAP, HAS_ALIBI)  # fmt: skip
        pT = tl.math.exp2(s - (lse * LOG2E)[None, :])
        if MASKED:
            # where (not a -inf score) so rows without visible keys (lse = -inf) give 0, not NaN
            vis = key_visible(offs_m[None, :], offs_n[:, None], off, sq, sk, window_left, window_right,
                           HAS_LEFT, HAS_RIGHT, True)  # fmt: skip
            pT = tl.where(vis, pT, 0.0)
        do = load_rows(do_ptr, desc_do, q_row0 + m0, q_col, offs_m, offs_d, stride_dom, sq,
                        HEAD_DIM, BLOCK_D, MASKED, USE_TMA)  # fmt: skip
        if DROPOUT:
            keep = dropout_keep(seed, rng_base, offs_m[None, :], offs_n[:, None], rng_sk, dropout_p)
        if DO_DV:
            if DROPOUT:
                pdT = tl.where(keep, pT * drop_scale, 0.0)
            else:
                pdT = pT
            dv = tl.dot(pdT.to(do.dtype), do, dv, input_precision=DOT_PREC)
        if DO_DK:
            if MASKED:
                delta = tl.load(delta_ptr + offs_m, mask=offs_m < sq, other=0.0)
            else:
                delta = tl.load(delta_ptr + offs_m)
            dpT = tl.dot(v, tl.trans(do), input_precision=DOT_PREC)
            if DROPOUT:
                dpT = tl.where(keep, dpT * drop_scale, 0.0)
            dsT = pT * (dpT - delta[None, :])
            if SOFTCAP:
                dsT = dsT * (1.0 - t * t)
            dsT = (dsT * sm_scale).to(q.dtype)
            dk = tl.dot(dsT, q, dk, input_precision=DOT_PREC)
            if ATOMIC_DQ:
                dq_part = tl.dot(tl.trans(dsT), k, input_precision=DOT_PREC)
                if DQ_TMA:
                    # One bulk fp32 reduce-add of the tile in L2 (cp.reduce.async.bulk.tensor) instead
                    # of BLOCK_M x d scalar atomics. Rows past this sequence's end hold exact zeros
                    # (P is masked there), so spilling them into the next sequence's rows adds 0.
                    desc_dq.atomic_add([q_row0 + m0, q_col], dq_part)
                else:
                    dq_ptrs = dq_ptr + offs_m[:, None] * stride_dqm + offs_d[None, :]
                    tl.atomic_add(dq_ptrs, dq_part, mask=(offs_m[:, None] < sq) & (offs_d[None, :] < HEAD_DIM),
                                  sem="relaxed")  # fmt: skip
    return dk, dv


@triton.jit
def _dkdv_program(
    pid_n, pid_bh,
    Q, K, V, DO, LSE, DELTA, DK, DV, DQ, ALIBI, CU_Q, CU_K, desc_q, desc_do, desc_dq,
    stride_qb, stride_qm, stride_qh, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh,
    stride_dob, stride_dom, stride_doh, stride_dkb, stride_dkn, stride_dkh,
    stride_dvb, stride_dvn, stride_dvh, stride_dqb, stride_dqm, stride_dqh,
    stride_lb, stride_lh, stride_ab,
    nheads_k, group, seqlen_q, seqlen_k,
    sm_scale, qk_scale, cap_in, cap_out, window_left, window_right, dropout_p, drop_scale, seed,
    s_lo, s_hi, slot, DK_WS, DV_WS,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    VARLEN: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, DROPOUT: tl.constexpr, ATOMIC_DQ: tl.constexpr, USE_TMA: tl.constexpr,
    DOT_PREC: tl.constexpr, DO_DK: tl.constexpr, DO_DV: tl.constexpr, DQ_TMA: tl.constexpr,
    SLICE: tl.constexpr,
):  # fmt: skip
    """dK/dV of KV tile ``pid_n`` of (sequence, KV head) ``pid_bh``: the body of the dK/dV kernel,
    also run by the dK/dV programs of the fused launch. No early ``return`` (the fused kernel calls
    this inside a branch), so the whole body sits under the tile's bounds check.

    ``SLICE`` (a tail-split piece, see ``flash_fwd.TailSplit``): only the steps ``[s_lo, s_hi)`` of
    the tile's (query head of the group, query tile) range, flattened head-major, and the float32
    partial dK / dV go to workspace slot ``slot`` of ``DK_WS`` / ``DV_WS`` (``(slots, BLOCK_N,
    BLOCK_D)``) instead of DK / DV."""
    b = pid_bh // nheads_k
    hk = pid_bh % nheads_k
    q_start, sq, k_start, sk = seq_bounds(b, CU_Q, CU_K, seqlen_q, seqlen_k, VARLEN)
    n0 = pid_n * BLOCK_N
    if n0 < sk:
        q_off = row_offset(q_start, b, stride_qm, stride_qb, VARLEN)
        do_off = row_offset(q_start, b, stride_dom, stride_dob, VARLEN)
        dq_off = row_offset(q_start, b, stride_dqm, stride_dqb, VARLEN)
        l_off = row_offset(q_start, b, 1, stride_lb, VARLEN)
        k_off = row_offset(k_start, b, stride_kn, stride_kb, VARLEN)
        v_off = row_offset(k_start, b, stride_vn, stride_vb, VARLEN)
        dk_off = row_offset(k_start, b, stride_dkn, stride_dkb, VARLEN)
        dv_off = row_offset(k_start, b, stride_dvn, stride_dvb, VARLEN)
        off = sk - sq
        nheads = nheads_k * group
        offs_n = n0 + tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        k = load_rows(K + k_off + hk * stride_kh, K, 0, 0, offs_n, offs_d, stride_kn, sk,
                       HEAD_DIM, BLOCK_D, True, False)  # fmt: skip
        v = load_rows(V + v_off + hk * stride_vh, V, 0, 0, offs_n, offs_d, stride_vn, sk,
                       HEAD_DIM, BLOCK_D, True, False)  # fmt: skip

        # Query rows that see this KV tile: [m_lo, m_hi); fully visible query tiles: [fs, fe).
        m_lo = 0
        m_hi = sq
        if HAS_RIGHT:
            m_lo = (tl.maximum(n0 - off - window_right, 0) // BLOCK_M) * BLOCK_M
        if HAS_LEFT:
            m_hi = tl.minimum(sq, n0 + BLOCK_N - off + window_left)
        fs = m_lo
        if HAS_RIGHT:
            fs = tl.maximum(
                m_lo, tl.cdiv(tl.maximum(n0 + BLOCK_N - 1 - off - window_right, 0), BLOCK_M) * BLOCK_M
            )
        fe_raw = sq
        if HAS_LEFT:
            fe_raw = tl.minimum(sq, n0 + window_left - off + 1)
        fe = (tl.maximum(fe_raw, 0) // BLOCK_M) * BLOCK_M
        fe = tl.where(n0 + BLOCK_N <= sk, fe, fs)  # a tile crossing the sequence end is never mask-free

        dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        n_q_tiles = tl.cdiv(sq, BLOCK_M)
        for g in range(0, group):  # GQA: sum over the query heads of this KV head
            h = hk * group + g
            g_lo, g_fs, g_fe, g_hi = m_lo, fs, fe, m_hi
            if SLICE:  # this piece's query rows of head g (an empty range for the others)
                r0 = tl.maximum(s_lo - g * n_q_tiles, 0) * BLOCK_M
                r1 = tl.minimum(s_hi - g * n_q_tiles, n_q_tiles) * BLOCK_M
                g_lo = tl.maximum(g_lo, r0)
                g_fs = tl.maximum(g_fs, r0)
                g_fe = tl.minimum(g_fe, r1)
                g_hi = tl.minimum(g_hi, r1)
            q_ptr = Q + q_off + h * stride_qh
            do_ptr = DO + do_off + h * stride_doh
            dq_ptr = DQ + dq_off + h * stride_dqh
            lse_ptr = LSE + l_off + h * stride_lh
            delta_ptr = DELTA + l_off + h * stride_lh
            slope2 = 0.0
            if HAS_ALIBI:
                slope2 = tl.load(ALIBI + b * stride_ab + h).to(tl.float32) * LOG2E
            rng_base = (b * nheads + h).to(tl.int64) * seqlen_q
            if HAS_RIGHT:  # the diagonal / right-window edge
                dk, dv = _dkdv_tiles(
                    dk, dv, k, v, q_ptr, do_ptr, desc_q, desc_do, desc_dq, q_start, h * HEAD_DIM, lse_ptr, delta_ptr,
                    dq_ptr, g_lo, tl.minimum(g_fs, g_hi), offs_n, offs_d, stride_qm, stride_dom, stride_dqm,
                    sq, sk, off, sm_scale, qk_scale, cap_in, cap_out, slope2, window_left, window_right,
                    dropout_p, drop_scale, seed, rng_base, seqlen_k,
                    True, HEAD_DIM, BLOCK_D, BLOCK_M, HAS_LEFT, HAS_RIGHT, SOFTCAP, HAS_ALIBI, DROPOUT,
                    ATOMIC_DQ, USE_TMA, DOT_PREC, DO_DK, DO_DV, DQ_TMA,
                )  # fmt: skip
            dk, dv = _dkdv_tiles(  # fully visible query tiles
                dk, dv, k, v, q_ptr, do_ptr, desc_q, desc_do, desc_dq, q_start, h * HEAD_DIM, lse_ptr, delta_ptr,
                dq_ptr, g_fs, g_fe, offs_n, offs_d, stride_qm, stride_dom, stride_dqm,
                sq, sk, off, sm_scale, qk_scale, cap_in, cap_out, slope2, window_left, window_right,
                dropout_p, drop_scale, seed, rng_base, seqlen_k,
                False, HEAD_DIM, BLOCK_D, BLOCK_M, HAS_LEFT, HAS_RIGHT, SOFTCAP, HAS_ALIBI, DROPOUT,
                ATOMIC_DQ, USE_TMA, DOT_PREC, DO_DK, DO_DV, DQ_TMA,
            )  # fmt: skip
            dk, dv = _dkdv_tiles(  # left-window edge / query-sequence end
                dk, dv, k, v, q_ptr, do_ptr, desc_q, desc_do, desc_dq, q_start, h * HEAD_DIM, lse_ptr, delta_ptr,
                dq_ptr, tl.maximum(g_fe, g_fs), g_hi, offs_n, offs_d, stride_qm, stride_dom, stride_dqm,
                sq, sk, off, sm_scale, qk_scale, cap_in, cap_out, slope2, window_left, window_right,
                dropout_p, drop_scale, seed, rng_base, seqlen_k,
                True, HEAD_DIM, BLOCK_D, BLOCK_M, HAS_LEFT, HAS_RIGHT, SOFTCAP, HAS_ALIBI, DROPOUT,
                ATOMIC_DQ, USE_TMA, DOT_PREC, DO_DK, DO_DV, DQ_TMA,
            )  # fmt: skip

        if SLICE:
            ws_offs = tail_ws_offsets(slot, 0, BLOCK_N, BLOCK_D, BLOCK_D)[0]
            if DO_DK:
                tl.store(DK_WS + ws_offs, dk)
            if DO_DV:
                tl.store(DV_WS + ws_offs, dv)
        else:
            st_mask = (offs_n[:, None] < sk) & (offs_d[None, :] < HEAD_DIM)
            dk_ptrs = DK + dk_off + hk * stride_dkh + offs_n[:, None] * stride_dkn + offs_d[None, :]
            dv_ptrs = DV + dv_off + hk * stride_dvh + offs_n[:, None] * stride_dvn + offs_d[None, :]
            if DO_DK:
                tl.store(dk_ptrs, dk.to(DK.dtype.element_ty), mask=st_mask)
            if DO_DV:
                tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=st_mask)


@triton.jit(
    do_not_specialize=["seed", "seqlen_q", "seqlen_k", "n_main", "tail_work", "piece_len", "max_pieces"]
)
def _bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, DQ, ALIBI, CU_Q, CU_K, desc_q, desc_do, desc_dq,
    stride_qb, stride_qm, stride_qh, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh,
    stride_dob, stride_dom, stride_doh, stride_dkb, stride_dkn, stride_dkh,
    stride_dvb, stride_dvn, stride_dvh, stride_dqb, stride_dqm, stride_dqh,
    stride_lb, stride_lh, stride_ab,
    nheads_k, group, seqlen_q, seqlen_k,
    sm_scale, qk_scale, cap_in, cap_out, window_left, window_right, dropout_p, drop_scale, seed,
    DK_WS, DV_WS, n_main, tail_work, piece_len, max_pieces,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    VARLEN: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, DROPOUT: tl.constexpr, ATOMIC_DQ: tl.constexpr, USE_TMA: tl.constexpr,
    DOT_PREC: tl.constexpr, DO_DK: tl.constexpr, DO_DV: tl.constexpr, DQ_TMA: tl.constexpr,
    TAIL: tl.constexpr,
):  # fmt: skip
    """Grid ``(KV tiles, batch * nheads_k)``; ``TAIL``: a 1-D grid of ``n_main`` whole KV tiles, then the pieces of a ``flash_fwd.TailSplit`` whose steps
    are a tile's (query head of the group, query tile) pairs."""
    if TAIL:
        pid = tl.program_id(0)
        n_kv = tl.cdiv(seqlen_k, BLOCK_N)
        if pid >= n_main:
            j = pid - n_main
            steps = group * tl.cdiv(seqlen_q, BLOCK_M)
            it0 = j * piece_len
            it1 = tl.minimum(it0 + piece_len, tail_work)
            for t in range(it0 // steps, (it1 - 1) // steps + 1):
                t0 = t * steps
                tile = n_main + t
                _dkdv_program(
                    tile % n_kv, tile // n_kv,
                    Q, K, V, DO, LSE, DELTA, DK, DV, DQ, ALIBI, CU_Q, CU_K, desc_q, desc_do, desc_dq,
                    stride_qb, stride_qm, stride_qh, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn,
                    stride_vh, stride_dob, stride_dom, stride_doh, stride_dkb, stride_dkn, stride_dkh,
                    stride_dvb, stride_dvn, stride_dvh, stride_dqb, stride_dqm, stride_dqh,
                    stride_lb, stride_lh, stride_ab,
                    nheads_k, group, seqlen_q, seqlen_k,
                    sm_scale, qk_scale, cap_in, cap_out, window_left, window_right, dropout_p, drop_scale,
                    seed, tl.maximum(it0, t0) - t0, tl.minimum(it1, t0 + steps) - t0,
                    t * max_pieces + j - t0 // piece_len, DK_WS, DV_WS,
                    HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, VARLEN, HAS_LEFT, HAS_RIGHT, SOFTCAP, HAS_ALIBI,
                    DROPOUT, ATOMIC_DQ, USE_TMA, DOT_PREC, DO_DK, DO_DV, DQ_TMA, True,
                )  # fmt: skip
            return
        pid_n = pid % n_kv
        pid_bh = pid // n_kv
    else:
        pid_n = tl.program_id(0)
        pid_bh = tl.program_id(1)
    _dkdv_program(
        pid_n, pid_bh,
        Q, K, V, DO, LSE, DELTA, DK, DV, DQ, ALIBI, CU_Q, CU_K, desc_q, desc_do, desc_dq,
        stride_qb, stride_qm, stride_qh, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh,
        stride_dob, stride_dom, stride_doh, stride_dkb, stride_dkn, stride_dkh,
        stride_dvb, stride_dvn, stride_dvh, stride_dqb, stride_dqm, stride_dqh,
        stride_lb, stride_lh, stride_ab,
        nheads_k, group, seqlen_q, seqlen_k,
        sm_scale, qk_scale, cap_in, cap_out, window_left, window_right, dropout_p, drop_scale, seed,
        0, 0, 0, DK_WS, DV_WS,
        HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, VARLEN, HAS_LEFT, HAS_RIGHT, SOFTCAP, HAS_ALIBI, DROPOUT,
        ATOMIC_DQ, USE_TMA, DOT_PREC, DO_DK, DO_DV, DQ_TMA, False,
    )  # fmt: skip


@triton.jit
def _dq_tiles(
    dq, q, do, lse2, delta, k_ptr, v_ptr, desc_k, desc_v, k_row0, kv_col,
    lo, hi, offs_m, offs_d, stride_kn, stride_vn, sq, sk, off,
    qk_scale, cap_in, cap_out, slope2, window_left, window_right,
    dropout_p, drop_scale, seed, rng_base, rng_sk,
    MASKED: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    DROPOUT: tl.constexpr, USE_TMA: tl.constexpr, DOT_PREC: tl.constexpr,
):  # fmt: skip
    """Accumulate ``dS K`` of one query tile over key tiles ``[lo, hi)`` (unscaled by softmax_scale)."""
    offs_n0 = tl.arange(0, BLOCK_N)
    for n0 in range(lo, hi, BLOCK_N):
        n0 = tl.multiple_of(n0, BLOCK_N)
        offs_n = n0 + offs_n0
        k = load_rows(k_ptr, desc_k, k_row0 + n0, kv_col, offs_n, offs_d, stride_kn, sk,
                       HEAD_DIM, BLOCK_D, MASKED, USE_TMA)  # fmt: skip
        v = load_rows(v_ptr, desc_v, k_row0 + n0, kv_col, offs_n, offs_d, stride_vn, sk,
                       HEAD_DIM, BLOCK_D, MASKED, USE_TMA)  # fmt: skip
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
        s, t = attn_scores(qk, offs_m[:, None], offs_n[None, :], off, qk_scale, cap_in, cap_out, slope2,
                       SOFTCAP, HAS_ALIBI)  # fmt: skip
        p = tl.math.exp2(s - lse2[:, None])
        if MASKED:
            vis = key_visible(offs_m[:, None], offs_n[None, :], off, sq, sk, window_left, window_right,
                           HAS_LEFT, HAS_RIGHT, True)  # fmt: skip
            p = tl.where(vis, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)
        if DROPOUT:
            keep = dropout_keep(seed, rng_base, offs_m[:, None], offs_n[None, :], rng_sk, dropout_p)
            dp = tl.where(keep, dp * drop_scale, 0.0)
        ds = p * (dp - delta[:, None])
        if SOFTCAP:
            ds = ds * (1.0 - t * t)
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PREC)
    return dq


@triton.jit
def _dq_program(
    pid_m, pid_bh,
    Q, K, V, DO, LSE, DELTA, DQ, ALIBI, CU_Q, CU_K, desc_k, desc_v,
    stride_qb, stride_qm, stride_qh, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh,
    stride_dob, stride_dom, stride_doh, stride_dqb, stride_dqm, stride_dqh,
    stride_lb, stride_lh, stride_ab,
    nheads, group, seqlen_q, seqlen_k,
    sm_scale, qk_scale, cap_in, cap_out, window_left, window_right, dropout_p, drop_scale, seed,
    n_lo, n_hi, slot, DQ_WS,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    VARLEN: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, DROPOUT: tl.constexpr, USE_TMA: tl.constexpr, DOT_PREC: tl.constexpr,
    SLICE: tl.constexpr,
):  # fmt: skip
    """dQ of query tile ``pid_m`` of (sequence, query head) ``pid_bh`` (the dQ kernel's body, also
    run by the dQ programs of the fused launch; no early ``return``, see :func:`_dkdv_program`).
    ``SLICE``: only keys ``[n_lo, n_hi)`` (multiples of ``BLOCK_N``), the float32 partial dQ into
    slot ``slot`` of ``DQ_WS`` (``(slots, BLOCK_M, BLOCK_D)``)."""
    b = pid_bh // nheads
    h = pid_bh % nheads
    hk = h // group
    q_start, sq, k_start, sk = seq_bounds(b, CU_Q, CU_K, seqlen_q, seqlen_k, VARLEN)
    m0 = pid_m * BLOCK_M
    if m0 < sq:
        q_off = row_offset(q_start, b, stride_qm, stride_qb, VARLEN)
        do_off = row_offset(q_start, b, stride_dom, stride_dob, VARLEN)
        dq_off = row_offset(q_start, b, stride_dqm, stride_dqb, VARLEN)
        l_off = row_offset(q_start, b, 1, stride_lb, VARLEN)
        k_off = row_offset(k_start, b, stride_kn, stride_kb, VARLEN)
        v_off = row_offset(k_start, b, stride_vn, stride_vb, VARLEN)
        off = sk - sq
        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        q = load_rows(Q + q_off + h * stride_qh, Q, 0, 0, offs_m, offs_d, stride_qm, sq,
                       HEAD_DIM, BLOCK_D, True, False)  # fmt: skip
        do = load_rows(DO + do_off + h * stride_doh, DO, 0, 0, offs_m, offs_d, stride_dom, sq,
                        HEAD_DIM, BLOCK_D, True, False)  # fmt: skip
        row_ok = offs_m < sq
        lse2 = tl.load(LSE + l_off + h * stride_lh + offs_m, mask=row_ok, other=0.0) * LOG2E
        delta = tl.load(DELTA + l_off + h * stride_lh + offs_m, mask=row_ok, other=0.0)
        k_ptr = K + k_off + hk * stride_kh
        v_ptr = V + v_off + hk * stride_vh
        slope2 = 0.0
        if HAS_ALIBI:
            slope2 = tl.load(ALIBI + b * stride_ab + h).to(tl.float32) * LOG2E
        rng_base = (b * nheads + h).to(tl.int64) * seqlen_q

        lo, fs, fe, hi = key_range(
            m0, sk, off, window_left, window_right, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT
        )
        if SLICE:
            lo = tl.maximum(lo, n_lo)
            fs = tl.maximum(fs, n_lo)
            fe = tl.minimum(fe, n_hi)
            hi = tl.minimum(hi, n_hi)

        dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        if HAS_LEFT:
            dq = _dq_tiles(
                dq, q, do, lse2, delta, k_ptr, v_ptr, desc_k, desc_v, k_start, hk * HEAD_DIM,
                lo, tl.minimum(fs, hi), offs_m, offs_d, stride_kn, stride_vn, sq, sk, off,
                qk_scale, cap_in, cap_out, slope2, window_left, window_right,
                dropout_p, drop_scale, seed, rng_base, seqlen_k,
                True, HEAD_DIM, BLOCK_D, BLOCK_N, HAS_LEFT, HAS_RIGHT, SOFTCAP, HAS_ALIBI, DROPOUT, USE_TMA,
                DOT_PREC,
            )  # fmt: skip
        dq = _dq_tiles(
            dq, q, do, lse2, delta, k_ptr, v_ptr, desc_k, desc_v, k_start, hk * HEAD_DIM,
            fs, fe, offs_m, offs_d, stride_kn, stride_vn, sq, sk, off,
            qk_scale, cap_in, cap_out, slope2, window_left, window_right,
            dropout_p, drop_scale, seed, rng_base, seqlen_k,
            False, HEAD_DIM, BLOCK_D, BLOCK_N, HAS_LEFT, HAS_RIGHT, SOFTCAP, HAS_ALIBI, DROPOUT, USE_TMA,
            DOT_PREC,
        )  # fmt: skip
        dq = _dq_tiles(
            dq, q, do, lse2, delta, k_ptr, v_ptr, desc_k, desc_v, k_start, hk * HEAD_DIM,
            tl.maximum(fe, fs), hi, offs_m, offs_d, stride_kn, stride_vn, sq, sk, off,
            qk_scale, cap_in, cap_out, slope2, window_left, window_right,
            dropout_p, drop_scale, seed, rng_base, seqlen_k,
            True, HEAD_DIM, BLOCK_D, BLOCK_N, HAS_LEFT, HAS_RIGHT, SOFTCAP, HAS_ALIBI, DROPOUT, USE_TMA,
            DOT_PREC,
        )  # fmt: skip
        dq = dq * sm_scale
        if SLICE:
            tl.store(DQ_WS + tail_ws_offsets(slot, 0, BLOCK_M, BLOCK_D, BLOCK_D)[0], dq)
        else:
            dq_ptrs = DQ + dq_off + h * stride_dqh + offs_m[:, None] * stride_dqm + offs_d[None, :]
            tl.store(dq_ptrs, dq.to(DQ.dtype.element_ty), mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM))


@triton.jit(
    do_not_specialize=["seed", "seqlen_q", "seqlen_k", "n_main", "tail_work", "piece_len", "max_pieces"]
)
def _bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, ALIBI, CU_Q, CU_K, desc_k, desc_v,
    stride_qb, stride_qm, stride_qh, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh,
    stride_dob, stride_dom, stride_doh, stride_dqb, stride_dqm, stride_dqh,
    stride_lb, stride_lh, stride_ab,
    nheads, group, seqlen_q, seqlen_k,
    sm_scale, qk_scale, cap_in, cap_out, window_left, window_right, dropout_p, drop_scale, seed,
    DQ_WS, n_main, tail_work, piece_len, max_pieces,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    VARLEN: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, DROPOUT: tl.constexpr, USE_TMA: tl.constexpr, REVERSE_M: tl.constexpr,
    DOT_PREC: tl.constexpr, TAIL: tl.constexpr,
):  # fmt: skip
    """Grid ``(query tiles, batch * nheads)`` (causal: heaviest first); ``TAIL``: a 1-D
    grid of ``n_main`` whole query tiles, then the pieces of a ``flash_fwd.TailSplit`` over key tiles."""
    if TAIL:
        pid = tl.program_id(0)
        n_q = tl.cdiv(seqlen_q, BLOCK_M)
        if pid >= n_main:
            j = pid - n_main
            steps = tl.cdiv(seqlen_k, BLOCK_N)
            it0 = j * piece_len
            it1 = tl.minimum(it0 + piece_len, tail_work)
            for t in range(it0 // steps, (it1 - 1) // steps + 1):
                t0 = t * steps
                tile = n_main + t
                _dq_program(
                    tile % n_q, tile // n_q,
                    Q, K, V, DO, LSE, DELTA, DQ, ALIBI, CU_Q, CU_K, desc_k, desc_v,
                    stride_qb, stride_qm, stride_qh, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn,
                    stride_vh, stride_dob, stride_dom, stride_doh, stride_dqb, stride_dqm, stride_dqh,
                    stride_lb, stride_lh, stride_ab,
                    nheads, group, seqlen_q, seqlen_k,
                    sm_scale, qk_scale, cap_in, cap_out, window_left, window_right, dropout_p, drop_scale,
                    seed, (tl.maximum(it0, t0) - t0) * BLOCK_N, (tl.minimum(it1, t0 + steps) - t0) * BLOCK_N,
                    t * max_pieces + j - t0 // piece_len, DQ_WS,
                    HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, VARLEN, HAS_LEFT, HAS_RIGHT, SOFTCAP, HAS_ALIBI,
                    DROPOUT, USE_TMA, DOT_PREC, True,
                )  # fmt: skip
            return
        pid_m = pid % n_q
        pid_bh = pid // n_q
    else:
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1)
        if REVERSE_M:  # causal: heaviest query tiles first
            pid_m = tl.num_programs(0) - 1 - pid_m
    _dq_program(
        pid_m, pid_bh,
        Q, K, V, DO, LSE, DELTA, DQ, ALIBI, CU_Q, CU_K, desc_k, desc_v,
        stride_qb, stride_qm, stride_qh, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh,
        stride_dob, stride_dom, stride_doh, stride_dqb, stride_dqm, stride_dqh,
        stride_lb, stride_lh, stride_ab,
        nheads, group, seqlen_q, seqlen_k,
        sm_scale, qk_scale, cap_in, cap_out, window_left, window_right, dropout_p, drop_scale, seed,
        0, 0, 0, DQ_WS,
        HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, VARLEN, HAS_LEFT, HAS_RIGHT, SOFTCAP, HAS_ALIBI, DROPOUT,
        USE_TMA, DOT_PREC, False,
    )  # fmt: skip


@triton.jit(do_not_specialize=["seed", "seqlen_q", "seqlen_k"])
def _bwd_fused_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, DQ, ALIBI, CU_Q, CU_K, desc_q, desc_do, desc_k, desc_v,
    stride_qb, stride_qm, stride_qh, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh,
    stride_dob, stride_dom, stride_doh, stride_dkb, stride_dkn, stride_dkh,
    stride_dvb, stride_dvn, stride_dvh, stride_dqb, stride_dqm, stride_dqh,
    stride_lb, stride_lh, stride_ab,
    nheads_k, group, seqlen_q, seqlen_k, n_kv_tiles, n_q_tiles,
    sm_scale, qk_scale, cap_in, cap_out, window_left, window_right, dropout_p, drop_scale, seed,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M1: tl.constexpr, BLOCK_N1: tl.constexpr,
    BLOCK_M2: tl.constexpr, BLOCK_N2: tl.constexpr,
    VARLEN: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, DROPOUT: tl.constexpr, USE_TMA1: tl.constexpr, USE_TMA2: tl.constexpr,
    REVERSE_M: tl.constexpr, DOT_PREC: tl.constexpr, DO_DK: tl.constexpr, DO_DV: tl.constexpr,
):  # fmt: skip
    """dK/dV and dQ in one launch (``dq_mode="fused"``, the layout of FlexAttention's backward).

    Grid ``(n_kv_tiles + group * n_q_tiles, batch * nheads_k)``: per (sequence, KV head), programs
    ``[0, n_kv_tiles)`` are its dK/dV tiles, the rest the dQ tiles of its ``group`` query heads
    (heaviest first when causal). Both kinds then share the GPU's waves: the shorter dQ programs fill
    the last wave of dK/dV work instead of each kernel ending on its own partly idle wave, and the
    dQ programs of a head run while its K/V are still in L2."""
    pid = tl.program_id(0)
    pid_bh = tl.program_id(1)
    if pid < n_kv_tiles:
        _dkdv_program(
            pid, pid_bh,
            Q, K, V, DO, LSE, DELTA, DK, DV, DQ, ALIBI, CU_Q, CU_K, desc_q, desc_do, DQ,
            stride_qb, stride_qm, stride_qh, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh,
            stride_dob, stride_dom, stride_doh, stride_dkb, stride_dkn, stride_dkh,
            stride_dvb, stride_dvn, stride_dvh, stride_dqb, stride_dqm, stride_dqh,
            stride_lb, stride_lh, stride_ab,
            nheads_k, group, seqlen_q, seqlen_k,
            sm_scale, qk_scale, cap_in, cap_out, window_left, window_right, dropout_p, drop_scale, seed,
            0, 0, 0, DK, DV,
            HEAD_DIM, BLOCK_D, BLOCK_M1, BLOCK_N1, VARLEN, HAS_LEFT, HAS_RIGHT, SOFTCAP, HAS_ALIBI, DROPOUT,
            False, USE_TMA1, DOT_PREC, DO_DK, DO_DV, False, False,
        )  # fmt: skip
    else:
        j = pid - n_kv_tiles
        g = j // n_q_tiles
        pid_m = j % n_q_tiles
        if REVERSE_M:
            pid_m = n_q_tiles - 1 - pid_m
        _dq_program(  # query head hk * group + g of the same sequence: row b * nheads + h
            pid_m, pid_bh * group + g,
            Q, K, V, DO, LSE, DELTA, DQ, ALIBI, CU_Q, CU_K, desc_k, desc_v,
            stride_qb, stride_qm, stride_qh, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh,
            stride_dob, stride_dom, stride_doh, stride_dqb, stride_dqm, stride_dqh,
            stride_lb, stride_lh, stride_ab,
            nheads_k * group, group, seqlen_q, seqlen_k,
            sm_scale, qk_scale, cap_in, cap_out, window_left, window_right, dropout_p, drop_scale, seed,
            0, 0, 0, DQ,
            HEAD_DIM, BLOCK_D, BLOCK_M2, BLOCK_N2, VARLEN, HAS_LEFT, HAS_RIGHT, SOFTCAP, HAS_ALIBI, DROPOUT,
            USE_TMA2, DOT_PREC, False,
        )  # fmt: skip


@triton.jit(do_not_specialize=["seqlen", "n_main", "steps", "piece_len", "max_pieces"])
def _tail_sum_kernel(
    WS, OUT, stride_ob, stride_or, stride_oh, nheads, seqlen, n_main, steps, piece_len, max_pieces,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr, COLS: tl.constexpr,
):  # fmt: skip
    """Grid ``(split tiles, BLOCK_D // COLS)``: the ``BLOCK_R`` rows of one split tile of ``OUT``
    (``(batch, seqlen, nheads, d)`` strides) = the sum of its pieces' float32 partials in ``WS``
    (fixed order: bit-identical run to run), cast to OUT's dtype. Tiles are numbered as in the
    1-D tail grid: row tile fastest, then (sequence, head)."""
    t = tl.program_id(0)
    col0 = tl.program_id(1) * COLS
    n_r = tl.cdiv(seqlen, BLOCK_R)
    pid_bh = (n_main + t) // n_r
    r0 = (n_main + t - pid_bh * n_r) * BLOCK_R
    b = pid_bh // nheads
    h = pid_bh % nheads
    n_pieces = ((t + 1) * steps - 1) // piece_len - (t * steps) // piece_len + 1
    acc = tl.zeros([BLOCK_R, COLS], dtype=tl.float32)
    for p in range(n_pieces):
        acc += tl.load(WS + tail_ws_offsets(t * max_pieces + p, col0, BLOCK_R, BLOCK_D, COLS)[0])
    offs_r = r0 + tl.arange(0, BLOCK_R)
    offs_d = col0 + tl.arange(0, COLS)
    ptrs = OUT + b.to(tl.int64) * stride_ob + h * stride_oh + offs_r[:, None] * stride_or + offs_d[None, :]
    tl.store(
        ptrs, acc.to(OUT.dtype.element_ty), mask=(offs_r[:, None] < seqlen) & (offs_d[None, :] < HEAD_DIM)
    )


# Compiled launches live on each kernel (kernel_launches, see flashpage.ops.launch_cache); the positions of each kernel's per-call arguments: its tensor / descriptor arguments, the LSE
# strides, seqlen_q, seqlen_k (the fused kernel: also its two tile counts) and the dropout seed.
_PRE_SLOTS = (0, 1, 2, 3, 10, 11, 13)
# (dK/dV and dQ: then the tail split's workspaces and numbers)
_DKDV_SLOTS = (*range(15), 36, 37, 41, 42, *range(51, 58))
_FUSED_SLOTS = (*range(16), 37, 38, 42, 43, 44, 45, 54)
_DQ_SLOTS = (*range(12), 27, 28, 32, 33, *range(42, 48))
_SUM_SLOTS = (0, 1, 6, 7, 8, 9, 10)


def _launch_bwd(
    prob: AttnProblem,
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    dq: Tensor,
    dk: Tensor,
    dv: Tensor,
    cu_q: Tensor | None,
    cu_k: Tensor | None,
    alibi_slopes: Tensor | None,
    seed: int,
    cfg: BwdConfig,
    resident: int | None = None,
) -> None:
    """Launch the backward kernels (``resident``: as :func:`flash_bwd`'s ``resident_programs``)."""
    d, vl = prob.head_dim, prob.varlen
    sq, sk = prob.seqlen_q, prob.seqlen_k
    cq = cu_q if cu_q is not None else q
    ck = cu_k if cu_k is not None else q
    delta = torch.empty_like(lse)
    stride_lb, stride_lh = lse_strides(prob, lse)
    pre_bm = 16 if q.device.type != "cuda" else 64
    pre_key = (
        prob.nheads, d, vl, q.dtype, q.device.index, out.stride(), dout.stride(),
        aligned(out, dout, delta, cq), int_spec(stride_lb), int_spec(stride_lh), int_spec(sq),
    )  # fmt: skip

    def build_pre() -> tuple[list[Any], dict[str, Any]]:
        args = [out, dout, delta, cq, *bsh_strides(out, vl), *bsh_strides(dout, vl), stride_lb, stride_lh,
                prob.nheads, sq]  # fmt: skip
        return args, {"HEAD_DIM": d, "BLOCK_D": prob.block_d, "BLOCK_M": pre_bm, "VARLEN": vl, "num_warps": 4}

    kernel_launches(_bwd_preprocess_kernel).launch(
        pre_key, (cdiv(sq, pre_bm), prob.batch * prob.nheads), _PRE_SLOTS,
        (out, dout, delta, cq, stride_lb, stride_lh, sq), build_pre,
    )  # fmt: skip

    alibi, stride_ab = alibi_args(alibi_slopes, q)
    tma_ok = cfg.use_tma and tma_supported(q.device)
    atomic = cfg.dq_mode in ("atomic", "atomic_tma")
    # Atomic dQ accumulates in float32; a float32 dq is its own accumulator.
    dq_acc = (
        (
            dq.zero_()
            if dq.dtype == torch.float32
            else torch.zeros(dq.shape, dtype=torch.float32, device=dq.device)
        )
        if atomic
        else dq
    )

    use_tma1 = tma_ok and tma_row_view_ok(q, vl, d) and tma_row_view_ok(dout, vl, d)
    desc_q = make_row_descriptor(q, vl, cfg.block_m1, d, checked=True) if use_tma1 else q
    desc_do = make_row_descriptor(dout, vl, cfg.block_m1, d, checked=True) if use_tma1 else dout
    # Bulk TMA reduce-adds need the real hardware (the 3.9 interpreter has no descriptor reductions):
    # elsewhere "atomic_tma" runs the scalar-atomic path (same arithmetic).
    dq_tma = (
        cfg.dq_mode == "atomic_tma"
        and q.device.type == "cuda"
        and tma_supported(q.device)
        and tma_row_view_ok(dq_acc, vl, d)
    )
    desc_dq = make_row_descriptor(dq_acc, vl, cfg.block_m1, d, checked=True) if dq_tma else dq_acc
    n_kv_tiles = cdiv(sk, cfg.block_n1)
    n_q_tiles = cdiv(sq, cfg.block_m2)

    grid1 = (n_kv_tiles, prob.batch * prob.nheads_k)
    # split_dkdv: one launch for dV, one for dK (+ atomic or fused dQ): one accumulator per program.
    passes = ((False, True), (True, False)) if cfg.split_dkdv else ((True, True),)
    fused = cfg.dq_mode == "fused"
    use_tma2 = not atomic and tma_ok and tma_row_view_ok(k, vl, d) and tma_row_view_ok(v, vl, d)
    desc_k = make_row_descriptor(k, vl, cfg.block_n2, d, checked=True) if use_tma2 else k
    desc_v = make_row_descriptor(v, vl, cfg.block_n2, d, checked=True) if use_tma2 else v
    # What every backward launch's compiled kernel and static arguments depend on (launch_cache doc).
    key = (
        prob.nheads, prob.nheads_k, d, vl, prob.softmax_scale, prob.window_left, prob.window_right,
        prob.softcap, prob.dropout_p, cfg, q.dtype, dq_acc.dtype, q.device.index, q.stride(), k.stride(),
        v.stride(), dout.stride(), dk.stride(), dv.stride(), dq_acc.stride(), dq.stride(), stride_ab,
        alibi_slopes is None, aligned(q, k, v, dout, lse, delta, dk, dv, dq_acc, dq, alibi, cq, ck),
        int_spec(stride_lb), int_spec(stride_lh), int_spec(sq), int_spec(sk), int_spec(seed),
        use_tma1, use_tma2, dq_tma,
    )  # fmt: skip

    def common_args() -> tuple[dict[str, Any], tuple[Any, ...]]:
        c = launch_common(prob, alibi_slopes)
        flags = {
            "HEAD_DIM": d, "BLOCK_D": prob.block_d, "VARLEN": vl, "HAS_LEFT": c["HAS_LEFT"],
            "HAS_RIGHT": c["HAS_RIGHT"], "SOFTCAP": c["SOFTCAP"], "HAS_ALIBI": c["HAS_ALIBI"],
            "DROPOUT": c["DROPOUT"], "DOT_PREC": dot_precision(q.dtype),
        }  # fmt: skip
        scalars = (
            prob.softmax_scale, c["qk_scale"], c["cap_in"], c["cap_out"], c["window_left"],
            c["window_right"], prob.dropout_p, 1.0 / (1.0 - prob.dropout_p), seed,
        )  # fmt: skip
        return flags, scalars

    def strides(*ts: Tensor) -> list[int]:
        return [s for t in ts for s in bsh_strides(t, vl)]

    # Tail split of the dK/dV and dQ launches (not the fused one, whose two kinds of programs
    # already share their last wave).
    split_ok = not fused and tail_split_applies(cfg, prob)
    for do_dk, do_dv in passes:
        if fused and do_dk:

            def build_fused(do_dv: bool = do_dv) -> tuple[list[Any], dict[str, Any]]:
                flags, scalars = common_args()
                args = [
                    q, k, v, dout, lse, delta, dk, dv, dq, alibi, cq, ck, desc_q, desc_do, desc_k, desc_v,
                    *strides(q, k, v, dout, dk, dv, dq), stride_lb, stride_lh, stride_ab, prob.nheads_k,
                    prob.group, sq, sk, n_kv_tiles, n_q_tiles, *scalars,
                ]  # fmt: skip
                kwargs = {
                    "BLOCK_M1": cfg.block_m1, "BLOCK_N1": cfg.block_n1, "BLOCK_M2": cfg.block_m2,
                    "BLOCK_N2": cfg.block_n2, "USE_TMA1": use_tma1, "USE_TMA2": use_tma2,
                    "REVERSE_M": prob.heavy_last, "DO_DK": True, "DO_DV": do_dv,
                    **flags,
                    "num_warps": cfg.num_warps, "num_stages": cfg.num_stages,
                }  # fmt: skip
                return args, kwargs

            kernel_launches(_bwd_fused_kernel).launch(
                (*key, do_dv, int_spec(n_kv_tiles), int_spec(n_q_tiles)),
                (n_kv_tiles + prob.group * n_q_tiles, prob.batch * prob.nheads_k), _FUSED_SLOTS,
                (q, k, v, dout, lse, delta, dk, dv, dq, alibi, cq, ck, desc_q, desc_do, desc_k, desc_v,
                 stride_lb, stride_lh, sq, sk, n_kv_tiles, n_q_tiles, seed),
                build_fused,
            )  # fmt: skip
            return

        def dkdv_values(split: TailSplit | None, dk_ws: Tensor, dv_ws: Tensor) -> tuple[Any, ...]:
            return (q, k, v, dout, lse, delta, dk, dv, dq_acc, alibi, cq, ck, desc_q, desc_do, desc_dq,
                    stride_lb, stride_lh, sq, sk, seed, dk_ws, dv_ws, *tail_split_numbers(split))  # fmt: skip

        def dkdv_builder(
            vals: tuple[Any, ...], tail: bool, do_dk: bool = do_dk, do_dv: bool = do_dv
        ) -> Callable[[], tuple[list[Any], dict[str, Any]]]:
            def build() -> tuple[list[Any], dict[str, Any]]:
                flags, scalars = common_args()
                args = [
                    *vals[:15], *strides(q, k, v, dout, dk, dv, dq_acc), stride_lb, stride_lh, stride_ab,
                    prob.nheads_k, prob.group, sq, sk, *scalars, *vals[20:],
                ]  # fmt: skip
                kwargs = {
                    "BLOCK_M": cfg.block_m1, "BLOCK_N": cfg.block_n1, "ATOMIC_DQ": atomic and do_dk,
                    "USE_TMA": use_tma1, "DO_DK": do_dk, "DO_DV": do_dv, "DQ_TMA": dq_tma,
                    "TAIL": tail, **flags,
                    "num_warps": cfg.num_warps, "num_stages": cfg.num_stages,
                }  # fmt: skip
                return args, kwargs

            return build

        def dkdv_placeholder(
            split: TailSplit, dkdv_values: Any = dkdv_values, dkdv_builder: Any = dkdv_builder
        ) -> tuple[tuple[Any, ...], Callable[[], tuple[list[Any], dict[str, Any]]]]:
            ws = lse.new_empty(4)
            vals = dkdv_values(split, ws, ws)
            return vals, dkdv_builder(vals, True)

        split = None
        if split_ok:
            split = plan_split_launch(
                kernel_launches(_bwd_dkdv_kernel), (*key, do_dk, do_dv, True), _DKDV_SLOTS, dkdv_placeholder,
                n_kv_tiles * prob.batch * prob.nheads_k, prob.group * cdiv(sq, cfg.block_m1), resident, q.device,
            )  # fmt: skip
        if split is None:
            vals = dkdv_values(None, lse, lse)
            kernel_launches(_bwd_dkdv_kernel).launch(
                (*key, do_dk, do_dv, False), grid1, _DKDV_SLOTS, vals, dkdv_builder(vals, False)
            )
            continue
        n_slots = split.tail_tiles * split.max_pieces
        dk_ws = lse.new_empty((n_slots, cfg.block_n1, prob.block_d)) if do_dk else lse
        dv_ws = lse.new_empty((n_slots, cfg.block_n1, prob.block_d)) if do_dv else lse
        vals = dkdv_values(split, dk_ws, dv_ws)
        kernel_launches(_bwd_dkdv_kernel).launch(
            (*key, do_dk, do_dv, True),
            (split.n_main + split.n_tail,),
            _DKDV_SLOTS,
            vals,
            dkdv_builder(vals, True),
        )
        for ws, grad in ((dk_ws, dk), (dv_ws, dv)):
            if ws is not lse:
                _sum_tail(split, ws, grad, prob.nheads_k, sk, cfg.block_n1, prob)
    if atomic:
        if dq_acc is not dq:
            dq.copy_(dq_acc)
        return

    def dq_values(split: TailSplit | None, dq_ws: Tensor) -> tuple[Any, ...]:
        return (q, k, v, dout, lse, delta, dq, alibi, cq, ck, desc_k, desc_v, stride_lb, stride_lh, sq, sk, seed,
                dq_ws, *tail_split_numbers(split))  # fmt: skip

    def dq_builder(vals: tuple[Any, ...], tail: bool) -> Callable[[], tuple[list[Any], dict[str, Any]]]:
        def build() -> tuple[list[Any], dict[str, Any]]:
            flags, scalars = common_args()
            args = [
                *vals[:12], *strides(q, k, v, dout, dq), stride_lb, stride_lh, stride_ab, prob.nheads, prob.group,
                sq, sk, *scalars, *vals[17:],
            ]  # fmt: skip
            kwargs = {
                "BLOCK_M": cfg.block_m2, "BLOCK_N": cfg.block_n2, "USE_TMA": use_tma2, "REVERSE_M": prob.heavy_last,
                "TAIL": tail, **flags, "num_warps": cfg.num_warps2, "num_stages": cfg.num_stages2,
            }  # fmt: skip
            return args, kwargs

        return build

    def dq_placeholder(
        split: TailSplit,
    ) -> tuple[tuple[Any, ...], Callable[[], tuple[list[Any], dict[str, Any]]]]:
        vals = dq_values(split, lse.new_empty(4))
        return vals, dq_builder(vals, True)

    n_q2 = cdiv(sq, cfg.block_m2)
    split = None
    if split_ok:
        split = plan_split_launch(
            kernel_launches(_bwd_dq_kernel), (*key, True), _DQ_SLOTS, dq_placeholder, n_q2 * prob.batch * prob.nheads,
            cdiv(sk, cfg.block_n2), resident, q.device,
        )  # fmt: skip
    if split is not None:
        dq_ws = lse.new_empty((split.tail_tiles * split.max_pieces, cfg.block_m2, prob.block_d))
        vals = dq_values(split, dq_ws)
        kernel_launches(_bwd_dq_kernel).launch(
            (*key, True), (split.n_main + split.n_tail,), _DQ_SLOTS, vals, dq_builder(vals, True)
        )
        _sum_tail(split, dq_ws, dq, prob.nheads, sq, cfg.block_m2, prob)
        return

    vals = dq_values(None, lse)
    kernel_launches(_bwd_dq_kernel).launch(
        (*key, False), (n_q2, prob.batch * prob.nheads), _DQ_SLOTS, vals, dq_builder(vals, False)
    )


def _sum_tail(
    split: TailSplit, ws: Tensor, grad: Tensor, nheads: int, seqlen: int, rows: int, prob: AttnProblem
) -> None:
    """``grad``'s split tiles (``rows`` rows each) = the sums of their pieces' partials in ``ws``."""
    cols = min(64, prob.block_d)
    sb, sr, sh = bsh_strides(grad, False)

    def build() -> tuple[list[Any], dict[str, Any]]:
        args = [
            ws,
            grad,
            sb,
            sr,
            sh,
            nheads,
            seqlen,
            split.n_main,
            split.steps,
            split.piece_len,
            split.max_pieces,
        ]
        return args, {"HEAD_DIM": prob.head_dim, "BLOCK_D": prob.block_d, "BLOCK_R": rows, "COLS": cols,
                      "num_warps": 4, "num_stages": 1}  # fmt: skip

    key = (nheads, rows, prob.head_dim, grad.dtype, grad.device.index, grad.stride(), aligned(ws, grad))
    values = (ws, grad, seqlen, split.n_main, split.steps, split.piece_len, split.max_pieces)
    kernel_launches(_tail_sum_kernel).launch(
        key, (split.tail_tiles, prob.block_d // cols), _SUM_SLOTS, values, build
    )


def flash_bwd(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
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
    deterministic: bool = False,
    config: BwdConfig | None = None,
    validate: bool = True,
    problem: AttnProblem | None = None,
    resident_programs: int | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """FlashAttention backward: gradients of ``out = attention(q, k, v)`` given ``dout``.

    Args:
        dout, out: like ``q``; ``lse``: the forward's float32 LSE (``(batch, nheads, seqlen_q)`` or
            varlen ``(nheads, total_q)``); other arguments exactly as passed to the forward
            (``seed`` must be the forward's dropout seed).
        deterministic: forbid atomics (dQ by its own kernel); gradients are then bit-identical run to run.
        config: tile configuration; default: the tuned table / autotuner.
        problem: the :func:`check_attention_inputs` result for exactly these q/k/v arguments, when
            the caller has already validated them (the eager API: skips a second check).
        resident_programs: programs the GPU runs at once, for the tail split of the dK/dV and dQ
            launches (``flash_fwd.TailSplit``; default as in :func:`flash_fwd`).

    Returns:
        ``dq`` like q, ``dk``/``dv`` like k/v (GQA: summed over each KV head's query heads).
    """
    prob = problem
    if prob is None:
        prob = check_attention_inputs(
            q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
            softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p, validate=validate,
        )  # fmt: skip
    for name, t in (("dout", dout), ("out", out)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
        if t.shape != q.shape or t.dtype != q.dtype or t.device != q.device:
            raise ValueError(
                f"{name} must match q: {tuple(q.shape)} {q.dtype}, got {tuple(t.shape)} {t.dtype}"
            )
    want_lse = prob.lse_shape(q.shape[0])
    if not isinstance(lse, Tensor) or tuple(lse.shape) != want_lse or lse.dtype != torch.float32:
        raise ValueError(f"lse must be a float32 tensor of shape {want_lse}")
    if needs_interpreter_upcast(q):
        grads = flash_bwd(
            dout.float(), q.float(), k.float(), v.float(), out.float(), lse, cu_seqlens_q=cu_seqlens_q,
            cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
            softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
            alibi_slopes=alibi_slopes, dropout_p=dropout_p, seed=seed, deterministic=deterministic,
            config=config, validate=False, resident_programs=resident_programs,
        )  # fmt: skip
        return tuple(g.to(q.dtype) for g in grads)  # type: ignore[return-value]
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    if out.stride(-1) != 1:
        out = out.contiguous()
    lse = lse.contiguous()
    alloc = torch.zeros if prob.varlen else torch.empty  # varlen padding rows are never written
    dq = alloc(q.shape, dtype=q.dtype, device=q.device)
    dk = alloc(k.shape, dtype=k.dtype, device=k.device)
    dv = alloc(v.shape, dtype=v.dtype, device=v.device)
    if q.numel() == 0 or k.numel() == 0 or prob.batch == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    args = (prob, dout, q, k, v, out, lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, alibi_slopes, seed)
    if config is None:
        if autotune_enabled() and q.device.type == "cuda":
            cands = bwd_candidates(prob.head_dim, q.device)
            if deterministic:
                cands = [c for c in cands if c.dq_mode in ("separate", "fused")]
            config = autotune(  # type: ignore[assignment]
                ("bwd", deterministic, *problem_key(prob, q, alibi_slopes is not None)),
                cands,
                lambda cfg: _launch_bwd(*args, cfg, resident_programs),  # type: ignore[arg-type]
            )
        else:
            config = bwd_config(prob.head_dim, q.dtype, prob.causal, q.device, prob.seqlen_k)
    assert config is not None
    if deterministic and config.dq_mode not in ("separate", "fused"):
        config = replace(config, dq_mode="separate")
    _launch_bwd(*args, config, resident_programs)
    return dq, dk, dv
