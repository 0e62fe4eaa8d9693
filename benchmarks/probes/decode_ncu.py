"""Probe (not part of the library): hardware counters of paged decode against cuDNN (issue #5).

Launches, for each shape (GQA 32/8, d=128, bf16, block size 16), one call of each of:

* ``cudnn``: SDPA cuDNN on a contiguous ``(b, hk, ctx, d)`` cache (the floor target);
* ``rand`` / ``seq``: the library's ``run_decode`` at the planner's split count over a random /
  ascending block table (the same values);

each inside its own ``cudaProfilerStart``/``Stop`` window after a warm-up, so that Nsight Compute
started with ``--profile-from-start off`` profiles exactly those launches (decode kernel + combine).
Every output is checked against the cuDNN output first.

Measured (2026-12-06, torch 2.11, triton 3.6, ``--set full``, clocks not locked; launches
serialised, so the split combine is not overlapped as PDL does in a timed run):

* cuDNN runs ``cudnn_generated_fort_native_sdpa_sm80_flash_fprop_wmma_f16_knob_35_16x128x128_1x4x1``:
  sm80 ``cp.async`` (no TMA) and ``mma.sync``, 16 query rows x 128 keys x d=128, 4 warps, 183
  registers, 86 KiB of shared memory, 2 CTAs per SM. No split at b32/32k (grid 1 x 8 x 32) and
  b256/4k (1 x 8 x 256, 7.8 waves); at b1/128k 32 chunks x 8 heads plus a 4-4.5 us
  ``lean_reduction_kernel``. Its loop alternates a 32 KiB K copy and a 32 KiB V copy
  (``DEPBAR.LE SB0, 1``): one is always in flight while the other is computed on.
* flashpage (planner: 4 KV heads per program and 8 splits at b32/32k, one head at b256/4k, 64 splits
  at b1/128k) issues as many 16-byte ``cp.async`` as cuDNN, plus 4.2M block-id loads at b32/32k
  (L1 hits), and waits for all its copies at the top of each tile (``DEPBAR.LE SB0, 0``): two thirds
  of its warp samples stall there (long scoreboard).
* Both read the same DRAM bytes (4.296 GB at b32/32k) in the same DRAM-active time; the difference is
  DRAM idle time. H100: b32/32k 1.338 ms (DRAM active 95.8%) vs 1.363 (94.1%) + 5.9 us combine,
  ascending pages 1.362 (94.2%); b256/4k 1.353 (94.9%) vs 1.366 (93.9%), ascending pages 1.351
  (95.0%); b1/128k 175.0 + 4.5 us (91.9%) vs 179.1 + 4.3 us (89.9%). H200: b32/32k 945.0 us (94.5%)
  vs 968.8 (92.3%) + 5.5 us; b256/4k 950.4 (94.1%) vs 964.0 (92.7%), ascending 952.9 (93.8%);
  b1/128k 125.4 + 4.0 us (89.4%) vs 129.2 + 3.5 us (86.8%).

Timing the same kernels over 8k-64k contexts at b32 (H100, ``decode_page_order.py`` with
``SHAPES``) puts the gap in the per-token slope (42.24 against 41.51 us per 1k tokens, +1.8%), not in
a fixed start or tail cost (intercepts 26 / 20 us); at b256 (one split) the slope is +0.8% over
random pages and +0.2% over ascending ones. Keeping a load in flight during the math did not close
it in Triton (``decode_stages.py``).

Run on the GPU (Firecracker machines only; gVisor has no counters)::

    ncu --profile-from-start off --clock-control none --set full -o $OUT/decode \\
        python3 benchmarks/probes/decode_ncu.py
    ncu -i $OUT/decode.ncu-rep --page details --csv > $OUT/details.csv

``SHAPES=b:ctx,...`` picks the shapes (default ``32:32768,256:4096,1:131072``). Without ncu the
script just runs (the profiler calls are no-ops), which checks it; ``DEV=cpu TRITON_INTERPRET=1``
with ``SHAPES=2:256`` runs it on a CPU.
"""

from __future__ import annotations

import os

import torch

from flashpage.ops.paged_plan import plan_decode, run_decode

H, HK, D, PAGE = 32, 8, 128, 16


def probe(b: int, ctx: int, dev: torch.device) -> None:
    """Warm up and profile one call of each implementation at ``(b, ctx)``."""
    dt = torch.bfloat16
    n = b * ctx // PAGE
    kc = torch.randn(n, PAGE, HK, D, device=dev, dtype=dt)
    vc = torch.randn_like(kc)
    q = torch.randn(b, H, D, device=dev, dtype=dt)
    seqlens = torch.full((b,), ctx, dtype=torch.int32, device=dev)
    gen = torch.Generator().manual_seed(0)
    tabs = {"rand": torch.randperm(n, generator=gen), "seq": torch.arange(n)}
    tabs = {k: v.view(b, ctx // PAGE).to(torch.int32).to(dev) for k, v in tabs.items()}
    t = tabs["rand"].long()
    kk = kc[t].reshape(b, ctx, HK, D).transpose(1, 2).contiguous()
    vv = vc[t].reshape(b, ctx, HK, D).transpose(1, 2).contiguous()

    def cudnn() -> torch.Tensor:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = SDPBackend.CUDNN_ATTENTION if dev.type == "cuda" else SDPBackend.MATH
        with sdpa_kernel(backend):
            out = torch.nn.functional.scaled_dot_product_attention(q.unsqueeze(2), kk, vv, enable_gqa=True)
        return out[:, :, 0]

    plan = plan_decode(b, H, HK, D, block_size=PAGE, max_seqlen_k=ctx, q_dtype=dt, device=dev)
    ref = cudnn().float()
    # Checked over the random table only: the contiguous copy holds its pages' values, not seq's.
    err = (run_decode(plan, q, kc, vc, tabs["rand"], seqlens).float() - ref).abs().max().item()
    assert err < 2e-2, err
    calls = {"cudnn": cudnn}
    for name, bt in tabs.items():
        calls[name] = lambda bt=bt: run_decode(plan, q, kc, vc, bt, seqlens)
    for name, fn in calls.items():
        for _ in range(5):
            fn()
        if dev.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStart()
        fn()
        if dev.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStop()
        print(f"b={b} ctx={ctx} {name}: profiled (splits {plan.num_splits})", flush=True)


def main() -> None:
    dev = torch.device(os.environ.get("DEV", "cuda"))
    spec = os.environ.get("SHAPES", "32:32768,256:4096,1:131072")
    for item in spec.split(","):
        b, ctx = (int(x) for x in item.split(":"))
        probe(b, ctx, dev)
        if dev.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
