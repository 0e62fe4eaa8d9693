"""``flashpage netprobe``: latency and bus bandwidth of the collectives ring attention and tensor
parallelism use, the transport NCCL chose for every peer, and a plain verdict on RDMA.

Run under ``torchrun`` (one process per GPU, any number of nodes)::

    torchrun --nproc-per-node 8 -m flashpage.cli netprobe [--json] [--save-profile link.json]

Measurements follow nccl-tests: for a message of ``S`` bytes taking ``t`` seconds (the slowest
rank's mean over ``iters`` runs), ``algbw = S / t`` and ``busbw = algbw * factor`` with factor
``2 (n - 1) / n`` for all-reduce, ``(n - 1) / n`` for all-gather (``S`` = the gathered total) and 1
for send/recv (every rank sends ``S`` bytes to the next rank and receives from the previous, as
nccl-tests' ``sendrecv_perf``). ``busbw`` is comparable to the link's per-direction bandwidth.

Transports: the probe sets ``NCCL_DEBUG=INFO`` (and ``NCCL_DEBUG_FILE``, unless the user set them)
before NCCL starts, then parses NCCL's own lines::

    ... NCCL INFO Channel 00/0 : 0[0] -> 8[0] [send] via NET/IB/0/GDRDMA
    ... NCCL INFO Channel 01 : 1[a000] -> 0[7000] via P2P/IPC/read
    ... NCCL INFO NET/IB : Using [0]mlx5_0:1/IB ; OOB ib0:192.168.11.1<0>

``--save-profile`` writes a :class:`flashpage.roofline.links.LinkProfile` (send/recv bus bandwidth
at the largest size, latency at the smallest) that ``flashpage roofline --link FILE`` loads.
"""

from __future__ import annotations

import glob
import os
import re
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "BUSBW_FACTORS",
    "NcclTransports",
    "PeerLink",
    "busbw_factor",
    "classify_via",
    "parse_nccl_log",
    "run_probe",
    "verdict",
]

#: nccl-tests' bus-bandwidth factors, as functions of the world size n.
BUSBW_FACTORS = {
    "all_reduce": lambda n: 2.0 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "sendrecv": lambda n: 1.0,
}

_CHANNEL_RE = re.compile(
    r"Channel (\d+)(?:/\d+)? : (\d+)\[[0-9a-fA-Fx]+\] -> (\d+)\[[0-9a-fA-Fx]+\]"
    r"(?: \[(send|receive)\])? via (\S+)"
)
_NET_USING_RE = re.compile(r"NET/(IB|Socket)\s*: Using (.+)")


def busbw_factor(op: str, world: int) -> float:
    """nccl-tests' factor from algorithm bandwidth to bus bandwidth."""
    if op not in BUSBW_FACTORS:
        raise ValueError(f"op: unknown collective {op!r}; expected one of {', '.join(BUSBW_FACTORS)}")
    return BUSBW_FACTORS[op](world)


def classify_via(via: str) -> tuple[str, bool]:
    """``(kind, gpudirect)`` of a ``via ...`` field: kind ``ib`` (NET/IB and IB plugins such as
    NET/IBext), ``socket``, ``net`` (other network plugins), ``p2p`` (NVLink or PCIe peer access),
    ``shm`` (host shared memory), ``collnet`` or ``other``; ``gpudirect`` when it ends in GDRDMA."""
    gdr = "GDRDMA" in via.upper().split("/")
    if via.startswith("NET/IB"):
        return "ib", gdr
    if via.startswith("NET/Socket"):
        return "socket", gdr
    if via.startswith("NET/"):
        return "net", gdr
    if via.startswith("P2P"):
        return "p2p", False
    if via.startswith("SHM"):
        return "shm", False
    if via.upper().startswith("COLLNET"):
        return "collnet", gdr
    return "other", gdr


@dataclass(frozen=True)
class PeerLink:
    """The transport between two ranks as NCCL logged it (``via`` fields, deduplicated)."""

    src: int
    dst: int
    kind: str
    gpudirect: bool
    via: tuple[str, ...]


@dataclass
class NcclTransports:
    """What NCCL's INFO output says about the fabric."""

    peers: list[PeerLink] = field(default_factory=list)
    nets: list[str] = field(default_factory=list)  # "IB : [0]mlx5_0:1/IB ; OOB ..." lines

    @property
    def kinds(self) -> set[str]:
        return {p.kind for p in self.peers}

    def to_dict(self) -> dict[str, Any]:
        return {"peers": [asdict(p) for p in self.peers], "nets": list(self.nets)}


def parse_nccl_log(text: str) -> NcclTransports:
    """Parse NCCL ``NCCL_DEBUG=INFO`` output (any number of ranks' lines, any NCCL 2.x format)."""
    vias: dict[tuple[int, int], set[str]] = {}
    nets: list[str] = []
    for line in text.splitlines():
        m = _CHANNEL_RE.search(line)
        if m:
            vias.setdefault((int(m.group(2)), int(m.group(3))), set()).add(m.group(5))
            continue
        n = _NET_USING_RE.search(line)
        if n:
            entry = f"{n.group(1)} : {n.group(2).strip()}"
            if entry not in nets:
                nets.append(entry)
    peers = []
    for (src, dst), vs in sorted(vias.items()):
        classes = [classify_via(v) for v in sorted(vs)]
        # one peer pair may use several channels: report the slowest kind seen
        order = ["socket", "other", "net", "ib", "collnet", "shm", "p2p"]
        kind = min((k for k, _ in classes), key=order.index)
        gdr = all(g for k, g in classes if k == kind)
        peers.append(PeerLink(src, dst, kind, gdr, tuple(sorted(vs))))
    return NcclTransports(peers, nets)


_SOCKET_HINT = (
    "falling back to TCP sockets: check NCCL_IB_HCA / NCCL_SOCKET_IFNAME, that the InfiniBand/RoCE devices "
    "are up (ibstat, ibv_devinfo), that NCCL_IB_DISABLE is not set, and that the container sees /dev/infiniband"
)


def verdict(t: NcclTransports, backend: str = "nccl") -> str:
    """One plain sentence on the network path NCCL took (the worst peer decides)."""
    if backend != "nccl":
        return f"{backend} backend: NCCL transports do not apply (gloo uses TCP sockets)"
    if not t.peers:
        return "no NCCL transport lines found (single rank, or NCCL_DEBUG output not captured)"
    kinds = t.kinds
    roce = any("/RoCE" in n for n in t.nets)
    if "socket" in kinds:
        return _SOCKET_HINT
    if "ib" in kinds or "net" in kinds or "collnet" in kinds:
        net = [p for p in t.peers if p.kind in ("ib", "net", "collnet")]
        fabric = "RoCE" if roce else "InfiniBand"
        if all(p.gpudirect for p in net):
            return f"RDMA in use (GPUDirect) over {fabric}"
        return (
            f"{fabric} without GPUDirect: GPU buffers are staged through host memory (load nvidia-peermem or "
            "use a DMA-BUF capable driver; check NCCL_NET_GDR_LEVEL)"
        )
    if "p2p" in kinds and "shm" not in kinds:
        return "single node: GPUs talk directly over P2P (NVLink or PCIe); no network in use"
    return "single node: some GPU pairs go through host shared memory (SHM): no P2P between them"


# ---------------------------------------------------------------------------------------------------
# Measurement
# ---------------------------------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_op(fn: Any, device: torch.device, warmup: int, iters: int, group: Any) -> float:
    """Mean seconds per call, the slowest rank's."""
    for _ in range(warmup):
        fn()
    _sync(device)
    dist.barrier(group=group)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync(device)
    dt = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64, device=device)
    dist.all_reduce(dt, op=dist.ReduceOp.MAX, group=group)
    return float(dt.item())


def _ops(nbytes: int, world: int, rank: int, device: torch.device, group: Any) -> dict[str, Any]:
    """The probed collectives on a message of ``nbytes`` (float32 elements, as nccl-tests)."""
    n = max(1, nbytes // 4)
    buf = torch.ones(n, dtype=torch.float32, device=device)
    per = max(1, n // world)
    gathered = torch.empty(per * world, dtype=torch.float32, device=device)
    piece = torch.ones(per, dtype=torch.float32, device=device)
    recv = torch.empty_like(buf)
    nxt, prv = (rank + 1) % world, (rank - 1) % world

    def sendrecv() -> None:
        ops = [dist.P2POp(dist.isend, buf, nxt, group), dist.P2POp(dist.irecv, recv, prv, group)]
        for req in dist.batch_isend_irecv(ops):
            req.wait()

    ops = {
        "all_reduce": (lambda: dist.all_reduce(buf, group=group), n * 4),
        "all_gather": (lambda: dist.all_gather_into_tensor(gathered, piece, group=group), per * world * 4),
        "sendrecv": (sendrecv, n * 4),
    }
    if world == 1:  # no peer to send to: the collectives still time the local path
        del ops["sendrecv"]
    return ops


def run_probe(
    sizes: Sequence[int],
    *,
    iters: int = 20,
    warmup: int = 5,
    group: Any = None,
    device: torch.device | None = None,
) -> list[dict[str, Any]]:
    """Time every collective at every message size (bytes) on the initialised process group.

    Returns rows ``{op, bytes, time_us, algbw_gbps, busbw_gbps}`` (the same on every rank); a
    group of one rank has no send/recv rows (and bus bandwidth 0: nothing crosses a link).
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("group: no torch.distributed process group is initialized (run under torchrun)")
    if iters < 1 or warmup < 0:
        raise ValueError(f"iters: must be >= 1 (got {iters}) with warmup >= 0 (got {warmup})")
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if device is None:
        device = (
            torch.device("cuda", torch.cuda.current_device())
            if dist.get_backend(group) == "nccl"
            else torch.device("cpu")
        )
    rows = []
    for size in sizes:
        if size < 1:
            raise ValueError(f"sizes: message sizes must be >= 1 byte, got {size}")
        for op, (fn, nbytes) in _ops(int(size), world, rank, device, group).items():
            t = _time_op(fn, device, warmup, iters, group)
            algbw = nbytes / t
            rows.append(
                {
                    "op": op,
                    "bytes": nbytes,
                    "time_us": t * 1e6,
                    "algbw_gbps": algbw / 1e9,
                    "busbw_gbps": algbw * busbw_factor(op, world) / 1e9,
                }
            )
    return rows


def link_from_rows(rows: list[dict[str, Any]], name: str) -> tuple[float, float]:
    """``(bandwidth bytes/s, latency s)`` for a link profile: send/recv bus bandwidth at the largest
    size and its time at the smallest."""
    sr = sorted((r for r in rows if r["op"] == "sendrecv"), key=lambda r: r["bytes"])
    if not sr:
        raise ValueError(f"{name}: no sendrecv rows measured")
    return sr[-1]["busbw_gbps"] * 1e9, sr[0]["time_us"] * 1e-6


def capture_nccl_debug() -> str | None:
    """Point NCCL's INFO output at a fresh directory (before NCCL initialises; sets ``NCCL_DEBUG``
    and ``NCCL_DEBUG_SUBSYS``); returns the directory, or None when the user already set
    ``NCCL_DEBUG_FILE`` (then nothing is parsed)."""
    if "NCCL_DEBUG_FILE" in os.environ:
        return None
    d = tempfile.mkdtemp(prefix="flashpage-netprobe-")
    # The output goes to our file, not the console, so the level and subsystems are ours to pick:
    # the transport lines are INFO messages of the INIT and NET subsystems.
    os.environ["NCCL_DEBUG"] = "INFO"
    os.environ["NCCL_DEBUG_SUBSYS"] = "INIT,NET"
    os.environ["NCCL_DEBUG_FILE"] = os.path.join(d, "nccl.%h.%p.log")
    return d


def read_nccl_debug(directory: str | None) -> str:
    if directory is None:
        return ""
    text = []
    for path in sorted(glob.glob(os.path.join(directory, "nccl.*.log"))):
        with open(path, errors="replace") as f:
            text.append(f.read())
    return "\n".join(text)


def format_rows(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'op':<11} {'bytes':>12} {'time us':>10} {'algbw GB/s':>11} {'busbw GB/s':>11}"]
    for r in rows:
        lines.append(
            f"{r['op']:<11} {r['bytes']:>12} {r['time_us']:>10.1f} {r['algbw_gbps']:>11.3f} {r['busbw_gbps']:>11.3f}"
        )
    return "\n".join(lines) + "\n"


def main(
    *,
    sizes: Sequence[int],
    iters: int,
    warmup: int,
    backend: str | None,
    as_json: bool,
    save_profile: str | None,
) -> int:
    """The ``flashpage netprobe`` command (every rank runs it; rank 0 prints and saves)."""
    import json

    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise ValueError(
            "netprobe: RANK / WORLD_SIZE are not set: run under torchrun, e.g. "
            "torchrun --nproc-per-node 8 -m flashpage.cli netprobe"
        )
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    nccl_dir = capture_nccl_debug() if backend == "nccl" else None
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend)
    try:
        rows = run_probe(sizes, iters=iters, warmup=warmup)
        dist.barrier()
        logs: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(logs, read_nccl_debug(nccl_dir))
        rank, world = dist.get_rank(), dist.get_world_size()
    finally:
        dist.destroy_process_group()
    if rank != 0:
        return 0
    transports = parse_nccl_log("\n".join(s for s in logs if s))
    result = {
        "world": world,
        "backend": backend,
        "rows": rows,
        "transports": transports.to_dict(),
        "verdict": verdict(transports, backend),
    }
    if save_profile:
        from flashpage.roofline.links import LinkProfile, save_link

        bw, lat = link_from_rows(rows, "save_profile")
        link = LinkProfile(
            f"measured-{backend}", bw, lat, f"flashpage netprobe, world {world}: {result['verdict']}"
        )
        save_link(link, save_profile, {"netprobe": result})
    if as_json:
        print(json.dumps(result, indent=1))
        return 0
    print(f"netprobe: world {world}, backend {backend}")
    print(format_rows(rows), end="")
    for p in transports.peers:
        print(f"  {p.src} -> {p.dst}: {p.kind}{' (GPUDirect)' if p.gpudirect else ''} via {', '.join(p.via)}")
    for n in transports.nets:
        print(f"  NET/{n}")
    print(f"verdict: {result['verdict']}")
    if save_profile:
        print(f"link profile written to {save_profile}")
    return 0
