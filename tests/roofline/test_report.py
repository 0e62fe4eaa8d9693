"""The roofline report: table, JSON contract and plot."""

from __future__ import annotations

from pathlib import Path

from flashpage.roofline.hardware import load_profile
from flashpage.roofline.model_shapes import get_model_shape
from flashpage.roofline.report import build_report, format_table, plot_roofline, report_json


def test_table_json_and_plot(tmp_path: Path) -> None:
    rep = build_report(get_model_shape("mistral-7b"), load_profile("l40s"), batch=4, seq=2048, chunk=256)
    table = format_table(rep)
    assert "flash_fwd" in table and "paged_prefill" in table and "ridge" in table
    assert len([line for line in table.splitlines() if line.startswith("decode")]) == 6
    js = report_json(rep)
    assert js["hardware"]["name"] == "l40s" and js["model"]["vocab"] == 32000
    assert len(js["ops"]) == 18
    for row in js["ops"]:
        assert {"phase", "op", "intensity", "ridge", "bound", "kernel"} <= set(row)
        assert row["bound"] == ("compute" if row["intensity"] >= row["ridge"] else "memory")
        # attainable = min(peak, intensity * bandwidth)
        assert row["attainable_tflops"] <= 362.05 + 1e-6
        assert abs(row["attainable_tflops"] - min(362.05, row["intensity"] * 0.864)) < 1e-6
    out = plot_roofline(rep, tmp_path / "plots" / "roofline.png")
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
