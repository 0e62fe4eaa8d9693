"""Plan / run split for paged decode (as in FlashInfer).

:func:`plan_decode` runs on the host once per batch (per engine step, shared by every layer): it
fixes the split-KV count (the roofline planner's choice unless overridden), the tile configuration,
the grid, and allocates the split workspace. :func:`run_decode` then only launches kernels: it reads
no device values (no ``.item()``, no host-side checks of tensor contents), so a step that calls it
can be captured in a CUDA graph and replayed with new block tables and lengths in the same buffers.
Its first call per tensor layout binds the launch (:class:`~flashpage.ops.paged_decode.PagedLaunch`);
later calls with tensors laid out alike (the other layers, the next steps) only fill in the tensors
and launch, which keeps eager decode's host time per call below the kernels' time on short launches.

Typical use::

    plan = plan_decode(batch, nheads, nheads_k, d, block_size=16, max_seqlen_k=4096,
                       q_dtype=torch.bfloat16, device=q.device)
    for layer in layers:
        out = run_decode(plan, q, k_cache[layer], v_cache[layer], block_table, cache_seqlens)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from flashpage.ops.cache_write import is_fp8_dtype
from flashpage.ops.paged_decode import (
    PagedAttnConfig,
    PagedLaunches,
    allocate_workspace,
    default_decode_config,
    paged_grid,
    resolve_launch,
)

__all__ = ["DecodePlan", "plan_decode", "run_decode"]


# Bound launches one plan keeps: an engine step sees one tensor layout per plan (every layer's
# cache shaped alike); a few more cover callers that alternate buffers.
_MAX_BOUND = 16


@dataclass(frozen=True)
class DecodePlan:
    """Everything a decode launch needs that does not change between layers of one step.

    Attributes:
        batch, nheads, nheads_k, head_dim, seqlen_q: problem shape (``seqlen_q`` queries per sequence).
        block_size: page size of the caches the plan runs on.
        q_dtype, kv_dtype: query and cache dtypes (``kv_dtype`` may be fp8 e4m3).
        num_splits: split-KV count; ``> 1`` uses ``workspace`` and the combine kernel.
        config: kernel tile configuration, its ``heads_per_program`` decided (never ``0``).
        block_m: query rows per program (tokens x GQA group x KV heads per program).
        grid: :func:`~flashpage.ops.paged_decode.paged_grid`, e.g. ``(nheads_k // heads, q_tiles *
            num_splits, batch)`` for the decode default.
        softmax_scale, causal, window_size, softcap: attention options baked into the plan.
        workspace: split partial outputs, log2-sum-exps and the fused combine's arrival counters
            (``None`` when ``num_splits == 1``).
        launches: :func:`run_decode`'s bound launches (bound to ``workspace``) by the layout of
            its tensors (filled by ``run_decode``; at most ``_MAX_BOUND`` kept).
    """

    batch: int
    nheads: int
    nheads_k: int
    head_dim: int
    seqlen_q: int
    block_size: int
    q_dtype: torch.dtype
    kv_dtype: torch.dtype
    num_splits: int
    config: PagedAttnConfig
    block_m: int
    grid: tuple[int, int, int]
    softmax_scale: float
    causal: bool
    window_size: tuple[int, int]
    softcap: float
    workspace: tuple[Tensor, Tensor, Tensor] | None
    # Not an __init__ argument: dataclasses.replace() must not hand a plan another plan's launches.
    launches: PagedLaunches = field(
        default_factory=lambda: PagedLaunches(_MAX_BOUND), init=False, compare=False, repr=False
    )


def plan_decode(
    batch: int,
    nheads: int,
    nheads_k: int,
    head_dim: int,
    *,
    block_size: int,
    max_seqlen_k: int,
    q_dtype: torch.dtype,
    device: torch.device | str,
    kv_dtype: torch.dtype | None = None,
    seqlen_q: int = 1,
    num_splits: int = 0,
    config: PagedAttnConfig | None = None,
    softmax_scale: float | None = None,
    causal: bool = True,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
) -> DecodePlan:
    """Plan a paged decode batch on the host (once per step).

    Args:
        max_seqlen_k: host bound on the keys per sequence (sizes the split count; for CUDA-graph
            capture use the largest length the graph will see).
        num_splits: ``0`` = the roofline planner's choice for this batch, context and SM count.
        config: tile configuration (default :func:`~flashpage.ops.paged_decode.default_decode_config`).
    """
    for name, val in (
        ("batch", batch),
        ("nheads", nheads),
        ("nheads_k", nheads_k),
        ("head_dim", head_dim),
        ("seqlen_q", seqlen_q),
    ):
        if isinstance(val, bool) or not isinstance(val, int) or val < 1:
            raise ValueError(f"{name} must be a positive int, got {val!r}")
    if nheads % nheads_k:
        raise ValueError(f"nheads ({nheads}) must be a multiple of nheads_k ({nheads_k})")
    if not (8 <= block_size <= 256 and block_size & (block_size - 1) == 0):
        raise ValueError(f"block_size must be a power of two from 8 to 256, got {block_size!r}")
    if isinstance(max_seqlen_k, bool) or not isinstance(max_seqlen_k, int) or max_seqlen_k < 0:
        raise ValueError(f"max_seqlen_k must be a non-negative int, got {max_seqlen_k!r}")
    device = torch.device(device)
    kv_dtype = kv_dtype or q_dtype
    if kv_dtype != q_dtype and not is_fp8_dtype(kv_dtype):
        raise TypeError(f"kv_dtype {kv_dtype} must be q_dtype {q_dtype} or torch.float8_e4m3fn")
    config = config or default_decode_config(kv_dtype, head_dim)
    config, tiles, splits = resolve_launch(
        config, num_splits, batch, seqlen_q, nheads, nheads_k, kv_dtype, max_seqlen_k, device
    )
    workspace = (
        allocate_workspace(
            batch * seqlen_q, nheads, splits, head_dim, device, batch * tiles.head_programs * tiles.q_tiles
        )
        if splits > 1
        else None
    )
    return DecodePlan(
        batch=batch,
        nheads=nheads,
        nheads_k=nheads_k,
        head_dim=head_dim,
        seqlen_q=seqlen_q,
        block_size=block_size,
        q_dtype=q_dtype,
        kv_dtype=kv_dtype,
        num_splits=splits,
        config=config,
        block_m=tiles.block_m,
        grid=paged_grid(config, tiles.q_tiles, splits, tiles.head_programs, batch),
        softmax_scale=softmax_scale if softmax_scale is not None else head_dim**-0.5,
        causal=causal,
        window_size=window_size,
        softcap=softcap,
        workspace=workspace,
    )


def run_decode(
    plan: DecodePlan,
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_table: Tensor,
    cache_seqlens: Tensor,
    *,
    alibi_slopes: Tensor | None = None,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
    out: Tensor | None = None,
    lse: Tensor | None = None,
) -> Tensor:
    """Launch a planned decode: no device syncs, only shape metadata is compared with the plan.

    Args:
        q: ``(batch, nheads, d)`` or ``(batch, seqlen_q, nheads, d)`` (``batch * seqlen_q`` packed
            rows, contiguous per row).
        k_cache, v_cache: ``(num_blocks, block_size, nheads_k, d)``.
        block_table: ``(batch, max_blocks_per_seq)`` int32; cache_seqlens: ``(batch,)`` int32.
        out: optional output buffer shaped like ``q`` (a static buffer for graph capture).
        lse: optional float32 ``(batch * seqlen_q, nheads)`` buffer for the natural-log LSE.
    Returns:
        ``out`` shaped like ``q``.
    """
    rows = plan.batch * plan.seqlen_q
    if q.numel() != rows * plan.nheads * plan.head_dim or q.shape[-2:] != (plan.nheads, plan.head_dim):
        raise ValueError(
            f"q {tuple(q.shape)} does not match the plan ({plan.batch} x {plan.seqlen_q}, {plan.nheads}, {plan.head_dim})"
        )
    if (
        k_cache.dtype != plan.kv_dtype
        or k_cache.shape[1] != plan.block_size
        or k_cache.shape[2] != plan.nheads_k
    ):
        raise ValueError(
            f"k_cache {tuple(k_cache.shape)} {k_cache.dtype} does not match the plan "
            f"(block_size {plan.block_size}, nheads_k {plan.nheads_k}, {plan.kv_dtype})"
        )
    qp = q.reshape(rows, plan.nheads, plan.head_dim)
    if out is None:
        out = q.new_empty(q.shape)  # contiguous whatever q's strides (q may be a slice of a qkv tensor)
    elif out.shape != q.shape or out.dtype != q.dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {q.dtype} tensor of shape {tuple(q.shape)}")
    if lse is not None and (tuple(lse.shape) != (rows, plan.nheads) or lse.dtype != torch.float32):
        # A wrong shape would be written through its strides as if it were (rows, nheads).
        raise ValueError(
            f"lse must be a float32 ({rows}, {plan.nheads}) tensor (batch * seqlen_q, nheads), "
            f"got {tuple(lse.shape)} {lse.dtype}"
        )
    plan.launches.launch(
        qp, k_cache, v_cache, out.view(rows, plan.nheads, plan.head_dim), cache_seqlens,
        max_seqlen_q=plan.seqlen_q, block_table=block_table, lse=lse.t() if lse is not None else None,
        softmax_scale=plan.softmax_scale, causal=plan.causal, window_size=plan.window_size,
        softcap=plan.softcap, alibi_slopes=alibi_slopes, k_scale=k_scale, v_scale=v_scale,
        num_splits=plan.num_splits, config=plan.config, workspace=plan.workspace,
    )  # fmt: skip
    return out
