"""Probe (not part of the library): a Gluon FlashAttention forward for Hopper with FA3's intra-warpgroup
overlap, to measure how far explicit wgmma scheduling gets past the Triton kernel (issue #4).

Triton's own pipeliner waits for every QK^T wgmma right after issuing it (``wgmma.wait_group 0``
before the softmax's exp2s), so a warpgroup's softmax never overlaps its MMAs. Gluon (triton 3.6 and
3.9: ``triton.experimental.gluon``) exposes the asynchronous ``warpgroup_mma`` and
``warpgroup_mma_wait(num_outstanding)``, TMA and mbarriers. This kernel issues the next tile's QK^T and
this tile's PV before the softmax of the next tile and waits for the QK^T alone (``num_outstanding=1``),
so both wgmmas run on the tensor cores while the warpgroup computes exp2s. K/V stream through a
``STAGES``-deep TMA ring (each stage refilled once the wgmma that read it has finished).

Measured (H200, torch 2.11, triton 3.6, 2026-12-04; b=1, h=16, s=16384, d=128, bf16, non-causal,
``do_bench`` median, fastest of two rounds, same run): 128 x 128 tiles, 2 stages, 8 warps 512 TFLOP/s
(max error 2.4e-4 vs cuDNN); 128 x 64, 3 stages 460; flashpage's Triton kernel 523; SDPA cuDNN 623,
SDPA flash 358. So the intra-warpgroup overlap alone, with both warpgroups of the CTA in lockstep, is
not enough; FA3 adds ping-pong between two consumer warpgroups (one's softmax during the other's
GEMMs, ordered by barriers), a producer warp for the TMA loads and register reallocation: in Gluon,
``gl.warp_specialize`` partitions (present in triton 3.6). That kernel is now
``flashpage.ops.flash_fwd_ws`` (643 TFLOP/s on the same shape); this probe stays as the minimal
single-partition form of the overlap.

Limits: non-causal only, ``seqlen % BLOCK_M == seqlen % BLOCK_N == 0``, no masking, bf16, contiguous
``(batch, heads, seqlen, d)``. Gluon kernels do not run under the Triton interpreter: CUDA sm_90 only.
Compiles for sm_90 on a CPU-only machine (``triton.compile`` of a ``GluonASTSource``): 237 registers,
no spills (128 x 128), 157 (128 x 64).

Run: ``PYTHONPATH=src python benchmarks/probes/gluon_attn_fwd.py`` on an H200; ``... --ptx`` prints the
sm_90 PTX on any machine (tests/test_gluon_probe.py checks its wgmma waits).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

# The TMA copies under their triton 3.6 / 3.9 names, and the online-softmax step of the library's kernel.
from flashpage.ops.flash_fwd_ws import online_softmax_step as _softmax_step
from flashpage.ops.flash_fwd_ws import tma_load, tma_store
from flashpage.ops.launch_cache import KERNEL_OPTIONS


@gluon.jit
def gluon_attn_fwd_kernel(  # type: ignore[no-untyped-def]
    q_desc, k_desc, v_desc, o_desc, seqlen, qk_scale,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
    num_warps: gl.constexpr,
):  # fmt: skip
    """One ``BLOCK_M``-row query tile of one (batch, head); rows of the ``(b * h * s, d)`` views."""
    pid_m = gl.program_id(0)
    row0 = gl.program_id(1) * seqlen
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_N, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, HEAD_DIM, 16]
    )
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    dtype: gl.constexpr = q_desc.dtype

    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_bar.index(i), count=1)
        mbarrier.init(v_bar.index(i), count=1)

    # Tile t of K (V) lives in stage t % STAGES; it is that stage's (t // STAGES)-th load, so its
    # barrier phase is (t // STAGES) & 1.
    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma_load(q_desc, [row0 + pid_m * BLOCK_M, 0], q_bar, q_smem)
    n_tiles = seqlen // BLOCK_N
    for i in gl.static_range(STAGES):
        mbarrier.expect(k_bar.index(i), k_desc.block_type.nbytes)
        tma_load(k_desc, [row0 + i * BLOCK_N, 0], k_bar.index(i), k_smem.index(i))
        mbarrier.expect(v_bar.index(i), v_desc.block_type.nbytes)
        tma_load(v_desc, [row0 + i * BLOCK_N, 0], v_bar.index(i), v_smem.index(i))

    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, s_layout))
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)

    mbarrier.wait(q_bar, 0)
    mbarrier.wait(k_bar.index(0), 0)
    s = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
    if n_tiles > STAGES:  # K tile 0 is consumed: its stage takes tile STAGES
        mbarrier.expect(k_bar.index(0), k_desc.block_type.nbytes)
        tma_load(k_desc, [row0 + STAGES * BLOCK_N, 0], k_bar.index(0), k_smem.index(0))
    p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, qk_scale)

    for j in range(0, n_tiles - 1):
        st = j % STAGES
        nst = (j + 1) % STAGES
        # QK^T of tile j+1, then PV of tile j: both in flight during the softmax of tile j+1.
        mbarrier.wait(k_bar.index(nst), ((j + 1) // STAGES) & 1)
        s = warpgroup_mma(q_smem, k_smem.index(nst).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        mbarrier.wait(v_bar.index(st), (j // STAGES) & 1)
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        acc = warpgroup_mma(p_op, v_smem.index(st), acc, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))  # the QK^T; the PV stays in flight
        if j + 1 + STAGES < n_tiles:
            mbarrier.expect(k_bar.index(nst), k_desc.block_type.nbytes)
            tma_load(k_desc, [row0 + (j + 1 + STAGES) * BLOCK_N, 0], k_bar.index(nst), k_smem.index(nst))
        p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, qk_scale)
        acc, p_op = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p_op))  # p_op live until here
        if j + STAGES < n_tiles:
            mbarrier.expect(v_bar.index(st), v_desc.block_type.nbytes)
            tma_load(v_desc, [row0 + (j + STAGES) * BLOCK_N, 0], v_bar.index(st), v_smem.index(st))
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]

    last = n_tiles - 1
    st = last % STAGES
    mbarrier.wait(v_bar.index(st), (last // STAGES) & 1)
    p_op = gl.convert_layout(p.to(dtype), p_layout)
    acc = warpgroup_mma(p_op, v_smem.index(st), acc, is_async=True)
    acc, p_op = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p_op))
    acc = acc / gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))[:, None]

    mbarrier.invalidate(q_bar)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(k_bar.index(i))
        mbarrier.invalidate(v_bar.index(i))
    q_smem.store(acc.to(dtype))  # Q's buffer is free: stage the output tile there
    fence_async_shared()
    tma_store(o_desc, [row0 + pid_m * BLOCK_M, 0], q_smem)
    tma.store_wait(pendings=0)


def descriptors(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, block_m: int, block_n: int
) -> tuple[TensorDescriptor, ...]:
    """TMA descriptors over the ``(rows, d)`` views of q, k, v, o (``(b, h, s, d)`` contiguous)."""
    d = q.shape[-1]
    q2, k2, v2, o2 = (t.reshape(-1, d) for t in (q, k, v, o))
    lay_m = gl.NVMMASharedLayout.get_default_for([block_m, d], gl.bfloat16)
    lay_n = gl.NVMMASharedLayout.get_default_for([block_n, d], gl.bfloat16)
    return (
        TensorDescriptor(q2, list(q2.shape), list(q2.stride()), [block_m, d], lay_m),
        TensorDescriptor(k2, list(k2.shape), list(k2.stride()), [block_n, d], lay_n),
        TensorDescriptor(v2, list(v2.shape), list(v2.stride()), [block_n, d], lay_n),
        TensorDescriptor(o2, list(o2.shape), list(o2.stride()), [block_m, d], lay_m),
    )


def gluon_attn_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_m: int = 128, block_n: int = 128, stages: int = 2,
    num_warps: int = 8,
) -> torch.Tensor:  # fmt: skip
    """Non-causal attention of bf16 ``(b, h, s, d)`` contiguous q, k, v (``s`` a multiple of both tiles)."""
    b, h, s, d = q.shape
    if (
        q.dtype != torch.bfloat16
        or s % block_m
        or s % block_n
        or not all(t.is_contiguous() for t in (q, k, v))
    ):
        raise ValueError("the probe takes contiguous bf16 (b, h, s, d) with s a multiple of the tiles")
    o = torch.empty_like(q)
    descs = descriptors(q, k, v, o, block_m, block_n)
    grid = (s // block_m, b * h)
    gluon_attn_fwd_kernel[grid](
        *descs, s, d**-0.5 * 1.4426950408889634, block_m, block_n, d, stages, num_warps=num_warps, **KERNEL_OPTIONS
    )  # fmt: skip
    return o


def compile_for_sm90(block_m: int = 128, block_n: int = 128, stages: int = 2, num_warps: int = 8) -> str:
    """The kernel's PTX for sm_90, compiled without a GPU (``triton.compile`` of a Gluon AST source, the
    bundled ptxas); for checking the wgmma schedule on a CPU-only machine. Needs TRITON_INTERPRET unset
    at import time (under the interpreter triton's own jit helpers are not compilable)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    x = torch.empty(1024, 128, dtype=torch.bfloat16)
    descs = descriptors(x, x, x, x, block_m, block_n)
    sig = {
        n: mangle_type(dsc) for n, dsc in zip(("q_desc", "k_desc", "v_desc", "o_desc"), descs, strict=True)
    }
    sig |= {"seqlen": "i32", "qk_scale": "fp32"}
    consts = {
        "BLOCK_M": block_m,
        "BLOCK_N": block_n,
        "HEAD_DIM": 128,
        "STAGES": stages,
        "num_warps": num_warps,
    }
    sig |= dict.fromkeys(consts, "constexpr")
    src = GluonASTSource(gluon_attn_fwd_kernel, sig, constexprs=consts)
    kernel = triton.compile(
        src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, **KERNEL_OPTIONS}
    )
    return str(kernel.asm["ptx"])


def main() -> None:
    """Check against cuDNN, then time the probe, flashpage and SDPA in two round-robin rounds."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from flashpage.bench.common import do_bench_ms, round_robin
    from flashpage.ops.flash_attn import flash_attn_func

    b, h, s, d = 1, 16, 16384, 128
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    flops = 4 * b * h * s * s * d

    def sdpa(backend: Any) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v)

        return run

    qn, kn, vn = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    fns: dict[str, Callable[[], Any]] = {
        "sdpa-flash": sdpa(SDPBackend.FLASH_ATTENTION),
        "sdpa-cudnn": sdpa(SDPBackend.CUDNN_ATTENTION),
        "flashpage": lambda: flash_attn_func(qn, kn, vn),
    }
    ref = fns["sdpa-cudnn"]().float()
    for bm, bn, st in ((128, 128, 2), (128, 64, 3)):
        err = float((gluon_attn_fwd(q, k, v, bm, bn, st).float() - ref).abs().max())
        print(f"gluon {bm}x{bn} s{st}: max err {err:.2e}")
        if err < 2e-2:
            fns[f"gluon {bm}x{bn} s{st}"] = lambda bm=bm, bn=bn, st=st: gluon_attn_fwd(q, k, v, bm, bn, st)
    names = list(fns)
    times = round_robin(names, lambda n: do_bench_ms(fns[n], warmup=50, rep=100), 2, lambda n, e: print(n, e))
    for name, ts in zip(names, times, strict=True):
        if ts is not None:
            print(f"{name:24s} {min(ts):.3f} ms {flops / min(ts) / 1e9:.0f} TFLOP/s")


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["--ptx"]:
        print(compile_for_sm90())
    else:
        main()
