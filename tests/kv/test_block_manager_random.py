"""Randomized block-manager test: thousands of operations, integrity checked after every one.

Besides ``check_integrity()``, the test keeps a simulated cache: each slot stores a fingerprint of
the whole token prefix ending at that position (what real KV depends on). Writes go through the
block tables and the copy-on-write copies the manager returns; after every operation every
sequence's written tokens must read back their own fingerprints. This catches a prefix-cache hit on
wrong content, a missed copy-on-write (a write into a block someone else reads) and a block handed
out twice.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from flashpage.kv import BlockManager, NoFreeBlocksError


@dataclass
class _Seq:
    tokens: list[int]
    written: int  # leading tokens whose KV is in the cache
    fps: list[int] = field(default_factory=list)  # prefix fingerprint per position


def _fingerprints(tokens: list[int]) -> list[int]:
    out: list[int] = []
    h = 0
    for t in tokens:
        h = hash((h, t))
        out.append(h)
    return out


class _Sim:
    def __init__(self, rng: random.Random, num_blocks: int, block_size: int, caching: bool) -> None:
        self.rng = rng
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching=caching)
        self.bs = block_size
        self.cache: dict[int, int] = {}  # flat slot -> fingerprint
        self.seqs: dict[int, _Seq] = {}
        self.next_id = 0
        # A few shared "system prompts" so that prefixes really repeat.
        self.prefixes = [
            [rng.randrange(50) for _ in range(rng.randrange(1, 5 * block_size))] for _ in range(4)
        ]
        self.hits = 0

    def _write(self, sid: int, start: int, end: int) -> None:
        s = self.seqs[sid]
        table = self.bm.block_table(sid)
        for t in range(start, end):
            b = table[t // self.bs]
            # Only the sole owner may write a block: a shared one must have been copied first.
            assert self.bm.ref_count(b) == 1, f"write into shared block {b}"
            assert not self.bm.is_cached(b), f"write into cached block {b}"
            self.cache[b * self.bs + t % self.bs] = s.fps[t]
        s.written = end

    def verify(self) -> None:
        self.bm.check_integrity()
        for sid, s in self.seqs.items():
            assert self.bm.num_tokens(sid) == len(s.tokens)
            slots = self.bm.slot_mapping(sid, 0, s.written)
            assert [self.cache.get(x) for x in slots] == s.fps[: s.written], f"seq {sid} reads wrong KV"

    def _new_tokens(self) -> list[int]:
        rng = self.rng
        head = list(rng.choice(self.prefixes)) if rng.random() < 0.7 else []
        return head + [rng.randrange(50) for _ in range(rng.randrange(1, 3 * self.bs))]

    def allocate(self, sid: int, tokens: list[int]) -> None:
        if not self.bm.can_allocate(tokens):
            with pytest.raises(NoFreeBlocksError):
                self.bm.allocate(sid, tokens)
            return
        cached = self.bm.allocate(sid, tokens)
        assert cached % self.bs == 0 and 0 <= cached <= len(tokens) - 1
        self.hits += cached > 0
        self.seqs[sid] = _Seq(tokens, cached, _fingerprints(tokens))

    def step(self) -> None:
        rng = self.rng
        op = rng.random()
        ids = list(self.seqs)
        if op < 0.22 or not ids:  # new request
            self.allocate(self.next_id, self._new_tokens())
            self.next_id += 1
            return
        sid = rng.choice(ids)
        s = self.seqs[sid]
        if s.written < len(s.tokens):  # (chunked) prefill
            end = min(len(s.tokens), s.written + rng.randrange(1, 2 * self.bs))
            self._write(sid, s.written, end)
            self.bm.commit(sid, s.tokens[: s.written])
        elif op < 0.70:  # decode 1..3 tokens
            n = rng.choice([1, 1, 1, 2, 3])
            if not self.bm.can_append(sid, n):
                with pytest.raises(NoFreeBlocksError):
                    self.bm.append_slots(sid, n)
                return
            for src, dst in self.bm.append_slots(sid, n):
                for o in range(self.bs):  # the runner's copy_blocks
                    if src * self.bs + o in self.cache:
                        self.cache[dst * self.bs + o] = self.cache[src * self.bs + o]
            start = len(s.tokens)
            s.tokens.extend(rng.randrange(50) for _ in range(n))
            s.fps = _fingerprints(s.tokens)
            self._write(sid, start, len(s.tokens))
            self.bm.commit(sid, s.tokens)
        elif op < 0.78:  # fork (n > 1 sampling)
            child = self.next_id
            self.next_id += 1
            self.bm.fork(sid, child)
            self.seqs[child] = _Seq(list(s.tokens), s.written, list(s.fps))
        elif op < 0.93:  # finish
            self.bm.free(sid)
            del self.seqs[sid]
        elif op < 0.995:  # recompute preemption: free, then re-allocate the whole token list
            self.bm.free(sid)
            del self.seqs[sid]
            self.allocate(sid, s.tokens)
        else:
            self.bm.reset_prefix_cache()


@pytest.mark.parametrize(
    ("seed", "num_blocks", "block_size", "caching", "ops"),
    [(0, 48, 8, True, 3000), (1, 96, 16, True, 2000), (2, 40, 8, False, 1500)],
)
def test_random_operations_keep_integrity(
    seed: int, num_blocks: int, block_size: int, caching: bool, ops: int
) -> None:
    sim = _Sim(random.Random(seed), num_blocks, block_size, caching)
    for _ in range(ops):
        sim.step()
        sim.verify()
    if caching:
        assert sim.hits > 20, "the workload should exercise prefix-cache hits"
        assert sim.bm.prefix_cache_hit_rate > 0
    for sid in list(sim.seqs):
        sim.bm.free(sid)
        del sim.seqs[sid]
        sim.verify()
    bm = sim.bm
    assert bm.num_free_blocks == num_blocks
    assert all(bm.ref_count(b) == 0 for b in range(num_blocks))
    u = bm.usage()
    assert u.used_blocks == 0 and u.free_blocks + u.cached_free_blocks == num_blocks
    bm.reset_prefix_cache()
    bm.check_integrity()
    assert bm.usage().free_blocks == num_blocks
