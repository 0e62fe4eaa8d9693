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


def test_fp8_decode_reads_v_as_byte_pairs_in_four_programs_per_sm() -> None:
    """fp8 default (128-token tiles, early V, ``v_pairs``, ``maxnreg=128``): at most 128 registers
    (four programs per SM) with no local memory in the mask-free KV loop (the cap spills outside
    it; triton 3.9 reloads one word per masked tile, 3.6 none), and V reaches the MMAs through
    16-bit transposing shared loads and byte permutes, not the 128 byte-wise ``LDS.U8`` per thread
    per tile of the byte path (1.07-1.10x faster on an H100, 2026-12-07)."""
    rep = _report("--kv", "fp8")
    assert rep["registers"] <= 128, rep["registers"]
    assert rep["stack_bytes"] <= 64, rep["stack_bytes"]
    for loop in rep["loops"]:
        assert sum(n for op, n in loop["ops"].items() if op.startswith(("LDL", "STL"))) <= 1, loop["ops"]
    mask_free = rep["loops"][1]["ops"]
    assert not any(op.startswith(("LDL", "STL")) for op in mask_free), mask_free
    assert mask_free.get("HMMA.16816.F32", 0) == 64, mask_free
    assert "LDS.U8" not in mask_free, mask_free
    assert mask_free.get("PRMT", 0) == 64 and mask_free.get("LDSM.16.MT88.4", 0) == 8, mask_free


def test_fp8_decode_k_pairs_and_shared_offsets_trim_the_kv_loop() -> None:
    """The fp8 default plus ``k_pairs`` and ``share_kv_offsets`` (options, off: on the H100 and the
    H200 they read no faster, 2026-12-07): still at most 128 registers and no local memory in the
    mask-free loop; K as 16-bit pairs keeps the queries' MMA operand in the plain 16-bit layout, so
    ptxas no longer copies it into each MMA every tile (96 ``IMAD.MOV`` with K widened from bytes),
    and one offset computation for K and V saves a shared-memory layout change (8 barriers per tile
    instead of 10)."""
    rep = _report("--kv", "fp8", "k_pairs=True", "share_kv_offsets=True")
    assert rep["config"].endswith("-vp-kp-so"), rep["config"]
    assert rep["registers"] <= 128 and rep["stack_bytes"] <= 64, rep
    mask_free = rep["loops"][1]["ops"]
    assert not any(op.startswith(("LDL", "STL")) for op in mask_free), mask_free
    assert mask_free.get("HMMA.16816.F32", 0) == 64 and "LDS.U8" not in mask_free, mask_free
    assert mask_free.get("PRMT", 0) == 128, mask_free
    assert mask_free.get("IMAD.MOV.U32", 0) <= 8, mask_free
    assert mask_free.get("BAR.SYNC.DEFER_BLOCKING", 0) <= 8, mask_free


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
