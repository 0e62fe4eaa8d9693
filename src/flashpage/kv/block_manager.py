"""Block manager: which physical KV blocks each sequence owns (pure Python, no torch).

Layout of the blocks themselves: :mod:`flashpage.kv.layout`. Lifecycle (``docs/kv-layout.md``):

* **allocate(seq, prompt)** gives a new sequence a block table covering its prompt. With prefix
  caching, the prompt's full blocks are looked up by *hash chain* (block ``i``'s hash is
  ``H(hash of block i-1, token ids of block i)``, so a hash identifies the whole prefix up to and
  including the block); hit blocks are shared (refcount + 1) instead of recomputed. The number of
  cached tokens returned is a multiple of ``block_size`` and at most ``len(prompt) - 1``: at least one
  token is always computed, because the engine needs the logits of the last prompt token.
* **append_slots(seq, n)** grows the table before the runner writes ``n`` more tokens. If the block
  that will be written is shared (refcount > 1, after :meth:`BlockManager.fork`), it is
  *copy-on-write*: the sequence gets a fresh block and the call returns ``(src, dst)`` pairs that the
  runner copies (``flashpage.kv.layout.copy_blocks``) before writing.
* **commit(seq, tokens)** after the KV of ``tokens`` is in the cache: every newly full block is
  registered in the prefix cache under its chain hash.
* **free(seq)** drops the sequence's references. A block whose refcount reaches 0 goes to the free
  list, or, if it is registered in the prefix cache, to the *evictable* LRU: it keeps its content and
  hash until the free list is empty and the block is needed, so a later request with the same prefix
  revives it. Eviction takes the least recently freed block first; a sequence's blocks are released
  tail first, so shared prefix heads outlive the tails.
* **Recompute preemption** (no swapping): to preempt a sequence the scheduler calls ``free(seq)``;
  to resume it, ``allocate(seq, prompt + generated tokens)`` again. Its committed blocks sit in the
  evictable LRU (or are still shared), so the recompute only runs the blocks that were evicted in
  between plus the last (partial) one.

Invariants (:meth:`BlockManager.check_integrity`): every block is in exactly one of *free*,
*evictable* (refcount 0, hashed) or *referenced* (refcount > 0); a block's refcount equals the number
of sequence tables that hold it; the hash map and the per-block hashes are a bijection.
"""

from __future__ import annotations

import hashlib
import heapq
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["ROOT_HASH", "BlockManager", "KVUsage", "NoFreeBlocksError", "hash_block_tokens"]

# Hash of the (empty) prefix before the first block.
ROOT_HASH = b""


def hash_block_tokens(prev_hash: bytes, token_ids: Sequence[int]) -> bytes:
    """Chain hash of a full block: 128-bit BLAKE2b of the previous block's hash and the token ids.

    Deterministic across processes (unlike ``hash()`` of a tuple, which is salted for str/bytes) and
    collision-free in practice; lookups additionally verify the tokens and the parent hash.
    """
    h = hashlib.blake2b(prev_hash, digest_size=16)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


class NoFreeBlocksError(RuntimeError):
    """Not enough free (or evictable) blocks for the request; check ``can_allocate``/``can_append``."""


@dataclass
class KVUsage:
    """Snapshot of the cache occupancy.

    Attributes:
        num_blocks: blocks in the cache.
        used_blocks: blocks referenced by at least one sequence (a shared block counts once).
        cached_free_blocks: unreferenced blocks kept for the prefix cache (evictable).
        free_blocks: blocks holding nothing.
        allocated_slots: ``used_blocks * block_size``.
        used_slots: slots of referenced blocks that hold a token covered by a sequence's table.
    """

    num_blocks: int
    used_blocks: int
    cached_free_blocks: int
    free_blocks: int
    allocated_slots: int
    used_slots: int

    @property
    def waste_frac(self) -> float:
        """Fraction of allocated slots holding no token (0 when nothing is allocated)."""
        if self.allocated_slots == 0:
            return 0.0
        return 1.0 - self.used_slots / self.allocated_slots

    @property
    def usage_frac(self) -> float:
        """Fraction of blocks referenced by sequences."""
        return self.used_blocks / self.num_blocks


@dataclass
class _SeqState:
    """Per-sequence block table and prefix-cache progress."""

    blocks: list[int] = field(default_factory=list)
    num_tokens: int = 0
    # Leading blocks whose chain hash has been computed (registered, or skipped as a duplicate);
    # ``last_hash`` is the chain hash of block ``num_hashed - 1`` (ROOT_HASH when 0).
    num_hashed: int = 0
    last_hash: bytes = ROOT_HASH


class BlockManager:
    """Allocates KV blocks to sequences with refcounts, copy-on-write and a prefix cache.

    Block ids are ``0 .. num_blocks-1``; a fresh block is the lowest free id, an evictable cached
    block only when nothing is free (least recently released first). Lowest-id-first keeps a
    sequence's blocks in ascending, mostly consecutive runs even after many sequences have come and
    gone, where a FIFO free list hands out blocks in the (scattered) order they were freed: paged
    decode reads randomly ordered pages ~1% slower (H200, block size 16,
    ``benchmarks/probes/decode_page_order.py``).

    Args:
        num_blocks: physical blocks in the cache.
        block_size: tokens per block (power of two in ``[8, 256]``).
        enable_prefix_caching: reuse full blocks with the same token prefix across sequences.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        if (
            isinstance(block_size, bool)
            or not isinstance(block_size, int)
            or not 8 <= block_size <= 256
            or block_size & (block_size - 1)
        ):
            raise ValueError(f"block_size must be a power of two from 8 to 256, got {block_size!r}")
        self.num_blocks: int = num_blocks
        self.block_size: int = block_size
        self.enable_prefix_caching: bool = bool(enable_prefix_caching)
        self._ref: list[int] = [0] * num_blocks
        # Chain hash and (parent hash, tokens) of each registered block, None when unregistered.
        self._hash: list[bytes | None] = [None] * num_blocks
        self._key: list[tuple[bytes, tuple[int, ...]] | None] = [None] * num_blocks
        # Min-heap of free block ids (ascending ids are already a heap).
        self._free: list[int] = list(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # oldest first
        self._hash_to_block: dict[bytes, int] = {}
        self._seqs: dict[int, _SeqState] = {}
        self._num_used_blocks = 0  # blocks with refcount > 0
        self._query_tokens = 0
        self._hit_tokens = 0

    # ------------------------------------------------------------------ queries

    @property
    def num_free_blocks(self) -> int:
        """Blocks allocatable now: truly free plus unreferenced cached (evictable) ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_evictable_blocks(self) -> int:
        """Unreferenced blocks kept for the prefix cache."""
        return len(self._evictable)

    @property
    def num_seqs(self) -> int:
        """Sequences holding a block table."""
        return len(self._seqs)

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that ``num_tokens`` tokens occupy: ``ceil(num_tokens / block_size)``."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        return -(-num_tokens // self.block_size)

    def has_seq(self, seq_id: int) -> bool:
        """Whether ``seq_id`` currently holds a block table."""
        return seq_id in self._seqs

    def block_table(self, seq_id: int) -> list[int]:
        """Copy of the sequence's physical block ids, in logical order."""
        return list(self._seq(seq_id).blocks)

    def num_tokens(self, seq_id: int) -> int:
        """Tokens the sequence's table currently covers."""
        return self._seq(seq_id).num_tokens

    def ref_count(self, block_id: int) -> int:
        """Number of sequence tables holding ``block_id``."""
        return self._ref[block_id]

    def is_cached(self, block_id: int) -> bool:
        """Whether ``block_id`` is registered in the prefix cache."""
        return self._hash[block_id] is not None

    def slot_mapping(self, seq_id: int, start: int, end: int) -> list[int]:
        """Flat cache slots of the sequence's tokens ``start .. end-1`` (see ``flashpage.kv.layout``)."""
        s = self._seq(seq_id)
        if not 0 <= start <= end <= s.num_tokens:
            raise ValueError(f"need 0 <= start <= end <= {s.num_tokens} for seq {seq_id}, got {start}, {end}")
        bs = self.block_size
        blocks = s.blocks
        return [blocks[t // bs] * bs + t % bs for t in range(start, end)]

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Prompt tokens served from the prefix cache / prompt tokens queried, over all allocations."""
        return self._hit_tokens / self._query_tokens if self._query_tokens else 0.0

    def usage(self) -> KVUsage:
        """Occupancy snapshot (O(number of sequences))."""
        bs = self.block_size
        # Every block of a table is full except possibly the last one; a last block shared by forked
        # sequences is counted once, with the largest fill any holder has.
        partial: dict[int, int] = {}
        for s in self._seqs.values():
            fill = s.num_tokens % bs
            if fill:
                b = s.blocks[-1]
                partial[b] = max(partial.get(b, 0), fill)
        allocated = self._num_used_blocks * bs
        unused = sum(bs - fill for fill in partial.values())
        return KVUsage(
            num_blocks=self.num_blocks,
            used_blocks=self._num_used_blocks,
            cached_free_blocks=len(self._evictable),
            free_blocks=len(self._free),
            allocated_slots=allocated,
            used_slots=allocated - unused,
        )

    # ------------------------------------------------------------------ allocation

    def can_allocate(self, token_ids: Sequence[int], num_lookahead: int = 0) -> bool:
        """Whether :meth:`allocate` of ``token_ids`` (plus ``num_lookahead`` more tokens) would succeed.

        Prefix-cache hits cost no new block; a hit on an evictable block removes it from the pool.
        """
        n = len(token_ids)
        if n == 0:
            return False
        hits = self._match_prefix(token_ids)
        evictable_hits = sum(1 for b in hits if self._ref[b] == 0)
        need = self.blocks_needed(n + max(0, num_lookahead)) - len(hits)
        return need <= len(self._free) + len(self._evictable) - evictable_hits

    def allocate(self, seq_id: int, token_ids: Sequence[int]) -> int:
        """Create the block table of a new sequence covering ``len(token_ids)`` tokens.

        Returns:
            ``num_cached_tokens``: leading tokens whose KV is already in the shared (prefix-cached)
            blocks, a multiple of ``block_size`` and ``<= len(token_ids) - 1``; the runner computes
            tokens ``num_cached_tokens .. len(token_ids)-1``.
        Raises:
            ValueError: ``seq_id`` already exists or ``token_ids`` is empty.
            NoFreeBlocksError: not enough blocks (nothing is changed).
        """
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id} is already allocated; free it first")
        n = len(token_ids)
        if n == 0:
            raise ValueError("token_ids must not be empty")
        hits = self._match_prefix(token_ids)
        evictable_hits = sum(1 for b in hits if self._ref[b] == 0)
        need = self.blocks_needed(n) - len(hits)
        available = len(self._free) + len(self._evictable) - evictable_hits
        if need > available:
            raise NoFreeBlocksError(
                f"cannot allocate sequence {seq_id}: needs {need} new blocks "
                f"({n} tokens, {len(hits)} prefix-cache hits), only {available} free"
            )
        s = _SeqState()
        for b in hits:
            self._take_ref(b)
            s.blocks.append(b)
        if hits:
            s.num_hashed = len(hits)
            s.last_hash = self._hash[hits[-1]]  # type: ignore[assignment]
        for _ in range(need):
            s.blocks.append(self._pop_free_block())
        s.num_tokens = n
        self._seqs[seq_id] = s
        self._query_tokens += n
        self._hit_tokens += len(hits) * self.block_size
        return len(hits) * self.block_size

    def can_append(self, seq_id: int, num_new_tokens: int = 1) -> bool:
        """Whether :meth:`append_slots` of ``num_new_tokens`` would succeed (incl. a CoW copy)."""
        return self._append_cost(self._seq(seq_id), num_new_tokens) <= self.num_free_blocks

    def append_slots(self, seq_id: int, num_new_tokens: int = 1) -> list[tuple[int, int]]:
        """Grow the table to cover ``num_tokens + num_new_tokens`` tokens.

        Returns:
            ``(src, dst)`` block copies the runner must do before writing the new tokens: when the
            partially filled last block is shared (refcount > 1) it is replaced by a fresh copy.
            Usually ``[]``.
        Raises:
            NoFreeBlocksError: not enough blocks (nothing is changed).
        """
        s = self._seq(seq_id)
        cost = self._append_cost(s, num_new_tokens)
        if cost > self.num_free_blocks:
            raise NoFreeBlocksError(
                f"cannot append {num_new_tokens} tokens to sequence {seq_id}: needs {cost} blocks, "
                f"only {self.num_free_blocks} free"
            )
        copies: list[tuple[int, int]] = []
        bs = self.block_size
        if num_new_tokens > 0 and s.num_tokens % bs:
            last = s.blocks[-1]
            if self._ref[last] > 1:
                dst = self._pop_free_block()
                self._drop_ref(last)
                s.blocks[-1] = dst
                copies.append((last, dst))
        for _ in range(self.blocks_needed(s.num_tokens + num_new_tokens) - len(s.blocks)):
            s.blocks.append(self._pop_free_block())
        s.num_tokens += num_new_tokens
        return copies

    def commit(self, seq_id: int, token_ids: Sequence[int]) -> None:
        """Register the sequence's newly full blocks in the prefix cache.

        Args:
            token_ids: the sequence's full token list whose KV is now written (``len(token_ids) <=
                num_tokens(seq_id)``). Blocks ``num_hashed .. len(token_ids)//block_size - 1`` are
                hashed along the chain; a block whose content is already registered under another
                block id (two sequences computed the same prefix at once) is left unregistered.
        No-op when prefix caching is off.
        """
        s = self._seq(seq_id)
        if not self.enable_prefix_caching:
            return
        n = len(token_ids)
        if n > s.num_tokens:
            raise ValueError(
                f"commit of {n} tokens for sequence {seq_id}, but its table covers only {s.num_tokens}"
            )
        bs = self.block_size
        full = n // bs
        prev = s.last_hash
        for i in range(s.num_hashed, full):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            h = hash_block_tokens(prev, tokens)
            b = s.blocks[i]
            existing = self._hash[b]
            if existing is not None:
                # Shared with a fork sibling that already registered it: must be the same content.
                if existing != h:
                    raise RuntimeError(
                        f"sequence {seq_id} commits block {b} (logical {i}) with a hash that differs from "
                        "its registered one: a shared block was written without copy-on-write"
                    )
            elif h not in self._hash_to_block:
                self._hash[b] = h
                self._key[b] = (prev, tokens)
                self._hash_to_block[h] = b
            prev = h
        if full > s.num_hashed:
            s.num_hashed = full
            s.last_hash = prev

    def fork(self, parent_id: int, child_id: int) -> None:
        """Give ``child_id`` the parent's table, sharing every block (refcount + 1 each)."""
        p = self._seq(parent_id)
        if child_id in self._seqs:
            raise ValueError(f"sequence {child_id} is already allocated; cannot fork into it")
        for b in p.blocks:
            self._ref[b] += 1
        self._seqs[child_id] = _SeqState(list(p.blocks), p.num_tokens, p.num_hashed, p.last_hash)

    def free(self, seq_id: int) -> None:
        """Release the sequence's blocks (tail first, so prefix heads stay cached longest)."""
        s = self._seqs.pop(seq_id, None)
        if s is None:
            raise KeyError(f"unknown sequence {seq_id}: not allocated or already freed")
        for b in reversed(s.blocks):
            self._drop_ref(b)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix: evictable blocks become free; held blocks lose their hash.

        Sequences keep their tables; their blocks simply stop being shareable by new requests.
        Lifetime hit-rate counters are kept.
        """
        for b in self._evictable:
            heapq.heappush(self._free, b)
        self._evictable.clear()
        for b in self._hash_to_block.values():
            self._hash[b] = None
            self._key[b] = None
        self._hash_to_block.clear()

    # ------------------------------------------------------------------ integrity

    def check_integrity(self) -> None:
        """Verify every invariant; raise ``RuntimeError`` listing each violation found."""
        errors: list[str] = []
        nb, bs = self.num_blocks, self.block_size
        holders = [0] * nb
        for sid, s in self._seqs.items():
            if len(s.blocks) != self.blocks_needed(s.num_tokens):
                errors.append(
                    f"seq {sid}: {len(s.blocks)} blocks for {s.num_tokens} tokens "
                    f"(expected {self.blocks_needed(s.num_tokens)})"
                )
            if len(set(s.blocks)) != len(s.blocks):
                errors.append(f"seq {sid}: block table {s.blocks} holds a block twice")
            if not 0 <= s.num_hashed <= len(s.blocks) or s.num_hashed * bs > s.num_tokens:
                errors.append(f"seq {sid}: num_hashed={s.num_hashed} beyond its {s.num_tokens} tokens")
            for i, b in enumerate(s.blocks):
                if not 0 <= b < nb:
                    errors.append(f"seq {sid}: block id {b} out of range [0, {nb})")
                    continue
                holders[b] += 1
                if self._hash[b] is not None and (i + 1) * bs > s.num_tokens:
                    errors.append(f"seq {sid}: cached block {b} at logical {i} is not full")
        free_set = set(self._free)
        if len(free_set) != len(self._free):
            errors.append("free list holds a block twice")
        evict_set = set(self._evictable)
        if free_set & evict_set:
            errors.append(f"blocks both free and evictable: {sorted(free_set & evict_set)}")
        used = 0
        for b in range(nb):
            ref = self._ref[b]
            if ref != holders[b]:
                errors.append(f"block {b}: refcount {ref} but held by {holders[b]} sequence tables")
            where = [
                name
                for name, present in (
                    ("free", b in free_set),
                    ("evictable", b in evict_set),
                    ("referenced", ref > 0),
                )
                if present
            ]
            if len(where) != 1:
                errors.append(
                    f"block {b}: must be in exactly one of free/evictable/referenced, is in {where}"
                )
            if ref > 0:
                used += 1
            h = self._hash[b]
            if b in free_set and h is not None:
                errors.append(f"block {b}: free but still registered in the prefix cache")
            if b in evict_set and h is None:
                errors.append(f"block {b}: evictable but not registered in the prefix cache")
            if h is not None:
                if self._hash_to_block.get(h) != b:
                    errors.append(f"block {b}: its hash maps to block {self._hash_to_block.get(h)}")
                key = self._key[b]
                if key is None or hash_block_tokens(*key) != h:
                    errors.append(f"block {b}: stored tokens do not match its hash")
            elif self._key[b] is not None:
                errors.append(f"block {b}: has stored tokens but no hash")
        for h, b in self._hash_to_block.items():
            if not 0 <= b < nb or self._hash[b] != h:
                errors.append(f"hash map entry {h.hex()} -> block {b} disagrees with the block's hash")
        if not self.enable_prefix_caching and (self._hash_to_block or self._evictable):
            errors.append("prefix caching is off but blocks are registered/evictable")
        if used != self._num_used_blocks:
            errors.append(f"used-block counter {self._num_used_blocks} != {used} referenced blocks")
        if errors:
            raise RuntimeError("BlockManager integrity check failed:\n  " + "\n  ".join(errors))

    # ------------------------------------------------------------------ internals

    def _seq(self, seq_id: int) -> _SeqState:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise KeyError(f"unknown sequence {seq_id}: not allocated or already freed") from None

    def _match_prefix(self, token_ids: Sequence[int]) -> list[int]:
        """Cached blocks matching the longest prefix of full blocks, at most ``(n - 1) // block_size``."""
        if not self.enable_prefix_caching or not self._hash_to_block:
            return []
        bs = self.block_size
        hits: list[int] = []
        prev = ROOT_HASH
        for i in range((len(token_ids) - 1) // bs):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            h = hash_block_tokens(prev, tokens)
            b = self._hash_to_block.get(h)
            if b is None or self._key[b] != (prev, tokens):
                break
            hits.append(b)
            prev = h
        return hits

    def _append_cost(self, s: _SeqState, num_new_tokens: int) -> int:
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        cost = self.blocks_needed(s.num_tokens + num_new_tokens) - len(s.blocks)
        if num_new_tokens > 0 and s.num_tokens % self.block_size and self._ref[s.blocks[-1]] > 1:
            cost += 1
        return cost

    def _take_ref(self, b: int) -> None:
        if self._ref[b] == 0:
            # Reviving a cached block: it leaves the evictable pool.
            del self._evictable[b]
            self._num_used_blocks += 1
        self._ref[b] += 1

    def _drop_ref(self, b: int) -> None:
        self._ref[b] -= 1
        if self._ref[b] == 0:
            self._num_used_blocks -= 1
            if self._hash[b] is not None:
                self._evictable[b] = None  # most recently released: evicted last
            else:
                heapq.heappush(self._free, b)

    def _pop_free_block(self) -> int:
        """A block with refcount 1 for the caller: from the free list, else evict the LRU cached one."""
        if self._free:
            b = heapq.heappop(self._free)
        else:
            b, _ = self._evictable.popitem(last=False)
            h = self._hash[b]
            del self._hash_to_block[h]  # type: ignore[arg-type]
            self._hash[b] = None
            self._key[b] = None
        self._ref[b] = 1
        self._num_used_blocks += 1
        return b
