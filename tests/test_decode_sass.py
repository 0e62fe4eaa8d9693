"""The paged decode kernel's sm_90 code keeps the properties its measured speed rests on (compiled
on the CPU by benchmarks/probes/decode_sass.py; registers decide how many programs share an SM)."""

from __future__ import annotations

import json
from typing import Any

from tests.sm90_ptx import ROOT, sm90_ptx

TOOL = str(ROOT / "benchmarks" / "probes" / "decode_sass.py")


def _report(*args: str) -> dict[str, Any]:
    return json.loads(sm90_ptx([TOOL, "--json", *args]).strip().splitlines()[-1])


def test_bf16_decode_fits_its_programs_per_sm() -> None:
    """bf16 GQA 32/8 decode defaults: no spills; one KV head per program without splits in <= 128
    registers (4 programs of 4 warps per SM); 4 KV heads per program with split-KV partials on
    128-column tiles in two programs per SM, the wave the planner's split count fills (188 registers
    and 72 KiB of shared memory with triton 3.9; 200 registers with 3.6). The mask-free loop reads K
    and V as 16-byte asynchronous copies, never element by element."""
    split = _report("--split")
    assert split["config"].startswith("n128") and split["config"].endswith("-h4"), split["config"]
    assert split["stack_bytes"] == 0
    # Two programs per SM: 2 x 128 threads x registers <= 64K, 2 x (shared + 1 KiB) <= 228 KiB.
    assert split["registers"] <= 255 and 2 * (split["shared_bytes"] + 1024) <= 228 * 1024, split
    one = _report("heads_per_program=1")
    assert one["stack_bytes"] == 0 and one["registers"] <= 128, one["registers"]
    for rep in (split, one):
        mask_free = rep["loops"][1]["ops"]  # loops: masked head tiles, mask-free tiles, masked tail
        assert mask_free.get("LDGSTS.E.BYPASS.128", 0) >= 16, mask_free
        assert not any(op.startswith(("LDG.E.U16", "LDS.U16", "LDS.U8")) for op in mask_free), mask_free


def test_fp8_decode_compiles_without_spills_to_speak_of() -> None:
    """fp8 default (128-token tiles, early V): at most 16 bytes of stack (triton 3.6's ptxas; none
    with 3.9). Its V operand is read byte-wise from shared memory (LDS.U8): reading words and
    widening them in registers removed that but read 0.6-24% slower on the H100 (2026-12-05)."""
    rep = _report("--kv", "fp8")
    assert rep["stack_bytes"] <= 16, rep["stack_bytes"]
    assert rep["loops"][1]["ops"].get("HMMA.16816.F32", 0) == 64


def test_chunked_prefill_mask_free_loop_runs_on_wgmma_without_spills() -> None:
    """The Hopper chunked-prefill tiles over 16-token pages (128 x 128, 8 warps, 3 stages, table
    prefetch): the mask-free loop issues its Q K^T and P V as wgmma (HGMMA) fed by 16-byte
    asynchronous K/V copies and touches no local memory (255 registers; triton 3.9 spills 64 bytes,
    outside that loop). Triton 3.9 also puts two proxy fences and two CTA memory barriers in it (3.6:
    none), likely why this launch read 7% slower under 3.9 on the H100 (2026-12-06)."""
    rep = _report("--q-len", "2048")
    assert rep["config"] == "n128w8s3-pt", rep["config"]
    mask_free = rep["loops"][1]["ops"]
    assert mask_free.get("HGMMA.64x128x16.F32.BF16", 0) == 16, mask_free
    assert mask_free.get("LDGSTS.E.BYPASS.128", 0) >= 16, mask_free
    assert not any(op.startswith(("LDL", "STL")) for op in mask_free), mask_free
