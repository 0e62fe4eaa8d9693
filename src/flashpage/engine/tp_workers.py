"""The engine's tensor-parallel ranks: start-up, the step broadcast, the workers' step loop, shutdown.

``LLM(..., tensor_parallel_size=N)``: rank 0 runs the scheduler, block manager and sampler. Every
step it broadcasts the step's flattened inputs (token ids, positions, slot mapping, block tables, context
lengths, copy-on-write copies, flags) as two int64 tensors over a gloo control group (:class:`StepChannel`;
nothing is pickled), every rank runs the model forward on its shard with its own KV cache of its heads,
and the logits come back to rank 0. Without ``torchrun``, rank 0 spawns ranks ``1..N-1`` with
``torch.multiprocessing`` (spawn context) on ``127.0.0.1`` and a free port; under ``torchrun``
(``WORLD_SIZE`` set, equal to ``N``) rank 0 is the engine and the other ranks serve steps inside
``LLM(...)`` and exit when rank 0 closes. Backend: NCCL on CUDA (rank ``r`` on ``cuda:LOCAL_RANK``), gloo
on CPU. Each rank's :class:`~flashpage.engine.model_runner.ModelRunner` captures its own decode CUDA graphs
(the all-reduces are captured with them) in the same order on every rank.

The parallel layers, the head split and the sharding itself are the torch-only building blocks of
:mod:`flashpage.distributed.tensor_parallel`.
"""

from __future__ import annotations

import atexit
import datetime
import math
import os
import socket
import traceback
import weakref
from collections.abc import Sequence as Seq
from typing import Any

import torch
import torch.distributed as dist

from flashpage.distributed.tensor_parallel import (
    TensorParallel,
    check_tensor_parallel,
    local_config,
    shard_model_,
)
from flashpage.engine.engine_core import runner_config
from flashpage.engine.model_runner import ModelRunner, StepBatch

__all__ = [
    "StepChannel",
    "TensorParallelDriver",
    "local_rank",
    "rank_device",
    "serve_launched_worker",
    "start_tensor_parallel",
    "torchrun_rank",
]

#: Timeout of every collective (and of start-up): a rank that dies or hangs surfaces as an error on the
#: others after at most this long (gloo reports a closed peer at once; NCCL needs the timeout).
COLLECTIVE_TIMEOUT_S = 300.0

#: Timeout of the control group's step broadcast, on which idle workers wait between requests: an idle
#: engine must not time its workers out (a dead rank 0 still closes their gloo sockets at once).
IDLE_TIMEOUT_S = 365 * 24 * 3600.0

#: How long close() waits for the workers to exit after the stop message before killing them.
SHUTDOWN_WAIT_S = 30.0


# ----------------------------------------------------------------------------------------------------------
# Step broadcast (rank 0 -> workers), without pickling
# ----------------------------------------------------------------------------------------------------------

_STOP, _STEP = 0, 1
_HEADER = 12  # cmd, T, B, width, samples, copies, keep, max_q, max_k, decode_only, prefix_free, spare


class StepChannel:
    """Sends one engine step's inputs from rank 0 to the other ranks as two int64 CPU tensors.

    The header ``(12,)`` holds the command and the sizes; the payload is the concatenation of
    ``input_ids, positions, slot_mapping (T each), seqlens_k (B), cu_seqlens_q (B + 1), block_tables
    (B * width, right-padded with block 0), sample_rows, copies (2 per copy), keep_hidden``.

    Args:
        group: a gloo process group (CPU tensors) holding every rank; ``src`` its rank 0's global rank.
    """

    def __init__(self, group: Any, src: int = 0) -> None:
        self.group = group
        self.src = src

    def send_step(
        self, batch: Any, copies: Seq[tuple[int, int]], keep_hidden: Seq[int], block_size: int
    ) -> None:
        """Broadcast a :class:`~flashpage.engine.model_runner.StepBatch` (rank 0)."""
        width = max(math.ceil(batch.max_seqlen_k / block_size), 1)
        b = batch.num_seqs
        tables = torch.zeros(b, width, dtype=torch.long)
        for i, t in enumerate(batch.block_tables):
            row = t[:width]
            tables[i, : len(row)] = torch.as_tensor(row, dtype=torch.long)
        flat_copies = [x for pair in copies for x in pair]
        header = torch.tensor(
            [
                _STEP, batch.num_tokens, b, width, len(batch.sample_rows), len(copies), len(keep_hidden),
                batch.max_seqlen_q, batch.max_seqlen_k, int(batch.decode_only), int(batch.prefix_free), 0,
            ],
            dtype=torch.long,
        )  # fmt: skip
        payload = torch.cat(
            [
                torch.as_tensor(batch.input_ids + batch.positions + batch.slot_mapping, dtype=torch.long),
                torch.as_tensor(batch.seqlens_k + batch.cu_seqlens_q, dtype=torch.long),
                tables.flatten(),
                torch.as_tensor(list(batch.sample_rows) + flat_copies + list(keep_hidden), dtype=torch.long),
            ]
        )
        dist.broadcast(header, self.src, group=self.group)
        dist.broadcast(payload, self.src, group=self.group)

    def send_stop(self) -> None:
        """Tell the workers to leave their loop (rank 0)."""
        header = torch.zeros(_HEADER, dtype=torch.long)
        dist.broadcast(header, self.src, group=self.group)

    def recv_step(self) -> tuple[Any, list[tuple[int, int]], list[int]] | None:
        """Receive ``(batch, copies, keep_hidden)``, or ``None`` for stop (workers)."""
        header = torch.empty(_HEADER, dtype=torch.long)
        dist.broadcast(header, self.src, group=self.group)
        cmd, t, b, width, ns, nc, nk, max_q, max_k, decode_only, prefix_free, _ = header.tolist()
        if cmd == _STOP:
            return None
        if cmd != _STEP:
            raise RuntimeError(f"tensor parallel: unknown command {cmd} from rank 0")
        payload = torch.empty(3 * t + 2 * b + 1 + b * width + ns + 2 * nc + nk, dtype=torch.long)
        dist.broadcast(payload, self.src, group=self.group)
        p = payload.tolist()
        o = 0

        def take(k: int) -> list[int]:
            nonlocal o
            o += k
            return p[o - k : o]

        batch = StepBatch(
            input_ids=take(t),
            positions=take(t),
            slot_mapping=take(t),
            seqlens_k=take(b),
            cu_seqlens_q=take(b + 1),
            max_seqlen_q=max_q,
            max_seqlen_k=max_k,
            decode_only=bool(decode_only),
            prefix_free=bool(prefix_free),
        )
        batch.block_tables = [take(width) for _ in range(b)]
        batch.sample_rows = take(ns)
        flat = take(2 * nc)
        copies = [(flat[2 * i], flat[2 * i + 1]) for i in range(nc)]
        return batch, copies, take(nk)


# ----------------------------------------------------------------------------------------------------------
# Process start-up and the engine hooks
# ----------------------------------------------------------------------------------------------------------


def _free_port() -> int:
    """A free TCP port on 127.0.0.1, chosen by the OS."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_device(device: torch.device, local_rank: int) -> torch.device:
    """The device of a rank: ``cuda:local_rank`` on CUDA (one GPU per rank), else ``device``."""
    if device.type == "cuda":
        return torch.device("cuda", local_rank)
    return device


def _init_group(
    backend: str, rank: int, world_size: int, init_method: str | None
) -> tuple[TensorParallel, Any]:
    """Initialise the default group (unless already done) and a gloo control group over the same ranks
    (CPU tensors, no timeout while idle)."""
    timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    if not dist.is_initialized():
        dist.init_process_group(
            backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timeout
        )
    tp = TensorParallel.from_group(None)
    ctrl = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=IDLE_TIMEOUT_S))
    return tp, ctrl


def _runner_for_rank(engine_config: Any, model: Any, model_config: Any, tp: TensorParallel, device: torch.device, dtype: torch.dtype, sampler_probe: Any = None) -> Any:  # fmt: skip
    """Shard ``model`` and build this rank's model runner (same options, same order on every rank)."""
    shard_model_(model, tp)
    return ModelRunner(
        model,
        local_config(model_config, tp.world_size),
        device=device,
        dtype=dtype,
        config=runner_config(engine_config, device),
        sampler_probe=sampler_probe,
        agree_num_blocks=lambda n: _min_over_group(n, device),
    )


def _min_over_group(n: int, device: torch.device) -> int:
    """The smallest ``n`` over the ranks (the block manager on rank 0 must fit every rank's cache)."""
    t = torch.tensor([n], dtype=torch.long, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def _set_cpu_threads(world_size: int) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))


def _serve_steps(engine_config: Any, tp: TensorParallel, ctrl: Any, device: torch.device, dtype: torch.dtype) -> None:  # fmt: skip
    """A worker rank: load, shard, build the runner, then run every step rank 0 sends until stop."""
    from flashpage.models.loader import load_model

    loaded = load_model(
        engine_config.model,
        dtype=dtype,
        device=device,
        load_format=engine_config.load_format,
        config=engine_config.model_config,
        seed=engine_config.seed,
    )
    runner = _runner_for_rank(engine_config, loaded.model, loaded.config, tp, device, dtype)
    channel = StepChannel(ctrl)
    try:
        while True:
            msg = channel.recv_step()
            if msg is None:
                break
            batch, copies, keep = msg
            runner.execute_batch(batch, copies, keep_hidden=keep)
    finally:
        runner.close()


def _spawned_worker(rank: int, world_size: int, port: int, engine_config: Any, device: torch.device, dtype: torch.dtype) -> None:  # fmt: skip
    """Entry point of a process spawned by rank 0 (errors are printed and exit with status 1)."""
    try:
        if device.type == "cpu":
            _set_cpu_threads(world_size)
        backend = "nccl" if device.type == "cuda" else "gloo"
        device = rank_device(device, rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)  # before the group: NCCL binds this rank to its GPU
        tp, ctrl = _init_group(backend, rank, world_size, f"tcp://127.0.0.1:{port}")
        _serve_steps(engine_config, tp, ctrl, device, dtype)
    except BaseException:
        traceback.print_exc()
        raise SystemExit(1) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class TensorParallelDriver:
    """Rank 0's side: the workers it spawned (if any), the step broadcast, and shutdown.

    Build with :func:`start_tensor_parallel`; the engine calls :meth:`build_runner`, sets
    :meth:`send_step` as the runner's step hook and calls :meth:`close` (also run at exit).
    """

    def __init__(self, tp: TensorParallel, ctrl: Any, procs: list[Any], device: torch.device) -> None:
        self.tp = tp
        self.device = device
        self.procs = procs
        self.channel = StepChannel(ctrl)
        self.closed = False
        atexit.register(_close_at_exit, weakref.ref(self))

    def build_runner(
        self, engine_config: Any, model: Any, model_config: Any, dtype: torch.dtype, sampler_probe: Any = None
    ) -> Any:
        """Shard rank 0's model and build its runner (the workers do the same at the same time)."""
        return _runner_for_rank(
            engine_config, model, model_config, self.tp, self.device, dtype, sampler_probe
        )

    def check_workers(self) -> None:
        """Raise ``RuntimeError`` if a spawned worker has exited."""
        for i, p in enumerate(self.procs, start=1):
            if not p.is_alive():
                raise RuntimeError(
                    f"tensor parallel: worker rank {i} exited (status {p.exitcode}); see its stderr"
                )

    def send_step(self, batch: Any, copies: Seq[tuple[int, int]], keep_hidden: Seq[int], block_size: int) -> None:  # fmt: skip
        """The runner's step hook: check the workers, then broadcast the step."""
        if self.closed:
            raise RuntimeError("tensor parallel: the engine is closed")
        self.check_workers()
        try:
            self.channel.send_step(batch, copies, keep_hidden, block_size)
        except RuntimeError as e:
            raise RuntimeError(f"tensor parallel: a worker rank is gone ({e})") from e

    def abort(self) -> None:
        """Kill the workers at once and leave the group (start-up failed half-way). Idempotent."""
        self.closed = True
        for p in self.procs:
            if p.is_alive():
                p.kill()
            p.join(5)
        if dist.is_initialized():
            dist.destroy_process_group()

    def close(self) -> None:
        """Stop the workers (stop message, then join; kill after :data:`SHUTDOWN_WAIT_S`) and leave the
        group. Idempotent."""
        if self.closed:
            return
        self.closed = True
        try:
            if all(p.is_alive() for p in self.procs):
                self.channel.send_stop()
        except RuntimeError:
            pass  # a worker is already gone: kill the rest below
        for p in self.procs:
            p.join(SHUTDOWN_WAIT_S)
            if p.is_alive():
                p.kill()
                p.join(5)
        if dist.is_initialized():
            dist.destroy_process_group()


def _close_at_exit(ref: weakref.ref) -> None:
    driver = ref()
    if driver is not None:
        driver.close()


def local_rank() -> int:
    """``LOCAL_RANK`` under ``torchrun`` (the GPU index of this rank on its node), else 0."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def torchrun_rank() -> int | None:
    """This process's rank when launched by ``torchrun`` (``WORLD_SIZE`` set) or in an initialised group,
    else ``None``."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    if "WORLD_SIZE" in os.environ:
        return int(os.environ.get("RANK", "0"))
    return None


def _launched_group(engine_config: Any, device: torch.device) -> tuple[TensorParallel, Any, torch.device]:
    """Join the group ``torchrun`` launched (or the one already initialised)."""
    n = engine_config.tensor_parallel_size
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ["WORLD_SIZE"])
    if world != n:
        raise ValueError(f"tensor_parallel_size: {n} differs from the launched world size {world}")
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ["RANK"])
    dev = rank_device(device, int(os.environ.get("LOCAL_RANK", rank)))
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    backend = "nccl" if device.type == "cuda" else "gloo"
    tp, ctrl = _init_group(backend, rank, n, "env://")
    return tp, ctrl, dev


def serve_launched_worker(engine_config: Any, device: torch.device, dtype: torch.dtype) -> None:
    """A ``torchrun`` rank other than 0: serve rank 0's steps until it closes, then leave the group."""
    tp, ctrl, dev = _launched_group(engine_config, device)
    try:
        _serve_steps(engine_config, tp, ctrl, dev, dtype)
    finally:
        dist.destroy_process_group()


def start_tensor_parallel(engine_config: Any, model_config: Any, device: torch.device, dtype: torch.dtype) -> TensorParallelDriver:  # fmt: skip
    """Become rank 0 of ``engine_config.tensor_parallel_size`` ranks: join the ``torchrun`` group, or
    spawn ranks ``1..N-1`` (spawn context, ``127.0.0.1``, a free port).

    Raises:
        ValueError: ``"tensor_parallel_size: ..."`` for heads that do not divide, a world size that
            differs, or too few GPUs.
    """
    n = engine_config.tensor_parallel_size
    check_tensor_parallel(model_config, n)
    if torchrun_rank() is not None:
        tp, ctrl, dev = _launched_group(engine_config, device)
        return TensorParallelDriver(tp, ctrl, [], dev)
    if device.type == "cuda" and torch.cuda.device_count() < n:
        raise ValueError(
            f"tensor_parallel_size: {n} ranks need {n} GPUs, {torch.cuda.device_count()} are visible"
        )
    port = _free_port()
    ctx = torch.multiprocessing.get_context("spawn")
    procs = [
        ctx.Process(target=_spawned_worker, args=(r, n, port, engine_config, device, dtype), daemon=True)
        for r in range(1, n)
    ]
    for p in procs:
        p.start()
    dev = rank_device(device, 0)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    try:
        tp, ctrl = _init_group("nccl" if device.type == "cuda" else "gloo", 0, n, f"tcp://127.0.0.1:{port}")
    except BaseException:
        for p in procs:
            p.kill()
        raise
    return TensorParallelDriver(tp, ctrl, procs, dev)
