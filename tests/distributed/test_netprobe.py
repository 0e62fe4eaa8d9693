"""netprobe: NCCL log parsing (one excerpt per transport, in the formats NCCL prints), the verdict,
nccl-tests' bus-bandwidth factors, and the probe itself on gloo (2 CPU processes, tiny sizes) both
as a function and as ``flashpage netprobe`` under a torchrun-style environment."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from flashpage.cli import main
from flashpage.distributed.netprobe import busbw_factor, link_from_rows, parse_nccl_log, run_probe, verdict
from flashpage.roofline.links import load_link
from tests.distributed.spawn import free_port, run_ranks

# Line formats as NCCL 2.x prints them (e.g. NVIDIA/nccl issues #707, #687, #952, #1053, #1814,
# nccl-tests #166, Mellanox/nv_peer_memory #56); host names, pids and bus ids are made up.
IB_GDR = """\
nodeA:1201:1290 [0] NCCL INFO NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_1:1/IB ; OOB ib0:10.0.0.1<0>
nodeA:1201:1290 [0] NCCL INFO Channel 00/0 : 0[0] -> 8[0] [send] via NET/IB/0/GDRDMA
nodeA:1201:1290 [0] NCCL INFO Channel 00/0 : 8[0] -> 0[0] [receive] via NET/IB/0/GDRDMA
nodeA:1201:1291 [1] NCCL INFO Channel 01 : 2[c7000] -> 0[87000] [receive] via NET/IB/5/GDRDMA
"""
IB_NO_GDR = """\
nodeB:2201:2290 [0] NCCL INFO NET/IB : Using [0]mlx5_0:1/IB ; OOB ib0:192.168.11.1<0>
nodeB:2201:2290 [0] NCCL INFO Channel 00 : 0[3b000] -> 4[3b000] [send] via NET/IB/0
nodeB:2207:2260 [7] NCCL INFO Channel 03/0 : 47[7] -> 39[7] [receive] via NET/IBext_v8/2
"""
ROCE_GDR = """\
nodeC:3301:3390 [0] NCCL INFO NET/IB : Using [0]mlx5_2:1/RoCE [RO]; OOB eth0:10.1.0.5<0>
nodeC:3301:3390 [0] NCCL INFO Channel 00/0 : 0[0] -> 8[0] [send] via NET/IB/0/GDRDMA
"""
SOCKET = """\
nodeD:4401:4490 [0] NCCL INFO NET/Socket : Using [0]eth0:10.2.0.7<0>
nodeD:4401:4490 [0] NCCL INFO Using network Socket
nodeD:4408:4491 [7] NCCL INFO Channel 03/0 : 15[7] -> 6[6] [send] via NET/Socket/3
nodeD:4401:4490 [0] NCCL INFO Channel 01/0 : 8[0] -> 15[7] via P2P/IPC/read
"""
P2P = """\
nodeE:5501:5590 [1] NCCL INFO Channel 00 : 1[a000] -> 0[7000] via P2P/IPC/read
nodeE:5500:5591 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read
"""
SHM = """\
nodeF:6606:6650 [6] NCCL INFO Channel 09 : 6[6] -> 7[7] via SHM/direct/direct
nodeF:6601:6651 [1] NCCL INFO Channel 00 : 1[1] -> 2[2] via P2P/IPC
"""


def test_parse_ib_gpudirect() -> None:
    t = parse_nccl_log(IB_GDR)
    assert {(p.src, p.dst) for p in t.peers} == {(0, 8), (8, 0), (2, 0)}
    assert all(p.kind == "ib" and p.gpudirect for p in t.peers)
    assert t.nets == ["IB : [0]mlx5_0:1/IB [1]mlx5_1:1/IB ; OOB ib0:10.0.0.1<0>"]
    assert verdict(t) == "RDMA in use (GPUDirect) over InfiniBand"


def test_parse_ib_without_gpudirect() -> None:
    t = parse_nccl_log(IB_NO_GDR)
    assert [(p.kind, p.gpudirect) for p in t.peers] == [("ib", False), ("ib", False)]
    assert t.peers[1].via == ("NET/IBext_v8/2",)
    assert verdict(t).startswith("InfiniBand without GPUDirect")


def test_parse_roce() -> None:
    assert verdict(parse_nccl_log(ROCE_GDR)) == "RDMA in use (GPUDirect) over RoCE"


def test_parse_socket_fallback() -> None:
    t = parse_nccl_log(SOCKET)
    kinds = {(p.src, p.dst): p.kind for p in t.peers}
    assert kinds == {(15, 6): "socket", (8, 15): "p2p"}
    assert t.nets == ["Socket : [0]eth0:10.2.0.7<0>"]
    v = verdict(t)
    assert v.startswith("falling back to TCP sockets: check NCCL_IB_HCA / NCCL_SOCKET_IFNAME")


def test_parse_single_node_p2p_and_shm() -> None:
    t = parse_nccl_log(P2P)
    assert [p.kind for p in t.peers] == ["p2p", "p2p"]
    assert "P2P (NVLink or PCIe)" in verdict(t)
    s = parse_nccl_log(SHM)
    assert {p.kind for p in s.peers} == {"shm", "p2p"}
    assert "(SHM)" in verdict(s)
    # a pair seen over both P2P and a socket reports the slower one
    mixed = parse_nccl_log(
        P2P + "x:1:2 [0] NCCL INFO Channel 02/0 : 1[a000] -> 0[7000] [send] via NET/Socket/0"
    )
    assert {(p.src, p.dst): p.kind for p in mixed.peers}[(1, 0)] == "socket"
    assert verdict(parse_nccl_log("")).startswith("no NCCL transport lines")
    assert verdict(t, backend="gloo").startswith("gloo backend")


def test_busbw_factors() -> None:
    assert busbw_factor("all_reduce", 4) == 1.5 and busbw_factor("all_gather", 4) == 0.75
    assert busbw_factor("sendrecv", 8) == 1.0 and busbw_factor("all_reduce", 2) == 1.0
    with pytest.raises(ValueError, match="op: unknown collective 'broadcast'"):
        busbw_factor("broadcast", 2)


def _probe(rank: int, world: int, _arg: object) -> dict:
    solo = [dist.new_group([r]) for r in range(world)][rank]  # every rank creates every group
    return {
        "rows": run_probe([8, 4096], iters=2, warmup=1),
        "solo": run_probe([8], iters=1, warmup=0, group=solo),
    }


def test_run_probe_gloo() -> None:
    ranks = run_ranks(_probe, 2, timeout=120)
    rows = ranks[0]["rows"]
    assert [(r["op"], r["bytes"]) for r in rows] == [
        ("all_reduce", 8), ("all_gather", 8), ("sendrecv", 8),
        ("all_reduce", 4096), ("all_gather", 4096), ("sendrecv", 4096),
    ]  # fmt: skip
    for r in rows:
        assert r["time_us"] > 0
        assert r["algbw_gbps"] == pytest.approx(r["bytes"] / (r["time_us"] * 1e-6) / 1e9)
        assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * busbw_factor(r["op"], 2))
    assert [r["time_us"] for r in ranks[1]["rows"]] == [r["time_us"] for r in rows]  # slowest rank's, on all
    assert [(r["op"], r["busbw_gbps"]) for r in ranks[0]["solo"]] == [
        ("all_reduce", 0.0),
        ("all_gather", 0.0),
    ]
    with pytest.raises(ValueError, match="x: no sendrecv rows"):
        link_from_rows(ranks[0]["solo"], "x")
    bw, lat = link_from_rows(rows, "x")
    assert bw == rows[5]["busbw_gbps"] * 1e9 and lat == rows[2]["time_us"] * 1e-6


def test_cli_netprobe_under_torchrun_env(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prof = tmp_path / "link.json"
    port = free_port()
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}  # fmt: skip
        cmd = [sys.executable, "-m", "flashpage.cli", "netprobe", "--backend", "gloo", "--sizes", "8,1K",
               "--iters", "2", "--warmup", "1", "--json", "--save-profile", str(prof)]  # fmt: skip
        procs.append(
            subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    result = json.loads(outs[0][0])
    assert outs[1][0] == ""  # only rank 0 prints
    assert result["world"] == 2 and result["backend"] == "gloo" and len(result["rows"]) == 6
    assert result["verdict"].startswith("gloo backend")
    link = load_link(prof)
    assert link.name == "measured-gloo" and link.bandwidth > 0 and link.latency > 0
    assert main(["roofline", "--hardware", "h100-sxm", "--world", "2", "--link", str(prof), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["distributed"]["link"]["name"] == "measured-gloo"


def test_cli_netprobe_needs_torchrun(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("RANK", raising=False)
    assert main(["netprobe"]) == 2
    assert "run under torchrun" in capsys.readouterr().err
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert main(["netprobe", "--sizes", "8,lots"]) == 2
    assert "--sizes: 'LOTS'" in capsys.readouterr().err


def test_cli_netprobe_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["netprobe", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "--save-profile" in out and "torchrun" in out
