"""Beyond one device over ``torch.distributed`` (NCCL on GPUs, gloo on CPU).

* Sequence-parallel attention: ``ring_flash_attn_func``, ``zigzag_ring_flash_attn_func``,
  ``zigzag_split``, ``zigzag_merge`` (and the ``*_varlen_func`` variants with ``varlen_split`` /
  ``varlen_merge``).
* Tensor parallelism: :mod:`.tensor_parallel`'s building blocks (``ColumnParallelLinear``,
  ``RowParallelLinear``, ``TensorParallel``, ``head_split``, ``shard_model_``), which
  ``LLM(..., tensor_parallel_size=N)`` runs on every rank (:mod:`flashpage.engine.tp_workers`).
* ``flashpage netprobe``: :mod:`.netprobe`.

Contract: DESIGN.md "Distributed". Imported lazily so ``import flashpage.distributed`` stays light.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ring_flash_attn_func": "flashpage.distributed.ring",
    "ring_flash_attn_varlen_func": "flashpage.distributed.ring",
    "zigzag_ring_flash_attn_func": "flashpage.distributed.zigzag",
    "zigzag_ring_flash_attn_varlen_func": "flashpage.distributed.zigzag",
    "zigzag_split": "flashpage.distributed.zigzag",
    "zigzag_merge": "flashpage.distributed.zigzag",
    "varlen_split": "flashpage.distributed.zigzag",
    "varlen_merge": "flashpage.distributed.zigzag",
    "ColumnParallelLinear": "flashpage.distributed.tensor_parallel",
    "RowParallelLinear": "flashpage.distributed.tensor_parallel",
    "TensorParallel": "flashpage.distributed.tensor_parallel",
    "head_split": "flashpage.distributed.tensor_parallel",
    "shard_model_": "flashpage.distributed.tensor_parallel",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'flashpage.distributed' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted(__all__)
