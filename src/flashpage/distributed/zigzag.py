"""Zigzag ring attention: the sequence cut into ``2 * world`` chunks, rank ``r`` holding chunks ``r``
and ``2 * world - 1 - r``, so every rank does the same causal work (with the contiguous layout rank
0 attends one block and the last rank ``world``). Same ring engine as :mod:`.ring`.

``zigzag_split`` / ``zigzag_merge`` convert between the full sequence and the per-rank shards;
``varlen_split`` / ``varlen_merge`` do the same for packed batches (both layouts).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from flashpage.distributed.ring import (
    Layout,
    Segment,
    _check_qkv,
    check_group,
    local_seqlens,
    ring_attention,
    varlen_attention,
)

__all__ = [
    "varlen_merge",
    "varlen_split",
    "zigzag_layout",
    "zigzag_merge",
    "zigzag_ring_flash_attn_func",
    "zigzag_ring_flash_attn_varlen_func",
    "zigzag_split",
]


def _check_world(rank: int, world_size: int) -> None:
    if world_size < 1:
        raise ValueError(f"world_size: {world_size} must be >= 1")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank: {rank} is not in [0, world_size={world_size})")


def zigzag_split(x: Tensor, rank: int, world_size: int, dim: int = 1) -> Tensor:
    """Rank ``rank``'s zigzag shard of ``x``: chunks ``rank`` and ``2 * world_size - 1 - rank`` of
    ``x`` cut into ``2 * world_size`` equal chunks along ``dim``, concatenated (a new tensor).

    Raises:
        ValueError: ``x.shape[dim]`` not divisible by ``2 * world_size``; bad rank / world_size.
    """
    _check_world(rank, world_size)
    n = x.shape[dim]
    if n % (2 * world_size) != 0:
        raise ValueError(
            f"x: sequence length {n} along dim {dim} is not divisible by 2 * world_size = {2 * world_size}"
        )
    chunks = x.chunk(2 * world_size, dim=dim)
    return torch.cat([chunks[rank], chunks[2 * world_size - 1 - rank]], dim=dim)


def zigzag_merge(shards: Sequence[Tensor], dim: int = 1) -> Tensor:
    """Inverse of :func:`zigzag_split`: the full sequence from every rank's shard, in rank order.

    Raises:
        ValueError: no shards, or a shard whose length along ``dim`` is odd.
    """
    if len(shards) == 0:
        raise ValueError("shards: empty")
    world = len(shards)
    halves: list[Tensor | None] = [None] * (2 * world)
    for r, s in enumerate(shards):
        if s.shape[dim] % 2 != 0:
            raise ValueError(f"shards: shard {r} has odd length {s.shape[dim]} along dim {dim}")
        a, b = s.chunk(2, dim=dim)
        halves[r], halves[2 * world - 1 - r] = a, b
    return torch.cat(halves, dim=dim)  # type: ignore[arg-type]


def zigzag_layout(seqlens: Sequence[int], starts: Sequence[int], world_size: int) -> Layout:
    """Zigzag layout: sequence ``i`` (local length ``seqlens[i]``, even, at local offset
    ``starts[i]``) is two chunks of ``seqlens[i] // 2`` tokens, chunks ``r`` and ``2 * world - 1 - r``."""

    def layout(rank: int) -> list[Segment]:
        segs = []
        for i, (s, n) in enumerate(zip(starts, seqlens, strict=True)):
            c = n // 2
            segs += [Segment(s, c, rank * c, i), Segment(s + c, c, (2 * world_size - 1 - rank) * c, i)]
        return segs

    return layout


def zigzag_ring_flash_attn_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    group: dist.ProcessGroup | None = None,
) -> Tensor:
    """:func:`flashpage.distributed.ring_flash_attn_func` on zigzag shards (:func:`zigzag_split`).

    Args:
        q: ``(batch, seqlen_local, nheads, d)`` = ``zigzag_split(q_full, rank, world)``;
            ``seqlen_local`` must be even (the global length divides by ``2 * world``).
        k, v, and the rest: as :func:`flashpage.distributed.ring_flash_attn_func`.

    Returns:
        ``out`` like ``q``, in the zigzag layout (``zigzag_merge`` of every rank's gives the
        full-sequence output).
    """
    _check_qkv(q, k, v, packed=False)
    world = check_group(group)[1]
    if q.shape[1] % 2 != 0:
        raise ValueError(
            f"q: local sequence length {q.shape[1]} is odd: the global sequence must divide by "
            f"2 * world_size = {2 * world} (use zigzag_split)"
        )
    layout = zigzag_layout([q.shape[1]], [0], world)
    return ring_attention(q, k, v, layout, dropout_p, softmax_scale, causal, window_size, group)


def zigzag_ring_flash_attn_varlen_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    group: dist.ProcessGroup | None = None,
) -> Tensor:
    """Zigzag ring attention on packed sequences: every sequence in its own zigzag layout
    (``varlen_split(..., zigzag=True)``); ``cu_seqlens`` holds the local (even) lengths.
    Arguments and result as :func:`flashpage.distributed.ring_flash_attn_varlen_func`."""
    return varlen_attention(
        q,
        k,
        v,
        cu_seqlens,
        max_seqlen,
        _even_zigzag_layout,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        group,
    )


def _even_zigzag_layout(lens: list[int], starts: list[int], world: int) -> Layout:
    odd = [i for i, n in enumerate(lens) if n % 2]
    if odd:
        raise ValueError(
            f"cu_seqlens: local lengths of sequences {odd} are odd: every global length must divide by "
            f"2 * world_size = {2 * world}"
        )
    return zigzag_layout(lens, starts, world)


def varlen_split(
    x: Tensor, cu_seqlens: Tensor, rank: int, world_size: int, zigzag: bool = False
) -> tuple[Tensor, Tensor]:
    """Rank ``rank``'s shard of a packed batch ``x (total, ...)`` and its local ``cu_seqlens``.

    Every sequence is split on its own (contiguous pieces, or zigzag chunks with ``zigzag=True``).

    Raises:
        ValueError: a sequence length not divisible by ``world_size`` (``2 * world_size`` zigzag).
    """
    _check_world(rank, world_size)
    lens, starts = local_seqlens(cu_seqlens, x.shape[0])
    parts = 2 * world_size if zigzag else world_size
    bad = [n for n in lens if n % parts]
    if bad:
        raise ValueError(f"cu_seqlens: sequence lengths {bad} are not divisible by {parts}")
    pieces = []
    for s, n in zip(starts, lens, strict=True):
        seq = x[s : s + n]
        pieces.append(zigzag_split(seq, rank, world_size, dim=0) if zigzag else seq.chunk(world_size)[rank])
    local = torch.tensor([0] + [n // world_size for n in lens], dtype=torch.int32).cumsum(0)
    return torch.cat(pieces), local.to(device=cu_seqlens.device, dtype=torch.int32)


def varlen_merge(shards: Sequence[Tensor], cu_seqlens: Tensor, zigzag: bool = False) -> Tensor:
    """Inverse of :func:`varlen_split`: the packed batch from every rank's shard (rank order);
    ``cu_seqlens`` are the local prefix sums (the same on every rank)."""
    if len(shards) == 0:
        raise ValueError("shards: empty")
    lens, starts = local_seqlens(cu_seqlens, shards[0].shape[0])
    seqs = []
    for s, n in zip(starts, lens, strict=True):
        parts = [sh[s : s + n] for sh in shards]
        seqs.append(zigzag_merge(parts, dim=0) if zigzag else torch.cat(parts))
    return torch.cat(seqs)
