"""Probe (not part of the library): does keeping the next KV tile in flight during a tile's math close
paged decode's gap to cuDNN (issue #5)?

Nsight Compute on the H100 (``benchmarks/probes/decode_ncu.py``, 2026-12-06) showed cuDNN's decode
kernel (``sdpa_sm80_flash_fprop_wmma``, 16 x 128 x 128 tiles, 4 warps, 2 CTAs per SM, no split at
b32/32k) alternating K and V ``cp.async`` groups so that one 32 KiB group is always in flight, and
the library's kernel (Triton 3.6, ``num_stages=2``) waiting for *all* its loads at the top of each
tile (``DEPBAR.LE SB0, 0``) and issuing the next tile's only at the end of its math: nothing in flight
for a program during a third of its time. Both read the same DRAM bytes in the same DRAM-active
time; the library's kernel leaves DRAM idle 25 us longer at b32/32k (1.8% of the kernel).

Triton 3.6 gives the 4-KV-head tiles a double-buffered K/V ring (``DEPBAR.LE SB0, 3``) only at
``num_stages=5`` (3 and 4 stage the block-table loads instead): 168 registers and 72 KiB of shared
memory, 3 programs per SM, so the split count must keep the grid within one wave of those.

Rows per shape (GQA 32/8, d=128, bf16, block size 16), random and block-manager tables, timed in
round-robin rounds with cuDNN on a contiguous cache: the library's planner, and each variant of
``VARIANTS`` (default below) at the split counts given per shape.

Measured (torch 2.11, triton 3.6, 2026-12-06; % of cuDNN in the same run, random / block-manager
tables, fastest of two rounds):

* H200, ``num_stages=5`` (the double-buffered ring): slower everywhere. b32/32k: planner 97.4 / 98.7;
  s5h4 at 4 / 6 splits 96.4 / 97.9 and 96.2 / 97.2; s5h2 94-96; s5h1 (1 split) 97.1 / 98.9. b64/4k:
  planner 98.4 / 99.3; s5 93.5-97.2, s5h1 81-82. b256/4k: planner 98.6 / 99.6; s5h4 81, s5h2 95-97,
  s5h1 98.3 / 99.3. b1/128k: planner 99.0 / 100.2; s5 87-97.7.
* H100, cuDNN's tile (32 KiB K and V tiles, 2 programs per SM, half the planner's splits): n128h4
  (32 tokens x 4 heads, 4 warps, 200 registers) read b32/32k 98.9 / 99.0 against the planner's
  98.3 / 98.4 (a second run: 98.8 / 99.0 against 98.3 / 98.4), b16/32k 97.2 / 97.1 against 96.6 /
  96.9, b4/128k 99.0 / 99.2 against 98.6 / 98.8, b1/256k 98.3 / 98.2 against 98.0 / 98.3; but b64/4k
  96.6 / 96.6 against 97.9 / 97.7, b1/128k 97.8 / 99.9 at 64 splits, 97.7 / 97.5 at 128 (planner
  98.7 / 98.6), b256/4k 98.4 / 98.3 (planner 98.4 / 98.6). 8 warps (n128h4w8, 80 registers, 3
  programs per SM) and 64 x 2-head tiles (n128h2w8) read 0.3-1% less than n128h4 at long contexts.
  A third H100 run (same day): n128h4 98.1 / 98.7 at b32/32k (planner 97.8 / 98.2), 97.7 / 98.1 at
  b16/32k (97.3 / 97.8), 98.7 / 98.9 at b4/128k (98.3 / 98.2); whole pages per tile (n128h8: 16
  tokens x 8 heads, 206 registers; n128h8w8: 8 warps, 128) 97.0-98.4, the split-first grid order
  (n128h4sf) 97.4-98.4. So a +0.3-0.7% lead at batches of long contexts (where the planner already
  takes several heads per program), short of cuDNN and not measured on the H200; not in the library.
  Adopting it means 128-column tiles for several-head programs and a split count that fills one wave
  of 2 programs per SM (4 at b32/32k: 256 programs for 264 slots), not the planner's ">= 2 programs
  per SM".
* H200, L2 prefetches (a6ca8bf's ``l2_prefetch``: ``prefetch.global.L2`` of the program's own K/V
  rows 1, 2 or 4 tiles ahead; ``l2_prefetch_pages``: one ``cp.async.bulk.prefetch.L2`` per page, from
  the first head group's program), random / block-manager tables at the planner's split counts:
  b32/32k planner 98.1 / 99.5, l2p1 87.6 / 88.6, l2p2 67.3 / 68.2, l2p4 55.6 / 55.8, pages 70-78;
  b64/4k planner 99.7 / 100.7, l2p1 75.6 / 76.0, pages 40-41; b256/4k planner 100.3 / 101.4, l2p1
  86.4 / 87.1, pages 52-55; b1/128k planner 98.2 / 98.7, l2p1 89.1 / 89.3, pages 42-44. Removed.
* H100 (2026-12-06, evening, 0c27be0), random / block-manager tables: ``fc`` (the combine fused into
  the attention kernel: the last split program merges) read b32/32k 98.1 / 98.7 (planner 98.1 /
  98.7), b64/4k and b256/4k as the planner (one split: nothing to combine), but b1/128k 90.2 / 89.6
  against 98.6 / 98.4 (64 splits: the last program of each head merges 64 partials after every
  other has finished). ``n128h1`` (cuDNN's tiling: one KV head, 128-token tiles) b32/32k at 1 split
  97.9 / 98.8, at 2 97.3 / 98.2; b64/4k 95.8 / 96.0 (planner 98.2 / 98.3); b256/4k 99.2 / 99.6 (99.3 /
  99.6); b1/128k at 32 splits 98.6 / 99.1, at 64 98.1 / 98.5. Neither beats the planner.
* A register-carried next tile (loads issued after the math of the current tile, the loop not
  pipelined by Triton) compiled to 215 registers and 126 ``PRMT`` per tile re-packing the carried
  tiles before their shared-memory stores (offline, ``decode_sass.py``); not timed.

Run on the GPU: ``PYTHONPATH=src python benchmarks/probes/decode_stages.py [out.json]``;
``DEV=cpu TRITON_INTERPRET=1 ... --tiny`` checks the script on a CPU.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from decode_page_order import SHAPE, add_decode_row, decode_inputs, run_probe, table_case, tables, time_rows

from flashpage.ops.paged_decode import default_decode_config

# name -> config fields; split counts per (batch, ctx) below (0: the planner's).
VARIANTS: dict[str, dict[str, int]] = {
    "s5h4": {"num_stages": 5, "heads_per_program": 4},
    "s5h2": {"num_stages": 5, "heads_per_program": 2},
    "s5h1": {"num_stages": 5, "heads_per_program": 1},
    # cuDNN-like 32 KiB K and V tiles: 32 tokens x 4 heads (or 64 x 2), 2 (4 warps) or 3 (8 warps)
    # programs per SM.
    "n128h4": {"block_n": 128, "heads_per_program": 4},
    "n128h4w8": {"block_n": 128, "heads_per_program": 4, "num_warps": 8},
    "n128h2w8": {"block_n": 128, "heads_per_program": 2, "num_warps": 8},
    # Whole pages (16 tokens x 8 KV heads, 32 KiB) per tile; and n128h4 in split-first grid order.
    "n128h8": {"block_n": 128, "heads_per_program": 8},
    "n128h8w8": {"block_n": 128, "heads_per_program": 8, "num_warps": 8},
    "n128h4sf": {"block_n": 128, "heads_per_program": 4, "heads_first": False},
    # The split combine fused into the attention kernel (the last split program merges), and
    # cuDNN's own tiling: one KV head, 128 tokens per tile, no split where the grid fills a wave.
    "n128h1": {"block_n": 128, "heads_per_program": 1, "wide_block_n": 0},
}
PLANNER_SPLITS = ("fc",)  # variants timed at the planner's count on every shape
SPLITS: dict[tuple[int, int], dict[str, tuple[int, ...]]] = {
    (32, 32768): {
        "n128h1": (1, 2),
        "s5h4": (4, 6),
        "s5h2": (2, 3),
        "s5h1": (1,),
        "n128h4": (4, 8),
        "n128h4w8": (4, 6),
        "n128h2w8": (2, 3),
        "n128h8": (8,),
        "n128h8w8": (8,),
        "n128h4sf": (4,),
    },
    (64, 4096): {
        "n128h1": (1,),
        "s5h4": (2, 3),
        "s5h2": (1,),
        "s5h1": (1,),
        "n128h4": (2,),
        "n128h4w8": (2, 3),
        "n128h2w8": (1,),
    },
    (256, 4096): {
        "n128h1": (1,),
        "s5h4": (1,),
        "s5h2": (1,),
        "s5h1": (1,),
        "n128h4": (1,),
        "n128h4w8": (1,),
        "n128h2w8": (1,),
    },
    (1, 131072): {
        "n128h1": (32, 64),
        "s5h4": (64, 96),
        "s5h2": (32, 48),
        "s5h1": (16, 24, 32),
        "n128h4": (64, 128),
        "n128h4w8": (32, 48),
        "n128h2w8": (16, 24),
    },
    (8, 32768): {"n128h4": (16,)},
    (16, 32768): {"n128h4": (8,), "n128h8": (16,), "n128h8w8": (16,), "n128h4sf": (8,)},
    (4, 131072): {"n128h4": (32,), "n128h8": (64,), "n128h8w8": (64,), "n128h4sf": (32,)},
    (1, 131072 * 2): {"n128h4": (128,)},
    (2, 512): {"s5h4": (2,), "s5h1": (1,), "n128h4w8": (1,), "n128h1": (1,)},  # --tiny
}


def probe_shape(
    b: int,
    ctx: int,
    split_list: tuple[int, ...],
    dev: torch.device,
    gen: torch.Generator,
    tiny: bool,
    bench: Callable[[Callable[[], Any]], float],
) -> list[dict[str, Any]]:
    """Rows of one ``(batch, ctx)`` shape (``split_list`` unused: the counts come from ``SPLITS``)."""
    del split_list
    dt = torch.bfloat16
    _, _, d, bs = SHAPE
    kc, vc, seqlens, q, kv_bytes = decode_inputs(b, ctx, dev, dt)
    rows: list[tuple[dict[str, Any], Callable[[], Any]]] = []
    pick = os.environ.get("VARIANTS", ",".join(VARIANTS)).split(",")
    keep = os.environ.get("TABLES", "rand,bm").split(",")
    base_cfg = default_decode_config(dt, d)
    for name, t in tables(b, ctx, bs, gen).items():
        if name not in keep:
            continue
        bt, ref, _ = table_case(q, kc, vc, t, rows)

        add_decode_row(rows, {"table": name, "variant": "planner"}, q, kc, vc, bt, seqlens, ref, ctx)
        for vname in pick:
            cfg = replace(base_cfg, **VARIANTS[vname])
            for ns in (0,) if vname in PLANNER_SPLITS else SPLITS.get((b, ctx), {}).get(vname, ()):
                label = {"table": name, "variant": vname}
                add_decode_row(rows, label, q, kc, vc, bt, seqlens, ref, ctx, config=cfg, num_splits=ns)
    return time_rows(rows, b, ctx, kv_bytes, bench, tiny)


def main() -> None:
    run_probe(
        probe_shape, [(32, 32768, ()), (64, 4096, ()), (256, 4096, ()), (1, 131072, ())], "decode_stages"
    )


if __name__ == "__main__":
    main()
