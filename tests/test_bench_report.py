"""``flashpage bench report``: README rendering, regression detection and ``--check`` on synthetic results."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from flashpage.bench.common import status_row, validate_rows
from flashpage.bench.report import (
    find_regressions,
    kernel_efficiency,
    load_results,
    main,
    plot_gpu_roofline,
    render_readme,
)

ENV = {"gpu": "NVIDIA H100 80GB HBM3", "torch": "2.11", "triton": "3.6", "cuda": "13.0", "date": "2026-12-08",
       "git_commit": "abc", "peak_tflops": 700.0, "peak_tbps": 3.0}  # fmt: skip


def _decode(impl: str, tbps: float, batch: int = 64, **kw: Any) -> dict[str, Any]:
    return {"bench": "decode", "impl": impl, "dtype": "bfloat16", "batch": batch, "ctx": 4096, "nheads": 32,
            "nheads_k": 8, "d": 128, "ms": 0.5, "tbps": tbps, "frac_of_roofline": tbps / 3.0, **kw}  # fmt: skip


def _attn(impl: str, tflops: float, pas: str = "fwd") -> dict[str, Any]:
    return {"bench": "attention", "impl": impl, "dtype": "bfloat16", "batch": 4, "seqlen": 4096, "nheads": 16,
            "nheads_k": 16, "d": 128, "causal": True, "pass": pas, "ms": 1.0, "tflops": tflops,
            "frac_of_roofline": tflops / 700.0}  # fmt: skip


def _write(d: Path, name: str, rows: list[dict[str, Any]], env: dict[str, Any] = ENV) -> None:
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_text(json.dumps({"env": env, "rows": rows}))


@pytest.fixture
def results(tmp_path: Path) -> Path:
    d = tmp_path / "benchmarks" / "results"
    _write(d, "decode-h100.json", [
        _decode("flashpage", 2.8, variant="planner", num_splits=1),
        _decode("flashpage", 2.9, variant="block-manager"),
        _decode("sdpa-cudnn", 3.0),
        _decode("gather-sdpa", 1.0),
        status_row("decode", "flashinfer", "missing", "flashinfer is not importable", batch=64, ctx=4096,
                   nheads=32, nheads_k=8, d=128, dtype="bfloat16"),
        _decode("flashpage", 2.4, batch=8, variant="planner", num_splits=4),
        _decode("sdpa-cudnn", 2.0, batch=8),
    ])  # fmt: skip
    _write(d, "attention-h100.json", [_attn("flashpage", 420.0), _attn("sdpa-flash", 300.0),
                                      _attn("flashpage", 350.0, "bwd"), _attn("sdpa-flash", 280.0, "bwd")])  # fmt: skip
    _write(
        d,
        "attention-h200.json",
        [_attn("flashpage", 500.0)],
        {**ENV, "gpu": "NVIDIA H200", "peak_tbps": None},
    )
    return d


def test_readme_has_a_table_per_gpu_and_bench_with_ratios_roofline_and_notes(results: Path) -> None:
    sets = load_results(results)
    assert set(sets) == {"h100", "h200"} and len(sets["h100"].rows) == 11
    text = render_readme(sets, {"h100": "roofline-h100.png"})
    assert text.index("## H100") < text.index("## H200")
    h100 = text[text.index("## H100") : text.index("## H200")]
    assert h100.index("### attention") < h100.index("### decode")
    assert "![roofline h100](roofline-h100.png)" in h100
    decode = h100[h100.index("### decode") :]
    assert "| shape | flashpage | flashpage/block-manager | sdpa-cudnn | gather-sdpa | flashinfer |" in decode
    # flashpage 2.8 TB/s (93% of 3.0) vs the best baseline, cuDNN at 3.0: 0.93x; at batch 8 1.20x.
    assert (
        "| b64 ctx4096 h32/8 d128 | 2.8 (93%) | 2.9 (97%) | 3 (100%) | 1 (33%) | missing | 0.93x (sdpa-cudnn) |"
        in decode
    )
    assert "| b8 ctx4096 h32/8 d128 | 2.4 (80%) |  | 2 (67%) |  |  | 1.20x (sdpa-cudnn) |" in decode
    note = decode.split("\n\n")[4].strip().splitlines()
    assert len(note) == 3  # at most three lines: method, summary, what did not run
    assert "geomean 1.06x over 2 shapes (0.93x to 1.20x)" in note[1]
    assert note[2] == "Not measured: flashinfer (missing: flashinfer is not importable)"
    assert "| fwd d128 s4096 b4 h16 causal | 420 (60%) | 300 (43%) | 1.40x (sdpa-flash) |" in h100


def test_serve_rows_put_the_offline_run_beside_each_level(tmp_path: Path) -> None:
    base = {"bench": "serve", "impl": "flashpage", "model": "m", "dtype": "bfloat16"}
    rows = [
        {**base, "mode": "server", "concurrency": 16, "requests": 64, "tokens_per_s": 900.0,
         "offline_tokens_per_s": 1000.0, "ratio_vs_offline": 0.9},
        {**base, "mode": "offline", "requests": 64, "tokens_per_s": 1000.0},
    ]  # fmt: skip
    _write(tmp_path, "serve-h100.json", rows)
    text = render_readme(load_results(tmp_path))
    assert "| m, concurrency 16, 64 requests | 900 | 1000 | 0.90x (offline LLM.generate) |" in text
    assert validate_rows(rows) == []  # serve rows carry no roofline fraction


def test_regressions_over_five_percent_are_flagged(results: Path) -> None:
    old = load_results(results)
    new = load_results(results)
    assert find_regressions(new, old) == []
    rows = new["h100"].rows

    def row(**kw: Any) -> dict[str, Any]:
        (r,) = [r for r in rows if all(r.get(k) == v for k, v in kw.items())]
        return r

    row(bench="decode", impl="flashpage", variant="planner", batch=64)["tbps"] = 2.8 * 0.96  # -4%: noise
    row(bench="decode", impl="sdpa-cudnn", batch=64)["tbps"] = 1.0  # a baseline: not flashpage's regression
    row(bench="attention", impl="flashpage", **{"pass": "fwd"})["tflops"] = 420.0 * 0.90  # -10%
    regs = find_regressions(new, old)
    assert [(r.bench, r.label, round(r.change, 3)) for r in regs] == [("attention", "flashpage", -0.1)]
    assert "fwd d128 s4096 b4 h16 causal: 420 -> 378 TFLOP/s (-10.0%)" in str(regs[0])
    assert find_regressions(new, old, threshold=0.12) == []
    row(bench="decode", variant="block-manager")["tbps"] = 2.0  # matched apart from the planner row
    assert [r.label for r in find_regressions(new, old)] == ["flashpage", "flashpage/block-manager"]


def _git(cwd: Path, *args: str) -> None:
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd, check=True,
                   capture_output=True)  # fmt: skip


def test_check_exits_nonzero_on_a_regression_against_the_committed_results(results: Path) -> None:
    repo = results.parent.parent
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "commit", "-qm", "results")
    readme = repo / "benchmarks" / "README.md"
    assert main(["--results", str(results), "--check", "--no-plot"]) == 0
    assert "## H100" in readme.read_text()
    data = json.loads((results / "decode-h100.json").read_text())
    data["rows"][0]["tbps"] = 2.0  # flashpage planner 2.8 -> 2.0 TB/s
    (results / "decode-h100.json").write_text(json.dumps(data))
    assert main(["--results", str(results), "--no-plot"]) == 0  # reported, not gating
    assert main(["--results", str(results), "--check", "--no-plot"]) == 1
    assert main(["--results", str(results), "--check", "--no-plot", "--threshold", "0.5"]) == 0
    _git(repo, "commit", "-qam", "new baseline")
    assert main(["--results", str(results), "--check", "--no-plot"]) == 0
    assert main(["--results", str(results), "--check", "--no-plot", "--baseline-ref", "HEAD~1"]) == 1
    assert main(["--results", str(repo / "missing")]) == 2
    probe = results / "probe-h100.json"  # a probe profile beside the rows gets their efficiency
    probe.write_text(json.dumps({"name": "h100-measured", "peak_flops": {"bf16": 7e14, "tf32": 3e14},
                                 "hbm_bandwidth": 3e12, "num_sms": 132, "l2_bytes": 1, "memory_bytes": 1}))  # fmt: skip
    assert main(["--results", str(results), "--no-plot"]) == 0
    assert json.loads(probe.read_text())["efficiency"]["flash_fwd"] == pytest.approx(0.6)
    assert "Measured roofline (`probe-h100.json`): 700 TFLOP/s matmul, 3 TB/s copy" in readme.read_text()


def test_roofline_plot_and_measured_efficiency(results: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    sets = load_results(results)
    out = plot_gpu_roofline(sets["h100"], tmp_path / "roofline-h100.png")
    assert out is not None and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot_gpu_roofline(sets["h200"], tmp_path / "none.png") is None  # no bandwidth recorded
    eff = kernel_efficiency(sets["h100"].rows)
    assert eff == pytest.approx({"flash_bwd": 0.5, "flash_fwd": 0.6, "paged_decode": 2.8 / 3,
                                 "paged_decode_splitkv": 0.8})  # fmt: skip
