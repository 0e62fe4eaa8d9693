"""``flashpage bench all``: probe first, every benchmark in turn, failures recorded, never fatal;
the measured efficiency reaches the planner (``flashpage roofline --hardware probe-<gpu>.json``)."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from flashpage.bench import all as bench_all
from flashpage.bench.all import BenchEntry, run_all
from flashpage.bench.common import gpu_slug, validate_rows
from flashpage.cli import main as cli_main
from flashpage.roofline.hardware import load_profile


def _fake_bench(name: str, calls: list[tuple[str, list[str]]], behaviour: str) -> types.ModuleType:
    """A benchmark module whose ``main`` records its argv, then writes a row, raises or returns 1."""
    m = types.ModuleType(name)

    def main(argv: list[str]) -> int:
        calls.append((name, argv))
        if behaviour == "raise":
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 80 GiB")
        out = Path(argv[argv.index("--out") + 1])
        profile = load_profile(argv[argv.index("--profile") + 1])  # the probe of this run
        row = {"bench": "attention", "impl": "flashpage", "dtype": "bfloat16", "batch": 1, "seqlen": 64,
               "nheads": 2, "nheads_k": 2, "d": 32, "causal": False, "pass": "fwd", "ms": 1.0, "tflops": 1e-3,
               "frac_of_roofline": 0.25, "peak_seen": profile.hbm_bandwidth}  # fmt: skip
        (out / f"attention-{gpu_slug()}.json").write_text(json.dumps({"env": {}, "rows": [row]}))
        return 0 if behaviour == "ok" else 1

    m.main = main  # type: ignore[attr-defined]
    return m


def test_run_all_probes_first_then_runs_skips_and_survives_failures(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    calls: list[tuple[str, list[str]]] = []
    for name, how in (("fake_ok", "ok"), ("fake_boom", "raise"), ("fake_rc", "rc")):
        monkeypatch.setitem(sys.modules, f"flashpage.bench.{name}", _fake_bench(name, calls, how))
    registry = (
        BenchEntry("ok", "flashpage.bench.fake_ok", ("attention",), cpu_args=("--smoke",)),
        BenchEntry("gpu-only", "flashpage.bench.fake_ok", ("attention",)),  # no cpu_args
        BenchEntry("boom", "flashpage.bench.fake_boom", ("decode", "prefill"), cpu_args=()),
        BenchEntry(
            "serve", "flashpage.bench.serve_not_there", ("serve",), requires=("fastapi",), cpu_args=()
        ),
        BenchEntry(
            "extra", "flashpage.bench.fake_rc", ("attention",), requires=("no_such_pkg_xyz",), cpu_args=()
        ),
        BenchEntry("rc", "flashpage.bench.fake_rc", ("attention",), cpu_args=()),
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    outcomes = run_all(tmp_path, quick=True, registry=registry, progress=False)
    state = {o.name: (o.state, o.rc) for o in outcomes}
    assert state == {"ok": ("ran", 0), "gpu-only": ("skipped", 0), "boom": ("failed", 1),
                     "serve": ("skipped", 0), "extra": ("skipped", 0), "rc": ("ran", 1)}  # fmt: skip
    reasons = {o.name: o.reason for o in outcomes}
    assert reasons["gpu-only"] == "needs a CUDA GPU" and "does not exist" in reasons["serve"]
    assert "no_such_pkg_xyz" in reasons["extra"] and "out of memory" in reasons["boom"]
    probe = tmp_path / "probe-cpu.json"
    assert [c[0] for c in calls] == ["fake_ok", "fake_boom", "fake_rc"]
    assert calls[0][1] == ["--out", str(tmp_path), "--profile", str(probe), "--smoke", "--quick"]
    # The crash is a failed flashpage row in the benchmark's first result file.
    failed = json.loads((tmp_path / "decode-cpu.json").read_text())["rows"]
    assert [(r["impl"], r["status"]) for r in failed] == [("flashpage", "failed")]
    assert validate_rows(failed) == []
    # The rows' median fraction per kernel went into the probe's profile: the planner uses it.
    prof = load_profile(probe)
    assert prof.efficiency == {"flash_fwd": 0.25}
    written = json.loads((tmp_path / "attention-cpu.json").read_text())["rows"][0]
    assert written["peak_seen"] == prof.hbm_bandwidth  # the benchmark scored against this run's probe
    # A later command of a split run reuses this probe instead of measuring again.
    again = tmp_path / "again"
    outcomes = run_all(again, registry=registry[:1], progress=False, profile=probe,
                       probe=lambda out, quick: pytest.fail("probed again"))  # fmt: skip
    assert [o.state for o in outcomes] == ["ran"] and load_profile(again / "probe-cpu.json").name == prof.name
    capsys.readouterr()
    assert cli_main(["roofline", "--hardware", str(probe), "--seq", "512", "--batch", "2"]) == 0
    table = capsys.readouterr().out
    assert "eff" in table.splitlines()[3] and "0.25" in table  # prefill attention at 25% of roofline


def test_bench_all_main_rejects_unknown_names_and_reports_worst_status(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert bench_all.main(["--only", "attention,nope", "--out", str(tmp_path)]) == 2
    assert "nope" in capsys.readouterr().err
    seen: dict[str, Any] = {}

    def fake_run_all(
        out: Path, quick: bool, only: Any, progress: bool, profile: Path | None
    ) -> list[bench_all.BenchOutcome]:
        seen.update(out=out, quick=quick, only=only, profile=profile)
        return [bench_all.BenchOutcome("attention", "ran", 0), bench_all.BenchOutcome("decode", "failed", 1)]

    monkeypatch.setattr(bench_all, "run_all", fake_run_all)
    assert bench_all.main(["--quick", "--only", "attention,decode", "--out", str(tmp_path)]) == 1
    assert seen == {"out": tmp_path, "quick": True, "only": ["attention", "decode"], "profile": None}
    assert bench_all.main(["--profile", str(tmp_path / "none.json")]) == 2
    assert [e.name for e in bench_all.REGISTRY] == ["attention", "decode", "throughput", "serve"]


def test_bench_name_help_shows_the_benchmarks_own_options(capsys: pytest.CaptureFixture[str]) -> None:
    for name, option in (("all", "--only"), ("report", "--baseline-ref")):
        with pytest.raises(SystemExit) as e:
            cli_main(["bench", name, "--help"])
        assert e.value.code == 0 and option in capsys.readouterr().out
