"""The one paged KV cache layout of flashpage (see also ``docs/kv-layout.md``).

Every kernel, the engine's model runner and the block manager use exactly this layout.

Physical storage, per transformer layer ``l``::

    k_cache[l], v_cache[l] : (num_blocks, block_size, nheads_k, head_dim)   contiguous, same dtype

A *block* (page) holds the K (resp. V) vectors of ``block_size`` consecutive tokens of one sequence,
for all ``nheads_k`` KV heads. ``block_size`` is a power of two from 8 to 256. Block ids are shared
by all layers: block ``b`` of a sequence means ``k_cache[l][b]`` and ``v_cache[l][b]`` in every layer,
so one block id is ``bytes_per_block = 2 * num_layers * block_size * nheads_k * head_dim * itemsize``
bytes of memory.

Logical view, per step::

    block_table   : (batch, max_blocks_per_seq) int32   physical block id of logical block j of seq b
    cache_seqlens : (batch,) int32                      tokens of seq b held in the cache

Token ``t`` of sequence ``b`` lives in block ``block_table[b, t // block_size]`` at offset
``t % block_size``. Its *flat slot* is::

    slot = block_table[b, t // block_size] * block_size + t % block_size

which indexes ``k_cache.view(num_blocks * block_size, nheads_k, head_dim)[slot]``. Slot mappings
(one flat slot per new token, int64, ``-1`` = skip the write) drive the cache-write kernel.
Entries of a block-table row past ``ceil(cache_seqlens[b] / block_size)`` are padding (never read).

The helpers here are host-side utilities (allocation, table building, CoW block copies); the block
manager (:mod:`flashpage.kv.block_manager`) decides which block ids a sequence owns.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "MAX_BLOCK_SIZE",
    "MIN_BLOCK_SIZE",
    "KVCacheSpec",
    "allocate_kv_cache",
    "build_block_table",
    "build_cache_seqlens",
    "copy_blocks",
    "num_blocks_for_bytes",
    "slot_mapping",
    "validate_block_size",
]

MIN_BLOCK_SIZE = 8
MAX_BLOCK_SIZE = 256

# fp32/fp16/bf16 for compute-precision caches, fp8 for the quantised KV storage option.
_CACHE_DTYPES: tuple[torch.dtype, ...] = tuple(
    dt
    for dt in (
        torch.float32,
        torch.float16,
        torch.bfloat16,
        getattr(torch, "float8_e4m3fn", None),
        getattr(torch, "float8_e5m2", None),
    )
    if dt is not None
)


def validate_block_size(block_size: int) -> int:
    """Return ``block_size`` if it is a power of two in ``[8, 256]``, else raise ``ValueError``."""
    if (
        isinstance(block_size, bool)
        or not isinstance(block_size, int)
        or block_size < MIN_BLOCK_SIZE
        or block_size > MAX_BLOCK_SIZE
        or block_size & (block_size - 1)
    ):
        raise ValueError(
            f"block_size must be a power of two from {MIN_BLOCK_SIZE} to {MAX_BLOCK_SIZE}, got {block_size!r}"
        )
    return block_size


def _positive_int(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _bytes_per_block(
    num_layers: int, block_size: int, nheads_k: int, head_dim: int, dtype: torch.dtype
) -> int:
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * nheads_k * head_dim * itemsize


@dataclass(frozen=True)
class KVCacheSpec:
    """Shape of the whole paged KV cache of a model (all layers).

    Attributes:
        num_layers: transformer layers (each has its own K and V cache tensors).
        num_blocks: physical blocks per layer; block ids are ``0 .. num_blocks-1``.
        block_size: tokens per block, a power of two in ``[8, 256]``.
        nheads_k: KV heads.
        head_dim: head dimension ``d``.
        dtype: storage dtype (fp32, fp16, bf16, or fp8 e4m3/e5m2).
    """

    num_layers: int
    num_blocks: int
    block_size: int
    nheads_k: int
    head_dim: int
    dtype: torch.dtype = torch.float16

    def __post_init__(self) -> None:
        _positive_int("num_layers", self.num_layers)
        _positive_int("num_blocks", self.num_blocks)
        validate_block_size(self.block_size)
        _positive_int("nheads_k", self.nheads_k)
        _positive_int("head_dim", self.head_dim)
        if self.dtype not in _CACHE_DTYPES:
            raise TypeError(f"dtype must be one of {_CACHE_DTYPES}, got {self.dtype!r}")

    @property
    def block_shape(self) -> tuple[int, int, int, int]:
        """Shape of one layer's K (or V) cache: ``(num_blocks, block_size, nheads_k, head_dim)``."""
        return (self.num_blocks, self.block_size, self.nheads_k, self.head_dim)

    @property
    def bytes_per_block(self) -> int:
        """Bytes behind one block id: K and V, all layers."""
        return _bytes_per_block(self.num_layers, self.block_size, self.nheads_k, self.head_dim, self.dtype)

    @property
    def bytes_per_token(self) -> int:
        """KV bytes of one token (K and V, all layers)."""
        return self.bytes_per_block // self.block_size

    @property
    def total_bytes(self) -> int:
        """Bytes of the whole cache."""
        return self.num_blocks * self.bytes_per_block

    @property
    def num_slots(self) -> int:
        """Token slots in the cache: ``num_blocks * block_size``."""
        return self.num_blocks * self.block_size

    @classmethod
    def num_blocks_for_bytes(
        cls,
        num_bytes: int,
        num_layers: int,
        block_size: int,
        nheads_k: int,
        head_dim: int,
        dtype: torch.dtype = torch.float16,
    ) -> int:
        """Largest number of blocks whose K+V caches (all layers) fit in ``num_bytes``."""
        return num_blocks_for_bytes(num_bytes, num_layers, block_size, nheads_k, head_dim, dtype)

    @classmethod
    def from_bytes(
        cls,
        num_bytes: int,
        num_layers: int,
        block_size: int,
        nheads_k: int,
        head_dim: int,
        dtype: torch.dtype = torch.float16,
    ) -> KVCacheSpec:
        """Spec of the largest cache that fits in ``num_bytes`` (raises ``ValueError`` if not one block)."""
        n = num_blocks_for_bytes(num_bytes, num_layers, block_size, nheads_k, head_dim, dtype)
        if n < 1:
            raise ValueError(f"num_bytes={num_bytes} is smaller than one KV block")
        return cls(num_layers, n, block_size, nheads_k, head_dim, dtype)


def num_blocks_for_bytes(
    num_bytes: int,
    num_layers: int,
    block_size: int,
    nheads_k: int,
    head_dim: int,
    dtype: torch.dtype = torch.float16,
) -> int:
    """Largest number of blocks whose K+V caches (all ``num_layers`` layers) fit in ``num_bytes``."""
    if isinstance(num_bytes, bool) or not isinstance(num_bytes, int) or num_bytes < 0:
        raise ValueError(f"num_bytes must be a non-negative int, got {num_bytes!r}")
    _positive_int("num_layers", num_layers)
    validate_block_size(block_size)
    _positive_int("nheads_k", nheads_k)
    _positive_int("head_dim", head_dim)
    return num_bytes // _bytes_per_block(num_layers, block_size, nheads_k, head_dim, dtype)


def allocate_kv_cache(spec: KVCacheSpec, device: torch.device | str = "cpu") -> list[tuple[Tensor, Tensor]]:
    """Allocate the paged cache: one ``(k_cache, v_cache)`` pair per layer.

    Each tensor is ``(num_blocks, block_size, nheads_k, head_dim)`` in ``spec.dtype``, contiguous; all
    of them are views of one allocation (no fragmentation between layers). Memory is zeroed, so
    kernels that load (and mask) slots not yet written never see NaN/Inf (``0 * NaN`` is NaN).
    """
    if not isinstance(spec, KVCacheSpec):
        raise TypeError(f"spec must be a KVCacheSpec, got {type(spec).__name__}")
    storage = torch.zeros((spec.num_layers, 2, *spec.block_shape), dtype=spec.dtype, device=device)
    return [(storage[layer, 0], storage[layer, 1]) for layer in range(spec.num_layers)]


def slot_mapping(block_table_row: Sequence[int], start: int, end: int, block_size: int) -> list[int]:
    """Flat cache slots of token positions ``start .. end-1`` of one sequence.

    Args:
        block_table_row: the sequence's physical block ids (logical block order).
        start, end: token range, ``0 <= start <= end <= len(block_table_row) * block_size``.
        block_size: tokens per block.
    Returns:
        ``end - start`` ints, ``block_table_row[t // block_size] * block_size + t % block_size``.
    """
    validate_block_size(block_size)
    if not 0 <= start <= end:
        raise ValueError(f"need 0 <= start <= end, got start={start}, end={end}")
    if end > len(block_table_row) * block_size:
        raise ValueError(
            f"end={end} exceeds the {len(block_table_row)} blocks of the table row "
            f"({len(block_table_row) * block_size} tokens at block_size={block_size})"
        )
    return [block_table_row[t // block_size] * block_size + t % block_size for t in range(start, end)]


def build_block_table(
    tables: Sequence[Sequence[int]],
    pad: int = 0,
    max_blocks_per_seq: int | None = None,
    device: torch.device | str = "cpu",
) -> Tensor:
    """Pack per-sequence block lists into a ``(batch, max_blocks_per_seq)`` int32 tensor.

    Rows shorter than the width are right-padded with ``pad`` (a valid block id, so a kernel that
    over-reads stays in bounds; padded entries are never used for tokens below ``cache_seqlens``).
    ``max_blocks_per_seq`` fixes the width (e.g. for CUDA-graph capture); default: longest row.
    """
    width = max((len(t) for t in tables), default=0)
    if max_blocks_per_seq is not None:
        if max_blocks_per_seq < width:
            raise ValueError(
                f"max_blocks_per_seq={max_blocks_per_seq} is less than the longest row ({width})"
            )
        width = max_blocks_per_seq
    rows = [list(t) + [pad] * (width - len(t)) for t in tables]
    if rows and width:
        return torch.tensor(rows, dtype=torch.int32, device=device)
    return torch.full((len(rows), width), pad, dtype=torch.int32, device=device)


def build_cache_seqlens(seqlens: Sequence[int], device: torch.device | str = "cpu") -> Tensor:
    """``(batch,)`` int32 ``cache_seqlens`` tensor."""
    return torch.tensor(list(seqlens), dtype=torch.int32, device=device)


def copy_blocks(kv_caches: Sequence[tuple[Tensor, Tensor]], copies: Sequence[tuple[int, int]]) -> None:
    """Do the copy-on-write block copies returned by ``BlockManager.append_slots``, in every layer.

    Args:
        kv_caches: per layer ``(k_cache, v_cache)``, each ``(num_blocks, block_size, nheads_k, d)``.
        copies: ``(src, dst)`` block ids; all ``dst`` distinct and none of them a ``src`` (the block
            manager guarantees that: destinations are freshly allocated blocks).
    """
    if not copies:
        return
    srcs = [s for s, _ in copies]
    dsts = [d for _, d in copies]
    if len(set(dsts)) != len(dsts) or set(dsts) & set(srcs):
        raise ValueError(f"copies must have distinct destinations that are not sources, got {list(copies)}")
    for k_cache, v_cache in kv_caches:
        src = torch.tensor(srcs, dtype=torch.long, device=k_cache.device)
        dst = torch.tensor(dsts, dtype=torch.long, device=k_cache.device)
        k_cache.index_copy_(0, dst, k_cache.index_select(0, src))
        v_cache.index_copy_(0, dst, v_cache.index_select(0, src))
