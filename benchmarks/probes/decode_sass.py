"""Probe (not part of the library): compile the paged attention kernel for sm_90 on a machine without
a GPU and report what the GPU would run: registers, spills, shared memory and, per loop of the SASS,
an instruction histogram. GPU time is scarce; this answers "what did Triton make of this change?"
(vectorised loads? byte-wise shared loads? spills?) before a device run.

Uses the installed triton's bundled ``ptxas`` and ``cuobjdump``. The constexprs come from
:func:`flashpage.ops.paged_decode.paged_kernel_constexprs`, as the launcher's, for a decode launch
over a paged cache (block size 16, offsets and grid order per the config, no PDL, no LSE), with every pointer and stride
16-divisible, as Triton specialises them for a real cache. The kernel's three KV loops are the
masked head tiles, the mask-free tiles (the one that matters for long contexts) and the masked tail.

Checked against the device (triton 3.6, bf16 GQA 32/8 one-head decode): it reports the register
counts measured there, 112 (88 with split-KV partials, 120 with 64-bit offsets), and 96 for the
4-head split kernel. Findings (2026-12-05):

- triton 3.9 gives the 4-head split kernel 111 registers (4 programs per SM instead of 3.6's 5);
  ``maxnreg=96`` brings it to 5 with 24 bytes of stack spilled outside the mask-free loop. Timed on
  an H100 (2026-12-06, triton 3.9 carried to the device, ``benchmarks/results/triton-3.9/``): the
  default reads within 0.2% of its triton 3.6 speed on every decode shape, and ``maxnreg`` 96 / 104
  change nothing but b256/4k (96: 2.4% slower).
- fp8 (``--kv fp8``, 128-token tiles, early V): 254-255 registers, mask-free loop 840 (3.9) / 859
  (3.6) instructions per thread per tile, 128 of them ``LDS.U8``: Triton widens fp8 in the dot-
  operand layout, so V's transposed operand is read from shared memory byte by byte. Loading the
  tiles as int32 words and widening them in registers (PTX ``cvt.rn.f16x2.e4m3x2``, then
  ``tl.join``/``tl.reshape`` so the conversion cannot move) gave 541 (3.9) / 760 (3.6)
  instructions and 163 / 145 registers, yet on the H100 (3.6, two runs, sequences x tokens/s over
  the bf16 kernel) it read slower than the byte path: with the same tiles b1/128k 1.26-1.28x against
  1.62x, b32/32k 1.43-1.53x against 1.78x, b64/4k 1.29-1.31x against 1.68-1.69x, b256/4k 1.67x
  against 1.71x; the best word-path tiles per shape (64-token tiles, no early V) 0.6-6% below the
  byte path; words for V only at best 1.63-1.73x, for K only within 1% of bytes. Not adopted.
- Since 2026-12-07 the fp8 default reads V as int16 byte pairs (``v_pairs``: transposing 16-bit
  shared loads, ``PRMT`` + ``F2FP`` per register, no ``LDS.U8``) under ``maxnreg=128``: mask-free
  loop 632-633 instructions, 128 registers (8 / 40 bytes of stack under 3.6 / 3.9, none touched in
  that loop); without the cap 621 (3.9) / 634 (3.6) instructions and 177 / 168 registers. On the
  H100 it reads 1.07-1.10x the byte path's speed (``decode_fp8_bound.py``).

- Fused split combine (an option since removed from the library; git history keeps it, 2026-12-07): the last arriver's merge used
  to load one split per iteration (fp8 default: 102-105 instructions, four ``LDG.128``, one L2 round
  trip per split: 64 at b1/128k). It now takes ``merge_chunk`` splits per step (4 for 16-row tiles
  at d=128), unrolled: ptxas hoists the step's 16 ``LDG.128`` above its math; 324 instructions per
  step (81 per split) under 3.6 and 3.9, the tile loop and the fp8 kernel's 128 registers and
  stack (8 / 32 bytes) unchanged, the bf16 4-head split kernel 200 -> 162 (3.6) / 188 -> 149 (3.9)
  registers. A ``(chunk, rows, d)`` load reduced over its first axis (c4e0eb8) was fine under 3.9
  but under 3.6 spilled 336 bytes and reduced through shared memory (1117 instructions per
  step). Timed on two H100s (2026-12-07, ``decode_fp8_bound.py``): still 6% slower than the PDL
  combine at fp8 b1/128k (0.118 against 0.110 ms; before the rework, bf16 b1/128k read 90.2% of
  cuDNN against the planner's 98.6%, ``decode_stages.py``), so it stays off.

- Chunked prefill (``--q-len 2048``: the Hopper tiles for 16-token pages, 128 x 128, 8 warps, 3
  stages, table prefetch), triton 3.9 against 3.6 (2026-12-06): 255 registers under both, 64 bytes
  of stack under 3.9 (3.6: none) read back only in the masked loops; the mask-free loop grows from
  725 to 751 instructions, among them two ``FENCE.VIEW.ASYNC.S``, two ``MEMBAR.ALL.CTA`` and a third
  ``BAR.SYNC`` per iteration (3.6: none, none, two): fences between the ``cp.async`` tile writes and
  the wgmma reads, which 3.6 did not emit. This launch read 7% slower under 3.9 on the H100
  (``benchmarks/results/triton-3.9/prefill-h100.json``); TMA-loaded tiles (pages >= 128 tokens) need
  no such fence and got faster.

Run without the Triton interpreter (``TRITON_INTERPRET`` unset): ``python decode_sass.py [--kv
bf16|fp16|fp8] [--group G] [--heads-k HK] [--d D] [--split] [--q-len N] [--sass FILE] [key=value ...]`` where
each ``key=value`` sets a :class:`~flashpage.ops.paged_decode.PagedAttnConfig` field (default: the
library's decode default for that KV dtype).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import re
import subprocess
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from flashpage.ops.launch_cache import KERNEL_OPTIONS
from flashpage.ops.paged_kernel import paged_attn_kernel
from flashpage.ops.paged_launch import (
    PagedAttnConfig,
    default_decode_config,
    kv_heads_per_program,
    kv_read_views,
    paged_kernel_constexprs,
    paged_tiles,
    with_heads,
)
from flashpage.ops.paged_prefill import default_prefill_config

_KV_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.float8_e4m3fn}
_PTR_TYPES = {"bf16": "*bf16", "fp16": "*fp16", "fp8": "*fp8e4nv"}


def resolved(config: PagedAttnConfig, kv: str, group: int, nheads_k: int, q_len: int) -> PagedAttnConfig:
    """``config`` with automatic heads per program (``0``) decided as the planner does where split-KV
    is needed: the most heads that fill 16 query rows, with ``wide_block_n`` tiles."""
    if config.heads_per_program:
        return config
    return with_heads(config, kv_heads_per_program(config, q_len, group, nheads_k, _KV_DTYPES[kv]))


def compile_sm90(
    config: PagedAttnConfig, kv: str = "bf16", group: int = 4, nheads_k: int = 8, head_dim: int = 128,
    split: bool = False, q_len: int = 1,
) -> Any:  # fmt: skip
    """The ``CompiledKernel`` of one decode launch of ``paged_attn_kernel`` for sm_90 (``q_len`` > 1:
    a chunked-prefill launch, queries packed by ``cu_seqlens_q`` as :func:`paged_prefill` passes them)."""
    config = resolved(config, kv, group, nheads_k, q_len)
    tiles = paged_tiles(config, q_len, group * nheads_k, nheads_k, _KV_DTYPES[kv])
    q = "fp16" if kv == "fp8" else kv
    # The launcher's views and flags for caches of this launch's shape (contiguous, offset 0).
    cache = torch.empty(1, 16, nheads_k, head_dim, dtype=_KV_DTYPES[kv], device="meta")
    _, v_pairs = kv_read_views(config, tiles, cache, head_dim, use_tma=False)
    consts = paged_kernel_constexprs(
        config, tiles, group=group, head_dim=head_dim, page_size=16, fp8=kv == "fp8", split=split,
        fp32_dot=False, wide=not config.narrow_offsets, heads_first=config.heads_first, varlen_q=q_len > 1,
        v_pairs=v_pairs,
    )  # fmt: skip
    pointers = {"Q": f"*{q}", "Out": f"*{q}", "K": _PTR_TYPES[kv],
                "V": "*i16" if v_pairs else _PTR_TYPES[kv],
                "desc_k": _PTR_TYPES[kv],
                "desc_v": _PTR_TYPES[kv]}  # fmt: skip
    i32_ptrs = {"BlockTable", "SeqlensK", "CuSeqlensQ", "BatchIdx", "KvStart"}
    fp32_ptrs = {"Lse", "MidO", "MidLse", "Alibi", "KScale", "VScale"}
    names = paged_attn_kernel.arg_names
    signature: dict[str, str] = {}
    attrs: dict[tuple[int, ...], list[list[Any]]] = {}
    for i, name in enumerate(names):
        if name in consts:
            signature[name] = "constexpr"
            continue
        if name in pointers:
            signature[name] = pointers[name]
        elif name in i32_ptrs:
            signature[name] = "*i32"
        elif name in fp32_ptrs:
            signature[name] = "*fp32"
        elif name in ("sm_scale", "softcap"):
            signature[name] = "fp32"
        elif name.startswith("stride") or name in ("window_left", "window_right", "num_splits", "q_per_seq"):
            signature[name] = "i32"
        else:
            raise RuntimeError(f"decode_sass does not know the type of the kernel's argument {name!r}")
        if signature[name].startswith("*") or name.startswith("stride"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(paged_attn_kernel, signature, constexprs=consts, attrs=attrs)
    options: dict[str, Any] = {
        "num_warps": config.num_warps,
        "num_stages": config.num_stages,
        **KERNEL_OPTIONS,
    }
    if config.maxnreg:
        options["maxnreg"] = config.maxnreg
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def _tool(name: str) -> str:
    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def sass_report(kernel: Any) -> dict[str, Any]:
    """Registers, stack (spills), shared memory and per-loop instruction histograms of ``kernel``."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        res = subprocess.run([_tool("cuobjdump"), "-res-usage", str(cubin)], capture_output=True, text=True,
                             check=True).stdout  # fmt: skip
        sass = subprocess.run([_tool("cuobjdump"), "-sass", str(cubin)], capture_output=True, text=True,
                              check=True).stdout  # fmt: skip
    usage = re.search(r"REG:(\d+) STACK:(\d+)", res)
    if usage is None:
        raise RuntimeError(f"no resource usage in cuobjdump's output: {res[-300:]}")
    instrs = [(int(m[1], 16), m[2]) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    index = {addr: i for i, (addr, _) in enumerate(instrs)}
    loops = []
    for i, (addr, text) in enumerate(instrs):
        jump = re.search(r"BRA\s.*?(0x[0-9a-f]+)", text)
        target = int(jump[1], 16) if jump else addr
        # A backward branch over more than a few instructions closes a loop (the KV loops here).
        if target < addr and target in index and i - index[target] > 50:
            body = instrs[index[target] : i + 1]
            ops = Counter(t.split()[1] if t.startswith("@") else t.split()[0] for _, t in body)
            loops.append({"instructions": len(body), "ops": dict(ops.most_common())})
    return {"registers": int(usage[1]), "stack_bytes": int(usage[2]), "shared_bytes": kernel.metadata.shared,
            "loops": loops, "sass": sass}  # fmt: skip


def _config(kv: str, head_dim: int, overrides: list[str], q_len: int = 1) -> PagedAttnConfig:
    if q_len > 1:  # the prefill tiles it picks on Hopper for 16-token pages (no GPU here to ask)
        with mock.patch("flashpage.ops.paged_prefill.gpu_family", return_value="hopper"):
            cfg = default_prefill_config(head_dim, torch.device("cuda"), _KV_DTYPES[kv], 16)
    else:
        cfg = default_decode_config(_KV_DTYPES[kv], head_dim)
    fields = {f.name for f in dataclasses.fields(PagedAttnConfig)}
    changes: dict[str, Any] = {}
    for item in overrides:
        key, _, value = item.partition("=")
        if key not in fields:
            raise SystemExit(f"unknown PagedAttnConfig field {key!r} (known: {sorted(fields)})")
        changes[key] = ast.literal_eval(value)
    return dataclasses.replace(cfg, **changes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kv", choices=sorted(_KV_DTYPES), default="bf16")
    parser.add_argument("--group", type=int, default=4, help="query heads per KV head")
    parser.add_argument("--heads-k", type=int, default=8)
    parser.add_argument("--d", type=int, default=128)
    parser.add_argument("--split", action="store_true", help="the split-KV variant (partials out)")
    parser.add_argument(
        "--q-len", type=int, default=1, help="query tokens per sequence (> 1: chunked prefill)"
    )
    parser.add_argument("--top", type=int, default=16, help="opcodes shown per loop")
    parser.add_argument("--json", action="store_true", help="print the report (without SASS) as JSON")
    parser.add_argument("--sass", help="also write the SASS to this file")
    parser.add_argument("overrides", nargs="*", help="PagedAttnConfig fields, key=value")
    args = parser.parse_args()
    cfg = resolved(
        _config(args.kv, args.d, args.overrides, args.q_len), args.kv, args.group, args.heads_k, args.q_len
    )
    report = sass_report(compile_sm90(cfg, args.kv, args.group, args.heads_k, args.d, args.split, args.q_len))
    if args.sass:
        Path(args.sass).write_text(report["sass"])
    del report["sass"]
    if args.json:
        print(json.dumps({"config": cfg.short(), "triton": triton.__version__, **report}))
        return
    print(f"{cfg.short()} ({args.kv}, triton {triton.__version__}): {report['registers']} registers, "
          f"{report['stack_bytes']} bytes stack, {report['shared_bytes']} bytes shared")  # fmt: skip
    for n, loop in enumerate(report["loops"]):
        top = ", ".join(f"{op} {c}" for op, c in list(loop["ops"].items())[: args.top])
        print(f"loop {n}: {loop['instructions']} instructions: {top}")


if __name__ == "__main__":
    main()
