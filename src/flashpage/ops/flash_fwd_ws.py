"""FlashAttention forward for Hopper (sm_90) as a warp-specialized Gluon kernel: FA3's schedule.

Why a second forward kernel: Triton's compiler cannot overlap the softmax with the tensor cores on
sm_90. It waits for every QK^T ``wgmma`` right after issuing it, and its warp specialization does
not run on Hopper (triton 3.6 / 3.9). Gluon (``triton.experimental.gluon``, in both releases) exposes
asynchronous ``warpgroup_mma``, ``warpgroup_mma_wait(num_outstanding)``, TMA, mbarriers and
``gl.warp_specialize``. This kernel uses them to build FlashAttention-3's forward
(Shah et al. 2024, section 3):

- A CTA owns ``2 * BLOCK_M = 128`` query rows of one (batch, head) in three partitions. Two
  consumer warpgroups each hold 64 rows (the default partition and a 4-warp worker, 240 registers
  each). A 1-warp producer (24 registers) streams Q and a ``STAGES``-deep ring of K/V tiles by TMA.
  Ring slots are freed by "empty" mbarriers that both consumers arrive on.
- **Ping-pong**: the consumers take turns issuing their wgmmas. Two "turn" mbarriers order them,
  so one warpgroup's softmax runs while the other's GEMMs occupy the tensor cores.
- **Intra-warpgroup overlap**: inside a consumer, the QK^T of key tile ``j+1`` and the PV of tile
  ``j`` are in flight while the exp2s of tile ``j+1`` wait only for the QK^T
  (``num_outstanding=1``).
- **Tail split**: when the row tiles end in a partial wave (d=128 at 16k tokens: 2048 tiles over
  132 SMs is 15.5 waves), the last tiles' key ranges are dealt evenly to every SM.
  :class:`flash_fwd.TailSplit` decides the dealing. Those programs leave float32 partials that
  ``flash_fwd``'s combine kernel merges, the same workspace format the Triton kernel writes.

Scope (everything else takes the Triton kernel, see :func:`ws_applies`): CUDA sm_90, bf16/fp16,
head dim 64 or 128, padded batches (no varlen), no dropout / softcap / ALiBi / window, and
``seqlen_q`` and ``seqlen_k`` multiples of 128. Causal problems need ``seqlen_k >= seqlen_q``. Their
row tiles run heaviest first with no tail split.

Layout: ``q`` ``(batch, seqlen_q, nheads, d)`` and ``k``, ``v`` ``(batch, seqlen_k, nheads_k, d)``,
read as 2-D ``(rows, nheads * d)`` TMA views. The output is written the same way. ``lse`` is
``(batch, nheads, seqlen_q)`` float32, natural log.

Gluon kernels do not run under the Triton interpreter. On a CPU-only machine,
:func:`compile_ptx` compiles this kernel for sm_90 (tests check the schedule in its PTX). GPU
correctness is covered by ``tests/ops/test_flash_fwd_ws.py`` on an H200.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from flashpage.ops.launch_cache import KERNEL_OPTIONS, aligned, int_specs, kernel_launches

__all__ = [
    "WS_BLOCK_M",
    "WS_BLOCK_N",
    "compile_ptx",
    "launch_ws_fwd",
    "online_softmax_step",
    "tma_load",
    "tma_store",
]

# triton 3.6 names the TMA copies async_copy_global_to_shared / async_copy_shared_to_global; 3.9 has
# async_load / async_store (the old names raise there).
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global

WS_BLOCK_M = 128  # query rows per CTA (64 per consumer warpgroup)
WS_BLOCK_N = 128  # keys per K/V tile
# Default K/V ring depth; the Hopper table picks per bucket (H200, d=128: 3 stages 643 vs 636 TFLOP/s
# at 16k, 2 stages 630 vs 599 at 4k).
_STAGES = 2
# Registers per thread: 12 warps x 168 = the whole register file; setmaxnreg then moves them to the
# consumers (2 x 128 threads x 240) from the producer (24). In the first probe 232 / 40 read 2.5% slower
# non-causal and 2% faster causal at d=128 16k: one setting is kept for both.
_MAXNREG = 168
_CONSUMER_REGS = 240
_PRODUCER_REGS = 24


@gluon.jit
def _piece(pid, n_main, tail_work, piece_len):
    """Tail program ``pid``'s share ``[it0, it1)`` of the tail's key-tile steps (``TailSplit``)."""
    it0 = (pid - n_main) * piece_len
    return it0, gl.minimum(it0 + piece_len, tail_work)


@gluon.jit
def _segment(i, sched, CAUSAL: gl.constexpr, TAIL: gl.constexpr, BM2: gl.constexpr, BN: gl.constexpr):
    """Segment ``i`` of this program (``sched``: see :func:`_attn_fwd_ws_kernel`):
    ``(b, h, m0, lo, hi, slot)``, query rows ``[m0, m0 + BM2)`` of (``b``, ``h``) over key tiles
    ``[lo, hi)``. Programs below ``n_main``
    have one segment, a whole row tile (``slot = -1``: write the output). A tail program's piece
    covers one or two tiles' key ranges, each ending in workspace ``slot``. Row tiles are numbered
    as ``flash_fwd._tile_coords`` numbers them (row tiles fastest), except causal ones: there all
    (batch, head)s' last row tiles (the heaviest) come first."""
    pid, n_main, tail_work, piece_len, max_pieces, n_m, nheads, _group, batch_heads, sq, sk = sched
    kv_tiles = sk // BN
    tile = pid
    lo = 0
    hi = kv_tiles
    slot = -1  # a constant unless TAIL: launches without a tail split compile no workspace code
    if TAIL and pid >= n_main:
        j = pid - n_main
        it0, it1 = _piece(pid, n_main, tail_work, piece_len)
        t = it0 // kv_tiles + i
        t0 = t * kv_tiles
        lo = gl.maximum(it0, t0) - t0
        hi = gl.minimum(it1, t0 + kv_tiles) - t0
        slot = t * max_pieces + j - t0 // piece_len
        tile = n_main + t
    if CAUSAL:
        pid_m = n_m - 1 - tile // batch_heads
        bh = tile % batch_heads
    else:
        bh = tile // n_m
        pid_m = tile - bh * n_m
    m0 = pid_m * BM2
    if CAUSAL:  # keys past the tile's last row (plus the bottom-right offset) are all masked
        hi = gl.minimum(hi, (m0 + BM2 + sk - sq + BN - 1) // BN)
    return bh // nheads, bh % nheads, m0, lo, hi, slot


@gluon.jit
def _n_segments(sched, TAIL: gl.constexpr, BN: gl.constexpr):
    """How many segments this program has (see :func:`_segment`)."""
    pid, n_main, tail_work, piece_len, _max_pieces, _n_m, _nheads, _group, _batch_heads, _sq, sk = sched
    kv_tiles = sk // BN
    n = 1
    if TAIL and pid >= n_main:
        it0, it1 = _piece(pid, n_main, tail_work, piece_len)
        n = (it1 - 1) // kv_tiles - it0 // kv_tiles + 1
    return n


@gluon.jit
def online_softmax_step(s, m_i, l_i, qk_scale):
    """Online softmax of one score tile in base 2 (scale folded into the exp2's FMA):
    ``(p, m, l, alpha)``."""
    m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
    p = gl.exp2(s * qk_scale - m_new[:, None])
    alpha = gl.exp2(m_i - m_new)
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, m_new, l_i, alpha


@gluon.jit
def _causal_mask(s, q0, k0, off, BM: gl.constexpr, BN: gl.constexpr, layout: gl.constexpr):
    """``s`` with keys after each query row (bottom-right aligned: row ``i`` sees keys ``<= i +
    off``) set to ``-inf``; ``q0`` / ``k0``: the tile's first row / key."""
    rows = q0 + off + gl.arange(0, BM, layout=gl.SliceLayout(1, layout))
    cols = k0 + gl.arange(0, BN, layout=gl.SliceLayout(0, layout))
    return gl.where(cols[None, :] <= rows[:, None], s, float("-inf"))


@gluon.jit
def _kv_step(
    q_buf, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, my_turn, other_turn, it, p, m_i, l_i, acc,
    s_zero, qk_scale, q0, kt, off, MASK: gl.constexpr, STAGES: gl.constexpr, BM: gl.constexpr,
    BN: gl.constexpr, HEAD_DIM: gl.constexpr,
):  # fmt: skip
    """One pipelined step of a consumer: the QK^T of key tile ``kt`` (ring position ``it + 1``) and
    the PV of the previous tile (``p``, position ``it``) issued in its turn, the softmax of tile
    ``kt`` while the PV runs. Returns ``(p, m, l, acc)`` with ``acc`` rescaled to the new max."""
    s_layout: gl.constexpr = s_zero.type.layout
    o_layout: gl.constexpr = acc.type.layout
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    st = it % STAGES
    nst = (it + 1) % STAGES
    mbarrier.wait(k_ready.index(nst), ((it + 1) // STAGES) & 1)
    mbarrier.wait(my_turn, (it + 1) & 1)
    s = warpgroup_mma(q_buf, k_smem.index(nst).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    mbarrier.wait(v_ready.index(st), (it // STAGES) & 1)
    p_op = gl.convert_layout(p.to(q_buf.dtype), p_layout)
    acc = warpgroup_mma(p_op, v_smem.index(st), acc, is_async=True)
    mbarrier.arrive(other_turn, count=1)
    s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))  # the QK^T; the PV stays in flight
    mbarrier.arrive(k_empty.index(nst), count=1)
    if MASK:
        s = _causal_mask(s, q0, kt * BN, off, BM, BN, s_layout)
    p, m_i, l_i, alpha = online_softmax_step(s, m_i, l_i, qk_scale)
    acc, p_op = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p_op))
    mbarrier.arrive(v_empty.index(st), count=1)
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
    return p, m_i, l_i, acc


@gluon.jit
def _store_output(o_desc, lse_ptr, q_buf, acc, m_i, l_i, b, h, sq, q0, stride_lb, stride_lh,
                  HEAD_DIM: gl.constexpr):  # fmt: skip
    """Epilogue of a whole row tile's half: ``acc / l`` through ``q_buf`` (Q is consumed) and a TMA
    store, and the natural-log LSE (every row saw a key: no empty rows on this path)."""
    BM: gl.constexpr = acc.shape[0]
    row_layout: gl.constexpr = m_i.type.layout
    rows = gl.arange(0, BM, layout=row_layout)
    lse = (m_i + gl.log2(l_i)) * 0.6931471805599453
    gl.store(lse_ptr + b.to(gl.int64) * stride_lb + h * stride_lh + q0 + rows, lse)
    acc = acc / gl.convert_layout(l_i, gl.SliceLayout(1, acc.type.layout))[:, None]
    q_buf.store(acc.to(q_buf.dtype))
    fence_async_shared()
    tma_store(o_desc, [b * sq + q0, h * HEAD_DIM], q_buf)
    tma.store_wait(pendings=0)


@gluon.jit
def _store_partial(acc_ws, ml_ws, acc, m_i, l_i, slot, WG: gl.constexpr, BM: gl.constexpr,
                   HEAD_DIM: gl.constexpr):  # fmt: skip
    """A tail piece's unnormalised state into workspace ``slot``, in ``flash_fwd._ws_offsets``'
    layout: ``acc (2 * BM, HEAD_DIM)`` per slot, then ``m`` and ``l`` (``(2, 2 * BM)``)."""
    o_layout: gl.constexpr = acc.type.layout
    orows = WG * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, o_layout))
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    acc_base = acc_ws + slot.to(gl.int64) * (2 * BM * HEAD_DIM)
    gl.store(acc_base + orows[:, None] * HEAD_DIM + cols[None, :], acc)
    ml_base = ml_ws + slot.to(gl.int64) * (4 * BM) + WG * BM + gl.arange(0, BM, layout=m_i.type.layout)
    gl.store(ml_base, m_i)
    gl.store(ml_base + 2 * BM, l_i)


@gluon.jit
def _producer(
    a, CAUSAL: gl.constexpr, TAIL: gl.constexpr, STAGES: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
    HEAD_DIM: gl.constexpr, WG: gl.constexpr,
):  # fmt: skip
    """The 1-warp TMA partition: per segment both Q halves, then its K/V tiles through the ring."""
    descs, smem, bars, sched, _epi = a
    q_desc, k_desc, v_desc = descs[0], descs[1], descs[2]
    q_smem, k_smem, v_smem = smem
    q_bar, q_empty, k_ready, v_ready, k_empty, v_empty = bars[0], bars[1], bars[2], bars[3], bars[4], bars[5]
    group, sq, sk = sched[7], sched[9], sched[10]
    it = 0  # K/V tiles loaded so far: ring slot and phase
    for i in range(_n_segments(sched, TAIL, BN)):
        b, h, m0, lo, hi, _slot = _segment(i, sched, CAUSAL, TAIL, 2 * BM, BN)
        kv_col = (h // group) * HEAD_DIM
        for c in gl.static_range(2):
            # Mbarriers start with phase 1 complete: the first wait on an "empty" barrier passes.
            mbarrier.wait(q_empty.index(c), (i & 1) ^ 1)
            mbarrier.expect(q_bar.index(c), q_desc.block_type.nbytes)
            tma_load(q_desc, [b * sq + m0 + c * BM, h * HEAD_DIM], q_bar.index(c), q_smem.index(c))
        for j in range(lo, hi):
            st = it % STAGES
            ph = (it // STAGES) & 1
            row = b * sk + j * BN
            mbarrier.wait(k_empty.index(st), ph ^ 1)
            mbarrier.expect(k_ready.index(st), k_desc.block_type.nbytes)
            tma_load(k_desc, [row, kv_col], k_ready.index(st), k_smem.index(st))
            mbarrier.wait(v_empty.index(st), ph ^ 1)
            mbarrier.expect(v_ready.index(st), v_desc.block_type.nbytes)
            tma_load(v_desc, [row, kv_col], v_ready.index(st), v_smem.index(st))
            it += 1


@gluon.jit
def _consumer(
    a, CAUSAL: gl.constexpr, TAIL: gl.constexpr, STAGES: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
    HEAD_DIM: gl.constexpr, WG: gl.constexpr,
):  # fmt: skip
    """Consumer warpgroup ``WG`` (0: the default partition, 1: a worker): rows ``[m0 + WG * BM,
    m0 + (WG + 1) * BM)`` of each segment, its wgmmas issued in turn with the other consumer's."""
    descs, smem, bars, sched, epi = a
    o_desc = descs[3]
    q_smem, k_smem, v_smem = smem
    q_bar, q_empty, k_ready, v_ready, k_empty, v_empty, turn = bars
    lse_ptr, acc_ws, ml_ws, qk_scale, stride_lb, stride_lh = epi
    sq, sk = sched[9], sched[10]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16]
    )
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    my_turn = turn.index(WG)
    other_turn = turn.index(1 - WG)
    q_buf = q_smem.index(WG)
    s_zero = gl.zeros([BM, BN], gl.float32, s_layout)
    off = sk - sq

    if WG == 1:
        mbarrier.arrive(other_turn, count=1)  # consumer 0 issues first
    it = 0  # K/V tiles consumed so far: ring slot, its phase and the turn phase
    for i in range(_n_segments(sched, TAIL, BN)):
        b, h, m0, lo, hi, slot = _segment(i, sched, CAUSAL, TAIL, 2 * BM, BN)
        q0 = m0 + WG * BM
        m_i = gl.full([BM], float("-inf"), gl.float32, row_layout)
        l_i = gl.zeros([BM], gl.float32, row_layout)
        acc = gl.zeros([BM, HEAD_DIM], gl.float32, o_layout)

        # The segment's first QK^T, alone: nothing to overlap it with yet.
        mbarrier.wait(q_bar.index(WG), i & 1)
        st = it % STAGES
        mbarrier.wait(k_ready.index(st), (it // STAGES) & 1)
        mbarrier.wait(my_turn, it & 1)
        s = warpgroup_mma(q_buf, k_smem.index(st).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        mbarrier.arrive(other_turn, count=1)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        mbarrier.arrive(k_empty.index(st), count=1)
        if CAUSAL:
            s = _causal_mask(s, q0, lo * BN, off, BM, BN, s_layout)
        p, m_i, l_i, _alpha = online_softmax_step(s, m_i, l_i, qk_scale)

        n_plain = hi - 1
        if CAUSAL:
            n_plain = hi - 2  # the diagonal tile, the segment's last, is stepped with its mask below
        for j in range(lo, n_plain):
            p, m_i, l_i, acc = _kv_step(
                q_buf, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, my_turn, other_turn, it, p, m_i,
                l_i, acc, s_zero, qk_scale, q0, j + 1, off, False, STAGES, BM, BN, HEAD_DIM,
            )  # fmt: skip
            it += 1
        if CAUSAL:  # noqa: SIM102 (a compile-time branch around a run-time one)
            if hi - lo > 1:
                p, m_i, l_i, acc = _kv_step(
                    q_buf, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, my_turn, other_turn, it, p,
                    m_i, l_i, acc, s_zero, qk_scale, q0, hi - 1, off, True, STAGES, BM, BN, HEAD_DIM,
                )  # fmt: skip
                it += 1

        # The last tile's PV.
        st = it % STAGES
        mbarrier.wait(v_ready.index(st), (it // STAGES) & 1)
        p_op = gl.convert_layout(
            p.to(q_buf.dtype), gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        )
        acc = warpgroup_mma(p_op, v_smem.index(st), acc, is_async=True)
        acc, p_op = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p_op))
        mbarrier.arrive(v_empty.index(st), count=1)
        it += 1

        if TAIL:
            if slot < 0:
                _store_output(o_desc, lse_ptr, q_buf, acc, m_i, l_i, b, h, sq, q0, stride_lb, stride_lh,
                              HEAD_DIM)  # fmt: skip
            else:
                _store_partial(acc_ws, ml_ws, acc, m_i, l_i, slot, WG, BM, HEAD_DIM)
        else:
            _store_output(o_desc, lse_ptr, q_buf, acc, m_i, l_i, b, h, sq, q0, stride_lb, stride_lh, HEAD_DIM)
        mbarrier.arrive(q_empty.index(WG), count=1)


@gluon.jit
def _attn_fwd_ws_kernel(
    q_desc, k_desc, v_desc, o_desc, lse_ptr, acc_ws, ml_ws,
    stride_lb, stride_lh, nheads, group, batch_heads, sq, sk, qk_scale,
    n_main, tail_work, piece_len, max_pieces,
    CAUSAL: gl.constexpr, TAIL: gl.constexpr, HEAD_DIM: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
    STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, num_warps: gl.constexpr,
):  # fmt: skip
    """1-D grid: ``n_main`` whole row tiles, then the tail pieces (:func:`_segment`). The partitions
    share one argument tuple ``(descs, smem, bars, sched, epi)``: worker partitions take no
    distributed tensors, only scalars, descriptors and shared memory, and the same signature."""
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [2, BM, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BN, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BN, HEAD_DIM], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for c in gl.static_range(2):
        mbarrier.init(q_bar.index(c), count=1)
        mbarrier.init(q_empty.index(c), count=1)
        mbarrier.init(turn.index(c), count=1)
    for st in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(st), count=1)
        mbarrier.init(v_ready.index(st), count=1)
        mbarrier.init(k_empty.index(st), count=2)  # both consumers release a slot
        mbarrier.init(v_empty.index(st), count=2)
    a = (
        (q_desc, k_desc, v_desc, o_desc),
        (q_smem, k_smem, v_smem),
        (q_bar, q_empty, k_ready, v_ready, k_empty, v_empty, turn),
        (gl.program_id(0), n_main, tail_work, piece_len, max_pieces, sq // (2 * BM), nheads, group,
         batch_heads, sq, sk),
        (lse_ptr, acc_ws, ml_ws, qk_scale, stride_lb, stride_lh),
    )  # fmt: skip
    gl.warp_specialize(
        [
            (_consumer, (a, CAUSAL, TAIL, STAGES, BM, BN, HEAD_DIM, 0)),
            (_consumer, (a, CAUSAL, TAIL, STAGES, BM, BN, HEAD_DIM, 1)),
            (_producer, (a, CAUSAL, TAIL, STAGES, BM, BN, HEAD_DIM, 2)),
        ],
        [4, 1],
        [CONSUMER_REGS, PRODUCER_REGS],
    )


@functools.cache
def _smem_layout(rows: int, head_dim: int, dtype: torch.dtype) -> Any:
    gdt = gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
    return gl.NVMMASharedLayout.get_default_for([rows, head_dim], gdt)


def _descriptor(t: Tensor, rows: int, head_dim: int) -> TensorDescriptor:
    """2-D TMA descriptor over ``(batch, seqlen, heads, d)`` ``t`` as ``(batch * seqlen, heads * d)``
    with ``[rows, d]`` boxes (``flash_fwd.tma_row_view_ok`` holds for ``t``)."""
    return TensorDescriptor(
        t, [t.shape[0] * t.shape[1], t.shape[2] * head_dim], [t.stride(1), 1], [rows, head_dim],
        _smem_layout(rows, head_dim, t.dtype),
    )  # fmt: skip


# Compiled launches by launch key (see launch_cache): the host cost of ``kernel[grid]`` (argument
# binding, specialisation, four descriptors' checks) is most of a 1k-token forward's kernel time.
# Per-call arguments: the descriptors, the LSE / workspace tensors, the LSE strides, the batch-wide
# sizes and the tail split's numbers.
_SLOTS = (0, 1, 2, 3, 4, 5, 6, 7, 8, 11, 12, 13, 15, 16, 17, 18)


def launch_ws_fwd(
    q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, *, softmax_scale: float, causal: bool,
    stages: int = _STAGES, tail: tuple[int, int, int, int, int] | None = None, acc_ws: Tensor | None = None,
    ml_ws: Tensor | None = None,
) -> None:  # fmt: skip
    """Launch the warp-specialized forward (inputs already validated by ``flash_fwd``, and
    ``ws_applies`` true for them).

    Args:
        q, k, v, out: ``(batch, seqlen, heads, d)`` 2-D TMA-readable views (see module doc).
        lse: ``(batch, nheads, seqlen_q)`` float32, strides ``(*, *, 1)``.
        stages: K/V ring depth (2 or 3: 164 / 228 KB of shared memory at d=128).
        tail: ``(n_main, n_tail, tail_work, piece_len, max_pieces)`` of a ``TailSplit``, with its
            ``acc_ws`` ``(slots, 128, d)`` and ``ml_ws`` ``(slots, 2, 128)`` float32 workspaces; the
            caller runs the combine. ``None``: one program per row tile.
    """
    batch, sq, nheads, d = q.shape
    sk, nheads_k = k.shape[1], k.shape[2]
    bm, bn = WS_BLOCK_M // 2, WS_BLOCK_N
    if tail is None:
        n_main, n_tail, tail_work, piece_len, max_pieces = batch * nheads * (sq // WS_BLOCK_M), 0, 0, 1, 1
        acc_ws = ml_ws = lse
    else:
        n_main, n_tail, tail_work, piece_len, max_pieces = tail
    assert acc_ws is not None and ml_ws is not None
    descs = (_descriptor(q, bm, d), _descriptor(k, bn, d), _descriptor(v, bn, d), _descriptor(out, bm, d))
    ints = (lse.stride(0), lse.stride(1), batch * nheads, sq, sk, n_main, tail_work, piece_len, max_pieces)
    values = (*descs, lse, acc_ws, ml_ws, *ints)
    key = (
        causal, tail is not None, d, stages, q.dtype, q.device.index, nheads, nheads_k, softmax_scale,
        q.stride(), k.stride(), v.stride(), out.stride(), aligned(q, k, v, out, lse, acc_ws, ml_ws),
        int_specs(ints),
    )  # fmt: skip

    def build() -> tuple[list[Any], dict[str, Any]]:
        args = [*descs, lse, acc_ws, ml_ws, ints[0], ints[1], nheads, nheads // nheads_k, *ints[2:5],
                softmax_scale * 1.4426950408889634, *ints[5:]]  # fmt: skip
        kwargs = {
            "CAUSAL": causal, "TAIL": tail is not None, "HEAD_DIM": d, "BM": bm, "BN": bn, "STAGES": stages,
            "CONSUMER_REGS": _CONSUMER_REGS, "PRODUCER_REGS": _PRODUCER_REGS, "num_warps": 4,
            "maxnreg": _MAXNREG,
        }  # fmt: skip
        return args, kwargs

    kernel_launches(_attn_fwd_ws_kernel).launch(key, (n_main + n_tail,), _SLOTS, values, build)


def compile_ptx(
    head_dim: int = 128, causal: bool = False, tail: bool = False, dtype: torch.dtype = torch.bfloat16
) -> str:
    """The kernel's sm_90 PTX, compiled without a GPU (``triton.compile`` of a Gluon AST source).
    For tests on a CPU-only machine; needs ``TRITON_INTERPRET`` unset when triton was imported."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    bm, bn = WS_BLOCK_M // 2, WS_BLOCK_N
    x = torch.empty(1, 256, 2, head_dim, dtype=dtype)
    descs = (_descriptor(x, bm, head_dim), _descriptor(x, bn, head_dim), _descriptor(x, bn, head_dim),
             _descriptor(x, bm, head_dim))  # fmt: skip
    sig = {n: mangle_type(t) for n, t in zip(("q_desc", "k_desc", "v_desc", "o_desc"), descs, strict=True)}
    sig |= {"lse_ptr": "*fp32", "acc_ws": "*fp32", "ml_ws": "*fp32"}
    sig |= dict.fromkeys(
        ("stride_lb", "stride_lh", "nheads", "group", "batch_heads", "sq", "sk", "n_main", "tail_work",
         "piece_len", "max_pieces"), "i32",
    )  # fmt: skip
    sig["qk_scale"] = "fp32"
    consts = {
        "CAUSAL": causal, "TAIL": tail, "HEAD_DIM": head_dim, "BM": bm, "BN": bn, "STAGES": _STAGES,
        "CONSUMER_REGS": _CONSUMER_REGS, "PRODUCER_REGS": _PRODUCER_REGS, "num_warps": 4,
    }  # fmt: skip
    sig |= dict.fromkeys(consts, "constexpr")
    src = GluonASTSource(_attn_fwd_ws_kernel, sig, constexprs=consts)
    opts = {"num_warps": 4, "maxnreg": _MAXNREG, **KERNEL_OPTIONS}
    return str(triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts).asm["ptx"])
