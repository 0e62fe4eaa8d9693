"""Hardware profiles: datasheet figures, the measured H200 file, loading and its error messages."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from flashpage.roofline.hardware import (
    DTYPE_KEYS,
    HardwareProfile,
    builtin_profile_names,
    dtype_bytes,
    known_profile_names,
    load_profile,
    normalize_dtype,
    profile_from_gpu_name,
    save_profile,
)

REQUIRED_PROFILES = ("h100-sxm", "h200", "a100-80gb", "l40s", "rtx-4090")


def test_builtin_profiles_cover_the_required_devices() -> None:
    names = builtin_profile_names()
    for n in REQUIRED_PROFILES:
        assert n in names
        p = load_profile(n)
        assert p.name == n
        for dt in ("fp32", "tf32", "fp16", "bf16"):
            assert p.peak(dt) > 0
        assert p.hbm_bandwidth > 1e11 and p.num_sms > 0 and p.l2_bytes > 0 and p.memory_bytes > 0
        assert "pcie" in p.interconnects
        # dense tensor-core bf16 beats plain fp32 everywhere
        assert p.peak("bf16") > p.peak("fp32")
    assert "cpu" in known_profile_names() and "h200-measured" in known_profile_names()


def test_h200_datasheet_ridge_and_links() -> None:
    p = load_profile("h200")
    assert p.peak("bf16") == pytest.approx(989.4e12)
    assert p.hbm_bandwidth == pytest.approx(4.8e12)
    assert p.ridge("bf16") == pytest.approx(206.1, abs=0.1)
    assert p.ridge(torch.bfloat16) == p.ridge("bfloat16")
    assert p.interconnects["nvlink"].bandwidth == pytest.approx(450e9)
    assert p.interconnects["infiniband"].bandwidth == pytest.approx(50e9)
    # 1 GB over NVLink one way: latency + 1e9 / 450e9 s
    assert p.interconnects["nvlink"].transfer_time(1e9) == pytest.approx(2e-6 + 1e9 / 450e9)
    assert p.attainable(4.0, "bf16") == pytest.approx(4.0 * 4.8e12)
    assert p.attainable(1e4, "bf16") == pytest.approx(989.4e12)


def test_a100_has_no_fp8_and_says_so() -> None:
    with pytest.raises(ValueError, match="fp8"):
        load_profile("a100-80gb").peak("fp8")


def test_h200_measured_profile_matches_the_anchors() -> None:
    p = load_profile("h200-measured")
    # shared/anchors/h200-2026-12-02.json: copy 4.273 TB/s, bf16 8192^3 mm 674.8 TFLOP/s, 132 SMs
    assert p.hbm_bandwidth == pytest.approx(4.273e12, rel=1e-3)
    assert 675e12 * 0.99 < p.peak("bf16") < 800e12
    assert p.num_sms == 132
    assert "anchors" in p.source
    assert p.ridge("bf16") == pytest.approx(674.83 / 4.273, rel=1e-3)


def test_aliases_and_gpu_name_detection() -> None:
    assert load_profile("H100").name == "h100-sxm"
    assert load_profile("a100").name == "a100-80gb"
    assert load_profile("4090").name == "rtx-4090"
    assert profile_from_gpu_name("NVIDIA H200").name == "h200"  # type: ignore[union-attr]
    assert profile_from_gpu_name("NVIDIA H100 80GB HBM3").name == "h100-sxm"  # type: ignore[union-attr]
    assert profile_from_gpu_name("NVIDIA A100-SXM4-80GB").name == "a100-80gb"  # type: ignore[union-attr]
    assert profile_from_gpu_name("NVIDIA GeForce RTX 4090").name == "rtx-4090"  # type: ignore[union-attr]
    assert profile_from_gpu_name("NVIDIA L40S").name == "l40s"  # type: ignore[union-attr]
    assert profile_from_gpu_name("Some Other GPU") is None


def test_unknown_name_lists_known_names() -> None:
    with pytest.raises(ValueError) as e:
        load_profile("tpu-v9")
    msg = str(e.value)
    assert "tpu-v9" in msg
    for n in (*REQUIRED_PROFILES, "h200-measured", "cpu"):
        assert n in msg


def test_malformed_profile_names_missing_field(tmp_path: Path) -> None:
    good = load_profile("h200").to_dict()
    for field in ("hbm_bandwidth", "peak_flops", "num_sms"):
        bad = dict(good)
        del bad[field]
        f = tmp_path / f"no-{field}.json"
        f.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=field):
            load_profile(f)
    links = json.loads(json.dumps(good))
    del links["interconnects"]["nvlink"]["latency"]
    f = tmp_path / "no-latency.json"
    f.write_text(json.dumps(links))
    with pytest.raises(ValueError, match="latency"):
        load_profile(str(f))
    f = tmp_path / "broken.json"
    f.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_profile(f)
    with pytest.raises(ValueError, match="does not exist"):
        load_profile(tmp_path / "missing.json")


def test_save_load_round_trip(tmp_path: Path) -> None:
    p = load_profile("l40s")
    q = load_profile(save_profile(p, tmp_path / "sub" / "l40s.json"))
    assert q == p
    assert hash(q) == hash(p)
    assert dict(q.interconnects) == dict(p.interconnects)


def test_profile_validation() -> None:
    with pytest.raises(ValueError, match="hbm_bandwidth"):
        HardwareProfile("x", {"bf16": 1.0}, 0.0, 1, 0, 0)
    with pytest.raises(ValueError, match="peak_flops"):
        HardwareProfile("x", {}, 1.0, 1, 0, 0)
    with pytest.raises(ValueError, match="dtype"):
        HardwareProfile("x", {"int4": 1.0}, 1.0, 1, 0, 0)


def test_dtype_normalisation() -> None:
    assert normalize_dtype(torch.bfloat16) == "bf16"
    assert normalize_dtype("float16") == "fp16"
    assert normalize_dtype(torch.float32) == "fp32"
    assert normalize_dtype(torch.float8_e4m3fn) == "fp8"
    assert [dtype_bytes(k) for k in DTYPE_KEYS] == [4, 4, 2, 2, 1]
    with pytest.raises(ValueError, match="dtype"):
        normalize_dtype(torch.int32)
