"""The paged attention Triton kernel (split-KV flash-decoding and chunked prefill) and its combine.

One kernel, :func:`paged_attn_kernel`, serves decode and (chunked) prefill. A program owns
``BLOCK_M`` query *rows* of one sequence and ``HPP`` consecutive KV heads, where a row is a (query
token, query head of those KV heads' GQA groups) pair: row ``m`` is token ``q0 + m // (G * HPP)``,
head ``kvh0 * G + m % (G * HPP)``. Every query head of a group is processed together, so each KV
byte is read once per program. The grid is ``(q_tiles * num_splits, nheads_k // HPP, batch)``, or
``(nheads_k // HPP, q_tiles * num_splits, batch)`` with ``HEADS_FIRST``.

A program walks the KV tiles of its split of the visible key range, fetching each tile's block ids
from the block table. A tile has ``BLOCK_N`` columns: ``BLOCK_N // HPP`` tokens times the ``HPP``
heads, in the cache's memory order; ``Q K^T`` is masked to the (row, column) pairs of the same KV
head. Tiles visible to every row run a mask-free loop; only the boundary tiles (causal diagonal,
window edge, sequence end) are masked. Softcap, ALiBi and the fp8 e4m3 per-head scales are fused.
With ``num_splits > 1`` every split writes its normalised partial output and log2-sum-exp to a
float32 workspace and :func:`combine_kernel` merges them.

Layout: cache ``(num_blocks, block_size, nheads_k, d)`` with a ``(batch, max_blocks)`` int32 block
table (``PAGE_SIZE = block_size``), or a contiguous cache ``(batch_cache, seqlen_cache, nheads_k,
d)`` read directly (``PAGE_SIZE = 0``). Queries are packed ``(total_q, nheads, d)``; sequence
``b``'s queries are the last ``q_len`` positions of its ``seqlens_k[b]`` keys (bottom-right).
The launcher (:mod:`flashpage.ops.paged_launch`) validates everything; the kernel trusts it.
"""

from __future__ import annotations

import triton
import triton.language as tl

from flashpage.ops.attn_math import LN2, LOG2E, attn_scores, key_visible, load_tile, softmax_step

__all__ = ["combine_kernel", "paged_attn_kernel", "split_pairs"]


@triton.jit
def _widen(x, WIDE: tl.constexpr):
    """``x`` as int64 for cache offsets, or as is (int32) when the launcher found every offset of
    the caches below 2**31 (fewer address instructions per row)."""
    if WIDE:
        return x.to(tl.int64)
    else:
        return x


@triton.jit
def _block_ids(bt_row, start_n, j, ctx, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, MASK: tl.constexpr,
               WIDE: tl.constexpr):  # fmt: skip
    """Cache block of each token ``j`` (any shape) of the tile at ``start_n``: one scalar table load
    when the tile lies in one page; past the sequence end (``MASK`` tiles) block 0."""
    if PAGE_SIZE >= BLOCK_N:
        blk = _widen(tl.load(bt_row + start_n // PAGE_SIZE), WIDE)
    elif MASK:
        blk = _widen(tl.load(bt_row + j // PAGE_SIZE, mask=j < ctx, other=0), WIDE)
    else:
        blk = _widen(tl.load(bt_row + j // PAGE_SIZE), WIDE)
    return blk


@triton.jit
def _kv_offsets(blk, j, kv_row, stride_kb, stride_kt, stride_vb, stride_vt, PAGE_SIZE: tl.constexpr):
    """K and V element offsets of the cache rows of tokens ``j`` (any shape): in their blocks
    ``blk`` (paged), or in the sequence's row ``kv_row`` of a contiguous cache (``PAGE_SIZE == 0``,
    ``blk`` unused)."""
    if PAGE_SIZE == 0:
        k_off = kv_row * stride_kb + j.to(tl.int64) * stride_kt
        v_off = kv_row * stride_vb + j.to(tl.int64) * stride_vt
    else:
        in_page = j % PAGE_SIZE
        k_off = blk * stride_kb + in_page * stride_kt
        v_off = blk * stride_vb + in_page * stride_vt
    return k_off, v_off


# e4m3 byte pairs to fp16 (V read as int16 pairs). Each int16 element holds two e4m3 bytes; the low
# bytes of the two elements packed in one register go to one conversion of a pair, the high bytes
# to another. Elementwise whatever two elements Triton packs together.
_PAIR_ASM = tl.constexpr("""{
.reg .b32 e, o;
.reg .b16 el, eh, ol, oh;
prmt.b32 e, $2, 0, 0x0020;
prmt.b32 o, $2, 0, 0x0031;
mov.b32 {el, eh}, e;
mov.b32 {ol, oh}, o;
cvt.rn.f16x2.e4m3x2 $0, el;
cvt.rn.f16x2.e4m3x2 $1, ol;
}""")


@triton.jit
def split_pairs(v16, ASM: tl.constexpr):
    """fp16 tensors of the low and of the high e4m3 byte of each int16 element of ``v16``: V's even
    and odd columns. ``ASM=False`` (the interpreter, which runs no PTX): the same by integer ops."""
    if ASM:
        return tl.inline_asm_elementwise(
            _PAIR_ASM, "=r,=r,r", [v16], dtype=(tl.float16, tl.float16), is_pure=True, pack=2
        )
    else:
        u = v16.to(tl.uint16, bitcast=True)
        lo = (u & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
        return lo, (u >> 8).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)


@triton.jit
def _pv_step(acc, acc2, p, v, alpha, q, CONVERT_KV: tl.constexpr, DOT_PRECISION: tl.constexpr,
             V_PAIRS: tl.constexpr, PAIR_ASM: tl.constexpr):  # fmt: skip
    """``acc * alpha + P V`` (``alpha`` already broadcast against ``acc``), V converted to ``q``'s
    dtype where ``CONVERT_KV``; with ``V_PAIRS`` ``v`` holds int16 byte pairs and ``acc`` / ``acc2``
    take V's even / odd columns (``acc2`` is returned unchanged otherwise)."""
    if V_PAIRS:
        v, v2 = split_pairs(v, PAIR_ASM)
        v2 = v2.to(q.dtype)
        acc2 = acc2 * alpha + tl.dot(p.to(v2.dtype), v2, input_precision=DOT_PRECISION)
    if CONVERT_KV:
        v = v.to(q.dtype)
    acc = acc * alpha + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, acc2


@triton.jit
def _attn_kv_loop(
    acc, acc2, l_i, m_i, q, K, V, desc_k, desc_v, kv_col, bt_row, kv_row, start, end, ctx, kv_lo, pos,
    slopes, qk_scale, softcap_log2, window_left, window_right, offs_t, col_k, col_v, same_head, offs_d,
    offs_v, d_ok, stride_kb, stride_kt, stride_vb, stride_vt,
    BLOCK_N: tl.constexpr, TOKN: tl.constexpr, HPP: tl.constexpr, PAGE_SIZE: tl.constexpr,
    MASK: tl.constexpr, SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_KV_START: tl.constexpr,
    CONVERT_KV: tl.constexpr, EVEN_D: tl.constexpr, DOT_PRECISION: tl.constexpr, EARLY_V: tl.constexpr,
    USE_TMA: tl.constexpr, PREFETCH_TABLE: tl.constexpr, WIDE: tl.constexpr, V_PAIRS: tl.constexpr,
    PAIR_ASM: tl.constexpr,
):  # fmt: skip
    """Online softmax over the KV tokens ``[start, end)`` (``start`` a multiple of ``TOKN``).

    A tile holds ``TOKN`` tokens of ``HPP`` KV heads: column ``n`` is token ``start_n + offs_t[n]``
    of head ``n % HPP`` (offsets ``col_k`` / ``col_v``); ``same_head`` masks the pairs of a row and
    a column of different heads. ``K``/``V`` point at this program's first KV head. ``MASK`` tiles
    apply the sequence end, the first key ``kv_lo`` (``HAS_KV_START``) and the causal/window bounds
    per row; mask-free tiles are fully visible to every row by construction. ``V_PAIRS``: ``V`` is
    the cache seen as int16 byte pairs (``offs_v`` its pair columns), ``acc`` / ``acc2`` accumulate
    V's even / odd columns; otherwise ``acc2`` is carried unchanged.
    """
    # A tile of BLOCK_N columns within one page takes one scalar block id; otherwise one per column
    # (not "within TOKN tokens": the scalar load in the iteration that uses it read slower).
    GATHER: tl.constexpr = PAGE_SIZE > 0 and PAGE_SIZE < BLOCK_N
    if GATHER and PREFETCH_TABLE:
        # Block ids of the first tile; each iteration then loads the next tile's, so the K/V
        # addresses never wait on a table load issued in the same iteration.
        blk_next = tl.load(bt_row + (start + offs_t) // PAGE_SIZE, mask=start + offs_t < ctx, other=0)
    for start_n in range(start, end, TOKN):
        j = start_n + offs_t
        blk = 0
        if GATHER and PREFETCH_TABLE:
            blk = _widen(blk_next, WIDE)
            j_next = j + TOKN
            blk_next = tl.load(bt_row + j_next // PAGE_SIZE, mask=j_next < ctx, other=0)
        elif PAGE_SIZE > 0:
            blk = _block_ids(bt_row, start_n, j, ctx, BLOCK_N, PAGE_SIZE, MASK, WIDE)
        k_off, v_off = _kv_offsets(blk, j, kv_row, stride_kb, stride_kt, stride_vb, stride_vt, PAGE_SIZE)
        if HPP > 1:
            k_off += col_k
            v_off += col_v
        n_ok = j < ctx
        if HAS_KV_START:
            # Left padding may be slots never written (NaN garbage): not read, as past the end.
            n_ok = n_ok & (j >= kv_lo)
        # TMA: only mask-free tiles inside one page (a masked tile's rows past the sequence end may
        # hold never-written slots, which a masked pointer load reads as 0 and TMA would not).
        TMA_TILE: tl.constexpr = USE_TMA and HPP == 1 and PAGE_SIZE >= BLOCK_N and not MASK
        if TMA_TILE:
            cache_row = (blk * PAGE_SIZE + start_n % PAGE_SIZE).to(tl.int32)
            k = desc_k.load([cache_row, kv_col])
        else:
            k = load_tile(K + k_off[:, None] + offs_d[None, :], n_ok[:, None], d_ok[None, :], MASK, EVEN_D)
        if EARLY_V:
            if TMA_TILE:
                v = desc_v.load([cache_row, kv_col])
            else:
                v = load_tile(
                    V + v_off[:, None] + offs_v[None, :], n_ok[:, None], d_ok[None, :], MASK, EVEN_D
                )
        if CONVERT_KV:
            k = k.to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        s, _t = attn_scores(s, pos[:, None], j[None, :], 0, qk_scale, qk_scale, softcap_log2, slopes[:, None],
                            SOFTCAP, HAS_ALIBI)  # fmt: skip
        if MASK:
            vis = key_visible(
                pos[:, None], j[None, :], 0, 0, ctx, window_left, window_right, True, True, False
            )
            if HAS_KV_START:
                vis = vis & (j[None, :] >= kv_lo)
            if HPP > 1:
                vis = vis & same_head
            s = tl.where(vis, s, float("-inf"))
        elif HPP > 1:
            s = tl.where(same_head, s, float("-inf"))
        p, alpha, l_i, m_new = softmax_step(s, m_i, l_i, MASK, 1)
        if not EARLY_V:
            if TMA_TILE:
                v = desc_v.load([cache_row, kv_col])
            else:
                v = load_tile(
                    V + v_off[:, None] + offs_v[None, :], n_ok[:, None], d_ok[None, :], MASK, EVEN_D
                )
        acc, acc2 = _pv_step(acc, acc2, p, v, alpha[:, None], q, CONVERT_KV, DOT_PRECISION, V_PAIRS, PAIR_ASM)
        m_i = m_new
    return acc, acc2, l_i, m_i


@triton.jit
def _split_range(ctx, q_len, q0, split, num_splits, kv_lo, window_left, window_right,
                 QPT: tl.constexpr, TOKN: tl.constexpr):  # fmt: skip
    """This split's key range ``[s_lo, s_hi)`` of a query tile (rows ``q0 .. q0 + QPT - 1``), cut
    at ``a_end`` and ``b_end``: ``[a_end, b_end)`` is visible to every row (mask-free), the rest is
    masked. The tile's visible range is split into ``num_splits`` chunks of whole ``TOKN`` tiles."""
    q_last = tl.minimum(q0 + QPT, q_len) - 1
    p_first = ctx - q_len + q0
    p_last = ctx - q_len + q_last
    lo = (tl.maximum(p_first - window_left, kv_lo) // TOKN) * TOKN
    hi = tl.minimum(p_last + window_right + 1, ctx)
    n_tiles = tl.cdiv(tl.maximum(hi - lo, 0), TOKN)
    per_split = tl.cdiv(n_tiles, num_splits)
    s_lo = lo + split * per_split * TOKN
    s_hi = tl.minimum(s_lo + per_split * TOKN, hi)
    full_lo = tl.cdiv(tl.maximum(p_last - window_left, kv_lo), TOKN) * TOKN
    full_hi = (tl.maximum(tl.minimum(p_first + window_right + 1, ctx), 0) // TOKN) * TOKN
    a_end = tl.minimum(tl.maximum(full_lo, s_lo), s_hi)
    b_end = tl.minimum(tl.maximum(full_hi, a_end), s_hi)
    return s_lo, a_end, b_end, s_hi


# Per-step values (split count, query length) are not specialised on: no mid-run recompiles.
@triton.jit(do_not_specialize=["num_splits", "q_per_seq"])
def paged_attn_kernel(
    Q, K, V, desc_k, desc_v, Out, Lse, MidO, MidLse, BlockTable, SeqlensK, CuSeqlensQ, BatchIdx, KvStart,
    Alibi, KScale, VScale,
    sm_scale, softcap, window_left, window_right, num_splits, q_per_seq,
    stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_ot, stride_oh, stride_lh, stride_lt, stride_btb, stride_ab,
    stride_mot, stride_moh, stride_mos, stride_mlt, stride_mlh,
    G: tl.constexpr, HPP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, VARLEN_Q: tl.constexpr, HAS_BATCH_IDX: tl.constexpr,
    HAS_KV_START: tl.constexpr, SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, KV_FP8: tl.constexpr,
    SPLIT: tl.constexpr, WRITE_LSE: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    EARLY_V: tl.constexpr, USE_TMA: tl.constexpr, PREFETCH_TABLE: tl.constexpr, WIDE_OFFSETS: tl.constexpr,
    HEADS_FIRST: tl.constexpr, PDL: tl.constexpr, V_PAIRS: tl.constexpr, PAIR_ASM: tl.constexpr,
):  # fmt: skip
    """Attention of one (query tile, split, KV head group, sequence) program; see the module doc."""
    if PDL:
        # Lets the combine kernel (launched as a programmatic dependent) be scheduled as soon as
        # every program here has started; it waits for this grid's results itself.
        tl.extra.cuda.gdc_launch_dependents()
    # A program owns HPP consecutive KV heads (kvg: their group), each with its G query heads.
    if HEADS_FIRST:
        kvg = tl.program_id(0)
        pid0 = tl.program_id(1)
        n_pid0 = tl.num_programs(1)
    else:
        pid0 = tl.program_id(0)
        kvg = tl.program_id(1)
        n_pid0 = tl.num_programs(0)
    kvh = kvg * HPP
    b = tl.program_id(2)
    split = pid0 % num_splits
    # Heaviest (last, most keys under causal) query tiles first: better tail balance.
    tile = n_pid0 // num_splits - 1 - pid0 // num_splits
    if VARLEN_Q:
        q_start = tl.load(CuSeqlensQ + b)
        q_len = tl.load(CuSeqlensQ + b + 1) - q_start
    else:
        q_start = b * q_per_seq
        q_len = q_per_seq
    GH: tl.constexpr = G * HPP  # query heads (rows) per query token
    QPT: tl.constexpr = BLOCK_M // GH  # query tokens per tile
    TOKN: tl.constexpr = BLOCK_N // HPP  # KV tokens per tile
    q0 = tile * QPT
    if q0 >= q_len:
        return
    ctx = tl.load(SeqlensK + b)

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    EVEN_D: tl.constexpr = HEAD_DIM == BLOCK_D
    qi = q0 + offs_m // GH
    head = kvh * G + offs_m % GH
    row_ok = (offs_m < QPT * GH) & (qi < q_len)
    col_h = offs_n % HPP
    same_head = ((offs_m % GH) // G)[:, None] == col_h[None, :]
    offs_t = offs_n // HPP
    pos = ctx - q_len + qi  # key position of each row's query (bottom-right aligned)
    tok = (q_start + qi).to(tl.int64)

    q = load_tile(
        Q + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        row_ok[:, None],
        d_ok[None, :],
        True,
        EVEN_D,
    )
    if UPCAST:
        q = q.to(tl.float32)
    elif KV_FP8 and Q.dtype.element_ty != tl.float32:
        # e4m3 -> fp16 is one exact cvt per pair (bf16 needs two); bf16 q in fp16 keeps its 8 bits of
        # mantissa for |q| in [6e-5, 65504], and p in [0, 1] gains precision.
        q = q.to(tl.float16)

    kv_scale = 1.0
    if KV_FP8:
        tl.static_assert(HPP == 1, "fp8 caches: one KV head (one scale) per program")
        kv_scale = tl.load(KScale + kvh)
    if SOFTCAP:
        qk_scale = sm_scale * kv_scale / softcap
        softcap_log2 = softcap * LOG2E
    else:
        qk_scale = sm_scale * kv_scale * LOG2E
        softcap_log2 = 0.0
    slopes = tl.zeros([BLOCK_M], dtype=tl.float32)
    if HAS_ALIBI:
        slopes = tl.load(Alibi + b * stride_ab + head, mask=row_ok, other=0.0) * LOG2E

    # Keys before KvStart[b] (flash-attn's cache_leftpad) are hidden like keys left of the window.
    kv_lo = 0
    if HAS_KV_START:
        kv_lo = tl.load(KvStart + b)
    s_lo, a_end, b_end, s_hi = _split_range(
        ctx, q_len, q0, split, num_splits, kv_lo, window_left, window_right, QPT, TOKN
    )

    if PAGE_SIZE == 0 and HAS_BATCH_IDX:
        kv_row = tl.load(BatchIdx + b).to(tl.int64)
    else:
        kv_row = b.to(tl.int64)
    bt_row = BlockTable + b.to(tl.int64) * stride_btb
    Kh = K + kvh.to(tl.int64) * stride_kh
    Vh = V + kvh.to(tl.int64) * stride_vh
    col_k = col_h * stride_kh
    col_v = col_h * stride_vh

    # V_PAIRS: V read as int16 byte pairs, accumulated as its even (acc) and odd (acc2) columns;
    # otherwise acc2 is a placeholder the loop carries unchanged.
    if V_PAIRS:
        tl.static_assert(
            KV_FP8 and EVEN_D and not USE_TMA, "v_pairs: fp8 caches, power-of-two d, pointer loads"
        )
        DV: tl.constexpr = BLOCK_D // 2
        DV2: tl.constexpr = BLOCK_D // 2
    else:
        DV: tl.constexpr = BLOCK_D
        DV2: tl.constexpr = 1
    offs_v = tl.arange(0, DV)

    # Three passes over [s_lo, s_hi): masked head tiles, mask-free tiles, masked tail tiles.
    acc = tl.zeros([BLOCK_M, DV], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_M, DV2], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    for phase in tl.static_range(3):
        if phase == 0:
            t_lo = s_lo
            t_hi = a_end
        elif phase == 1:
            t_lo = a_end
            t_hi = b_end
        else:
            t_lo = b_end
            t_hi = s_hi
        acc, acc2, l_i, m_i = _attn_kv_loop(
            acc, acc2, l_i, m_i, q, Kh, Vh, desc_k, desc_v, kvh * HEAD_DIM, bt_row, kv_row, t_lo, t_hi, ctx, kv_lo,
            pos, slopes, qk_scale, softcap_log2, window_left, window_right, offs_t, col_k, col_v, same_head, offs_d,
            offs_v, d_ok, stride_kb, stride_kt, stride_vb, stride_vt, BLOCK_N, TOKN, HPP, PAGE_SIZE, phase != 1,
            SOFTCAP, HAS_ALIBI, HAS_KV_START, KV_FP8 or UPCAST, EVEN_D, DOT_PRECISION, EARLY_V, USE_TMA,
            PREFETCH_TABLE, WIDE_OFFSETS, V_PAIRS, PAIR_ASM,
        )  # fmt: skip
    if V_PAIRS:
        # Even and odd columns back into the head dim's order: column 2c is acc[:, c], 2c + 1 acc2[:, c].
        acc = tl.reshape(tl.join(acc, acc2), (BLOCK_M, BLOCK_D))

    _write_output(
        acc, l_i, m_i, VScale + kvh, Out, Lse, MidO, MidLse, tok, head, split, row_ok, d_ok, offs_d,
        stride_ot, stride_oh, stride_lh, stride_lt, stride_mot, stride_moh, stride_mos, stride_mlt, stride_mlh,
        KV_FP8, SPLIT, WRITE_LSE,
    )  # fmt: skip


@triton.jit
def _write_output(
    acc, l_i, m_i, v_scale_ptr, Out, Lse, MidO, MidLse, tok, head, split, row_ok, d_ok, offs_d,
    stride_ot, stride_oh, stride_lh, stride_lt, stride_mot, stride_moh, stride_mos, stride_mlt, stride_mlh,
    KV_FP8: tl.constexpr, SPLIT: tl.constexpr, WRITE_LSE: tl.constexpr,
):  # fmt: skip
    """Normalise a program's rows and store them: the output (and natural-log LSE) unsplit, else the
    split's float32 partial output and log2-sum-exp in the workspace (fp8: times the V scale at
    ``v_scale_ptr``). Rows that saw no key get zeros and ``-inf``."""
    nonempty = l_i > 0.0
    o = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    if KV_FP8:
        o = o * tl.load(v_scale_ptr)
    lse2 = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
    out_mask = row_ok[:, None] & d_ok[None, :]
    if SPLIT:
        mo = (
            MidO
            + tok[:, None] * stride_mot
            + head[:, None] * stride_moh
            + split * stride_mos
            + offs_d[None, :]
        )
        tl.store(mo, o, mask=out_mask)
        tl.store(MidLse + tok * stride_mlt + head * stride_mlh + split, lse2, mask=row_ok)
    else:
        optr = Out + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(optr, o.to(Out.dtype.element_ty), mask=out_mask)
        if WRITE_LSE:
            tl.store(Lse + head * stride_lh + tok * stride_lt, lse2 * LN2, mask=row_ok)


@triton.jit
def combine_kernel(
    MidO, MidLse, Out, Lse, num_splits,
    stride_mot, stride_moh, stride_mos, stride_mlt, stride_mlh, stride_ot, stride_oh, stride_lh, stride_lt,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, WRITE_LSE: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """Merge the splits of one (token, head), head-dim columns ``[program_id(2) * BLOCK_D, ... +
    BLOCK_D)``: weights ``2**(lse_s - max)``, empty splits (lse ``-inf``) weigh 0."""
    if PDL:
        tl.extra.cuda.gdc_wait()  # the attention grid's partials are complete and visible after this
    tok = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d0 = tl.program_id(2) * BLOCK_D
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = d0 + tl.arange(0, BLOCK_D)
    s_ok = offs_s < num_splits
    lse = tl.load(MidLse + tok * stride_mlt + h * stride_mlh + offs_s, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)
    denom = tl.sum(w, 0)
    mo = MidO + tok * stride_mot + h * stride_moh + offs_s[:, None] * stride_mos + offs_d[None, :]
    o = tl.load(mo, mask=s_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    out = tl.sum(o * w[:, None], 0) / tl.where(denom > 0.0, denom, 1.0)
    tl.store(
        Out + tok * stride_ot + h * stride_oh + offs_d, out.to(Out.dtype.element_ty), mask=offs_d < HEAD_DIM
    )
    if WRITE_LSE:  # noqa: SIM102 (a compile-time branch around a run-time one)
        if d0 == 0:
            lse_out = tl.where(
                denom > 0.0,
                (m + tl.log2(tl.where(denom > 0.0, denom, 1.0))) * LN2,
                float("-inf"),
            )
            tl.store(Lse + h * stride_lh + tok * stride_lt, lse_out)
