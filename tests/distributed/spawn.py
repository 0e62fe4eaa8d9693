"""Run a function on ``world`` spawned processes joined by a gloo group on 127.0.0.1 (a free port
picked at run time), bounded by a timeout; each rank returns a JSON-able dict."""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(
    rank: int, fn: Callable[..., dict], world: int, port: int, outdir: str, arg: Any, backend: str
) -> None:
    torch.set_num_threads(1)  # tiny problems: threads only add contention on a shared machine
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        result = fn(rank, world, arg)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def run_ranks(
    fn: Callable[..., dict], world: int, arg: Any = None, timeout: float = 120.0, backend: str = "gloo"
) -> list[dict]:
    """``[fn(rank, world, arg) for each rank]``, run in ``world`` processes with a ``backend`` group
    (``nccl``: rank ``r`` on GPU ``r``).

    Raises:
        TimeoutError: the ranks did not finish within ``timeout`` seconds (they are killed).
    """
    with tempfile.TemporaryDirectory() as outdir:
        ctx = mp.start_processes(
            _entry,
            args=(fn, world, free_port(), outdir, arg, backend),
            nprocs=world,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                raise TimeoutError(f"{world} ranks did not finish within {timeout} s")
        results = []
        for r in range(world):
            with open(os.path.join(outdir, f"rank{r}.json")) as f:
                results.append(json.load(f))
        return results
