"""The roofline planner: which attention kernel (and split-KV count) each phase gets.

Small, pure-Python and cheap: the engine calls :func:`plan_attention` every step, kernels call
:func:`choose_num_splits` when asked for ``num_splits=0``. Nothing is cached globally except
``lru_cache`` on pure functions of plain numbers.

Decisions:

- ``prefill`` without a cached prefix -> ``flash_fwd`` (the FlashAttention kernel on the new K/V;
  compute-bound from a few hundred tokens on).
- ``prefill`` with a cached prefix, and ``chunked_prefill`` -> ``paged_prefill`` (queries over the
  paged cache, causal bottom-right).
- ``decode`` (one query token per sequence) -> ``paged_decode``, or ``paged_decode_splitkv`` when
  :func:`choose_num_splits` returns more than one split. A ``decode`` step with several query tokens
  per sequence (speculative verification) goes to ``paged_prefill``.

Split-KV heuristic (flash-decoding): a decode launch has ``batch * nheads_k * splits`` programs (one
per sequence, KV head and KV split; the GQA group of query heads shares its KV head's program). To
fill the GPU we want at least two programs per SM, so ``splits`` is the smallest power of two with
``batch * nheads_k * splits >= 2 * num_sms``, capped so each split keeps at least
``min_tokens_per_split`` keys (the partial results' merge costs a second pass) and at most
``max_splits``. On the H200 (132 SMs, Llama-3 GQA 8 KV heads) this reproduces the best split counts
measured in ``shared/anchors/triton-paged-decode-h200-2026-12-02.json``: b=1 ctx=128k -> 64,
b=32 ctx=32k -> 2, b=64 ctx=4k -> 1, b=256 ctx=4k -> 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from flashpage.roofline.hardware import HardwareProfile, load_profile, normalize_dtype
from flashpage.roofline.intensity import OpCost, attention_cost, bound, model_op_costs
from flashpage.roofline.model_shapes import ModelShape

__all__ = [
    "PHASES",
    "KernelChoice",
    "PlannedOp",
    "choose_heads_per_program",
    "choose_num_splits",
    "plan",
    "plan_attention",
    "plan_model",
    "pow2_divisor_at_most",
]

#: Phases the planner knows.
PHASES: tuple[str, ...] = ("prefill", "decode", "chunked_prefill")


@dataclass(frozen=True)
class KernelChoice:
    """The planner's decision for one op of one phase.

    Attributes:
        phase: ``"prefill"`` | ``"decode"`` | ``"chunked_prefill"``.
        op: ``"attention"`` for attention choices; GEMM rows of :func:`plan` use the GEMM's name
            (``qkv``, ``o``, ``gate_up``, ``down``, ``lm_head``).
        kernel: ``"flash_fwd"`` | ``"paged_prefill"`` | ``"paged_decode"`` | ``"paged_decode_splitkv"``
            (``"matmul"`` for GEMMs: torch / cuBLAS).
        num_splits: split-KV count (1 = no split).
        intensity: FLOP/byte of the op.
        ridge: FLOP/byte where the hardware turns compute-bound for this dtype.
        bound: ``"compute"`` | ``"memory"``.
    """

    phase: str
    op: str
    kernel: str
    num_splits: int
    intensity: float
    ridge: float
    bound: str


def _pow2_floor(x: int) -> int:
    return 1 << (x.bit_length() - 1) if x >= 1 else 1


@lru_cache(maxsize=4096)
def choose_num_splits(
    batch: int,
    nheads_k: int,
    seqlen_k: int,
    num_sms: int,
    min_tokens_per_split: int = 256,
    max_splits: int = 128,
    one_wave_of: int = 0,
) -> int:
    """Split-KV count for a decode launch (flash-decoding heuristic, see the module docstring).

    Returns the smallest power of two ``s`` with ``batch * nheads_k * s >= 2 * num_sms``, lowered to
    the largest power of two keeping ``seqlen_k / s >= min_tokens_per_split`` and ``s <= max_splits``;
    at least 1. With ``one_wave_of = k > 0`` (programs that hold only ``k`` per SM) instead the
    largest power of two with ``batch * nheads_k * s <= k * num_sms``: one full wave, no second
    partial one, under the same caps.
    """
    for name, v in (("batch", batch), ("nheads_k", nheads_k), ("seqlen_k", seqlen_k), ("num_sms", num_sms)):
        if v < 1:
            raise ValueError(f"{name}: must be >= 1, got {v}")
    if min_tokens_per_split < 1 or max_splits < 1 or one_wave_of < 0:
        raise ValueError("min_tokens_per_split and max_splits must be >= 1, one_wave_of >= 0")
    programs = batch * nheads_k
    splits = 1
    if one_wave_of:
        while programs * splits * 2 <= one_wave_of * num_sms:
            splits *= 2
    else:
        while programs * splits < 2 * num_sms:
            splits *= 2
    cap = min(_pow2_floor(max_splits), _pow2_floor(max(1, seqlen_k // min_tokens_per_split)))
    return max(1, min(splits, cap))


def pow2_divisor_at_most(n: int, cap: int) -> int:
    """The largest power of two that divides ``n`` and is at most ``cap`` (at least 1)."""
    h = 1
    while h * 2 <= cap and n % (h * 2) == 0:
        h *= 2
    return h


def choose_heads_per_program(
    batch: int,
    nheads_k: int,
    max_heads: int,
    seqlen_k: int,
    num_sms: int,
    min_tokens_per_split: int = 256,
    max_splits: int = 32,
) -> int:
    """KV heads per decode program (a power of two <= ``max_heads`` dividing ``nheads_k``).

    Programs over several KV heads read each token's heads as one run, but a launch has
    ``nheads_k / heads`` times fewer of them. The rule: one head when one-head programs fill the
    GPU without splitting (``batch * nheads_k >= 2 * num_sms``); otherwise (splits are needed
    anyway) the most heads whose :func:`choose_num_splits` count still reaches ``2 * num_sms``
    programs with at most ``max_splits`` splits (more heads, more splits: their combine grows);
    else 1.

    Measured (H100, GQA 32/8 and MHA 32/32, d=128, bf16, block size 16, 2026-12-05, ``flashpage
    bench decode`` planner vs one-head rows in the same run, three runs): where one head needs
    splits, 4 heads read +0.6-0.8% at b32/32k (8 splits vs 2) and 16 heads +0.9-1.3% at MHA
    b8/32k. Where one head needs none, more heads were -1.5% (b64/4k: 4 splits), -0.6% (MHA
    b64/4k) or within +-0.5% (b256/4k). At b1/128k 2 heads with 128 splits read 0.3-0.4% less
    than one head with 64 (two runs): hence ``max_splits`` 32.
    """
    for name, v in (("batch", batch), ("nheads_k", nheads_k), ("max_heads", max_heads), ("num_sms", num_sms)):
        if v < 1:
            raise ValueError(f"{name}: must be >= 1, got {v}")
    target = 2 * num_sms
    if batch * nheads_k >= target:
        return 1
    h = pow2_divisor_at_most(nheads_k, max_heads)
    while h > 1:
        splits = choose_num_splits(batch, nheads_k // h, seqlen_k, num_sms, min_tokens_per_split, max_splits)
        if batch * (nheads_k // h) * splits >= target:
            return h
        h //= 2
    return 1


@lru_cache(maxsize=1)
def _default_profile() -> HardwareProfile:
    # The project's target device. Callers that know their device pass detect_profile() (once, at
    # start-up); probing here would make a per-step call expensive.
    return load_profile("h200")


@lru_cache(maxsize=4096)
def _plan_attention_cached(
    phase: str,
    batch: int,
    seqlen_q: int,
    seqlen_k: int,
    nheads: int,
    nheads_k: int,
    head_dim: int,
    dtype: str,
    peak: float,
    bandwidth: float,
    num_sms: int,
    has_prefix: bool,
) -> KernelChoice:
    cost = attention_cost(
        phase,
        batch=batch,
        seqlen_q=seqlen_q,
        seqlen_k=seqlen_k,
        nheads=nheads,
        nheads_k=nheads_k,
        head_dim=head_dim,
        dtype=dtype,
    )
    rp = peak / bandwidth
    splits = 1
    if phase == "decode" and seqlen_q == 1:
        splits = choose_num_splits(batch, nheads_k, seqlen_k, num_sms)
        kernel = "paged_decode_splitkv" if splits > 1 else "paged_decode"
    elif phase == "prefill" and not has_prefix:
        kernel = "flash_fwd"
    else:  # chunked prefill, prefill over a cached prefix, multi-token decode
        kernel = "paged_prefill"
    return KernelChoice(phase, "attention", kernel, splits, cost.intensity, rp, bound(cost.intensity, rp))


def plan_attention(
    phase: str,
    *,
    batch: int,
    seqlen_q: int,
    seqlen_k: int,
    nheads: int,
    nheads_k: int,
    head_dim: int,
    dtype: Any = "bfloat16",
    profile: HardwareProfile | None = None,
    has_prefix: bool = False,
) -> KernelChoice:
    """Choose the attention kernel and its split count for one step.

    Args:
        phase: ``"prefill"``, ``"decode"`` or ``"chunked_prefill"``.
        batch: sequences in the step.
        seqlen_q: new query tokens per sequence (the longest one, for a ragged batch).
        seqlen_k: keys per sequence including the new tokens (the longest one).
        nheads, nheads_k, head_dim: attention geometry (``nheads % nheads_k == 0``).
        dtype: activation / KV dtype (string or torch dtype).
        profile: hardware; default the H200 datasheet profile.
        has_prefix: some sequence has cached tokens before this step (prefill only).

    Raises:
        ValueError: naming the bad argument.
    """
    if phase not in PHASES:
        raise ValueError(f"phase: expected one of {', '.join(PHASES)}, got {phase!r}")
    prof = profile if profile is not None else _default_profile()
    key = normalize_dtype(dtype)
    if phase == "prefill" and seqlen_k != seqlen_q:
        has_prefix = True
    return _plan_attention_cached(
        phase,
        int(batch),
        int(seqlen_q),
        int(seqlen_k),
        int(nheads),
        int(nheads_k),
        int(head_dim),
        key,
        prof.peak(key),
        prof.hbm_bandwidth,
        prof.num_sms,
        bool(has_prefix),
    )


@dataclass(frozen=True)
class PlannedOp:
    """One row of a model plan: the decision, the op's cost and its roofline figures.

    Attributes:
        choice: the planner's decision (kernel, splits, intensity, ridge, bound).
        cost: FLOPs and bytes of one call, ``count`` calls per forward.
        attainable_flops: ``efficiency * min(peak, intensity * bandwidth)`` in FLOP/s.
        time_s: least seconds for all ``count`` calls at that rate.
        efficiency: the kernel's measured fraction of the roofline from the profile
            (:meth:`HardwareProfile.efficiency_of`; 1.0 = the bare roofline).
    """

    choice: KernelChoice
    cost: OpCost
    attainable_flops: float
    time_s: float
    efficiency: float = 1.0


def plan_model(
    shape: ModelShape,
    profile: HardwareProfile,
    *,
    batch: int = 8,
    seq: int = 4096,
    chunk: int = 512,
    dtype: Any = "bfloat16",
) -> list[PlannedOp]:
    """Every op of the three phases of ``shape`` on ``profile``, with kernel choices.

    A profile with measured ``efficiency`` (``flashpage bench all``'s ``probe-<gpu>.json``) scales
    each op's attainable rate and time by its kernel's measured fraction of the roofline.

    Phases: ``prefill`` of ``batch`` prompts of ``seq`` tokens; ``decode`` of one token for ``batch``
    sequences over ``seq`` cached tokens; ``chunked_prefill`` of ``chunk`` new tokens for ``batch``
    sequences after a cached prefix of ``seq`` tokens.
    """
    for name, v in (("batch", batch), ("seq", seq), ("chunk", chunk)):
        if int(v) != v or v < 1:
            raise ValueError(f"{name}: must be a positive int, got {v!r}")
    key = normalize_dtype(dtype)
    rp = profile.ridge(key)
    phases = (
        ("prefill", seq, seq, False),
        ("decode", 1, seq, True),
        ("chunked_prefill", chunk, seq + chunk, True),
    )
    rows: list[PlannedOp] = []
    for phase, sq, sk, has_prefix in phases:
        for cost in model_op_costs(shape, phase, batch=batch, seqlen_q=sq, seqlen_k=sk, dtype=key):
            if cost.op == "attention":
                choice = plan_attention(
                    phase,
                    batch=batch,
                    seqlen_q=sq,
                    seqlen_k=sk,
                    nheads=shape.heads,
                    nheads_k=shape.kv_heads,
                    head_dim=shape.head_dim,
                    dtype=key,
                    profile=profile,
                    has_prefix=has_prefix,
                )
            else:
                choice = KernelChoice(
                    phase, cost.op, "matmul", 1, cost.intensity, rp, bound(cost.intensity, rp)
                )
            eff = profile.efficiency_of(choice.kernel)
            rows.append(
                PlannedOp(
                    choice=choice,
                    cost=cost,
                    attainable_flops=eff * profile.attainable(cost.intensity, key),
                    time_s=cost.count * cost.time_s(profile, key) / eff,
                    efficiency=eff,
                )
            )
    return rows


def plan(
    shape: ModelShape,
    profile: HardwareProfile | None = None,
    *,
    batch: int = 8,
    seq: int = 4096,
    chunk: int = 512,
    dtype: Any = "bfloat16",
) -> dict[str, list[KernelChoice]]:
    """Per phase, the list of :class:`KernelChoice` for every op of ``shape`` (attention first).

    Same phases and arguments as :func:`plan_model`; ``profile`` defaults to the H200 datasheet profile.
    """
    prof = profile if profile is not None else _default_profile()
    out: dict[str, list[KernelChoice]] = {p: [] for p in PHASES}
    for row in plan_model(shape, prof, batch=batch, seq=seq, chunk=chunk, dtype=dtype):
        out[row.choice.phase].append(row.choice)
    return out
