"""Small host-side helpers of the kernel launchers: integer arithmetic and what the device and
the installed triton support (compute capability, TMA descriptors, programmatic dependent launch).

The capability queries are cached per device index (``functools.cache``: pure functions of the
hardware and the installed triton, which do not change within a process).
"""

from __future__ import annotations

import functools
import importlib
import re
from typing import Any

import torch

from flashpage.ops.backend import interpreter_enabled

__all__ = [
    "cdiv",
    "cuda_capability",
    "default_num_sms",
    "gpu_family",
    "next_pow2",
    "pdl_supported",
    "programs_per_sm",
    "tma_supported",
    "triton_version",
    "ws_supported",
]


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for host ints. Launchers use this, not ``triton.cdiv``: in triton 3.9 that is
    a ``ConstexprFunction`` whose host call costs ~3.6 us (argument unwrapping), on every launch."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """Smallest power of two >= ``n`` (1 for ``n <= 1``); the host-side ``triton.next_power_of_2``
    (a ``ConstexprFunction`` in triton 3.6 and 3.9, ~3.6 us per host call)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def gpu_family(device: torch.device) -> str:
    """``"interpreter"``, ``"hopper"`` (sm_90), ``"ampere"`` (sm_8x), ``"blackwell"`` or ``"other"``."""
    if device.type != "cuda":
        return "interpreter"
    major, _ = cuda_capability(device)
    return {8: "ampere", 9: "hopper", 10: "blackwell", 12: "blackwell"}.get(major, "other")


def cuda_capability(device: torch.device) -> tuple[int, int]:
    """Compute capability of a CUDA device (cached: a query costs microseconds of host time and
    the config lookups of every eager attention call ask several times)."""
    return _capability_of(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _capability_of(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


@functools.cache
def triton_version() -> tuple[int, int]:
    """The installed triton's (major, minor) release."""
    import triton

    match = re.match(r"(\d+)\.(\d+)", triton.__version__)
    return (int(match[1]), int(match[2])) if match else (0, 0)


@functools.cache
def _triton_has(module: str, *names: str) -> bool:
    """Whether this triton provides ``names`` in ``module`` (an optional feature of some releases)."""
    try:
        mod = importlib.import_module(module)
    except ImportError:
        return False
    return all(hasattr(mod, name) for name in names)


def tma_supported(device: torch.device) -> bool:
    """Host-side TMA descriptors can be used: triton has them and the GPU is sm_90+ (or interpreter)."""
    if not _triton_has("triton.tools.tensor_descriptor", "TensorDescriptor"):
        return False
    if device.type != "cuda":
        return interpreter_enabled()
    return cuda_capability(device)[0] >= 9


def pdl_supported(device: torch.device) -> bool:
    """Programmatic dependent launch can be used: a CUDA sm_90+ GPU and a triton with the grid
    dependency control ops (``griddepcontrol`` does not exist below sm_90; never the interpreter)."""
    return (
        device.type == "cuda"
        and _triton_has("triton.language.extra.cuda", "gdc_launch_dependents", "gdc_wait")
        and cuda_capability(device)[0] >= 9
    )


def ws_supported(device: torch.device) -> bool:
    """The Gluon warp-specialized forward (``flash_fwd_ws``) can run: a CUDA sm_90 GPU and a triton
    with Gluon's Hopper ops and ``warp_specialize`` (3.6 and 3.9 have them; never the interpreter)."""
    return (
        device.type == "cuda"
        and not interpreter_enabled()
        and cuda_capability(device)[0] == 9
        and _triton_has("triton.experimental.gluon.language", "warp_specialize")
        and _triton_has(
            "triton.experimental.gluon.language.nvidia.hopper", "warpgroup_mma", "warpgroup_mma_wait"
        )
    )


def default_num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (4 off CUDA, i.e. under the Triton interpreter)."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).multi_processor_count)
    return 4


def programs_per_sm(kernel: Any, device: torch.device) -> int:
    """How many programs of a compiled kernel one SM holds at once, from its shared memory,
    registers and warps and the device's limits (CUDA's occupancy rules: 1 KB of shared memory
    reserved per block, registers allocated per warp in units of 256). At least 1."""
    props = torch.cuda.get_device_properties(device)
    # Hopper's limits where this torch does not report them
    threads = getattr(props, "max_threads_per_multi_processor", 2048)
    smem_sm = getattr(props, "shared_memory_per_multiprocessor", 233472)
    regs_sm = getattr(props, "regs_per_multiprocessor", 65536)
    md = kernel.metadata
    warps = int(md.num_warps)
    limits = [max(1, threads // (32 * warps)), 32]
    smem = int(md.shared)
    if smem > 0:
        limits.append(smem_sm // (smem + 1024))
    regs = getattr(kernel, "n_regs", None)
    if regs is None and hasattr(kernel, "_init_handles"):
        kernel._init_handles()  # loads the module: sets n_regs
        regs = getattr(kernel, "n_regs", None)
    if regs:
        per_warp = -(-int(regs) * 32 // 256) * 256
        limits.append((regs_sm // per_warp) // warps)
    return max(1, min(limits))
