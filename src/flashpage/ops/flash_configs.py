"""Tile configurations of the FlashAttention kernels: a tuned table per GPU, fallbacks, autotuning.

A forward launch is described by :class:`FwdConfig` (``BLOCK_M`` query rows x ``BLOCK_N`` keys per
tile, warps, pipeline stages, TMA descriptors on/off), a backward launch by :class:`BwdConfig` (the
dK/dV kernel's ``block_m1`` x ``block_n1`` tiles, the dQ kernel's ``block_m2`` x ``block_n2`` tiles and
whether dQ is accumulated with fp32 atomics inside the dK/dV kernel or by its own kernel).

Lookup order (:func:`fwd_config`, :func:`bwd_config`):

1. under the Triton interpreter: 16 x 16 tiles (fast on CPU, still several tiles per test problem);
2. ``FLASHPAGE_AUTOTUNE=1`` on CUDA: time :func:`fwd_candidates` / :func:`bwd_candidates` once per
   problem key (``triton.testing.do_bench``) and remember the fastest for the process;
3. the checked-in table for this GPU family (Hopper entries measured on the H200 by
   ``python -m flashpage.bench.attention --variants``, which prints a dict to paste here);
4. conservative defaults (Ampere-safe tile sizes, pointer loads).

Table keys are ``(padded head dim, causal, seqlen bucket)`` for 16-bit dtypes: a problem uses the entry
with the smallest bucket >= its ``max_seqlen_k`` (else the largest bucket), because the best tiles for
1k-token sequences (many short programs: latency, occupancy) differ from those for 16k. float32 always
uses small tiles.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from flashpage.ops.utils import gpu_family, tma_supported, ws_supported

__all__ = [
    "BwdConfig",
    "FwdConfig",
    "autotune_enabled",
    "bwd_candidates",
    "bwd_config",
    "fwd_candidates",
    "fwd_config",
    "padded_head_dim",
    "table_lookup",
    "tuned_configs",
]

_DQ_MODES = ("separate", "fused", "atomic", "atomic_tma")


@dataclass(frozen=True)
class FwdConfig:
    """Forward launch parameters.

    Attributes:
        block_m: query rows per program (power of two, >= 16).
        block_n: keys per inner-loop tile (power of two, >= 16).
        num_warps, num_stages: Triton launch parameters.
        use_tma: load Q/K/V tiles through TMA tensor descriptors (Hopper+, power-of-two head dim,
            16-byte aligned strides); silently falls back to pointer loads when not possible.
        split_tail: when the row tiles of a padded, unmasked (non-causal, no window) forward end in
            a partial wave of programs, share that wave's key ranges among all resident programs
            (stream-K, ``flash_fwd.TailSplit``) instead of running it at partial occupancy.
        ws_stages: on Hopper, run the Gluon warp-specialized kernel of ``flash_fwd_ws`` (FA3's
            ping-pong schedule, 128 x 128 tiles) with a K/V ring this deep (2 or 3) where it applies
            (``flash_fwd.ws_applies``); 0: never. The other fields configure the Triton kernel,
            which runs everything the Gluon one does not take.
    """

    block_m: int = 128
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    use_tma: bool = False
    split_tail: bool = True
    ws_stages: int = 0

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n"):
            val = getattr(self, name)
            if val < 16 or val & (val - 1):
                raise ValueError(f"FwdConfig.{name} must be a power of two >= 16, got {val}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"FwdConfig.num_warps must be 1, 2, 4, 8 or 16, got {self.num_warps}")
        if self.num_stages < 1:
            raise ValueError(f"FwdConfig.num_stages must be >= 1, got {self.num_stages}")
        if self.ws_stages not in (0, 2, 3):
            raise ValueError(f"FwdConfig.ws_stages must be 0 (off), 2 or 3, got {self.ws_stages}")

    def short(self) -> str:
        """Compact label used by the benchmark's variant table."""
        tail = "" if self.split_tail else "-whole"
        ws = f"-ws{self.ws_stages}" if self.ws_stages else ""
        return (
            f"m{self.block_m}n{self.block_n}w{self.num_warps}s{self.num_stages}"
            f"{'tma' if self.use_tma else 'ptr'}{tail}{ws}"
        )


@dataclass(frozen=True)
class BwdConfig:
    """Backward launch parameters.

    Attributes:
        block_m1, block_n1: dK/dV kernel tiles: ``block_n1`` keys per program, ``block_m1`` query rows
            per inner step.
        block_m2, block_n2: dQ kernel tiles: ``block_m2`` query rows per program, ``block_n2`` keys per
            inner step (unused with ``dq_mode="atomic"``).
        num_warps, num_stages: dK/dV kernel launch parameters.
        num_warps2, num_stages2: dQ kernel launch parameters.
        dq_mode: ``"separate"`` (own kernel, no atomics, deterministic), ``"fused"`` (the same dQ
            programs in the dK/dV launch, after each KV head's dK/dV programs, as FlexAttention's
            backward does; deterministic; runs with ``num_warps`` / ``num_stages``, so
            ``num_warps2`` / ``num_stages2`` must equal them), ``"atomic"`` (fp32 atomic
            adds from the dK/dV kernel: 5 instead of 7 matmuls per tile pair, not bit-reproducible) or
            ``"atomic_tma"`` (the same through one TMA bulk reduce-add per tile, Hopper+; the scalar
            atomics elsewhere). ``deterministic=True`` always uses ``"separate"``.
        use_tma: TMA descriptor loads of the streamed tiles (Q/dO in dK/dV, K/V in dQ).
        split_dkdv: compute dV and dK in two launches of the dK/dV kernel (one float32
            accumulator per program instead of two, one more Q K^T): at d=256 what lets the score
            tiles have the 16 x num_warps rows that keep Triton from computing them once per
            warpgroup (64-row tiles with 4 warps, 128-row tiles with 8).
        split_tail: as :attr:`FwdConfig.split_tail`, for the dK/dV and dQ launches (not ``"fused"``):
            the last partial wave's KV tiles are split over their query tiles, its query tiles over
            their key tiles, and float32 partials are summed by a small kernel.

    Tiles of fewer than ``16 * num_warps`` rows (``block_n1`` in dK/dV, ``block_m2`` in dQ) are legal
    but slow on Hopper: the score tile feeds another dot, so Triton spreads all warps along its rows
    and each warpgroup repeats the same ``Q K^T`` / ``dO V^T``.
    """

    block_m1: int = 32
    block_n1: int = 64
    block_m2: int = 64
    block_n2: int = 32
    num_warps: int = 4
    num_stages: int = 2
    num_warps2: int = 4
    num_stages2: int = 2
    dq_mode: str = "separate"
    use_tma: bool = False
    split_dkdv: bool = False
    split_tail: bool = True

    def __post_init__(self) -> None:
        for name in ("block_m1", "block_n1", "block_m2", "block_n2"):
            val = getattr(self, name)
            if val < 16 or val & (val - 1):
                raise ValueError(f"BwdConfig.{name} must be a power of two >= 16, got {val}")
        for name in ("num_warps", "num_warps2"):
            if getattr(self, name) not in (1, 2, 4, 8, 16):
                raise ValueError(f"BwdConfig.{name} must be 1, 2, 4, 8 or 16, got {getattr(self, name)}")
        if self.num_stages < 1 or self.num_stages2 < 1:
            raise ValueError("BwdConfig.num_stages / num_stages2 must be >= 1")
        if self.dq_mode not in _DQ_MODES:
            raise ValueError(f"BwdConfig.dq_mode must be one of {_DQ_MODES}, got {self.dq_mode!r}")
        one_launch = (self.num_warps2, self.num_stages2) == (self.num_warps, self.num_stages)
        if self.dq_mode == "fused" and not one_launch:
            raise ValueError(
                "BwdConfig with dq_mode='fused' runs dQ in the dK/dV launch: num_warps2 / num_stages2 "
                f"({self.num_warps2} / {self.num_stages2}) must equal num_warps / num_stages "
                f"({self.num_warps} / {self.num_stages})"
            )

    def short(self) -> str:
        """Compact label used by the benchmark's variant table."""
        return (
            f"kv{self.block_m1}x{self.block_n1}w{self.num_warps}s{self.num_stages}-"
            f"q{self.block_m2}x{self.block_n2}w{self.num_warps2}s{self.num_stages2}-"
            f"{self.dq_mode}{'-tma' if self.use_tma else ''}{'-split' if self.split_dkdv else ''}"
            f"{'' if self.split_tail else '-whole'}"
        )


# ---------------------------------------------------------------------------------------------
# Checked-in tables. Keys: (padded head dim, causal, seqlen bucket), see table_lookup. Hopper (sm_90:
# H100 / H200) entries, picked by FLASHPAGE_AUTOTUNE=1 in `flashpage bench attention` on the H200
# (torch 2.11, triton 3.6, 2026-12-03, commit 7ef85f4; benchmarks/results/attention-h200.json), which prints these
# dicts (a bucket equal to the next larger one is left out); `--variants` prints per-config timings.
# Entries with a comment beside them (d=128 forward at 16k, d=256 backward) come from later sweeps
# that timed explicit configs against SDPA-flash in the same run.
# d=32 entries are untuned guesses.
# ---------------------------------------------------------------------------------------------
ANY_SEQLEN = 1 << 30
HOPPER_FWD: dict[tuple[int, bool, int], FwdConfig] = {
    (32, False, ANY_SEQLEN): FwdConfig(128, 128, 8, 3, True),
    (32, True, ANY_SEQLEN): FwdConfig(128, 128, 8, 3, True),
    # ws_stages (the Gluon warp-specialized kernel, flash_fwd_ws): sweep of 2026-12-04 on the H200,
    # same run as SDPA (16k tokens, model dim 2048, bf16; TFLOP/s, Triton entry -> Gluon):
    # d=64 16k 420 -> 436 / causal 394 -> 408, 4k 409 -> 419 / causal 373 -> 328 (kept Triton),
    # 1k 360 -> 331-349 / causal 293 -> 241 (kept Triton).
    (64, False, 1024): FwdConfig(64, 64, 4, 3, True),
    (64, False, ANY_SEQLEN): FwdConfig(128, 64, 4, 3, True, ws_stages=2),
    (64, True, 1024): FwdConfig(64, 64, 4, 2, True),
    (64, True, 4096): FwdConfig(64, 64, 4, 3, True),
    (64, True, ANY_SEQLEN): FwdConfig(64, 64, 4, 3, True, ws_stages=2),
    # d=128: 16k 517 -> 643 (3 stages; 2: 636) / causal 496 -> 592 (2: 568), 4k 473 -> 630 (2 stages;
    # 3: 599) / causal 435 -> 475, 1k 418 -> 498 (no tail split; with it 482) / causal 341 -> 322
    # (kept Triton). cuDNN in the same run: 609 / 542 at 16k.
    (128, False, 1024): FwdConfig(64, 64, 4, 3, True, split_tail=False, ws_stages=2),
    (128, False, 4096): FwdConfig(128, 128, 8, 3, True, ws_stages=2),
    # Triton at 16k (sweep of 2026-12-03, same run as SDPA-flash): 128 x 128 w8 s3 506 / 503 TFLOP/s
    # non-causal / causal vs 481 / 485 for 64 x 64 w4 s3 (which wins causal at 4k: 444 vs 429).
    (128, False, ANY_SEQLEN): FwdConfig(128, 128, 8, 3, True, ws_stages=3),
    (128, True, 1024): FwdConfig(64, 64, 4, 3, True),
    (128, True, 4096): FwdConfig(64, 64, 4, 3, True, ws_stages=2),
    (128, True, ANY_SEQLEN): FwdConfig(128, 128, 8, 3, True, ws_stages=3),
    (256, False, ANY_SEQLEN): FwdConfig(128, 64, 8, 2, True),
    (256, True, ANY_SEQLEN): FwdConfig(128, 64, 8, 2, True),
}
HOPPER_BWD: dict[tuple[int, bool, int], BwdConfig] = {
    (32, False, ANY_SEQLEN): BwdConfig(64, 128, 128, 64, 8, 3, 8, 3),
    (32, True, ANY_SEQLEN): BwdConfig(64, 128, 128, 64, 8, 3, 8, 3),
    (64, False, ANY_SEQLEN): BwdConfig(64, 64, 64, 64, 4, 3, 4, 3, "separate", True),
    (64, True, ANY_SEQLEN): BwdConfig(64, 64, 64, 64, 4, 3, 4, 3),
    (128, False, ANY_SEQLEN): BwdConfig(64, 128, 128, 64, 8, 3, 8, 3),
    # d=128 causal (sweep of 2026-12-03 evening, same run, direct flash_bwd): dQ fused into the
    # dK/dV launch with TMA, 401.7 / 346.2 / 233.8 TFLOP/s at 16k / 4k / 1k vs 388.1 / 338.7 / 223.8
    # for the previous entries (repeat at 16k: 399-400 vs 390-398). Non-causal, fused is slower
    # (362-370 vs 389.8 at 16k), so those keep the separate dQ kernel.
    (128, True, ANY_SEQLEN): BwdConfig(64, 128, 128, 64, 8, 3, 8, 3, "fused", True),
    # d=256 (sweep of 2026-12-03, same H200 run as SDPA-flash: 255-308 TFLOP/s non-causal, 195-319
    # causal, 1.12-1.28x SDPA-flash at 1k-16k): dK and dV in two launches so one float32 accumulator
    # fits, with score tiles of 64 rows per 4 warps / 128 per 8 warps (see bwd_candidates).
    # No tail split: its tail variants of these kernels spill (offline sm_90 compile, triton 3.6: the
    # dK pass 520 bytes instead of 164, the dV pass 60 instead of none).
    (256, False, ANY_SEQLEN): BwdConfig(64, 64, 128, 32, 4, 2, 8, 3, "separate", True, True, False),
    # causal: dQ fused into the dK pass (same evening sweep): 335.1 / 204.2 at 16k / 1k vs 332.0 / 194.6.
    (256, True, ANY_SEQLEN): BwdConfig(32, 128, 128, 32, 8, 3, 8, 3, "fused", True, True),
}


def table_lookup(table: dict, head_dim_padded: int, causal: bool, seqlen_k: int | None) -> object | None:
    """The entry of ``table`` for ``(head_dim_padded, causal)`` whose seqlen bucket is the smallest one
    >= ``seqlen_k`` (``None``: the largest bucket); ``None`` when the table has no such key."""
    buckets = sorted(b for (d, c, b) in table if d == head_dim_padded and c == causal)
    if not buckets:
        return None
    s = ANY_SEQLEN if seqlen_k is None else int(seqlen_k)
    chosen = next((b for b in buckets if b >= s), buckets[-1])
    return table[(head_dim_padded, causal, chosen)]


# Safe everywhere (sm_80+, < 100 KB shared memory, no TMA).
_DEFAULT_FWD: dict[int, FwdConfig] = {
    32: FwdConfig(128, 64, 4, 3),
    64: FwdConfig(128, 64, 4, 3),
    128: FwdConfig(128, 64, 8, 2),
    256: FwdConfig(64, 32, 4, 2),
}
_DEFAULT_BWD: dict[int, BwdConfig] = {
    32: BwdConfig(32, 128, 128, 32, 8, 2, 8, 2),
    64: BwdConfig(32, 128, 128, 32, 8, 2, 8, 2),
    128: BwdConfig(32, 64, 64, 32, 4, 2, 4, 2),
    256: BwdConfig(16, 32, 32, 16, 4, 1, 4, 1),
}
_FP32_FWD = FwdConfig(64, 32, 4, 2)
_FP32_BWD = BwdConfig(16, 32, 32, 16, 4, 1, 4, 1)
_INTERP_FWD = FwdConfig(16, 16, 4, 1)
_INTERP_BWD = BwdConfig(16, 16, 16, 16, 4, 1, 4, 1)


def padded_head_dim(head_dim: int) -> int:
    """The head-dim block: the next power of two (96 -> 128, 192 -> 256), at least 32."""
    return max(32, 1 << (int(head_dim) - 1).bit_length())


def autotune_enabled() -> bool:
    """``FLASHPAGE_AUTOTUNE=1`` (read at every call) asks for per-shape autotuning on CUDA."""
    return os.environ.get("FLASHPAGE_AUTOTUNE", "0") not in ("", "0")


def fwd_config(
    head_dim: int, dtype: torch.dtype, causal: bool, device: torch.device, seqlen_k: int | None = None
) -> FwdConfig:
    """The table (or fallback) forward config; autotuning is done by the launcher (see module doc)."""
    fam = gpu_family(device)
    if fam == "interpreter":
        return _INTERP_FWD
    if dtype == torch.float32:
        return _FP32_FWD
    dp = padded_head_dim(head_dim)
    if fam in ("hopper", "blackwell"):
        cfg = table_lookup(HOPPER_FWD, dp, causal, seqlen_k) or _DEFAULT_FWD[dp]
        assert isinstance(cfg, FwdConfig)
        return cfg if tma_supported(device) else replace(cfg, use_tma=False)
    return _DEFAULT_FWD[dp]


def bwd_config(
    head_dim: int, dtype: torch.dtype, causal: bool, device: torch.device, seqlen_k: int | None = None
) -> BwdConfig:
    """The table (or fallback) backward config."""
    fam = gpu_family(device)
    if fam == "interpreter":
        return _INTERP_BWD
    if dtype == torch.float32:
        return _FP32_BWD
    dp = padded_head_dim(head_dim)
    if fam in ("hopper", "blackwell"):
        cfg = table_lookup(HOPPER_BWD, dp, causal, seqlen_k) or _DEFAULT_BWD[dp]
        assert isinstance(cfg, BwdConfig)
        return cfg if tma_supported(device) else replace(cfg, use_tma=False)
    return _DEFAULT_BWD[dp]


def fwd_candidates(head_dim: int, device: torch.device) -> list[FwdConfig]:
    """Forward configs worth timing on this GPU (the autotuner's and ``--variants``' search space)."""
    dp = padded_head_dim(head_dim)
    tma = tma_supported(device) and dp == head_dim
    if dp <= 64:
        base = [
            (128, 64, 4, 3),
            (128, 128, 8, 3),
            (128, 64, 8, 3),
            (64, 64, 4, 3),
            (64, 64, 4, 2),
            (128, 128, 8, 4),
        ]
    elif dp <= 128:
        base = [
            (128, 128, 8, 3),
            (128, 64, 8, 3),
            (64, 64, 4, 3),
            (64, 64, 4, 2),
            (128, 128, 8, 2),
            (128, 128, 8, 4),  # not yet measured (2026-12-03): deeper pipelines for long rows
            (128, 64, 4, 4),
        ]
    else:
        base = [(128, 64, 8, 2), (64, 64, 4, 2), (64, 32, 4, 2), (128, 32, 8, 2)]
    # With TMA the pointer-load variants were never faster on the H200 (2026-12-03): time TMA only.
    out = [FwdConfig(*b, use_tma=tma) for b in base]
    if head_dim in (64, 128) and ws_supported(device):
        out += [replace(out[0], ws_stages=st) for st in (2, 3)]
        out += [replace(out[0], ws_stages=2, split_tail=False)]
    return out


def bwd_candidates(head_dim: int, device: torch.device) -> list[BwdConfig]:
    """Backward configs worth timing on this GPU."""
    dp = padded_head_dim(head_dim)
    tma = tma_supported(device) and dp == head_dim
    if dp <= 64:
        base = [
            BwdConfig(64, 128, 128, 64, 8, 3, 8, 3),
            BwdConfig(32, 128, 128, 32, 4, 3, 4, 3),
            BwdConfig(64, 64, 64, 64, 4, 3, 4, 3),
        ]
    elif dp <= 128:
        base = [
            BwdConfig(32, 128, 128, 64, 8, 3, 8, 2),
            BwdConfig(64, 128, 128, 64, 8, 2, 8, 2),
            BwdConfig(32, 64, 64, 64, 4, 3, 4, 3),
            BwdConfig(16, 128, 128, 32, 8, 4, 8, 3),
            # FlexAttention's sm90 default for d <= 128: 388 / 424 TFLOP/s at d=128 16k non-causal /
            # causal on the H200 (2026-12-03), vs 338 / 362 for the best of the others.
            BwdConfig(64, 128, 128, 64, 8, 3, 8, 3),
        ]
    else:
        # d=256. Triton gives a dot whose result feeds another dot (the score tile here) all warps
        # along M, so a score tile of fewer rows than 16 x num_warps is computed redundantly by
        # each warpgroup: with 8 warps, 64-row tiles did Q K^T and dO V^T twice (207 TFLOP/s at 16k,
        # 0.80x SDPA-flash). The two float32 BLOCK x 256 accumulators of dK and dV do not fit with
        # 128-row tiles, so dK and dV take two launches (split_dkdv: one more Q K^T, no spills):
        # 292 / 319 TFLOP/s non-causal / causal at 16k on the H200 (2026-12-03).
        base = [
            BwdConfig(64, 64, 128, 32, 4, 2, 8, 3, split_dkdv=True),
            BwdConfig(32, 128, 128, 32, 8, 3, 8, 3, split_dkdv=True),
            BwdConfig(32, 128, 128, 32, 8, 2, 8, 3, split_dkdv=True),
        ]
        # Measured with TMA only (pointer loads of 64 x 256 tiles cost registers).
        return [replace(c, use_tma=tma) for c in base] + [replace(base[1], use_tma=tma, dq_mode="fused")]
    out = list(base)
    out += [replace(c, dq_mode="atomic") for c in base[:2]]
    out += [replace(base[-1], dq_mode="fused")]
    if tma:
        out += [replace(c, use_tma=True) for c in base[:2]]
        out += [replace(base[-1], use_tma=True), replace(base[-1], use_tma=True, dq_mode="fused")]
    # Measured slower on the H200 at 16k (2026-12-03), so not timed by the autotuner (still
    # selectable): dq_mode="atomic_tma" 302 vs 338 TFLOP/s (d=128, kv64x128, non-causal); at d=256
    # 16 warps 74 and the previous 8-warp 64 x 64 tiles 207 (vs 292 for the first candidate).
    return out


# One process-wide memo of autotuning results (like triton.autotune's cache): key -> best config.
# Only used with FLASHPAGE_AUTOTUNE=1.
@functools.cache
def _tuned() -> dict[tuple[object, ...], object]:
    return {}


def tuned_configs() -> dict[tuple[object, ...], object]:
    """A copy of this process's autotuning results (key -> config); see :func:`autotune`."""
    return dict(_tuned())


def autotune(key: tuple[object, ...], candidates: list, run: Callable[[object], object]) -> object:
    """Return the fastest of ``candidates`` for ``key`` (timed once per process with do_bench).

    ``run(cfg)`` launches the kernel(s) with one config; configs that fail to compile are skipped.
    """
    memo = _tuned()
    if key in memo:
        return memo[key]
    from triton.testing import do_bench

    best, best_ms = candidates[0], float("inf")
    for cfg in candidates:
        try:
            ms = do_bench(lambda cfg=cfg: run(cfg), warmup=10, rep=30, return_mode="median")
        except Exception:  # a config that does not compile / fit on this GPU is just not a candidate
            continue
        if ms < best_ms:
            best, best_ms = cfg, ms
    memo[key] = best
    return best
