"""Model runner: owns the paged KV cache and runs one forward per engine step.

Per step (:meth:`ModelRunner.execute`):

1. copy-on-write block copies from the scheduler (``flashpage.kv.layout.copy_blocks``);
2. flatten the scheduled chunks into one token batch: ``input_ids``/``positions`` ``(T,)`` and an
   :class:`~flashpage.ops.metadata.AttentionMetadata` (slot of every new token from the sequence's
   block table, padded ``(B, max_blocks)`` block table, context lengths, ``cu_seqlens_q``, and the
   ``decode_only`` / ``prefix_free`` flags);
3. ask the roofline planner (:func:`flashpage.roofline.planner.plan_attention`, once per step) which
   kernel the step's phase gets; a decode step is planned once
   (:func:`flashpage.ops.paged_plan.plan_decode`: split-KV count and KV heads per program, the
   decision the benchmark's planner rows time) and the plan rides on the metadata to every layer;
   what is launched is recorded per phase for stats;
4. ``model.forward`` (or the replay of a captured CUDA graph for decode batches on GPU), then
   ``model.compute_logits`` of the last token of every sequence that samples this step.

KV cache size: ``kv_cache_bytes`` if given; else on GPU ``gpu_memory_utilization`` of the device minus
the peak memory of a profiling forward of ``max_num_batched_tokens`` tokens (plus the sampler over
``max_num_seqs`` rows) and memory held outside PyTorch; on CPU ``min(256 MiB, what max_num_seqs
sequences of max_model_len tokens need)``.

CUDA graphs (GPU, Triton backend, ``enforce_eager=False``): decode steps are captured per bucketed
batch size (1, 2, 4, 8, 16, 24, ... up to ``max_num_seqs``) and per launch (heads per program,
split-KV count) the planner can choose for that bucket, over static input buffers; a step pads its batch up to the bucket (padded rows
write no KV: slot ``-1``). Capture happens at start-up; a failed capture falls back to eager.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
import warnings
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from flashpage.engine.scheduler import ScheduledSeq
from flashpage.kv.layout import KVCacheSpec, allocate_kv_cache, copy_blocks, num_blocks_for_bytes
from flashpage.ops.backend import resolve_backend
from flashpage.ops.metadata import AttentionMetadata
from flashpage.ops.paged_launch import default_decode_config, with_heads
from flashpage.ops.paged_plan import DecodePlan, LaunchChoice, choose_launch, plan_decode
from flashpage.ops.utils import default_num_sms

__all__ = ["CPU_DEFAULT_KV_BYTES", "ModelRunner", "PhaseDecision", "RunnerConfig", "StepBatch"]

#: Default KV cache size on CPU when neither ``kv_cache_bytes`` nor a GPU is there.
CPU_DEFAULT_KV_BYTES = 256 * 1024**2

# Headroom kept free on GPU beyond the profiled peak (CUDA graph pools, allocator fragmentation).
_GPU_RESERVE_BYTES = 512 * 1024**2


@dataclass(frozen=True)
class RunnerConfig:
    """What the runner needs to size the cache and batches.

    Attributes:
        block_size: tokens per KV block.
        max_num_seqs: most sequences per step (largest CUDA graph batch).
        max_num_batched_tokens: most tokens per step (profiling forward size).
        max_model_len: requested longest sequence (``None``: the model's ``max_position_embeddings``,
            capped to what the cache holds; an explicit value the cache cannot hold is an error).
        kv_cache_bytes: explicit KV cache size, or ``None``.
        gpu_memory_utilization: fraction of GPU memory the engine may use (weights + activations + KV).
        enforce_eager: never use CUDA graphs.
    """

    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None
    kv_cache_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False


@dataclass
class PhaseDecision:
    """The roofline planner's choice for a phase, and how often the phase ran.

    Attributes:
        phase: ``prefill`` | ``decode`` | ``chunked_prefill``.
        choice: the latest :class:`~flashpage.roofline.planner.KernelChoice` of the phase.
        steps: steps of this phase so far.
        tokens: tokens processed in those steps.
        graph_steps: decode steps that replayed a CUDA graph.
    """

    phase: str
    choice: Any
    steps: int = 0
    tokens: int = 0
    graph_steps: int = 0

    def as_dict(self) -> dict[str, Any]:
        c = self.choice
        return {
            "phase": self.phase,
            "op": c.op,
            "kernel": c.kernel,
            "num_splits": c.num_splits,
            "intensity": c.intensity,
            "ridge": c.ridge,
            "bound": c.bound,
            "steps": self.steps,
            "tokens": self.tokens,
            "graph_steps": self.graph_steps,
        }


@dataclass
class StepBatch:
    """Host-side flattened batch of one step (lists; moved to the device by the runner).

    Attributes:
        input_ids / positions / slot_mapping: ``T`` entries.
        seqlens_k: ``B`` context lengths after the step.
        cu_seqlens_q: ``B + 1`` prefix sums of new tokens.
        block_tables: ``B`` rows of physical block ids.
        sample_rows: token index (into ``T``) of the last token of each sampling sequence.
        max_seqlen_q / max_seqlen_k: host maxima.
        decode_only / prefix_free: the metadata flags.
    """

    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slot_mapping: list[int] = field(default_factory=list)
    seqlens_k: list[int] = field(default_factory=list)
    cu_seqlens_q: list[int] = field(default_factory=lambda: [0])
    block_tables: list[list[int]] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    decode_only: bool = True
    prefix_free: bool = True

    @property
    def num_seqs(self) -> int:
        return len(self.seqlens_k)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)


def build_step_batch(scheduled: Seq[ScheduledSeq], block_size: int) -> StepBatch:
    """Flatten scheduled chunks into a :class:`StepBatch` (pure host work)."""
    b = StepBatch()
    ids, pos, slots = b.input_ids, b.positions, b.slot_mapping
    total = 0
    bs = block_size
    for item in scheduled:
        seq, start, n = item.seq, item.start, item.num_tokens
        end = start + n
        table = seq.block_table
        skip = seq.kv_write_from  # positions below it are in shared cached blocks: write nothing
        if n == 1:
            ids.append(seq.token_ids[start])
            pos.append(start)
            slots.append(table[start // bs] * bs + start % bs if start >= skip else -1)
        else:
            ids.extend(seq.token_ids[start:end])
            pos.extend(range(start, end))
            slots.extend([table[t // bs] * bs + t % bs if t >= skip else -1 for t in range(start, end)])
            b.decode_only = False
        if start:
            b.prefix_free = False
        total += n
        b.cu_seqlens_q.append(total)
        b.seqlens_k.append(end)
        b.block_tables.append(table)
        if item.samples:
            b.sample_rows.append(total - 1)
        b.max_seqlen_q = max(b.max_seqlen_q, n)
        b.max_seqlen_k = max(b.max_seqlen_k, end)
    return b


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """CUDA graph buckets: 1, 2, 4, 8, then every 8 up to 64, every 16 up to 256, every 32 beyond."""
    sizes = [1, 2, 4, 8]
    s = 8
    while s < max_num_seqs:
        s += 8 if s < 64 else (16 if s < 256 else 32)
        sizes.append(s)
    return [x for x in sizes if x < max_num_seqs] + [max_num_seqs]


@dataclass
class _Graph:
    """A captured decode step: ``replay()`` reruns it on the static buffers.

    ``meta`` keeps the step's metadata (and its decode plan's split workspace, which the graph
    writes) alive as long as the graph; ``out`` is the graph's output buffer.
    """

    replay: Callable[[], Any]
    batch: int
    launch: tuple[int, int]  # (KV heads per program, split-KV count)
    meta: AttentionMetadata
    out: Tensor


def _rerun_into(fn: Callable[[], Tensor], out: Tensor) -> None:
    """Emulated replay: run ``fn`` again and write the result into the recorded output."""
    out.copy_(fn())


class ModelRunner:
    """Runs the model over steps of the scheduler.

    Args:
        model: ``forward(input_ids, positions, kv_caches, meta) -> (T, H)`` and
            ``compute_logits(hidden) -> (N, V)`` float32.
        model_config: has ``num_layers``, ``num_heads``, ``num_kv_heads``, ``head_dim``, ``vocab_size``,
            ``max_position_embeddings``.
        device / dtype: where and in which dtype the model runs (the KV cache dtype too).
        config: sizing options.
        profile: hardware profile for the planner (``None``: detected).
        sampler_probe: called with ``(logits,)`` during GPU memory profiling so the sampler's peak is
            included (``None``: not profiled).
        agree_num_blocks: maps this process's KV block count to the one every tensor-parallel rank uses
            (their minimum; ``None``: a single process).

    Attributes:
        step_hook: called as ``step_hook(batch, copies, keep_hidden, block_size)`` at the start of every
            step on rank 0 of a tensor-parallel group (it broadcasts the step to the other ranks, which
            run :meth:`execute_batch`); ``None`` otherwise.
    """

    step_hook: Callable[[StepBatch, Seq[tuple[int, int]], Seq[int], int], None] | None = None

    def __init__(
        self,
        model: Any,
        model_config: Any,
        *,
        device: torch.device,
        dtype: torch.dtype,
        config: RunnerConfig,
        profile: Any = None,
        sampler_probe: Any = None,
        agree_num_blocks: Callable[[int], int] | None = None,
    ) -> None:
        self.model = model
        self.model_config = model_config
        self.device = torch.device(device)
        self.dtype = dtype
        self.config = config
        self.block_size = config.block_size
        c = model_config
        self.num_layers = int(c.num_layers)
        self.num_kv_heads = int(c.num_kv_heads)
        self.num_heads = int(
            getattr(c, "num_heads", None) or getattr(c, "num_attention_heads", c.num_kv_heads)
        )
        self.head_dim = int(c.head_dim)
        self.vocab_size = int(c.vocab_size)
        self.backend = resolve_backend(self.device)
        self.profile = profile if profile is not None else _default_profile(self.device)
        self.decisions: dict[str, PhaseDecision] = {}
        self.last_hidden: dict[int, Tensor] = {}
        self.forward_time_s = 0.0
        requested_len = config.max_model_len or int(getattr(c, "max_position_embeddings", 8192))
        requested_len = min(requested_len, int(getattr(c, "max_position_embeddings", requested_len)))

        spec_args = (self.num_layers, self.block_size, self.num_kv_heads, self.head_dim, dtype)
        kv_bytes = self._kv_cache_bytes(requested_len, sampler_probe)
        num_blocks = num_blocks_for_bytes(kv_bytes, *spec_args)
        if agree_num_blocks is not None:
            num_blocks = agree_num_blocks(num_blocks)
        if num_blocks < 2:
            raise ValueError(
                f"kv_cache_bytes: {kv_bytes} bytes hold {num_blocks} KV blocks of "
                f"{KVCacheSpec(self.num_layers, 1, *spec_args[1:]).bytes_per_block} bytes; need at least 2"
            )
        self.spec = KVCacheSpec(
            self.num_layers, num_blocks, self.block_size, self.num_kv_heads, self.head_dim, dtype
        )
        self.kv_caches = allocate_kv_cache(self.spec, self.device)
        self.num_blocks = num_blocks
        # The longest sequence must fit in the cache on its own (else it could never run): an explicit
        # max_model_len that does not is an error, the default is capped.
        if config.max_model_len is not None and requested_len > num_blocks * self.block_size:
            raise ValueError(
                f"max_model_len: {requested_len} tokens do not fit in the KV cache, which holds "
                f"{num_blocks * self.block_size} tokens ({num_blocks} blocks of {self.block_size} in {kv_bytes} "
                "bytes); raise kv_cache_bytes or gpu_memory_utilization, or lower max_model_len"
            )
        self.max_model_len = min(requested_len, num_blocks * self.block_size)
        self.max_blocks_per_seq = math.ceil(self.max_model_len / self.block_size)

        self._decode_config = default_decode_config(dtype, self.head_dim)
        self._num_sms = default_num_sms(self.device)
        self._graphs: dict[tuple[int, int, int], _Graph] = {}
        self._decode_plans: dict[tuple[int, int, int], DecodePlan | None] = {}
        self._graph_buckets: list[int] = []
        self.use_graphs = self.device.type == "cuda" and self.backend == "triton" and not config.enforce_eager
        self.graph_capture_s = 0.0
        if self.use_graphs:
            self.capture_graphs()

    # ------------------------------------------------------------------ sizing

    def _kv_cache_bytes(self, max_model_len: int, sampler_probe: Any) -> int:
        cfg = self.config
        if cfg.kv_cache_bytes is not None:
            return int(cfg.kv_cache_bytes)
        per_token = KVCacheSpec(
            self.num_layers, 1, self.block_size, self.num_kv_heads, self.head_dim, self.dtype
        ).bytes_per_token
        if self.device.type != "cuda":
            want = cfg.max_num_seqs * (max_model_len + self.block_size) * per_token
            return int(min(CPU_DEFAULT_KV_BYTES, want))
        peak = self._profile_peak_bytes(max_model_len, sampler_probe)
        free, total = torch.cuda.mem_get_info(self.device)
        outside_torch = total - free - torch.cuda.memory_reserved(self.device)
        budget = int(total * cfg.gpu_memory_utilization) - peak - max(0, outside_torch) - _GPU_RESERVE_BYTES
        if budget <= 0:
            raise ValueError(
                f"gpu_memory_utilization: {cfg.gpu_memory_utilization} of {total / 2**30:.1f} GiB leaves no "
                f"room for the KV cache (profiled peak {peak / 2**30:.1f} GiB); raise it or pass kv_cache_bytes"
            )
        return budget

    @torch.inference_mode()
    def _profile_peak_bytes(self, max_model_len: int, sampler_probe: Any) -> int:
        """Peak GPU bytes of a forward over ``max_num_batched_tokens`` prompt tokens (+ sampler)."""
        cfg = self.config
        dev = self.device
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
        total = cfg.max_num_batched_tokens
        seq_len = max(1, min(max_model_len, total))
        lens = [seq_len] * (total // seq_len) + ([total % seq_len] if total % seq_len else [])
        lens = lens[: cfg.max_num_seqs] or [1]
        t = sum(lens)
        spec = KVCacheSpec(self.num_layers, 1, self.block_size, self.num_kv_heads, self.head_dim, self.dtype)
        tiny = allocate_kv_cache(spec, dev)
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        nblk = math.ceil(max(lens) / self.block_size)
        meta = AttentionMetadata(
            slot_mapping=torch.full((t,), -1, dtype=torch.long, device=dev),  # write nothing
            block_table=torch.zeros(len(lens), nblk, dtype=torch.int32, device=dev),
            seqlens_k=torch.tensor(lens, dtype=torch.int32, device=dev),
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=dev),
            max_seqlen_q=max(lens),
            max_seqlen_k=max(lens),
            decode_only=False,
            prefix_free=True,
        )
        ids = torch.randint(0, self.vocab_size, (t,), device=dev)
        pos = torch.cat([torch.arange(n, device=dev) for n in lens])
        hidden = self.model.forward(ids, pos, tiny, meta)
        rows = torch.arange(cfg.max_num_seqs, device=dev) % t
        logits = self.model.compute_logits(hidden[rows])
        if sampler_probe is not None:
            sampler_probe(logits)
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev)
        del hidden, logits, tiny, meta
        torch.cuda.empty_cache()
        return int(peak)

    # ------------------------------------------------------------------ planning

    def _plan(self, batch: StepBatch) -> tuple[str, Any]:
        from flashpage.roofline.planner import plan_attention

        if batch.decode_only:
            phase = "decode"
        elif batch.prefix_free:
            phase = "prefill"
        else:
            phase = "chunked_prefill"
        choice = plan_attention(
            phase,
            batch=batch.num_seqs,
            seqlen_q=batch.max_seqlen_q,
            seqlen_k=batch.max_seqlen_k,
            nheads=self.num_heads,
            nheads_k=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype=self.dtype,
            profile=self.profile,
            has_prefix=not batch.prefix_free,
        )
        rec = self.decisions.get(phase)
        if rec is None:
            rec = self.decisions[phase] = PhaseDecision(phase, choice)
        if batch.decode_only and batch.max_seqlen_q == 1:
            # Record what the paged kernel launches (the split count of choose_launch, which also
            # decides the KV heads per program), not the one-head estimate of plan_attention.
            splits = self._decode_choice(batch.num_seqs, batch.max_seqlen_k).num_splits
            kernel = "paged_decode_splitkv" if splits > 1 else "paged_decode"
            choice = dataclasses.replace(choice, num_splits=splits, kernel=kernel)
        rec.choice = choice
        rec.steps += 1
        rec.tokens += batch.num_tokens
        return phase, choice

    # ------------------------------------------------------------------ execution

    def _host(self, data: list[int] | np.ndarray, dtype: torch.dtype) -> Tensor:
        """A CPU tensor of ``data`` (pinned when the device is a GPU, for asynchronous copies)."""
        t = torch.as_tensor(data, dtype=dtype)
        return t.pin_memory() if self.device.type == "cuda" else t

    def _to_device(self, data: list[int] | np.ndarray, dtype: torch.dtype) -> Tensor:
        t = self._host(data, dtype)
        return t.to(self.device, non_blocking=True) if self.device.type == "cuda" else t

    @staticmethod
    def _fill_block_table(arr: np.ndarray, tables: Seq[list[int]], width: int) -> np.ndarray:
        """Write each table's first ``width`` block ids into the rows of ``arr`` (a table may already
        cover tokens that later chunks compute); entries past a row's blocks are left as they are
        (never read: the kernels stop at each sequence's length). Returns ``arr``."""
        for i, t in enumerate(tables):
            row = t[:width]
            arr[i, : len(row)] = row
        return arr

    @classmethod
    def _block_table_array(cls, tables: Seq[list[int]], width: int) -> np.ndarray:
        """``(B, width)`` int32 block table, right-padded with block 0."""
        width = max(width, 1)
        return cls._fill_block_table(np.zeros((len(tables), width), dtype=np.int32), tables, width)

    @torch.inference_mode()
    def execute(
        self, scheduled: Seq[ScheduledSeq], copies: Seq[tuple[int, int]] = (), keep_hidden: Seq[int] = ()
    ) -> Tensor:
        """Run one step; returns ``(num_sampling_seqs, V)`` float32 logits in scheduled order.

        Args:
            scheduled / copies: the scheduler's plan.
            keep_hidden: indices into ``scheduled`` whose chunk's hidden states (``(num_tokens, H)``,
                row ``j`` at position ``start + j``) are kept in :attr:`last_hidden` (prompt
                logprobs); such a step runs eagerly.
        """
        batch = build_step_batch(scheduled, self.block_size)
        if self.step_hook is not None:
            self.step_hook(batch, copies, keep_hidden, self.block_size)
        return self.execute_batch(batch, copies, keep_hidden)

    @torch.inference_mode()
    def execute_batch(
        self, batch: StepBatch, copies: Seq[tuple[int, int]] = (), keep_hidden: Seq[int] = ()
    ) -> Tensor:
        """:meth:`execute` of an already flattened step (the tensor-parallel workers' entry point)."""
        if copies:
            copy_blocks(self.kv_caches, copies)
        phase, _ = self._plan(batch)
        t0 = time.perf_counter()
        self.last_hidden = {}
        if batch.decode_only and self._graphs and not keep_hidden:
            g = self._find_graph(batch.num_seqs, self._decode_choice(batch.num_seqs, batch.max_seqlen_k))
            if g is not None:
                self.decisions[phase].graph_steps += 1
                hidden = self._replay(g, batch)
                if len(batch.sample_rows) != batch.num_tokens:  # a 1-token prefill chunk does not sample
                    hidden = hidden[self._to_device(batch.sample_rows, torch.long)]
                logits = self.model.compute_logits(hidden)
                self.forward_time_s += time.perf_counter() - t0
                return logits
        width = max(math.ceil(batch.max_seqlen_k / self.block_size), 1)
        meta = AttentionMetadata(
            slot_mapping=self._to_device(batch.slot_mapping, torch.long),
            block_table=self._to_device(self._block_table_array(batch.block_tables, width), torch.int32),
            seqlens_k=self._to_device(batch.seqlens_k, torch.int32),
            cu_seqlens_q=self._to_device(batch.cu_seqlens_q, torch.int32),
            max_seqlen_q=batch.max_seqlen_q,
            max_seqlen_k=batch.max_seqlen_k,
            decode_only=batch.decode_only,
            prefix_free=batch.prefix_free,
            decode_plan=self._decode_plan(batch.num_seqs, batch.max_seqlen_k) if batch.decode_only else None,
        )
        ids = self._to_device(batch.input_ids, torch.long)
        pos = self._to_device(batch.positions, torch.long)
        hidden = self.model.forward(ids, pos, self.kv_caches, meta)
        for i in keep_hidden:
            self.last_hidden[i] = hidden[batch.cu_seqlens_q[i] : batch.cu_seqlens_q[i + 1]]
        if len(batch.sample_rows) != batch.num_tokens:
            hidden = hidden[self._to_device(batch.sample_rows, torch.long)]
        logits = self.model.compute_logits(hidden)
        self.forward_time_s += time.perf_counter() - t0
        return logits

    # ------------------------------------------------------------------ CUDA graphs

    def _decode_choice(self, batch: int, max_seqlen_k: int) -> LaunchChoice:
        """How a one-token decode of ``batch`` sequences of at most ``max_seqlen_k`` keys launches."""
        return choose_launch(
            self._decode_config, 0, batch, 1, self.num_heads, self.num_kv_heads, self.dtype,
            max(max_seqlen_k, 1), self._num_sms,
        )  # fmt: skip

    def _decode_plan(
        self, batch: int, max_seqlen_k: int, launch: tuple[int, int] | None = None
    ) -> DecodePlan | None:
        """The step's decode plan (``None`` off the Triton backend): the planner's launch for
        ``batch`` sequences of at most ``max_seqlen_k`` keys, or the given ``(heads per program,
        splits)`` (graph capture)."""
        if self.backend != "triton":
            return None
        if launch is None:
            # Steps with the same batch and launch reuse one plan: its workspace, and the launch its
            # first step bound (later steps relaunch it on every layer).
            key = (batch, *self._launch_key(self._decode_choice(batch, max_seqlen_k)))
            plan = self._decode_plans.get(key)
            if plan is None:
                if len(self._decode_plans) >= 256:
                    self._decode_plans.clear()
                plan = self._decode_plans[key] = self._decode_plan(batch, max_seqlen_k, key[1:])
            return plan
        return plan_decode(
            batch, self.num_heads, self.num_kv_heads, self.head_dim, block_size=self.block_size,
            max_seqlen_k=max(max_seqlen_k, 1), q_dtype=self.dtype, kv_dtype=self.dtype, device=self.device,
            num_splits=launch[1], config=with_heads(self._decode_config, launch[0]),
        )  # fmt: skip

    @staticmethod
    def _launch_key(choice: LaunchChoice) -> tuple[int, int]:
        return choice.config.heads_per_program, choice.num_splits

    def _possible_launches(self, bucket: int, prev_bucket: int) -> list[tuple[int, int]]:
        """Every (heads per program, splits) the planner can pick for a decode batch in this bucket."""
        ctxs = sorted(
            {min(self.max_model_len, 1 << k) for k in range(0, 31) if (1 << k) <= 2 * self.max_model_len}
        )
        launches = {
            self._launch_key(self._decode_choice(b, ctx))
            for b in range(prev_bucket + 1, bucket + 1)
            for ctx in ctxs
        }
        return sorted(launches)

    @torch.inference_mode()
    def capture_graphs(self, emulate: bool = False) -> None:
        """Capture the decode CUDA graphs (one per bucket and possible launch).

        Args:
            emulate: instead of CUDA graphs, record plain re-runs of the forward over the same static
                buffers (any device). Tests use it to check the bucketing, padding and static-buffer
                logic on CPU; it is not faster than eager.
        """
        t0 = time.perf_counter()
        dev = self.device
        cuda = dev.type == "cuda" and not emulate
        max_bs = self.config.max_num_seqs
        self._g_ids = torch.zeros(max_bs, dtype=torch.long, device=dev)
        self._g_pos = torch.zeros(max_bs, dtype=torch.long, device=dev)
        self._g_slots = torch.full((max_bs,), -1, dtype=torch.long, device=dev)
        self._g_seqlens = torch.ones(max_bs, dtype=torch.int32, device=dev)
        self._g_tables = torch.zeros(max_bs, self.max_blocks_per_seq, dtype=torch.int32, device=dev)
        self._g_cu = torch.arange(max_bs + 1, dtype=torch.int32, device=dev)
        # Host staging of the replay inputs, allocated once: pinning fresh tensors every step costs
        # pinned-memory allocations on the critical path. Before rewriting them, _replay waits on the
        # event recorded after the previous uploads (normally long done: the sampler synchronises).
        pin = dev.type == "cuda"
        self._h_event = torch.cuda.Event() if cuda else None
        self._h_ids = torch.zeros(3, max_bs, dtype=torch.long, pin_memory=pin)  # ids, positions, slots
        self._h_seqlens = torch.ones(max_bs, dtype=torch.int32, pin_memory=pin)
        self._h_tables = torch.zeros(max_bs, self.max_blocks_per_seq, dtype=torch.int32, pin_memory=pin)
        self._graphs.clear()
        buckets = graph_batch_sizes(max_bs)
        pool = None
        try:
            todo: list[tuple[int, tuple[int, int]]] = []
            prev = 0
            for b in buckets:
                todo.extend((b, launch) for launch in self._possible_launches(b, prev))
                prev = b
            # Largest first, so later (smaller) graphs reuse the pool's memory.
            for b, launch in sorted(todo, reverse=True):
                meta = self._graph_meta(b, launch)

                def fwd(b: int = b, meta: AttentionMetadata = meta) -> Tensor:
                    return self.model.forward(self._g_ids[:b], self._g_pos[:b], self.kv_caches, meta)

                # Warm-up outside the graph compiles the Triton kernels and runs lazy initialisation
                # (the static slots are -1: nothing is written to the cache).
                out = fwd()
                if cuda:
                    torch.cuda.synchronize(dev)
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g, pool=pool):
                        out = fwd()
                    pool = g.pool()
                    replay = g.replay
                else:
                    replay = functools.partial(_rerun_into, fwd, out)
                # The output lives in the graph pool; each replay rewrites it in place.
                self._graphs[(b, *launch)] = _Graph(replay, b, launch, meta, out)
            if cuda:
                torch.cuda.synchronize(dev)
        except Exception as e:  # capture is an optimisation: fall back to eager, loudly
            warnings.warn(
                f"CUDA graph capture failed, decode runs eagerly: {type(e).__name__}: {e}", stacklevel=2
            )
            self._graphs.clear()
        self._graph_buckets = sorted({key[0] for key in self._graphs})
        self.graph_capture_s = time.perf_counter() - t0

    def _graph_meta(self, b: int, launch: tuple[int, int]) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self._g_slots[:b],
            block_table=self._g_tables[:b],
            seqlens_k=self._g_seqlens[:b],
            cu_seqlens_q=self._g_cu[: b + 1],
            max_seqlen_q=1,
            max_seqlen_k=self.max_model_len,
            decode_only=True,
            prefix_free=False,
            decode_plan=self._decode_plan(b, self.max_model_len, launch),
        )

    def _find_graph(self, batch: int, choice: LaunchChoice) -> _Graph | None:
        for b in self._graph_buckets:
            if b >= batch:
                return self._graphs.get((b, *self._launch_key(choice)))
        return None

    def _replay(self, g: _Graph, batch: StepBatch) -> Tensor:
        b, n = g.batch, batch.num_seqs
        width = max(math.ceil(batch.max_seqlen_k / self.block_size), 1)
        if self._h_event is not None:
            self._h_event.synchronize()  # the previous step's uploads have read the staging buffers
        h = self._h_ids.numpy()
        h[0, :n] = batch.input_ids
        h[1, :n] = batch.positions
        h[2, :n] = batch.slot_mapping
        h[:2, n:b] = 0
        h[2, n:b] = -1  # padded rows write no KV
        hs = self._h_seqlens.numpy()
        hs[:n] = batch.seqlens_k
        hs[n:b] = 1
        self._fill_block_table(self._h_tables.numpy(), batch.block_tables, width)
        # Pinned staging -> static device buffers, asynchronously (whole rows: contiguous sources; the
        # table entries past a sequence's own blocks are never read).
        self._g_ids[:b].copy_(self._h_ids[0, :b], non_blocking=True)
        self._g_pos[:b].copy_(self._h_ids[1, :b], non_blocking=True)
        self._g_slots[:b].copy_(self._h_ids[2, :b], non_blocking=True)
        self._g_seqlens[:b].copy_(self._h_seqlens[:b], non_blocking=True)
        self._g_tables[:n].copy_(self._h_tables[:n], non_blocking=True)
        if self._h_event is not None:
            self._h_event.record()
        g.replay()
        return g.out[:n]

    def close(self) -> None:
        """Drop the graphs and the KV cache (frees device memory)."""
        self._graphs.clear()
        self._graph_buckets = []
        self._decode_plans.clear()
        self.kv_caches = []


def _default_profile(device: torch.device) -> Any:
    """The hardware profile the planner uses: this GPU's datasheet profile, or the stored CPU one."""
    from flashpage.roofline.hardware import detect_profile, load_profile

    if device.type == "cuda":
        return detect_profile()
    try:
        return load_profile("cpu")
    except (ValueError, OSError):
        return load_profile("h200")
