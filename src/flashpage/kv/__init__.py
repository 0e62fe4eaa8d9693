"""Paged KV cache: the one page layout (:mod:`flashpage.kv.layout`) and the block manager.

See ``docs/kv-layout.md`` for the picture and the block lifecycle.
"""

from flashpage.kv.block_manager import ROOT_HASH, BlockManager, KVUsage, NoFreeBlocksError, hash_block_tokens
from flashpage.kv.layout import (
    MAX_BLOCK_SIZE,
    MIN_BLOCK_SIZE,
    KVCacheSpec,
    allocate_kv_cache,
    build_block_table,
    build_cache_seqlens,
    copy_blocks,
    num_blocks_for_bytes,
    slot_mapping,
    validate_block_size,
)

__all__ = [
    "MAX_BLOCK_SIZE",
    "MIN_BLOCK_SIZE",
    "ROOT_HASH",
    "BlockManager",
    "KVCacheSpec",
    "KVUsage",
    "NoFreeBlocksError",
    "allocate_kv_cache",
    "build_block_table",
    "build_cache_seqlens",
    "copy_blocks",
    "hash_block_tokens",
    "num_blocks_for_bytes",
    "slot_mapping",
    "validate_block_size",
]
