"""The probe on this machine's CPU: quick, and its profile loads back."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from flashpage.roofline.hardware import load_profile, save_profile
from flashpage.roofline.probe import measure_copy_bandwidth, measure_matmul_flops, probe


def test_quick_cpu_probe_writes_a_loadable_profile(tmp_path: Path) -> None:
    t0 = time.perf_counter()
    prof = probe(device="cpu", quick=True)
    assert time.perf_counter() - t0 < 15.0
    assert prof.name == "cpu" and "measured" in prof.source
    # A CPU core does between ~0.1 GFLOP/s and ~10 TFLOP/s fp32, and copies at 0.1 GB/s .. 2 TB/s.
    assert 1e8 < prof.peak("fp32") < 1e13
    assert 1e8 < prof.hbm_bandwidth < 2e12
    assert prof.num_sms >= 1 and prof.details["quick"] is True
    back = load_profile(save_profile(prof, tmp_path / "cpu.json"))
    assert back == prof
    assert back.ridge("fp32") == pytest.approx(prof.peak("fp32") / prof.hbm_bandwidth)


def test_measurements_and_errors() -> None:
    assert measure_matmul_flops("fp32", 64, "cpu", quick=True) > 0
    assert measure_copy_bandwidth(2**20, "cpu", quick=True) > 0
    with pytest.raises(RuntimeError, match="fp8"):
        measure_matmul_flops("fp8", 64, "cpu")
    with pytest.raises(ValueError, match="device"):
        probe(device="meta")
