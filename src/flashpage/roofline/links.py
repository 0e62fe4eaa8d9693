"""Link profiles: the bandwidth and latency of the fabrics between GPUs, for the communication side of
the roofline (``flashpage roofline --world N --link NAME``).

A :class:`LinkProfile` holds the per-direction bandwidth one GPU gets on the link (bytes/s) and a
one-way small-message latency (seconds). Built-in profiles come from datasheets and standards
(bidirectional totals halved, line rates in bits divided by 8); latencies are not datasheet
figures but typical orders of magnitude, marked as such: ``flashpage netprobe --save-profile FILE``
measures both on the real fabric and writes a profile :func:`load_link` reads.

Built-in names: ``nvlink4``, ``pcie5``, ``ib-ndr``, ``ib-hdr``, ``roce-400g``, ``roce-200g``, ``tcp``.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = ["LinkProfile", "builtin_link_names", "builtin_links", "load_link", "save_link"]

_G = 1e9


@dataclass(frozen=True)
class LinkProfile:
    """One link type between GPUs.

    Attributes:
        name: short name (``nvlink4``, ``ib-ndr``, ``measured-nccl``...).
        bandwidth: bytes/s per direction per GPU.
        latency: one-way small-message latency, seconds.
        source: where the figures come from.
    """

    name: str
    bandwidth: float
    latency: float
    source: str = ""

    def __post_init__(self) -> None:
        if not self.bandwidth > 0:
            raise ValueError(f"bandwidth: must be > 0 bytes/s, got {self.bandwidth!r}")
        if not self.latency >= 0:
            raise ValueError(f"latency: must be >= 0 s, got {self.latency!r}")

    def transfer_time(self, nbytes: float) -> float:
        """Least seconds to move ``nbytes`` one way: ``latency + nbytes / bandwidth``."""
        return self.latency + nbytes / self.bandwidth

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


_LAT_NOTE = "latency: typical order of magnitude, not a datasheet figure"


def builtin_links() -> dict[str, LinkProfile]:
    """The datasheet link profiles, built fresh on each call (no module-level mutable state)."""
    links = [
        # NVIDIA H100 SXM5 datasheet: "NVLink: 900GB/s" (fourth-generation NVLink, 18 links,
        # bidirectional total per GPU) -> 450 GB/s per direction. Latency ~2 us GPU to GPU.
        LinkProfile(
            "nvlink4",
            450 * _G,
            2e-6,
            "NVIDIA H100 SXM5 datasheet, NVLink 900 GB/s bidirectional; " + _LAT_NOTE,
        ),
        # PCI Express Base Specification 5.0: 32 GT/s per lane, 128b/130b encoding, x16
        # -> 32e9 * 16 * 128/130 / 8 = 63.0 GB/s per direction. Latency ~5 us GPU to GPU through the host.
        LinkProfile("pcie5", 63.0 * _G, 5e-6, "PCIe 5.0 spec: 32 GT/s x16, 128b/130b; " + _LAT_NOTE),
        # NVIDIA ConnectX-7 datasheet: InfiniBand NDR 400 Gb/s per port -> 50 GB/s per direction
        # (one HCA per GPU, as in DGX H100). Latency ~3 us GPU to GPU with GPUDirect RDMA.
        LinkProfile(
            "ib-ndr", 50 * _G, 3e-6, "NVIDIA ConnectX-7 datasheet, NDR 400 Gb/s per port; " + _LAT_NOTE
        ),
        # NVIDIA ConnectX-6 datasheet: InfiniBand HDR 200 Gb/s per port -> 25 GB/s per direction.
        LinkProfile(
            "ib-hdr", 25 * _G, 3e-6, "NVIDIA ConnectX-6 datasheet, HDR 200 Gb/s per port; " + _LAT_NOTE
        ),
        # IEEE 802.3bs/802.3ck 400GbE, RoCEv2 on ConnectX-7 -> 50 GB/s per direction; Ethernet
        # switching adds latency over InfiniBand (~5 us).
        LinkProfile("roce-400g", 50 * _G, 5e-6, "IEEE 802.3 400GbE (ConnectX-7 RoCEv2); " + _LAT_NOTE),
        # IEEE 802.3cd 200GbE, RoCEv2 on ConnectX-6 Dx -> 25 GB/s per direction.
        LinkProfile("roce-200g", 25 * _G, 5e-6, "IEEE 802.3 200GbE (ConnectX-6 Dx RoCEv2); " + _LAT_NOTE),
        # NCCL's NET/Socket fallback over a 100GbE NIC: line rate 12.5 GB/s per direction (sockets
        # usually reach well below it), through the kernel TCP stack and host memory (~30 us).
        LinkProfile("tcp", 12.5 * _G, 30e-6, "IEEE 802.3 100GbE line rate, NCCL NET/Socket; " + _LAT_NOTE),
    ]
    return {link.name: link for link in links}


def builtin_link_names() -> list[str]:
    return list(builtin_links())


def load_link(name_or_path: str | os.PathLike[str]) -> LinkProfile:
    """A built-in link by name, or a link profile JSON (``flashpage netprobe --save-profile``).

    Raises:
        ValueError: unknown name, unreadable or malformed file (naming the missing field).
    """
    links = builtin_links()
    key = str(name_or_path)
    if key in links:
        return links[key]
    path = Path(key)
    if not path.is_file():
        raise ValueError(
            f"link: unknown link {key!r}; expected one of {', '.join(links)} or a profile JSON file"
        )
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"link: cannot read {path}: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"link: {path} does not hold a JSON object")
    for f in ("name", "bandwidth", "latency"):
        if f not in data:
            raise ValueError(f"link: {path} is missing required field {f!r}")
    return LinkProfile(
        str(data["name"]), float(data["bandwidth"]), float(data["latency"]), str(data.get("source", ""))
    )


def save_link(link: LinkProfile, path: str | os.PathLike[str], extra: dict[str, Any] | None = None) -> Path:
    """Write ``link`` (plus ``extra`` fields, e.g. the measurements behind it) as JSON to ``path``."""
    out = Path(path)
    out.write_text(json.dumps({**link.to_dict(), **(extra or {})}, indent=1) + "\n")
    return out
