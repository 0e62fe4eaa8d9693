"""Ring (sequence-parallel) FlashAttention over ``torch.distributed``: ``ring_flash_attn_func`` and
``ring_flash_attn_varlen_func``, plus the ring engine the zigzag layout (:mod:`.zigzag`) reuses.

Every rank holds a shard of the sequence (queries, keys and values of the same positions). With
``world`` ranks the forward takes ``world`` steps: at step ``s`` rank ``r`` holds the K/V shard of rank
``r - s``, attends its queries to it with flashpage's flash forward (which returns the LSE) and
merges the partial output by log-sum-exp in float32, while the next K/V shard travels by
``torch.distributed.batch_isend_irecv`` (on its own CUDA stream on GPU). The backward walks the ring
again: every step computes the dQ/dK/dV of one block with the flash backward from the final output
and LSE, and the dK/dV accumulators (float32) travel around the ring with their K/V shard, arriving
back at their owner after ``world`` hops. Masks are defined on global positions
(:func:`flashpage.distributed.blocks.plan_block`), so causal and sliding-window attention are exact
and blocks no query can see are skipped.

Layouts: the contiguous layout here (rank ``r`` holds positions ``[r*n, (r+1)*n)``) leaves rank 0
with one causal block and the last rank with ``world``; the zigzag layout balances them.

Launches: one flash call per step where the mask allows it (a rank's own causal block, fused full
blocks); a packed (varlen) batch takes one call per sequence and block, since each sequence has its
own global positions. No softcap or ALiBi (not in the contract's signature).

Works over NCCL (GPU) and gloo (CPU). Kernels: the Triton kernels on CUDA, the PyTorch reference on
CPU (``FLASHPAGE_BACKEND``, as :func:`flashpage.flash_attn_func`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from flashpage.distributed.blocks import (
    block_backward,
    block_forward,
    default_scale,
    merge_partial,
    plan_block,
)

__all__ = [
    "RingComm",
    "Segment",
    "check_group",
    "ring_attention",
    "ring_flash_attn_func",
    "ring_flash_attn_varlen_func",
    "ring_layout",
]

_SEED_HIGH = 1 << 62


@dataclass(frozen=True)
class Segment:
    """A run of tokens a rank holds: ``length`` tokens at ``local_start`` in the local tensor's
    sequence dim, which are positions ``[global_start, global_start + length)`` of sequence ``seq``."""

    local_start: int
    length: int
    global_start: int
    seq: int = 0


# rank -> the segments that rank holds (the same function on every rank).
Layout = Callable[[int], Sequence[Segment]]


@dataclass(frozen=True)
class _Task:
    q: slice
    k: slice
    window: tuple[int, int]


def check_group(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """``(rank, world_size)`` of ``group`` (default: the world group).

    Raises:
        RuntimeError: ``torch.distributed`` has no initialised process group.
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "group: no torch.distributed process group is initialized; start the processes under torchrun "
            "(or spawn them) and call torch.distributed.init_process_group('nccl' or 'gloo') first"
        )
    return dist.get_rank(group), dist.get_world_size(group)


class RingComm:
    """Sends tensors to the next rank of ``group`` and receives the previous rank's, asynchronously.

    ``send_recv`` posts the sends and receives as one ``batch_isend_irecv`` (on a side CUDA stream
    that first waits for the producer stream, so the transfer overlaps the next kernel); ``wait``
    returns the received tensors, ordered after the transfer on the current stream.
    """

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.rank, self.world = check_group(group)
        base = group if group is not None else dist.group.WORLD
        self.next = dist.get_global_rank(base, (self.rank + 1) % self.world)  # type: ignore[arg-type]
        self.prev = dist.get_global_rank(base, (self.rank - 1) % self.world)  # type: ignore[arg-type]
        self._stream: torch.cuda.Stream | None = None
        self._reqs: list[dist.Work] = []
        self._recv: list[Tensor] = []

    def send_recv(self, tensors: Sequence[Tensor]) -> None:
        if self._reqs:
            raise RuntimeError("RingComm.send_recv: the previous transfer was not waited for")
        send = [t.contiguous() for t in tensors]
        self._recv = [torch.empty_like(t) for t in send]
        ops = [dist.P2POp(dist.isend, t, self.next, self.group) for t in send]
        ops += [dist.P2POp(dist.irecv, t, self.prev, self.group) for t in self._recv]
        if send[0].is_cuda:
            if self._stream is None:
                self._stream = torch.cuda.Stream(device=send[0].device)
            self._stream.wait_stream(torch.cuda.current_stream(send[0].device))
            with torch.cuda.stream(self._stream):
                self._reqs = dist.batch_isend_irecv(ops)
            for t in (*send, *self._recv):
                t.record_stream(self._stream)
        else:
            self._reqs = dist.batch_isend_irecv(ops)

    def wait(self) -> list[Tensor]:
        for req in self._reqs:
            req.wait()
        self._reqs = []
        if self._stream is not None:
            torch.cuda.current_stream(self._stream.device).wait_stream(self._stream)
        recv, self._recv = self._recv, []
        return recv


def ring_layout(seqlens: Sequence[int], starts: Sequence[int]) -> Layout:
    """Contiguous layout: sequence ``i`` (local length ``seqlens[i]`` at local offset ``starts[i]``)
    is cut into ``world`` equal pieces, rank ``r`` holding piece ``r``."""

    def layout(rank: int) -> list[Segment]:
        return [Segment(s, n, rank * n, i) for i, (s, n) in enumerate(zip(starts, seqlens, strict=True))]

    return layout


def _tasks(layout: Layout, rank: int, src: int, causal: bool, window: tuple[int, int]) -> list[_Task]:
    """The exact local calls between this rank's queries and rank ``src``'s keys."""
    by_seq: dict[int, tuple[list[Segment], list[Segment]]] = {}
    for seg in layout(rank):
        by_seq.setdefault(seg.seq, ([], []))[0].append(seg)
    for seg in layout(src):
        by_seq.setdefault(seg.seq, ([], []))[1].append(seg)
    tasks = []
    for q_segs, k_segs in by_seq.values():
        own = _diagonal(q_segs) if src == rank and causal and window[0] < 0 else None
        if own is not None:
            tasks.append(_Task(own, own, (-1, 0)))
            continue
        for qs in q_segs:
            for ks in k_segs:
                blk = plan_block(qs.global_start, qs.length, ks.global_start, ks.length, causal, window)
                if blk is not None:
                    q = slice(qs.local_start + blk.q_lo, qs.local_start + blk.q_hi)
                    k = slice(ks.local_start + blk.k_lo, ks.local_start + blk.k_hi)
                    tasks.append(_Task(q, k, blk.window))
    return _coalesce(tasks)


def _diagonal(segs: list[Segment]) -> slice | None:
    """A rank's own causal block as one local causal call, when its segments of a sequence are
    contiguous locally and in increasing global order (then local order is global order, and the
    local causal mask is the global one: zigzag's first step is one launch, not three)."""
    segs = sorted(segs, key=lambda s: s.local_start)
    for a, b in itertools.pairwise(segs):
        if a.local_start + a.length != b.local_start or a.global_start + a.length > b.global_start:
            return None
    return slice(segs[0].local_start, segs[-1].local_start + segs[-1].length) if segs else None


def _coalesce(tasks: list[_Task]) -> list[_Task]:
    """Fuse full (unmasked) blocks that share their keys and have adjacent query rows, or share
    their queries and have adjacent keys, into one larger call (zigzag's off-diagonal steps: one
    kernel launch instead of two)."""
    out: list[_Task] = []
    for t in tasks:
        prev = out[-1] if out else None
        if prev is not None and prev.window == t.window == (-1, -1):
            if prev.k == t.k and prev.q.stop == t.q.start:
                out[-1] = _Task(slice(prev.q.start, t.q.stop), t.k, t.window)
                continue
            if prev.q == t.q and prev.k.stop == t.k.start:
                out[-1] = _Task(t.q, slice(prev.k.start, t.k.stop), t.window)
                continue
        out.append(t)
    return out


def _block_seed(seed: int, rank: int, world: int, step: int, index: int) -> int:
    """A distinct dropout seed per (rank, step, block), the same in forward and backward."""
    return (seed + ((rank * world + step) << 16) + index) % _SEED_HIGH


@dataclass(frozen=True)
class _Opts:
    layout: Layout
    scale: float
    causal: bool
    window: tuple[int, int]
    dropout_p: float
    group: dist.ProcessGroup | None


def _forward(q: Tensor, k: Tensor, v: Tensor, o: _Opts, seed: int) -> tuple[Tensor, Tensor]:
    comm = RingComm(o.group)
    rank, world = comm.rank, comm.world
    b, n, h, d = q.shape
    out = torch.zeros((b, n, h, d), dtype=torch.float32, device=q.device)
    lse = torch.full((b, h, n), float("-inf"), dtype=torch.float32, device=q.device)
    kv = [k, v]
    for step in range(world):
        if step + 1 < world:
            comm.send_recv(kv)
        src = (rank - step) % world
        for i, t in enumerate(_tasks(o.layout, rank, src, o.causal, o.window)):
            bo, bl = block_forward(
                q[:, t.q], kv[0][:, t.k], kv[1][:, t.k], o.scale, t.window, o.dropout_p,
                _block_seed(seed, rank, world, step, i),
            )  # fmt: skip
            merge_partial(out[:, t.q], lse[:, :, t.q], bo, bl)
        if step + 1 < world:
            kv = comm.wait()
    return out, lse


def _backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, o: _Opts, seed: int
) -> tuple[Tensor, Tensor, Tensor]:
    kv_comm, dkv_comm = RingComm(o.group), RingComm(o.group)
    rank, world = kv_comm.rank, kv_comm.world
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    kv = [k, v]
    for step in range(world):
        if step + 1 < world:
            kv_comm.send_recv(kv)
        src = (rank - step) % world
        dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
        for i, t in enumerate(_tasks(o.layout, rank, src, o.causal, o.window)):
            bq, bk, bv = block_backward(
                dout[:, t.q], q[:, t.q], kv[0][:, t.k], kv[1][:, t.k], out[:, t.q], lse[:, :, t.q], o.scale,
                t.window, o.dropout_p, _block_seed(seed, rank, world, step, i),
            )  # fmt: skip
            dq[:, t.q] += bq
            dk[:, t.k] += bk
            dv[:, t.k] += bv
        if step > 0:  # the accumulators of src's K/V, from the ranks it has visited so far
            prev_dk, prev_dv = dkv_comm.wait()
            dk += prev_dk
            dv += prev_dv
        if world > 1:
            dkv_comm.send_recv([dk, dv])
        if step + 1 < world:
            kv = kv_comm.wait()
    if world > 1:  # after `world` hops our own K/V's accumulators are back
        dk, dv = dkv_comm.wait()
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _RingAttnFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx, q: Tensor, k: Tensor, v: Tensor, opts: _Opts
    ) -> tuple[Tensor, Tensor]:  # type: ignore[override]
        seed = int(torch.randint(0, _SEED_HIGH, (1,)).item()) if opts.dropout_p > 0 else 0
        out32, lse = _forward(q, k, v, opts, seed)
        out = out32.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.opts, ctx.seed = opts, seed  # type: ignore[attr-defined]
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, dout: Tensor, _dlse: Tensor) -> tuple:  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors  # type: ignore[attr-defined]
        dq, dk, dv = _backward(dout.contiguous(), q, k, v, out, lse, ctx.opts, ctx.seed)  # type: ignore[attr-defined]
        return dq, dk, dv, None


def _check_qkv(q: Tensor, k: Tensor, v: Tensor, packed: bool) -> None:
    dims = 3 if packed else 4
    names = "(total, nheads, d)" if packed else "(batch, seqlen_local, nheads, d)"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor) or t.dim() != dims:
            raise ValueError(f"{name}: expected a {dims}-D tensor {names}")
    if k.shape != v.shape:
        raise ValueError(f"v: shape {tuple(v.shape)} != k's {tuple(k.shape)}")
    if q.shape[:-2] != k.shape[:-2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"k: shape {tuple(k.shape)} does not match q's {tuple(q.shape)} (same tokens, head dim)"
        )
    if q.shape[-2] % k.shape[-2] != 0:
        raise ValueError(f"k: nheads ({q.shape[-2]}) must be divisible by nheads_k ({k.shape[-2]})")


def _check_opts(dropout_p: float, window_size: Sequence[int]) -> tuple[int, int]:
    if not 0.0 <= float(dropout_p) < 1.0:
        raise ValueError(f"dropout_p: {dropout_p} is not in [0, 1)")
    if len(window_size) != 2 or any(int(w) < -1 for w in window_size):
        raise ValueError(f"window_size: {tuple(window_size)} must be two ints >= -1 (-1 = unbounded)")
    return int(window_size[0]), int(window_size[1])


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    layout: Layout,
    dropout_p: float,
    softmax_scale: float | None,
    causal: bool,
    window_size: Sequence[int],
    group: dist.ProcessGroup | None,
) -> Tensor:
    """Differentiable ring attention of 4-D local shards under any :data:`Layout` (the engine of
    the public functions; ``layout`` must describe ``q``'s sequence dim on every rank)."""
    check_group(group)
    window = _check_opts(dropout_p, window_size)
    opts = _Opts(layout, default_scale(q, softmax_scale), bool(causal), window, float(dropout_p), group)
    return _RingAttnFunction.apply(q, k, v, opts)[0]  # type: ignore[no-any-return]


def local_seqlens(cu_seqlens: Tensor, total: int) -> tuple[list[int], list[int]]:
    """``(lengths, starts)`` from int32 ``cu_seqlens``, checked against the packed length."""
    if not isinstance(cu_seqlens, Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError("cu_seqlens: expected a 1-D int tensor (batch + 1,) of prefix sums")
    cu = [int(c) for c in cu_seqlens.tolist()]
    if cu[0] != 0 or any(b < a for a, b in itertools.pairwise(cu)) or cu[-1] > total:
        raise ValueError(f"cu_seqlens: {cu} must start at 0, not decrease and end <= total ({total})")
    return [b - a for a, b in itertools.pairwise(cu)], cu[:-1]


def ring_flash_attn_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    group: dist.ProcessGroup | None = None,
) -> Tensor:
    """Sequence-parallel FlashAttention over the ranks of ``group``, contiguous layout.

    Args:
        q: ``(batch, seqlen_local, nheads, d)``, this rank's shard: rank ``r`` of ``world`` holds
            global positions ``[r * seqlen_local, (r + 1) * seqlen_local)``.
        k, v: ``(batch, seqlen_local, nheads_k, d)`` of the same positions; nheads % nheads_k == 0.
        dropout_p, softmax_scale: as :func:`flashpage.flash_attn_func`.
        causal, window_size: masks on global positions (query ``i`` sees key ``j`` iff
            ``i - left <= j <= i + right``; causal: ``right = 0``) -- the full-sequence call's.
        group: the process group (default: the world group).

    Returns:
        ``out`` like ``q``: this rank's rows of ``flash_attn_func`` on the whole sequence.
        Differentiable in q, k, v.

    Raises:
        RuntimeError: no initialised process group.
        ValueError: mismatched shapes, bad dropout_p or window_size.
    """
    _check_qkv(q, k, v, packed=False)
    return ring_attention(
        q, k, v, ring_layout([q.shape[1]], [0]), dropout_p, softmax_scale, causal, window_size, group
    )


def ring_flash_attn_varlen_func(
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
    """Ring attention on packed variable-length sequences (contiguous layout per sequence).

    Args:
        q: ``(total, nheads, d)``; k, v: ``(total, nheads_k, d)``: this rank's shard of every
            sequence, packed. Sequence ``i`` of global length ``world * n_i`` is cut into ``world``
            pieces of ``n_i`` tokens and rank ``r`` holds piece ``r``
            (:func:`flashpage.distributed.varlen_split`).
        cu_seqlens: int32 ``(batch + 1,)`` prefix sums of the *local* lengths ``n_i`` (the same on
            every rank).
        max_seqlen: the largest local length (flash-attn's signature; only checked).
        Other arguments: as :func:`ring_flash_attn_func`; masks act within each sequence.

    Returns:
        ``out (total, nheads, d)`` (rows past ``cu_seqlens[-1]`` are zeros).
    """
    return varlen_attention(
        q, k, v, cu_seqlens, max_seqlen, lambda lens, starts, _world: ring_layout(lens, starts), dropout_p,
        softmax_scale, causal, window_size, group,
    )  # fmt: skip


def varlen_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: int,
    make_layout: Callable[[list[int], list[int], int], Layout],
    dropout_p: float,
    softmax_scale: float | None,
    causal: bool,
    window_size: Sequence[int],
    group: dist.ProcessGroup | None,
) -> Tensor:
    """The varlen entry points' shared body: checks, then :func:`ring_attention` on the packed
    tensors as one batch row, with ``make_layout(local lengths, local starts, world)``."""
    _check_qkv(q, k, v, packed=True)
    world = check_group(group)[1]
    lens, starts = local_seqlens(cu_seqlens, q.shape[0])
    if max(lens) > int(max_seqlen):
        raise ValueError(f"max_seqlen: {max_seqlen} < the longest local sequence ({max(lens)})")
    layout = make_layout(lens, starts, world)
    out = ring_attention(
        q.unsqueeze(0),
        k.unsqueeze(0),
        v.unsqueeze(0),
        layout,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        group,
    )
    return out.squeeze(0)
