"""``flashpage bench decode``: paged decode (and chunked prefill) against the baselines, in one run.

Decode rows (``bench="decode"``), GQA 32 q / 8 kv heads and MHA 32/32, d=128, bf16, one new token per
sequence, paged cache with block size 16 (a random permutation of the blocks):

* ``flashpage``: the split-KV paged decode kernel through ``plan_decode``/``run_decode``, the roofline
  planner's split count and the default tiles (``variant="planner"``); the same plan over the block
  tables a fresh :class:`~flashpage.kv.BlockManager` hands out when the batch's prompts (a quarter
  of ``ctx`` each) are allocated together and then decode in lockstep to ``ctx``
  (``variant="block-manager"``: ascending runs, the order an engine's tables have, where the
  ``planner`` row's random permutation is the worst case); ``flash_attn_with_kvcache`` over a
  contiguous ``(batch, ctx, nheads_k, d)``
  cache, flash-attn's unpaged layout (``variant="contiguous"``); with ``--variants`` also the
  best of a sweep over split counts, ``BLOCK_N``, warps and stages (``variant="best"``); and fp8 e4m3
  KV with per-head scales (``dtype="fp8_e4m3"``, with ``ratio_vs_bf16`` of sequences x tokens / s);
* ``sdpa-cudnn`` / ``sdpa-flash``: PyTorch SDPA on a contiguous ``(batch, nheads_k, ctx, d)`` cache
  (``enable_gqa=True``), the bandwidth target;
* ``gather-sdpa``: gather the pages into a contiguous cache, then SDPA flash (paged without a kernel);
* ``flash-attn`` / ``flashinfer`` when importable.

Effective bandwidth ``tbps = 2 * batch * ctx * nheads_k * d * bytes / time`` (the KV bytes a decode
step must read) and ``frac_of_roofline = tbps / copy bandwidth`` (of the profile ``--profile`` names,
which ``flashpage bench all`` measures with ``probe`` in the same run; default this device probed now:
a device copy, bytes read + written; see :func:`flashpage.bench.common.roofline_fraction`). Every implementation's output is
checked against SDPA before timing; then a shape's rows are timed in ``--rounds`` round-robin rounds (default 2), each row keeping its
fastest round (``ms``; ``ms_rounds`` lists all): a single sequential timing once read cuDNN 10% slow
on one shape (b256/4k, 1.057 ms where its other runs read 0.94-0.96). The ``planner`` and
``contiguous`` rows and the fp8 ``planner`` row also carry ``ms_graph``, the call replayed from a
CUDA graph (no host time): an eager call can be host-bound where the kernel is short; the fp8 row's
``ratio_vs_bf16_graph`` compares the two planner rows' graph replays.

Prefill rows (``bench="prefill"``): chunked prefill of 4 sequences x 2048 new tokens after a 2048-token
cached prefix (bottom-right causal): the paged prefill kernel vs the flash forward kernel
(``flashpage.ops.flash_attn.flash_attn_varlen_fwd``) on the same shape with a contiguous KV, plus SDPA
with a lower-right causal mask and flash-attn's varlen forward when importable (a ``missing`` row
otherwise); ``ratio_vs_flash`` is the flash kernel's time over the paged one's.
``paged-prefill-bs128`` rows run the same K/V in 128-token pages (a tile lies inside one page),
with the default tiles and (Hopper) the same tiles over the other load path, TMA or pointers.

Run ``python -m flashpage.bench.decode [--quick] [--variants]`` (or ``flashpage bench decode``);
``--smoke`` runs tiny shapes anywhere (CPU: the Triton interpreter) to check the script itself.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from flashpage.bench.common import (
    env_info,
    failure_reason,
    graph_ms,
    make_timer,
    markdown_table,
    roofline_fraction,
    round_robin,
    run_profile,
    status_row,
    write_results,
)
from flashpage.roofline.hardware import HardwareProfile

TABLE_COLUMNS = [
    "bench",
    "impl",
    "variant",
    "dtype",
    "batch",
    "ctx",
    "nheads",
    "nheads_k",
    "d",
    "block_size",
    "num_splits",
    "config",
    "ms",
    "tbps",
    "tflops",
    "frac_of_roofline",
    "max_err",
    "ratio_vs_flash",
    "ratio_vs_bf16",
]
_TOL = 2e-2  # max |out - sdpa| for bf16 outputs of unit-variance random data


@dataclass(frozen=True)
class DecodeShape:
    """One decode problem: ``batch`` sequences of ``ctx`` cached tokens."""

    batch: int
    ctx: int
    nheads: int
    nheads_k: int
    head_dim: int = 128


@dataclass(frozen=True)
class PrefillShape:
    """Chunked prefill: ``batch`` sequences of ``new`` tokens after a ``prefix``-token cached prefix."""

    batch: int
    prefix: int
    new: int
    nheads: int
    nheads_k: int
    head_dim: int = 128


@dataclass(frozen=True)
class BenchSettings:
    """Problem list and timing budget of one run."""

    decode: tuple[DecodeShape, ...]
    prefill: tuple[PrefillShape, ...]
    dtype: torch.dtype
    block_size: int
    warmup_ms: int
    rep_ms: int
    variants: bool
    fp8: bool
    rounds: int = 2


def _settings(args: argparse.Namespace) -> BenchSettings:
    if args.smoke:
        return BenchSettings(
            decode=(DecodeShape(2, 96, 8, 2, 32), DecodeShape(2, 48, 4, 4, 32)),
            prefill=(PrefillShape(2, 24, 20, 8, 2, 32),),
            dtype=torch.float32 if not torch.cuda.is_available() else torch.bfloat16,
            block_size=16,
            warmup_ms=1,
            rep_ms=1,
            variants=args.variants,
            fp8=True,
            rounds=max(1, args.rounds or 1),
        )
    gqa = [
        DecodeShape(1, 131072, 32, 8),
        DecodeShape(32, 32768, 32, 8),
        DecodeShape(64, 4096, 32, 8),
        DecodeShape(256, 4096, 32, 8),
    ]
    mha = (
        [DecodeShape(64, 4096, 32, 32)]
        if args.quick
        else [DecodeShape(64, 4096, 32, 32), DecodeShape(8, 32768, 32, 32)]
    )
    return BenchSettings(
        decode=tuple(gqa + mha),
        prefill=(PrefillShape(4, 2048, 2048, 32, 8), PrefillShape(4, 2048, 2048, 16, 4, 256)),
        dtype=torch.bfloat16,
        block_size=16,
        # 100 ms: a baseline timed right after a compile (GPU idle, clocks down) read up to 25% low
        # with 25 ms (H200, 2026-12-03: the flash-kernel prefill row, 323 vs 406 TFLOP/s).
        warmup_ms=10 if args.quick else 100,
        rep_ms=40 if args.quick else 100,
        variants=args.variants and not args.quick,
        fp8=True,
        rounds=max(1, args.rounds or (1 if args.quick else 2)),
    )


def _max_err(a: Tensor, b: Tensor) -> float:
    d = (a.float() - b.float()).abs()
    return float("inf") if bool(torch.isnan(d).any()) else float(d.max())


def _sdpa(backend_name: str) -> Callable[..., Tensor] | None:
    """SDPA restricted to one backend (None when this torch has no such backend)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    be = {"sdpa-cudnn": "CUDNN_ATTENTION", "sdpa-flash": "FLASH_ATTENTION", "sdpa-math": "MATH"}[backend_name]
    if not hasattr(SDPBackend, be):
        return None
    backend = getattr(SDPBackend, be)

    def run(q: Tensor, k: Tensor, v: Tensor, **kw: Any) -> Tensor:
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, **kw)

    return run


def _first_sdpa(q: Tensor, k: Tensor, v: Tensor, scale: float, gqa: dict[str, bool]) -> Tensor:
    """Reference output: the first SDPA backend that runs (cuDNN, flash, then math)."""
    for name in ("sdpa-cudnn", "sdpa-flash", "sdpa-math"):
        fn = _sdpa(name)
        if fn is None:
            continue
        try:
            return fn(q, k, v, scale=scale, **gqa)
        except RuntimeError:
            continue
    raise RuntimeError("no SDPA backend ran")


def _variant_configs(fp8: bool) -> list[Any]:
    from flashpage.ops.paged_decode import PagedAttnConfig, default_decode_config

    # The tile sweep keeps the plain split-KV combine (a second launch, whole-head programs) and the
    # split-first grid; the default configuration's knobs are measured on their own below.
    if fp8:
        # 128 x 4 first (the default without its early V load, which the knobs below add back: 210
        # registers, no spill on sm_90 with triton 3.6); 128 x 8 gets 128 registers and spills 28
        # bytes, 64 x 8 112 registers without spills.
        combos = [(128, 4, 2), (64, 4, 2), (64, 8, 2), (128, 8, 2), (256, 8, 2), (64, 4, 5)]
    else:
        # The block-table load in front of the gathered K/V tiles of 16-token pages halves the latency
        # Triton's pipeliner gives them: (num_stages - 1) // 2 buffers (one below 5 stages); with
        # prefetch_table, num_stages - 1 (sm_90 TTGIR / SASS probes).
        combos = [(bn, w, 2) for bn in (32, 64, 128) for w in (4, 8)] + [(64, 4, 3), (128, 8, 3)]
    cfgs = [PagedAttnConfig(block_n=bn, num_warps=w, num_stages=s) for bn, w, s in combos]
    if not fp8:
        cfgs += [PagedAttnConfig(block_n=bn, num_warps=w, num_stages=s, prefetch_table=True)
                 for bn, w, s in ((64, 4, 3), (64, 4, 4), (32, 4, 4), (128, 4, 3), (64, 8, 3))]  # fmt: skip
    # The default configuration with each latency knob flipped: early V load, register cap, 64-bit
    # KV-row offsets, the split-first grid, the plain second-launch combine, fp8 V read as byte pairs.
    d0 = default_decode_config(torch.float8_e4m3fn if fp8 else torch.bfloat16, 128)
    plain = {"pdl": False, "combine_block_d": 0, "combine_warps": 4}
    bf16_only = [] if fp8 else [{"maxnreg": 128}, {"narrow_offsets": False}]
    knobs = [{"early_v": not d0.early_v}, *bf16_only, {"heads_first": False}, plain,
             *([{"v_pairs": not d0.v_pairs}] if fp8 else [])]  # fmt: skip
    return cfgs + [replace(d0, **kw) for kw in knobs]


def _cfg_name(cfg: Any) -> str:
    return str(cfg.short())


def block_manager_table(batch: int, ctx: int, block_size: int, prompt_frac: float = 0.25) -> Tensor:
    """The ``(batch, ctx // block_size)`` int32 block tables (CPU) a fresh :class:`BlockManager` of
    exactly ``batch * ctx // block_size`` blocks hands out when ``batch`` prompts of ``prompt_frac *
    ctx`` tokens are allocated together and the sequences then decode in lockstep up to ``ctx``
    tokens: each prompt one ascending run, then one block per sequence per ``block_size`` steps."""
    from flashpage.kv.block_manager import BlockManager

    if ctx % block_size:
        raise ValueError(f"ctx ({ctx}) must be a multiple of block_size ({block_size})")
    bm = BlockManager(batch * ctx // block_size, block_size, enable_prefix_caching=False)
    prompt = max(1, int(ctx * prompt_frac))
    for s in range(batch):
        bm.allocate(s, [0] * prompt)
    # Per round, every sequence grows to its next block boundary: the same block order as growing
    # one token per step, in ctx / block_size rounds instead of ctx.
    while bm.num_tokens(0) < ctx:
        for s in range(batch):
            n = bm.num_tokens(s)
            bm.append_slots(s, min(ctx, (n // block_size + 1) * block_size) - n)
    return torch.tensor([bm.block_table(s) for s in range(batch)], dtype=torch.int32)


def bench_decode_shape(
    shape: DecodeShape,
    st: BenchSettings,
    device: torch.device,
    profile: HardwareProfile,
    time_ms: Callable[[Callable[[], Any]], float],
    sweep_ms: Callable[[Callable[[], Any]], float],
) -> tuple[list[dict[str, Any]], list[str]]:
    """Rows for one decode shape, and notes (failed correctness checks, skipped baselines).

    ``sweep_ms`` is the (shorter) timer for the ``--variants`` sweep; its winner is timed again with
    ``time_ms`` so best and planner rows are measured alike.
    """
    from flashpage.ops.cache_write import fp8_kv_scales
    from flashpage.ops.paged_decode import default_decode_config
    from flashpage.ops.paged_plan import plan_decode, run_decode

    b, ctx, h, hk, d, bs = shape.batch, shape.ctx, shape.nheads, shape.nheads_k, shape.head_dim, st.block_size
    dt = st.dtype
    nblk = b * ctx // bs
    k_cache = torch.randn(nblk + 1, bs, hk, d, device=device, dtype=dt)
    v_cache = torch.randn_like(k_cache)
    block_table = torch.randperm(nblk, device=device).view(b, ctx // bs).to(torch.int32)
    seqlens = torch.full((b,), ctx, dtype=torch.int32, device=device)
    q = torch.randn(b, h, d, device=device, dtype=dt)
    scale = d**-0.5
    table = block_table.long()

    def logical(cache: Tensor, tbl: Tensor) -> Tensor:
        """The sequences' KV under block table ``tbl``, contiguous ``(batch, nheads_k, ctx, d)``."""
        return cache[tbl.long()].reshape(b, ctx, hk, d).transpose(1, 2).contiguous()

    # Same values, contiguous, for the SDPA baselines.
    k_contig, v_contig = logical(k_cache, table), logical(v_cache, table)
    q4 = q.unsqueeze(2)  # (b, h, 1, d)
    gqa = {"enable_gqa": True} if h != hk else {}
    kv_bytes = 2 * b * ctx * hk * d * k_cache.element_size()
    base = {"bench": "decode", "batch": b, "ctx": ctx, "nheads": h, "nheads_k": hk, "d": d}
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    # Baselines that did not run: rows with status and reason (never dropped).
    status_rows: list[dict[str, Any]] = []

    def status(impl: str, state: str, reason: str) -> None:
        fields = {k: v for k, v in base.items() if k != "bench"}
        status_rows.append(status_row("decode", impl, state, reason, dtype=dtype_name, **fields))

    # Rows with the call to time and the bytes it reads; timed together at the end (round robin).
    pending: list[tuple[dict[str, Any], Callable[[], Any], int]] = []

    def row(impl: str, fn: Callable[[], Any], nbytes: int, dtype_name: str, **extra: Any) -> dict[str, Any]:
        r = {**base, "impl": impl, "dtype": dtype_name, **extra}
        pending.append((r, fn, nbytes))
        return r

    ref = _first_sdpa(q4, k_contig, v_contig, scale, gqa)[:, :, 0]
    dtype_name = str(dt).replace("torch.", "")

    def timed_plan(
        variant: str, p: Any, kc: Tensor, vc: Tensor, bt: Tensor = block_table, want: Tensor = ref
    ) -> dict[str, Any]:
        """Check ``p`` over caches ``kc``/``vc`` and table ``bt`` against SDPA's ``want``, time it and
        add its row."""
        e = _max_err(run_decode(p, q, kc, vc, bt, seqlens), want)
        if e > _TOL:
            notes.append(f"flashpage {variant} b={b} ctx={ctx} h={h}/{hk}: max err {e:.3g} vs SDPA")
        return row(
            "flashpage", lambda: run_decode(p, q, kc, vc, bt, seqlens), kv_bytes, dtype_name,
            variant=variant, num_splits=p.num_splits, config=_cfg_name(p.config), max_err=e, block_size=bs,
        )  # fmt: skip

    # flashpage, planner's choice.
    plan = plan_decode(b, h, hk, d, block_size=bs, max_seqlen_k=ctx, q_dtype=dt, device=device, num_splits=0)
    r_fp = timed_plan("planner", plan, k_cache, v_cache)
    r_fp["ms_graph"] = graph_ms(
        lambda: run_decode(plan, q, k_cache, v_cache, block_table, seqlens), device, time_ms
    )

    # One KV head per program (the tiling before several-head programs), and several heads over
    # the default 64-column tiles with the ">= 2 programs per SM" split rule (before wide tiles):
    # same table, same run.
    if plan.config.heads_per_program > 1:
        default_cfg = default_decode_config(dt, d)
        variants = {"one-head": replace(default_cfg, heads_per_program=1)}
        if plan.config.block_n != default_cfg.block_n:  # the planner took wide tiles
            variants["narrow-tiles"] = replace(default_cfg, wide_block_n=0)
        for name, cfg in variants.items():
            p1 = plan_decode(
                b, h, hk, d, block_size=bs, max_seqlen_k=ctx, q_dtype=dt, device=device, config=cfg
            )
            timed_plan(name, p1, k_cache, v_cache)

    # The same plan over the tables an engine's block manager builds (ascending runs); its own
    # SDPA reference, since the table maps other blocks.
    bm_table = block_manager_table(b, ctx, bs).to(device)
    bm_ref = _first_sdpa(q4, logical(k_cache, bm_table), logical(v_cache, bm_table), scale, gqa)[:, :, 0]
    timed_plan("block-manager", plan, k_cache, v_cache, bm_table, bm_ref)

    # The public flash-attn entry point on its unpaged layout (the planner's split count, the
    # contiguous-cache tiles; validate=False: no host sync inside the timed call).
    from flashpage.ops.kvcache import flash_attn_with_kvcache

    kv_nhd = [c.transpose(1, 2).contiguous() for c in (k_contig, v_contig)]

    def contiguous() -> Tensor:
        return flash_attn_with_kvcache(q.unsqueeze(1), *kv_nhd, cache_seqlens=seqlens, validate=False)

    e = _max_err(contiguous()[:, 0], ref)
    if e > _TOL:
        notes.append(f"flashpage contiguous b={b} ctx={ctx} h={h}/{hk}: max err {e:.3g} vs SDPA")
    r_c = row("flashpage", contiguous, kv_bytes, dtype_name, variant="contiguous", max_err=e)
    # The eager call's host time can exceed a short kernel's (b1/128k on an H200 machine read 0.20 ms
    # eagerly at 9d0cc5d, 0.147 ms in an earlier run): the graph replay gives the kernels' own time.
    r_c["ms_graph"] = graph_ms(contiguous, device, time_ms)

    if st.variants:
        best = None
        ns0 = plan.num_splits
        # Also 2 and 4 splits: with few programs per SM, the program count decides the last wave.
        cands = sorted({1, 2, 4, max(1, ns0 // 2), ns0, min(128, 2 * ns0)})
        for cfg in _variant_configs(False):
            for ns in cands:
                p = plan_decode(
                    b,
                    h,
                    hk,
                    d,
                    block_size=bs,
                    max_seqlen_k=ctx,
                    q_dtype=dt,
                    device=device,
                    num_splits=ns,
                    config=cfg,
                )
                o = run_decode(p, q, k_cache, v_cache, block_table, seqlens)
                e = _max_err(o, ref)
                if e > _TOL:
                    notes.append(
                        f"flashpage {_cfg_name(cfg)} ns={p.num_splits} b={b} ctx={ctx}: max err {e:.3g}"
                    )
                    continue
                t = sweep_ms(lambda p=p: run_decode(p, q, k_cache, v_cache, block_table, seqlens))
                if best is None or t < best[0]:
                    best = (t, p)
        if best is not None:
            timed_plan("best", best[1], k_cache, v_cache)

    # SDPA on the contiguous cache; gather-then-SDPA over the paged one.
    for name in ("sdpa-cudnn", "sdpa-flash"):
        fn = _sdpa(name)
        if fn is None or device.type != "cuda":
            continue
        try:
            o = fn(q4, k_contig, v_contig, scale=scale, **gqa)[:, :, 0]
        except RuntimeError as exc:
            notes.append(f"{name} b={b} ctx={ctx}: {type(exc).__name__}")
            status(name, "failed", failure_reason(exc))
            continue
        sdpa = lambda fn=fn, kc=k_contig, vc=v_contig: fn(q4, kc, vc, scale=scale, **gqa)
        row(name, sdpa, kv_bytes, dtype_name, max_err=_max_err(o, ref))
    flash = _sdpa("sdpa-flash") if device.type == "cuda" else _sdpa("sdpa-math")
    if flash is not None:

        def gathered() -> Tensor:
            kk = k_cache[table].reshape(b, ctx, hk, d).transpose(1, 2)
            vv = v_cache[table].reshape(b, ctx, hk, d).transpose(1, 2)
            return flash(q4, kk, vv, scale=scale, **gqa)

        try:
            o = gathered()[:, :, 0]
            row(
                "gather-sdpa",
                gathered,
                kv_bytes,
                dtype_name,
                max_err=_max_err(o, ref),
                block_size=bs,
            )
        except RuntimeError as exc:
            notes.append(f"gather-sdpa b={b} ctx={ctx}: {type(exc).__name__}")
            status("gather-sdpa", "failed", failure_reason(exc))
    _external_rows(
        q,
        k_contig,
        v_contig,
        k_cache,
        v_cache,
        block_table,
        seqlens,
        ref,
        scale,
        row,
        dtype_name,
        notes,
        bs,
        status,
    )

    if st.fp8 and hasattr(torch, "float8_e4m3fn"):
        # fp8 e4m3 KV, per-head scales from the data; checked against SDPA on the dequantised cache.
        f8 = torch.float8_e4m3fn
        ks, vs = fp8_kv_scales(k_cache), fp8_kv_scales(v_cache)
        kc8 = (k_cache / ks.view(1, 1, hk, 1).to(dt)).clamp(-448, 448).to(f8)
        vc8 = (v_cache / vs.view(1, 1, hk, 1).to(dt)).clamp(-448, 448).to(f8)
        kd = (
            (kc8[table].to(dt) * ks.view(1, 1, hk, 1).to(dt))
            .reshape(b, ctx, hk, d)
            .transpose(1, 2)
            .contiguous()
        )
        vd = (
            (vc8[table].to(dt) * vs.view(1, 1, hk, 1).to(dt))
            .reshape(b, ctx, hk, d)
            .transpose(1, 2)
            .contiguous()
        )
        ref8 = _first_sdpa(q4, kd, vd, scale, gqa)[:, :, 0]
        del kd, vd
        fp8_bytes = 2 * b * ctx * hk * d  # one byte per element

        def plan8(cfg: Any, num_splits: int = 0) -> Any:
            return plan_decode(
                b, h, hk, d, block_size=bs, max_seqlen_k=ctx, q_dtype=dt, kv_dtype=f8, device=device,
                num_splits=num_splits, config=cfg,
            )  # fmt: skip

        def run8(p: Any) -> Tensor:
            return run_decode(p, q, kc8, vc8, block_table, seqlens, k_scale=ks, v_scale=vs)

        def checked8(p: Any) -> float | None:
            """``p``'s max error against SDPA on the dequantised cache, or None (noted) when too large."""
            e = _max_err(run8(p), ref8)
            if e > _TOL:
                notes.append(
                    f"flashpage fp8 {_cfg_name(p.config)} ns={p.num_splits} b={b} ctx={ctx}: max err {e:.3g}"
                )
                return None
            return e

        def row8(variant: str, p: Any, e: float) -> dict[str, Any]:
            return row(
                "flashpage", lambda: run8(p), fp8_bytes, "fp8_e4m3", variant=variant, num_splits=p.num_splits,
                config=_cfg_name(p.config), max_err=e, block_size=bs,
            )  # fmt: skip

        p0 = plan8(None)  # the planner's default plan, as the engine runs it
        e0 = checked8(p0)
        if e0 is not None:
            row8("planner", p0, e0)["ms_graph"] = graph_ms(lambda: run8(p0), device, time_ms)
        best8 = None
        for cfg in _variant_configs(True) if st.variants else []:
            first = plan8(cfg)  # the sweep also tries twice the planner's splits
            for p in (first, plan8(cfg, min(128, 2 * first.num_splits))):
                e = checked8(p)
                if e is None:
                    continue
                t = sweep_ms(lambda p=p: run8(p))
                if best8 is None or t < best8[0]:
                    best8 = (t, p, e)
        if best8 is not None:
            _, p, e = best8
            row8("best", p, e)

    def failed(item: tuple[dict[str, Any], Callable[[], Any], int], exc: Exception) -> None:
        r = item[0]
        notes.append(f"{r['impl']} {r.get('variant', '')} b={b} ctx={ctx}: {type(exc).__name__}: {exc}"[:200])
        status_rows.append({**r, "status": "failed", "reason": failure_reason(exc)})

    timings = round_robin(pending, lambda item: time_ms(item[1]), st.rounds, failed)
    for (r, _fn, nbytes), ms_rounds in zip(pending, timings, strict=True):
        if ms_rounds is None:
            continue
        ms = min(ms_rounds)  # every implementation gets the same rule: its fastest round
        tbps = nbytes / (ms * 1e-3) / 1e12
        flops = 4.0 * b * h * ctx * d  # q.k and p.v for one query token per head
        r.update(ms=ms, ms_rounds=ms_rounds, tbps=tbps, tflops=flops / (ms * 1e-3) / 1e12)
        r["frac_of_roofline"] = roofline_fraction(flops, nbytes, ms * 1e-3, profile)
        r["tokens_per_s"] = b * ctx / (ms * 1e-3)  # sequences x context tokens attended per second
        rows.append(r)
    # fp8 rows against the faster bf16 flashpage row of the shape (the planner's, or the sweep's best).
    bf16 = [r["ms"] for r in rows if r["impl"] == "flashpage" and r["dtype"] == dtype_name
            and r.get("variant") in ("planner", "best")]  # fmt: skip
    # The same for the graph replays of the planner rows: the kernels' ratio where a slow host
    # bounds the eager calls.
    bf16_graph = [r["ms_graph"] for r in rows if r["impl"] == "flashpage" and r["dtype"] == dtype_name
                  and r.get("variant") == "planner" and r.get("ms_graph")]  # fmt: skip
    for r in rows:
        if r["dtype"] == "fp8_e4m3" and bf16:
            r["ratio_vs_bf16"] = min(bf16) / r["ms"]
        if r["dtype"] == "fp8_e4m3" and bf16_graph and r.get("ms_graph"):
            r["ratio_vs_bf16_graph"] = bf16_graph[0] / r["ms_graph"]
    return rows + status_rows, notes


def _external_rows(
    q: Tensor,
    k_contig: Tensor,
    v_contig: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_table: Tensor,
    seqlens: Tensor,
    ref: Tensor,
    scale: float,
    row: Callable[..., dict[str, Any]],
    dtype_name: str,
    notes: list[str],
    block_size: int,
    status: Callable[[str, str, str], None],
) -> None:
    """flash-attn (contiguous cache) and FlashInfer (paged) decode rows (``row`` registers the call to
    time) when those packages are installed; on CUDA, ``status(impl, "missing" | "failed", reason)``
    otherwise."""
    b, hk, _, d = k_contig.shape
    kv_bytes = 2 * k_contig.numel() * k_contig.element_size()
    try:
        from flash_attn import flash_attn_with_kvcache as fa_kvcache  # type: ignore[import-not-found]
    except ImportError as exc:
        fa_kvcache = None
        if q.is_cuda:
            status("flash-attn", "missing", f"flash_attn is not importable ({exc})")
    if fa_kvcache is not None and q.is_cuda:
        kc, vc = k_contig.transpose(1, 2), v_contig.transpose(1, 2)  # (b, ctx, hk, d) view
        fn = lambda: fa_kvcache(q.unsqueeze(1), kc, vc, cache_seqlens=seqlens, softmax_scale=scale)
        try:
            o = fn()[:, 0]
            row("flash-attn", fn, kv_bytes, dtype_name, max_err=_max_err(o, ref))
        except Exception as exc:  # a third-party kernel: record, do not abort the run
            notes.append(f"flash-attn: {type(exc).__name__}: {exc}"[:200])
            status("flash-attn", "failed", failure_reason(exc))
    try:
        import flashinfer  # type: ignore[import-not-found]
    except ImportError as exc:
        if q.is_cuda:
            status("flashinfer", "missing", f"flashinfer is not importable ({exc})")
        return
    if not q.is_cuda:
        return
    try:
        pages = block_table.shape[1]
        workspace = torch.empty(256 << 20, dtype=torch.uint8, device=q.device)
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
        indptr = torch.arange(b + 1, dtype=torch.int32, device=q.device) * pages
        last = torch.full((b,), block_size, dtype=torch.int32, device=q.device)
        wrapper.plan(
            indptr,
            block_table.flatten(),
            last,
            q.shape[1],
            hk,
            d,
            block_size,
            data_type=q.dtype,
            sm_scale=scale,
        )
        fn = lambda: wrapper.run(q, (k_cache, v_cache))
        o = fn()
        row("flashinfer", fn, kv_bytes, dtype_name, max_err=_max_err(o, ref), block_size=block_size)
    except Exception as exc:  # API differences between FlashInfer versions: record, do not abort
        notes.append(f"flashinfer: {type(exc).__name__}: {exc}"[:200])
        status("flashinfer", "failed", failure_reason(exc))


def bench_prefill_shape(
    shape: PrefillShape,
    st: BenchSettings,
    device: torch.device,
    time_ms: Callable[[Callable[[], Any]], float],
    profile: HardwareProfile,
) -> tuple[list[dict[str, Any]], list[str]]:
    """Chunked prefill over a paged prefix vs the flash forward kernel (contiguous KV), same shape."""
    from flashpage.ops.paged_decode import PagedAttnConfig
    from flashpage.ops.paged_prefill import default_prefill_config, paged_prefill

    b, pre, new, h, hk, d, bs = (
        shape.batch,
        shape.prefix,
        shape.new,
        shape.nheads,
        shape.nheads_k,
        shape.head_dim,
        st.block_size,
    )
    ctx = pre + new
    dt = st.dtype
    nblk = b * triton_cdiv(ctx, bs)
    k_cache = torch.randn(nblk + 1, bs, hk, d, device=device, dtype=dt)
    v_cache = torch.randn_like(k_cache)
    block_table = torch.randperm(nblk, device=device).view(b, -1).to(torch.int32)
    seqlens = torch.full((b,), ctx, dtype=torch.int32, device=device)
    cu_q = (torch.arange(b + 1, device=device) * new).to(torch.int32)
    cu_k = (torch.arange(b + 1, device=device) * ctx).to(torch.int32)
    q = torch.randn(b * new, h, d, device=device, dtype=dt)
    table = block_table.long()
    k_flat = k_cache[table].reshape(b, -1, hk, d)[:, :ctx].reshape(b * ctx, hk, d).contiguous()
    v_flat = v_cache[table].reshape(b, -1, hk, d)[:, :ctx].reshape(b * ctx, hk, d).contiguous()
    scale = d**-0.5
    visible = b * (new * pre + new * (new + 1) // 2)  # (query, key) pairs under bottom-right causal
    flops = 4 * h * d * visible
    base = {
        "bench": "prefill",
        "batch": b,
        "ctx": ctx,
        "seqlen": new,
        "nheads": h,
        "nheads_k": hk,
        "d": d,
        "causal": True,
        "dtype": str(dt).replace("torch.", ""),
    }
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    pending: list[tuple[dict[str, Any], Callable[[], Any]]] = []  # timed round robin at the end

    elt = q.element_size()
    # Least bytes: q read and o written, every sequence's K and V (prefix + new) read once.
    nbytes = 2 * b * new * h * d * elt + 2 * b * ctx * hk * d * elt

    def row(impl: str, variant: str, fn: Callable[[], Any], err: float | None, **extra: Any) -> None:
        """One prefill row, timing ``fn`` (``frac_of_roofline``: compute-bound, TFLOP/s over the peak)."""
        pending.append(({**base, "impl": impl, "variant": variant, "max_err": err, **extra}, fn))

    # Reference: SDPA with an explicit bottom-right causal mask (query i sees keys <= prefix + i) on
    # K/V expanded to every query head (no backend-specific GQA or causal-variant support needed).
    qs = q.view(b, new, h, d).transpose(1, 2)
    k_rep = k_flat.view(b, ctx, hk, d).transpose(1, 2).repeat_interleave(h // hk, dim=1)
    v_rep = v_flat.view(b, ctx, hk, d).transpose(1, 2).repeat_interleave(h // hk, dim=1)
    visible_mask = torch.ones(new, ctx, dtype=torch.bool, device=device).tril(diagonal=pre)
    ref = F.scaled_dot_product_attention(qs, k_rep, v_rep, attn_mask=visible_mask, scale=scale)
    ref = ref.transpose(1, 2).reshape(b * new, h, d)

    def paged(cfg: Any = None) -> Tensor:
        return paged_prefill(
            q,
            k_cache,
            v_cache,
            cu_q,
            seqlens,
            block_table,
            new,
            softmax_scale=scale,
            causal=True,
            max_seqlen_k=ctx,
            config=cfg,
            validate=False,
        )  # type: ignore[return-value]

    out = paged()
    err = _max_err(out, ref)
    if err > _TOL:
        notes.append(f"paged prefill: max err {err:.3g}")
    row(
        "flashpage",
        "paged-prefill",
        paged,
        err,
        block_size=bs,
        config=_cfg_name(default_prefill_config(d, device, k_cache.dtype, bs)),
    )
    if st.variants:
        best: tuple[float, Any, float, str] | None = None
        paged_ms = time_ms(paged)
        if d <= 128:
            combos = ((128, 64, 8, 3, False), (128, 128, 8, 2, False), (128, 128, 8, 3, False),
                      (64, 64, 4, 3, False), (64, 128, 4, 2, False), (128, 128, 8, 3, True),
                      (128, 64, 8, 3, True), (128, 64, 8, 4, True), (64, 64, 4, 3, True),
                      (64, 128, 4, 3, True))  # fmt: skip
        else:
            combos = ((64, 64, 8, 2, False), (128, 32, 8, 2, False), (64, 32, 4, 2, False),
                      (128, 32, 8, 3, True), (64, 32, 4, 3, True), (128, 64, 8, 2, False),
                      (128, 64, 8, 4, False), (128, 32, 8, 7, False))  # fmt: skip
        for bm, bn, w, s, pt in combos:
            cfg = PagedAttnConfig(block_m=bm, block_n=bn, num_warps=w, num_stages=s, prefetch_table=pt)
            try:
                o = paged(cfg)
            except Exception as exc:  # out of shared memory on this GPU, etc.
                notes.append(f"paged prefill bm{bm}-{_cfg_name(cfg)}: {type(exc).__name__}")
                continue
            e = _max_err(o, ref)
            if e <= _TOL:
                t = time_ms(lambda cfg=cfg: paged(cfg))
                if t < (best[0] if best is not None else paged_ms):
                    best = (t, cfg, e, f"bm{bm}-{_cfg_name(cfg)}")
        if best is not None:
            _, cfg, e, label = best
            row("flashpage", "paged-prefill-best", lambda cfg=cfg: paged(cfg), e, block_size=bs, config=label)
    big = 128
    if ctx % big == 0 and bs < big:
        # The same K/V in 128-token pages (random page order): a KV tile then lies inside one page,
        # which TMA descriptors can load (use_tma) -- the cost of the 16-token gather, measured.
        pages = ctx // big
        perm = torch.randperm(b * pages, device=device)
        kc2 = torch.empty(b * pages + 1, big, hk, d, device=device, dtype=dt)
        vc2 = torch.empty_like(kc2)
        kc2[perm] = k_flat.view(b * pages, big, hk, d)
        vc2[perm] = v_flat.view(b * pages, big, hk, d)
        bt2 = perm.view(b, pages).to(torch.int32)
        combos = (
            [(128, 128, 8, 2, False), (128, 64, 8, 3, True), (128, 128, 8, 3, True)] if st.variants else []
        )
        # Both load paths for tiles inside one page (which is faster depends on the triton release).
        big_cfgs = [default_prefill_config(d, device, dt, big)]
        for tma in (False, True):
            cfg = default_prefill_config(d, device, dt, big, tma=tma)
            if cfg not in big_cfgs:
                big_cfgs.append(cfg)
        big_cfgs += [PagedAttnConfig(block_m=bm, block_n=bn, num_warps=w, num_stages=s_, use_tma=t)
                     for bm, bn, w, s_, t in combos]  # fmt: skip
        for cfg in big_cfgs:
            bm = cfg.block_m
            fn = lambda cfg=cfg: paged_prefill(
                q, kc2, vc2, cu_q, seqlens, bt2, new, softmax_scale=scale, causal=True,
                max_seqlen_k=ctx, config=cfg, validate=False,
            )  # fmt: skip
            try:
                o = fn()
            except Exception as exc:  # out of shared memory on this GPU, etc.
                notes.append(f"paged prefill bs{big} bm{bm}-{_cfg_name(cfg)}: {type(exc).__name__}")
                continue
            e = _max_err(o, ref)
            if e > _TOL:
                notes.append(f"paged prefill bs{big} bm{bm}-{_cfg_name(cfg)}: max err {e:.3g}")
                continue
            label = f"bm{bm}-{_cfg_name(cfg)}"
            row("flashpage", f"paged-prefill-bs{big}", fn, e, block_size=big, config=label)
    try:
        from flashpage.ops.flash_attn import flash_attn_varlen_fwd
    except ImportError:
        flash_attn_varlen_fwd = None
        notes.append(
            "flashpage.ops.flash_attn.flash_attn_varlen_fwd not available: no flash-kernel prefill row"
        )
    if flash_attn_varlen_fwd is not None:
        fwd = lambda: flash_attn_varlen_fwd(
            q, k_flat, v_flat, cu_q, cu_k, new, ctx, scale, True, (-1, -1), 0.0, None
        )
        try:
            o = fwd()[0]
        except Exception as exc:  # another module's kernel: record, keep the run going
            notes.append(f"flash varlen fwd failed: {type(exc).__name__}: {exc}"[:200])
        else:
            e = _max_err(o, ref)
            if e > _TOL:
                notes.append(f"flash varlen fwd: max err {e:.3g}")
            row("flashpage", "flash-varlen", fwd, e)
    if device.type == "cuda":
        # SDPA's own lower-right causal variant (the memory-efficient kernel; flash/cuDNN take only
        # top-left causal masks), on the head-expanded K/V.
        from torch.nn.attention.bias import causal_lower_right

        bias = causal_lower_right(new, ctx)
        sdpa = lambda: F.scaled_dot_product_attention(qs, k_rep, v_rep, attn_mask=bias, scale=scale)
        try:
            o = sdpa().transpose(1, 2).reshape(b * new, h, d)
            row("sdpa-efficient", "lower-right causal", sdpa, _max_err(o, ref))
        except (RuntimeError, TypeError, ValueError) as exc:
            notes.append(f"prefill sdpa lower-right causal: {type(exc).__name__}")
            rows.append({**base, "impl": "sdpa-efficient", "variant": "lower-right causal", "status": "failed",
                         "reason": failure_reason(exc)})  # fmt: skip
        # flash-attn's varlen forward on the same contiguous K/V (its causal mask is bottom-right).
        try:
            from flash_attn import flash_attn_varlen_func as fa_varlen  # type: ignore[import-not-found]
        except ImportError as exc:
            rows.append({**base, "impl": "flash-attn", "variant": "varlen", "status": "missing",
                         "reason": f"flash_attn is not importable ({exc})"})  # fmt: skip
        else:
            fa = lambda: fa_varlen(q, k_flat, v_flat, cu_q, cu_k, new, ctx, softmax_scale=scale, causal=True)
            try:
                row("flash-attn", "varlen", fa, _max_err(fa(), ref))
            except Exception as exc:  # a third-party kernel: record, keep the run going
                rows.append({**base, "impl": "flash-attn", "variant": "varlen", "status": "failed",
                             "reason": failure_reason(exc)})  # fmt: skip

    def failed(item: tuple[dict[str, Any], Callable[[], Any]], exc: Exception) -> None:
        notes.append(f"prefill {item[0]['impl']} {item[0]['variant']}: {type(exc).__name__}: {exc}"[:200])
        rows.append({**item[0], "status": "failed", "reason": failure_reason(exc)})

    timings = round_robin(pending, lambda item: time_ms(item[1]), st.rounds, failed)
    for (r, _fn), ms_rounds in zip(pending, timings, strict=True):
        if ms_rounds is not None:
            ms = min(ms_rounds)  # the fastest round, for every implementation alike
            r.update(ms=ms, ms_rounds=ms_rounds, tflops=flops / (ms * 1e-3) / 1e12)
            r["frac_of_roofline"] = roofline_fraction(flops, nbytes, ms * 1e-3, profile)
            rows.append(r)
    flash_ms = [r["ms"] for r in rows if r["variant"] == "flash-varlen" and not r.get("status")]
    for r in rows:
        if r["variant"].startswith("paged-prefill") and flash_ms and not r.get("status"):
            r["ratio_vs_flash"] = flash_ms[0] / r["ms"]
    return rows, notes


def triton_cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints."""
    return -(-a // b)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns 0 when every implementation matched SDPA, 1 otherwise."""
    parser = argparse.ArgumentParser(prog="flashpage bench decode", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="fewer shapes and repetitions, one round, no sweep (about 1 min)"
    )
    parser.add_argument(
        "--variants", action="store_true", help="also sweep split counts, BLOCK_N, warps, stages"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="round-robin timing rounds per shape (default 2, --smoke 1): every row's call is timed once "
        "per round in turn, and keeps its fastest round",
    )
    parser.add_argument(
        "--smoke", action="store_true", help="tiny shapes on any device (CPU: Triton interpreter)"
    )
    parser.add_argument(
        "--profile",
        default=None,
        help="hardware profile JSON frac_of_roofline is of (flashpage bench all passes the one probe "
        "measured); default: this device probed now",
    )
    parser.add_argument(
        "--out",
        "--out-dir",
        dest="out_dir",
        type=Path,
        default=None,
        help="where the JSON files go (default benchmarks/results): decode-<gpu>.json, prefill-<gpu>.json",
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        if not args.smoke:
            print(
                "flashpage bench decode needs a CUDA GPU (use --smoke to check the script on CPU)",
                file=sys.stderr,
            )
            return 2
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before flashpage.ops imports triton
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    st = _settings(args)
    time_ms = make_timer(device, st.warmup_ms, st.rep_ms)
    sweep_ms = make_timer(device, max(1, st.warmup_ms // 2), max(1, st.rep_ms // 3))
    torch.manual_seed(0)
    t_start = time.perf_counter()
    profile = run_profile(args.profile, quick=args.quick or args.smoke)
    print(
        f"roofline {profile.name}: copy bandwidth {profile.hbm_bandwidth / 1e12:.2f} TB/s (read + write)",
        flush=True,
    )
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    for shape in st.decode:
        r, n = bench_decode_shape(shape, st, device, profile, time_ms, sweep_ms)
        rows += r
        notes += n
        for x in r:
            fig = (
                f"{x['status']}: {x['reason']}"
                if x.get("status")
                else f"{x['ms']:.4f} ms {x['tbps']:.2f} TB/s"
            )
            print(
                f"  decode b={x['batch']:4d} ctx={x['ctx']:6d} h={x['nheads']}/{x['nheads_k']} {x['impl']:12s} {x.get('variant', ''):8s} {x['dtype']:9s} {fig}",
                flush=True,
            )
        if device.type == "cuda":
            torch.cuda.empty_cache()
    for pshape in st.prefill:
        r, n = bench_prefill_shape(pshape, st, device, time_ms, profile)
        rows += r
        notes += n
        for x in r:
            fig = (
                f"{x['status']}: {x['reason']}"
                if x.get("status")
                else f"{x['ms']:.3f} ms {x['tflops']:.1f} TFLOP/s"
            )
            print(f"  prefill {x['impl']:12s} {x['variant']:18s} {fig}", flush=True)
    env = env_info(None, None, profile=profile)
    env["copy_tbps"] = profile.hbm_bandwidth / 1e12
    env["wall_s"] = round(time.perf_counter() - t_start, 1)
    note = (
        "Decode: one new token per sequence, paged KV at block size 16 (random block order) for flashpage, "
        "gather-sdpa and flashinfer, except flashpage's block-manager rows (the tables a fresh BlockManager "
        "hands out: prompts of ctx/4 allocated together, then lockstep decode); contiguous KV for "
        "sdpa-*/flash-attn. tbps = KV bytes read / time; frac_of_roofline = tbps / the probed copy "
        "bandwidth. Prefill: chunked prefill (new tokens after a cached prefix), TFLOP/s over the visible "
        "(bottom-right causal) pairs, frac_of_roofline of the probed bf16 matmul peak."
    )
    out_dir = args.out_dir
    if args.smoke and out_dir is None:  # a script check, not a result: keep it out of benchmarks/
        out_dir = Path(tempfile.mkdtemp(prefix="flashpage-bench-"))
    # One file per benchmark: decode rows, and the chunked-prefill rows apart.
    paths = [
        write_results(bench, [r for r in rows if r["bench"] == bench], env, table_columns=TABLE_COLUMNS,
                      out_dir=out_dir, note=note)
        for bench in ("decode", "prefill")
    ]  # fmt: skip
    print(markdown_table([r for r in rows if not r.get("status")], TABLE_COLUMNS))
    for n in notes:
        print("note:", n)
    print(f"wrote {', '.join(map(str, paths))} in {env['wall_s']} s")
    bad = [n for n in notes if "max err" in n]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
