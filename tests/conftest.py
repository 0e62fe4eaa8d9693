"""Test harness: Triton kernels run on CPU tensors under the interpreter when no GPU is present.

``TRITON_INTERPRET=1`` must be set before ``triton`` is first imported, which is why this happens at
import time of the conftest, before any test module (and so any flashpage kernel) is collected.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _fixed_seeds() -> None:
    """Every test starts from the same seeds, so failures reproduce."""
    torch.manual_seed(0)
    random.seed(0)


@pytest.fixture
def device() -> str:
    """The device kernels run on: CUDA when present, else CPU under the Triton interpreter."""
    return "cuda" if torch.cuda.is_available() else "cpu"
