"""Per-rank bodies of the ring-attention tests (run by :func:`tests.distributed.spawn.run_ranks`):
every rank builds the same full problem, runs single-process flash attention on the whole sequence
as the reference, runs ring / zigzag attention on its shard and reports max errors of its rows."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from flashpage.distributed import (
    ring_flash_attn_func,
    ring_flash_attn_varlen_func,
    varlen_split,
    zigzag_ring_flash_attn_func,
    zigzag_ring_flash_attn_varlen_func,
    zigzag_split,
)
from flashpage.ops.flash_attn import flash_attn_func, flash_attn_varlen_func

D = 32


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    diff = (a.float() - b.float()).abs()
    return float("inf") if torch.isnan(diff).any() else float(diff.max())


def _full(case: dict, world: int) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    g = torch.Generator().manual_seed(1234)
    h, hk = case["nheads"], case["nheads_k"]
    if case["varlen"]:
        lens = [2 * world * m for m in (2, 3)]
        total = sum(lens)
        cu = torch.tensor([0, lens[0], total], dtype=torch.int32)
        shapes = [(total, h, D), (total, hk, D), (total, hk, D), (total, h, D)]
    else:
        n = case.get("seqlen") or case["seqlen_per_rank"] * world
        cu = None
        shapes = [(2, n, h, D), (2, n, hk, D), (2, n, hk, D), (2, n, h, D)]
    return [torch.randn(s, generator=g) for s in shapes], cu


def _single(
    case: dict, qkv: list[torch.Tensor], dout: torch.Tensor, cu: torch.Tensor | None
) -> list[torch.Tensor]:
    """Single-process flash attention on the full sequence: [out, dq, dk, dv]."""
    q, k, v = (t.detach().clone().requires_grad_() for t in qkv)
    kw = {"softmax_scale": case["scale"], "causal": case["causal"], "window_size": tuple(case["window"])}
    if cu is not None:
        m = int((cu[1:] - cu[:-1]).max())
        out = flash_attn_varlen_func(q, k, v, cu, cu, m, m, **kw)
    else:
        out = flash_attn_func(q, k, v, **kw)
    out.backward(dout)
    return [out.detach(), q.grad, k.grad, v.grad]  # type: ignore[list-item]


def _ring(
    case: dict,
    rank: int,
    world: int,
    qkv: list[torch.Tensor],
    dout: torch.Tensor,
    cu: torch.Tensor | None,
    group: dist.ProcessGroup | None = None,
):
    """Ring / zigzag attention of this rank's shard (``rank``/``world`` within ``group``)."""
    zig = case["layout"] == "zigzag"
    kw = {"softmax_scale": case["scale"], "causal": case["causal"], "window_size": tuple(case["window"])}
    kw["group"] = group
    if cu is not None:
        shards = [varlen_split(t, cu, rank, world, zigzag=zig) for t in (*qkv, dout)]
        local_cu = shards[0][1]
        q, k, v = (s[0].clone().requires_grad_() for s in shards[:3])
        fn = zigzag_ring_flash_attn_varlen_func if zig else ring_flash_attn_varlen_func
        m = int((local_cu[1:] - local_cu[:-1]).max())
        out = fn(q, k, v, local_cu, m, **kw)
        out.backward(shards[3][0])
        return [out.detach(), q.grad, k.grad, v.grad]

    def split(t: torch.Tensor) -> torch.Tensor:
        return zigzag_split(t, rank, world) if zig else t.chunk(world, dim=1)[rank]

    q, k, v = (split(t).clone().requires_grad_() for t in qkv)
    fn = zigzag_ring_flash_attn_func if zig else ring_flash_attn_func
    out = fn(q, k, v, **kw)
    out.backward(split(dout))
    return [out.detach(), q.grad, k.grad, v.grad]


def _shard(case: dict, t: torch.Tensor, rank: int, world: int, cu: torch.Tensor | None) -> torch.Tensor:
    zig = case["layout"] == "zigzag"
    if cu is not None:
        return varlen_split(t, cu, rank, world, zigzag=zig)[0]
    return zigzag_split(t, rank, world) if zig else t.chunk(world, dim=1)[rank]


NAMES = ("out", "dq", "dk", "dv")


def attention_worker(rank: int, world: int, cases: list[dict]) -> dict[str, Any]:
    """``{case name: {"ring": {out, dq, dk, dv errors}, "single": {...}}}``: errors against the
    float32 single-process result (the PyTorch reference on CPU); "single" is the single-process run
    in the case's dtype. Ring and "single" run on the GPU under NCCL, else on CPU."""
    device = torch.device("cuda", rank) if dist.get_backend() == "nccl" else torch.device("cpu")
    results: dict[str, Any] = {}
    for case in cases:
        dtype = getattr(torch, case["dtype"])
        full, cu = _full(case, world)
        low = [t.to(dtype) for t in full]
        ref = _single(case, [t.float() for t in low[:3]], low[3].float(), cu)
        dev = [t.to(device) for t in low]
        dev_cu = cu.to(device) if cu is not None else None
        if case.get("backend"):  # the ring's blocks on this backend (triton on CPU: the interpreter)
            os.environ["FLASHPAGE_BACKEND"] = case["backend"]
        try:
            ring = [t.cpu() for t in _ring(case, rank, world, dev[:3], dev[3], dev_cu)]
        finally:
            os.environ.pop("FLASHPAGE_BACKEND", None)
        entry = {"ring": {n: _err(r, _shard(case, f, rank, world, cu)) for n, r, f in zip(NAMES, ring, ref)}}
        if dtype != torch.float32:
            single = _single(case, dev[:3], dev[3], dev_cu)
            entry["single"] = {n: _err(s.cpu(), f) for n, s, f in zip(NAMES, single, ref)}
            entry["dtype_ok"] = all(r.dtype == dtype for r in ring)
        results[case["name"]] = entry
    if device.type == "cpu" and world == 4:
        results["subgroup"] = _subgroup_check(rank, cases[1])
    if device.type == "cpu":
        results["errors"] = _misuse_errors()
        results["dropout"] = _dropout_check(rank, world)
    return results


def _subgroup_check(rank: int, case: dict) -> dict[str, float]:
    """Ring attention over the groups {0, 2} and {1, 3} of a world of 4, where group ranks differ
    from global ranks: errors of this rank's rows against the full-sequence result."""
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]  # every rank creates every group
    group, grank = groups[rank % 2], rank // 2
    (q, k, v, dout), cu = _full(case, 2)
    ref = _single(case, [q, k, v], dout, cu)
    ring = _ring(case, grank, 2, [q, k, v], dout, cu, group)
    return {n: _err(r, _shard(case, f, grank, 2, cu)) for n, r, f in zip(NAMES, ring, ref)}


def _misuse_errors() -> dict[str, str]:
    """Messages of the errors a misuse raises inside an initialised group."""
    msgs = {}
    q = torch.randn(1, 3, 2, D)
    try:
        zigzag_ring_flash_attn_func(q, q, q, causal=True)
    except ValueError as e:
        msgs["zigzag_odd"] = str(e)
    try:
        ring_flash_attn_func(q, q[:, :2], q[:, :2])
    except ValueError as e:
        msgs["shape"] = str(e)
    try:
        ring_flash_attn_func(q, q, q, window_size=(-2, 0))
    except ValueError as e:
        msgs["window"] = str(e)
    return msgs


def _dropout_check(rank: int, world: int) -> dict[str, float]:
    """With dropout, the gradients match central differences of the global loss (the dropout
    masks are reproduced from the reseeded generator) and dropout changes the output."""
    g = torch.Generator().manual_seed(7)
    q, k, v, w, uq, uk = (
        torch.randn(1, 4 * world, 2, D, generator=g).chunk(world, dim=1)[rank] for _ in range(6)
    )

    def loss(qq: torch.Tensor, kk: torch.Tensor, p: float = 0.3) -> torch.Tensor:
        torch.manual_seed(5)
        return (ring_flash_attn_func(qq, kk, v, dropout_p=p, causal=True) * w).sum()

    def total(t: torch.Tensor) -> float:
        t = t.detach().clone()
        dist.all_reduce(t)
        return float(t)

    qq, kk = q.clone().requires_grad_(), k.clone().requires_grad_()
    loss(qq, kk).backward()
    eps = 1e-2
    fd_q = total(loss(q + eps * uq, k) - loss(q - eps * uq, k)) / (2 * eps)
    fd_k = total(loss(q, k + eps * uk) - loss(q, k - eps * uk)) / (2 * eps)
    return {
        "fd_q": fd_q,
        "an_q": total((qq.grad * uq).sum()),
        "fd_k": fd_k,
        "an_k": total((kk.grad * uk).sum()),
        "changed": total((loss(q, k) - loss(q, k, 0.0)).abs()),
    }
