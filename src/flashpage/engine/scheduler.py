"""Continuous-batching scheduler: which sequences run in the next step, and how many tokens each.

Every step has a token budget ``max_num_batched_tokens`` shared by all sequences:

1. **Decodes first**: running sequences with one token left to compute (arrival order).
2. **Running prefills** next: sequences part-way through their prompt get a chunk of what is left
   of the budget (chunked prefill), in arrival order.
3. **Waiting sequences** (FCFS, at most ``max_num_seqs`` running): each is given a block table for
   all its tokens (prefix-cache hits are shared, not recomputed, except for a request that asks
   for prompt logprobs: its cached prefix is recomputed without writing K/V) and a first chunk. The queue head
   blocks the queue: a later request never overtakes an earlier one that does not fit.

**Preemption by recompute**: when a running sequence needs a new KV block and none is free, the
latest-arrived running sequence not yet scheduled this step is preempted (its blocks are freed; it
goes back to the head of the waiting queue and later recomputes its tokens, mostly from the prefix
cache). *No thrashing*: a preempted sequence cannot be preempted again before it has generated a new
token; such a sequence needs no new block before that (its table is allocated whole on admission),
so the system always progresses. No new sequence is admitted in a step that preempted one.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from flashpage.engine.sequence import Sequence, SequenceStatus
from flashpage.kv.block_manager import BlockManager

__all__ = ["ScheduledSeq", "Scheduler", "SchedulerConfig", "SchedulerOutput"]


@dataclass(frozen=True)
class SchedulerConfig:
    """Scheduling limits.

    Attributes:
        max_num_seqs: most sequences running at once.
        max_num_batched_tokens: token budget of one step (decode tokens + prefill chunks).
        max_model_len: longest sequence (prompt + output).
        watermark_frac: fraction of blocks kept free when admitting a sequence while others run,
            so that running decodes do not need to preempt right after an admission.
    """

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    watermark_frac: float = 0.01

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if not 0.0 <= self.watermark_frac < 1.0:
            raise ValueError(f"watermark_frac must be in [0, 1), got {self.watermark_frac!r}")


@dataclass
class ScheduledSeq:
    """One sequence's share of a step: tokens ``start .. start + num_tokens - 1`` are computed.

    ``samples`` is true when the chunk reaches the end of the sequence's tokens, so the logits of its
    last token are needed.
    """

    seq: Sequence
    start: int
    num_tokens: int
    samples: bool


@dataclass
class SchedulerOutput:
    """The plan of one step.

    Attributes:
        scheduled: decodes first, then prefill chunks.
        copies: copy-on-write ``(src, dst)`` block copies to do before the forward.
        preempted: sequences preempted while planning this step.
        num_prefill_tokens / num_decode_tokens: tokens of each kind in the step.
    """

    scheduled: list[ScheduledSeq] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens


class Scheduler:
    """Owns the waiting queue and the running set, and every block-manager call for them.

    Args:
        config: limits.
        block_manager: the KV block allocator (shared with nothing else).
    """

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.bm = block_manager
        self.block_size = block_manager.block_size
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # sorted by Sequence.sort_key (arrival order)
        self.num_preemptions = 0
        self._watermark_blocks = int(config.watermark_frac * block_manager.num_blocks)

    # ------------------------------------------------------------------ queue management

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence (at the tail: FCFS)."""
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def _insert_running(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.RUNNING
        keys = [s.sort_key for s in self.running]
        self.running.insert(bisect.bisect_right(keys, seq.sort_key), seq)

    def _remove_running(self, seq: Sequence) -> None:
        self.running.remove(seq)

    def _free_blocks(self, seq: Sequence) -> None:
        if self.bm.has_seq(seq.seq_id):
            self.bm.free(seq.seq_id)
        seq.block_table = []
        seq.num_committed_blocks = 0
        seq.kv_write_from = 0

    def preempt(self, seq: Sequence) -> None:
        """Free a running sequence's blocks and put it at the head of the waiting queue."""
        self._remove_running(seq)
        self._free_blocks(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.tokens_at_preemption = len(seq.token_ids)
        seq.request.metrics.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        # Keep the waiting queue in arrival order among preempted sequences: victims are taken
        # latest-first, so each new victim is older than the ones already at the head.
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """A running sequence is done: free its blocks at once."""
        if seq.status == SequenceStatus.RUNNING:
            self._remove_running(seq)
        elif seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self._free_blocks(seq)
        seq.status = status

    def abort(self, seqs: Iterable[Sequence]) -> None:
        """Drop sequences wherever they are and free their blocks."""
        for seq in seqs:
            if not seq.is_finished:
                self.finish(seq, SequenceStatus.FINISHED_ABORTED)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Start ``child`` as a copy of ``parent`` sharing all of its blocks (after its prefill)."""
        self.bm.fork(parent.seq_id, child.seq_id)
        child.num_computed_tokens = parent.num_computed_tokens
        child.block_table = list(parent.block_table)
        child.num_committed_blocks = parent.num_committed_blocks
        self._insert_running(child)

    # ------------------------------------------------------------------ planning

    def schedule(self) -> SchedulerOutput:
        """Plan the next step (see the module docstring)."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        scheduled: set[int] = set()
        decodes = [s for s in self.running if s.num_uncomputed_tokens == 1]
        prefills = [s for s in self.running if s.num_uncomputed_tokens > 1]
        for seq in decodes + prefills:
            if budget == 0:
                break
            if seq.status != SequenceStatus.RUNNING:  # preempted as a victim earlier in this loop
                continue
            n = min(seq.num_uncomputed_tokens, budget)
            if not self._reserve(seq, n, scheduled, out):
                continue
            self._add(out, seq, n)
            scheduled.add(seq.seq_id)
            budget -= n
        if out.preempted:
            return out
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if len(self.running) + 1 + seq.pending_forks > self.config.max_num_seqs:
                break
            lookahead = self._watermark_blocks * self.block_size if self.running else 0
            if not self.bm.can_allocate(seq.token_ids, num_lookahead=lookahead):
                break
            self.waiting.popleft()
            cached = self.bm.allocate(seq.seq_id, seq.token_ids)
            seq.num_computed_tokens = cached
            if cached and seq.needs_prompt_logits:
                # Prompt logprobs need the hidden state of every prompt token: recompute the cached
                # prefix too, without writing its K/V (those blocks are shared and already hold it).
                seq.num_computed_tokens = 0
                seq.kv_write_from = cached
            seq.block_table = self.bm.block_table(seq.seq_id)
            seq.num_committed_blocks = cached // self.block_size
            if seq.num_preemptions == 0:
                seq.request.metrics.num_cached_tokens = cached
            self._insert_running(seq)
            n = min(seq.num_uncomputed_tokens, budget)
            self._add(out, seq, n)
            budget -= n
        return out

    def _add(self, out: SchedulerOutput, seq: Sequence, n: int) -> None:
        start = seq.num_computed_tokens
        out.scheduled.append(ScheduledSeq(seq, start, n, start + n == len(seq.token_ids)))
        if n == 1 and start == len(seq.token_ids) - 1:
            out.num_decode_tokens += n
        else:
            out.num_prefill_tokens += n

    def _reserve(self, seq: Sequence, n: int, scheduled: set[int], out: SchedulerOutput) -> bool:
        """Make the sequence's table cover ``num_computed + n`` tokens, preempting if needed."""
        need = seq.num_computed_tokens + n - self.bm.num_tokens(seq.seq_id)
        if need <= 0:
            return True
        while not self.bm.can_append(seq.seq_id, need):
            victim = self._pick_victim(seq, scheduled)
            if victim is None:
                if seq.preemptible:
                    self.preempt(seq)
                    out.preempted.append(seq)
                return False
            self.preempt(victim)
            out.preempted.append(victim)
        old_len = len(seq.block_table)
        copies = self.bm.append_slots(seq.seq_id, need)
        if copies or self.bm.blocks_needed(seq.num_computed_tokens + n) != old_len:
            seq.block_table = self.bm.block_table(seq.seq_id)
        out.copies.extend(copies)
        return True

    def _pick_victim(self, seq: Sequence, scheduled: set[int]) -> Sequence | None:
        """The latest-arrived running sequence that may be preempted (not ``seq``, not scheduled)."""
        for cand in reversed(self.running):
            if cand is seq or cand.seq_id in scheduled or not cand.preemptible:
                continue
            return cand
        return None

    # ------------------------------------------------------------------ after the forward

    def on_computed(self, out: SchedulerOutput) -> None:
        """The step's K/V are written: advance each sequence and register its new full blocks."""
        bs = self.block_size
        caching = self.bm.enable_prefix_caching
        for item in out.scheduled:
            seq = item.seq
            seq.num_computed_tokens = item.start + item.num_tokens
            if caching:
                full = seq.num_computed_tokens // bs
                if full > seq.num_committed_blocks:
                    self.bm.commit(seq.seq_id, seq.token_ids[: full * bs])
                    seq.num_committed_blocks = full
