"""Page layout helpers: spec validation, sizing, allocation, slot mapping, block tables, CoW copies."""

from __future__ import annotations

import pytest
import torch

from flashpage.kv import (
    KVCacheSpec,
    allocate_kv_cache,
    build_block_table,
    build_cache_seqlens,
    copy_blocks,
    num_blocks_for_bytes,
    slot_mapping,
)
from flashpage.ops.reference import gather_paged_kv


@pytest.mark.parametrize("bs", [8, 16, 32, 64, 128, 256])
def test_spec_accepts_power_of_two_block_sizes(bs: int) -> None:
    spec = KVCacheSpec(
        num_layers=2, num_blocks=3, block_size=bs, nheads_k=4, head_dim=32, dtype=torch.bfloat16
    )
    assert spec.block_shape == (3, bs, 4, 32)
    # K and V, 2 layers, bs tokens, 4 heads x 32 dims, 2 bytes each.
    assert spec.bytes_per_block == 2 * 2 * bs * 4 * 32 * 2
    assert spec.bytes_per_token == 2 * 2 * 4 * 32 * 2
    assert spec.total_bytes == 3 * spec.bytes_per_block
    assert spec.num_slots == 3 * bs


@pytest.mark.parametrize("bs", [0, 4, 7, 12, 24, 512, -16])
def test_spec_rejects_bad_block_size(bs: int) -> None:
    with pytest.raises(ValueError, match="block_size"):
        KVCacheSpec(num_layers=1, num_blocks=1, block_size=bs, nheads_k=1, head_dim=32)


@pytest.mark.parametrize(
    ("field", "value"), [("num_layers", 0), ("num_blocks", 0), ("nheads_k", -1), ("head_dim", 0)]
)
def test_spec_rejects_bad_sizes(field: str, value: int) -> None:
    kwargs = dict(num_layers=1, num_blocks=1, block_size=16, nheads_k=1, head_dim=32)
    kwargs[field] = value
    with pytest.raises(ValueError, match=field):
        KVCacheSpec(**kwargs)  # type: ignore[arg-type]


def test_spec_rejects_bad_dtype() -> None:
    with pytest.raises(TypeError, match="dtype"):
        KVCacheSpec(num_layers=1, num_blocks=1, block_size=16, nheads_k=1, head_dim=32, dtype=torch.int32)


def test_num_blocks_for_bytes() -> None:
    # fp16, 4 layers, bs 16, 2 heads, d 64: 2*4*16*2*64*2 = 32768 bytes per block.
    per_block = 2 * 4 * 16 * 2 * 64 * 2
    assert num_blocks_for_bytes(10 * per_block + per_block - 1, 4, 16, 2, 64, torch.float16) == 10
    assert KVCacheSpec.num_blocks_for_bytes(per_block - 1, 4, 16, 2, 64, torch.float16) == 0
    spec = KVCacheSpec.from_bytes(7 * per_block, 4, 16, 2, 64, torch.float16)
    assert spec.num_blocks == 7 and spec.bytes_per_block == per_block
    assert num_blocks_for_bytes(per_block, 4, 16, 2, 64, torch.float32) == 0
    with pytest.raises(ValueError, match="one KV block"):
        KVCacheSpec.from_bytes(per_block - 1, 4, 16, 2, 64, torch.float16)
    with pytest.raises(ValueError, match="block_size"):
        num_blocks_for_bytes(per_block, 4, 10, 2, 64)


def test_allocate_kv_cache_shapes_and_independence() -> None:
    spec = KVCacheSpec(num_layers=3, num_blocks=5, block_size=8, nheads_k=2, head_dim=32, dtype=torch.float32)
    caches = allocate_kv_cache(spec, "cpu")
    assert len(caches) == 3
    for k, v in caches:
        assert k.shape == v.shape == (5, 8, 2, 32)
        assert k.dtype == v.dtype == torch.float32
        assert k.is_contiguous() and v.is_contiguous()
        assert torch.count_nonzero(k) == 0 and torch.count_nonzero(v) == 0
    # Writing one layer's K must not touch any other tensor.
    caches[1][0].fill_(1.0)
    assert caches[1][0].sum() == 5 * 8 * 2 * 32
    for i, (k, v) in enumerate(caches):
        if i != 1:
            assert k.sum() == 0
        assert v.sum() == 0


def test_slot_mapping_matches_layout_and_gather() -> None:
    bs = 8
    row = [5, 2, 7]
    slots = slot_mapping(row, 3, 20, bs)
    assert slots == [row[t // bs] * bs + t % bs for t in range(3, 20)]
    assert slots[:5] == [43, 44, 45, 46, 47] and slots[5] == 16
    # The flat slot indexes cache.view(-1, h, d); gathering through the block table agrees.
    cache = torch.randn(9, bs, 2, 4)
    table = build_block_table([row])
    gathered = gather_paged_kv(cache, table, 20, 0)
    flat = cache.view(-1, 2, 4)
    torch.testing.assert_close(flat[torch.tensor(slot_mapping(row, 0, 20, bs))], gathered)
    assert slot_mapping(row, 4, 4, bs) == []
    with pytest.raises(ValueError, match="exceeds"):
        slot_mapping(row, 0, 25, bs)
    with pytest.raises(ValueError, match="start"):
        slot_mapping(row, 5, 4, bs)


def test_build_block_table_pads_and_is_int32() -> None:
    t = build_block_table([[3, 1], [4], [1, 5, 9]], pad=0)
    assert t.dtype == torch.int32
    assert t.tolist() == [[3, 1, 0], [4, 0, 0], [1, 5, 9]]
    t = build_block_table([[3]], pad=7, max_blocks_per_seq=4)
    assert t.tolist() == [[3, 7, 7, 7]]
    assert build_block_table([]).shape == (0, 0)
    assert build_block_table([[], []], max_blocks_per_seq=2).tolist() == [[0, 0], [0, 0]]
    with pytest.raises(ValueError, match="max_blocks_per_seq"):
        build_block_table([[1, 2, 3]], max_blocks_per_seq=2)
    s = build_cache_seqlens([5, 1])
    assert s.dtype == torch.int32 and s.tolist() == [5, 1]


def test_copy_blocks_all_layers() -> None:
    spec = KVCacheSpec(num_layers=2, num_blocks=6, block_size=8, nheads_k=1, head_dim=32, dtype=torch.float32)
    caches = allocate_kv_cache(spec)
    for k, v in caches:
        k.copy_(torch.randn_like(k))
        v.copy_(torch.randn_like(v))
    before = [(k.clone(), v.clone()) for k, v in caches]
    copy_blocks(caches, [(1, 4), (2, 5)])
    for (k, v), (k0, v0) in zip(caches, before):
        for src, dst in [(1, 4), (2, 5)]:
            torch.testing.assert_close(k[dst], k0[src])
            torch.testing.assert_close(v[dst], v0[src])
        torch.testing.assert_close(k[:4], k0[:4])
        torch.testing.assert_close(v[:4], v0[:4])
    with pytest.raises(ValueError, match="distinct"):
        copy_blocks(caches, [(1, 4), (4, 5)])
    copy_blocks(caches, [])
