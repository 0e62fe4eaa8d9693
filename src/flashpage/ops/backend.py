"""Which attention implementation runs: ``FLASHPAGE_BACKEND=triton|torch|auto``.

``triton`` runs the Triton kernels (on CUDA, or on CPU tensors under ``TRITON_INTERPRET=1``);
``torch`` runs the pure-PyTorch path; ``auto`` (default) picks ``triton`` for CUDA tensors and
``torch`` otherwise. The variable is read at every call (no module-level state), so tests and users
may change it at run time.
"""

from __future__ import annotations

import os
from typing import Literal

import torch

Backend = Literal["triton", "torch"]
_CHOICES = ("triton", "torch", "auto")


def interpreter_enabled() -> bool:
    """True when Triton runs kernels on CPU tensors (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def resolve_backend(device: torch.device | str | None = None, requested: str | None = None) -> Backend:
    """Resolve the backend for tensors on ``device``.

    Args:
        device: where the tensors live; decides ``auto``.
        requested: overrides the environment variable when given.

    Raises:
        ValueError: an unknown backend name, or ``triton`` on CPU without the interpreter.
    """
    name = (requested or os.environ.get("FLASHPAGE_BACKEND", "auto")).strip().lower()
    if name not in _CHOICES:
        raise ValueError(f"FLASHPAGE_BACKEND={name!r} is not one of {', '.join(_CHOICES)}")
    is_cuda = device is not None and torch.device(device).type == "cuda"
    if name == "auto":
        return "triton" if is_cuda else "torch"
    if name == "triton" and not is_cuda and not interpreter_enabled():
        raise ValueError(
            "FLASHPAGE_BACKEND=triton on CPU tensors needs the Triton interpreter: set TRITON_INTERPRET=1 "
            "before triton is imported, or use FLASHPAGE_BACKEND=torch"
        )
    return name  # type: ignore[return-value]
