"""Probe (not part of the library): paged split-KV decode in Gluon for Hopper, with TMA page loads
and a warp-specialized producer, to see whether a deeper, register-free load pipeline closes the
last 1-3% to cuDNN on a contiguous cache (issue #5).

Design:

- One program per (KV head, split, sequence). That is the library's heads-first grid; the splits
  cut the sequence's 64-token tiles evenly.
- A 1-warp producer partition reads each tile's block ids from the block table. Per page it issues
  one 2-D TMA box of 16 x 128 on the cache's ``(num_blocks * 16, nheads_k * d)`` view, for K and
  for V, into a ``STAGES``-deep shared-memory ring. It waits on per-slot "empty" mbarriers.
- A 4-warp consumer partition holds the GQA group's query heads as a 64-row tile padded with
  zeros. Q K^T and P V run as wgmma straight from shared memory, so KV bytes never pass through
  registers and the tensor cores have 16x headroom.
- Partial outputs and base-2 LSEs go to a ``(batch, nheads, splits, d)`` workspace; torch merges
  them here.
- ``maxnreg=128`` with 24 producer registers keeps two CTAs (3 stages, 112 KB of shared memory
  each) on an SM.

Measured (H200, torch 2.11, triton 3.6, 2026-12-04): GQA 32/8, d=128, bf16, block 16, random page
order. ``do_bench`` median, fastest of two round-robin rounds. Same run as SDPA cuDNN on a
contiguous cache and as flashpage's Triton kernel (``run_decode`` of the planner's plan, with its
PDL split combine). This kernel is timed without its combine:

| shape | cuDNN TB/s | Triton kernel | this, 4 pages x 3 stages | 2 x 6 | 2 x 3 | 1 CTA, 4 x 4 | no producer warp |
|---|---|---|---|---|---|---|---|
| b1/128k, 64 splits | 3.87 | 98.4% | 100.3% | 97.7% | 99.7% | 96.1% | 98.1% |
| b32/32k, 2 (4) splits | 4.49 | 97.4% | 97.9% (98.2%) | 96.7% | 97.8% | 98.1% | 95.8% |
| b64/4k, 1 split | 4.22 | 98.5% | 98.4% | 96.6% | 97.7% | 96.4% | 96.5% |
| b256/4k, 1 split | 4.46 | 98.4% | 97.9% (98.2%) | 96.3% | 97.1% | 95.9% | 97.0% |

So TMA pages with a producer warp read KV as fast as the Triton kernel, not faster. At b1/128k
the kernel alone passes cuDNN, but a combine costs ~1% there. Neither more bytes in flight
(deeper rings, one CTA per SM) nor fewer register-bound loads moved the other shapes. What is left
is the cost of reading 256-byte rows of randomly ordered pages: 0.7-1.3% (sequential pages read
98.1-100.1% of cuDNN with the Triton kernel). The library keeps the Triton kernel. Limits: bf16,
block size 16, ``d`` 128, ``G <= 64``. Gluon kernels do not run under the Triton interpreter.

Run: ``PYTHONPATH=src python benchmarks/probes/gluon_paged_decode.py`` on an H200; ``--ptx`` prints
the sm_90 PTX on any machine (tests/test_gluon_probe.py checks its partitions).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from flashpage.ops.flash_fwd_ws import online_softmax_step, tma_load
from flashpage.ops.launch_cache import KERNEL_OPTIONS

ROWS = gl.constexpr(64)  # wgmma's smallest M: the GQA group is padded to it


@gluon.jit
def _producer(a, G: gl.constexpr, HEAD_DIM: gl.constexpr, PAGE: gl.constexpr, PPT: gl.constexpr,
              STAGES: gl.constexpr):  # type: ignore[no-untyped-def]  # fmt: skip
    """Per tile: wait for its ring slot, then one K and one V TMA box per page."""
    k_desc, v_desc, k_smem, v_smem, ready, empty, bt_row, max_blocks, kcol, t0, t1 = a[0]
    for j in range(t0, t1):
        st = (j - t0) % STAGES
        mbarrier.wait(empty.index(st), (((j - t0) // STAGES) & 1) ^ 1)
        bar = ready.index(st)
        mbarrier.expect(bar, 2 * PPT * k_desc.block_type.nbytes)
        for i in gl.static_range(PPT):
            # Table entries past the sequence may hold anything: their keys are masked.
            page = gl.load(bt_row + gl.minimum(j * PPT + i, max_blocks - 1))
            tma_load(k_desc, [page * PAGE, kcol], bar, k_smem.index(st).slice(i * PAGE, PAGE))
            tma_load(v_desc, [page * PAGE, kcol], bar, v_smem.index(st).slice(i * PAGE, PAGE))


@gluon.jit
def _consumer(a, G: gl.constexpr, HEAD_DIM: gl.constexpr, PAGE: gl.constexpr, PPT: gl.constexpr,
              STAGES: gl.constexpr):  # type: ignore[no-untyped-def]  # fmt: skip
    """The group's queries against each tile by wgmma; the split's partial output and LSE."""
    k_desc, _v_desc, k_smem, v_smem, ready, empty, _bt_row, _max_blocks, _kcol, t0, t1 = a[0]
    q_row, stride_qh, q_smem, seqlen, qk_scale, mo_ptr, ml_ptr, num_splits = a[1]
    BN: gl.constexpr = PAGE * PPT
    dtype: gl.constexpr = k_desc.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16]
    )
    q_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    qr = gl.arange(0, ROWS, layout=gl.SliceLayout(1, q_layout))
    qc = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, q_layout))
    q_smem.store(gl.load(q_row + qr[:, None] * stride_qh + qc[None, :], mask=(qr < G)[:, None], other=0.0))
    fence_async_shared()
    m_i = gl.full([ROWS], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([ROWS], gl.float32, gl.SliceLayout(1, s_layout))
    acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, o_layout)
    s_zero = gl.zeros([ROWS, BN], gl.float32, s_layout)
    cols = gl.arange(0, BN, layout=gl.SliceLayout(0, s_layout))
    for j in range(t0, t1):
        st = (j - t0) % STAGES
        mbarrier.wait(ready.index(st), ((j - t0) // STAGES) & 1)
        s = warpgroup_mma(q_smem, k_smem.index(st).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        s = gl.where((j * BN + cols)[None, :] < seqlen, s, float("-inf"))
        p, m_i, l_i, alpha = online_softmax_step(s, m_i, l_i, qk_scale)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        p_op = gl.convert_layout(
            p.to(dtype), gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        )
        acc = warpgroup_mma(p_op, v_smem.index(st), acc, is_async=True)
        acc, p_op = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p_op))
        mbarrier.arrive(empty.index(st), count=1)
    rows_o = gl.arange(0, ROWS, layout=gl.SliceLayout(1, o_layout))
    cols_o = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    rows_s = gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
    out = acc / gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))[:, None]
    o_ptrs = mo_ptr + (rows_o * num_splits).to(gl.int64)[:, None] * HEAD_DIM + cols_o[None, :]
    gl.store(o_ptrs, out, mask=(rows_o < G)[:, None])
    gl.store(ml_ptr + rows_s * num_splits, m_i + gl.log2(l_i), mask=rows_s < G)


@gluon.jit
def gluon_paged_decode_kernel(  # type: ignore[no-untyped-def]
    q_ptr, k_desc, v_desc, bt_ptr, seqlens_ptr, mid_o, mid_lse,
    stride_qb, stride_qh, stride_btb, max_blocks, num_splits, qk_scale,
    G: gl.constexpr, HEAD_DIM: gl.constexpr, PAGE: gl.constexpr, PPT: gl.constexpr, STAGES: gl.constexpr,
    num_warps: gl.constexpr,
):  # fmt: skip
    """Grid ``(nheads_k, num_splits, batch)``; ``mid_o`` ``(batch, nheads, splits, d)`` and
    ``mid_lse`` ``(batch, nheads, splits)`` (base 2) float32."""
    hk = gl.program_id(0)
    split = gl.program_id(1)
    b = gl.program_id(2)
    BN: gl.constexpr = PAGE * PPT
    seqlen = gl.load(seqlens_ptr + b)
    n_tiles = gl.cdiv(seqlen, BN)
    per = gl.cdiv(n_tiles, num_splits)
    t0 = split * per
    t1 = gl.minimum(t0 + per, n_tiles)
    head0 = (b * gl.num_programs(0) + hk) * G
    mo_ptr = mid_o + (head0 * num_splits + split).to(gl.int64) * HEAD_DIM
    ml_ptr = mid_lse + head0 * num_splits + split
    if t0 >= t1:  # an empty split weighs 0 in the merge
        e_layout: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [1, num_warps], [1, 0])
        r = gl.arange(0, ROWS, layout=gl.SliceLayout(1, e_layout))
        c = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, e_layout))
        gl.store(
            ml_ptr + r * num_splits, gl.full([ROWS], float("-inf"), gl.float32, r.type.layout), mask=r < G
        )
        gl.store(mo_ptr + (r * num_splits).to(gl.int64)[:, None] * HEAD_DIM + c[None, :],
                 gl.zeros([ROWS, HEAD_DIM], gl.float32, e_layout), mask=(r < G)[:, None])  # fmt: skip
        return
    dtype: gl.constexpr = k_desc.dtype
    q_smem = gl.allocate_shared_memory(
        dtype, [ROWS, HEAD_DIM], gl.NVMMASharedLayout.get_default_for([ROWS, HEAD_DIM], dtype)
    )
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BN, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BN, HEAD_DIM], v_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    ring = (k_desc, v_desc, k_smem, v_smem, ready, empty, bt_ptr + b.to(gl.int64) * stride_btb, max_blocks,
            hk * HEAD_DIM, t0, t1)  # fmt: skip
    q_row = q_ptr + b.to(gl.int64) * stride_qb + hk * G * stride_qh
    rest = (q_row, stride_qh, q_smem, seqlen, qk_scale, mo_ptr, ml_ptr, num_splits)
    gl.warp_specialize(
        [
            (_consumer, ((ring, rest), G, HEAD_DIM, PAGE, PPT, STAGES)),
            (_producer, ((ring, rest), G, HEAD_DIM, PAGE, PPT, STAGES)),
        ],
        [1],
        [24],
    )


def _descriptors(k_cache: Tensor, v_cache: Tensor, pages_per_tile: int) -> tuple[TensorDescriptor, ...]:
    nblk, page, hk, d = k_cache.shape
    lay = gl.NVMMASharedLayout.get_default_for([page * pages_per_tile, d], gl.bfloat16)
    out = []
    for c in (k_cache, v_cache):
        c2 = c.view(nblk * page, hk * d)
        out.append(TensorDescriptor(c2, list(c2.shape), list(c2.stride()), [page, d], lay))
    return tuple(out)


def gluon_paged_decode(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor, seqlens: Tensor, num_splits: int,
    pages_per_tile: int = 4, stages: int = 3, maxnreg: int = 128, merge: bool = True,
) -> Tensor | tuple[Tensor, Tensor]:  # fmt: skip
    """Decode attention of bf16 ``q`` ``(batch, nheads, d)`` over a paged cache ``(num_blocks, 16,
    nheads_k, d)``; ``merge=False``: the split partials ``(mid_o, mid_lse)`` instead."""
    b, h, d = q.shape
    hk = k_cache.shape[2]
    mid_o = torch.empty(b, h, num_splits, d, device=q.device, dtype=torch.float32)
    mid_l = torch.empty(b, h, num_splits, device=q.device, dtype=torch.float32)
    gluon_paged_decode_kernel[(hk, num_splits, b)](
        q, *_descriptors(k_cache, v_cache, pages_per_tile), block_table, seqlens, mid_o, mid_l,
        q.stride(0), q.stride(1), block_table.stride(0), block_table.shape[1], num_splits,
        d**-0.5 * 1.4426950408889634, h // hk, d, k_cache.shape[1], pages_per_tile, stages,
        num_warps=4, maxnreg=maxnreg, **KERNEL_OPTIONS,
    )  # fmt: skip
    if not merge:
        return mid_o, mid_l
    w = torch.exp2(mid_l - mid_l.amax(-1, keepdim=True))
    return ((mid_o * w[..., None]).sum(2) / w.sum(-1)[..., None]).to(q.dtype)


def compile_for_sm90(pages_per_tile: int = 4, stages: int = 3) -> str:
    """The kernel's sm_90 PTX, compiled without a GPU (needs TRITON_INTERPRET unset at import)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    cache = torch.empty(64, 16, 8, 128, dtype=torch.bfloat16)
    kd, vd = _descriptors(cache, cache, pages_per_tile)
    sig = {"q_ptr": "*bf16", "k_desc": mangle_type(kd), "v_desc": mangle_type(vd), "bt_ptr": "*i32",
           "seqlens_ptr": "*i32", "mid_o": "*fp32", "mid_lse": "*fp32"}  # fmt: skip
    sig |= dict.fromkeys(("stride_qb", "stride_qh", "stride_btb", "max_blocks", "num_splits"), "i32")
    sig["qk_scale"] = "fp32"
    consts = {"G": 4, "HEAD_DIM": 128, "PAGE": 16, "PPT": pages_per_tile, "STAGES": stages, "num_warps": 4}
    sig |= dict.fromkeys(consts, "constexpr")
    src = GluonASTSource(gluon_paged_decode_kernel, sig, constexprs=consts)
    kernel = triton.compile(
        src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "maxnreg": 128, **KERNEL_OPTIONS}
    )
    return str(kernel.asm["ptx"])


def main() -> None:
    """Check ragged lengths against the library, then time the four GQA shapes of ``bench decode``."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from flashpage.bench.common import do_bench_ms, round_robin
    from flashpage.ops.paged_decode import paged_decode
    from flashpage.ops.paged_launch import PagedAttnConfig
    from flashpage.ops.paged_plan import choose_launch, plan_decode, run_decode
    from flashpage.ops.utils import default_num_sms

    torch.manual_seed(0)
    bs, h, hk, d = 16, 32, 8, 128
    lens = [1000, 37, 4096]
    nb = sum(-(-n // bs) for n in lens) + 5
    kc = torch.randn(nb, bs, hk, d, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    perm = torch.randperm(nb, device="cuda").to(torch.int32)
    bt = torch.zeros(len(lens), 4096 // bs, dtype=torch.int32, device="cuda")
    used = 0
    for i, n in enumerate(lens):
        bt[i, : -(-n // bs)] = perm[used : used + -(-n // bs)]
        used += -(-n // bs)
    sl = torch.tensor(lens, dtype=torch.int32, device="cuda")
    q = torch.randn(len(lens), h, d, device="cuda", dtype=torch.bfloat16)
    ref = paged_decode(q, kc, vc, bt, sl)
    for ns in (1, 3, 8):
        out = gluon_paged_decode(q, kc, vc, bt, sl, ns)
        assert isinstance(out, Tensor)
        print(f"check splits={ns}: max err {float((out.float() - ref.float()).abs().max()):.2e}", flush=True)

    for b, ctx in ((1, 131072), (32, 32768), (64, 4096), (256, 4096)):
        nblk = b * ctx // bs
        kc = torch.randn(nblk + 1, bs, hk, d, device="cuda", dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        bt = torch.randperm(nblk, device="cuda").view(b, ctx // bs).to(torch.int32)
        sl = torch.full((b,), ctx, dtype=torch.int32, device="cuda")
        q = torch.randn(b, h, d, device="cuda", dtype=torch.bfloat16)
        kk, vv = (c[bt.long()].reshape(b, ctx, hk, d).transpose(1, 2).contiguous() for c in (kc, vc))

        def cudnn(kk: Tensor = kk, vv: Tensor = vv, q: Tensor = q) -> Tensor:
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q.unsqueeze(2), kk, vv, enable_gqa=True)

        plan = plan_decode(b, h, hk, d, block_size=bs, max_seqlen_k=ctx, q_dtype=q.dtype, device=q.device)
        fns: dict[str, Callable[[], Any]] = {
            "sdpa-cudnn": cudnn,
            "flashpage": lambda plan=plan, q=q, kc=kc, vc=vc, bt=bt, sl=sl: run_decode(
                plan, q, kc, vc, bt, sl
            ),
        }
        ns = choose_launch(
            PagedAttnConfig(), 0, b, 1, hk, hk, torch.bfloat16, ctx, default_num_sms(q.device)
        ).num_splits
        for ppt, st in ((4, 3), (2, 6), (2, 3)):
            fns[f"gluon {ppt}x{st}"] = lambda ppt=ppt, st=st, q=q, kc=kc, vc=vc, bt=bt, sl=sl, ns=ns: (
                gluon_paged_decode(q, kc, vc, bt, sl, ns, ppt, st, merge=False)
            )
        names = list(fns)
        times = round_robin(
            names, lambda n, fns=fns: do_bench_ms(fns[n], warmup=30, rep=100), 2, lambda n, e: print(n, e)
        )
        kv_bytes = 2 * b * ctx * hk * d * 2
        for name, ts in zip(names, times, strict=True):
            if ts is not None:
                print(f"b{b}/{ctx} {name:14s} {kv_bytes / min(ts) / 1e9:.2f} TB/s", flush=True)


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["--ptx"]:
        print(compile_for_sm90())
    else:
        main()
