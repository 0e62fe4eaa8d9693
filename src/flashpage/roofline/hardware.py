"""Hardware profiles: the ceilings of the roofline (peak FLOP/s per dtype, memory and link bandwidth).

A :class:`HardwareProfile` holds what the roofline needs to know about one accelerator:

- ``peak_flops``: dense (no 2:4 sparsity) matrix-multiply FLOP/s per dtype key ``fp32``, ``tf32``,
  ``fp16``, ``bf16``, ``fp8``; a missing key means the device has no such path.
- ``hbm_bandwidth``: device memory bandwidth in bytes/s.
- ``num_sms``, ``l2_bytes``, ``memory_bytes``: occupancy and capacity figures used by the planner.
- ``interconnects``: ``{"nvlink" | "pcie" | "infiniband" | "roce": Interconnect}``, each with the
  bandwidth per direction per GPU in bytes/s and a one-way small-message latency in seconds.

Built-in datasheet profiles: ``h100-sxm``, ``h200``, ``a100-80gb``, ``l40s``, ``rtx-4090``; ``cpu`` is
measured on the spot by :func:`flashpage.roofline.probe.probe` (kept nowhere). Profile files in
``roofline/profiles/*.json`` (e.g. ``h200-measured``) load by their file stem, and any path to a JSON
written by ``flashpage probe`` loads too.

A profile may carry ``efficiency``: per planner kernel name (``flash_fwd``, ``flash_bwd``,
``paged_decode``, ``paged_decode_splitkv``, ``paged_prefill``, ``matmul``), the fraction of the
roofline that kernel measured on this device (``flashpage bench all`` writes it from its results into
``benchmarks/results/probe-<gpu>.json``). The planner scales each op's attainable rate by it; a kernel
without an entry counts as 1.0. Profile JSON without the field (older files) load unchanged.

Conventions: datasheets quote "with sparsity" tensor figures; the dense figure (half of it) is what
real GEMMs can reach, so that is what is stored. Link bandwidths in datasheets are bidirectional
totals; the per-direction figure (half) is stored. Datasheets do not give latencies: the latency
figures are typical one-way small-message latencies, order of magnitude only, marked as such.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

__all__ = [
    "DTYPE_BYTES",
    "DTYPE_KEYS",
    "HardwareProfile",
    "Interconnect",
    "builtin_profile_names",
    "detect_profile",
    "dtype_bytes",
    "known_profile_names",
    "load_profile",
    "normalize_dtype",
    "profile_from_dict",
    "profile_from_gpu_name",
    "save_profile",
]

#: Dtype keys of ``HardwareProfile.peak_flops``.
DTYPE_KEYS: tuple[str, ...] = ("fp32", "tf32", "fp16", "bf16", "fp8")

#: Storage bytes per element of each dtype key (tf32 is stored as fp32).
DTYPE_BYTES: Mapping[str, int] = MappingProxyType({"fp32": 4, "tf32": 4, "fp16": 2, "bf16": 2, "fp8": 1})

# Accepted spellings -> dtype key. torch dtypes are matched through str(dtype) ("torch.bfloat16"),
# so this module never has to import torch.
_DTYPE_ALIASES: Mapping[str, str] = MappingProxyType(
    {
        "fp32": "fp32",
        "float32": "fp32",
        "float": "fp32",
        "f32": "fp32",
        "tf32": "tf32",
        "fp16": "fp16",
        "float16": "fp16",
        "half": "fp16",
        "f16": "fp16",
        "bf16": "bf16",
        "bfloat16": "bf16",
        "fp8": "fp8",
        "float8": "fp8",
        "float8_e4m3fn": "fp8",
        "float8_e5m2": "fp8",
        "float8_e4m3fnuz": "fp8",
        "float8_e5m2fnuz": "fp8",
    }
)


def normalize_dtype(dtype: Any) -> str:
    """Map a dtype spelling (``"bfloat16"``, ``"bf16"``, ``torch.bfloat16``...) to its key in DTYPE_KEYS.

    Raises:
        ValueError: naming ``dtype`` and the accepted keys when it is not a known floating dtype.
    """
    key = str(dtype).lower().removeprefix("torch.")
    if key not in _DTYPE_ALIASES:
        raise ValueError(f"dtype: unknown dtype {dtype!r}; expected one of {', '.join(DTYPE_KEYS)}")
    return _DTYPE_ALIASES[key]


def dtype_bytes(dtype: Any) -> int:
    """Bytes per element of ``dtype`` (any spelling accepted by :func:`normalize_dtype`)."""
    return DTYPE_BYTES[normalize_dtype(dtype)]


@dataclass(frozen=True)
class Interconnect:
    """One link type of a device.

    Attributes:
        bandwidth: bytes/s per direction per GPU.
        latency: one-way small-message latency in seconds.
        note: where the figures come from.
    """

    bandwidth: float
    latency: float
    note: str = ""

    def transfer_time(self, nbytes: float) -> float:
        """Least seconds to move ``nbytes`` one way over this link: latency + bytes / bandwidth."""
        return self.latency + nbytes / self.bandwidth


@dataclass(frozen=True)
class HardwareProfile:
    """The roofline ceilings of one device (all rates in SI units: FLOP/s, bytes/s, bytes, seconds).

    The mapping fields are read-only views and take no part in hashing, so a profile can be used as
    an ``lru_cache`` key while the name, bandwidth and SM count tell profiles apart.
    """

    name: str
    peak_flops: Mapping[str, float] = field(hash=False)
    hbm_bandwidth: float
    num_sms: int
    l2_bytes: int
    memory_bytes: int
    interconnects: Mapping[str, Interconnect] = field(default_factory=dict, hash=False)
    source: str = "datasheet"
    details: Mapping[str, Any] = field(default_factory=dict, hash=False, compare=False)
    efficiency: Mapping[str, float] = field(default_factory=dict, hash=False, compare=False)

    def __post_init__(self) -> None:
        peaks = {normalize_dtype(k): float(v) for k, v in dict(self.peak_flops).items() if v}
        if not peaks:
            raise ValueError(f"peak_flops: profile {self.name!r} has no positive peak FLOP/s")
        for k, v in peaks.items():
            if v <= 0:
                raise ValueError(f"peak_flops: {k} must be > 0, got {v}")
        if not self.hbm_bandwidth > 0:
            raise ValueError(f"hbm_bandwidth: must be > 0, got {self.hbm_bandwidth}")
        if int(self.num_sms) < 1:
            raise ValueError(f"num_sms: must be >= 1, got {self.num_sms}")
        object.__setattr__(self, "peak_flops", MappingProxyType(peaks))
        object.__setattr__(self, "interconnects", MappingProxyType(dict(self.interconnects)))
        object.__setattr__(self, "details", MappingProxyType(dict(self.details)))
        eff = {str(k): float(v) for k, v in dict(self.efficiency).items()}
        for k, v in eff.items():
            if not 0 < v <= 2:  # above 1: a kernel beat the probe's ceiling (e.g. cache-resident data)
                raise ValueError(f"efficiency: {k} must be in (0, 2], got {v}")
        object.__setattr__(self, "efficiency", MappingProxyType(eff))
        object.__setattr__(self, "num_sms", int(self.num_sms))

    def peak(self, dtype: Any) -> float:
        """Dense peak FLOP/s for ``dtype``.

        Raises:
            ValueError: if this device has no figure for the dtype (e.g. fp8 on A100).
        """
        key = normalize_dtype(dtype)
        if key not in self.peak_flops:
            raise ValueError(
                f"dtype: profile {self.name!r} has no peak FLOP/s for {key}; it has {', '.join(self.peak_flops)}"
            )
        return self.peak_flops[key]

    def ridge(self, dtype: Any) -> float:
        """Ridge point in FLOP/byte: the intensity above which ``dtype`` work is compute-bound."""
        return self.peak(dtype) / self.hbm_bandwidth

    def attainable(self, intensity: float, dtype: Any) -> float:
        """Roofline-attainable FLOP/s at ``intensity`` FLOP/byte: ``min(peak, intensity * bandwidth)``."""
        return min(self.peak(dtype), intensity * self.hbm_bandwidth)

    def efficiency_of(self, kernel: str) -> float:
        """Measured fraction of the roofline ``kernel`` reaches here (1.0 when not measured)."""
        return self.efficiency.get(kernel, 1.0)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict; :func:`profile_from_dict` reads it back (``efficiency`` only when set)."""
        out = {
            "name": self.name,
            "source": self.source,
            "peak_flops": dict(self.peak_flops),
            "hbm_bandwidth": self.hbm_bandwidth,
            "num_sms": self.num_sms,
            "l2_bytes": self.l2_bytes,
            "memory_bytes": self.memory_bytes,
            "interconnects": {
                k: {"bandwidth": v.bandwidth, "latency": v.latency, "note": v.note}
                for k, v in self.interconnects.items()
            },
            "details": dict(self.details),
        }
        if self.efficiency:
            out["efficiency"] = dict(self.efficiency)
        return out


# ---------------------------------------------------------------------------------------------------
# Datasheet profiles. T = 1e12, G = 1e9, MB = 2**20 bytes for caches (NVIDIA quotes L2 in binary MB).
# ---------------------------------------------------------------------------------------------------
_T = 1e12
_G = 1e9
_MIB = 2**20

# Link latencies are NOT datasheet figures (datasheets give none): typical one-way small-message
# latencies, order of magnitude (CUDA p2pBandwidthLatencyTest-style GPU<->GPU over NVLink ~2 us,
# over PCIe ~5 us; InfiniBand verbs ib_write_lat ~1-2 us plus GPUDirect overhead). Measure real ones
# with a network probe before relying on them.
_LAT_NVLINK = 2e-6
_LAT_PCIE = 5e-6
_LAT_IB = 3e-6
_LAT_NOTE = "latency: typical order of magnitude, not a datasheet figure"


def _h100_like(name: str, hbm: float, mem: float, mem_note: str) -> HardwareProfile:
    return HardwareProfile(
        name=name,
        # H100 SXM5 / H200 SXM datasheets (nvidia.com/en-us/data-center/h100/ and .../h200/):
        # FP32 67 TFLOPS; TF32 989, BF16 1,979, FP16 1,979, FP8 3,958 TFLOPS "with sparsity" -> dense half.
        peak_flops={
            "fp32": 67 * _T,
            "tf32": 494.7 * _T,
            "bf16": 989.4 * _T,
            "fp16": 989.4 * _T,
            "fp8": 1978.9 * _T,
        },
        hbm_bandwidth=hbm,
        # 132 SMs and 50 MB L2 on the SXM5 part: NVIDIA H100 Tensor Core GPU Architecture whitepaper
        # (the H200 is the same GH100 die with HBM3e).
        num_sms=132,
        l2_bytes=50 * _MIB,
        memory_bytes=int(mem),
        interconnects={
            # Datasheet: NVLink 900 GB/s (bidirectional total) -> 450 GB/s per direction.
            "nvlink": Interconnect(450 * _G, _LAT_NVLINK, "datasheet 900 GB/s bidirectional; " + _LAT_NOTE),
            # Datasheet: PCIe Gen5 128 GB/s (bidirectional, x16) -> 64 GB/s per direction.
            "pcie": Interconnect(
                64 * _G, _LAT_PCIE, "datasheet PCIe Gen5 128 GB/s bidirectional; " + _LAT_NOTE
            ),
            # DGX H100 / DGX H200 datasheets: 8x ConnectX-7 400 Gb/s NDR, one per GPU -> 50 GB/s.
            "infiniband": Interconnect(
                50 * _G, _LAT_IB, "DGX datasheet ConnectX-7 400 Gb/s per GPU; " + _LAT_NOTE
            ),
        },
        source=f"datasheet ({mem_note})",
    )


def _builtin_profiles() -> dict[str, HardwareProfile]:
    """The datasheet profiles, built fresh on each call (no module-level mutable state)."""
    return {
        # H100 SXM5 datasheet: 80 GB HBM3, 3.35 TB/s.
        "h100-sxm": _h100_like(
            "h100-sxm", 3.35 * _T, 80e9, "NVIDIA H100 SXM5 datasheet: 80 GB HBM3, 3.35 TB/s"
        ),
        # H200 SXM datasheet: 141 GB HBM3e, 4.8 TB/s. Ridge bf16 = 989.4e12 / 4.8e12 = 206 FLOP/B.
        "h200": _h100_like("h200", 4.8 * _T, 141e9, "NVIDIA H200 SXM datasheet: 141 GB HBM3e, 4.8 TB/s"),
        "a100-80gb": HardwareProfile(
            name="a100-80gb",
            # NVIDIA A100 datasheet (nvidia.com/en-us/data-center/a100/), SXM column: FP32 19.5 TFLOPS;
            # TF32 156, BF16 312, FP16 312 TFLOPS dense (312/624/624 with sparsity). No FP8 path on Ampere.
            peak_flops={"fp32": 19.5 * _T, "tf32": 156 * _T, "bf16": 312 * _T, "fp16": 312 * _T},
            # A100 80GB SXM datasheet: 80 GB HBM2e, 2,039 GB/s.
            hbm_bandwidth=2039 * _G,
            # 108 SMs, 40 MB L2: NVIDIA A100 Tensor Core GPU Architecture whitepaper.
            num_sms=108,
            l2_bytes=40 * _MIB,
            memory_bytes=int(80e9),
            interconnects={
                # Datasheet: NVLink 600 GB/s bidirectional -> 300 GB/s per direction.
                "nvlink": Interconnect(
                    300 * _G, _LAT_NVLINK, "datasheet 600 GB/s bidirectional; " + _LAT_NOTE
                ),
                # Datasheet: PCIe Gen4 64 GB/s bidirectional -> 32 GB/s per direction.
                "pcie": Interconnect(
                    32 * _G, _LAT_PCIE, "datasheet PCIe Gen4 64 GB/s bidirectional; " + _LAT_NOTE
                ),
                # DGX A100 datasheet: 8x ConnectX-6 200 Gb/s HDR, one per GPU -> 25 GB/s.
                "infiniband": Interconnect(
                    25 * _G, _LAT_IB, "DGX A100 datasheet HDR 200 Gb/s per GPU; " + _LAT_NOTE
                ),
            },
            source="datasheet (NVIDIA A100 80GB SXM datasheet + A100 architecture whitepaper)",
        ),
        "l40s": HardwareProfile(
            name="l40s",
            # NVIDIA L40S datasheet: FP32 91.6 TFLOPS; TF32 183 | 366*, BF16 362.05 | 733*,
            # FP16 362.05 | 733*, FP8 733 | 1,466* TFLOPS (* with sparsity) -> dense figures.
            peak_flops={
                "fp32": 91.6 * _T,
                "tf32": 183 * _T,
                "bf16": 362.05 * _T,
                "fp16": 362.05 * _T,
                "fp8": 733 * _T,
            },
            # L40S datasheet: 48 GB GDDR6 with ECC, 864 GB/s.
            hbm_bandwidth=864 * _G,
            # 142 SMs (18,176 CUDA cores / 128 per SM; 142 third-gen RT cores, one per SM, datasheet);
            # 96 MB L2: NVIDIA Ada Lovelace architecture whitepaper (full AD102).
            num_sms=142,
            l2_bytes=96 * _MIB,
            memory_bytes=int(48e9),
            interconnects={
                # Datasheet: PCIe Gen4 x16 64 GB/s bidirectional -> 32 GB/s per direction; no NVLink.
                "pcie": Interconnect(
                    32 * _G, _LAT_PCIE, "datasheet PCIe Gen4 x16 64 GB/s bidirectional; " + _LAT_NOTE
                ),
            },
            source="datasheet (NVIDIA L40S datasheet + Ada Lovelace architecture whitepaper)",
        ),
        "rtx-4090": HardwareProfile(
            name="rtx-4090",
            # NVIDIA Ada Lovelace GPU architecture whitepaper v1.0, appendix table for the RTX 4090:
            # FP32 82.6 TFLOPS; tensor dense figures with FP32 accumulate (what PyTorch GEMMs use):
            # TF32 82.6, BF16 165.2, FP16 165.2 (330.3 with FP16 accumulate), FP8 330.3.
            peak_flops={
                "fp32": 82.6 * _T,
                "tf32": 82.6 * _T,
                "bf16": 165.2 * _T,
                "fp16": 165.2 * _T,
                "fp8": 330.3 * _T,
            },
            # Whitepaper: 24 GB GDDR6X at 21 Gbps on 384 bits = 1,008 GB/s.
            hbm_bandwidth=1008 * _G,
            # Whitepaper: 128 SMs, 72 MB L2.
            num_sms=128,
            l2_bytes=72 * _MIB,
            memory_bytes=24 * 2**30,
            interconnects={
                # PCIe Gen4 x16: 64 GB/s bidirectional -> 32 GB/s per direction; GeForce Ada has no NVLink.
                "pcie": Interconnect(32 * _G, _LAT_PCIE, "PCIe Gen4 x16 64 GB/s bidirectional; " + _LAT_NOTE),
            },
            source="datasheet (NVIDIA Ada Lovelace GPU architecture whitepaper)",
        ),
    }


# Short names people type -> canonical profile name.
_ALIASES: Mapping[str, str] = MappingProxyType(
    {
        "h100": "h100-sxm",
        "h100-sxm5": "h100-sxm",
        "a100": "a100-80gb",
        "a100-80g": "a100-80gb",
        "4090": "rtx-4090",
        "rtx4090": "rtx-4090",
    }
)


def _profiles_dir() -> Path:
    return Path(__file__).resolve().parent / "profiles"


def _profile_files() -> dict[str, Path]:
    d = _profiles_dir()
    return {p.stem: p for p in sorted(d.glob("*.json"))} if d.is_dir() else {}


def builtin_profile_names() -> list[str]:
    """Names of the datasheet profiles."""
    return list(_builtin_profiles())


def known_profile_names() -> list[str]:
    """Every name :func:`load_profile` accepts (datasheet, shipped profile files, ``cpu``)."""
    return [*builtin_profile_names(), *_profile_files(), "cpu"]


_REQUIRED_FIELDS: tuple[str, ...] = (
    "name",
    "peak_flops",
    "hbm_bandwidth",
    "num_sms",
    "l2_bytes",
    "memory_bytes",
)


def profile_from_dict(data: Mapping[str, Any], origin: str = "<dict>") -> HardwareProfile:
    """Build a profile from its JSON form (see :meth:`HardwareProfile.to_dict`).

    Raises:
        ValueError: naming the first missing or ill-typed field and ``origin``.
    """
    if not isinstance(data, Mapping):
        raise ValueError(f"{origin}: a profile must be a JSON object, got {type(data).__name__}")
    for f in _REQUIRED_FIELDS:
        if f not in data:
            raise ValueError(
                f"{origin}: profile is missing required field {f!r} (required: {', '.join(_REQUIRED_FIELDS)})"
            )
    peaks = data["peak_flops"]
    if not isinstance(peaks, Mapping) or not peaks:
        raise ValueError(f"{origin}: field 'peak_flops' must be a non-empty object of dtype -> FLOP/s")
    eff = data.get("efficiency") or {}
    if not isinstance(eff, Mapping):
        raise ValueError(f"{origin}: field 'efficiency' must be an object of kernel -> fraction")
    links: dict[str, Interconnect] = {}
    raw_links = data.get("interconnects") or {}
    if not isinstance(raw_links, Mapping):
        raise ValueError(f"{origin}: field 'interconnects' must be an object")
    for k, v in raw_links.items():
        for f in ("bandwidth", "latency"):
            if not isinstance(v, Mapping) or f not in v:
                raise ValueError(f"{origin}: interconnects.{k} is missing required field {f!r}")
        links[str(k)] = Interconnect(float(v["bandwidth"]), float(v["latency"]), str(v.get("note", "")))
    try:
        return HardwareProfile(
            name=str(data["name"]),
            peak_flops={str(k): float(v) for k, v in peaks.items() if v is not None},
            hbm_bandwidth=float(data["hbm_bandwidth"]),
            num_sms=int(data["num_sms"]),
            l2_bytes=int(data["l2_bytes"]),
            memory_bytes=int(data["memory_bytes"]),
            interconnects=links,
            source=str(data.get("source", origin)),
            details=dict(data.get("details") or {}),
            efficiency={str(k): float(v) for k, v in eff.items()},
        )
    except (TypeError, ValueError) as e:
        raise ValueError(f"{origin}: {e}") from e


def _read_profile_file(path: Path) -> HardwareProfile:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e
    return profile_from_dict(data, origin=str(path))


def save_profile(profile: HardwareProfile, path: str | os.PathLike[str]) -> Path:
    """Write ``profile`` as JSON to ``path`` (loadable by :func:`load_profile`); returns the path."""
    p = Path(path)
    if p.parent and not p.parent.exists():
        p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(profile.to_dict(), indent=1) + "\n")
    return p


def load_profile(name_or_path: str | os.PathLike[str]) -> HardwareProfile:
    """Load a hardware profile by name (``h200``, ``h200-measured``, ``cpu``...) or JSON path.

    ``cpu`` runs a quick measurement of this machine (a few seconds); nothing is cached.

    Raises:
        ValueError: unknown name (the message lists the known names), or a malformed profile file
            (the message names the missing field).
    """
    s = os.fspath(name_or_path)
    p = Path(s)
    if s.endswith(".json") or p.is_file():
        if not p.is_file():
            raise ValueError(f"hardware: profile file {s!r} does not exist")
        return _read_profile_file(p)
    key = s.strip().lower().replace("_", "-").replace(" ", "-")
    key = _ALIASES.get(key, key)
    if key == "cpu":
        from flashpage.roofline.probe import probe

        return probe(device="cpu", quick=True)
    builtins = _builtin_profiles()
    if key in builtins:
        return builtins[key]
    files = _profile_files()
    if key in files:
        return _read_profile_file(files[key])
    raise ValueError(
        f"hardware: unknown profile {s!r}; known: {', '.join(known_profile_names())} (or a .json path)"
    )


def profile_from_gpu_name(device_name: str) -> HardwareProfile | None:
    """The datasheet profile matching a CUDA device name (``"NVIDIA H200"`` -> ``h200``), or None."""
    n = device_name.lower()
    # Order matters: "h200" before "h100" (a GH200 reports "GH200" and is H200-like only in memory).
    table = (
        ("h200", "h200"),
        ("h100", "h100-sxm"),
        ("a100", "a100-80gb"),
        ("l40s", "l40s"),
        ("4090", "rtx-4090"),
    )
    for key, prof in table:
        if key in n:
            return _builtin_profiles()[prof]
    return None


def detect_profile() -> HardwareProfile:
    """The profile of the device this process runs on.

    With CUDA: the datasheet profile matching ``torch.cuda.get_device_name()``; an unknown GPU is
    measured with a quick probe. Without CUDA: this CPU, measured now by a quick probe.
    """
    import torch

    from flashpage.roofline.probe import probe

    if torch.cuda.is_available():
        prof = profile_from_gpu_name(torch.cuda.get_device_name())
        return prof if prof is not None else probe(device="cuda", quick=True)
    return probe(device="cpu", quick=True)
