"""The ops tests check the Triton kernels: their calls default to ``FLASHPAGE_BACKEND=triton``
(CUDA, or CPU under the interpreter), where ``auto`` would pick the PyTorch path for CPU tensors.
A test of another backend sets the variable itself."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _triton_backend_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLASHPAGE_BACKEND", "triton")
