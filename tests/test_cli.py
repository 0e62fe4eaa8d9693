"""The ``flashpage`` command through ``main(argv)``: the roofline JSON contract, errors, help, dispatch."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest

from flashpage.cli import main
from flashpage.roofline.hardware import load_profile


def _json_ops(capsys: pytest.CaptureFixture[str], argv: list[str]) -> dict:
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_roofline_json_contract_h200_llama3_8b(capsys: pytest.CaptureFixture[str]) -> None:
    out = _json_ops(capsys, ["roofline", "--hardware", "h200", "--model", "llama-3-8b", "--json"])
    assert out["hardware"]["name"] == "h200" and out["model"]["name"] == "llama-3-8b"
    assert out["seq"] == 4096
    ops = out["ops"]
    assert ops and all({"phase", "op", "intensity", "ridge", "bound", "kernel"} <= set(o) for o in ops)
    by = {(o["phase"], o["op"]): o for o in ops}
    dec, pre = by[("decode", "attention")], by[("prefill", "attention")]
    assert dec["bound"] == "memory" and dec["kernel"].startswith("paged_decode")
    assert dec["intensity"] == pytest.approx(4.0, rel=1e-2)  # GQA group 4 in bf16
    assert pre["bound"] == "compute" and pre["kernel"] == "flash_fwd"
    assert "q=4096 k=4096" in pre["shape"]
    assert pre["intensity"] == pytest.approx(4096 * 32 / 80) and pre["ridge"] == pytest.approx(206.1, abs=0.1)
    assert by[("chunked_prefill", "attention")]["kernel"] == "paged_prefill"


def test_roofline_table_plot_and_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "config.json"
    cfg.write_text(
        json.dumps(
            {
                "hidden_size": 256,
                "intermediate_size": 512,
                "num_hidden_layers": 2,
                "num_attention_heads": 8,
                "num_key_value_heads": 2,
                "vocab_size": 1000,
            }
        )
    )
    png = tmp_path / "r.png"
    prof = load_profile("a100").to_dict()
    pfile = tmp_path / "a100.json"
    pfile.write_text(json.dumps(prof))
    argv = [
        "roofline",
        "--model",
        str(cfg),
        "--hardware",
        str(pfile),
        "--batch",
        "2",
        "--seq",
        "1024",
        "--plot",
        str(png),
    ]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "a100-80gb" in text and "flash_fwd" in text and "decode" in text and str(png) in text
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_bad_inputs_give_clear_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["roofline", "--hardware", "tpu-v9", "--model", "llama-3-8b"]) == 2
    err = capsys.readouterr().err
    assert "tpu-v9" in err and "h200" in err and "rtx-4090" in err and "cpu" in err
    assert main(["roofline", "--hardware", "h200", "--model", "gpt-17"]) == 2
    err = capsys.readouterr().err
    assert "gpt-17" in err and "llama-3-70b" in err and "smollm2-135m" in err
    bad = load_profile("h200").to_dict()
    del bad["num_sms"]
    f = tmp_path / "bad.json"
    f.write_text(json.dumps(bad))
    assert main(["roofline", "--hardware", str(f)]) == 2
    assert "num_sms" in capsys.readouterr().err
    assert main(["roofline", "--hardware", "h200", "--batch", "0"]) == 2
    assert "batch" in capsys.readouterr().err


@pytest.mark.parametrize("cmd", [[], ["roofline"], ["probe"], ["demo"], ["bench"]])
def test_help_for_every_subcommand(cmd: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main([*cmd, "--help"])
    assert e.value.code == 0
    assert "usage: flashpage" in capsys.readouterr().out


def test_probe_quick_cpu_writes_loadable_profile(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cpu.json"
    assert main(["probe", "--quick", "--device", "cpu", "--out", str(out)]) == 0
    assert str(out) in capsys.readouterr().out
    prof = load_profile(out)
    assert prof.name == "cpu" and prof.peak("fp32") > 0 and prof.hbm_bandwidth > 0


def test_demo_and_bench_forward_their_arguments(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    calls: list[tuple[str, list[str]]] = []

    def fake(name: str, rc: int | None) -> types.ModuleType:
        m = types.ModuleType(name)

        def _main(argv: list[str]) -> int | None:
            calls.append((name, argv))
            return rc

        m.main = _main  # type: ignore[attr-defined]
        return m

    monkeypatch.setitem(sys.modules, "flashpage.engine.demo", fake("demo", None))
    from flashpage.bench.all import REGISTRY

    for b in ("attention", "decode", "throughput", "all", "report"):
        monkeypatch.setitem(sys.modules, f"flashpage.bench.{b}", fake(b, 3 if b == "decode" else 0))
    sys.modules["flashpage.bench.all"].REGISTRY = REGISTRY  # type: ignore[attr-defined]
    assert main(["demo", "--model", "x", "--max-tokens", "4"]) == 0
    assert main(["bench", "attention", "--quick", "--out", "res", "--seqlens", "128"]) == 0
    assert main(["bench", "decode"]) == 3
    assert main(["bench", "all", "--quick", "--out", "res"]) == 0
    assert main(["bench", "report", "--out", "res", "--check"]) == 0
    assert main(["bench", "nope"]) == 2
    assert calls == [
        ("demo", ["--model", "x", "--max-tokens", "4"]),
        ("attention", ["--out", "res", "--quick", "--seqlens", "128"]),
        ("decode", []),
        ("all", ["--out", "res", "--quick"]),
        ("report", ["--results", "res", "--check"]),
    ]


def test_bench_missing_module_and_unknown_arguments(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "flashpage.bench.throughput", None)
    assert main(["bench", "throughput"]) == 1
    assert "flashpage.bench.throughput" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["roofline", "--bogus"])
    assert e.value.code == 2


def test_git_commit_override_and_dirty_marker(monkeypatch: pytest.MonkeyPatch) -> None:
    from flashpage.bench.common import git_commit

    monkeypatch.setenv("FLASHPAGE_GIT_COMMIT", "0123abcd")
    assert git_commit() == "0123abcd"
    monkeypatch.delenv("FLASHPAGE_GIT_COMMIT")
    c = git_commit()
    assert c == "unknown" or len(c.removesuffix("+dirty")) == 12
