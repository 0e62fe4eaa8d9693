"""Sequence-parallel (ring / zigzag) FlashAttention over ``torch.distributed`` and the network probe.

``from flashpage.distributed import ring_flash_attn_func, zigzag_ring_flash_attn_func, zigzag_split,
zigzag_merge`` (and the ``*_varlen_func`` variants with ``varlen_split`` / ``varlen_merge``).
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
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'flashpage.distributed' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted(__all__)
