"""Scheduler + BlockManager without a model: randomized workloads, integrity after every step."""

from __future__ import annotations

import random

import pytest

from flashpage.engine.outputs import RequestMetrics
from flashpage.engine.sampling_params import SamplingParams
from flashpage.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from flashpage.engine.sequence import Request, Sequence, SequenceStatus
from flashpage.kv.block_manager import BlockManager


class Sim:
    """Drives a Scheduler like the engine does, with random 'sampled' tokens instead of a model."""

    def __init__(
        self, num_blocks: int, block_size: int, max_num_seqs: int, budget: int, caching: bool = True
    ) -> None:
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching=caching)
        self.sched = Scheduler(SchedulerConfig(max_num_seqs, budget, num_blocks * block_size), self.bm)
        self.budget = budget
        self.max_num_seqs = max_num_seqs
        self.next_id = 0
        self.live: list[Sequence] = []
        self.last_preempt_len: dict[int, int] = {}
        self.rng = random.Random(0)

    def add(self, prompt: list[int], max_tokens: int) -> Sequence:
        self.next_id += 1
        req = Request(
            str(self.next_id),
            None,
            prompt,
            SamplingParams(max_tokens=max_tokens),
            self.next_id,
            RequestMetrics(0.0),
        )
        seq = Sequence(self.next_id, req, 0, list(prompt), len(prompt))
        req.seqs.append(seq)
        self.sched.add(seq)
        self.live.append(seq)
        return seq

    def step(self) -> SchedulerOutput:
        out = self.sched.schedule()
        self.check(out)
        self.sched.on_computed(out)
        for item in out.scheduled:
            s = item.seq
            if item.samples:
                s.token_ids.append(self.rng.randrange(4))
                if (
                    s.num_output_tokens >= s.params.max_tokens
                    or s.num_tokens >= self.sched.config.max_model_len
                ):
                    self.sched.finish(s, SequenceStatus.FINISHED_LENGTH)
                    self.live.remove(s)
        self.bm.check_integrity()
        return out

    def check(self, out: SchedulerOutput) -> None:
        self.bm.check_integrity()
        assert sum(i.num_tokens for i in out.scheduled) <= self.budget
        assert len(self.sched.running) <= self.max_num_seqs
        ids = [i.seq.seq_id for i in out.scheduled]
        assert len(ids) == len(set(ids))
        kinds = [i.num_tokens == 1 and i.start == i.seq.num_tokens - 1 for i in out.scheduled]
        # Running decodes come before any prefill chunk of a sequence that was already running.
        for item in out.scheduled:
            s = item.seq
            assert s.status == SequenceStatus.RUNNING
            assert s.block_table == self.bm.block_table(s.seq_id), "cached block table is stale"
            assert self.bm.num_tokens(s.seq_id) >= item.start + item.num_tokens
            assert item.start == s.num_computed_tokens
            assert item.samples == (item.start + item.num_tokens == s.num_tokens)
        del kinds
        for s in out.preempted:
            assert s.status == SequenceStatus.WAITING and not self.bm.has_seq(s.seq_id)
            prev = self.last_preempt_len.get(s.seq_id)
            # No thrash: a sequence is preempted again only after it generated a token since.
            assert prev is None or s.num_tokens > prev, "preempted again before progressing"
            self.last_preempt_len[s.seq_id] = s.num_tokens
        for s in self.sched.running:
            assert self.bm.has_seq(s.seq_id)
        for s in self.sched.waiting:
            assert not self.bm.has_seq(s.seq_id)


@pytest.mark.parametrize(
    ("caching", "num_blocks", "budget"), [(True, 14, 12), (False, 14, 40), (True, 40, 7)]
)
def test_random_workload_integrity_and_all_blocks_free(caching: bool, num_blocks: int, budget: int) -> None:
    rng = random.Random(num_blocks * 100 + budget)
    sim = Sim(num_blocks, 8, max_num_seqs=5, budget=budget, caching=caching)
    shared = [rng.randrange(4) for _ in range(20)]
    added = 0
    steps = 0
    preemptions = 0
    while (added < 40 or sim.live) and steps < 5000:
        if added < 40 and rng.random() < 0.3:
            plen = rng.randint(1, 30)
            prompt = (shared[: rng.randint(0, 20)] + [rng.randrange(4) for _ in range(plen)])[
                : 8 * num_blocks // 2
            ]
            sim.add(prompt or [1], rng.randint(1, 25))
            added += 1
        if rng.random() < 0.03 and sim.live:
            victim = rng.choice(sim.live)
            sim.sched.abort([victim])
            sim.live.remove(victim)
            assert not sim.bm.has_seq(victim.seq_id)
        out = sim.step()
        preemptions += len(out.preempted)
        steps += 1
    assert not sim.live and steps < 5000
    assert sim.sched.num_unfinished == 0
    u = sim.bm.usage()
    assert u.used_blocks == 0 and sim.bm.num_free_blocks == num_blocks and sim.bm.num_seqs == 0
    if num_blocks == 14:
        assert preemptions > 0  # the tight cache did force preemption
    if caching:
        assert sim.bm.prefix_cache_hit_rate > 0


def test_chunked_prefill_decodes_first_and_budget() -> None:
    sim = Sim(64, 8, max_num_seqs=4, budget=10)
    a = sim.add(list(range(4)) * 6, 5)  # 24 prompt tokens -> chunks of 10, 10, 4
    out = sim.step()
    assert [(i.seq, i.start, i.num_tokens, i.samples) for i in out.scheduled] == [(a, 0, 10, False)]
    b = sim.add([1, 2, 3], 5)
    out = sim.step()
    assert [(i.seq, i.start, i.num_tokens) for i in out.scheduled] == [(a, 10, 10)]
    out = sim.step()  # a's last 4 tokens, then b's whole prompt fits in the rest of the budget
    assert [(i.seq, i.start, i.num_tokens, i.samples) for i in out.scheduled] == [
        (a, 20, 4, True),
        (b, 0, 3, True),
    ]
    assert out.num_prefill_tokens == 7 and out.num_decode_tokens == 0
    c = sim.add(list(range(30)), 3)
    out = sim.step()  # decodes of a and b first, then a chunk of c
    assert [(i.seq, i.num_tokens) for i in out.scheduled] == [(a, 1), (b, 1), (c, 8)]
    assert out.num_decode_tokens == 2 and out.num_prefill_tokens == 8


def test_fcfs_head_of_queue_blocks_and_max_num_seqs() -> None:
    sim = Sim(6, 8, max_num_seqs=2, budget=100)
    big = sim.add([1] * 30, 1)  # 4 blocks
    mid = sim.add([2] * 20, 1)  # 3 blocks: does not fit next to `big`
    small = sim.add([3], 1)  # would fit, but must not overtake `mid`
    out = sim.step()
    assert [i.seq for i in out.scheduled] == [big]
    assert list(sim.sched.waiting) == [mid, small]
    sim.step()  # big finishes (max_tokens=1) and mid, small are admitted
    assert big.is_finished
    sim2 = Sim(64, 8, max_num_seqs=2, budget=100)
    s = [sim2.add([i], 3) for i in range(3)]
    out = sim2.step()
    assert [i.seq for i in out.scheduled] == s[:2]


def test_preempts_latest_arrived_and_recomputes_from_prefix_cache() -> None:
    sim = Sim(5, 8, max_num_seqs=4, budget=100)
    a = sim.add([1] * 15, 4)  # 2 blocks for the prompt, a third from token 17 on
    b = sim.add([2] * 15, 4)
    sim.step()  # both prefilled; each holds 2 blocks (15 tokens) and sampled token 16
    out = sim.step()  # decode of token 16 needs no new block
    assert not out.preempted
    # Token 17 needs a third block for each; one is free: a (earliest) takes it, b has no victim
    # left that is not scheduled, so b (the latest-arrived) preempts itself.
    out = sim.step()
    assert out.preempted == [b] and [i.seq for i in out.scheduled] == [a]
    assert b.num_preemptions == 1 and not b.preemptible and b.status == SequenceStatus.WAITING
    assert list(sim.sched.waiting) == [b]
    while not a.is_finished:
        sim.step()
    out = sim.step()  # b comes back: its committed full blocks are prefix-cache hits
    assert out.scheduled[0].seq is b and out.scheduled[0].start == 16
    while not b.is_finished:
        sim.step()
    assert sim.bm.num_free_blocks == 5


def test_protected_sequence_is_not_preempted_again() -> None:
    sim = Sim(5, 8, max_num_seqs=4, budget=100)
    a = sim.add([1] * 7, 30)
    b = sim.add([2] * 7, 30)
    c = sim.add([3] * 7, 30)
    for _ in range(40):
        if not sim.live:
            break
        sim.step()  # Sim.check asserts the no-thrash rule on every preemption
    while sim.live:
        sim.step()
    assert all(s.is_finished for s in (a, b, c))
    assert sim.sched.num_preemptions > 0


def test_victim_is_the_latest_arrived_other_sequence() -> None:
    sim = Sim(7, 8, max_num_seqs=4, budget=100)
    a, b, c = (sim.add([k] * 15, 4) for k in (1, 2, 3))
    sim.step()
    sim.step()
    out = sim.step()  # a takes the free block; b needs one: c (latest, not yet scheduled) is preempted
    assert out.preempted == [c]
    assert [i.seq for i in out.scheduled] == [a, b]
    while sim.live:
        sim.step()
    assert sim.bm.num_free_blocks == 7
