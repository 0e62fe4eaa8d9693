"""The result files' environment record (flashpage.bench.common)."""

from __future__ import annotations

import pytest
import torch

from flashpage.bench import common

# `ptxas --version` of triton 3.9's bundled ptxas-blackwell.
_VERSION_TEXT = """ptxas: NVIDIA (R) Ptx optimizing assembler
Copyright (c) 2005-2026 NVIDIA Corporation
Cuda compilation tools, release 13.4, V13.4.48
Build cuda_13.4.r13.4/compiler.38657139_0
"""


@pytest.fixture
def fake_gpu(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A CUDA sm_90 GPU as far as ptxas_version can tell; returns the archs triton was asked about."""
    nvidia = pytest.importorskip("triton.backends.nvidia.compiler")
    asked: list[int] = []

    def version(arch: int) -> str:
        asked.append(arch)
        return _VERSION_TEXT

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(nvidia, "get_ptxas_version", version)
    return asked


def test_ptxas_version_names_the_cuda_release_for_this_gpu(fake_gpu: list[int]) -> None:
    assert common.ptxas_version() == "13.4"
    assert fake_gpu == [90]


def test_ptxas_version_is_none_when_triton_cannot_find_it(
    fake_gpu: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    import triton.backends.nvidia.compiler as nvidia

    def missing(arch: int) -> str:
        raise RuntimeError("Cannot find ptxas-blackwell")

    monkeypatch.setattr(nvidia, "get_ptxas_version", missing)
    assert common.ptxas_version() is None


def test_env_info_records_ptxas(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    env = common.env_info(peak_tflops=1.0, peak_tbps=None)
    assert env["ptxas"] is None and env["gpu"] == "cpu"
    assert {"gpu", "torch", "triton", "cuda", "date", "git_commit", "peak_tflops", "peak_tbps"} <= env.keys()
