"""Paged decode entry point: validated split-KV attention of new query tokens over a paged cache.

The kernel lives in :mod:`flashpage.ops.paged_kernel`, its launcher in
:mod:`flashpage.ops.paged_launch`, the split / heads decision and the plan/run API in
:mod:`flashpage.ops.paged_plan`; this module keeps the names it has always exported.
"""

from __future__ import annotations

import torch
from torch import Tensor

from flashpage.ops.paged_launch import (
    PagedAttnConfig,
    PagedLaunch,
    PagedLauncher,
    PagedProblem,
    PagedTiles,
    allocate_workspace,
    check_paged_cache,
    check_paged_values,
    default_decode_config,
    eager_launcher,
    kv_heads_per_program,
    paged_grid,
    paged_kernel_constexprs,
    paged_tiles,
    wide_offsets,
    with_heads,
)
from flashpage.ops.paged_plan import LaunchChoice, choose_launch
from flashpage.ops.utils import default_num_sms

__all__ = [
    "LaunchChoice",
    "PagedAttnConfig",
    "PagedLaunch",
    "PagedLauncher",
    "PagedProblem",
    "PagedTiles",
    "allocate_workspace",
    "check_paged_cache",
    "check_paged_values",
    "choose_launch",
    "default_decode_config",
    "default_num_sms",
    "eager_launcher",
    "kv_heads_per_program",
    "paged_decode",
    "paged_grid",
    "paged_kernel_constexprs",
    "paged_tiles",
    "wide_offsets",
    "with_heads",
]


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
    choice = choose_launch(
        config or default_decode_config(k_cache.dtype, d), num_splits, batch, seqlen_q, nheads,
        k_cache.shape[2], k_cache.dtype, seqlen_bound, default_num_sms(q.device),
    )  # fmt: skip
    qp = q4.reshape(batch * seqlen_q, nheads, d)
    out = torch.empty_like(qp)
    lse = torch.empty(batch, seqlen_q, nheads, dtype=torch.float32, device=q.device) if return_lse else None
    problem = PagedProblem(
        qp, k_cache, v_cache, out, cache_seqlens, seqlen_q, softmax_scale if softmax_scale is not None else d**-0.5,
        block_table=block_table, lse=lse.view(batch * seqlen_q, nheads).t() if lse is not None else None,
        causal=causal, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
        k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip
    eager_launcher().launch(problem, choice.config, choice.num_splits)
    out = out.view(q.shape)
    if not return_lse:
        return out
    assert lse is not None
    lse_bhq = lse.permute(0, 2, 1)
    return out, (lse_bhq[..., 0] if q.dim() == 3 else lse_bhq)
