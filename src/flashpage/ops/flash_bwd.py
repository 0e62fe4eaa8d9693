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

from dataclasses import replace
from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from flashpage.ops.flash_configs import (
    BwdConfig,
    autotune,
    autotune_enabled,
    bwd_candidates,
    bwd_config,
    tma_supported,
)
from flashpage.ops.flash_fwd import (
    LOG2E,
    AttnProblem,
    _keep,
    _key_range,
    _load_rows,
    _row_off,
    _scores,
    _seq_bounds,
    _visible,
    alibi_args,
    bsh_strides,
    check_attention_inputs,
    dot_precision,
    launch_common,
    lse_strides,
    make_row_descriptor,
    needs_interpreter_upcast,
    problem_key,
    tma_row_view_ok,
)
from flashpage.ops.launch_cache import LaunchCache, aligned, cdiv, int_spec

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
    q_start, sq, _ks, _sk = _seq_bounds(b, CU_Q, CU_Q, seqlen_q, seqlen_q, VARLEN)
    m0 = pid_m * BLOCK_M
    if m0 >= sq:
        return
    o_off = _row_off(q_start, b, stride_om, stride_ob, VARLEN)
    do_off = _row_off(q_start, b, stride_dom, stride_dob, VARLEN)
    l_off = _row_off(q_start, b, 1, stride_lb, VARLEN)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    o = _load_rows(O + o_off + h * stride_oh, O, 0, 0, offs_m, offs_d, stride_om, sq,
                   HEAD_DIM, BLOCK_D, True, False)  # fmt: skip
    do = _load_rows(DO + do_off + h * stride_doh, DO, 0, 0, offs_m, offs_d, stride_dom, sq,
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
        q = _load_rows(q_ptr, desc_q, q_row0 + m0, q_col, offs_m, offs_d, stride_qm, sq,
                       HEAD_DIM, BLOCK_D, MASKED, USE_TMA)  # fmt: skip
        if MASKED:
            lse = tl.load(lse_ptr + offs_m, mask=offs_m < sq, other=0.0)
        else:
            lse = tl.load(lse_ptr + offs_m)
        qkT = tl.dot(k, tl.trans(q), input_precision=DOT_PREC)
        s, t = _scores(qkT, offs_m[None, :], offs_n[:, None], off, qk_scale, cap_in, cap_out, slope2,
                       SOFTCAP, HAS_ALIBI)  # fmt: skip
        pT = tl.math.exp2(s - (lse * LOG2E)[None, :])
        if MASKED:
            # where (not a -inf score) so rows without visible keys (lse = -inf) give 0, not NaN
            vis = _visible(offs_m[None, :], offs_n[:, None], off, sq, sk, window_left, window_right,
                           HAS_LEFT, HAS_RIGHT, True)  # fmt: skip
            pT = tl.where(vis, pT, 0.0)
        do = _load_rows(do_ptr, desc_do, q_row0 + m0, q_col, offs_m, offs_d, stride_dom, sq,
                        HEAD_DIM, BLOCK_D, MASKED, USE_TMA)  # fmt: skip
        if DROPOUT:
            keep = _keep(seed, rng_base, offs_m[None, :], offs_n[:, None], rng_sk, dropout_p)
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
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    VARLEN: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, DROPOUT: tl.constexpr, ATOMIC_DQ: tl.constexpr, USE_TMA: tl.constexpr,
    DOT_PREC: tl.constexpr, DO_DK: tl.constexpr, DO_DV: tl.constexpr, DQ_TMA: tl.constexpr,
):  # fmt: skip
    """dK/dV of KV tile ``pid_n`` of (sequence, KV head) ``pid_bh``: the body of the dK/dV kernel,
    also run by the dK/dV programs of the fused launch. No early ``return`` (the fused kernel calls
    this inside a branch), so the whole body sits under the tile's bounds check."""
    b = pid_bh // nheads_k
    hk = pid_bh % nheads_k
    q_start, sq, k_start, sk = _seq_bounds(b, CU_Q, CU_K, seqlen_q, seqlen_k, VARLEN)
    n0 = pid_n * BLOCK_N
    if n0 < sk:
        q_off = _row_off(q_start, b, stride_qm, stride_qb, VARLEN)
        do_off = _row_off(q_start, b, stride_dom, stride_dob, VARLEN)
        dq_off = _row_off(q_start, b, stride_dqm, stride_dqb, VARLEN)
        l_off = _row_off(q_start, b, 1, stride_lb, VARLEN)
        k_off = _row_off(k_start, b, stride_kn, stride_kb, VARLEN)
        v_off = _row_off(k_start, b, stride_vn, stride_vb, VARLEN)
        dk_off = _row_off(k_start, b, stride_dkn, stride_dkb, VARLEN)
        dv_off = _row_off(k_start, b, stride_dvn, stride_dvb, VARLEN)
        off = sk - sq
        nheads = nheads_k * group
        offs_n = n0 + tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        k = _load_rows(K + k_off + hk * stride_kh, K, 0, 0, offs_n, offs_d, stride_kn, sk,
                       HEAD_DIM, BLOCK_D, True, False)  # fmt: skip
        v = _load_rows(V + v_off + hk * stride_vh, V, 0, 0, offs_n, offs_d, stride_vn, sk,
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
        for g in range(0, group):  # GQA: sum over the query heads of this KV head
            h = hk * group + g
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
                    dq_ptr, m_lo, tl.minimum(fs, m_hi), offs_n, offs_d, stride_qm, stride_dom, stride_dqm,
                    sq, sk, off, sm_scale, qk_scale, cap_in, cap_out, slope2, window_left, window_right,
                    dropout_p, drop_scale, seed, rng_base, seqlen_k,
                    True, HEAD_DIM, BLOCK_D, BLOCK_M, HAS_LEFT, HAS_RIGHT, SOFTCAP, HAS_ALIBI, DROPOUT,
                    ATOMIC_DQ, USE_TMA, DOT_PREC, DO_DK, DO_DV, DQ_TMA,
                )  # fmt: skip
            dk, dv = _dkdv_tiles(  # fully visible query tiles
                dk, dv, k, v, q_ptr, do_ptr, desc_q, desc_do, desc_dq, q_start, h * HEAD_DIM, lse_ptr, delta_ptr,
                dq_ptr, fs, fe, offs_n, offs_d, stride_qm, stride_dom, stride_dqm,
                sq, sk, off, sm_scale, qk_scale, cap_in, cap_out, slope2, window_left, window_right,
                dropout_p, drop_scale, seed, rng_base, seqlen_k,
                False, HEAD_DIM, BLOCK_D, BLOCK_M, HAS_LEFT, HAS_RIGHT, SOFTCAP, HAS_ALIBI, DROPOUT,
                ATOMIC_DQ, USE_TMA, DOT_PREC, DO_DK, DO_DV, DQ_TMA,
            )  # fmt: skip
            dk, dv = _dkdv_tiles(  # left-window edge / query-sequence end
                dk, dv, k, v, q_ptr, do_ptr, desc_q, desc_do, desc_dq, q_start, h * HEAD_DIM, lse_ptr, delta_ptr,
                dq_ptr, tl.maximum(fe, fs), m_hi, offs_n, offs_d, stride_qm, stride_dom, stride_dqm,
                sq, sk, off, sm_scale, qk_scale, cap_in, cap_out, slope2, window_left, window_right,
                dropout_p, drop_scale, seed, rng_base, seqlen_k,
                True, HEAD_DIM, BLOCK_D, BLOCK_M, HAS_LEFT, HAS_RIGHT, SOFTCAP, HAS_ALIBI, DROPOUT,
                ATOMIC_DQ, USE_TMA, DOT_PREC, DO_DK, DO_DV, DQ_TMA,
            )  # fmt: skip

        st_mask = (offs_n[:, None] < sk) & (offs_d[None, :] < HEAD_DIM)
        dk_ptrs = DK + dk_off + hk * stride_dkh + offs_n[:, None] * stride_dkn + offs_d[None, :]
        dv_ptrs = DV + dv_off + hk * stride_dvh + offs_n[:, None] * stride_dvn + offs_d[None, :]
        if DO_DK:
            tl.store(dk_ptrs, dk.to(DK.dtype.element_ty), mask=st_mask)
        if DO_DV:
            tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=st_mask)


@triton.jit(do_not_specialize=["seed", "seqlen_q", "seqlen_k"])
def _bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, DQ, ALIBI, CU_Q, CU_K, desc_q, desc_do, desc_dq,
    stride_qb, stride_qm, stride_qh, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh,
    stride_dob, stride_dom, stride_doh, stride_dkb, stride_dkn, stride_dkh,
    stride_dvb, stride_dvn, stride_dvh, stride_dqb, stride_dqm, stride_dqh,
    stride_lb, stride_lh, stride_ab,
    nheads_k, group, seqlen_q, seqlen_k,
    sm_scale, qk_scale, cap_in, cap_out, window_left, window_right, dropout_p, drop_scale, seed,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    VARLEN: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, DROPOUT: tl.constexpr, ATOMIC_DQ: tl.constexpr, USE_TMA: tl.constexpr,
    DOT_PREC: tl.constexpr, DO_DK: tl.constexpr, DO_DV: tl.constexpr, DQ_TMA: tl.constexpr,
    HEADS_INNER: tl.constexpr,
):  # fmt: skip
    """Grid ``(KV tiles, batch * nheads_k)``, or with ``HEADS_INNER`` (causal: the first KV tiles are
    the heaviest) ``(batch * nheads_k, KV tiles)``: every head's heaviest tiles start first."""
    if HEADS_INNER:
        pid_n = tl.program_id(1)
        pid_bh = tl.program_id(0)
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
        HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, VARLEN, HAS_LEFT, HAS_RIGHT, SOFTCAP, HAS_ALIBI, DROPOUT,
        ATOMIC_DQ, USE_TMA, DOT_PREC, DO_DK, DO_DV, DQ_TMA,
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
        k = _load_rows(k_ptr, desc_k, k_row0 + n0, kv_col, offs_n, offs_d, stride_kn, sk,
                       HEAD_DIM, BLOCK_D, MASKED, USE_TMA)  # fmt: skip
        v = _load_rows(v_ptr, desc_v, k_row0 + n0, kv_col, offs_n, offs_d, stride_vn, sk,
                       HEAD_DIM, BLOCK_D, MASKED, USE_TMA)  # fmt: skip
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
        s, t = _scores(qk, offs_m[:, None], offs_n[None, :], off, qk_scale, cap_in, cap_out, slope2,
                       SOFTCAP, HAS_ALIBI)  # fmt: skip
        p = tl.math.exp2(s - lse2[:, None])
        if MASKED:
            vis = _visible(offs_m[:, None], offs_n[None, :], off, sq, sk, window_left, window_right,
                           HAS_LEFT, HAS_RIGHT, True)  # fmt: skip
            p = tl.where(vis, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)
        if DROPOUT:
            keep = _keep(seed, rng_base, offs_m[:, None], offs_n[None, :], rng_sk, dropout_p)
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
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    VARLEN: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, DROPOUT: tl.constexpr, USE_TMA: tl.constexpr, DOT_PREC: tl.constexpr,
):  # fmt: skip
    """dQ of query tile ``pid_m`` of (sequence, query head) ``pid_bh`` (the dQ kernel's body, also
    run by the dQ programs of the fused launch; no early ``return``, see :func:`_dkdv_program`)."""
    b = pid_bh // nheads
    h = pid_bh % nheads
    hk = h // group
    q_start, sq, k_start, sk = _seq_bounds(b, CU_Q, CU_K, seqlen_q, seqlen_k, VARLEN)
    m0 = pid_m * BLOCK_M
    if m0 < sq:
        q_off = _row_off(q_start, b, stride_qm, stride_qb, VARLEN)
        do_off = _row_off(q_start, b, stride_dom, stride_dob, VARLEN)
        dq_off = _row_off(q_start, b, stride_dqm, stride_dqb, VARLEN)
        l_off = _row_off(q_start, b, 1, stride_lb, VARLEN)
        k_off = _row_off(k_start, b, stride_kn, stride_kb, VARLEN)
        v_off = _row_off(k_start, b, stride_vn, stride_vb, VARLEN)
        off = sk - sq
        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        q = _load_rows(Q + q_off + h * stride_qh, Q, 0, 0, offs_m, offs_d, stride_qm, sq,
                       HEAD_DIM, BLOCK_D, True, False)  # fmt: skip
        do = _load_rows(DO + do_off + h * stride_doh, DO, 0, 0, offs_m, offs_d, stride_dom, sq,
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

        lo, fs, fe, hi = _key_range(
            m0, sk, off, window_left, window_right, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT
        )

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
        dq_ptrs = DQ + dq_off + h * stride_dqh + offs_m[:, None] * stride_dqm + offs_d[None, :]
        tl.store(dq_ptrs, dq.to(DQ.dtype.element_ty), mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM))


@triton.jit(do_not_specialize=["seed", "seqlen_q", "seqlen_k"])
def _bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, ALIBI, CU_Q, CU_K, desc_k, desc_v,
    stride_qb, stride_qm, stride_qh, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh,
    stride_dob, stride_dom, stride_doh, stride_dqb, stride_dqm, stride_dqh,
    stride_lb, stride_lh, stride_ab,
    nheads, group, seqlen_q, seqlen_k,
    sm_scale, qk_scale, cap_in, cap_out, window_left, window_right, dropout_p, drop_scale, seed,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    VARLEN: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, DROPOUT: tl.constexpr, USE_TMA: tl.constexpr, REVERSE_M: tl.constexpr,
    DOT_PREC: tl.constexpr,
):  # fmt: skip
    if REVERSE_M:  # causal: grid (batch * nheads, query tiles), every head's heaviest tiles first
        pid_m = tl.num_programs(1) - 1 - tl.program_id(1)
        pid_bh = tl.program_id(0)
    else:
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1)
    _dq_program(
        pid_m, pid_bh,
        Q, K, V, DO, LSE, DELTA, DQ, ALIBI, CU_Q, CU_K, desc_k, desc_v,
        stride_qb, stride_qm, stride_qh, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh,
        stride_dob, stride_dom, stride_doh, stride_dqb, stride_dqm, stride_dqh,
        stride_lb, stride_lh, stride_ab,
        nheads, group, seqlen_q, seqlen_k,
        sm_scale, qk_scale, cap_in, cap_out, window_left, window_right, dropout_p, drop_scale, seed,
        HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, VARLEN, HAS_LEFT, HAS_RIGHT, SOFTCAP, HAS_ALIBI, DROPOUT,
        USE_TMA, DOT_PREC,
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
    HEADS_INNER: tl.constexpr,
):  # fmt: skip
    """dK/dV and dQ in one launch (``dq_mode="fused"``, the layout of FlexAttention's backward).

    Grid ``(n_kv_tiles + group * n_q_tiles, batch * nheads_k)``: per (sequence, KV head), programs
    ``[0, n_kv_tiles)`` are its dK/dV tiles, the rest the dQ tiles of its ``group`` query heads
    (heaviest first when causal). Both kinds then share the GPU's waves: the shorter dQ programs fill
    the last wave of dK/dV work instead of each kernel ending on its own partly idle wave, and the
    dQ programs of a head run while its K/V are still in L2. ``HEADS_INNER`` (causal) swaps the grid's
    axes: the tiles of one index start together for all heads, heaviest first, lightest last."""
    if HEADS_INNER:
        pid = tl.program_id(1)
        pid_bh = tl.program_id(0)
    else:
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
            HEAD_DIM, BLOCK_D, BLOCK_M1, BLOCK_N1, VARLEN, HAS_LEFT, HAS_RIGHT, SOFTCAP, HAS_ALIBI, DROPOUT,
            False, USE_TMA1, DOT_PREC, DO_DK, DO_DV, False,
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
            HEAD_DIM, BLOCK_D, BLOCK_M2, BLOCK_N2, VARLEN, HAS_LEFT, HAS_RIGHT, SOFTCAP, HAS_ALIBI, DROPOUT,
            USE_TMA2, DOT_PREC,
        )  # fmt: skip


# Compiled launches of the four backward kernels by launch key (see flashpage.ops.launch_cache), and
# the positions of each kernel's per-call arguments: its tensor / descriptor arguments, the LSE
# strides, seqlen_q, seqlen_k (the fused kernel: also its two tile counts) and the dropout seed.
_PRE_LAUNCHES = LaunchCache(_bwd_preprocess_kernel)
_DKDV_LAUNCHES = LaunchCache(_bwd_dkdv_kernel)
_FUSED_LAUNCHES = LaunchCache(_bwd_fused_kernel)
_DQ_LAUNCHES = LaunchCache(_bwd_dq_kernel)
_PRE_SLOTS = (0, 1, 2, 3, 10, 11, 13)
_DKDV_SLOTS = (*range(15), 36, 37, 41, 42, 51)
_FUSED_SLOTS = (*range(16), 37, 38, 42, 43, 44, 45, 54)
_DQ_SLOTS = (*range(12), 27, 28, 32, 33, 42)


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
) -> None:
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

    _PRE_LAUNCHES.launch(
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

    def heads_inner(grid: tuple[int, int]) -> tuple[int, int]:
        """Causal launches put the heads on the grid's first (fastest-starting) axis."""
        return (grid[1], grid[0]) if prob.heavy_last else grid

    grid1 = heads_inner((n_kv_tiles, prob.batch * prob.nheads_k))
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
                    "REVERSE_M": prob.heavy_last, "DO_DK": True, "DO_DV": do_dv, "HEADS_INNER": prob.heavy_last,
                    **flags,
                    "num_warps": cfg.num_warps, "num_stages": cfg.num_stages,
                }  # fmt: skip
                return args, kwargs

            _FUSED_LAUNCHES.launch(
                (*key, do_dv, int_spec(n_kv_tiles), int_spec(n_q_tiles)),
                heads_inner((n_kv_tiles + prob.group * n_q_tiles, prob.batch * prob.nheads_k)), _FUSED_SLOTS,
                (q, k, v, dout, lse, delta, dk, dv, dq, alibi, cq, ck, desc_q, desc_do, desc_k, desc_v,
                 stride_lb, stride_lh, sq, sk, n_kv_tiles, n_q_tiles, seed),
                build_fused,
            )  # fmt: skip
            return

        def build_dkdv(do_dk: bool = do_dk, do_dv: bool = do_dv) -> tuple[list[Any], dict[str, Any]]:
            flags, scalars = common_args()
            args = [
                q, k, v, dout, lse, delta, dk, dv, dq_acc, alibi, cq, ck, desc_q, desc_do, desc_dq,
                *strides(q, k, v, dout, dk, dv, dq_acc), stride_lb, stride_lh, stride_ab, prob.nheads_k,
                prob.group, sq, sk, *scalars,
            ]  # fmt: skip
            kwargs = {
                "BLOCK_M": cfg.block_m1, "BLOCK_N": cfg.block_n1, "ATOMIC_DQ": atomic and do_dk,
                "USE_TMA": use_tma1, "DO_DK": do_dk, "DO_DV": do_dv, "DQ_TMA": dq_tma,
                "HEADS_INNER": prob.heavy_last, **flags,
                "num_warps": cfg.num_warps, "num_stages": cfg.num_stages,
            }  # fmt: skip
            return args, kwargs

        _DKDV_LAUNCHES.launch(
            (*key, do_dk, do_dv), grid1, _DKDV_SLOTS,
            (q, k, v, dout, lse, delta, dk, dv, dq_acc, alibi, cq, ck, desc_q, desc_do, desc_dq,
             stride_lb, stride_lh, sq, sk, seed),
            build_dkdv,
        )  # fmt: skip
    if atomic:
        if dq_acc is not dq:
            dq.copy_(dq_acc)
        return

    def build_dq() -> tuple[list[Any], dict[str, Any]]:
        flags, scalars = common_args()
        args = [
            q, k, v, dout, lse, delta, dq, alibi, cq, ck, desc_k, desc_v, *strides(q, k, v, dout, dq),
            stride_lb, stride_lh, stride_ab, prob.nheads, prob.group, sq, sk, *scalars,
        ]  # fmt: skip
        kwargs = {
            "BLOCK_M": cfg.block_m2, "BLOCK_N": cfg.block_n2, "USE_TMA": use_tma2,
            "REVERSE_M": prob.heavy_last, **flags, "num_warps": cfg.num_warps2, "num_stages": cfg.num_stages2,
        }  # fmt: skip
        return args, kwargs

    _DQ_LAUNCHES.launch(
        key, heads_inner((cdiv(sq, cfg.block_m2), prob.batch * prob.nheads)), _DQ_SLOTS,
        (q, k, v, dout, lse, delta, dq, alibi, cq, ck, desc_k, desc_v, stride_lb, stride_lh, sq, sk, seed),
        build_dq,
    )  # fmt: skip


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
            config=config, validate=False,
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
                lambda cfg: _launch_bwd(*args, cfg),  # type: ignore[arg-type]
            )
        else:
            config = bwd_config(prob.head_dim, q.dtype, prob.causal, q.device, prob.seqlen_k)
    assert config is not None
    if deterministic and config.dq_mode not in ("separate", "fused"):
        config = replace(config, dq_mode="separate")
    _launch_bwd(*args, config)
    return dq, dk, dv
