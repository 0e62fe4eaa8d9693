"""Tensor parallelism (Megatron-style) for the Llama-family models: head split, parallel layers, sharding.

Layers. Each rank holds a slice of every projection:

* column-parallel (no communication): the fused QKV projection split by heads (each rank computes its
  own q heads and the kv heads they read) and the fused gate/up projection split by intermediate
  columns;
* row-parallel (one all-reduce each): the attention output projection and the MLP down projection take
  the rank's slice of their input columns; the partial products are summed by one all-reduce, then the
  bias (if any) is added once. So a decoder layer costs exactly one all-reduce per attention block and
  one per MLP;
* vocab-parallel embedding: rank ``r`` holds rows ``[r * s, (r + 1) * s)`` of the table
  (``s = ceil(vocab / N)``, the last shard zero-padded); a token outside the shard looks up zeros and one
  all-reduce completes the rows (exact: one non-zero addend per element);
* vocab-parallel logits: each rank multiplies by its vocabulary rows (the tied or separate ``lm_head``)
  and the shards are gathered on the group's rank 0 (``dst=0``, what the engine uses: only rank 0
  samples) or on every rank (``dst=None``).

Heads: ``num_heads`` must divide by ``N``. Key/value heads divide by ``N`` too, or, when there are fewer
kv heads than ranks, ``N`` must be a multiple of them and each kv head is replicated on ``N / num_kv_heads``
consecutive ranks (rank ``r`` keeps kv head ``r // (N / num_kv_heads)``, which is exactly the kv head its
q heads ``[r * h / N, (r + 1) * h / N)`` read under GQA; its KV cache then holds that one head). Anything
else (e.g. SmolLM2's 9 heads / 3 kv heads at ``N = 2``) is a ``ValueError`` naming
``tensor_parallel_size``.

Weights: every rank loads the full checkpoint and slices it (:func:`shard_model_`), then frees the full
tensors. Simple and correct for every architecture the loaders know; peak host/device memory per rank is
one full model during start-up (a per-rank sharded loader would avoid it).

The engine's use of these blocks (``LLM(..., tensor_parallel_size=N)``: rank 0 schedules and samples, the
other ranks run each step on their shard) lives in :mod:`flashpage.engine.tp_workers`; this module is
torch-only and imports nothing of the engine or the models.
"""

from __future__ import annotations

import math
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "ColumnParallelLinear",
    "HeadSplit",
    "RowParallelLinear",
    "TensorParallel",
    "check_tensor_parallel",
    "head_split",
    "local_config",
    "shard_model_",
]

# ----------------------------------------------------------------------------------------------------------
# Partitioning
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HeadSplit:
    """Heads of one rank: ``q_heads`` query heads, ``kv_heads`` key/value heads, each kv head kept on
    ``kv_replicas`` ranks (1 unless the model has fewer kv heads than ranks)."""

    q_heads: int
    kv_heads: int
    kv_replicas: int

    def q_range(self, rank: int) -> tuple[int, int]:
        """Query heads ``[lo, hi)`` of ``rank``."""
        return rank * self.q_heads, (rank + 1) * self.q_heads

    def kv_range(self, rank: int) -> tuple[int, int]:
        """Key/value heads ``[lo, hi)`` of ``rank``."""
        lo = (rank // self.kv_replicas) * self.kv_heads
        return lo, lo + self.kv_heads


def head_split(num_heads: int, num_kv_heads: int, tensor_parallel_size: int) -> HeadSplit:
    """Split ``num_heads`` / ``num_kv_heads`` over ``tensor_parallel_size`` ranks (see the module docstring).

    Raises:
        ValueError: ``"tensor_parallel_size: ..."`` when the heads do not divide.
    """
    n = tensor_parallel_size
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"tensor_parallel_size: must be a positive int, got {n!r}")
    if num_heads % n:
        raise ValueError(
            f"tensor_parallel_size: the model's {num_heads} attention heads do not divide by {n}; "
            f"use a divisor of {num_heads}"
        )
    if num_kv_heads >= n:
        if num_kv_heads % n:
            raise ValueError(
                f"tensor_parallel_size: the model's {num_kv_heads} key/value heads do not divide by {n}"
            )
        return HeadSplit(num_heads // n, num_kv_heads // n, 1)
    if n % num_kv_heads:
        raise ValueError(
            f"tensor_parallel_size: {n} is not a multiple of the model's {num_kv_heads} key/value heads "
            "(fewer kv heads than ranks are replicated, which needs a whole number of copies)"
        )
    return HeadSplit(num_heads // n, 1, n // num_kv_heads)


def check_tensor_parallel(config: Any, tensor_parallel_size: int) -> HeadSplit:
    """Check that a model config shards over ``tensor_parallel_size`` ranks; returns the head split.

    Raises:
        ValueError: ``"tensor_parallel_size: ..."`` naming what does not divide.
    """
    split = head_split(int(config.num_heads), int(config.num_kv_heads), tensor_parallel_size)
    if int(config.intermediate_size) % tensor_parallel_size:
        raise ValueError(
            f"tensor_parallel_size: the MLP width {config.intermediate_size} does not divide by "
            f"{tensor_parallel_size}"
        )
    return split


def local_config(config: Any, tensor_parallel_size: int) -> Any:
    """The per-rank view of a ``ModelConfig`` (its heads and MLP width); vocabulary and layers unchanged.

    The KV cache of a rank is sized and shaped from it.
    """
    split = check_tensor_parallel(config, tensor_parallel_size)
    return config.replace(
        num_heads=split.q_heads,
        num_kv_heads=split.kv_heads,
        intermediate_size=config.intermediate_size // tensor_parallel_size,
    )


# ----------------------------------------------------------------------------------------------------------
# The rank's view of the group, and the parallel ops
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorParallel:
    """One rank of a tensor-parallel group: the collectives the model's layers call.

    Attributes:
        rank / world_size: this rank's index in ``group`` and the group's size.
        group: the process group (``None``: the default group).
    """

    rank: int
    world_size: int
    group: Any = None

    @classmethod
    def from_group(cls, group: Any = None) -> TensorParallel:
        """This process's rank in ``group`` (the default group when ``None``).

        Raises:
            ValueError: ``"group: ..."`` when ``torch.distributed`` is not initialised.
        """
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError(
                "group: torch.distributed is not initialised; call init_process_group (or run under torchrun)"
            )
        return cls(dist.get_rank(group), dist.get_world_size(group), group)

    def all_reduce(self, x: Tensor) -> Tensor:
        """Sum ``x`` over the group in place; returns ``x``."""
        if self.world_size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def vocab_shard(self, vocab_size: int) -> tuple[int, int, int]:
        """``(start, end, rows)``: this rank's vocabulary rows ``[start, end)`` of a shard padded to ``rows``."""
        rows = math.ceil(vocab_size / self.world_size)
        start = min(self.rank * rows, vocab_size)
        return start, min(start + rows, vocab_size), rows

    def column_parallel_linear(self, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        """``x (..., in)`` by this rank's output rows ``weight (out / N, in)`` -> ``(..., out / N)``; no
        communication (the output stays split, as the next row-parallel layer wants it)."""
        return F.linear(x, weight, bias)

    def row_parallel_linear(self, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        """``x (..., in / N)`` (this rank's input columns) by ``weight (out, in / N)``, summed over the
        group by one all-reduce, plus the full ``bias (out,)`` once -> ``(..., out)`` on every rank."""
        y = self.all_reduce(F.linear(x, weight))
        return y if bias is None else y + bias

    def vocab_parallel_embedding(self, ids: Tensor, shard: Tensor, vocab_size: int) -> Tensor:
        """Rows of ``ids (T,)`` from a table split by rows: ``shard (rows, hidden)`` holds ids
        ``[start, start + rows)`` -> ``(T, hidden)`` on every rank (masked lookup + one all-reduce)."""
        if self.world_size == 1:
            return F.embedding(ids, shard)
        start, end, _ = self.vocab_shard(vocab_size)
        local = ids - start
        outside = (ids < start) | (ids >= end)
        h = F.embedding(local.masked_fill(outside, 0), shard)
        h = h.masked_fill(outside.unsqueeze(-1), 0)
        return self.all_reduce(h)

    def vocab_parallel_logits(
        self, hidden: Tensor, shard: Tensor, vocab_size: int, dst: int | None = 0
    ) -> Tensor:
        """``hidden (N, H)`` by this rank's vocabulary rows ``shard (rows, H)`` -> ``(N, vocab)`` float32.

        With ``dst`` (a rank of the group) the shards are gathered there and the other ranks get an
        empty ``(0, vocab)`` tensor; with ``dst=None`` every rank gets the full logits.
        """
        local = F.linear(hidden, shard).float().contiguous()
        if self.world_size == 1:
            return local[:, :vocab_size]
        parts = [torch.empty_like(local) for _ in range(self.world_size)]
        if dst is None:
            dist.all_gather(parts, local, group=self.group)
        else:
            gdst = dst if self.group is None else dist.get_global_rank(self.group, dst)
            dist.gather(local, parts if self.rank == dst else None, dst=gdst, group=self.group)
            if self.rank != dst:
                return local.new_empty((0, vocab_size))
        return torch.cat(parts, dim=-1)[:, :vocab_size]


class _ShardedLinear(nn.Module):
    """A rank's weight and bias (inference: no gradients) and its collectives."""

    def __init__(self, weight: Tensor, bias: Tensor | None, tp: TensorParallel) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.tp = tp


class ColumnParallelLinear(_ShardedLinear):
    """``y_r = x W_r^T + b_r``: the rank's slice ``W_r`` of the output rows; the output stays split.

    Args:
        weight / bias: this rank's rows ``(out / N, in)`` / ``(out / N,)``.
        tp: the rank (its collectives).
    """

    @classmethod
    def from_full(
        cls, weight: Tensor, bias: Tensor | None, tp: TensorParallel, sizes: Seq[int] | None = None
    ) -> ColumnParallelLinear:
        """Slice an unsharded ``(out, in)`` weight; ``sizes`` splits fused projections (e.g. ``[I, I]`` for
        gate/up), each part split by ranks and the rank's parts concatenated."""
        parts = _split_rows(weight, tp, sizes)
        b = None if bias is None else _split_rows(bias, tp, sizes)
        return cls(parts, b, tp)

    def forward(self, x: Tensor) -> Tensor:
        return self.tp.column_parallel_linear(x, self.weight, self.bias)


class RowParallelLinear(_ShardedLinear):
    """``y = sum_r x_r W_r^T + b``: the rank's input columns ``W_r``, one all-reduce, the bias once.

    Args:
        weight: this rank's columns ``(out, in / N)``; bias: the full ``(out,)``.
        tp: the rank (its collectives).
    """

    @classmethod
    def from_full(cls, weight: Tensor, bias: Tensor | None, tp: TensorParallel) -> RowParallelLinear:
        """Slice an unsharded ``(out, in)`` weight by input columns."""
        return cls(_split_cols(weight, tp), bias, tp)

    def forward(self, x: Tensor) -> Tensor:
        return self.tp.row_parallel_linear(x, self.weight, self.bias)


def _split_rows(t: Tensor, tp: TensorParallel, sizes: Seq[int] | None = None) -> Tensor:
    sizes = [t.shape[0]] if sizes is None else list(sizes)
    out = []
    for part in t.split(sizes, dim=0):
        n = part.shape[0] // tp.world_size
        out.append(part[tp.rank * n : (tp.rank + 1) * n])
    return torch.cat(out, dim=0).contiguous()


def _split_cols(t: Tensor, tp: TensorParallel) -> Tensor:
    n = t.shape[1] // tp.world_size
    return t[:, tp.rank * n : (tp.rank + 1) * n].contiguous()


# ----------------------------------------------------------------------------------------------------------
# Sharding a loaded model
# ----------------------------------------------------------------------------------------------------------


def _frozen(t: Tensor) -> nn.Parameter:
    return nn.Parameter(t.contiguous().clone(), requires_grad=False)


@torch.no_grad()
def shard_model_(model: Any, tp: TensorParallel) -> Any:
    """Slice a loaded :class:`~flashpage.models.llama.LlamaForCausalLM` in place to ``tp``'s shard and
    switch its layers to the parallel ops. Returns ``model``.

    QKV rows by heads (see :func:`head_split`; biases likewise), O columns, gate/up rows per half, down
    columns, embedding and ``lm_head`` rows by vocabulary (zero-padded to equal shards); norms (incl. the
    per-head q/k norms) and RoPE tables are replicated. The full tensors are released.

    Raises:
        ValueError: ``"tensor_parallel_size: ..."`` when heads or MLP width do not divide.
    """
    c = model.config
    n, r = tp.world_size, tp.rank
    split = check_tensor_parallel(c, n)
    d = c.head_dim
    qlo, qhi = (h * d for h in split.q_range(r))
    klo, khi = (h * d for h in split.kv_range(r))
    q_size, kv_size = c.q_size, c.kv_size
    inter = c.intermediate_size
    ilo, ihi = r * inter // n, (r + 1) * inter // n
    for layer in model.layers:
        a, m = layer.self_attn, layer.mlp

        def qkv_rows(t: Tensor) -> Tensor:
            q, k, v = t.split([q_size, kv_size, kv_size], dim=0)
            return torch.cat([q[qlo:qhi], k[klo:khi], v[klo:khi]], dim=0)

        a.qkv_weight = _frozen(qkv_rows(a.qkv_weight))
        if a.qkv_bias is not None:
            a.qkv_bias = _frozen(qkv_rows(a.qkv_bias))
        a.o_weight = _frozen(a.o_weight[:, qlo:qhi])
        a.num_heads, a.num_kv_heads = split.q_heads, split.kv_heads
        a.q_size, a.kv_size = split.q_heads * d, split.kv_heads * d
        gate, up = m.gate_up_weight.split(inter, dim=0)
        m.gate_up_weight = _frozen(torch.cat([gate[ilo:ihi], up[ilo:ihi]], dim=0))
        m.down_weight = _frozen(m.down_weight[:, ilo:ihi])
        m.intermediate = ihi - ilo
        a.tp = m.tp = tp
    start, end, rows = tp.vocab_shard(c.vocab_size)

    def vocab_rows(t: Tensor) -> nn.Parameter:
        shard = t.new_zeros((rows, t.shape[1]))
        shard[: end - start] = t[start:end]
        return nn.Parameter(shard, requires_grad=False)

    model.embed_tokens = vocab_rows(model.embed_tokens)
    if model.lm_head is not None:
        model.lm_head = vocab_rows(model.lm_head)
    model.tp = tp
    return model
