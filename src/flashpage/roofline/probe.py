"""Measure the current device's roofline ceilings and return them as a :class:`HardwareProfile`.

What is measured (FLOP and byte counts are explicit so results compare with any benchmark):

- matmul FLOP/s per dtype: ``C = A @ B`` with square ``n x n`` operands, ``2 * n**3`` FLOP.
  On GPU: bf16, fp16, fp32 (IEEE, TF32 off), tf32 (``torch.set_float32_matmul_precision("high")``)
  and fp8 (``torch._scaled_mm``, e4m3, where the GPU and torch support it), each timed with
  ``triton.testing.do_bench`` (median). On CPU: fp32, bf16, fp16 at small sizes, best of a few runs.
- memory bandwidth: ``y.copy_(x)``, counted as ``2 * nbytes`` (one read + one write), the same
  convention as ``shared/anchors`` (4.27 TB/s on the H200).

``quick=True`` keeps everything small: on CPU the whole probe takes about a second.
The result is returned, never cached; ``flashpage probe --out FILE`` writes it with ``save_profile``.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flashpage.roofline.hardware import HardwareProfile, profile_from_gpu_name

__all__ = ["measure_copy_bandwidth", "measure_matmul_flops", "probe"]

_TORCH_DTYPES = {"fp32": "float32", "tf32": "float32", "fp16": "float16", "bf16": "bfloat16"}


def _cpu_time_s(fn: Callable[[], object], budget_s: float, max_reps: int = 50) -> float:
    """Best wall time of ``fn`` over repeated runs within ``budget_s`` (one warm-up run first)."""
    fn()
    best = float("inf")
    start = time.perf_counter()
    for _ in range(max_reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        if time.perf_counter() - start > budget_s:
            break
    return best


def _gpu_time_s(fn: Callable[[], object], quick: bool) -> float:
    """Median GPU time of ``fn`` in seconds via ``triton.testing.do_bench``."""
    from triton.testing import do_bench

    ms = do_bench(fn, warmup=10 if quick else 25, rep=30 if quick else 100, return_mode="median")
    return float(ms) / 1e3


def measure_matmul_flops(dtype: str, n: int, device: str, quick: bool = False) -> float:
    """FLOP/s of an ``n x n @ n x n`` matmul in ``dtype`` (a key: fp32, tf32, fp16, bf16, fp8) on ``device``.

    Raises:
        RuntimeError: if the dtype has no matmul path on this device (e.g. fp8 on CPU or pre-Ada GPUs).
    """
    import torch

    flops = 2.0 * n**3
    if dtype == "fp8":
        if device == "cpu" or not hasattr(torch, "_scaled_mm"):
            raise RuntimeError("fp8 matmul needs torch._scaled_mm on a CUDA device")
        if torch.cuda.get_device_capability() < (8, 9):
            raise RuntimeError("fp8 matmul needs compute capability >= 8.9")
        a = torch.randn(n, n, device=device).to(torch.float8_e4m3fn)
        b = torch.randn(n, n, device=device).to(torch.float8_e4m3fn).t()  # _scaled_mm wants B column-major
        one = torch.ones((), device=device, dtype=torch.float32)
        fn: Callable[[], object] = lambda: torch._scaled_mm(
            a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16
        )
        return flops / _gpu_time_s(fn, quick)
    if dtype not in _TORCH_DTYPES:
        raise ValueError(f"dtype: expected one of fp32, tf32, fp16, bf16, fp8, got {dtype!r}")
    tdt = getattr(torch, _TORCH_DTYPES[dtype])
    a = torch.randn(n, n, device=device, dtype=tdt)
    b = torch.randn(n, n, device=device, dtype=tdt)
    out = torch.empty(n, n, device=device, dtype=tdt)
    fn = lambda: torch.mm(a, b, out=out)
    if device == "cpu":
        # CPUs have no TF32 mode; callers do not ask for it there.
        return flops / _cpu_time_s(fn, budget_s=0.1 if quick else 0.5)
    # Process-wide setting: set it for this measurement only and put back what was there.
    prev = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if dtype == "tf32" else "highest")
    try:
        return flops / _gpu_time_s(fn, quick)
    finally:
        torch.set_float32_matmul_precision(prev)


def measure_copy_bandwidth(nbytes: int, device: str, quick: bool = False) -> float:
    """Bytes/s of a device-to-device copy of ``nbytes`` (counted as read + write = ``2 * nbytes``)."""
    import torch

    x = torch.empty(nbytes // 4, device=device, dtype=torch.float32).uniform_()
    y = torch.empty_like(x)
    fn = lambda: y.copy_(x)
    moved = 2.0 * x.numel() * 4
    if device == "cpu":
        return moved / _cpu_time_s(fn, budget_s=0.1 if quick else 0.5)
    return moved / _gpu_time_s(fn, quick)


def _cpu_model_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def _cpu_cache_bytes(level: int) -> int:
    """Size of the CPU cache of ``level`` from sysfs (0 when unknown)."""
    base = Path("/sys/devices/system/cpu/cpu0/cache")
    try:
        for idx in sorted(base.glob("index*")):
            if (idx / "level").read_text().strip() == str(level) and (idx / "type").read_text().strip() in (
                "Unified",
                "Data",
            ):
                s = (idx / "size").read_text().strip().upper()
                mult = {"K": 2**10, "M": 2**20, "G": 2**30}.get(s[-1:], 1)
                return int(s.rstrip("KMG")) * mult
    except (OSError, ValueError):
        pass
    return 0


def _cpu_memory_bytes() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0


def probe(device: str | None = None, quick: bool = False, name: str | None = None) -> HardwareProfile:
    """Measure ``device`` (``"cpu"``, ``"cuda"``, ``"cuda:1"``; default: CUDA if present else CPU).

    Args:
        device: where to measure.
        quick: small sizes and few repetitions (CPU: ~1 s; GPU: a few seconds).
        name: profile name; default ``"cpu"`` on CPU, ``"<gpu>-measured"`` on GPU.

    Returns:
        A profile whose ``details`` hold the raw measurements (sizes, per-dtype FLOP/s, errors).
    """
    import torch

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device: expected 'cpu' or 'cuda[:i]', got {device!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: CUDA was asked for but torch.cuda.is_available() is False")
    date = _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d")
    details: dict[str, Any] = {"quick": quick, "torch": torch.__version__, "date": date, "errors": {}}
    peaks: dict[str, float] = {}

    if dev.type == "cpu":
        sizes = {"fp32": 384, "bf16": 192, "fp16": 128} if quick else {"fp32": 1024, "bf16": 512, "fp16": 256}
        copy_bytes = (32 if quick else 256) * 2**20
        for dt, n in sizes.items():
            try:
                peaks[dt] = measure_matmul_flops(dt, n, "cpu", quick)
            except RuntimeError as e:  # a torch build without this CPU kernel
                details["errors"][dt] = str(e)[:200]
        bw = measure_copy_bandwidth(copy_bytes, "cpu", quick)
        details.update(
            device_name=_cpu_model_name(),
            matmul_n=sizes,
            copy_bytes=copy_bytes,
            threads=torch.get_num_threads(),
        )
        return HardwareProfile(
            name=name or "cpu",
            peak_flops=peaks,
            hbm_bandwidth=bw,
            num_sms=os.cpu_count() or 1,
            l2_bytes=_cpu_cache_bytes(2),
            memory_bytes=_cpu_memory_bytes(),
            interconnects={},
            source=f"measured by flashpage probe on {_cpu_model_name()} ({date})",
            details=details,
        )

    import triton

    with torch.cuda.device(dev):
        props = torch.cuda.get_device_properties(dev)
        gpu = torch.cuda.get_device_name(dev)
        # A peak is the best over shapes: cuBLAS reaches its top rate at different sizes per dtype.
        sizes = (4096,) if quick else (4096, 8192, 16384)
        copy_bytes = (256 if quick else 2048) * 2**20
        per_size: dict[str, dict[int, float]] = {}
        for dt in ("bf16", "fp16", "tf32", "fp32", "fp8"):
            try:
                per_size[dt] = {n: measure_matmul_flops(dt, n, device, quick) for n in sizes}
                peaks[dt] = max(per_size[dt].values())
            except RuntimeError as e:  # fp8 where unsupported
                details["errors"][dt] = str(e)[:200]
        bw = measure_copy_bandwidth(copy_bytes, device, quick)
    sheet = profile_from_gpu_name(gpu)
    details.update(
        device_name=gpu,
        triton=triton.__version__,
        cuda=torch.version.cuda,
        matmul_n=list(sizes),
        matmul_flops_by_n={dt: {str(n): v for n, v in d.items()} for dt, d in per_size.items()},
        copy_bytes=copy_bytes,
        datasheet_profile=sheet.name if sheet else None,
    )
    slug = sheet.name if sheet else gpu.lower().replace("nvidia", "").strip().replace(" ", "-")
    return HardwareProfile(
        name=name or f"{slug}-measured",
        peak_flops=peaks,
        hbm_bandwidth=bw,
        num_sms=props.multi_processor_count,
        l2_bytes=int(getattr(props, "L2_cache_size", 0)),
        memory_bytes=int(props.total_memory),
        # Links are not measured here; they come from the datasheet profile when the GPU is known.
        interconnects=dict(sheet.interconnects) if sheet else {},
        source=f"measured by flashpage probe on {gpu} ({date}); interconnects from datasheet",
        details=details,
    )
