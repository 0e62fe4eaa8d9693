"""Block manager semantics with exact block ids and refcounts; prefix cache; eviction; errors."""

from __future__ import annotations

import hashlib
import struct

import pytest

from flashpage.kv import ROOT_HASH, BlockManager, NoFreeBlocksError, hash_block_tokens


def refs(bm: BlockManager) -> list[int]:
    return [bm.ref_count(b) for b in range(bm.num_blocks)]


def toks(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def test_allocate_append_fork_cow_free_exact_ids() -> None:
    bm = BlockManager(num_blocks=8, block_size=16)
    assert bm.allocate(1, toks(0, 20)) == 0
    assert bm.block_table(1) == [0, 1] and bm.num_tokens(1) == 20
    assert refs(bm)[:3] == [1, 1, 0] and bm.num_free_blocks == 6
    u = bm.usage()
    assert (u.used_blocks, u.allocated_slots, u.used_slots, u.free_blocks) == (2, 32, 20, 6)
    assert u.waste_frac == pytest.approx(12 / 32) and u.usage_frac == pytest.approx(2 / 8)
    bm.check_integrity()

    # Filling the partial block needs no new block; the next token opens block 2.
    assert bm.append_slots(1, 12) == []
    assert bm.block_table(1) == [0, 1] and bm.num_tokens(1) == 32
    assert bm.append_slots(1) == []
    assert bm.block_table(1) == [0, 1, 2] and bm.num_tokens(1) == 33
    assert bm.slot_mapping(1, 30, 33) == [1 * 16 + 14, 1 * 16 + 15, 2 * 16 + 0]
    bm.check_integrity()

    # Fork shares every block.
    bm.fork(1, 2)
    assert bm.block_table(2) == [0, 1, 2] and bm.num_tokens(2) == 33
    assert refs(bm)[:4] == [2, 2, 2, 0]
    bm.check_integrity()

    # The child writes into the shared partial block 2: copy-on-write into fresh block 3.
    assert bm.can_append(2)
    assert bm.append_slots(2) == [(2, 3)]
    assert bm.block_table(2) == [0, 1, 3] and bm.num_tokens(2) == 34
    assert refs(bm)[:4] == [2, 2, 1, 1]
    # Now block 2 is the parent's alone: it writes in place.
    assert bm.append_slots(1) == []
    assert bm.block_table(1) == [0, 1, 2]
    bm.check_integrity()
    u = bm.usage()
    assert (u.used_blocks, u.allocated_slots, u.used_slots) == (4, 64, 32 + 2 + 2)

    # Free releases tail first; unhashed blocks return to the free list.
    bm.free(1)
    assert refs(bm)[:4] == [1, 1, 0, 1]
    assert not bm.has_seq(1) and bm.has_seq(2)
    bm.free(2)
    assert refs(bm) == [0] * 8 and bm.num_free_blocks == 8
    bm.check_integrity()
    # Whatever the release order (2, then 3, 1, 0), new blocks come lowest id first: one ascending run.
    assert bm.allocate(3, toks(100, 16 * 8)) == 0
    assert bm.block_table(3) == [0, 1, 2, 3, 4, 5, 6, 7]


def test_cow_multi_token_append_and_fork_at_block_boundary() -> None:
    bm = BlockManager(num_blocks=8, block_size=8)
    bm.allocate(1, toks(0, 16))  # exactly two full blocks
    bm.fork(1, 2)
    # Next write opens a new block: no copy, each gets its own.
    assert bm.append_slots(1, 3) == [] and bm.block_table(1) == [0, 1, 2]
    assert bm.append_slots(2, 10) == [] and bm.block_table(2) == [0, 1, 3, 4]
    assert refs(bm)[:5] == [2, 2, 1, 1, 1]
    bm.fork(2, 3)  # child of 2 shares its partial block 4 (2 tokens in it)
    # Multi-token append spanning the shared partial block and a new one: CoW first, then grow.
    assert bm.append_slots(3, 8) == [(4, 5)]
    assert bm.block_table(3) == [0, 1, 3, 5, 6] and bm.num_tokens(3) == 34
    assert refs(bm)[:7] == [3, 3, 1, 2, 1, 1, 1]
    bm.check_integrity()
    assert bm.append_slots(3, 0) == []


def test_prefix_hits_share_blocks_and_hit_rate() -> None:
    bs = 16
    bm = BlockManager(num_blocks=16, block_size=bs)
    prefix = toks(1000, 3 * bs)
    a = prefix + toks(0, 10)
    assert bm.allocate(1, a) == 0
    assert bm.block_table(1) == [0, 1, 2, 3]
    bm.commit(1, a)  # registers blocks 0, 1, 2 (block 3 is partial)
    assert [bm.is_cached(b) for b in range(4)] == [True, True, True, False]
    b = prefix + toks(500, 5)
    assert bm.can_allocate(b)
    assert bm.allocate(2, b) == 3 * bs
    assert bm.block_table(2) == [0, 1, 2, 4]
    assert refs(bm)[:5] == [2, 2, 2, 1, 1]
    assert bm.prefix_cache_hit_rate == pytest.approx(48 / (58 + 53))
    bm.check_integrity()
    u = bm.usage()
    # A block shared by two sequences counts once.
    assert (u.used_blocks, u.allocated_slots, u.used_slots) == (5, 80, 48 + 10 + 5)


def test_prefix_cap_keeps_one_token_to_compute() -> None:
    bs = 16
    bm = BlockManager(num_blocks=16, block_size=bs)
    prefix = toks(7, 3 * bs)
    bm.allocate(1, [*prefix, 1])
    bm.commit(1, [*prefix, 1])
    # Exactly the cached prefix: the last block is not reused (its last token must be computed).
    assert bm.allocate(2, prefix) == 2 * bs
    assert bm.block_table(2)[:2] == [0, 1] and bm.block_table(2)[2] != 2
    # One more token: all three blocks are reused.
    assert bm.allocate(3, [*prefix, 99]) == 3 * bs
    assert bm.block_table(3)[:3] == [0, 1, 2]
    # Short prompts never hit.
    assert bm.allocate(4, prefix[:bs]) == 0
    assert bm.allocate(5, prefix[: bs + 1]) == bs
    bm.check_integrity()


def test_hash_is_blake2b_of_parent_and_int64_tokens() -> None:
    # Stable across processes and runs (Python's hash() of str/bytes is salted; this is not).
    parent = hashlib.blake2b(struct.pack("<3q", 1, 2, 3), digest_size=16).digest()
    assert hash_block_tokens(ROOT_HASH, [1, 2, 3]) == parent
    assert parent.hex() == "abccad42d03c940bc2b249bf5a4e1e3d"
    child = hashlib.blake2b(parent + struct.pack("<2q", 4, 2**40), digest_size=16).digest()
    assert hash_block_tokens(parent, [4, 2**40]) == child


def test_hash_chain_depends_on_whole_prefix() -> None:
    bs = 8
    bm = BlockManager(num_blocks=16, block_size=bs)
    a = toks(0, 3 * bs + 1)
    bm.allocate(1, a)
    bm.commit(1, a)
    # Differs inside block 1: only block 0 is shared.
    b = list(a)
    b[bs + 3] = -5
    assert bm.allocate(2, b) == bs
    # Same tokens in blocks 1, 2 but a different block 0: nothing is shared.
    c = list(a)
    c[0] = 12345
    assert bm.allocate(3, c) == 0
    assert hash_block_tokens(ROOT_HASH, a[:bs]) != hash_block_tokens(ROOT_HASH, c[:bs])
    assert hash_block_tokens(b"x", [1, 2]) == hash_block_tokens(b"x", (1, 2))
    bm.check_integrity()


def test_commit_is_incremental_and_skips_duplicates() -> None:
    bs = 8
    bm = BlockManager(num_blocks=16, block_size=bs)
    a = toks(0, 20)
    # Two sequences compute the same prompt at the same time: the second copy stays unregistered.
    bm.allocate(1, a)
    bm.allocate(2, a)
    bm.commit(1, a[:5])  # nothing full yet
    assert not bm.is_cached(0)
    bm.commit(1, a[:12])  # block 0 full
    assert bm.is_cached(0) and not bm.is_cached(1)
    bm.commit(1, a)
    bm.commit(2, a)
    assert [bm.is_cached(b) for b in range(6)] == [True, True, False, False, False, False]
    bm.check_integrity()
    bm.free(2)  # its blocks are unregistered duplicates: straight to the free list
    assert bm.num_evictable_blocks == 0
    bm.free(1)
    assert bm.num_evictable_blocks == 2
    bm.check_integrity()
    bm.allocate(3, a[:4])
    with pytest.raises(ValueError, match="covers only"):
        bm.commit(3, a)


def test_commit_after_fork_is_consistent() -> None:
    bs = 8
    bm = BlockManager(num_blocks=16, block_size=bs)
    a = toks(0, 12)
    bm.allocate(1, a)
    bm.fork(1, 2)
    # Both extend the shared partial block 1 differently: the first writer gets a copy (CoW), the
    # second then owns block 1 alone and writes in place; commits register both versions.
    assert bm.append_slots(1, 4) == [(1, 2)]
    a1 = [*a, 100, 101, 102, 103]
    assert bm.append_slots(2, 4) == []
    a2 = [*a, 200, 201, 202, 203]
    bm.commit(1, a1)
    bm.commit(2, a2)
    assert bm.block_table(1) == [0, 2] and bm.block_table(2) == [0, 1]
    assert all(bm.is_cached(b) for b in (0, 1, 2))
    bm.check_integrity()
    bm.free(1)
    bm.free(2)
    assert bm.allocate(3, [*a2, 7]) == 16
    assert bm.block_table(3)[:2] == [0, 1]
    assert bm.allocate(4, [*a1, 7]) == 16
    assert bm.block_table(4)[:2] == [0, 2]
    bm.check_integrity()


def test_eviction_is_lru_and_revival() -> None:
    bs = 8
    bm = BlockManager(num_blocks=6, block_size=bs)
    x = toks(0, 17)
    y = toks(100, 17)
    bm.allocate(1, x)  # [0, 1, 2]
    bm.commit(1, x)  # registers 0, 1
    bm.allocate(2, y)  # [3, 4, 5]
    bm.commit(2, y)  # registers 3, 4
    bm.free(1)  # 2 -> free; 1, 0 -> evictable (tail first)
    bm.free(2)  # 5 -> free; 4, 3 -> evictable
    assert bm.num_free_blocks == 6 and bm.num_evictable_blocks == 4
    u = bm.usage()
    assert (u.used_blocks, u.cached_free_blocks, u.free_blocks) == (0, 4, 2)
    bm.check_integrity()
    # 4 new blocks: free list first (2, 5), then the least recently released cached blocks (1, 0).
    z = toks(500, 25)
    assert bm.allocate(3, z) == 0
    assert bm.block_table(3) == [2, 5, 1, 0]
    assert not bm.is_cached(0) and not bm.is_cached(1) and bm.num_evictable_blocks == 2
    bm.check_integrity()
    # x's prefix was evicted; y's is still cached and is revived from the LRU.
    assert bm.can_allocate(y) is False  # y needs 3 blocks: 2 hits (evictable) + 1 new, 0 left after revival
    bm.free(3)
    assert bm.allocate(4, y) == 2 * bs
    assert bm.block_table(4)[:2] == [3, 4] and bm.num_evictable_blocks == 0
    assert bm.allocate(5, x) == 0
    bm.check_integrity()


def test_lru_order_follows_release_time() -> None:
    bs = 8
    bm = BlockManager(num_blocks=4, block_size=bs)
    a, b = toks(0, 9), toks(50, 9)
    bm.allocate(1, a)  # [0, 1]
    bm.commit(1, a)
    bm.allocate(2, b)  # [2, 3]
    bm.commit(2, b)
    bm.free(1)  # 1 -> free, 0 -> evictable
    bm.free(2)  # 3 -> free, 2 -> evictable
    # Re-hit a's head (block 0) and release it again: now b's head (block 2) is the LRU.
    bm.allocate(3, a)
    assert bm.block_table(3) == [0, 1]
    bm.free(3)
    assert bm.allocate(4, toks(900, 24)) == 0
    assert bm.block_table(4) == [1, 3, 2]  # free blocks lowest id first, then the LRU cached one
    assert bm.is_cached(0) and not bm.is_cached(2)
    bm.check_integrity()


def test_can_allocate_counts_prefix_hits_as_free() -> None:
    bs = 8
    for caching, expect in [(True, True), (False, False)]:
        bm = BlockManager(num_blocks=4, block_size=bs, enable_prefix_caching=caching)
        a = toks(0, 17)
        bm.allocate(1, a)  # [0, 1, 2], one block free
        bm.commit(1, a)
        assert bm.num_free_blocks == 1
        b = a[:16] + toks(300, 8)  # 3 blocks, 2 of them cached and held by seq 1
        assert bm.can_allocate(b) is expect
        assert bm.can_allocate(b, num_lookahead=1) is False
        if expect:
            assert bm.allocate(2, b) == 16
            assert bm.block_table(2) == [0, 1, 3]
        else:
            with pytest.raises(NoFreeBlocksError):
                bm.allocate(2, b)
        bm.check_integrity()


def test_recompute_preemption_reuses_committed_blocks() -> None:
    bs = 8
    bm = BlockManager(num_blocks=8, block_size=bs)
    seq = toks(0, 10)
    bm.allocate(1, seq)
    bm.commit(1, seq)
    for t in range(15):  # decode to 25 tokens, committing as it goes
        bm.append_slots(1)
        seq.append(1000 + t)
        bm.commit(1, seq)
    table = bm.block_table(1)
    assert len(table) == 4 and bm.num_tokens(1) == 25
    bm.free(1)  # preempted: 3 full committed blocks stay cached
    assert bm.num_evictable_blocks == 3
    assert bm.allocate(1, seq) == 24  # resume: only the last token is recomputed
    assert bm.block_table(1)[:3] == table[:3]
    bm.check_integrity()


def test_reset_prefix_cache() -> None:
    bs = 8
    bm = BlockManager(num_blocks=8, block_size=bs)
    a = toks(0, 17)
    bm.allocate(1, a)
    bm.commit(1, a)
    bm.allocate(2, toks(40, 9))
    bm.commit(2, toks(40, 9))
    bm.free(2)
    assert bm.num_evictable_blocks == 1
    bm.reset_prefix_cache()
    bm.check_integrity()
    assert bm.num_evictable_blocks == 0 and bm.num_free_blocks == 5
    assert not any(bm.is_cached(b) for b in range(8))
    assert bm.allocate(3, a) == 0
    bm.free(1)
    bm.free(3)
    assert bm.num_free_blocks == 8
    bm.check_integrity()


def test_prefix_caching_disabled() -> None:
    bm = BlockManager(num_blocks=8, block_size=8, enable_prefix_caching=False)
    a = toks(0, 17)
    bm.allocate(1, a)
    bm.commit(1, a)
    assert not bm.is_cached(0)
    assert bm.allocate(2, a) == 0
    bm.free(1)
    assert bm.num_evictable_blocks == 0
    assert bm.prefix_cache_hit_rate == 0.0
    bm.check_integrity()


def test_errors() -> None:
    bm = BlockManager(num_blocks=4, block_size=8)
    with pytest.raises(NoFreeBlocksError, match="needs 5 new blocks"):
        bm.allocate(1, toks(0, 33))
    assert not bm.has_seq(1) and bm.num_free_blocks == 4
    bm.check_integrity()
    bm.allocate(1, toks(0, 32))
    with pytest.raises(ValueError, match="already allocated"):
        bm.allocate(1, toks(0, 3))
    assert not bm.can_append(1)
    with pytest.raises(NoFreeBlocksError, match="cannot append"):
        bm.append_slots(1)
    assert bm.num_tokens(1) == 32 and bm.block_table(1) == [0, 1, 2, 3]
    bm.check_integrity()
    for call in (
        lambda: bm.block_table(7),
        lambda: bm.num_tokens(7),
        lambda: bm.append_slots(7),
        lambda: bm.can_append(7),
        lambda: bm.commit(7, [1]),
        lambda: bm.fork(7, 8),
        lambda: bm.free(7),
    ):
        with pytest.raises(KeyError, match="unknown sequence 7"):
            call()
    with pytest.raises(ValueError, match="already allocated"):
        bm.fork(1, 1)
    with pytest.raises(ValueError, match="empty"):
        bm.allocate(9, [])
    assert bm.can_allocate([]) is False
    with pytest.raises(ValueError, match="num_new_tokens"):
        bm.append_slots(1, -1)
    with pytest.raises(ValueError, match="start"):
        bm.slot_mapping(1, 0, 33)
    bm.free(1)
    with pytest.raises(KeyError, match="already freed"):
        bm.free(1)


@pytest.mark.parametrize("bs", [0, 4, 12, 300, 512])
def test_bad_block_size(bs: int) -> None:
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(num_blocks=4, block_size=bs)


def test_bad_num_blocks() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(num_blocks=0, block_size=16)


def _corrupt_refcount(bm: BlockManager) -> None:
    bm._ref[0] += 1


def _corrupt_refcount_to_zero(bm: BlockManager) -> None:
    bm._ref[1] = 0


def _corrupt_free_list(bm: BlockManager) -> None:
    bm._free.append(0)  # a referenced block also on the free list


def _corrupt_lost_block(bm: BlockManager) -> None:
    bm._free.pop()  # a block in none of the pools


def _corrupt_hash_map(bm: BlockManager) -> None:
    h = next(iter(bm._hash_to_block))
    bm._hash_to_block[h] = 5


def _corrupt_block_hash(bm: BlockManager) -> None:
    bm._hash[2] = None  # evictable block that lost its hash


def _corrupt_table(bm: BlockManager) -> None:
    bm._seqs[1].blocks.append(6)  # table longer than its tokens need, block 6 not refcounted


def _corrupt_tokens(bm: BlockManager) -> None:
    prev, tokens = bm._key[0]  # type: ignore[misc]
    bm._key[0] = (prev, (tokens[0] + 1, *tokens[1:]))


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (_corrupt_refcount, "refcount 2 but held by 1"),
        (_corrupt_refcount_to_zero, "refcount 0 but held by 1"),
        (_corrupt_free_list, "exactly one of"),
        (_corrupt_lost_block, "exactly one of"),
        (_corrupt_hash_map, "hash maps to block 5"),
        (_corrupt_block_hash, "evictable but not registered"),
        (_corrupt_table, "blocks for 9 tokens"),
        (_corrupt_tokens, "do not match its hash"),
    ],
)
def test_check_integrity_detects_corruption(corrupt, message: str) -> None:  # type: ignore[no-untyped-def]
    bs = 8
    bm = BlockManager(num_blocks=8, block_size=bs)
    a = toks(0, 9)
    bm.allocate(1, a)  # [0, 1]
    bm.commit(1, a)  # block 0 registered
    bm.allocate(2, toks(50, 9))  # [2, 3]
    bm.commit(2, toks(50, 9))
    bm.free(2)  # 3 free, 2 evictable
    bm.check_integrity()
    corrupt(bm)
    with pytest.raises(RuntimeError, match=message):
        bm.check_integrity()


def test_fresh_blocks_lowest_id_first_after_churn() -> None:
    # Released blocks come back in scattered order (tails first, sequences in any order); new tables
    # still come out ascending, in runs of consecutive ids (paged decode reads those faster).
    bm = BlockManager(num_blocks=16, block_size=8, enable_prefix_caching=False)
    for s in range(4):
        bm.allocate(s, toks(100 * s, 32))  # seq s holds [4s .. 4s+3]
    bm.free(2)
    bm.free(0)
    assert bm.allocate(9, toks(900, 64)) == 0
    assert bm.block_table(9) == [0, 1, 2, 3, 8, 9, 10, 11]
    bm.free(3)
    bm.append_slots(1, 8)  # seq 1 grows into the lowest free block
    assert bm.block_table(1) == [4, 5, 6, 7, 12]
    bm.check_integrity()
