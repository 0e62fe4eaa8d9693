"""Paged (chunked) prefill: packed varlen queries attending to a cached paged prefix plus themselves.

Sequence ``b`` has ``q_len[b] = cu_seqlens_q[b+1] - cu_seqlens_q[b]`` new queries and ``seqlens_k[b]``
keys in the cache (its prefix plus the new tokens, already written by
:func:`~flashpage.ops.cache_write.reshape_and_cache`); its queries are the last ``q_len[b]`` positions,
so with ``causal=True`` query ``i`` sees keys ``0 .. seqlens_k[b] - q_len[b] + i`` (bottom-right
alignment). This is what prefix caching (a cached prefix plus a new suffix) and chunked prefill (a
long prompt fed in chunks) need.

The kernel is the paged attention kernel of :mod:`flashpage.ops.paged_kernel` launched with prefill
tiles: ``BLOCK_M`` = 128 rows (``128 // group`` query tokens x the GQA group, so K/V are read once
per group), ``BLOCK_N`` = 64 keys. KV tiles wholly above the causal diagonal or left of the window
are never visited; tiles wholly inside run without masks; the tiles crossing the diagonal, the
window edge or the sequence end are masked. Programs start with the last (heaviest) query tiles.
"""

from __future__ import annotations

import torch
from torch import Tensor

from flashpage.ops.paged_launch import (
    PagedAttnConfig,
    PagedProblem,
    check_paged_cache,
    check_paged_values,
    default_decode_config,
    eager_launcher,
)
from flashpage.ops.paged_plan import choose_launch
from flashpage.ops.utils import default_num_sms, gpu_family, triton_version

__all__ = [
    "DECODE_ROWS",
    "check_cu_seqlens",
    "default_prefill_config",
    "kv_attention_config",
    "paged_prefill",
]


def default_prefill_config(
    head_dim: int,
    device: torch.device | None = None,
    kv_dtype: torch.dtype | None = None,
    block_size: int | None = None,
    tma: bool | None = None,
) -> PagedAttnConfig:
    """Prefill tiles. The Hopper tiles give every warp >= 16 query rows (fewer make Triton repeat
    the score MMAs once per warpgroup, see flash_configs).

    Args:
        head_dim: ``d``; device, kv_dtype: the cache's (defaults without them: Ampere's tiles).
        block_size: the cache's page size (tokens per page).
        tma: Hopper, 16-bit caches: load tiles that lie inside one page (pages of >= ``block_n``
            tokens) through TMA descriptors; ``None``: where the installed triton gains from it
            (>= 3.9, below). Smaller pages always take pointer loads.

    Hopper, 16-bit caches: 128 x 128 tiles, 8 warps (d <= 128; 3 stages with the table prefetch for
    pages smaller than a tile, TMA for pages that hold whole tiles under triton >= 3.9, where
    pointer-loaded tiles carry extra fences); 128 x 64, 3 stages above d=128. Elsewhere: 128 x 64
    (64 x 64 above d=128), 8 warps. Why: the fastest measured on H100/H200 (docs/perf-notes.md).
    """
    hopper = device is not None and gpu_family(device) == "hopper"
    page = block_size or 0
    if hopper and kv_dtype in (torch.float16, torch.bfloat16):
        if tma is None:
            tma = triton_version() >= (3, 9)
        if head_dim > 128:
            return PagedAttnConfig(
                block_m=128, block_n=64, num_warps=8, num_stages=3, use_tma=tma and page >= 64
            )
        if tma and page >= 128:
            return PagedAttnConfig(block_m=128, block_n=128, num_warps=8, num_stages=2, use_tma=True)
        return PagedAttnConfig(block_m=128, block_n=128, num_warps=8, num_stages=3, prefetch_table=True)
    if head_dim > 128:
        return PagedAttnConfig(block_m=64, block_n=64, num_warps=8, num_stages=2)
    return PagedAttnConfig(block_m=128, block_n=64, num_warps=8, num_stages=2)


# Up to this many (query token x GQA head) rows per sequence the decode tiles serve a KV-cache call.
DECODE_ROWS = 64


def kv_attention_config(q: Tensor, k_cache: Tensor, max_seqlen_q: int, paged: bool = True) -> PagedAttnConfig:
    """The tiles for ``q (..., nheads, d)`` over ``k_cache`` (paged ``(num_blocks, block_size, ...)``
    or contiguous) when no sequence has more than ``max_seqlen_q`` queries: the decode tiles (sized
    to the rows) up to :data:`DECODE_ROWS` rows per sequence, else :func:`default_prefill_config`."""
    nheads, d = q.shape[-2], q.shape[-1]
    if max_seqlen_q * (nheads // k_cache.shape[2]) <= DECODE_ROWS:
        return default_decode_config(k_cache.dtype, d, paged=paged)
    return default_prefill_config(d, q.device, k_cache.dtype, k_cache.shape[1] if paged else None)


def check_cu_seqlens(
    cu_seqlens_q: Tensor, batch: int, total_q: int, device: torch.device, name: str = "cu_seqlens_q"
) -> None:
    """``cu_seqlens_q`` (called ``name`` in errors) must be a contiguous int32 ``(batch + 1,)`` tensor
    on ``device`` (metadata only)."""
    if not isinstance(cu_seqlens_q, Tensor):
        raise TypeError(f"{name} must be an int32 tensor, got {type(cu_seqlens_q).__name__}")
    if cu_seqlens_q.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {cu_seqlens_q.dtype}")
    if tuple(cu_seqlens_q.shape) != (batch + 1,) or cu_seqlens_q.stride(0) != 1:
        raise ValueError(
            f"{name} must be a contiguous ({batch + 1},) tensor, got {tuple(cu_seqlens_q.shape)}"
        )
    if cu_seqlens_q.device != device:
        raise ValueError(f"{name} is on {cu_seqlens_q.device}, expected {device}")


def _check_cu_values(cu_seqlens_q: Tensor, total_q: int, max_seqlen_q: int) -> Tensor:
    """Host checks of the prefix sums (one sync); returns the per-sequence query counts."""
    cu = cu_seqlens_q.long()
    qlen = cu[1:] - cu[:-1]
    if int(cu[0]) != 0 or int(cu[-1]) != total_q:
        raise ValueError(
            f"cu_seqlens_q must start at 0 and end at total_q={total_q}, got {int(cu[0])}..{int(cu[-1])}"
        )
    if qlen.numel() and int(qlen.min()) < 0:
        raise ValueError("cu_seqlens_q must be non-decreasing")
    if qlen.numel() and int(qlen.max()) > max_seqlen_q:
        raise ValueError(f"max_seqlen_q={max_seqlen_q} is less than the longest query run {int(qlen.max())}")
    return qlen


def paged_prefill(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    cu_seqlens_q: Tensor,
    seqlens_k: Tensor,
    block_table: Tensor,
    max_seqlen_q: int,
    *,
    softmax_scale: float | None = None,
    causal: bool = True,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
    num_splits: int = 1,
    max_seqlen_k: int | None = None,
    config: PagedAttnConfig | None = None,
    return_lse: bool = False,
    validate: bool = True,
) -> Tensor | tuple[Tensor, Tensor]:
    """Attention of packed new queries over a paged cache that already holds their K/V.

    Args:
        q: ``(total_q, nheads, d)`` packed queries of ``batch`` sequences.
        k_cache, v_cache: ``(num_blocks, block_size, nheads_k, d)``, q's dtype or fp8 e4m3.
        cu_seqlens_q: ``(batch + 1,)`` int32 prefix sums of the query counts.
        seqlens_k: ``(batch,)`` int32 keys per sequence (prefix + new), ``>= q_len``.
        block_table: ``(batch, max_blocks_per_seq)`` int32.
        max_seqlen_q: largest query count (host int: sizes the grid, no device sync).
        num_splits: split-KV count (1 = none, 0 = the planner's choice; helps few long-prefix chunks).
        max_seqlen_k: host bound on ``seqlens_k`` for the planner (default: the table's capacity).
        k_scale, v_scale: ``(nheads_k,)`` float32 fp8 scales.
        validate: host-side checks of the table, lengths and prefix sums (device syncs).
    Returns:
        ``out (total_q, nheads, d)`` in q's dtype; with ``return_lse`` also ``lse (nheads, total_q)``
        float32, natural log (flash-attn's varlen layout).
    """
    if not isinstance(q, Tensor) or q.dim() != 3:
        raise ValueError(f"q must be packed (total_q, nheads, d), got {getattr(q, 'shape', q)}")
    if isinstance(max_seqlen_q, bool) or not isinstance(max_seqlen_q, int) or max_seqlen_q < 0:
        raise ValueError(f"max_seqlen_q must be a non-negative int, got {max_seqlen_q!r}")
    total_q, nheads, d = q.shape
    batch = seqlens_k.shape[0] if isinstance(seqlens_k, Tensor) and seqlens_k.dim() == 1 else -1
    check_paged_cache(
        q, k_cache, v_cache, block_table, seqlens_k, batch=batch, seqlens_name="seqlens_k",
        alibi_slopes=alibi_slopes, k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip
    if block_table is None:
        raise ValueError("block_table is required (paged cache)")
    check_cu_seqlens(cu_seqlens_q, batch, total_q, q.device)
    if validate:
        qlen = _check_cu_values(cu_seqlens_q, total_q, max_seqlen_q)
        check_paged_values(
            block_table,
            seqlens_k,
            k_cache.shape[0],
            k_cache.shape[1],
            seqlens_name="seqlens_k",
            min_seqlens=qlen,
        )
    config = config or default_prefill_config(d, q.device, k_cache.dtype, k_cache.shape[1])
    seqlen_bound = max_seqlen_k if max_seqlen_k is not None else block_table.shape[1] * k_cache.shape[1]
    choice = choose_launch(
        config,
        num_splits,
        batch,
        max_seqlen_q,
        nheads,
        k_cache.shape[2],
        k_cache.dtype,
        seqlen_bound,
        default_num_sms(q.device),
    )
    out = torch.empty_like(q)
    lse = torch.empty(nheads, total_q, dtype=torch.float32, device=q.device) if return_lse else None
    if total_q and batch:
        problem = PagedProblem(
            q, k_cache, v_cache, out, seqlens_k, max_seqlen_q, softmax_scale if softmax_scale is not None else d**-0.5,
            block_table=block_table, cu_seqlens_q=cu_seqlens_q, lse=lse, causal=causal, window_size=window_size,
            softcap=softcap, alibi_slopes=alibi_slopes, k_scale=k_scale, v_scale=v_scale,
        )  # fmt: skip
        eager_launcher().launch(problem, choice.config, choice.num_splits)
    return (out, lse) if lse is not None else out
