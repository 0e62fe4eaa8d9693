"""Paged attention kernels: split-KV flash-decoding over the paged cache, and the LSE combine.

One Triton kernel, :func:`_paged_attn_kernel`, serves decode and (chunked) prefill: a program owns
``BLOCK_M`` query *rows* of one sequence and ``HPP`` consecutive KV heads (``heads_per_program``),
where a row is a (query token, query head of those KV heads' GQA groups) pair: row ``m`` is token
``q0 + m // (G * HPP)``, head ``kvh0 * G + m % (G * HPP)``. So every query head of a group is
processed together and each KV byte is read once per program. The grid (:func:`paged_grid`) is
``(q_tiles * num_splits, nheads_k // HPP, batch)``, or ``(nheads_k // HPP, q_tiles * num_splits,
batch)`` with ``heads_first`` (the decode default); decode has one q tile (``BLOCK_M`` = the
group's heads times ``HPP``, padded to at least 16 rows for ``tl.dot``: decode fills those rows with
more KV heads' groups instead of padding), chunked prefill (:mod:`flashpage.ops.paged_prefill`) has
many.

A program walks the KV tiles of its split of the visible key range, fetching each tile's block ids
from the block table. A tile has ``BLOCK_N`` columns: ``BLOCK_N // HPP`` tokens (absolute positions
aligned to that) times the ``HPP`` heads, in the cache's memory order, so each token's heads are
one contiguous read; ``Q K^T`` is masked to the (row, column) pairs of the same KV head. A tile
takes one block id per column unless ``block_size >= BLOCK_N`` (one scalar block id per tile).
Tiles that need no mask (all keys visible to every row) run a mask-free loop;
only the boundary tiles (the causal diagonal, the window's left edge, the sequence end) are masked.
Online softmax is done in base 2 (``exp2``) with the scale folded into the scores; softcap, ALiBi and
the fp8 e4m3 per-head scales are fused. With ``num_splits > 1`` every split writes its normalised
partial output and log2-sum-exp to a float32 workspace and :func:`_combine_kernel` merges them
(on CUDA by default a programmatic dependent launch: scheduled while the attention grid drains, it
waits in-kernel for the partials), or the last split to finish does (``fused_combine``).

Layout: cache ``(num_blocks, block_size, nheads_k, d)`` with ``block_table (batch, max_blocks)`` int32
(``PAGE_SIZE = block_size``), or a contiguous cache ``(batch_cache, seqlen_cache, nheads_k, d)`` read
directly (``PAGE_SIZE = 0``; optional ``cache_batch_idx``). Queries are packed ``(total_q, nheads, d)``
with either ``cu_seqlens_q`` (varlen) or ``q_per_seq`` queries per sequence (padded decode batch).
Sequence ``b``'s queries are the last ``q_len`` positions of its ``seqlens_k[b]`` keys (bottom-right).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from flashpage.ops.backend import interpreter_enabled
from flashpage.ops.cache_write import is_fp8_dtype, validate_scale
from flashpage.ops.flash_configs import pdl_supported, tma_supported
from flashpage.ops.flash_fwd import make_row_descriptor, tma_row_view_ok
from flashpage.ops.launch_cache import BoundLaunch, LaunchCache, Memo, aligned, cdiv, int_specs, next_pow2

# The roofline planner's split-KV and heads-per-program rules.
from flashpage.roofline.planner import choose_heads_per_program, choose_num_splits, pow2_divisor_at_most

__all__ = [
    "EAGER_LAUNCHES",
    "PagedAttnConfig",
    "PagedLaunch",
    "PagedLaunches",
    "PagedTiles",
    "allocate_workspace",
    "check_paged_cache",
    "check_paged_values",
    "choose_num_splits",
    "default_decode_config",
    "default_num_sms",
    "kv_heads_per_program",
    "launch_paged_attention",
    "paged_decode",
    "paged_grid",
    "paged_kernel_constexprs",
    "paged_tiles",
    "resolve_launch",
    "resolve_num_splits",
    "wide_offsets",
    "with_heads",
]

# "Unbounded" window side: far beyond any context, small enough that pos +- it stays in int32.
_NO_WINDOW = 1 << 30
_MAX_SPLITS = 128
_COMPUTE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class PagedAttnConfig:
    """Launch parameters of the paged attention kernel (the benchmark sweeps these).

    Attributes:
        block_m: query rows per program (tokens x GQA group heads), a power of two >= 16; ``0`` picks
            the smallest that holds ``max_seqlen_q * group`` rows (decode) up to 128.
        block_n: KV tokens per tile, a power of two >= 16.
        num_warps: warps per program.
        num_stages: software-pipelining depth of the KV loads.
        fused_combine: with split-KV, the last split program of each (sequence, KV head, query tile) to
            finish merges the splits itself (an atomic arrival counter in the workspace) instead of a
            second kernel launch, :func:`merge_chunk` splits per step. Off by default: on an H100
            (2026-12-07, triton 3.6, fp8 default tiles) it read 6% slower than the PDL combine at
            b1/128k (64 splits; one program per KV head merges them all after the last tile, where
            the combine kernel spreads that work over the GPU) and the same at b32/32k (2 splits).
        early_v: issue each tile's V load together with its K load (twice the bytes in flight per
            program, more registers) instead of after the softmax.
        maxnreg: register cap per thread passed to the compiler (``0``: its choice); fewer registers
            allow more resident programs per SM.
        use_tma: read mask-free KV tiles through TMA descriptors when a tile lies inside one page
            (``block_size >= block_n``; Hopper+, contiguous 16-byte aligned caches); pointer loads
            otherwise.
        prefetch_table: with pages smaller than ``block_n`` (a tile gathers several pages), load
            the next tile's block ids one iteration ahead instead of at the top of each iteration.
        narrow_offsets: compute cache offsets in 32-bit integers when every element of both caches
            lies within 2**31 elements of its base (checked per launch; larger caches use 64-bit).
            Fewer address instructions and registers per KV row (sm_90, triton 3.6, d=128 decode:
            114-120 -> 88-112 registers).
        heads_first: launch order with the KV head as the fastest grid axis (the programs of one
            sequence and split that read the same pages start together) instead of the split.
        pdl: with split-KV and the separate combine kernel, launch the combine as a programmatic
            dependent launch: it is scheduled while the attention grid drains and waits in-kernel
            (``griddepcontrol.wait``) for its results instead of after a full launch gap. Used where
            supported (CUDA sm_90+, :func:`~flashpage.ops.flash_configs.pdl_supported`), a plain launch
            elsewhere.
        combine_block_d: head-dim columns per combine program (a power of two; ``0``: the whole
            head dim); smaller blocks give the combine more, shorter programs.
        combine_warps: warps per combine program.
        heads_per_program: KV heads per program (a power of two; ``0``: as many as fill ``tl.dot``'s
            16-row minimum with real query rows, ``16 // (query tokens x group)``). A program's
            ``block_n`` tile columns are then ``block_n // heads`` tokens of each of its KV heads, in
            the cache's order, so every token's heads are read as one contiguous run (whole pages
            when all KV heads share a program) instead of one ``d``-element row per head, strided by
            ``nheads_k * d``; ``Q K^T`` masks the pairs of different heads. Lowered to the largest
            power of two dividing ``nheads_k`` (and ``block_n``); ``1`` with fp8 caches or TMA.
        wide_block_n: ``0``, or the tile columns (a power of two >= 16) that replace ``block_n``
            when ``heads_per_program=0`` resolves to several KV heads per program; the planner's
            split count (``num_splits=0``) then fills one wave of two such programs per SM
            (:func:`resolve_launch`). cuDNN's decode tile: 32 KiB K and V tiles, two per SM.
        warp_slices: cut each ``block_n`` tile into ``num_warps`` slices of ``block_n // num_warps``
            tokens, one per warp (a 3-D ``tl.dot`` whose batch is the slice), each slice with its own
            softmax statistics and output accumulator, merged once after the KV loop: no tile needs a
            cross-warp reduction or an exchange of ``P`` through shared memory, at the cost of one
            ``(rows, d)`` accumulator per warp. One KV head per program, pointer loads (not with
            ``use_tma`` or ``prefetch_table``); ``block_n // num_warps >= 16``. Applied to tiles of at
            most :data:`WARP_SLICE_ROWS` query rows (decode): each warp holds every row's accumulator,
            so larger row tiles (multi-query rows) run unsliced. Off by default. Offline (sm_90,
            triton 3.9, fp8 decode tiles, the mask-free loop per thread per 128-token tile) it takes
            718 instructions instead of 840, 4 barriers instead of 10 and 176 registers instead of
            254, yet on an H100 (2026-12-07, ``benchmarks/probes/decode_fp8_bound.py``) the fp8
            kernel read at 1.83 / 1.68 / 1.75 / 1.53x the bf16 kernel (b32/32k, b64/4k, b256/4k,
            b1/128k) against 1.78 / 1.70 / 1.74 / 1.63x unsliced, and bf16 0.3-4.4% slower.
        v_pairs: fp8 caches: read V's tile as int16 pairs of bytes (columns ``2c`` and ``2c + 1`` of a
            token) and compute ``P V`` as two dots, over V's even and over its odd columns. The pairs
            reach ``tl.dot``'s operand layout through Triton's transposing 16-bit shared-memory load
            (``ldmatrix.trans``), where each register holds one pair of two consecutive tokens; two
            byte permutes and two conversions per register (inline PTX, :func:`_split_pairs`) then
            give the even and odd columns in fp16. Without it Triton widens fp8 in the operand
            layout and reads V from shared memory one byte per element. Applied to decode tiles (at
            most :data:`WARP_SLICE_ROWS` query rows) of fp8 caches whose head dim is a power of two,
            loaded by pointers (not ``use_tma``), and whose V cache can be viewed as int16 (even
            offset and strides); otherwise ignored. Under the Triton interpreter (no PTX) integer
            ops split the pairs. Offline (sm_90, 128-token tiles, the mask-free loop per thread per
            tile): 621 instructions and 177 registers instead of 840 and 254 (triton 3.9; 3.6: 634 /
            168 instead of 859 / 255). The registers are what pays: on an H100 the pairs alone read
            at 0.95-1.05x the byte-wise kernel's speed, and with ``maxnreg=128`` (four programs per
            SM instead of two; no spill in the mask-free loop) 1.07-1.10x (the fp8 default; see
            :func:`default_decode_config`).
        k_pairs: fp8 caches: read K's tile as int16 pairs of bytes too and compute ``Q K^T`` as two
            dots, the queries' even columns against K's even columns plus the odd against the odd
            (the queries are split once, before the KV loop). K needs no transposing load, but
            Triton widens fp8 in the dot-operand layout of an 8-bit type, which permutes the
            reduction axis; the queries' operand then takes that permutation too, and ptxas copies
            their registers into each MMA's operand every tile (sm_90, triton 3.9, fp8 default:
            96 register moves in the mask-free loop per thread per 128-token tile). As 16-bit pairs
            both operands keep the plain 16-bit layout: the loop takes 596 instructions instead of
            633 (3.6: 608 instead of 632), 64 byte permutes replacing the moves. Applied where
            ``v_pairs`` is (same conditions, on the K cache); otherwise ignored. Off by default:
            timed on the H100 and the H200 (2026-12-07), it read 0-1% slower than the default
            (see :func:`default_decode_config`).
        share_kv_offsets: where the K and V caches, as the kernel reads them, have the same strides
            (the usual case: two tensors of one shape), compute each tile's cache offsets once for
            both. Triton otherwise builds K's and V's offsets apart and moves each into its load
            layout through shared memory (a store, a barrier and four loads per thread per tile).
            Offline (sm_90, triton 3.9, mask-free loop per thread per tile): the fp8 default with
            ``k_pairs`` 596 -> 568 instructions; bf16 4-head tiles 419 -> 376, but one-head bf16
            tiles take 154 registers instead of 106 (three programs per SM instead of four). Off
            by default: on the H100 and the H200 (2026-12-07) fp8 with ``k_pairs`` read no faster
            with it, and the bf16 default read the same (1.00x).
    """

    block_m: int = 0
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    fused_combine: bool = False
    early_v: bool = False
    maxnreg: int = 0
    use_tma: bool = False
    prefetch_table: bool = False
    narrow_offsets: bool = True
    heads_first: bool = False
    pdl: bool = False
    combine_block_d: int = 0
    combine_warps: int = 4
    heads_per_program: int = 1
    wide_block_n: int = 0
    warp_slices: bool = False
    v_pairs: bool = False
    k_pairs: bool = False
    share_kv_offsets: bool = False

    def __post_init__(self) -> None:
        for name in ("block_n", "num_warps"):
            val = getattr(self, name)
            if not isinstance(val, int) or val < 1 or val & (val - 1):
                raise ValueError(f"PagedAttnConfig.{name} must be a positive power of two, got {val!r}")
        if self.block_n < 16:
            raise ValueError(f"PagedAttnConfig.block_n must be >= 16 (tl.dot), got {self.block_n}")
        wide = self.wide_block_n
        if isinstance(wide, bool) or not isinstance(wide, int) or (wide and (wide < 16 or wide & (wide - 1))):
            raise ValueError(f"PagedAttnConfig.wide_block_n must be 0 or a power of two >= 16, got {wide!r}")
        if self.block_m and (self.block_m < 16 or self.block_m & (self.block_m - 1)):
            raise ValueError(f"PagedAttnConfig.block_m must be 0 or a power of two >= 16, got {self.block_m}")
        if self.combine_block_d and (
            self.combine_block_d < 16 or self.combine_block_d & (self.combine_block_d - 1)
        ):
            raise ValueError(
                f"PagedAttnConfig.combine_block_d must be 0 or a power of two >= 16, got {self.combine_block_d}"
            )
        if self.combine_warps < 1 or self.combine_warps & (self.combine_warps - 1):
            raise ValueError(
                f"PagedAttnConfig.combine_warps must be a power of two, got {self.combine_warps}"
            )
        hpp = self.heads_per_program
        if isinstance(hpp, bool) or not isinstance(hpp, int) or hpp < 0 or hpp & (hpp - 1):
            raise ValueError(f"PagedAttnConfig.heads_per_program must be 0 or a power of two, got {hpp!r}")
        if not isinstance(self.num_stages, int) or self.num_stages < 1:
            raise ValueError(f"PagedAttnConfig.num_stages must be a positive int, got {self.num_stages!r}")
        if not isinstance(self.maxnreg, int) or not (self.maxnreg == 0 or 32 <= self.maxnreg <= 255):
            raise ValueError(f"PagedAttnConfig.maxnreg must be 0 or in [32, 255], got {self.maxnreg!r}")
        if self.warp_slices:
            if self.use_tma or self.prefetch_table:
                raise ValueError(
                    "PagedAttnConfig.warp_slices cannot be combined with use_tma or prefetch_table"
                )
            if self.block_n // self.num_warps < 16:
                raise ValueError(
                    f"PagedAttnConfig.warp_slices needs block_n // num_warps >= 16 (tl.dot), got "
                    f"{self.block_n} // {self.num_warps}"
                )

    def short(self) -> str:
        """Compact label for benchmark tables."""
        extra = ("-fc" if self.fused_combine else "") + ("-ev" if self.early_v else "")
        extra += f"-r{self.maxnreg}" if self.maxnreg else ""
        extra += "-tma" if self.use_tma else ""
        extra += "-pt" if self.prefetch_table else ""
        extra += "" if self.narrow_offsets else "-i64"
        extra += "-hf" if self.heads_first else ""
        extra += "-pdl" if self.pdl else ""
        extra += f"-c{self.combine_block_d}" if self.combine_block_d else ""
        extra += f"-cw{self.combine_warps}" if self.combine_warps != 4 else ""
        extra += "" if self.heads_per_program == 1 else f"-h{self.heads_per_program or 'auto'}"
        # Once heads are decided (resolve_launch) block_n already says which tiles run.
        extra += f"-wide{self.wide_block_n}" if self.wide_block_n and self.heads_per_program == 0 else ""
        extra += "-ws" if self.warp_slices else ""
        extra += "-vp" if self.v_pairs else ""
        extra += "-kp" if self.k_pairs else ""
        extra += "-so" if self.share_kv_offsets else ""
        return f"n{self.block_n}w{self.num_warps}s{self.num_stages}{extra}"


def default_decode_config(kv_dtype: torch.dtype, head_dim: int, paged: bool = True) -> PagedAttnConfig:
    """Decode defaults: 64-column tiles, 4 warps, for d <= 128 as many KV heads per program as fill
    16 query rows (GQA 4: 4 heads, 16 tokens per tile); fp8 KV: 128-token tiles of one head, 4
    warps, early V load and, for a power-of-two head dim, V read as byte pairs (``v_pairs``) under a
    128-register cap; contiguous caches (``paged=False``) a deeper pipeline; with split-KV the
    KV-head-first grid and a programmatic-dependent combine of 32-column, one-warp programs.

    Several KV heads per program (H100, 2026-12-05, ``benchmarks/probes/decode_multihead.py``, GQA
    32/8, d=128, bf16, block size 16, % of cuDNN on a contiguous cache in the same run, random /
    block-manager tables): a pure read of whole pages (every KV head of a page, 32 KiB runs) read
    98.4-101.7 / 100.0-103.1% where the one-head tiling (256-byte rows strided by 2 KiB) read
    95.4-99.8 / 96.6-101.2%. A decode program over 4 KV heads and 16-token tiles (the same 16 x 64
    ``tl.dot`` as one head's GQA group padded to 16 rows, 96 registers) read b32/32k 98.2-98.4 /
    98.8-99.3 (one head: 96.9 / 97.8), b64/4k 98.4-98.7 / 99.5-100.3 (98.0 / 98.4), b256/4k 99.1 /
    99.8 (99.0 / 99.6), b1/128k (its combine not timed) 100.0-100.8 / 100.6-100.7 (97.9 / 98.5 with
    its combine); 8 heads per program (32 rows, 164 registers, 2 programs per SM) read up to 1%
    less. In the library the gain is smaller and comes with more splits (fewer programs per split),
    so ``0`` (auto) leaves the choice to the planner's
    :func:`~flashpage.roofline.planner.choose_heads_per_program` (through :func:`resolve_launch`):
    several heads only where one head per program needs splits anyway (``flashpage bench decode``
    on the H100: b32/32k +0.6-0.8%, MHA b8/32k +0.9-1.3% against one head in the same run).
    Contiguous caches keep one head: their 4-stage pipeline holds one or two programs per SM, and
    with fewer programs b1/128k read 16% less.

    Those several-head programs take 128-column tiles (``wide_block_n``: 32 tokens x 4 KV heads,
    32 KiB K and V tiles, as cuDNN's decode kernel reads; 200 registers with triton 3.6, 188 with
    3.9: two programs per SM) and a split count filling one wave of them (b32/32k: 4 splits, 256
    programs for 264 slots, where the 64-column tiles' ">= 2 programs per SM" rule takes 8). H100,
    against the 64-column tiles in the same run, % of cuDNN on a contiguous cache: probe
    ``benchmarks/probes/decode_stages.py`` (3 runs, 2026-12-06) b32/32k 98.1-98.9 vs 97.8-98.3,
    b16/32k +0.4-0.6, b4/128k +0.4-0.5 points; ``flashpage bench decode`` (2026-12-06, one run)
    b32/32k 98.0 vs 97.9, MHA b8/32k 98.3 vs 98.1. Shapes where one head per program fills the GPU
    (b64/4k, b256/4k) or b1/128k (one head, 64 splits) are unchanged; there these tiles read less
    (b64/4k 96.6 vs 97.9 at 2 splits). H200 (``flashpage bench decode`` at a6ca8bf, 2026-12-06,
    ``benchmarks/results/decode-h200.json``): b32/32k 98.4 vs 98.1 (one head: 97.5), MHA b8/32k 99.0
    vs 98.9 (97.4).

    L2 prefetches of later tiles do not help: ``prefetch.global.L2`` of each program's own K and V
    rows 1 / 2 / 4 tiles ahead of the tile being read (one per 128-byte line, 4 per thread) read
    75-89 / 67-78 / 55-60% of cuDNN where the default read 98.1-101.4% (H200, 2026-12-06,
    ``benchmarks/probes/decode_stages.py``, random and block-manager tables), and whole pages as one
    bulk prefetch (``cp.async.bulk.prefetch.L2``) from the first head group's program 40-78%; the
    code is in a6ca8bf (``PagedAttnConfig.l2_prefetch``), removed after.

    On sm_90 (d=128) bf16 compiles without spills; with 32-bit KV-row offsets (``narrow_offsets``,
    used where the caches allow) triton 3.6 gives 112 registers (88 with split-KV: 5 programs per
    SM) instead of 120 (114), and the H200 read 0.3-1.4% more KV bandwidth at the planner's split
    counts (GQA 32/8 and MHA, 4k-128k contexts, interleaved with cuDNN in one run). triton 3.9 gives
    111 registers with or without splits, yet on one H100 (2026-12-06,
    ``benchmarks/results/triton-3.9/``) it read within 0.2% of 3.6 on every shape, so no register
    cap is set (96 made b256/4k 2.4% slower). fp8 (H200,
    triton 3.6, GQA 32/8 and MHA, block size 16; ``flashpage bench decode --variants`` at b81af5d,
    benchmarks/results/decode-h200.json): 128 x 4 warps with the V load issued beside the K load was
    the fastest fp8 configuration on every shape, 1.21-1.32x the bf16 kernel's sequences x tokens/s;
    1.17-1.32x at the planner's split counts (at 4k contexts it picks one split where two were 3-4%
    faster). 255 registers (two programs per SM; no spill with triton 3.9, 16 bytes under 3.6's
    ptxas). Without the early V load 1.11-1.25x; the previous 128 x 8 warps (128 registers, 28 bytes
    spilled under 3.6) 0.97-1.05x in a probe of the same day. With 32-bit offsets (2026-12-04) it
    reads 1.30-1.39x the bf16 default at the planner's split counts (64-bit: 1.17-1.30x in the same
    run) and was still the fastest of 8 fp8 and 8 bf16 tile configurations on those five shapes.
    Its V operand is read from shared memory byte by byte (Triton widens fp8 in the dot-operand
    layout; ``benchmarks/probes/decode_sass.py``); reading int32 words widened in registers cut the
    loop from 859 to 760 instructions (triton 3.6) but read slower on the H100 (2026-12-05): 2-24%
    with these tiles, 0.6-6% with the best word-path tiles of each shape.

    fp8 since 2026-12-07: the same tiles reading V as int16 byte pairs (``v_pairs``: no byte-wise
    shared-memory loads; 177 registers instead of 254 with triton 3.9, 168 instead of 255 with 3.6)
    and capped at 128 registers, so four programs share an SM instead of two (8-40 bytes of stack;
    none touched in the mask-free KV loop, one word reloaded per masked tile under triton 3.9).
    H100 (``benchmarks/probes/decode_fp8_bound.py``, GQA 32/8, random pages, x the bf16 kernel's
    sequences x tokens/s in the same run; b32/32k, b64/4k, b256/4k, b1/128k): 1.92 / 1.87 / 1.86 /
    1.79x, the previous default 1.78 / 1.70 / 1.74 / 1.63x, the pairs without the cap 1.70 / 1.61 /
    1.83 / 1.59x; ``flashpage bench decode`` at fb1d4bc (``benchmarks/results/decode-h100.json``)
    1.79-1.93x on the six shapes. With one program's loads in flight per tile and a long dependent
    chain of shared loads, conversions and MMAs per tile, resident programs are what hides the
    latency. H200 (2026-12-07, same probe and shapes): 1.89 / 1.82 / 1.84 / 1.70x, the previous
    default 1.38 / 1.35 / 1.36 / 1.32x; ``flashpage bench decode`` at 61a4346
    (``benchmarks/results/decode-h200.json``) 1.71-1.84x. The planner's split counts (at least two
    programs per SM) suit it although it holds four: filling four per SM read slower on an H100
    (2026-12-07, same probe, x bf16): b64/4k 1.80x at 2 splits vs 1.88x at the planner's 1, b32/32k
    1.91x at 4 vs 1.93x at 2, b256/4k 1.83x at 2 vs 1.89x at 1, b1/128k 1.72x at 128 vs 1.78x at 64.

    Options timed against this default and left off: K read as byte pairs too (``k_pairs``: the
    queries' MMA operand no longer copied register by register every tile, 96 moves) and K's
    offsets reused for V (``share_kv_offsets``: one shared-memory layout change and two barriers
    fewer) take the mask-free loop (offline sm_90, per thread per 128-token tile, under the same
    cap) from 633 to 568 instructions (triton 3.9; 3.6: 632 to 583), but on the H100
    (2026-12-07, ``decode_fp8_bound.py``, two runs, same shapes as above) they read the same or up
    to 1% slower: ``k_pairs`` 1.93 / 1.86 / 1.90 / 1.78x, both 1.93-1.94 / 1.84-1.86 / 1.89-1.90 /
    1.78-1.79x against this default's 1.94 / 1.85-1.88 / 1.90-1.91 / 1.79x; uncapped (3 programs
    per SM) 1.58-1.86x, capped at 96 registers 1.63-1.76x. There this default already reads the
    device-copy bandwidth at b32/32k (``bench decode``: 1.00 of the copy roofline), so fewer
    instructions cannot show. On the H200 (same day) neither: ``k_pairs`` 1.87 / 1.81 / 1.83 /
    1.69x, both 1.86 / 1.81 / 1.83 / 1.69x against this default's 1.89 / 1.82 / 1.84 / 1.70x.

    The block-table indirection halves the load latency Triton's pipeliner assigns (``(num_stages -
    1) // 2`` stages ahead), so 2 stages issue a tile's loads one iteration ahead into one buffer; 5
    or 7 stages give two or three buffers but were slower for bf16 in that probe (the default 95-98%
    of cuDNN, 5 stages 86-96%). A contiguous cache has no indirection, so its loads go through
    Triton's shared-memory pipeline at full depth: there 2 stages read only 78-81% of cuDNN's KV
    bandwidth (H200, GQA 32/8, d=128, bf16; b1/128k, b32/32k, b64/4k), 4 stages 92-97.5% (5 or 6:
    83-96%), and fp8 reads 1.19x faster with 3 stages than with 2 (b32/32k).

    Split-KV combine (H200, 2026-12-04, interleaved with cuDNN): at b1/128k (64 splits) the attention
    kernel alone takes 137.2 us (cuDNN 137.0) and the combine added 5.6 us as a second plain launch
    of 32 four-warp programs; as a programmatic dependent launch (``pdl``) of 128 one-warp programs
    over 32 columns each it adds ~1.6 us (138.8-139.1 us: 98.5% of cuDNN, was 95-96%). At b32/32k
    (2 splits) no combine variant moved the time by more than 0.1%. The KV-head-first grid
    (``heads_first``) read 0.1-0.4% more at the split shapes and the same elsewhere.
    """
    split_opts = {"heads_first": True, "pdl": True, "combine_block_d": 32, "combine_warps": 1}
    if is_fp8_dtype(kv_dtype) and head_dim <= 128:
        # The register cap pays only with the pairs (the byte path spills in its KV loop at 128),
        # and the pairs need a power-of-two head dim.
        pairs = _pairs_head_dim(head_dim)
        return PagedAttnConfig(
            block_n=128,
            num_warps=4,
            num_stages=2 if paged else 3,
            early_v=True,
            v_pairs=pairs,
            maxnreg=128 if pairs else 0,
            **split_opts,
        )
    if head_dim > 128:
        return PagedAttnConfig(block_n=32, num_warps=4, num_stages=2, **split_opts)
    return PagedAttnConfig(
        block_n=64,
        num_warps=4,
        num_stages=2 if paged else 4,
        heads_per_program=0 if paged else 1,
        wide_block_n=128 if paged else 0,
        **split_opts,
    )


def default_num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (4 off CUDA, i.e. under the Triton interpreter)."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).multi_processor_count)
    return 4


@triton.jit
def _load_tile(ptrs, row_ok, d_ok, MASK_ROWS: tl.constexpr, EVEN_D: tl.constexpr):
    """Load a ``(..., rows, BLOCK_D)`` tile, masking rows and/or the padded head dim only when needed
    (``row_ok`` and ``d_ok`` already shaped to broadcast against ``ptrs``)."""
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


@triton.jit
def _scores(s, rows, cols, slopes, qk_scale, softcap_log2, SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr):
    """Raw ``Q K^T`` scores to base-2 logits: scale or softcap, then the ALiBi bias of query
    positions ``rows`` and key positions ``cols`` (both broadcast against ``s``, as ``slopes``)."""
    if SOFTCAP:
        # softcap * tanh(x), tanh through exp2 (portable: no libdevice), in base-2 units.
        x = s * qk_scale
        t = 1.0 - 2.0 / (tl.exp2(x * (2.0 * 1.4426950408889634)) + 1.0)
        s = t * softcap_log2
    else:
        s = s * qk_scale
    if HAS_ALIBI:
        s = s - slopes * tl.abs(rows - cols).to(tl.float32)
    return s


@triton.jit
def _visible(rows, cols, ctx, kv_lo, window_left, window_right, HAS_KV_START: tl.constexpr):
    """Which (query position ``rows``, key ``cols``) pairs a masked tile keeps: keys before the
    sequence end, inside the window and, with ``HAS_KV_START``, from the first key ``kv_lo`` on."""
    vis = (cols < ctx) & (cols >= rows - window_left) & (cols <= rows + window_right)
    if HAS_KV_START:
        vis = vis & (cols >= kv_lo)
    return vis


@triton.jit
def _softmax_step(s, m_i, l_i, MASK: tl.constexpr, AXIS: tl.constexpr):
    """One online-softmax step over the keys on ``AXIS`` of the logits ``s``: ``(p, alpha, l_i,
    m_new)``; with ``MASK`` rows that have seen no key yet keep a zero reference."""
    m_new = tl.maximum(m_i, tl.max(s, AXIS))
    if MASK:
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
    else:
        m_use = m_new
    p = tl.exp2(s - tl.expand_dims(m_use, AXIS))
    alpha = tl.exp2(m_i - m_use)
    return p, alpha, l_i * alpha + tl.sum(p, AXIS), m_new


# e4m3 byte pairs to fp16 (PagedAttnConfig.v_pairs). Each int16 element holds two e4m3 bytes;
# the low bytes of the two elements packed in one register go to one conversion of a pair, the
# high bytes to another. Elementwise whatever two elements Triton packs together.
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
def _split_pairs(v16, ASM: tl.constexpr):
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
def _qk_dot(q, q2, k, CONVERT_KV: tl.constexpr, DOT_PRECISION: tl.constexpr, K_PAIRS: tl.constexpr,
            PAIR_ASM: tl.constexpr, SLICED: tl.constexpr):  # fmt: skip
    """``q K^T`` for a K tile ``k`` of ``(tokens, d)`` (``SLICED``: ``(slices, tokens, d)``), K
    converted to ``q``'s dtype where ``CONVERT_KV``; with ``K_PAIRS`` ``k`` holds int16 byte pairs
    and ``q`` / ``q2`` are the queries' even / odd columns."""
    if K_PAIRS:
        k, k2 = _split_pairs(k, PAIR_ASM)
        s = tl.dot(q, _transpose_tile(k.to(q.dtype), SLICED), input_precision=DOT_PRECISION)
        return tl.dot(q2, _transpose_tile(k2.to(q.dtype), SLICED), acc=s, input_precision=DOT_PRECISION)
    if CONVERT_KV:
        k = k.to(q.dtype)
    return tl.dot(q, _transpose_tile(k, SLICED), input_precision=DOT_PRECISION)


@triton.jit
def _transpose_tile(x, SLICED: tl.constexpr):
    """Swap the last two axes of a 2-D tile or (``SLICED``) of a 3-D batch of tiles."""
    if SLICED:
        return tl.permute(x, (0, 2, 1))
    else:
        return tl.trans(x)


@triton.jit
def _pv_step(acc, acc2, p, v, alpha, q, CONVERT_KV: tl.constexpr, DOT_PRECISION: tl.constexpr,
             V_PAIRS: tl.constexpr, PAIR_ASM: tl.constexpr):  # fmt: skip
    """``acc * alpha + P V`` for tiles of any rank (``alpha`` already broadcast against ``acc``), V
    converted to ``q``'s dtype where ``CONVERT_KV``; with ``V_PAIRS`` ``v`` holds int16 byte pairs
    and ``acc`` / ``acc2`` take V's even / odd columns (``acc2`` is returned unchanged otherwise)."""
    if V_PAIRS:
        v, v2 = _split_pairs(v, PAIR_ASM)
        v2 = v2.to(q.dtype)
        acc2 = acc2 * alpha + tl.dot(p.to(v2.dtype), v2, input_precision=DOT_PRECISION)
    if CONVERT_KV:
        v = v.to(q.dtype)
    acc = acc * alpha + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, acc2


@triton.jit
def _attn_kv_loop(
    acc,
    acc2,
    l_i,
    m_i,
    q,
    q2,
    K,
    V,
    desc_k,
    desc_v,
    kv_col,
    bt_row,
    kv_row,
    start,
    end,
    ctx,
    kv_lo,
    pos,
    slopes,
    qk_scale,
    softcap_log2,
    window_left,
    window_right,
    offs_t,
    col_k,
    col_v,
    same_head,
    offs_k,
    offs_v,
    d_ok,
    stride_kb,
    stride_kt,
    stride_vb,
    stride_vt,
    BLOCK_N: tl.constexpr,
    TOKN: tl.constexpr,
    HPP: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    MASK: tl.constexpr,
    SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    HAS_KV_START: tl.constexpr,
    CONVERT_KV: tl.constexpr,
    EVEN_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    EARLY_V: tl.constexpr,
    USE_TMA: tl.constexpr,
    PREFETCH_TABLE: tl.constexpr,
    WIDE: tl.constexpr,
    V_PAIRS: tl.constexpr,
    K_PAIRS: tl.constexpr,
    PAIR_ASM: tl.constexpr,
):
    """Online-softmax over the KV tokens ``[start, end)`` (``start`` a multiple of ``TOKN``).

    A tile holds ``TOKN`` tokens of ``HPP`` KV heads: column ``n`` is token ``start_n + offs_t[n]``
    (``n // HPP``) of head ``n % HPP`` (offsets ``col_k`` / ``col_v``), so with ``HPP > 1`` each
    token's heads are one contiguous run and ``same_head`` masks the pairs of a row and a column of
    different heads. ``K``/``V`` already point at this program's first KV head. ``MASK`` tiles apply
    the sequence end, the sequence's first key ``kv_lo`` (``HAS_KV_START``) and the causal/window
    bounds per row; mask-free tiles are fully visible to every row by construction. ``V_PAIRS``:
    ``V`` is the cache seen as int16 byte pairs (``offs_v`` its pair columns), ``acc`` / ``acc2``
    accumulate V's even / odd columns; otherwise ``acc2`` is carried unchanged. ``K_PAIRS``: ``K``
    likewise (``offs_k`` its pair columns), ``q`` / ``q2`` the queries' even / odd columns;
    otherwise ``q2`` is unused.
    """
    # A tile of BLOCK_N columns within one page takes one scalar block id; otherwise one per column.
    # (Not "within TOKN tokens": with 4 heads per program and 16-token tiles of 16-token pages the
    # scalar path read 9-10% less on the H100, GQA 32/8, b64/4k and b256/4k, than a block id per
    # column; the scalar load in the iteration that uses it is the likely cause.)
    GATHER: tl.constexpr = PAGE_SIZE > 0 and PAGE_SIZE < BLOCK_N
    if GATHER and PREFETCH_TABLE:
        # Block ids of the first tile; each iteration then loads the next tile's, so the K/V
        # addresses never wait on a table load issued in the same iteration.
        blk_next = tl.load(bt_row + (start + offs_t) // PAGE_SIZE, mask=start + offs_t < ctx, other=0)
    for start_n in range(start, end, TOKN):
        j = start_n + offs_t
        # Token -> cache row. Paged: block id from the table (one scalar when the tile lies in a page).
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
            k = _load_tile(K + k_off[:, None] + offs_k[None, :], n_ok[:, None], d_ok[None, :], MASK, EVEN_D)
        if EARLY_V:
            if TMA_TILE:
                v = desc_v.load([cache_row, kv_col])
            else:
                v = _load_tile(
                    V + v_off[:, None] + offs_v[None, :], n_ok[:, None], d_ok[None, :], MASK, EVEN_D
                )
        s = _qk_dot(q, q2, k, CONVERT_KV, DOT_PRECISION, K_PAIRS, PAIR_ASM, False)
        s = _scores(s, pos[:, None], j[None, :], slopes[:, None], qk_scale, softcap_log2, SOFTCAP, HAS_ALIBI)
        if MASK:
            vis = _visible(pos[:, None], j[None, :], ctx, kv_lo, window_left, window_right, HAS_KV_START)
            if HPP > 1:
                vis = vis & same_head
            s = tl.where(vis, s, float("-inf"))
        elif HPP > 1:
            s = tl.where(same_head, s, float("-inf"))
        p, alpha, l_i, m_new = _softmax_step(s, m_i, l_i, MASK, 1)
        if not EARLY_V:
            if TMA_TILE:
                v = desc_v.load([cache_row, kv_col])
            else:
                v = _load_tile(
                    V + v_off[:, None] + offs_v[None, :], n_ok[:, None], d_ok[None, :], MASK, EVEN_D
                )
        acc, acc2 = _pv_step(acc, acc2, p, v, alpha[:, None], q, CONVERT_KV, DOT_PRECISION, V_PAIRS, PAIR_ASM)
        m_i = m_new
    return acc, acc2, l_i, m_i


@triton.jit
def _attn_kv_loop_slices(
    acc,
    acc2,
    l_i,
    m_i,
    q,
    q2,
    K,
    V,
    bt_row,
    kv_row,
    start,
    end,
    ctx,
    kv_lo,
    pos,
    slopes,
    qk_scale,
    softcap_log2,
    window_left,
    window_right,
    offs_k,
    offs_v,
    d_ok,
    stride_kb,
    stride_kt,
    stride_vb,
    stride_vt,
    BLOCK_N: tl.constexpr,
    SLICES: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    MASK: tl.constexpr,
    SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    HAS_KV_START: tl.constexpr,
    CONVERT_KV: tl.constexpr,
    EVEN_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    EARLY_V: tl.constexpr,
    WIDE: tl.constexpr,
    V_PAIRS: tl.constexpr,
    K_PAIRS: tl.constexpr,
    PAIR_ASM: tl.constexpr,
):
    """:func:`_attn_kv_loop` for one KV head per program with each ``BLOCK_N`` tile cut into
    ``SLICES`` slices of consecutive tokens (``PagedAttnConfig.warp_slices``).

    ``q`` is ``(SLICES, BLOCK_M, BLOCK_D)`` (the query tile repeated), ``acc`` likewise and ``l_i``
    / ``m_i`` ``(SLICES, BLOCK_M)``: slice ``s`` accumulates the tokens ``s * BLOCK_N // SLICES +
    [0, BLOCK_N // SLICES)`` of every tile with its own softmax statistics. ``tl.dot`` over the
    leading axis puts one slice per warp when ``SLICES == num_warps``, so no tile reduces across
    warps; :func:`_merge_slices` combines the slices once. ``V_PAIRS``, ``K_PAIRS`` and ``q2`` as in
    :func:`_attn_kv_loop`.
    """
    TS: tl.constexpr = BLOCK_N // SLICES
    offs_t = tl.arange(0, SLICES)[:, None] * TS + tl.arange(0, TS)[None, :]  # (SLICES, TS)
    offs_k3 = offs_k[None, None, :]
    offs_v3 = offs_v[None, None, :]
    d_ok3 = d_ok[None, None, :]
    rows = pos[None, :, None]
    for start_n in range(start, end, BLOCK_N):
        j = start_n + offs_t
        blk = 0
        if PAGE_SIZE > 0:
            blk = _block_ids(bt_row, start_n, j, ctx, BLOCK_N, PAGE_SIZE, MASK, WIDE)
        k_off, v_off = _kv_offsets(blk, j, kv_row, stride_kb, stride_kt, stride_vb, stride_vt, PAGE_SIZE)
        n_ok = j < ctx
        if HAS_KV_START:
            n_ok = n_ok & (j >= kv_lo)
        k = _load_tile(K + k_off[:, :, None] + offs_k3, n_ok[:, :, None], d_ok3, MASK, EVEN_D)
        if EARLY_V:
            v = _load_tile(V + v_off[:, :, None] + offs_v3, n_ok[:, :, None], d_ok3, MASK, EVEN_D)
        s = _qk_dot(q, q2, k, CONVERT_KV, DOT_PRECISION, K_PAIRS, PAIR_ASM, True)  # (SLICES, BLOCK_M, TS)
        cols = j[:, None, :]
        s = _scores(s, rows, cols, slopes[None, :, None], qk_scale, softcap_log2, SOFTCAP, HAS_ALIBI)
        if MASK:
            s = tl.where(
                _visible(rows, cols, ctx, kv_lo, window_left, window_right, HAS_KV_START), s, float("-inf")
            )
        p, alpha, l_i, m_new = _softmax_step(s, m_i, l_i, MASK, 2)
        if not EARLY_V:
            v = _load_tile(V + v_off[:, :, None] + offs_v3, n_ok[:, :, None], d_ok3, MASK, EVEN_D)
        acc, acc2 = _pv_step(
            acc, acc2, p, v, alpha[:, :, None], q, CONVERT_KV, DOT_PRECISION, V_PAIRS, PAIR_ASM
        )
        m_i = m_new
    return acc, acc2, l_i, m_i


@triton.jit
def _merge_slices(acc, l_i, m_i):
    """Merge :func:`_attn_kv_loop_slices`' per-slice state over its leading axis: ``(BLOCK_M,
    BLOCK_D)`` accumulator, ``(BLOCK_M,)`` sums and maxima as :func:`_attn_kv_loop` keeps them."""
    m = tl.max(m_i, 0)
    w = tl.exp2(m_i - tl.where(m == float("-inf"), 0.0, m)[None, :])  # 0 for slices that saw nothing
    return tl.sum(acc * w[:, :, None], 0), tl.sum(l_i * w, 0), m


# Per-step values (split count, query length) are not specialised on: no mid-run recompiles.
@triton.jit(do_not_specialize=["num_splits", "q_per_seq"])
def _paged_attn_kernel(
    Q,
    K,
    V,
    desc_k,
    desc_v,
    Out,
    Lse,
    MidO,
    MidLse,
    Arrivals,
    BlockTable,
    SeqlensK,
    CuSeqlensQ,
    BatchIdx,
    KvStart,
    Alibi,
    KScale,
    VScale,
    sm_scale,
    softcap,
    window_left,
    window_right,
    num_splits,
    q_per_seq,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_lh,
    stride_lt,
    stride_btb,
    stride_ab,
    stride_mot,
    stride_moh,
    stride_mos,
    stride_mlt,
    stride_mlh,
    G: tl.constexpr,
    HPP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    VARLEN_Q: tl.constexpr,
    HAS_BATCH_IDX: tl.constexpr,
    HAS_KV_START: tl.constexpr,
    SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    KV_FP8: tl.constexpr,
    SPLIT: tl.constexpr,
    WRITE_LSE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    EARLY_V: tl.constexpr,
    FUSED_COMBINE: tl.constexpr,
    USE_TMA: tl.constexpr,
    PREFETCH_TABLE: tl.constexpr,
    WIDE_OFFSETS: tl.constexpr,
    HEADS_FIRST: tl.constexpr,
    PDL: tl.constexpr,
    SLICES: tl.constexpr,
    V_PAIRS: tl.constexpr,
    K_PAIRS: tl.constexpr,
    PAIR_ASM: tl.constexpr,
    SHARE_KV_OFFSETS: tl.constexpr,
    MERGE_CH: tl.constexpr,
):
    if PDL:
        # Lets the combine kernel (launched as a programmatic dependent) be scheduled as soon as
        # every program here has started; it waits for this grid's results itself.
        tl.extra.cuda.gdc_launch_dependents()
    # A program owns HPP consecutive KV heads (kvg: their group), each with its G query heads.
    if HEADS_FIRST:
        kvg = tl.program_id(0)
        pid0 = tl.program_id(1)
        n_pid0 = tl.num_programs(1)
        n_kvg = tl.num_programs(0)
    else:
        pid0 = tl.program_id(0)
        kvg = tl.program_id(1)
        n_pid0 = tl.num_programs(0)
        n_kvg = tl.num_programs(1)
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

    q = _load_tile(
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
        softcap_log2 = softcap * 1.4426950408889634
    else:
        qk_scale = sm_scale * kv_scale * 1.4426950408889634
        softcap_log2 = 0.0
    slopes = tl.zeros([BLOCK_M], dtype=tl.float32)
    if HAS_ALIBI:
        slopes = tl.load(Alibi + b * stride_ab + head, mask=row_ok, other=0.0) * 1.4426950408889634

    # Visible key range of the tile's valid rows, split into num_splits chunks of whole tiles. Keys
    # before KvStart[b] (flash-attn's cache_leftpad) are hidden like keys left of the window.
    kv_lo = 0
    if HAS_KV_START:
        kv_lo = tl.load(KvStart + b)
    q_last = tl.minimum(q0 + QPT, q_len) - 1
    p_first = ctx - q_len + q0
    p_last = ctx - q_len + q_last
    lo = (tl.maximum(p_first - window_left, kv_lo) // TOKN) * TOKN
    hi = tl.minimum(p_last + window_right + 1, ctx)
    n_tiles = tl.cdiv(tl.maximum(hi - lo, 0), TOKN)
    per_split = tl.cdiv(n_tiles, num_splits)
    s_lo = lo + split * per_split * TOKN
    s_hi = tl.minimum(s_lo + per_split * TOKN, hi)
    # Tiles in [full_lo, full_hi) are visible to every row: no mask.
    full_lo = tl.cdiv(tl.maximum(p_last - window_left, kv_lo), TOKN) * TOKN
    full_hi = (tl.maximum(tl.minimum(p_first + window_right + 1, ctx), 0) // TOKN) * TOKN
    a_end = tl.minimum(tl.maximum(full_lo, s_lo), s_hi)
    b_end = tl.minimum(tl.maximum(full_hi, a_end), s_hi)

    if PAGE_SIZE == 0:
        if HAS_BATCH_IDX:
            kv_row = tl.load(BatchIdx + b).to(tl.int64)
        else:
            kv_row = b.to(tl.int64)
    else:
        kv_row = b.to(tl.int64)
    bt_row = BlockTable + b.to(tl.int64) * stride_btb
    if SHARE_KV_OFFSETS:  # equal strides (checked by the launcher): V's offsets are K's
        stride_vb = stride_kb
        stride_vt = stride_kt
        stride_vh = stride_kh
    Kh = K + kvh.to(tl.int64) * stride_kh
    Vh = V + kvh.to(tl.int64) * stride_vh
    col_k = col_h * stride_kh
    col_v = col_h * stride_vh

    # V_PAIRS: V read as int16 byte pairs, accumulated as its even (acc) and odd (acc2) columns;
    # otherwise acc2 is a placeholder the loops carry unchanged.
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
    # K_PAIRS: K read as int16 byte pairs; Q K^T as the queries' even columns (q) against K's even
    # columns plus the odd ones (q2) against K's odd columns. Otherwise q2 is unused.
    if K_PAIRS:
        tl.static_assert(
            KV_FP8 and EVEN_D and not USE_TMA, "k_pairs: fp8 caches, power-of-two d, pointer loads"
        )
        q, q2 = tl.split(tl.reshape(q, (BLOCK_M, BLOCK_D // 2, 2)))
        offs_k = tl.arange(0, BLOCK_D // 2)
    else:
        q2 = q
        offs_k = offs_d

    # Three passes over [s_lo, s_hi): masked head tiles, mask-free tiles, masked tail tiles.
    if SLICES:
        tl.static_assert(HPP == 1 and not USE_TMA, "warp slices: one KV head per program, pointer loads")
        q3 = tl.broadcast_to(q[None, :, :], [SLICES, BLOCK_M, q.shape[1]])
        q3b = tl.broadcast_to(q2[None, :, :], [SLICES, BLOCK_M, q2.shape[1]])
        acc3 = tl.zeros([SLICES, BLOCK_M, DV], dtype=tl.float32)
        acc3b = tl.zeros([SLICES, BLOCK_M, DV2], dtype=tl.float32)
        l3 = tl.zeros([SLICES, BLOCK_M], dtype=tl.float32)
        m3 = tl.full([SLICES, BLOCK_M], float("-inf"), dtype=tl.float32)
    else:
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
        if SLICES:
            acc3, acc3b, l3, m3 = _attn_kv_loop_slices(
                acc3, acc3b, l3, m3, q3, q3b, Kh, Vh, bt_row, kv_row, t_lo, t_hi, ctx, kv_lo, pos, slopes, qk_scale, softcap_log2,
                window_left, window_right, offs_k, offs_v, d_ok, stride_kb, stride_kt, stride_vb, stride_vt, BLOCK_N, SLICES,
                PAGE_SIZE, phase != 1, SOFTCAP, HAS_ALIBI, HAS_KV_START, KV_FP8 or UPCAST, EVEN_D, DOT_PRECISION,
                EARLY_V, WIDE_OFFSETS, V_PAIRS, K_PAIRS, PAIR_ASM,
            )  # fmt: skip
        else:
            acc, acc2, l_i, m_i = _attn_kv_loop(
                acc, acc2, l_i, m_i, q, q2, Kh, Vh, desc_k, desc_v, kvh * HEAD_DIM, bt_row, kv_row, t_lo, t_hi, ctx, kv_lo, pos, slopes, qk_scale, softcap_log2,
                window_left, window_right, offs_t, col_k, col_v, same_head, offs_k, offs_v, d_ok, stride_kb, stride_kt,
                stride_vb, stride_vt, BLOCK_N, TOKN, HPP, PAGE_SIZE, phase != 1, SOFTCAP, HAS_ALIBI, HAS_KV_START, KV_FP8 or UPCAST, EVEN_D, DOT_PRECISION, EARLY_V, USE_TMA, PREFETCH_TABLE,
                WIDE_OFFSETS, V_PAIRS, K_PAIRS, PAIR_ASM,
            )  # fmt: skip
    if SLICES:
        acc, l_i, m_i = _merge_slices(acc3, l3, m3)
        if V_PAIRS:
            acc2, _, _ = _merge_slices(acc3b, l3, m3)
    if V_PAIRS:
        # Even and odd columns back into the head dim's order: column 2c is acc[:, c], 2c + 1 acc2[:, c].
        acc = tl.reshape(tl.join(acc, acc2), (BLOCK_M, BLOCK_D))

    nonempty = l_i > 0.0
    o = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    if KV_FP8:
        o = o * tl.load(VScale + kvh)
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
        if FUSED_COMBINE:
            # Arrival counter of this (sequence, KV head, query tile): the barrier orders every
            # thread's partial stores before the (gpu-scope, acq_rel) atomic; the last split to
            # arrive merges all of them and resets the counter for the next launch (graph replay).
            tl.debug_barrier()
            n_tiles_q = n_pid0 // num_splits
            arrival = Arrivals + (b * n_kvg + kvg) * n_tiles_q + tile
            prev = tl.atomic_add(arrival, 1, sem="acq_rel")
            if prev == num_splits - 1:
                tl.debug_barrier()
                _merge_splits(
                    MidO, MidLse, Out, Lse, tok, head, row_ok, offs_d, d_ok, num_splits,
                    stride_mot, stride_moh, stride_mos, stride_mlt, stride_mlh,
                    stride_ot, stride_oh, stride_lh, stride_lt, BLOCK_M, BLOCK_D, WRITE_LSE, MERGE_CH,
                )  # fmt: skip
                tl.atomic_xchg(arrival, 0)
    else:
        optr = Out + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(optr, o.to(Out.dtype.element_ty), mask=out_mask)
        if WRITE_LSE:
            tl.store(Lse + head * stride_lh + tok * stride_lt, lse2 * 0.6931471805599453, mask=row_ok)


@triton.jit
def _merge_splits(
    MidO, MidLse, Out, Lse, tok, head, row_ok, offs_d, d_ok, num_splits,
    stride_mot, stride_moh, stride_mos, stride_mlt, stride_mlh,
    stride_ot, stride_oh, stride_lh, stride_lt,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, WRITE_LSE: tl.constexpr, MERGE_CH: tl.constexpr,
):  # fmt: skip
    """Merge the ``num_splits`` partials of ``BLOCK_M`` (token, head) rows by a running max of their
    log2-sum-exps (empty splits, lse = -inf, weigh 0), ``MERGE_CH`` splits per step: a step's
    loads can be issued together, so a merge of ``S`` splits waits for about ``S / MERGE_CH`` round
    trips to L2 rather than ``S`` (this runs on the critical path, after the last split's tile
    loop). ``.cg`` loads: read other SMs' writes from L2."""
    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    den = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    lse_rows = MidLse + tok * stride_mlt + head * stride_mlh  # (BLOCK_M,) pointers
    o_rows = MidO + tok[:, None] * stride_mot + head[:, None] * stride_moh + offs_d[None, :]
    row_mask = row_ok[:, None] & d_ok[None, :]
    for s0 in range(0, num_splits, MERGE_CH):
        # Unrolled, so the step's loads do not wait on each other's math; a (MERGE_CH, rows, d)
        # load reduced over its first axis instead made triton 3.6 spill and reduce through
        # shared memory.
        for c in tl.static_range(MERGE_CH):
            # a (rows,) mask: the interpreter takes no scalar bool in one
            rows_in = row_ok & (tl.zeros([BLOCK_M], dtype=tl.int32) + (s0 + c) < num_splits)
            ls = tl.load(lse_rows + (s0 + c), mask=rows_in, other=float("-inf"), cache_modifier=".cg")
            o_s = tl.load(o_rows + (s0 + c) * stride_mos, mask=rows_in[:, None] & d_ok[None, :], other=0.0,
                          cache_modifier=".cg")  # fmt: skip
            m_new = tl.maximum(m, ls)
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m - m_use)
            w = tl.exp2(ls - m_use)
            acc = acc * alpha[:, None] + o_s * w[:, None]
            den = den * alpha + w
            m = m_new
    ok = den > 0.0
    out = acc / tl.where(ok, den, 1.0)[:, None]
    tl.store(Out + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
             out.to(Out.dtype.element_ty), mask=row_mask)  # fmt: skip
    if WRITE_LSE:
        m_fin = tl.where(m == float("-inf"), 0.0, m)
        lse = tl.where(ok, (m_fin + tl.log2(tl.where(ok, den, 1.0))) * 0.6931471805599453, float("-inf"))
        tl.store(Lse + head * stride_lh + tok * stride_lt, lse, mask=row_ok)


@triton.jit
def _combine_kernel(
    MidO,
    MidLse,
    Out,
    Lse,
    num_splits,
    stride_mot,
    stride_moh,
    stride_mos,
    stride_mlt,
    stride_mlh,
    stride_ot,
    stride_oh,
    stride_lh,
    stride_lt,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    WRITE_LSE: tl.constexpr,
    PDL: tl.constexpr,
):
    """Merge the splits of one (token, head), head-dim columns ``[program_id(2) * BLOCK_D, ... +
    BLOCK_D)``: weights ``2**(lse_s - max)``, empty splits weigh 0."""
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
                (m + tl.log2(tl.where(denom > 0.0, denom, 1.0))) * 0.6931471805599453,
                float("-inf"),
            )
            tl.store(Lse + h * stride_lh + tok * stride_lt, lse_out)


# Compiled launches by launch key (flashpage.ops.launch_cache) and the positions of the per-call
# arguments: the paged kernel's 18 tensor / descriptor arguments, its two float scalars, the window
# bounds, split count, query length, LSE / block-table / workspace strides; the combine's four tensors,
# split count, workspace and LSE strides.
_PAGED_LAUNCHES = LaunchCache(_paged_attn_kernel)
_RESOLVED_LAUNCHES = Memo(512)  # resolve_launch's answers
_COMBINE_LAUNCHES = LaunchCache(_combine_kernel)
_PAGED_SLOTS = (*range(24), 34, 35, 36, 38, 39, 40, 41, 42)
_COMBINE_SLOTS = (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 13)
# What a PagedLaunch replaces per call: the paged kernel's tensors, the combine's four tensors
# (workspace, output, LSE).
_TENSOR_SLOTS = tuple(range(18))
_COMBINE_TENSOR_SLOTS = (0, 1, 2, 3)


_MAX_GRID_YZ = 65535  # CUDA's limit on a grid's y and z dimensions
# Query rows up to which PagedAttnConfig.warp_slices applies: one warp's (rows, d) fp32 accumulator
# is 64 registers per thread at 16 rows and d=128.
WARP_SLICE_ROWS = 16


@dataclass(frozen=True)
class PagedTiles:
    """How one launch of the paged attention kernel tiles its problem (:func:`paged_tiles`).

    Attributes:
        block_m: query rows per program; a row is a (query token, query head) pair.
        q_tiles: query tiles per sequence.
        heads: KV heads per program (``HPP``; each brings its ``group`` query heads).
        head_programs: programs per (sequence, query tile, split): ``nheads_k // heads``.
        tile_tokens: KV tokens per tile: ``block_n // heads``.
    """

    block_m: int
    q_tiles: int
    heads: int
    head_programs: int
    tile_tokens: int


def kv_heads_per_program(
    config: PagedAttnConfig, max_seqlen_q: int, group: int, nheads_k: int, kv_dtype: torch.dtype
) -> int:
    """KV heads one program owns: ``config.heads_per_program`` (``0``: enough to fill 16 query rows),
    lowered to a power of two dividing ``nheads_k`` and at most ``config.block_n``; 1 for fp8 caches
    (one dequantisation scale per program), TMA tiles (one head's rows per box) and warp slices."""
    if is_fp8_dtype(kv_dtype) or config.use_tma or config.warp_slices:
        return 1
    want = config.heads_per_program or max(1, 16 // next_pow2(max(1, max_seqlen_q) * group))
    return pow2_divisor_at_most(nheads_k, min(want, config.block_n))


def paged_tiles(
    config: PagedAttnConfig,
    max_seqlen_q: int,
    nheads: int,
    nheads_k: int,
    kv_dtype: torch.dtype,
) -> PagedTiles:
    """The launch geometry for ``max_seqlen_q`` queries per sequence.

    ``block_m`` is ``config.block_m`` or, for decode, the smallest power of two >= 16 that holds
    ``max_seqlen_q * group * heads`` rows (up to 128); always at least ``group * heads``. A tile
    holds ``block_m // (group * heads)`` query tokens.
    """
    group = nheads // nheads_k
    heads = kv_heads_per_program(config, max_seqlen_q, group, nheads_k, kv_dtype)
    per_token = group * heads
    if config.block_m:
        block_m = max(config.block_m, next_pow2(per_token))
    else:
        rows = max(1, max_seqlen_q) * per_token
        block_m = max(16, min(next_pow2(rows), 128), next_pow2(per_token))
    q_tiles = cdiv(max(max_seqlen_q, 1), block_m // per_token)
    return PagedTiles(block_m, q_tiles, heads, nheads_k // heads, config.block_n // heads)


_MAX_GRID_YZ = 65535  # CUDA's limit on a grid's y and z dimensions


def paged_grid(
    config: PagedAttnConfig, q_tiles: int, num_splits: int, head_programs: int, batch: int
) -> tuple[int, int, int]:
    """The paged attention kernel's grid over ``head_programs`` (KV heads / heads per program):
    heads first when ``config.heads_first`` and the ``q_tiles * num_splits`` programs per
    (sequence, head group) fit the grid's y dimension."""
    work = q_tiles * num_splits
    return (head_programs, work, batch) if _heads_first(config, work) else (work, head_programs, batch)


def _heads_first(config: PagedAttnConfig, work: int) -> bool:
    return config.heads_first and work <= _MAX_GRID_YZ


def allocate_workspace(
    total_q: int, nheads: int, num_splits: int, head_dim: int, device: torch.device, arrivals: int = 0
) -> tuple[Tensor, Tensor, Tensor]:
    """Split-KV workspace: partial outputs ``(total_q, nheads, splits, d)`` and log2-sum-exps
    ``(total_q, nheads, splits)``, fp32, and ``arrivals`` int32 zeros (the fused combine's counters,
    one per ``(sequence, KV head, query tile)``; the kernel leaves them zero)."""
    mid_o = torch.empty(total_q, nheads, num_splits, head_dim, dtype=torch.float32, device=device)
    mid_lse = torch.empty(total_q, nheads, num_splits, dtype=torch.float32, device=device)
    counters = (
        torch.zeros(arrivals, dtype=torch.int32, device=device)
        if arrivals > 0
        else torch.empty(1, dtype=torch.int32, device=device)  # unfused combine: never touched
    )
    return mid_o, mid_lse, counters


def launch_paged_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    out: Tensor,
    seqlens_k: Tensor,
    *,
    max_seqlen_q: int,
    block_table: Tensor | None = None,
    cu_seqlens_q: Tensor | None = None,
    cache_batch_idx: Tensor | None = None,
    kv_start: Tensor | None = None,
    lse: Tensor | None = None,
    softmax_scale: float,
    causal: bool = True,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
    num_splits: int = 1,
    config: PagedAttnConfig | None = None,
    workspace: tuple[Tensor, Tensor, Tensor] | None = None,
    bind: bool = False,
) -> PagedLaunch | None:
    """Launch the paged attention kernel (and the combine when ``num_splits > 1``). No checks, no syncs.

    The caller (a validating entry point, or a :class:`~flashpage.ops.paged_plan.DecodePlan`) has
    checked every argument; this function only reads host metadata (shapes, strides), so it can be
    captured in a CUDA graph.

    Args:
        q: ``(total_q, nheads, d)`` packed queries; with ``cu_seqlens_q=None`` sequence ``b`` owns rows
            ``b * max_seqlen_q .. (b+1) * max_seqlen_q - 1`` (a padded decode batch).
        k_cache, v_cache: paged ``(num_blocks, block_size, nheads_k, d)`` with ``block_table``, or
            contiguous ``(batch_cache, seqlen_cache, nheads_k, d)`` without (then ``cache_batch_idx``
            maps batch entries to cache rows).
        out: ``(total_q, nheads, d)``, written.
        seqlens_k: ``(batch,)`` int32 keys per sequence (including the queries' own tokens).
        kv_start: optional ``(batch,)`` int32 first key of each sequence (flash-attn's
            ``cache_leftpad``): keys ``[0, kv_start[b])`` are hidden, positions stay absolute.
        lse: optional ``(nheads, total_q)``-indexed float32 output (any strides), natural log.
        alibi_slopes: ``(nheads,)`` or ``(batch, nheads)`` float32.
        k_scale, v_scale: ``(nheads_k,)`` float32 fp8 dequantisation scales (fp8 caches).
        workspace: ``allocate_workspace(total_q, nheads, num_splits, d, arrivals=batch * nheads_k *
            q_tiles)`` buffers, else allocated here.
        bind: also return the launch as a :class:`PagedLaunch` (``None`` where TMA descriptors,
            built from each call's caches, are in use).
    Returns:
        The :class:`PagedLaunch` when ``bind``, else ``None``.
    """
    config = config or default_decode_config(k_cache.dtype, q.shape[-1], block_table is not None)
    total_q, nheads, head_dim = q.shape
    batch = seqlens_k.shape[0]
    nheads_k = k_cache.shape[2]
    group = nheads // nheads_k
    tiles = paged_tiles(config, max_seqlen_q, nheads, nheads_k, k_cache.dtype)
    block_m, q_tiles = tiles.block_m, tiles.q_tiles
    paged = block_table is not None
    fp8 = is_fp8_dtype(k_cache.dtype)
    left = window_size[0] if window_size[0] >= 0 else _NO_WINDOW
    right = 0 if causal else (window_size[1] if window_size[1] >= 0 else _NO_WINDOW)
    split = num_splits > 1
    write_lse = lse is not None
    # The interpreter keeps bf16 as raw uint16 (arithmetic on it is garbage): compute in fp32 there.
    upcast = q.dtype == torch.bfloat16 and interpreter_enabled()
    no_scales = (fp8 and k_scale is None, fp8 and v_scale is None)
    if fp8 and k_scale is None:
        k_scale = torch.ones(nheads_k, dtype=torch.float32, device=q.device)
    if fp8 and v_scale is None:
        v_scale = torch.ones(nheads_k, dtype=torch.float32, device=q.device)
    fused = split and config.fused_combine
    pdl = split and not fused and config.pdl and pdl_supported(q.device)
    n_arrivals = batch * tiles.head_programs * q_tiles
    ws = None  # unsplit: _kernel_tensors passes placeholders the kernel never reads
    if split:
        ws = (
            workspace
            if workspace is not None
            else allocate_workspace(
                total_q, nheads, num_splits, head_dim, q.device, n_arrivals if fused else 0
            )
        )
        mid_o, mid_lse, arrivals = ws
        if fused and arrivals.numel() < n_arrivals:
            raise ValueError(f"workspace holds {arrivals.numel()} arrival counters, {n_arrivals} needed")
    lse_arg = lse if write_lse else out
    lse_strides = (lse.stride(0), lse.stride(1)) if write_lse else (0, 0)
    # A paged cache seen as (num_blocks * block_size, nheads_k * d) rows: the flash kernels' row view.
    use_tma = (
        config.use_tma
        and tiles.heads == 1
        and paged
        and k_cache.shape[1] >= config.block_n
        and tma_supported(k_cache.device)
        and all(tma_row_view_ok(c, False, head_dim) for c in (k_cache, v_cache))
    )
    bind = bind and not use_tma  # TMA descriptors are built from each call's caches: not bound
    if use_tma:
        desc_k, desc_v = (
            make_row_descriptor(c, False, config.block_n, head_dim, checked=True) for c in (k_cache, v_cache)
        )
    else:
        desc_k, desc_v = k_cache, v_cache
    wide = wide_offsets(config, k_cache, v_cache, paged)
    # Strides below in the units the kernel reads (int16 for caches read as byte pairs).
    k_cache, v_cache, k_pairs, v_pairs, share_offsets = kv_read_views(
        config, tiles, k_cache, v_cache, head_dim, use_tma
    )
    grid = paged_grid(config, q_tiles, num_splits, tiles.head_programs, batch)
    heads_first = _heads_first(config, q_tiles * num_splits)
    tensors = _kernel_tensors(
        q, k_cache, v_cache, desc_k, desc_v, out, lse, ws, block_table, seqlens_k,
        cu_seqlens_q, cache_batch_idx, kv_start, alibi_slopes, k_scale, v_scale,
    )  # fmt: skip
    mid_strides = (
        (mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1))
        if split
        else (0, 0, 0, 0, 0)
    )
    bt_stride = block_table.stride(0) if paged else 0
    ints = (left, right, num_splits, max_seqlen_q, *lse_strides, bt_stride, *mid_strides)
    scalars = (float(softmax_scale), float(softcap) if softcap > 0 else 1.0)
    values = (*tensors, *scalars, *ints)
    page_size = k_cache.shape[1] if paged else 0
    key = (
        config, block_m, tiles.heads, q.dtype, k_cache.dtype, out.dtype, q.device.index, head_dim, nheads,
        nheads_k, page_size, cu_seqlens_q is not None, cache_batch_idx is not None, kv_start is not None, softcap > 0,
        None if alibi_slopes is None else (alibi_slopes.dim(), alibi_slopes.stride(0)), split, write_lse, upcast, fused, use_tma,
        wide, pdl, heads_first, v_pairs, k_pairs,
        q.stride(), k_cache.stride(), v_cache.stride(), out.stride(), aligned(*tensors),
        int_specs(ints),
    )  # fmt: skip

    def build() -> tuple[list[Any], dict[str, Any]]:
        args = [
            *tensors, *scalars, left, right, num_splits, max_seqlen_q,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1),
            *lse_strides, bt_stride,
            alibi_slopes.stride(0) if alibi_slopes is not None and alibi_slopes.dim() == 2 else 0,
            *mid_strides,
        ]  # fmt: skip
        kwargs = paged_kernel_constexprs(
            config, tiles, group=group, head_dim=head_dim, page_size=page_size, fp8=fp8, split=split,
            fp32_dot=q.dtype == torch.float32 or upcast, upcast=upcast, varlen_q=cu_seqlens_q is not None,
            batch_idx=cache_batch_idx is not None, kv_start=kv_start is not None, softcap=softcap > 0, alibi=alibi_slopes is not None,
            write_lse=write_lse, fused=fused, use_tma=use_tma, wide=wide, heads_first=heads_first, pdl=pdl,
            v_pairs=v_pairs, k_pairs=k_pairs, share_offsets=share_offsets,
        )  # fmt: skip
        kwargs.update(num_warps=config.num_warps, num_stages=config.num_stages)
        if config.maxnreg and q.device.type == "cuda":
            kwargs["maxnreg"] = config.maxnreg
        return args, kwargs

    bound = _PAGED_LAUNCHES.launch(key, grid, _PAGED_SLOTS, values, build, _TENSOR_SLOTS if bind else None)
    bound_combine = None
    if split and not fused:
        c_tensors = (mid_o, mid_lse, out, lse_arg)
        c_ints = (num_splits, *mid_strides, *lse_strides)
        block_s = max(2, next_pow2(num_splits))
        block_dc = min(config.combine_block_d or next_pow2(head_dim), next_pow2(head_dim))
        c_key = (
            head_dim, block_s, block_dc, config.combine_warps, write_lse, pdl, out.dtype, q.device.index, out.stride(), aligned(*c_tensors),
            int_specs(c_ints),
        )  # fmt: skip

        def build_combine() -> tuple[list[Any], dict[str, Any]]:
            args = [*c_tensors, num_splits, *mid_strides, out.stride(0), out.stride(1), *lse_strides]
            kwargs = {"HEAD_DIM": head_dim, "BLOCK_D": block_dc, "BLOCK_S": block_s,
                      "WRITE_LSE": write_lse, "PDL": pdl, "num_warps": config.combine_warps,
                      **({"launch_pdl": True} if pdl else {})}  # fmt: skip
            return args, kwargs

        bound_combine = _COMBINE_LAUNCHES.launch(
            c_key,
            (total_q, nheads, cdiv(head_dim, block_dc)),
            _COMBINE_SLOTS,
            (*c_tensors, *c_ints),
            build_combine,
            _COMBINE_TENSOR_SLOTS if bind else None,
        )
    if bound is None:
        return None
    return PagedLaunch(
        bound, bound_combine, ws, (k_pairs, v_pairs),
        (k_scale if no_scales[0] else None, v_scale if no_scales[1] else None),
    )  # fmt: skip


def _kernel_tensors(
    q: Tensor,
    k_read: Tensor,
    v_read: Tensor,
    desc_k: Any,
    desc_v: Any,
    out: Tensor,
    lse: Tensor | None,
    workspace: tuple[Tensor, Tensor, Tensor] | None,
    block_table: Tensor | None,
    seqlens_k: Tensor,
    cu_seqlens_q: Tensor | None,
    cache_batch_idx: Tensor | None,
    kv_start: Tensor | None,
    alibi_slopes: Tensor | None,
    k_scale: Tensor | None,
    v_scale: Tensor | None,
) -> tuple[Any, ...]:
    """The paged kernel's 18 tensor / descriptor arguments in signature order (``_TENSOR_SLOTS``).
    Absent ones take a pointer the kernel never dereferences; an unsplit launch's workspace
    (``None``) is ``(out, out, seqlens_k)``, likewise unused."""
    dummy = seqlens_k
    return (
        q, k_read, v_read, desc_k, desc_v, out, lse if lse is not None else out,
        *(workspace if workspace is not None else (out, out, seqlens_k)),
        block_table if block_table is not None else dummy, seqlens_k,
        cu_seqlens_q if cu_seqlens_q is not None else dummy,
        cache_batch_idx if cache_batch_idx is not None else dummy,
        kv_start if kv_start is not None else dummy,
        alibi_slopes if alibi_slopes is not None else q, k_scale if k_scale is not None else q,
        v_scale if v_scale is not None else q,
    )  # fmt: skip


@dataclass(frozen=True)
class PagedLaunch:
    """A :func:`launch_paged_attention` call with everything but its tensors bound (``bind=True``).

    :meth:`relaunch` launches the same kernels again with new tensors and computes nothing else:
    no tiles, no launch keys, no Triton binder. The caller guarantees that the new tensors
    specialise the launch as the bound ones did: same dtypes, shapes and strides, the same low
    four bits of each data pointer (16-byte alignment, and the byte-pair views' parity), the same
    optional tensors present (:func:`~flashpage.ops.paged_plan.run_decode` keys its launches on
    exactly that).

    Attributes:
        main, combine: the attention kernel's and the split combine's launches (``combine`` is
            ``None`` without a split or with the fused combine).
        workspace: the split workspace the launch was bound to (``None`` unsplit), used by
            :meth:`relaunch` unless it is given another.
        pairs: whether K / V are read as int16 byte pairs (the caches are viewed so again).
        unit_scales: the fp8 scales of ones that stand in for a scale the bound call did not
            pass (``None`` where it passed one).
    """

    main: BoundLaunch
    combine: BoundLaunch | None
    workspace: tuple[Tensor, Tensor, Tensor] | None
    pairs: tuple[bool, bool]
    unit_scales: tuple[Tensor | None, Tensor | None]

    def relaunch(
        self,
        q: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        out: Tensor,
        seqlens_k: Tensor,
        *,
        block_table: Tensor | None = None,
        cu_seqlens_q: Tensor | None = None,
        cache_batch_idx: Tensor | None = None,
        kv_start: Tensor | None = None,
        lse: Tensor | None = None,
        alibi_slopes: Tensor | None = None,
        k_scale: Tensor | None = None,
        v_scale: Tensor | None = None,
        workspace: tuple[Tensor, Tensor, Tensor] | None = None,
    ) -> None:
        """Launch with these tensors (as :func:`launch_paged_attention` takes them); ``workspace``
        (shaped like the bound one, its arrival counters zero) replaces the bound workspace."""
        k_scale = k_scale if k_scale is not None else self.unit_scales[0]
        v_scale = v_scale if v_scale is not None else self.unit_scales[1]
        k_read = k_cache.view(torch.int16) if self.pairs[0] else k_cache
        v_read = v_cache.view(torch.int16) if self.pairs[1] else v_cache
        ws = workspace if workspace is not None else self.workspace
        tensors = _kernel_tensors(
            q, k_read, v_read, k_cache, v_cache, out, lse, ws, block_table, seqlens_k,
            cu_seqlens_q, cache_batch_idx, kv_start, alibi_slopes, k_scale, v_scale,
        )  # fmt: skip
        self.main.relaunch(tensors)
        if self.combine is not None:
            assert ws is not None  # a combine launch exists only for a split
            self.combine.relaunch((ws[0], ws[1], out, lse if lse is not None else out))


class PagedLaunches:
    """Bound :class:`PagedLaunch` es by everything a launch derives from its arguments: a decode
    plan's (:func:`~flashpage.ops.paged_plan.run_decode`) and the eager entry points'
    (:func:`paged_decode`, ``flash_attn_with_kvcache``, ``paged_prefill``, through ``EAGER_LAUNCHES``).

    A decode loop launches once per layer and step with tensors laid out alike: the first call of a
    layout goes through :func:`launch_paged_attention` and binds it; later ones only relaunch
    (:meth:`PagedLaunch.relaunch`), which saves the launch key, the tiles and Triton's binder
    (binding took ``run_decode`` from 94 to 40 us per call on an H100 machine's host). The key is
    every tensor's shape, strides, dtype, device and low four data-pointer bits (Triton's 16-byte
    alignment specialisation, the byte-pair views' parity), which optional tensors are present, and
    every non-tensor argument. A split workspace passed to :meth:`launch` (a plan's own) is bound
    and reused; without one, each call allocates its own and none is kept, so a memo shared by
    calls on several streams stays safe. ``max_items`` bounds the memo (cleared when full).
    """

    def __init__(self, max_items: int = 64) -> None:
        self.max_items = max_items
        # key -> (the launch, and for a launch bound without its workspace that workspace's
        # (total_q, nheads, splits, d) and arrival counters; None where nothing is allocated per call)
        self._items: dict[tuple[Any, ...], tuple[PagedLaunch, tuple[tuple[int, ...], int] | None]] = {}

    def __len__(self) -> int:
        return len(self._items)

    def clear(self) -> None:
        self._items.clear()

    def launch(
        self,
        q: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        out: Tensor,
        seqlens_k: Tensor,
        *,
        max_seqlen_q: int,
        block_table: Tensor | None = None,
        cu_seqlens_q: Tensor | None = None,
        cache_batch_idx: Tensor | None = None,
        kv_start: Tensor | None = None,
        lse: Tensor | None = None,
        softmax_scale: float,
        causal: bool,
        window_size: tuple[int, int],
        softcap: float,
        alibi_slopes: Tensor | None,
        k_scale: Tensor | None,
        v_scale: Tensor | None,
        num_splits: int,
        config: PagedAttnConfig,
        workspace: tuple[Tensor, Tensor, Tensor] | None = None,
    ) -> None:
        """:func:`launch_paged_attention` with these arguments (``workspace=None``: allocated per call)."""
        tensors = (q, k_cache, v_cache, out, seqlens_k, block_table, cu_seqlens_q, cache_batch_idx, kv_start,
                   lse, alibi_slopes, k_scale, v_scale)  # fmt: skip
        key = (
            config, max_seqlen_q, float(softmax_scale), bool(causal), tuple(window_size), float(softcap),
            num_splits, workspace is None,
            *(None if t is None else (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() & 15) for t in tensors),
        )  # fmt: skip
        hit = self._items.get(key)
        if hit is not None:
            bound, ws_args = hit
            bound.relaunch(
                q, k_cache, v_cache, out, seqlens_k, block_table=block_table, cu_seqlens_q=cu_seqlens_q,
                cache_batch_idx=cache_batch_idx, kv_start=kv_start, lse=lse, alibi_slopes=alibi_slopes,
                k_scale=k_scale, v_scale=v_scale,
                workspace=allocate_workspace(*ws_args[0], q.device, ws_args[1]) if ws_args is not None else None,
            )  # fmt: skip
            return
        bound = launch_paged_attention(
            q, k_cache, v_cache, out, seqlens_k, max_seqlen_q=max_seqlen_q, block_table=block_table,
            cu_seqlens_q=cu_seqlens_q, cache_batch_idx=cache_batch_idx, kv_start=kv_start, lse=lse,
            softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
            alibi_slopes=alibi_slopes, k_scale=k_scale, v_scale=v_scale, num_splits=num_splits,
            config=config, workspace=workspace, bind=True,
        )  # fmt: skip
        if bound is None:  # TMA descriptors: every call takes the full path
            return
        ws_args = None
        if workspace is None and bound.workspace is not None:
            mid_o, _, counters = bound.workspace
            fused = bound.combine is None  # a split without a combine launch combines in the kernel
            ws_args = (tuple(mid_o.shape), counters.numel() if fused else 0)
            bound = replace(bound, workspace=None)
        if len(self._items) >= self.max_items:
            self._items.clear()
        self._items[key] = (bound, ws_args)


# The eager entry points' bound launches (paged_decode, flash_attn_with_kvcache, paged_prefill).
EAGER_LAUNCHES = PagedLaunches()


def paged_kernel_constexprs(
    config: PagedAttnConfig,
    tiles: PagedTiles,
    *,
    group: int,
    head_dim: int,
    page_size: int,
    fp8: bool,
    split: bool,
    fp32_dot: bool,
    upcast: bool = False,
    varlen_q: bool = False,
    batch_idx: bool = False,
    kv_start: bool = False,
    softcap: bool = False,
    alibi: bool = False,
    write_lse: bool = False,
    fused: bool = False,
    use_tma: bool = False,
    wide: bool = False,
    heads_first: bool = False,
    pdl: bool = False,
    v_pairs: bool = False,
    k_pairs: bool = False,
    share_offsets: bool = False,
) -> dict[str, Any]:
    """The compile-time arguments of :func:`_paged_attn_kernel` for one launch (by name).

    :func:`launch_paged_attention` derives the flags from its arguments; the offline codegen probe
    (``benchmarks/probes/decode_sass.py``) passes the decode case it compiles. ``page_size`` is
    ``0`` for a contiguous cache; ``fp32_dot``: ``tl.dot`` in IEEE fp32 (fp32 queries, or bf16
    upcast under the interpreter) instead of tf32/bf16; ``v_pairs`` / ``k_pairs``:
    :func:`v_pairs_apply`'s / :func:`k_pairs_apply`'s answer for the launch; ``share_offsets``:
    ``PagedAttnConfig.share_kv_offsets`` where the caches' strides (as read) are equal.
    """
    block_d = max(16, next_pow2(head_dim))
    return {
        "G": group, "HPP": tiles.heads, "HEAD_DIM": head_dim, "BLOCK_D": block_d,
        "BLOCK_M": tiles.block_m, "BLOCK_N": config.block_n, "PAGE_SIZE": page_size, "VARLEN_Q": varlen_q,
        "HAS_BATCH_IDX": batch_idx, "HAS_KV_START": kv_start, "SOFTCAP": softcap, "HAS_ALIBI": alibi, "KV_FP8": fp8, "SPLIT": split,
        "WRITE_LSE": write_lse, "DOT_PRECISION": "ieee" if fp32_dot else "tf32", "UPCAST": upcast,
        "EARLY_V": config.early_v, "FUSED_COMBINE": fused, "USE_TMA": use_tma,
        "PREFETCH_TABLE": config.prefetch_table, "WIDE_OFFSETS": wide, "HEADS_FIRST": heads_first, "PDL": pdl,
        "SLICES": config.num_warps if config.warp_slices and tiles.block_m <= WARP_SLICE_ROWS else 0,
        "V_PAIRS": v_pairs, "K_PAIRS": k_pairs, "PAIR_ASM": not interpreter_enabled(),
        "SHARE_KV_OFFSETS": share_offsets,
        "MERGE_CH": merge_chunk(tiles.block_m, block_d, config.num_warps) if fused else 1,
    }  # fmt: skip


def merge_chunk(block_m: int, block_d: int, num_warps: int) -> int:
    """Splits the fused combine (``PagedAttnConfig.fused_combine``) loads per step: as many as keep
    one step's ``(chunk, block_m, block_d)`` fp32 partials at 64 values per thread (at least one;
    all three sizes are powers of two, so the answer is one too)."""
    return max(1, 64 * 32 * num_warps // (block_m * block_d))


def _pairs_head_dim(head_dim: int) -> bool:
    """Head dims the byte pairs serve: powers of two (>= 16), where the tile holds no padded
    columns, so the even and odd halves are ``BLOCK_D // 2`` wide each."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0


def v_pairs_apply(
    config: PagedAttnConfig, tiles: PagedTiles, v_cache: Tensor, head_dim: int, use_tma: bool
) -> bool:
    """Whether a launch reads V as int16 byte pairs (``PagedAttnConfig.v_pairs``): fp8 decode tiles
    (at most :data:`WARP_SLICE_ROWS` rows) of a power-of-two head dim, pointer loads, and a V cache
    that can be viewed as int16 (even element offset and strides)."""
    return config.v_pairs and _pairs_ok(tiles, v_cache, head_dim, use_tma)


def k_pairs_apply(
    config: PagedAttnConfig, tiles: PagedTiles, k_cache: Tensor, head_dim: int, use_tma: bool
) -> bool:
    """Whether a launch reads K as int16 byte pairs (``PagedAttnConfig.k_pairs``): the conditions
    of :func:`v_pairs_apply`, on the K cache."""
    return config.k_pairs and _pairs_ok(tiles, k_cache, head_dim, use_tma)


def kv_read_views(
    config: PagedAttnConfig, tiles: PagedTiles, k_cache: Tensor, v_cache: Tensor, head_dim: int, use_tma: bool
) -> tuple[Tensor, Tensor, bool, bool, bool]:
    """The caches as one launch's kernel reads them: ``(k_cache, v_cache, k_pairs, v_pairs,
    share_offsets)``. A cache read as byte pairs (:func:`k_pairs_apply`, :func:`v_pairs_apply`) is
    viewed as int16 (last dim and strides halved); ``share_offsets`` is
    ``PagedAttnConfig.share_kv_offsets`` where the two views have equal strides."""
    k_pairs = k_pairs_apply(config, tiles, k_cache, head_dim, use_tma)
    v_pairs = v_pairs_apply(config, tiles, v_cache, head_dim, use_tma)
    if k_pairs:
        k_cache = k_cache.view(torch.int16)
    if v_pairs:
        v_cache = v_cache.view(torch.int16)
    share_offsets = config.share_kv_offsets and k_cache.stride() == v_cache.stride()
    return k_cache, v_cache, k_pairs, v_pairs, share_offsets


def _pairs_ok(tiles: PagedTiles, cache: Tensor, head_dim: int, use_tma: bool) -> bool:
    """The launches whose ``cache`` tiles can be read as int16 byte pairs (see :func:`v_pairs_apply`)."""
    return (
        is_fp8_dtype(cache.dtype)
        and tiles.block_m <= WARP_SLICE_ROWS
        and _pairs_head_dim(head_dim)
        and not use_tma
        and cache.stride(-1) == 1
        and cache.storage_offset() % 2 == 0
        and all(st % 2 == 0 for st in cache.stride()[:-1])
    )


def _max_offset(t: Tensor) -> int:
    """Largest element offset of ``t`` from its data pointer (0 for an empty tensor)."""
    n = t.numel()
    if n == 0 or t.is_contiguous():  # the common cache: one cheap test per launch
        return max(n - 1, 0)
    return sum((size - 1) * st for size, st in zip(t.shape, t.stride()))


def wide_offsets(config: PagedAttnConfig, k_cache: Tensor, v_cache: Tensor, paged: bool) -> bool:
    """Whether the kernel computes KV-row offsets in 64-bit integers: always for a contiguous cache
    and without ``config.narrow_offsets``; otherwise only when an element of either paged cache
    lies 2**31 or more elements past its base (a 32-bit product ``block_id * stride`` would wrap)."""
    if not (config.narrow_offsets and paged):
        return True
    return max(_max_offset(k_cache), _max_offset(v_cache)) >= 2**31


def _is_pow2_block_size(block_size: int) -> bool:
    return 8 <= block_size <= 256 and block_size & (block_size - 1) == 0


def check_paged_cache(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_table: Tensor | None,
    seqlens: Tensor,
    *,
    batch: int,
    seqlens_name: str = "cache_seqlens",
    alibi_slopes: Tensor | None = None,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
) -> None:
    """Shape/dtype/device checks shared by the paged entry points (host metadata only, no sync).

    Args:
        q: ``(..., nheads, d)`` queries (last dim contiguous).
        k_cache, v_cache: ``(num_blocks, block_size, nheads_k, d)`` (paged, ``block_table`` given) or
            ``(batch_cache, seqlen_cache, nheads_k, d)`` (contiguous, ``block_table=None``).
        block_table: ``(batch, max_blocks_per_seq)`` int32 or ``None``.
        seqlens: ``(batch,)`` int32 keys per sequence.
    Raises:
        TypeError / ValueError naming the offending argument.
    """
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), (seqlens_name, seqlens)):
        if not isinstance(x, Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(x).__name__}")
        if x.device != q.device:
            raise ValueError(f"{name} is on {x.device}, expected {q.device} (q's device)")
    if q.dtype not in _COMPUTE_DTYPES:
        raise TypeError(f"q must be fp16, bf16 or fp32, got {q.dtype}")
    if q.stride(-1) != 1:
        raise ValueError("q must be contiguous in its last dimension")
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.dim() != 4:
            raise ValueError(
                f"{name} must be 4-D (num_blocks, block_size, nheads_k, d), got shape {tuple(c.shape)}"
            )
        if c.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")
        if c.dtype != q.dtype and not is_fp8_dtype(c.dtype):
            raise TypeError(f"{name} dtype {c.dtype} must be q's dtype {q.dtype} or torch.float8_e4m3fn")
    if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError(
            f"k_cache {tuple(k_cache.shape)} {k_cache.dtype} and v_cache {tuple(v_cache.shape)} {v_cache.dtype} "
            "must have the same shape and dtype"
        )
    nheads, d = q.shape[-2], q.shape[-1]
    nheads_k = k_cache.shape[2]
    if k_cache.shape[3] != d:
        raise ValueError(f"k_cache head dim {k_cache.shape[3]} != q head dim {d}")
    if not 8 <= d <= 256:
        raise ValueError(f"head dim d={d} must be in [8, 256]")
    if nheads_k < 1 or nheads % nheads_k:
        raise ValueError(f"q's nheads ({nheads}) must be a multiple of the cache's nheads_k ({nheads_k})")
    if block_table is not None:
        if not isinstance(block_table, Tensor):
            raise TypeError(f"block_table must be an int32 tensor, got {type(block_table).__name__}")
        if block_table.dtype != torch.int32:
            raise TypeError(f"block_table must be int32, got {block_table.dtype}")
        if block_table.dim() != 2 or block_table.shape[0] != batch:
            raise ValueError(
                f"block_table must be (batch={batch}, max_blocks_per_seq), got {tuple(block_table.shape)}"
            )
        if block_table.device != q.device:
            raise ValueError(f"block_table is on {block_table.device}, expected {q.device}")
        if block_table.stride(1) != 1 and block_table.shape[1] > 1:
            raise ValueError("block_table must be contiguous in its last dimension")
        if not _is_pow2_block_size(k_cache.shape[1]):
            raise ValueError(
                f"block_size (k_cache.shape[1]) must be a power of two from 8 to 256, got {k_cache.shape[1]}"
            )
    if seqlens.dtype != torch.int32:
        raise TypeError(f"{seqlens_name} must be int32, got {seqlens.dtype}")
    if tuple(seqlens.shape) != (batch,):
        raise ValueError(f"{seqlens_name} must have shape ({batch},), got {tuple(seqlens.shape)}")
    if batch > 1 and seqlens.stride(0) != 1:
        raise ValueError(f"{seqlens_name} must be contiguous")
    if alibi_slopes is not None:
        if not isinstance(alibi_slopes, Tensor) or alibi_slopes.dtype != torch.float32:
            raise TypeError("alibi_slopes must be a float32 tensor")
        if tuple(alibi_slopes.shape) not in ((nheads,), (batch, nheads)) or alibi_slopes.stride(-1) != 1:
            raise ValueError(
                f"alibi_slopes must be ({nheads},) or ({batch}, {nheads}) with a contiguous last dim, "
                f"got {tuple(alibi_slopes.shape)} with strides {alibi_slopes.stride()}"
            )
        if alibi_slopes.device != q.device:
            raise ValueError(f"alibi_slopes is on {alibi_slopes.device}, expected {q.device}")
    if (k_scale is not None or v_scale is not None) and not is_fp8_dtype(k_cache.dtype):
        raise ValueError("k_scale/v_scale apply to fp8 caches only")
    validate_scale("k_scale", k_scale, nheads_k, q.device)
    validate_scale("v_scale", v_scale, nheads_k, q.device)


def check_paged_values(
    block_table: Tensor | None,
    seqlens: Tensor,
    num_blocks: int,
    block_size: int,
    *,
    seqlens_name: str = "cache_seqlens",
    min_seqlens: Tensor | None = None,
) -> None:
    """Value checks that need a device sync (the validating entry points only, never ``run``).

    Checks ``0 <= seqlens``, ``seqlens <= max_blocks_per_seq * block_size`` (paged) or
    ``<= seqlen_cache`` (contiguous, pass ``block_table=None`` and ``block_size=seqlen_cache``),
    ``seqlens >= min_seqlens`` (each sequence's own query count), and that the block-table entries
    covering each sequence's tokens are valid block ids ``[0, num_blocks)``.

    The statistics are read back one by one (three syncs with a block table). Stacking them into one
    device tensor read back once (0c27be0) did not make ``flash_attn_with_kvcache`` cheaper: H100 host,
    2026-12-06, 1000 back-to-back eager calls in three rounds, ctx 256 / 4096: 454-485 / 566-575 us
    per call with three reads, 504-513 / 515-629 us with one: the first sync drains the launch queue
    and costs nearly all of it; the stack adds launches.
    """
    if seqlens.numel() == 0:
        return
    lens = seqlens.long()
    lo, hi = int(lens.min()), int(lens.max())
    if lo < 0:
        raise ValueError(f"{seqlens_name} must be non-negative, got min {lo}")
    cap = block_table.shape[1] * block_size if block_table is not None else block_size
    if hi > cap:
        what = (
            f"the block table covers ({block_table.shape[1]} blocks x {block_size})"
            if block_table is not None
            else "the cache holds (seqlen_cache)"
        )
        raise ValueError(f"{seqlens_name} max {hi} is longer than {what} = {cap} tokens")
    if min_seqlens is not None and bool((lens < min_seqlens.long()).any()):
        raise ValueError(f"{seqlens_name} must be at least each sequence's number of new queries")
    if block_table is not None and block_table.shape[1]:
        used = torch.arange(block_table.shape[1], device=lens.device).view(1, -1) < (
            (lens + block_size - 1) // block_size
        ).view(-1, 1)
        bad = used & ((block_table < 0) | (block_table >= num_blocks))
        if bool(bad.any()):
            b, j = (int(x) for x in bad.nonzero()[0])
            raise ValueError(
                f"block_table[{b}, {j}] = {int(block_table[b, j])} points outside the cache (num_blocks={num_blocks})"
            )


def resolve_num_splits(
    num_splits: int,
    work_items: int,
    head_programs: int,
    seqlen_k: int,
    tile_tokens: int,
    device: torch.device,
    one_wave_of: int = 0,
) -> int:
    """``num_splits`` if positive, else the planner's choice; never more than the tiles of ``seqlen_k``.

    Args:
        work_items: independent (sequence, query tile) problems per KV head group.
        head_programs: programs per problem and split (:attr:`PagedTiles.head_programs`).
        seqlen_k: host-side bound on the keys per sequence (no device sync).
        tile_tokens: KV tokens per tile (:attr:`PagedTiles.tile_tokens`).
        one_wave_of: programs per SM the planner fills exactly one wave of (``0``: at least two
            programs per SM); see :func:`~flashpage.roofline.planner.choose_num_splits`.
    """
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or not 0 <= num_splits <= _MAX_SPLITS:
        raise ValueError(f"num_splits must be an int in [0, {_MAX_SPLITS}] (0 = planner), got {num_splits!r}")
    if num_splits == 0:
        # The roofline planner: >= 2 programs per SM (or one wave of one_wave_of), >= 256 keys per split.
        num_splits = choose_num_splits(
            max(work_items, 1), head_programs, max(seqlen_k, 1), default_num_sms(device),
            one_wave_of=one_wave_of,
        )  # fmt: skip
    return max(1, min(num_splits, cdiv(max(seqlen_k, 1), tile_tokens)))


def with_heads(config: PagedAttnConfig, heads: int) -> PagedAttnConfig:
    """``config`` (``heads_per_program=0``, auto) with its heads per program decided: ``heads``, and
    for ``heads > 1`` ``config.wide_block_n`` tile columns where set."""
    wide = heads > 1 and config.wide_block_n
    return replace(config, heads_per_program=heads, block_n=config.wide_block_n if wide else config.block_n)


def resolve_launch(
    config: PagedAttnConfig,
    num_splits: int,
    batch: int,
    max_seqlen_q: int,
    nheads: int,
    nheads_k: int,
    kv_dtype: torch.dtype,
    seqlen_k: int,
    device: torch.device,
) -> tuple[PagedAttnConfig, PagedTiles, int]:
    """The config with its heads per program decided, its tiles, and the split count.

    ``config.heads_per_program == 0`` (auto) becomes the planner's
    :func:`~flashpage.roofline.planner.choose_heads_per_program` up to what fills 16 query rows
    (:func:`kv_heads_per_program`), or that maximum when ``num_splits`` is given; several heads
    take ``config.wide_block_n`` columns per tile where set, and then the planner's split count fills
    one wave of two programs per SM. The returned config is what to launch with
    (``launch_paged_attention`` recomputes the same tiles from it).

    Args:
        seqlen_k: host-side bound on the keys per sequence (no device sync).

    A pure function of its arguments, remembered per argument tuple: a decode loop calls it per
    layer and step, and the planner's answer costs ~30 us of Python on a slow host.
    """

    def plan() -> tuple[PagedAttnConfig, PagedTiles, int]:
        cfg = config
        one_wave_of = 0
        if cfg.heads_per_program == 0:
            most = kv_heads_per_program(cfg, max_seqlen_q, nheads // nheads_k, nheads_k, kv_dtype)
            heads = most
            if num_splits == 0 and most > 1:
                widest = paged_tiles(
                    replace(cfg, heads_per_program=most), max_seqlen_q, nheads, nheads_k, kv_dtype
                )
                heads = choose_heads_per_program(
                    max(batch * widest.q_tiles, 1), nheads_k, most, max(seqlen_k, 1), default_num_sms(device)
                )
            one_wave_of = 2 if heads > 1 and cfg.wide_block_n else 0
            cfg = with_heads(cfg, heads)
        tiles = paged_tiles(cfg, max_seqlen_q, nheads, nheads_k, kv_dtype)
        splits = resolve_num_splits(
            num_splits, batch * tiles.q_tiles, tiles.head_programs, seqlen_k, tiles.tile_tokens, device,
            one_wave_of=one_wave_of,
        )  # fmt: skip
        return cfg, tiles, splits

    key = (config, num_splits, batch, max_seqlen_q, nheads, nheads_k, kv_dtype, seqlen_k, device)
    return _RESOLVED_LAUNCHES.get(key, plan)  # type: ignore[no-any-return]


def paged_decode(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_table: Tensor,
    cache_seqlens: Tensor,
    *,
    softmax_scale: float | None = None,
    causal: bool = True,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
    num_splits: int = 0,
    config: PagedAttnConfig | None = None,
    max_seqlen_k: int | None = None,
    return_lse: bool = False,
    validate: bool = True,
) -> Tensor | tuple[Tensor, Tensor]:
    """Split-KV decode attention over a paged KV cache.

    Args:
        q: ``(batch, nheads, d)`` (one new token per sequence) or ``(batch, seqlen_q, nheads, d)``
            (the last ``seqlen_q`` positions of each sequence, e.g. speculative tokens).
        k_cache, v_cache: ``(num_blocks, block_size, nheads_k, d)``, q's dtype or fp8 e4m3.
        block_table: ``(batch, max_blocks_per_seq)`` int32.
        cache_seqlens: ``(batch,)`` int32 keys per sequence (already including the new tokens).
        causal: bottom-right causal mask (only matters for ``seqlen_q > 1``).
        k_scale, v_scale: ``(nheads_k,)`` float32 fp8 scales (default 1). fp8 error: each cached
            value is off by at most 2**-4 of itself (e4m3 rounding, see ``cache_write``), so the output
            is within about ``2**-4 * max|v|`` of the unquantised result (v's rounding averages; k's
            shifts the softmax weights by ``exp(+-2**-4 * scale * |q||k|)`` at worst).
        num_splits: split-KV count, ``0`` = the roofline planner's choice.
        max_seqlen_k: host bound on ``cache_seqlens`` for the planner (default: the table's capacity).
        validate: host-side value checks of the block table and lengths (one device sync).
    Returns:
        ``out`` shaped like ``q``; with ``return_lse`` also ``lse`` float32, natural log,
        ``(batch, nheads)`` or ``(batch, nheads, seqlen_q)``.
    """
    if not isinstance(q, Tensor) or q.dim() not in (3, 4):
        raise ValueError(
            f"q must be (batch, nheads, d) or (batch, seqlen_q, nheads, d), got {getattr(q, 'shape', q)}"
        )
    q4 = q.unsqueeze(1) if q.dim() == 3 else q
    batch, seqlen_q, nheads, d = q4.shape
    check_paged_cache(
        q4, k_cache, v_cache, block_table, cache_seqlens, batch=batch,
        alibi_slopes=alibi_slopes, k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip
    if block_table is None:
        raise ValueError("block_table is required (paged cache)")
    if validate:
        check_paged_values(block_table, cache_seqlens, k_cache.shape[0], k_cache.shape[1])
    seqlen_bound = max_seqlen_k if max_seqlen_k is not None else block_table.shape[1] * k_cache.shape[1]
    config, _, splits = resolve_launch(
        config or default_decode_config(k_cache.dtype, d), num_splits, batch, seqlen_q, nheads,
        k_cache.shape[2], k_cache.dtype, seqlen_bound, q.device,
    )  # fmt: skip
    qp = q4.reshape(batch * seqlen_q, nheads, d)
    out = torch.empty_like(qp)
    lse = torch.empty(batch, seqlen_q, nheads, dtype=torch.float32, device=q.device) if return_lse else None
    EAGER_LAUNCHES.launch(
        qp, k_cache, v_cache, out, cache_seqlens, max_seqlen_q=seqlen_q, block_table=block_table,
        lse=lse.view(batch * seqlen_q, nheads).t() if lse is not None else None,
        softmax_scale=softmax_scale if softmax_scale is not None else d**-0.5, causal=causal,
        window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes, k_scale=k_scale,
        v_scale=v_scale, num_splits=splits, config=config,
    )  # fmt: skip
    out = out.view(q.shape)
    if not return_lse:
        return out
    assert lse is not None
    lse_bhq = lse.permute(0, 2, 1)
    return out, (lse_bhq[..., 0] if q.dim() == 3 else lse_bhq)
