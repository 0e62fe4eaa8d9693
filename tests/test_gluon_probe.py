"""The Gluon attention probe (benchmarks/probes/gluon_attn_fwd.py) still compiles for sm_90 with this
triton, with its overlap intact: the loop waits for the QK^T wgmma alone (``wait_group 1``) while the PV
wgmma stays in flight. Compiles only (PTX and cubin through the bundled ptxas; Gluon does not run under
the interpreter), in a subprocess without TRITON_INTERPRET, which this suite's conftest sets and under
which triton's own jit helpers are not compilable."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_probe_compiles_for_sm90_with_the_overlap() -> None:
    pytest.importorskip("triton.experimental.gluon")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT / "src")
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "probes" / "gluon_attn_fwd.py"), "--ptx"],
        capture_output=True, text=True, env=env, timeout=600, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    ptx = run.stdout
    # Four warpgroup_mma calls (QK^T before and in the loop, PV in and after it), 8 k-steps of 16 each.
    assert ptx.count("wgmma.mma_async") == 32
    assert re.findall(r"wgmma.wait_group.sync.aligned (\d+)", ptx) == ["0", "1", "0", "0"]


def test_paged_decode_probe_compiles_for_sm90_with_its_partitions() -> None:
    """benchmarks/probes/gluon_paged_decode.py: a 1-warp TMA producer (24 registers) and a consumer
    warpgroup (232), one K and one V box per page of the 4-page tile."""
    pytest.importorskip("triton.experimental.gluon")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT / "src")
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "probes" / "gluon_paged_decode.py"), "--ptx"],
        capture_output=True, text=True, env=env, timeout=600, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    ptx = run.stdout
    assert re.search(r"setmaxnreg.dec.sync.aligned.u32\s+24;", ptx)
    assert re.search(r"setmaxnreg.inc.sync.aligned.u32\s+232;", ptx)
    # 4 pages x (K, V), each 128-column box copied as two 64-column swizzled halves.
    assert len(re.findall(r"cp\.async\.bulk\.tensor\.2d", ptx)) == 16
    assert re.findall(r"wgmma.wait_group.sync.aligned (\d+)", ptx) == ["0", "0"]
