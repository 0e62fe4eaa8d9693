"""Plan / run split for paged decode (as in FlashInfer), and the one launch decision.

:func:`choose_launch` is the only place that decides how a paged attention launch is cut: the
split-KV count and the KV heads per program (the roofline planner's rules). :func:`plan_decode`
runs it on the host once per batch (an engine step, shared by every layer), and allocates the split
workspace. :func:`run_decode` then only launches: it reads no device values, so a step that calls
it can be captured in a CUDA graph and replayed with new block tables and lengths in the same
buffers. A plan binds its launch on its first run; later runs with tensors laid out alike (the
other layers, the next steps) only fill in the tensors.

Typical use::

    plan = plan_decode(batch, nheads, nheads_k, d, block_size=16, max_seqlen_k=4096,
                       q_dtype=torch.bfloat16, device=q.device)
    for layer in layers:
        out = run_decode(plan, q, k_cache[layer], v_cache[layer], block_table, cache_seqlens)
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor

from flashpage.ops.cache_write import is_fp8_dtype
from flashpage.ops.paged_launch import (
    PagedAttnConfig,
    PagedLaunch,
    PagedLauncher,
    PagedProblem,
    PagedTiles,
    allocate_workspace,
    default_decode_config,
    eager_launcher,
    kv_heads_per_program,
    paged_grid,
    paged_tiles,
    with_heads,
)
from flashpage.ops.utils import cdiv, default_num_sms
from flashpage.roofline.planner import choose_heads_per_program, choose_num_splits

__all__ = ["MAX_SPLITS", "DecodePlan", "LaunchChoice", "choose_launch", "plan_decode", "run_decode"]

MAX_SPLITS = 128


@dataclass(frozen=True)
class LaunchChoice:
    """How to launch one paged attention problem.

    Attributes:
        config: the tile config with its heads per program decided (never ``0``).
        tiles: its launch geometry.
        num_splits: split-KV count (1 = no split).
    """

    config: PagedAttnConfig
    tiles: PagedTiles
    num_splits: int


@functools.lru_cache(maxsize=1024)
def choose_launch(
    config: PagedAttnConfig,
    num_splits: int,
    batch: int,
    max_seqlen_q: int,
    nheads: int,
    nheads_k: int,
    kv_dtype: torch.dtype,
    seqlen_k: int,
    num_sms: int,
) -> LaunchChoice:
    """The split count and heads per program of a launch: the one place both are decided.

    ``config.heads_per_program == 0`` (auto) becomes the planner's
    :func:`~flashpage.roofline.planner.choose_heads_per_program`, bounded by what fills 16 query
    rows (:func:`~flashpage.ops.paged_launch.kv_heads_per_program`); with a given ``num_splits``
    that bound itself. Several heads take ``config.wide_block_n`` tile columns where set, and then
    the planner's split count fills one wave of two programs per SM; otherwise at least two programs
    per SM. ``num_splits > 0`` is kept, never more than ``seqlen_k``'s tiles.

    Args:
        num_splits: ``0`` = the planner's choice, else ``1 .. MAX_SPLITS``.
        batch, max_seqlen_q, nheads, nheads_k, kv_dtype: the problem.
        seqlen_k: host-side bound on the keys per sequence (no device sync).
        num_sms: streaming multiprocessors of the device.
    Raises:
        ValueError: ``num_splits`` out of range.

    A pure function of hashable arguments, cached (a decode loop asks once per step or call).
    """
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or not 0 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be an int in [0, {MAX_SPLITS}] (0 = planner), got {num_splits!r}")
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
                max(batch * widest.q_tiles, 1), nheads_k, most, max(seqlen_k, 1), num_sms
            )
        one_wave_of = 2 if heads > 1 and cfg.wide_block_n else 0
        cfg = with_heads(cfg, heads)
    tiles = paged_tiles(cfg, max_seqlen_q, nheads, nheads_k, kv_dtype)
    splits = num_splits
    if splits == 0:
        # >= 2 programs per SM (or one wave of one_wave_of per SM), >= 256 keys per split.
        splits = choose_num_splits(
            max(batch * tiles.q_tiles, 1),
            tiles.head_programs,
            max(seqlen_k, 1),
            num_sms,
            one_wave_of=one_wave_of,
        )
    splits = max(1, min(splits, cdiv(max(seqlen_k, 1), tiles.tile_tokens)))
    return LaunchChoice(cfg, tiles, splits)


@dataclass
class _BoundSlot:
    """A plan's bound launch and the problem layout it was bound for."""

    key: tuple[Any, ...] | None = None
    launch: PagedLaunch | None = None


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
        grid: the kernel's grid, e.g. ``(nheads_k // heads, q_tiles * num_splits, batch)``.
        softmax_scale, causal, window_size, softcap: attention options (a run may override the
            scale, window and softcap).
        workspace: split partial outputs and log2-sum-exps (``None`` when ``num_splits == 1``).
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
    workspace: tuple[Tensor, Tensor] | None
    # Not an __init__ argument: dataclasses.replace() must not hand a plan another plan's launch.
    bound: _BoundSlot = field(default_factory=_BoundSlot, init=False, compare=False, repr=False)

    @property
    def heads_per_program(self) -> int:
        """KV heads each program owns."""
        return self.config.heads_per_program


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
    """Plan a paged decode batch on the host (once per step): :func:`choose_launch`, then the
    split workspace.

    Args:
        max_seqlen_k: host bound on the keys per sequence (sizes the split count; for CUDA-graph
            capture use the largest length the graph will see).
        num_splits: ``0`` = the planner's choice for this batch, context and SM count.
        config: tile configuration (default :func:`~flashpage.ops.paged_launch.default_decode_config`);
            a config with ``heads_per_program > 0`` keeps it.
    Raises:
        ValueError / TypeError naming the bad argument.
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
    choice = choose_launch(
        config or default_decode_config(kv_dtype, head_dim), num_splits, batch, seqlen_q, nheads, nheads_k,
        kv_dtype, max_seqlen_k, default_num_sms(device),
    )  # fmt: skip
    splits, tiles = choice.num_splits, choice.tiles
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
        config=choice.config,
        block_m=tiles.block_m,
        grid=paged_grid(choice.config, tiles.q_tiles, splits, tiles.head_programs, batch),
        softmax_scale=softmax_scale if softmax_scale is not None else head_dim**-0.5,
        causal=causal,
        window_size=window_size,
        softcap=softcap,
        workspace=allocate_workspace(batch * seqlen_q, nheads, splits, head_dim, device)
        if splits > 1
        else None,
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
    softmax_scale: float | None = None,
    window_size: tuple[int, int] | None = None,
    softcap: float | None = None,
    launcher: PagedLauncher | None = None,
) -> Tensor:
    """Launch a planned decode: no device syncs, only shape metadata is compared with the plan.

    Args:
        q: ``(batch, nheads, d)`` or ``(batch, seqlen_q, nheads, d)`` (``batch * seqlen_q`` packed
            rows, contiguous per row).
        k_cache, v_cache: ``(num_blocks, block_size, nheads_k, d)``.
        block_table: ``(batch, max_blocks_per_seq)`` int32; cache_seqlens: ``(batch,)`` int32.
        out: optional output buffer shaped like ``q`` (a static buffer for graph capture).
        lse: optional float32 ``(batch * seqlen_q, nheads)`` buffer for the natural-log LSE.
        softmax_scale, window_size, softcap: override the plan's (``None``: the plan's).
        launcher: binds the plan's launch on a new tensor layout (default: the eager launcher).
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
    problem = PagedProblem(
        q.reshape(rows, plan.nheads, plan.head_dim), k_cache, v_cache, out.view(rows, plan.nheads, plan.head_dim),
        cache_seqlens, plan.seqlen_q, plan.softmax_scale if softmax_scale is None else softmax_scale,
        block_table=block_table, lse=lse.t() if lse is not None else None, causal=plan.causal,
        window_size=plan.window_size if window_size is None else window_size,
        softcap=plan.softcap if softcap is None else softcap, alibi_slopes=alibi_slopes,
        k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip
    slot = plan.bound
    key = problem.layout_key()
    if slot.launch is not None and slot.key == key:
        slot.launch.relaunch(problem)
        return out
    bound = (launcher or eager_launcher()).bind(problem, plan.config, plan.num_splits, plan.workspace)
    slot.key, slot.launch = (key, bound) if bound is not None else (None, None)
    return out
