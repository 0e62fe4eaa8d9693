"""Profiles with measured per-kernel efficiency: the schema extension loads old and new files alike,
and the planner scales each op by its kernel's measured fraction."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flashpage.roofline.hardware import load_profile, profile_from_dict, save_profile
from flashpage.roofline.model_shapes import get_model_shape
from flashpage.roofline.planner import plan_model


def test_old_profile_files_load_and_efficiency_round_trips(tmp_path: Path) -> None:
    old = load_profile("h200-measured")  # a shipped file written before the field existed
    assert dict(old.efficiency) == {} and old.efficiency_of("flash_fwd") == 1.0
    assert "efficiency" not in old.to_dict()  # files without measurements stay as they were
    data = {**old.to_dict(), "efficiency": {"flash_fwd": 0.6, "paged_decode": 0.95}}
    path = tmp_path / "measured.json"
    path.write_text(json.dumps(data))
    prof = load_profile(path)
    assert prof.efficiency_of("flash_fwd") == 0.6 and prof.efficiency_of("matmul") == 1.0
    assert load_profile(save_profile(prof, tmp_path / "again.json")).efficiency == prof.efficiency
    with pytest.raises(ValueError, match="efficiency"):
        profile_from_dict({**data, "efficiency": {"flash_fwd": 0.0}}, "bad.json")
    with pytest.raises(ValueError, match="efficiency"):
        profile_from_dict({**data, "efficiency": [0.5]}, "bad.json")


def test_planner_scales_ops_by_measured_efficiency() -> None:
    base = load_profile("h200-measured")
    prof = profile_from_dict({**base.to_dict(), "efficiency": {"flash_fwd": 0.5}})
    shape = get_model_shape("llama-3-8b")
    before = {(r.choice.phase, r.choice.op): r for r in plan_model(shape, base, batch=4, seq=2048)}
    after = {(r.choice.phase, r.choice.op): r for r in plan_model(shape, prof, batch=4, seq=2048)}
    attn = ("prefill", "attention")
    assert after[attn].choice.kernel == "flash_fwd" and after[attn].efficiency == 0.5
    assert after[attn].time_s == pytest.approx(2 * before[attn].time_s)
    assert after[attn].attainable_flops == pytest.approx(0.5 * before[attn].attainable_flops)
    for key in after.keys() - {attn}:  # kernels without a measurement keep the bare roofline
        assert after[key].time_s == pytest.approx(before[key].time_s) and after[key].efficiency == 1.0
