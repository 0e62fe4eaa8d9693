"""``flashpage bench attention``: FlashAttention forward / backward against the baselines, in one run.

flash-attn's benchmark convention: 16k tokens in total (``batch = 16384 // seqlen``), model dim 2048
(``nheads = nheads_k = 2048 // d``), bf16, seqlen 1k / 4k / 16k, head dims 64 / 128 / 256, causal and
not. Implementations measured in the same process:

* ``flashpage``: ``flashpage.ops.flash_attn.flash_attn_func`` (Triton backend, checked-in tile table);
* ``sdpa-flash`` / ``sdpa-cudnn`` / ``sdpa-efficient``: ``F.scaled_dot_product_attention`` under
  ``torch.nn.attention.sdpa_kernel`` on contiguous ``(batch, nheads, seqlen, d)`` tensors;
* ``flex``: FlexAttention under ``torch.compile`` (head dim 128 only unless ``--flex-all``; one
  compile per shape, skipped when the time budget runs out);
* ``flash-attn``: ``flash_attn.flash_attn_func`` when importable;
* ``triton-tutorial``: the Triton tutorial's FA2 forward (:mod:`flashpage.bench.tutorial_attn`, TMA,
  on contiguous ``(batch, nheads, seqlen, d)``; forward rows only, d=128 only unless
  ``--tutorial-all``; the faster of its two configs, named in ``config``).

FLOPs: forward ``4 * batch * nheads * seqlen^2 * d`` (halved when causal), backward 2.5x the forward.
Backward time = ``torch.autograd.grad`` of a retained graph (the backward kernels only). Per shape,
every implementation is checked first, then timed in ``--rounds`` round-robin rounds (default 2: all
implementations once, then all again), so the GPU's clock drift under its power cap and temperature
reaches each alike; a row's ``ms`` is its fastest round, ``ms_rounds`` lists every round.
``frac_of_roofline`` (:func:`flashpage.bench.common.roofline_fraction`): of the roofline of the
profile ``--profile`` names (``flashpage bench all`` passes the one ``probe`` measured in the same
run; default: this device probed now), with bytes = q, k, v read and o written forward, q, k, v, o,
dO read and dq, dk, dv written backward (attention is compute-bound here: TFLOP/s over the bf16 peak);
``ratio_vs_sdpa_flash`` = TFLOP/s over SDPA-flash's on the same row. Every implementation's output and
gradients are compared with SDPA-flash's before timing (``max_err``; a failing flashpage check makes
the exit status 1).

``--variants`` also times every tile configuration of ``flashpage.ops.flash_configs.fwd_candidates``
/ ``bwd_candidates`` (TMA on / off, dQ atomic / separate) directly through ``flash_fwd`` /
``flash_bwd`` at every shape of the sweep and prints the best per (head dim, causal, seqlen bucket; the
longest length stands for all longer ones) as the ``HOPPER_FWD`` / ``HOPPER_BWD`` dicts to paste into
flash_configs.py.

GPU: ``PYTHONUNBUFFERED=1 PYTHONPATH=src python3 -m flashpage.bench.attention [--quick] [--variants]``
(``--quick``: d=128, seqlen 4k, one round). ``--smoke`` runs tiny shapes on any device (CPU: the Triton
interpreter) to check the script itself. Writes ``benchmarks/results/attention-<gpu>.json``
(``flashpage bench report`` renders the tables).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
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
    roofline_fraction,
    round_robin,
    run_profile,
    status_row,
    write_results,
)

TABLE_COLUMNS = [
    "impl",
    "d",
    "seqlen",
    "batch",
    "nheads",
    "causal",
    "pass",
    "ms",
    "kernel_ms",
    "host_ms",
    "tflops",
    "frac_of_roofline",
    "ratio_vs_sdpa_flash",
    "max_err",
]
SDPA_IMPLS = ("sdpa-flash", "sdpa-cudnn", "sdpa-efficient")


@dataclass(frozen=True)
class Shape:
    """One benchmark problem (self-attention, ``nheads_k == nheads``)."""

    batch: int
    seqlen: int
    nheads: int
    d: int
    causal: bool

    @property
    def fwd_flops(self) -> float:
        return 4.0 * self.batch * self.nheads * self.seqlen**2 * self.d / (2 if self.causal else 1)


@dataclass(frozen=True)
class Settings:
    shapes: list[Shape]
    warmup_ms: int
    rep_ms: int
    flex_dims: tuple[int, ...]
    budget_s: float
    smoke: bool
    tutorial_dims: tuple[int, ...] = ()
    rounds: int = 2


def _settings(args: argparse.Namespace) -> Settings:
    if args.smoke:
        dims, seqs, total, model = (32,), (32, 64), 128, 64
    else:
        dims = (128,) if args.quick else (64, 128, 256)
        seqs = (4096,) if args.quick else (1024, 4096, 16384)
        total, model = 16384, 2048
    if args.head_dims:
        dims = tuple(int(x) for x in args.head_dims.split(","))
    if args.seqlens:
        seqs = tuple(int(x) for x in args.seqlens.split(","))
    shapes = [
        Shape(max(1, total // s), s, model // d, d, causal)
        for d in dims
        for causal in (False, True)
        for s in seqs
    ]
    flex_dims = () if args.no_flex else (dims if args.flex_all else tuple(d for d in dims if d == 128))
    budget = args.budget_s if args.budget_s else (120.0 if args.quick else 540.0)
    # 100 ms of warm-up per timing: a row timed right after a compile (GPU idle, clocks down) came out
    # 20-40% slow at 1k tokens with 25 ms (H200, 2026-12-03: kernel_ms, timed later, did not).
    tutorial_dims = dims if args.tutorial_all or args.smoke else tuple(d for d in dims if d == 128)
    rounds = max(1, args.rounds if args.rounds is not None else (1 if args.smoke or args.quick else 2))
    return Settings(shapes, 100, 100, flex_dims, budget, args.smoke, tutorial_dims, rounds)


def attention_bytes(shape: Shape, pas: str, elt: int) -> float:
    """HBM bytes a fused attention pass must move at least: forward q, k, v read and o written (4
    tensors), backward q, k, v, o, dO read and dq, dk, dv written (8); ``elt`` bytes per element."""
    n = shape.batch * shape.seqlen * shape.nheads * shape.d * elt
    return (4 if pas == "fwd" else 8) * n


# ------------------------------------------------------------------------------------------------
# Implementations: each gives a forward closure returning the output in (batch, seqlen, nheads, d)
# ------------------------------------------------------------------------------------------------
@dataclass
class Impl:
    name: str
    fwd: Callable[[], Tensor]
    inputs: tuple[Tensor, Tensor, Tensor]
    ctx: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext
    note: str = ""
    bhsd_inputs: bool = False  # gradients come back (batch, nheads, seqlen, d)
    backward: bool = True  # False: forward rows only (no autograd)


def _sdpa_impls(qt: Tensor, kt: Tensor, vt: Tensor, causal: bool, device: torch.device) -> list[Impl]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = (
        {"sdpa-flash": SDPBackend.FLASH_ATTENTION, "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION,
         "sdpa-efficient": SDPBackend.EFFICIENT_ATTENTION}
        if device.type == "cuda"
        else {"sdpa-flash": SDPBackend.MATH}
    )  # fmt: skip
    out = []
    for name, be in backends.items():
        fwd = lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal).transpose(1, 2)
        out.append(Impl(name, fwd, (qt, kt, vt), ctx=lambda be=be: sdpa_kernel(be), bhsd_inputs=True))
    return out


class _Flex:
    """FlexAttention compiled once per process (recompiles per shape happen on first use)."""

    def __init__(self) -> None:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        self.fn = torch.compile(flex_attention, dynamic=False)
        self.create_block_mask = create_block_mask

    def impl(self, qt: Tensor, kt: Tensor, vt: Tensor, causal: bool) -> Impl:
        s = qt.shape[2]
        mask = None
        if causal:
            mask = self.create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, s, s, device=qt.device)
        fwd = lambda: self.fn(qt, kt, vt, block_mask=mask).transpose(1, 2)
        return Impl("flex", fwd, (qt, kt, vt), bhsd_inputs=True)


def _tutorial_impls(qt: Tensor, kt: Tensor, vt: Tensor, causal: bool, smoke: bool) -> list[Impl]:
    from flashpage.bench.tutorial_attn import TUTORIAL_CONFIGS, tutorial_attention

    q, k, v = (t.detach() for t in (qt, kt, vt))
    cfgs = [(16, 16, 4, 1)] if smoke else TUTORIAL_CONFIGS.get(qt.shape[-1], [])
    return [
        Impl("triton-tutorial", lambda c=c: tutorial_attention(q, k, v, causal, c).transpose(1, 2), (q, k, v),
             note="m{}n{}w{}s{}".format(*c), backward=False)
        for c in cfgs
    ]  # fmt: skip


def _flash_attn_impl(q: Tensor, k: Tensor, v: Tensor, causal: bool) -> Impl | None:
    try:
        from flash_attn import flash_attn_func as fa_func  # type: ignore[import-not-found]
    except ImportError:
        return None
    return Impl("flash-attn", lambda: fa_func(q, k, v, causal=causal), (q, k, v))


# ------------------------------------------------------------------------------------------------
# Measurement
# ------------------------------------------------------------------------------------------------
def _max_err(a: Tensor, b: Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def _rel(a: Tensor, b: Tensor) -> float:
    """max |a - b| / max(|b|, 1e-6): scale-free error for gradients of very different magnitudes."""
    return _max_err(a, b) / max(float(b.float().abs().max()), 1e-6)


def _grads(out: Tensor, inputs: tuple[Tensor, ...], do: Tensor) -> tuple[Tensor, ...]:
    return torch.autograd.grad(out, inputs, do, retain_graph=True)


def _impl_grads(impl: Impl, out: Tensor, do: Tensor) -> tuple[Tensor, ...]:
    """Gradients w.r.t. the impl's inputs, in (batch, seqlen, nheads, d)."""
    gs = _grads(out, impl.inputs, do)
    return tuple(g.transpose(1, 2) for g in gs) if impl.bhsd_inputs else gs


def check_impl(impl: Impl, ref: tuple[Tensor, ...], do: Tensor) -> tuple[float, float]:
    """``impl``'s relative errors against the reference ``(out, dq, dk, dv)`` (bshd): (output,
    worst gradient; 0 without a backward)."""
    with impl.ctx():
        out = impl.fwd()
        err_o = _rel(out, ref[0])
        err_g = 0.0
        if impl.backward:
            grads = _impl_grads(impl, out, do)
            err_g = max(_rel(g, r) for g, r in zip(grads, ref[1:]))
    return err_o, err_g


def time_impl(impl: Impl, do: Tensor, time_ms: Callable[[Callable[[], Any]], float]) -> dict[str, float]:
    """Milliseconds of ``impl``'s forward and (unless ``impl.backward`` is False) backward."""
    with impl.ctx():
        times = {"fwd": time_ms(impl.fwd)}
        if impl.backward:
            out = impl.fwd()
            times["bwd"] = time_ms(lambda: _grads(out, impl.inputs, do))
    return times


def impl_key(impl: Impl) -> str:
    """An implementation's identity within a shape (the tutorial baseline runs several configs)."""
    return f"{impl.name}:{impl.note}"


def time_round_robin(
    impls: list[Impl],
    do: Tensor,
    time_ms: Callable[[Callable[[], Any]], float],
    rounds: int,
    on_error: Callable[[Impl, Exception], None],
) -> dict[str, list[dict[str, float]]]:
    """Time ``impls`` in ``rounds`` rounds, each round every implementation once in list order
    (:func:`time_impl`); returns each one's per-round times by :func:`impl_key`. An implementation
    that raises is reported to ``on_error`` and left out of the result and of later rounds."""
    results = round_robin(impls, lambda impl: time_impl(impl, do, time_ms), rounds, on_error)
    return {impl_key(impl): got for impl, got in zip(impls, results, strict=True) if got is not None}


def impl_rows(
    impl: Impl, shape: Shape, errs: tuple[float, float], rounds: list[dict[str, float]]
) -> tuple[list[dict[str, Any]], bool]:
    """Rows of ``impl`` from its check errors and its timing rounds: ``ms`` is the fastest round
    (every implementation gets the same rule), ``ms_rounds`` all of them in order."""
    err_o, err_g = errs
    ok = err_o <= 2e-2 and err_g <= 5e-2
    rows: list[dict[str, Any]] = []
    for pas, flops, err in (("fwd", shape.fwd_flops, err_o), ("bwd", 2.5 * shape.fwd_flops, err_g)):
        if pas not in rounds[0]:
            continue
        ms_rounds = [r[pas] for r in rounds]
        ms = min(ms_rounds)
        rows.append(
            {
                "bench": "attention", "impl": impl.name, "dtype": "bfloat16", "batch": shape.batch,
                "seqlen": shape.seqlen, "nheads": shape.nheads, "nheads_k": shape.nheads, "d": shape.d,
                "causal": shape.causal, "pass": pas, "ms": ms, "ms_rounds": ms_rounds,
                "tflops": flops / ms / 1e9, "max_err": err, "check_ok": ok,
            }
        )  # fmt: skip
        if impl.note:
            rows[-1]["config"] = impl.note
    return rows, ok


def make_inputs(shape: Shape, device: torch.device, dtype: torch.dtype) -> dict[str, Tensor]:
    """bshd q/k/v (flashpage, flash-attn), contiguous bhsd copies (SDPA, flex) and dO."""
    b, s, h, d = shape.batch, shape.seqlen, shape.nheads, shape.d
    q, k, v = (torch.randn(b, s, h, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    qt, kt, vt = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
    return {"q": q, "k": k, "v": v, "qt": qt, "kt": kt, "vt": vt, "do": torch.randn_like(q)}


def bench_shape(
    shape: Shape,
    st: Settings,
    device: torch.device,
    time_ms: Callable[[Callable[[], Any]], float],
    flex: _Flex | str | None,
    deadline: float,
) -> tuple[list[dict[str, Any]], bool, list[str]]:
    from flashpage.ops.flash_attn import flash_attn_func
    from flashpage.ops.flash_configs import autotune_enabled, bwd_config, fwd_config

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    t = make_inputs(shape, device, dtype)
    q, k, v, do = t["q"], t["k"], t["v"], t["do"]
    notes: list[str] = []
    sdpa = _sdpa_impls(t["qt"], t["kt"], t["vt"], shape.causal, device)
    with sdpa[0].ctx():  # reference: SDPA flash (math on CPU)
        out = sdpa[0].fwd()
        ref = (out.detach(), *_impl_grads(sdpa[0], out, do))
    cfg = fwd_config(shape.d, dtype, shape.causal, device, shape.seqlen)
    bcfg = bwd_config(shape.d, dtype, shape.causal, device, shape.seqlen)
    impls = [
        Impl(
            "flashpage",
            lambda: flash_attn_func(q, k, v, causal=shape.causal),
            (q, k, v),
            note="autotuned" if autotune_enabled() else f"{cfg.short()} | {bcfg.short()}",
        )
    ]  # type: ignore[arg-type]
    impls += sdpa
    shape_fields = {"dtype": "bfloat16" if dtype == torch.bfloat16 else str(dtype).removeprefix("torch."),
                    "batch": shape.batch, "seqlen": shape.seqlen, "nheads": shape.nheads,
                    "nheads_k": shape.nheads, "d": shape.d, "causal": shape.causal}  # fmt: skip
    status_rows: list[dict[str, Any]] = []
    fa = _flash_attn_impl(q, k, v, shape.causal)
    if fa is not None:
        impls.append(fa)
    elif device.type == "cuda":
        status_rows.append(
            status_row("attention", "flash-attn", "missing", "flash_attn is not importable", **shape_fields)
        )
    if shape.d in st.tutorial_dims:
        impls += _tutorial_impls(t["qt"], t["kt"], t["vt"], shape.causal, st.smoke)
    if shape.d in st.flex_dims and device.type == "cuda":
        if isinstance(flex, str):
            status_rows.append(status_row("attention", "flex", "missing", flex, **shape_fields))
        elif flex is not None and time.perf_counter() < deadline:
            impls.append(flex.impl(t["qt"], t["kt"], t["vt"], shape.causal))
        else:
            notes.append(f"flex skipped at d={shape.d} s={shape.seqlen} causal={shape.causal}: time budget")
            status_rows.append(
                status_row("attention", "flex", "missing", "skipped: time budget spent", **shape_fields)
            )
    rows: list[dict[str, Any]] = []
    flashpage_ok = True
    # Every implementation is checked, then timed in st.rounds round-robin rounds, so a drift of the
    # GPU's clocks (power cap, temperature) over the shape's minute reaches them all alike.
    errs: dict[str, tuple[float, float]] = {}

    def failed(impl: Impl, e: Exception) -> None:
        nonlocal flashpage_ok
        msg = f"{impl.name} d={shape.d} s={shape.seqlen} causal={shape.causal}: {type(e).__name__}: {str(e)[:160]}"
        print("  FAILED " + msg, flush=True)
        notes.append(msg)
        status_rows.append(status_row("attention", impl.name, "failed", failure_reason(e), **shape_fields))
        if impl.name == "flashpage":
            flashpage_ok = False

    for impl in impls:
        try:
            errs[impl_key(impl)] = check_impl(impl, ref, do)
        except Exception as e:  # a baseline that does not support the shape is reported, not fatal
            failed(impl, e)
    checked = [impl for impl in impls if impl_key(impl) in errs]
    timings = time_round_robin(checked, do, time_ms, st.rounds, failed)
    for impl in impls:
        key = impl_key(impl)
        if key not in timings:
            continue
        r, ok = impl_rows(impl, shape, errs[key], timings[key])
        if impl.name == "flashpage" and not ok:
            flashpage_ok = False
            print(
                f"  CHECK FAILED flashpage: out/grad rel err {r[0]['max_err']:.2e} / {r[1]['max_err']:.2e}",
                flush=True,
            )
        if impl.name == "flashpage":
            _add_kernel_times(r, shape, q, k, v, do, time_ms)
        rows += r
    tut = [row for row in rows if row["impl"] == "triton-tutorial"]
    rows = [row for row in rows if row["impl"] != "triton-tutorial"]
    rows += [min(tut, key=lambda row: row["ms"])] if tut else []  # the faster tutorial config
    base = {row["pass"]: row["tflops"] for row in rows if row["impl"] == "sdpa-flash"}
    for row in rows:
        if row["pass"] in base:
            row["ratio_vs_sdpa_flash"] = row["tflops"] / base[row["pass"]]
    return rows + status_rows, flashpage_ok, notes


def _add_kernel_times(
    rows: list[dict[str, Any]],
    shape: Shape,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    do: Tensor,
    time_ms: Callable[[Callable[[], Any]], float],
) -> None:
    """``kernel_ms`` and ``host_ms`` on flashpage's fwd / bwd rows, so a short-sequence row shows how
    much of its time is host-side overhead rather than kernel.

    ``kernel_ms``: GPU time of the launchers (``flash_fwd`` / ``flash_bwd``, same configs) without
    host cost: 10 calls captured in one CUDA graph, the replay timed (CPU: the launchers timed).
    ``host_ms``: host time per API call (``flash_attn_func`` with autograd / ``torch.autograd.grad``),
    50 calls back to back without synchronising. ``do_bench`` clears the L2 before each call, so
    the host time beyond that clear adds to ``ms``.
    """
    from flashpage.ops.flash_attn import flash_attn_func
    from flashpage.ops.flash_bwd import flash_bwd
    from flashpage.ops.flash_fwd import flash_fwd

    qd, kd, vd = q.detach(), k.detach(), v.detach()
    out, lse = flash_fwd(qd, kd, vd, causal=shape.causal, validate=False)
    launchers = {
        "fwd": lambda: flash_fwd(qd, kd, vd, causal=shape.causal, validate=False),
        "bwd": lambda: flash_bwd(do, qd, kd, vd, out, lse, causal=shape.causal, validate=False),
    }
    api_out = flash_attn_func(q, k, v, causal=shape.causal)
    api = {
        "fwd": lambda: flash_attn_func(q, k, v, causal=shape.causal),
        "bwd": lambda: torch.autograd.grad(api_out, (q, k, v), do, retain_graph=True),
    }
    times = {p: (_kernel_ms(fn, time_ms, qd.device), _host_ms(api[p])) for p, fn in launchers.items()}
    for row in rows:
        row["kernel_ms"], row["host_ms"] = times[row["pass"]]


def _kernel_ms(
    fn: Callable[[], Any], time_ms: Callable[[Callable[[], Any]], float], device: torch.device
) -> float:
    """GPU milliseconds per call of ``fn``: 10 calls replayed from a CUDA graph; off CUDA, or when
    the capture fails, ``fn`` timed directly."""
    ms = graph_ms(fn, device, time_ms, reps=10)
    if ms is None:
        if device.type == "cuda":
            print("  CUDA graph capture failed; kernel_ms timed eagerly", flush=True)
        ms = time_ms(fn)
    return ms


def _host_ms(fn: Callable[[], Any], calls: int = 50) -> float:
    """Host milliseconds per call of ``fn`` issued back to back (the GPU queue absorbs the work)."""
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t0) / calls * 1e3
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return host


# ------------------------------------------------------------------------------------------------
# Variants (tile configs, TMA on / off, dQ mode)
# ------------------------------------------------------------------------------------------------
def bench_variants(
    shape: Shape,
    device: torch.device,
    time_ms: Callable[[Callable[[], Any]], float],
    limit: int | None,
) -> tuple[list[dict[str, Any]], Any, Any]:
    """Time every candidate config on ``shape``; returns (rows, best fwd config, best bwd config)."""
    from flashpage.ops.flash_bwd import flash_bwd
    from flashpage.ops.flash_configs import bwd_candidates, fwd_candidates
    from flashpage.ops.flash_fwd import flash_fwd

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    t = make_inputs(shape, device, dtype)
    q, k, v, do = (t[n].detach() for n in ("q", "k", "v", "do"))
    qt, kt, vt = (t[n].detach().requires_grad_() for n in ("qt", "kt", "vt"))
    ref_o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=shape.causal)
    ref_g = tuple(g.transpose(1, 2) for g in torch.autograd.grad(ref_o, (qt, kt, vt), do.transpose(1, 2)))
    ref_o = ref_o.detach().transpose(1, 2)
    rows: list[dict[str, Any]] = []
    best: dict[str, tuple[float, Any]] = {}
    out0, lse0 = flash_fwd(q, k, v, causal=shape.causal)
    for pas, cands in (("fwd", fwd_candidates(shape.d, device)), ("bwd", bwd_candidates(shape.d, device))):
        for cfg in cands[:limit]:
            try:
                if pas == "fwd":
                    fn = lambda cfg=cfg: flash_fwd(q, k, v, causal=shape.causal, config=cfg)
                    err = _rel(fn()[0], ref_o)
                    flops = shape.fwd_flops
                else:
                    fn = lambda cfg=cfg: flash_bwd(do, q, k, v, out0, lse0, causal=shape.causal, config=cfg)
                    err = max(_rel(g, r) for g, r in zip(fn(), ref_g))
                    flops = 2.5 * shape.fwd_flops
                ms = time_ms(fn)
            except Exception as e:
                print(f"    {pas} {cfg.short():40s} FAILED {type(e).__name__}: {str(e)[:120]}", flush=True)
                continue
            ok = err <= (2e-2 if pas == "fwd" else 5e-2)
            tf = flops / ms / 1e9
            print(
                f"    {pas} {cfg.short():40s} {ms:8.3f} ms {tf:7.1f} TFLOP/s err {err:.1e}{'' if ok else ' WRONG'}",
                flush=True,
            )
            rows.append({"pass": pas, "d": shape.d, "causal": shape.causal, "seqlen": shape.seqlen,
                         "variant": cfg.short(), "ms": ms, "tflops": tf, "max_err": err, "check_ok": ok})  # fmt: skip
            if ok and tf > best.get(pas, (0.0, None))[0]:
                best[pas] = (tf, cfg)
    return rows, best.get("fwd", (0.0, None))[1], best.get("bwd", (0.0, None))[1]


def print_autotuned_table(longest: int) -> None:
    """Print this process's autotuning results (``FLASHPAGE_AUTOTUNE=1``) as table entries.

    Keys follow :func:`flashpage.ops.flash_fwd.problem_key` (``("fwd", gpu, dtype, d, group, varlen,
    causal, ...)``, ``("bwd", deterministic, gpu, ...)``); only plain (no window/softcap/ALiBi/dropout)
    non-deterministic problems become entries, the longest swept length standing for all longer ones.
    """
    from flashpage.ops.flash_configs import padded_head_dim, tuned_configs

    tables: dict[str, dict[tuple[int, bool, Any], Any]] = {"fwd": {}, "bwd": {}}
    for key, cfg in tuned_configs().items():
        kind, rest = str(key[0]), key[1:]
        if kind == "bwd":
            if rest[0]:  # deterministic
                continue
            rest = rest[1:]
        _gpu, _dtype, d, _group, varlen, causal, wl, wr, cap, alibi, drop, _bq, bk = rest
        if varlen or wl or (wr and not causal) or cap or alibi or drop:  # causal sets window_right = 0
            continue
        bucket = "ANY_SEQLEN" if int(bk) >= longest else int(bk)  # type: ignore[call-overload]
        tables[kind][(padded_head_dim(int(d)), bool(causal), bucket)] = cfg  # type: ignore[call-overload]
    _print_config_tables("autotuned configs (FLASHPAGE_AUTOTUNE=1)", tables["fwd"], tables["bwd"])


def _print_config_tables(title: str, fwd: dict[tuple[int, bool, Any], Any], bwd: dict[tuple[int, bool, Any], Any]) -> None:  # fmt: skip
    """Print ``HOPPER_FWD`` / ``HOPPER_BWD`` dict literals (keys ``(head dim, causal, bucket)``)."""
    print(f"\n# {title}, paste into src/flashpage/ops/flash_configs.py")
    for name, table in (("HOPPER_FWD", fwd), ("HOPPER_BWD", bwd)):
        # Per (head dim, causal): numeric buckets in order, then ANY_SEQLEN (the table's layout).
        items = sorted(table.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2] == "ANY_SEQLEN", kv[0][2] if isinstance(kv[0][2], int) else 0))  # fmt: skip
        # A bucket whose config equals the next larger bucket's adds nothing to table_lookup.
        items = [
            (k, c) for i, (k, c) in enumerate(items)
            if i + 1 == len(items) or items[i + 1][0][:2] != k[:2] or items[i + 1][1] != c
        ]  # fmt: skip
        body = "".join(f"    ({k[0]}, {k[1]}, {k[2]}): {_config_literal(c)},\n" for k, c in items)
        print(f"{name} = {{\n{body}}}", flush=True)


def _config_literal(cfg: Any) -> str:
    from dataclasses import fields

    args = ", ".join(f"{f.name}={getattr(cfg, f.name)!r}" for f in fields(cfg))
    return f"{type(cfg).__name__}({args})"


# ------------------------------------------------------------------------------------------------
# Main
# ------------------------------------------------------------------------------------------------
def _print_table(rows: list[dict[str, Any]]) -> None:
    rows = [r for r in rows if not r.get("status")]
    keyed: dict[tuple[Any, ...], dict[str, dict[str, Any]]] = {}
    for r in rows:
        keyed.setdefault((r["d"], r["seqlen"], r["causal"], r["pass"]), {})[r["impl"]] = r
    impls: list[str] = []
    for r in rows:
        if r["impl"] not in impls:
            impls.append(r["impl"])
    head = f"{'d':>4} {'seqlen':>6} {'causal':>6} {'pass':>4} | " + " | ".join(f"{n:>14}" for n in impls)
    print("\nTFLOP/s (ratio to sdpa-flash)\n" + head + "\n" + "-" * len(head))
    for (d, s, c, p), per in keyed.items():
        cells = []
        for n in impls:
            r = per.get(n)
            cells.append(f"{r['tflops']:7.1f} ({r.get('ratio_vs_sdpa_flash', 0):.2f})" if r else f"{'-':>14}")
        print(f"{d:>4} {s:>6} {int(c):>6} {p:>4} | " + " | ".join(cells))


@contextlib.contextmanager
def _section(name: str) -> Iterator[None]:
    t0 = time.perf_counter()
    yield
    print(f"  [{name}: {time.perf_counter() - t0:.1f} s]", flush=True)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns 0 when flashpage matched SDPA on every shape, 1 otherwise, 2 on bad use."""
    parser = argparse.ArgumentParser(prog="flashpage bench attention", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="d=128, seqlen 4k, one timing round (about 2 min on an H100/H200)",
    )
    parser.add_argument("--variants", action="store_true", help="also time every tile config / TMA on-off")
    parser.add_argument(
        "--smoke", action="store_true", help="tiny shapes on any device (CPU: Triton interpreter)"
    )
    parser.add_argument("--head-dims", default=None, help="comma list overriding the head dims")
    parser.add_argument("--seqlens", default=None, help="comma list overriding the sequence lengths")
    parser.add_argument("--no-flex", action="store_true", help="skip FlexAttention (its compiles are slow)")
    parser.add_argument(
        "--flex-all", action="store_true", help="FlexAttention at every head dim, not just 128"
    )
    parser.add_argument(
        "--tutorial-all",
        action="store_true",
        help="the Triton-tutorial baseline at every head dim, not just 128",
    )
    parser.add_argument("--budget-s", type=float, default=None, help="skip flex after this many seconds")
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="timing rounds per shape, every implementation once per round in turn; rows keep the "
        "fastest (default 2, smoke 1)",
    )
    parser.add_argument(
        "--profile",
        default=None,
        help="hardware profile JSON frac_of_roofline is of (flashpage bench all passes the one probe "
        "measured); default: this device probed now",
    )
    parser.add_argument(
        "--out", "--out-dir", dest="out_dir", type=Path, default=None, help="results directory"
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        if not args.smoke:
            print(
                "flashpage bench attention needs a CUDA GPU (use --smoke to check the script on CPU)",
                file=sys.stderr,
            )
            return 2
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before flashpage.ops imports triton
        os.environ.setdefault("FLASHPAGE_BACKEND", "triton")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    st = _settings(args)
    time_ms = make_timer(device, st.warmup_ms, st.rep_ms)
    sweep_ms = make_timer(device, 10, 40)
    t_start = time.perf_counter()
    deadline = t_start + st.budget_s
    torch.manual_seed(0)
    profile = run_profile(args.profile, quick=args.quick or args.smoke)
    elt = 2 if device.type == "cuda" else 4
    print(
        f"{torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}: roofline {profile.name}, "
        f"peak {profile.peak('bf16' if device.type == 'cuda' else 'fp32') / 1e12:.0f} TFLOP/s, "
        f"{profile.hbm_bandwidth / 1e12:.2f} TB/s",
        flush=True,
    )
    flex: _Flex | str | None = None
    if st.flex_dims and device.type == "cuda":
        try:
            flex = _Flex()
        except Exception as e:
            print(f"flex unavailable: {e}", flush=True)
            flex = f"FlexAttention unavailable: {failure_reason(e)}"
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    all_ok = True
    for shape in st.shapes:
        print(
            f"d={shape.d} s={shape.seqlen} b={shape.batch} h={shape.nheads} causal={shape.causal}", flush=True
        )
        with _section("shape"):
            r, ok, n = bench_shape(shape, st, device, time_ms, flex, deadline)
        for row in r:
            if row.get("status"):
                print(f"  {row['impl']:15s} {row['status']}: {row['reason']}", flush=True)
                continue
            flops = row["tflops"] * row["ms"] * 1e9
            row["frac_of_roofline"] = roofline_fraction(
                flops, attention_bytes(shape, row["pass"], elt), row["ms"] * 1e-3, profile
            )
            print(f"  {row['impl']:15s} {row['pass']} {row['ms']:8.3f} ms {row['tflops']:7.1f} TFLOP/s "
                  f"x{row.get('ratio_vs_sdpa_flash', float('nan')):.2f} err {row['max_err']:.1e}", flush=True)  # fmt: skip
        rows += r
        notes += n
        all_ok &= ok
        if device.type == "cuda":
            torch.cuda.empty_cache()
    _print_table(rows)

    if args.variants:
        from flashpage.ops.flash_configs import padded_head_dim

        best_f: dict[tuple[int, bool, Any], Any] = {}
        best_b: dict[tuple[int, bool, Any], Any] = {}
        longest = max(s.seqlen for s in st.shapes)
        for shape in st.shapes:
            print(f"variants d={shape.d} s={shape.seqlen} causal={shape.causal}", flush=True)
            with _section("variants"):
                _, bf, bb = bench_variants(shape, device, sweep_ms, 2 if st.smoke else None)
            # The longest swept length stands for every longer one (flash_configs.table_lookup).
            bucket = "ANY_SEQLEN" if shape.seqlen == longest else shape.seqlen
            key = (padded_head_dim(shape.d), shape.causal, bucket)
            if bf is not None:
                best_f[key] = bf
            if bb is not None:
                best_b[key] = bb
        _print_config_tables("best configs", best_f, best_b)

    from flashpage.ops.flash_configs import autotune_enabled

    if autotune_enabled():
        print_autotuned_table(max(s.seqlen for s in st.shapes))
    env = env_info(None, None, profile=profile)
    note = (
        "16k tokens total, model dim 2048, bf16; TFLOP/s from 4*b*h*s^2*d (/2 causal), bwd 2.5x fwd; "
        "ratio_vs_sdpa_flash per row; max_err = relative max error vs SDPA-flash (grads: worst of dq/dk/dv)."
    )
    if notes:
        note += " Notes: " + "; ".join(notes)
    out_dir = args.out_dir
    if st.smoke and out_dir is None:  # a script check, not a result: keep it out of benchmarks/
        out_dir = Path(tempfile.mkdtemp(prefix="flashpage-attn-smoke-"))
    path = write_results("attention", rows, env, table_columns=TABLE_COLUMNS, out_dir=out_dir, note=note)
    print(f"\nwrote {path} ({time.perf_counter() - t_start:.0f} s)", flush=True)
    return 0 if all_ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
