"""Link profiles and the communication roofline: hand-computed numbers, profile files, and
``flashpage roofline --world N --link NAME`` (table and JSON)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flashpage.cli import main
from flashpage.roofline.comm import min_hidden_block, ring_allreduce_time, ring_step, tp_decode
from flashpage.roofline.hardware import HardwareProfile
from flashpage.roofline.links import LinkProfile, builtin_link_names, load_link, save_link
from flashpage.roofline.model_shapes import ModelShape

# 2 query heads, 1 KV head, d = 64; bf16 peak 1 TFLOP/s; link 1 GB/s.
SHAPE = ModelShape("t", hidden=128, intermediate=256, layers=2, heads=2, kv_heads=1, head_dim=64, vocab=1000)
PROF = HardwareProfile("toy", {"bf16": 1e12}, hbm_bandwidth=1e11, num_sms=1, l2_bytes=1, memory_bytes=1)


def test_builtin_links_have_sources() -> None:
    names = builtin_link_names()
    assert names == ["nvlink4", "pcie5", "ib-ndr", "ib-hdr", "roce-400g", "roce-200g", "tcp"]
    for n in names:
        link = load_link(n)
        assert link.bandwidth > 0 and link.latency > 0 and link.source
    assert load_link("nvlink4").bandwidth == 450e9 and load_link("ib-ndr").bandwidth == 50e9
    with pytest.raises(ValueError, match="link: unknown link 'carrier-pigeon'"):
        load_link("carrier-pigeon")


def test_min_block_hand_computed() -> None:
    link = LinkProfile("toy", 1e9, 0.0)
    # forward: 4*2*64 n^2 / 1e12 >= 2*1*64*2 n / 1e9  ->  n >= 256e3 / 512 = 500
    assert min_hidden_block(SHAPE, PROF, link) == 500
    assert min_hidden_block(SHAPE, PROF, link, causal=True) == 1000  # half the work per step
    # backward: 10*2*64 n^2 / 1e12 >= 2*64*(2+4) n / 1e9  ->  n >= 768e3 / 1280 = 600
    assert min_hidden_block(SHAPE, PROF, link, backward=True) == 600
    # with 1 us latency: 5.12e-10 n^2 - 2.56e-7 n - 1e-6 >= 0  ->  n >= 503.88
    lat = LinkProfile("toy", 1e9, 1e-6)
    assert min_hidden_block(SHAPE, PROF, lat) == 504
    assert ring_step(SHAPE, PROF, lat, block=504).hidden and not ring_step(SHAPE, PROF, lat, block=503).hidden
    s = ring_step(SHAPE, PROF, lat, block=1000)
    assert s.compute_s == pytest.approx(5.12e-4) and s.transfer_s == pytest.approx(1e-6 + 2.56e-4)


def test_tp_allreduce_hand_computed() -> None:
    link = LinkProfile("toy", 1e9, 1e-6)
    assert ring_allreduce_time(1e6, 4, link) == pytest.approx(6e-6 + 1.5e-3)
    assert ring_allreduce_time(1e6, 1, link) == 0.0
    tp = tp_decode(SHAPE, PROF, link, world=2, batch=4, ctx=64)
    # 2 all-reduces per layer x 2 layers of 4*128*2 bytes: 4 * (2 us + 1024 / 1e9 s)
    assert tp.allreduce_s == pytest.approx(4 * (2e-6 + 1.024e-6))
    assert 0 < tp.share < 1 and tp.comm_bound == (tp.allreduce_s > tp.compute_s)


def test_link_profile_file_round_trip(tmp_path: Path) -> None:
    p = save_link(LinkProfile("measured", 12e9, 7e-6, "netprobe"), tmp_path / "l.json", {"rows": []})
    got = load_link(p)
    assert (got.name, got.bandwidth, got.latency) == ("measured", 12e9, 7e-6)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"name": "x", "latency": 1}))
    with pytest.raises(ValueError, match="missing required field 'bandwidth'"):
        load_link(bad)


def test_cli_roofline_world_json(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["roofline", "--hardware", "h100-sxm", "--model", "llama-3-8b", "--seq", "32768", "--json"]
    assert main([*argv, "--world", "8", "--link", "ib-ndr"]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert out["ops"]  # the single-GPU contract is still there
    d = out["distributed"]
    assert d["world"] == 8 and d["link"]["name"] == "ib-ndr" and d["ring"]["block_tokens"] == 4096
    fwd = next(s for s in d["ring"]["steps"] if s["pass"] == "fwd" and not s["causal"])
    # K/V of 4096 tokens x 8 KV heads x 128 x 2 bytes x 2 over 50 GB/s, + 3 us
    assert fwd["transfer_s"] == pytest.approx(3e-6 + 2 * 4096 * 8 * 128 * 2 / 50e9)
    assert fwd["compute_s"] == pytest.approx(4 * 32 * 128 * 4096**2 / 989.4e12, rel=1e-3)
    assert not fwd["hidden"] and d["warnings"] and "warning: ring attention" in captured.err
    assert main([*argv, "--world", "8", "--link", "nvlink4"]) == 0
    nv = json.loads(capsys.readouterr().out)["distributed"]
    assert all(s["hidden"] for s in nv["ring"]["steps"]) and not any("ring" in w for w in nv["warnings"])


def test_cli_roofline_world_table_and_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(["roofline", "--hardware", "h100-sxm", "--model", "llama-3-8b", "--world", "2", "--link", "tcp"])
        == 0
    )
    out = capsys.readouterr().out
    assert "distributed: world 2 over tcp" in out and "WARNING: tensor-parallel decode" in out
    assert main(["roofline", "--hardware", "h100-sxm", "--world", "2", "--link", "nope"]) == 2
    assert "link: unknown link 'nope'" in capsys.readouterr().err
    assert main(["roofline", "--hardware", "h100-sxm", "--world", "1"]) == 2
    assert "world: must be >= 2" in capsys.readouterr().err
