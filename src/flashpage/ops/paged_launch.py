"""Launching the paged attention kernel: its tile config, the validated problem, and the launcher.

:class:`PagedProblem` carries one call's tensors and attention options (checked once by the entry
point, :func:`check_paged_cache`); :class:`PagedLauncher` launches it with a
:class:`PagedAttnConfig` and a split count. The first launch of a tensor layout goes through
Triton and is bound (:class:`PagedLaunch`); later launches of the same layout only fill in the new
tensors (:meth:`PagedLaunch.relaunch`). Nothing here reads device values, so every launch can be
captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from flashpage.ops.backend import interpreter_enabled
from flashpage.ops.cache_write import is_fp8_dtype, validate_scale
from flashpage.ops.flash_fwd import make_row_descriptor, tma_row_view_ok
from flashpage.ops.launch_cache import BoundLaunch, LaunchCache
from flashpage.ops.paged_kernel import combine_kernel, paged_attn_kernel
from flashpage.ops.utils import cdiv, next_pow2, pdl_supported, tma_supported
from flashpage.roofline.planner import pow2_divisor_at_most

__all__ = [
    "PagedAttnConfig",
    "PagedLaunch",
    "PagedLauncher",
    "PagedProblem",
    "PagedTiles",
    "allocate_workspace",
    "check_paged_cache",
    "check_paged_values",
    "default_decode_config",
    "eager_launcher",
    "kv_heads_per_program",
    "kv_read_views",
    "paged_grid",
    "paged_kernel_constexprs",
    "paged_tiles",
    "v_pairs_apply",
    "wide_offsets",
    "with_heads",
]

# "Unbounded" window side: far beyond any context, small enough that pos +- it stays in int32.
_NO_WINDOW = 1 << 30
_COMPUTE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_GRID_YZ = 65535  # CUDA's limit on a grid's y and z dimensions
# Query rows up to which fp8 V is read as byte pairs (decode tiles).
PAIR_ROWS = 16
# Argument positions of paged_attn_kernel: its 17 tensors / descriptors, then the two float
# scalars, window bounds, split count, query length, LSE / block-table / workspace strides.
_TENSOR_SLOTS = tuple(range(17))
_PAGED_SLOTS = (*range(23), 33, 34, 35, 37, 38, 39, 40, 41)
_COMBINE_SLOTS = (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 13)
_COMBINE_TENSOR_SLOTS = (0, 1, 2, 3)


@dataclass(frozen=True)
class PagedAttnConfig:
    """Launch parameters of the paged attention kernel (the benchmark sweeps these).

    Attributes:
        block_m: query rows per program (tokens x GQA group heads), a power of two >= 16; ``0`` picks
            the smallest that holds ``max_seqlen_q * group`` rows (decode) up to 128.
        block_n: KV tile columns (tokens x heads per program), a power of two >= 16.
        num_warps: warps per program.
        num_stages: software-pipelining depth of the KV loads.
        early_v: issue each tile's V load together with its K load instead of after the softmax.
        maxnreg: register cap per thread (``0``: the compiler's choice).
        use_tma: read mask-free KV tiles through TMA descriptors when a tile lies inside one page
            (Hopper+, one head per program, contiguous 16-byte aligned caches).
        prefetch_table: with pages smaller than a tile, load the next tile's block ids one
            iteration ahead.
        narrow_offsets: 32-bit cache offsets where every element of both caches lies within 2**31
            elements of its base (checked per launch; 64-bit otherwise).
        heads_first: grid with the KV head group as the fastest axis.
        pdl: launch the split combine as a programmatic dependent launch where supported (CUDA
            sm_90+), a plain launch elsewhere.
        combine_block_d: head-dim columns per combine program (power of two; ``0``: all).
        combine_warps: warps per combine program.
        heads_per_program: KV heads per program (power of two; ``0``: the planner decides, see
            :func:`flashpage.ops.paged_plan.choose_launch`). Lowered to a power of two dividing
            ``nheads_k``; ``1`` with fp8 caches or TMA.
        wide_block_n: ``0``, or the tile columns that replace ``block_n`` when ``heads_per_program=0``
            resolves to several KV heads per program.
        v_pairs: fp8 caches: read V as int16 byte pairs and compute ``P V`` as two dots (even and
            odd columns); applied to decode tiles of a power-of-two head dim with pointer loads.
    """

    block_m: int = 0
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
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
    v_pairs: bool = False

    def __post_init__(self) -> None:
        for name in ("block_n", "num_warps", "combine_warps"):
            val = getattr(self, name)
            if not _is_pow2(val):
                raise ValueError(f"PagedAttnConfig.{name} must be a positive power of two, got {val!r}")
        if self.block_n < 16:
            raise ValueError(f"PagedAttnConfig.block_n must be >= 16 (tl.dot), got {self.block_n}")
        for name in ("block_m", "wide_block_n", "combine_block_d"):
            val = getattr(self, name)
            if not (val == 0 or (_is_pow2(val) and val >= 16)):
                raise ValueError(f"PagedAttnConfig.{name} must be 0 or a power of two >= 16, got {val!r}")
        hpp = self.heads_per_program
        if not (hpp == 0 or _is_pow2(hpp)):
            raise ValueError(f"PagedAttnConfig.heads_per_program must be 0 or a power of two, got {hpp!r}")
        if isinstance(self.num_stages, bool) or not isinstance(self.num_stages, int) or self.num_stages < 1:
            raise ValueError(f"PagedAttnConfig.num_stages must be a positive int, got {self.num_stages!r}")
        if not isinstance(self.maxnreg, int) or not (self.maxnreg == 0 or 32 <= self.maxnreg <= 255):
            raise ValueError(f"PagedAttnConfig.maxnreg must be 0 or in [32, 255], got {self.maxnreg!r}")

    def short(self) -> str:
        """Compact label for benchmark tables."""
        extra = "-ev" if self.early_v else ""
        extra += f"-r{self.maxnreg}" if self.maxnreg else ""
        extra += "-tma" if self.use_tma else ""
        extra += "-pt" if self.prefetch_table else ""
        extra += "" if self.narrow_offsets else "-i64"
        extra += "-hf" if self.heads_first else ""
        extra += "-pdl" if self.pdl else ""
        extra += f"-c{self.combine_block_d}" if self.combine_block_d else ""
        extra += f"-cw{self.combine_warps}" if self.combine_warps != 4 else ""
        extra += "" if self.heads_per_program == 1 else f"-h{self.heads_per_program or 'auto'}"
        # Once heads are decided (choose_launch) block_n already says which tiles run.
        extra += f"-wide{self.wide_block_n}" if self.wide_block_n and self.heads_per_program == 0 else ""
        extra += "-vp" if self.v_pairs else ""
        return f"n{self.block_n}w{self.num_warps}s{self.num_stages}{extra}"


def _is_pow2(val: Any) -> bool:
    return not isinstance(val, bool) and isinstance(val, int) and val >= 1 and not val & (val - 1)


def default_decode_config(kv_dtype: torch.dtype, head_dim: int, paged: bool = True) -> PagedAttnConfig:
    """Decode tiles for a ``kv_dtype`` cache of head dim ``head_dim`` (paged, or contiguous).

    - 16-bit KV, d <= 128: 64-column tiles, 4 warps, 2 stages; paged caches let the planner put
      several KV heads in a program (128-column tiles then, two programs per SM), contiguous caches
      keep one head and a 4-stage pipeline (no block-table indirection to hide).
    - fp8 KV, d <= 128: 128-token tiles of one head, early V load; for a power-of-two head dim V
      read as byte pairs under a 128-register cap (four programs per SM).
    - d > 128: 32-column tiles.
    - With split-KV: the heads-first grid and a programmatic-dependent combine of 32-column,
      one-warp programs.

    Why: the fastest configurations measured against cuDNN on H100/H200 (docs/perf-notes.md,
    "Paged attention kernel notes").
    """
    split_opts = {"heads_first": True, "pdl": True, "combine_block_d": 32, "combine_warps": 1}
    if is_fp8_dtype(kv_dtype) and head_dim <= 128:
        # The register cap pays only with the pairs, and the pairs need a power-of-two head dim.
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


@dataclass(frozen=True)
class PagedTiles:
    """How one launch of the paged attention kernel tiles its problem (:func:`paged_tiles`).

    Attributes:
        block_m: query rows per program; a row is a (query token, query head) pair.
        q_tiles: query tiles per sequence.
        heads: KV heads per program (each brings its ``group`` query heads).
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
    (one dequantisation scale per program) and TMA tiles (one head's rows per box)."""
    if is_fp8_dtype(kv_dtype) or config.use_tma:
        return 1
    want = config.heads_per_program or max(1, 16 // next_pow2(max(1, max_seqlen_q) * group))
    return pow2_divisor_at_most(nheads_k, min(want, config.block_n))


def with_heads(config: PagedAttnConfig, heads: int) -> PagedAttnConfig:
    """``config`` with its heads per program decided: ``heads``, and for ``heads > 1``
    ``config.wide_block_n`` tile columns where set."""
    wide = heads > 1 and config.wide_block_n
    return replace(config, heads_per_program=heads, block_n=config.wide_block_n if wide else config.block_n)


def paged_tiles(
    config: PagedAttnConfig, max_seqlen_q: int, nheads: int, nheads_k: int, kv_dtype: torch.dtype
) -> PagedTiles:
    """The launch geometry for ``max_seqlen_q`` queries per sequence.

    ``block_m`` is ``config.block_m`` or, for decode, the smallest power of two >= 16 that holds
    ``max_seqlen_q * group * heads`` rows (up to 128); always at least ``group * heads``.
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


def paged_grid(
    config: PagedAttnConfig, q_tiles: int, num_splits: int, head_programs: int, batch: int
) -> tuple[int, int, int]:
    """The kernel's grid: heads first when ``config.heads_first`` and the ``q_tiles * num_splits``
    programs per (sequence, head group) fit the grid's y dimension."""
    work = q_tiles * num_splits
    return (head_programs, work, batch) if _heads_first(config, work) else (work, head_programs, batch)


def _heads_first(config: PagedAttnConfig, work: int) -> bool:
    return config.heads_first and work <= _MAX_GRID_YZ


def allocate_workspace(
    total_q: int, nheads: int, num_splits: int, head_dim: int, device: torch.device
) -> tuple[Tensor, Tensor]:
    """Split-KV workspace: partial outputs ``(total_q, nheads, splits, d)`` and log2-sum-exps
    ``(total_q, nheads, splits)``, both float32, uninitialised (every split writes its own)."""
    mid_o = torch.empty(total_q, nheads, num_splits, head_dim, dtype=torch.float32, device=device)
    mid_lse = torch.empty(total_q, nheads, num_splits, dtype=torch.float32, device=device)
    return mid_o, mid_lse


@dataclass(slots=True)
class PagedProblem:
    """One paged attention call: its tensors and options, already validated by the entry point.

    Attributes:
        q: ``(total_q, nheads, d)`` packed queries; without ``cu_seqlens_q`` sequence ``b`` owns
            rows ``b * max_seqlen_q .. (b+1) * max_seqlen_q - 1`` (a padded decode batch).
        k_cache, v_cache: paged ``(num_blocks, block_size, nheads_k, d)`` with ``block_table``, or
            contiguous ``(batch_cache, seqlen_cache, nheads_k, d)`` without (``cache_batch_idx``
            then maps batch entries to cache rows). q's dtype or fp8 e4m3.
        out: ``(total_q, nheads, d)``, written.
        seqlens_k: ``(batch,)`` int32 keys per sequence (including the queries' own tokens).
        max_seqlen_q: host bound on the queries per sequence (sizes the grid).
        softmax_scale: the score scale.
        block_table: ``(batch, max_blocks_per_seq)`` int32, or ``None`` for a contiguous cache.
        cu_seqlens_q: optional ``(batch + 1,)`` int32 query prefix sums (varlen queries).
        cache_batch_idx: optional ``(batch,)`` int32 cache rows (contiguous caches).
        kv_start: optional ``(batch,)`` int32 first visible key (flash-attn's ``cache_leftpad``).
        lse: optional ``(nheads, total_q)``-indexed float32 output (any strides), natural log.
        causal, window_size, softcap: attention options (bottom-right aligned masks).
        alibi_slopes: ``(nheads,)`` or ``(batch, nheads)`` float32.
        k_scale, v_scale: ``(nheads_k,)`` float32 fp8 dequantisation scales (``None``: 1).
    """

    q: Tensor
    k_cache: Tensor
    v_cache: Tensor
    out: Tensor
    seqlens_k: Tensor
    max_seqlen_q: int
    softmax_scale: float
    block_table: Tensor | None = None
    cu_seqlens_q: Tensor | None = None
    cache_batch_idx: Tensor | None = None
    kv_start: Tensor | None = None
    lse: Tensor | None = None
    causal: bool = True
    window_size: tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    alibi_slopes: Tensor | None = None
    k_scale: Tensor | None = None
    v_scale: Tensor | None = None

    def tensors(self) -> tuple[Tensor | None, ...]:
        """Every tensor argument, in a fixed order (``None`` where absent)."""
        return (
            self.q, self.k_cache, self.v_cache, self.out, self.seqlens_k, self.block_table, self.cu_seqlens_q,
            self.cache_batch_idx, self.kv_start, self.lse, self.alibi_slopes, self.k_scale, self.v_scale,
        )  # fmt: skip

    def layout_key(self) -> tuple[Any, ...]:
        """Everything a launch derives from this problem except tensor contents and addresses:
        every option, and per tensor its shape, strides, dtype, device and low four address bits
        (Triton's 16-byte alignment specialisation, the byte-pair views' parity)."""
        return (
            self.max_seqlen_q, float(self.softmax_scale), bool(self.causal), tuple(self.window_size),
            float(self.softcap),
            *(None if t is None else (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() & 15) for t in self.tensors()),
        )  # fmt: skip


def _kernel_tensors(
    p: PagedProblem,
    k_read: Tensor,
    v_read: Tensor,
    desc_k: Any,
    desc_v: Any,
    workspace: tuple[Tensor, Tensor] | None,
    k_scale: Tensor | None,
    v_scale: Tensor | None,
) -> tuple[Any, ...]:
    """The kernel's 17 tensor / descriptor arguments in signature order (``_TENSOR_SLOTS``). Absent
    ones take a pointer the kernel never dereferences."""
    dummy = p.seqlens_k
    return (
        p.q, k_read, v_read, desc_k, desc_v, p.out, p.lse if p.lse is not None else p.out,
        *(workspace if workspace is not None else (p.out, p.out)),
        p.block_table if p.block_table is not None else dummy, p.seqlens_k,
        p.cu_seqlens_q if p.cu_seqlens_q is not None else dummy,
        p.cache_batch_idx if p.cache_batch_idx is not None else dummy,
        p.kv_start if p.kv_start is not None else dummy,
        p.alibi_slopes if p.alibi_slopes is not None else p.q,
        k_scale if k_scale is not None else p.q, v_scale if v_scale is not None else p.q,
    )  # fmt: skip


@dataclass(frozen=True)
class PagedLaunch:
    """A launch of the paged kernel (and its combine) with everything but its tensors bound.

    :meth:`relaunch` launches the same kernels with a new problem's tensors and computes nothing
    else. The caller guarantees the new problem has the bound one's :meth:`PagedProblem.layout_key`.

    Attributes:
        main, combine: the attention kernel's and the split combine's launches (``combine`` is
            ``None`` without a split).
        workspace: the split workspace bound (``None`` unsplit, or allocated per call).
        workspace_shape: ``(total_q, nheads, splits, d)`` of a split workspace allocated per call.
        pairs: whether V is read as int16 byte pairs (the cache is viewed so again).
        unit_scales: fp8 scales of ones standing in for a scale the bound call did not pass.
    """

    main: BoundLaunch
    combine: BoundLaunch | None
    workspace: tuple[Tensor, Tensor] | None
    workspace_shape: tuple[int, int, int, int] | None
    pairs: bool
    unit_scales: tuple[Tensor | None, Tensor | None]

    def relaunch(self, p: PagedProblem) -> None:
        """Launch on ``p``'s tensors (a fresh split workspace where none is bound)."""
        k_scale = p.k_scale if p.k_scale is not None else self.unit_scales[0]
        v_scale = p.v_scale if p.v_scale is not None else self.unit_scales[1]
        v_read = p.v_cache.view(torch.int16) if self.pairs else p.v_cache
        ws = self.workspace
        if ws is None and self.workspace_shape is not None:
            ws = allocate_workspace(*self.workspace_shape, p.q.device)
        tensors = _kernel_tensors(p, p.k_cache, v_read, p.k_cache, p.v_cache, ws, k_scale, v_scale)
        self.main.relaunch(tensors)
        if self.combine is not None:
            assert ws is not None  # a combine launch exists only for a split
            self.combine.relaunch((ws[0], ws[1], p.out, p.lse if p.lse is not None else p.out))


class PagedLauncher:
    """Launches paged attention problems, binding each tensor layout's first launch.

    :meth:`launch` is the eager path: a bounded memo (``max_items`` layouts, cleared when full) of
    :class:`PagedLaunch` es keyed on :meth:`PagedProblem.layout_key`, the config and the split
    count; a hit relaunches without computing tiles, launch keys or Triton's argument binding.
    Split workspaces are allocated per call, so one launcher may serve calls on several streams.
    :meth:`bind` always takes the full path and returns the bound launch (a decode plan keeps it).
    """

    def __init__(self, max_items: int = 64) -> None:
        self.max_items = max_items
        self._main = LaunchCache(paged_attn_kernel)
        self._combine = LaunchCache(combine_kernel)
        self._bound: dict[tuple[Any, ...], PagedLaunch] = {}

    def __len__(self) -> int:
        return len(self._bound)

    def clear(self) -> None:
        """Forget every bound launch."""
        self._bound.clear()

    def launch(self, p: PagedProblem, config: PagedAttnConfig, num_splits: int) -> None:
        """Launch ``p`` (eager; see the class doc)."""
        key = (config, num_splits, *p.layout_key())
        hit = self._bound.get(key)
        if hit is not None:
            hit.relaunch(p)
            return
        bound = self.bind(p, config, num_splits)
        if bound is None:  # TMA descriptors are built per call: nothing to keep
            return
        if len(self._bound) >= self.max_items:
            self._bound.clear()
        self._bound[key] = bound

    def bind(
        self,
        p: PagedProblem,
        config: PagedAttnConfig,
        num_splits: int,
        workspace: tuple[Tensor, Tensor] | None = None,
    ) -> PagedLaunch | None:
        """Launch ``p`` through Triton (no checks, no syncs) and return the launch bound, to
        ``workspace`` when given (``allocate_workspace(total_q, nheads, num_splits, d)``), else to a
        workspace allocated here. ``None`` where TMA descriptors (built from each call's caches) are
        in use."""
        q, k_cache, v_cache, out = p.q, p.k_cache, p.v_cache, p.out
        total_q, nheads, head_dim = q.shape
        batch = p.seqlens_k.shape[0]
        nheads_k = k_cache.shape[2]
        tiles = paged_tiles(config, p.max_seqlen_q, nheads, nheads_k, k_cache.dtype)
        paged = p.block_table is not None
        fp8 = is_fp8_dtype(k_cache.dtype)
        split = num_splits > 1
        # The interpreter keeps bf16 as raw uint16 (arithmetic on it is garbage): fp32 there.
        upcast = q.dtype == torch.bfloat16 and interpreter_enabled()
        k_scale, v_scale = p.k_scale, p.v_scale
        unit = (fp8 and k_scale is None, fp8 and v_scale is None)
        if unit[0]:
            k_scale = torch.ones(nheads_k, dtype=torch.float32, device=q.device)
        if unit[1]:
            v_scale = torch.ones(nheads_k, dtype=torch.float32, device=q.device)
        pdl = split and config.pdl and pdl_supported(q.device)
        ws = None
        if split:
            ws = workspace if workspace is not None else allocate_workspace(
                total_q, nheads, num_splits, head_dim, q.device
            )  # fmt: skip
        use_tma = (
            config.use_tma
            and tiles.heads == 1
            and paged
            and k_cache.shape[1] >= config.block_n
            and tma_supported(k_cache.device)
            and all(tma_row_view_ok(c, False, head_dim) for c in (k_cache, v_cache))
        )
        if use_tma:
            desc_k, desc_v = (
                make_row_descriptor(c, False, config.block_n, head_dim, checked=True)
                for c in (k_cache, v_cache)
            )
        else:
            desc_k, desc_v = k_cache, v_cache
        wide = wide_offsets(config, k_cache, v_cache, paged)
        v_read, v_pairs = kv_read_views(config, tiles, v_cache, head_dim, use_tma)
        heads_first = _heads_first(config, tiles.q_tiles * num_splits)
        grid = paged_grid(config, tiles.q_tiles, num_splits, tiles.head_programs, batch)
        tensors = _kernel_tensors(p, k_cache, v_read, desc_k, desc_v, ws, k_scale, v_scale)
        mid_strides = (*ws[0].stride()[:3], *ws[1].stride()[:2]) if ws is not None else (0, 0, 0, 0, 0)
        lse_strides = (p.lse.stride(0), p.lse.stride(1)) if p.lse is not None else (0, 0)
        left = p.window_size[0] if p.window_size[0] >= 0 else _NO_WINDOW
        right = 0 if p.causal else (p.window_size[1] if p.window_size[1] >= 0 else _NO_WINDOW)
        bt_stride = p.block_table.stride(0) if p.block_table is not None else 0
        ints = (left, right, num_splits, p.max_seqlen_q, *lse_strides, bt_stride, *mid_strides)
        scalars = (float(p.softmax_scale), float(p.softcap) if p.softcap > 0 else 1.0)
        alibi = p.alibi_slopes
        args = [
            *tensors, *scalars, left, right, num_splits, p.max_seqlen_q,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_read.stride(0), v_read.stride(1), v_read.stride(2), out.stride(0), out.stride(1),
            *lse_strides, bt_stride, alibi.stride(0) if alibi is not None and alibi.dim() == 2 else 0,
            *mid_strides,
        ]  # fmt: skip
        kwargs = paged_kernel_constexprs(
            config, tiles, group=nheads // nheads_k, head_dim=head_dim,
            page_size=k_cache.shape[1] if paged else 0, fp8=fp8, split=split,
            fp32_dot=q.dtype == torch.float32 or upcast, upcast=upcast, varlen_q=p.cu_seqlens_q is not None,
            batch_idx=p.cache_batch_idx is not None, kv_start=p.kv_start is not None, softcap=p.softcap > 0,
            alibi=alibi is not None, write_lse=p.lse is not None, use_tma=use_tma, wide=wide,
            heads_first=heads_first, pdl=pdl, v_pairs=v_pairs,
        )  # fmt: skip
        kwargs.update(num_warps=config.num_warps, num_stages=config.num_stages)
        if config.maxnreg and q.device.type == "cuda":
            kwargs["maxnreg"] = config.maxnreg
        values = (*tensors, *scalars, *ints)
        bind = None if use_tma else _TENSOR_SLOTS
        main = self._main.launch(None, grid, _PAGED_SLOTS, values, lambda: (args, kwargs), bind)
        combine = self._launch_combine(p, config, ws, num_splits, mid_strides, lse_strides, pdl, use_tma)
        if main is None:
            return None
        return PagedLaunch(
            main, combine, ws if workspace is not None else None,
            (total_q, nheads, num_splits, head_dim) if split and workspace is None else None,
            v_pairs, (k_scale if unit[0] else None, v_scale if unit[1] else None),
        )  # fmt: skip

    def _launch_combine(
        self,
        p: PagedProblem,
        config: PagedAttnConfig,
        ws: tuple[Tensor, Tensor] | None,
        num_splits: int,
        mid_strides: tuple[int, ...],
        lse_strides: tuple[int, int],
        pdl: bool,
        use_tma: bool,
    ) -> BoundLaunch | None:
        """Launch the split combine after the attention grid (nothing unsplit); bound unless TMA."""
        if ws is None:
            return None
        total_q, nheads, head_dim = p.q.shape
        out = p.out
        c_tensors = (ws[0], ws[1], out, p.lse if p.lse is not None else out)
        block_s = max(2, next_pow2(num_splits))
        block_dc = min(config.combine_block_d or next_pow2(head_dim), next_pow2(head_dim))
        args = [*c_tensors, num_splits, *mid_strides, out.stride(0), out.stride(1), *lse_strides]
        kwargs = {"HEAD_DIM": head_dim, "BLOCK_D": block_dc, "BLOCK_S": block_s, "WRITE_LSE": p.lse is not None,
                  "PDL": pdl, "num_warps": config.combine_warps, **({"launch_pdl": True} if pdl else {})}  # fmt: skip
        return self._combine.launch(
            None,
            (total_q, nheads, cdiv(head_dim, block_dc)),
            _COMBINE_SLOTS,
            (*c_tensors, num_splits, *mid_strides, *lse_strides),
            lambda: (args, kwargs),
            None if use_tma else _COMBINE_TENSOR_SLOTS,
        )


def eager_launcher() -> PagedLauncher:
    """The :class:`PagedLauncher` the eager entry points share (``paged_decode``, ``paged_prefill``,
    ``flash_attn_with_kvcache``; a decode plan binds through it but keeps its own launch). Kept on the
    kernel object, as :func:`~flashpage.ops.launch_cache.kernel_launches` keeps a kernel's cache."""
    launcher = getattr(paged_attn_kernel, "_flashpage_eager", None)
    if launcher is None:
        launcher = PagedLauncher()
        paged_attn_kernel._flashpage_eager = launcher
    return launcher


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
    use_tma: bool = False,
    wide: bool = False,
    heads_first: bool = False,
    pdl: bool = False,
    v_pairs: bool = False,
) -> dict[str, Any]:
    """The compile-time arguments of :func:`~flashpage.ops.paged_kernel.paged_attn_kernel` for one
    launch, by name. ``page_size`` is ``0`` for a contiguous cache; ``fp32_dot``: ``tl.dot`` in
    IEEE fp32 (fp32 queries, or bf16 upcast under the interpreter) instead of tf32/bf16;
    ``v_pairs``: :func:`v_pairs_apply`'s answer for the launch."""
    return {
        "G": group, "HPP": tiles.heads, "HEAD_DIM": head_dim, "BLOCK_D": max(16, next_pow2(head_dim)),
        "BLOCK_M": tiles.block_m, "BLOCK_N": config.block_n, "PAGE_SIZE": page_size, "VARLEN_Q": varlen_q,
        "HAS_BATCH_IDX": batch_idx, "HAS_KV_START": kv_start, "SOFTCAP": softcap, "HAS_ALIBI": alibi, "KV_FP8": fp8,
        "SPLIT": split, "WRITE_LSE": write_lse, "DOT_PRECISION": "ieee" if fp32_dot else "tf32", "UPCAST": upcast,
        "EARLY_V": config.early_v, "USE_TMA": use_tma, "PREFETCH_TABLE": config.prefetch_table,
        "WIDE_OFFSETS": wide, "HEADS_FIRST": heads_first, "PDL": pdl, "V_PAIRS": v_pairs,
        "PAIR_ASM": not interpreter_enabled(),
    }  # fmt: skip


def _pairs_head_dim(head_dim: int) -> bool:
    """Head dims the byte pairs serve: powers of two (>= 16), where a tile has no padded columns."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0


def v_pairs_apply(
    config: PagedAttnConfig, tiles: PagedTiles, v_cache: Tensor, head_dim: int, use_tma: bool
) -> bool:
    """Whether a launch reads V as int16 byte pairs (``config.v_pairs``): fp8 decode tiles (at most
    :data:`PAIR_ROWS` rows) of a power-of-two head dim, pointer loads, and a V cache that can be
    viewed as int16 (even element offset and strides)."""
    return (
        config.v_pairs
        and is_fp8_dtype(v_cache.dtype)
        and tiles.block_m <= PAIR_ROWS
        and _pairs_head_dim(head_dim)
        and not use_tma
        and v_cache.stride(-1) == 1
        and v_cache.storage_offset() % 2 == 0
        and all(st % 2 == 0 for st in v_cache.stride()[:-1])
    )


def kv_read_views(
    config: PagedAttnConfig, tiles: PagedTiles, v_cache: Tensor, head_dim: int, use_tma: bool
) -> tuple[Tensor, bool]:
    """The V cache as one launch's kernel reads it and whether as byte pairs: viewed as int16 (last
    dim and strides halved) where :func:`v_pairs_apply`."""
    v_pairs = v_pairs_apply(config, tiles, v_cache, head_dim, use_tma)
    return (v_cache.view(torch.int16) if v_pairs else v_cache), v_pairs


def _max_offset(t: Tensor) -> int:
    """Largest element offset of ``t`` from its data pointer (0 for an empty tensor)."""
    n = t.numel()
    if n == 0 or t.is_contiguous():  # the common cache: one cheap test per launch
        return max(n - 1, 0)
    return sum((size - 1) * st for size, st in zip(t.shape, t.stride()))


def wide_offsets(config: PagedAttnConfig, k_cache: Tensor, v_cache: Tensor, paged: bool) -> bool:
    """Whether the kernel computes KV-row offsets in 64-bit integers: always for a contiguous cache
    and without ``config.narrow_offsets``; otherwise only when an element of either paged cache
    lies 2**31 or more elements past its base (a 32-bit ``block_id * stride`` would wrap)."""
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
        _check_block_table(block_table, batch, q.device, k_cache.shape[1])
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


def _check_block_table(block_table: Any, batch: int, device: torch.device, block_size: int) -> None:
    if not isinstance(block_table, Tensor):
        raise TypeError(f"block_table must be an int32 tensor, got {type(block_table).__name__}")
    if block_table.dtype != torch.int32:
        raise TypeError(f"block_table must be int32, got {block_table.dtype}")
    if block_table.dim() != 2 or block_table.shape[0] != batch:
        raise ValueError(
            f"block_table must be (batch={batch}, max_blocks_per_seq), got {tuple(block_table.shape)}"
        )
    if block_table.device != device:
        raise ValueError(f"block_table is on {block_table.device}, expected {device}")
    if block_table.stride(1) != 1 and block_table.shape[1] > 1:
        raise ValueError("block_table must be contiguous in its last dimension")
    if not _is_pow2_block_size(block_size):
        raise ValueError(
            f"block_size (k_cache.shape[1]) must be a power of two from 8 to 256, got {block_size}"
        )


def check_paged_values(
    block_table: Tensor | None,
    seqlens: Tensor,
    num_blocks: int,
    block_size: int,
    *,
    seqlens_name: str = "cache_seqlens",
    min_seqlens: Tensor | None = None,
) -> None:
    """Value checks that need a device sync (the validating entry points only, never a plan's run).

    Checks ``0 <= seqlens``, ``seqlens <= max_blocks_per_seq * block_size`` (paged) or
    ``<= seqlen_cache`` (contiguous: pass ``block_table=None`` and ``block_size=seqlen_cache``),
    ``seqlens >= min_seqlens`` (each sequence's own query count), and that the block-table entries
    covering each sequence's tokens are valid block ids ``[0, num_blocks)``. The statistics are
    read back one by one: the first sync drains the launch queue and costs nearly all of it.
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
