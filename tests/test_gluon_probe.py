"""The Gluon probes in benchmarks/probes still compile for sm_90 with this triton, with their schedules
intact. Compiles only (PTX through triton's bundled toolchain; see tests/sm90_ptx.py)."""

from __future__ import annotations

import re

import pytest

from tests.sm90_ptx import ROOT, sm90_ptx

PROBES = ROOT / "benchmarks" / "probes"


def test_attention_probe_keeps_the_overlap() -> None:
    """gluon_attn_fwd.py: the loop waits for the QK^T wgmma alone (``wait_group 1``) while the PV
    wgmma stays in flight."""
    pytest.importorskip("triton.experimental.gluon")
    ptx = sm90_ptx([str(PROBES / "gluon_attn_fwd.py"), "--ptx"])
    # Four warpgroup_mma calls (QK^T before and in the loop, PV in and after it), 8 k-steps of 16 each.
    assert ptx.count("wgmma.mma_async") == 32
    assert re.findall(r"wgmma.wait_group.sync.aligned (\d+)", ptx) == ["0", "1", "0", "0"]


def test_paged_decode_probe_keeps_its_partitions() -> None:
    """gluon_paged_decode.py: a 1-warp TMA producer (24 registers) and a consumer warpgroup (232),
    one K and one V box per page of the 4-page tile."""
    pytest.importorskip("triton.experimental.gluon")
    ptx = sm90_ptx([str(PROBES / "gluon_paged_decode.py"), "--ptx"])
    assert re.search(r"setmaxnreg.dec.sync.aligned.u32\s+24;", ptx)
    assert re.search(r"setmaxnreg.inc.sync.aligned.u32\s+232;", ptx)
    # 4 pages x (K, V), each 128-column box copied as two 64-column swizzled halves.
    assert len(re.findall(r"cp\.async\.bulk\.tensor\.2d", ptx)) == 16
    assert re.findall(r"wgmma.wait_group.sync.aligned (\d+)", ptx) == ["0", "0"]
