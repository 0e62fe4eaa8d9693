"""Cache write (``reshape_and_cache``): scatter new tokens' K/V into their paged-cache slots.

Layout (see :mod:`flashpage.kv.layout`): per layer ``k_cache, v_cache (num_blocks, block_size, nheads_k, d)``;
the new tokens' ``key, value (T, nheads_k, d)`` go to flat slots ``slot_mapping (T,)`` int64, slot
``s`` being block ``s // block_size`` at offset ``s % block_size``; negative slots are skipped (padding
tokens of a CUDA-graph batch, or tokens whose KV is already cached).

fp8 KV storage: a ``torch.float8_e4m3fn`` cache stores ``round_e4m3(clamp(x / scale[h], -448, 448))``
with one float32 scale per KV head (``k_scale, v_scale (nheads_k,)``); readers multiply back by the
scale (the attention kernels fold it into the softmax scale and the output). Rounding is
round-to-nearest-even, so the stored value's relative error is at most ``2**-4`` (3 mantissa bits) for
``|x / scale| >= 2**-6`` and an absolute ``2**-10 * scale`` below that (subnormals).
:func:`fp8_kv_scales` computes per-head scales from sample data (``amax / 448``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from flashpage.ops.launch_cache import KERNEL_OPTIONS
from flashpage.ops.utils import next_pow2

__all__ = ["FP8_E4M3_MAX", "fp8_kv_scales", "is_fp8_dtype", "reshape_and_cache", "validate_scale"]

FP8_E4M3_MAX = 448.0
_FP8_DTYPES: tuple[torch.dtype, ...] = tuple(
    dt for dt in (getattr(torch, "float8_e4m3fn", None),) if dt is not None
)
_COMPUTE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def is_fp8_dtype(dtype: torch.dtype) -> bool:
    """True for the fp8 KV storage dtype flashpage supports (``torch.float8_e4m3fn``)."""
    return dtype in _FP8_DTYPES


@triton.jit
def round_to_e4m3(x):
    """Round float32 ``x`` (already within ``[-448, 448]``) to the nearest-even e4m3 value, in fp32.

    Done in float32 arithmetic so the final ``.to(tl.float8e4nv)`` is exact: the Triton interpreter's
    fp32->fp8 cast mis-rounds when the mantissa carries into the exponent, and doing it here makes
    GPU and interpreter bit-identical. e4m3 keeps 3 mantissa bits; below 2**-6 it is subnormal with a
    fixed quantum of 2**-9.
    """
    ax = tl.abs(x)
    bits = ax.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127
    e = tl.maximum(e, -6)
    quantum = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)
    inv_quantum = ((127 - (e - 3)) << 23).to(tl.float32, bitcast=True)
    # Exact (powers of two; no approximate fp32 division), so an FMA with the next add changes nothing.
    y = ax * inv_quantum  # y < 16
    y = (y + 12582912.0) - 12582912.0  # 1.5 * 2**23: round-to-nearest-even to an integer
    r = y * quantum
    # Rounded on |x|, then x's sign bit copied onto it, so tiny negatives and -0 round to -0. (Not
    # ``-r``: Triton lowers unary minus to ``0 - r``, which is +0 for r = 0 on a GPU.)
    sign = x.to(tl.int32, bitcast=True) & -2147483648
    return (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _reshape_and_cache_kernel(
    K,
    V,
    KC,
    VC,
    Slots,
    KScale,
    VScale,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kct,
    stride_kch,
    stride_vcb,
    stride_vct,
    stride_vch,
    block_size,
    HK: tl.constexpr,
    D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FP8: tl.constexpr,
):
    # One program per new token, all of its KV heads at once (hk * d contiguous elements).
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(Slots + t)
    if slot < 0:
        return
    blk = slot // block_size
    off = slot % block_size
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < HK) & (offs_d[None, :] < D)
    k = tl.load(K + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(V + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    if FP8:
        ks = tl.load(KScale + offs_h, mask=offs_h < HK, other=1.0)
        vs = tl.load(VScale + offs_h, mask=offs_h < HK, other=1.0)
        k = round_to_e4m3(tl.clamp(k.to(tl.float32) / ks[:, None], -448.0, 448.0))
        v = round_to_e4m3(tl.clamp(v.to(tl.float32) / vs[:, None], -448.0, 448.0))
    kc = KC + blk * stride_kcb + off * stride_kct + offs_h[:, None] * stride_kch + offs_d[None, :]
    vc = VC + blk * stride_vcb + off * stride_vct + offs_h[:, None] * stride_vch + offs_d[None, :]
    tl.store(kc, k.to(KC.dtype.element_ty), mask=mask)
    tl.store(vc, v.to(VC.dtype.element_ty), mask=mask)


def validate_scale(name: str, scale: Tensor | None, nheads_k: int, device: torch.device) -> None:
    """Check a per-KV-head fp8 scale: ``(nheads_k,)`` float32 on ``device`` (or ``None``)."""
    if scale is None:
        return
    if not isinstance(scale, Tensor):
        raise TypeError(f"{name} must be a float32 tensor of shape ({nheads_k},), got {type(scale).__name__}")
    if scale.dtype != torch.float32:
        raise TypeError(f"{name} must be float32, got {scale.dtype}")
    if tuple(scale.shape) != (nheads_k,):
        raise ValueError(
            f"{name} must have shape ({nheads_k},) (one scale per KV head), got {tuple(scale.shape)}"
        )
    if scale.device != device:
        raise ValueError(f"{name} is on {scale.device}, expected {device}")


def fp8_kv_scales(x: Tensor, margin: float = 1.0) -> Tensor:
    """Per-KV-head fp8 e4m3 scales for sample data ``x (..., nheads_k, d)``: ``margin * amax / 448``.

    Returns ``(nheads_k,)`` float32 (a head that is all zeros gets scale 1).
    """
    if x.dim() < 2:
        raise ValueError(f"x must be (..., nheads_k, d), got shape {tuple(x.shape)}")
    amax = x.detach().float().abs().movedim(-2, 0).reshape(x.shape[-2], -1).amax(dim=1)
    return torch.where(amax > 0, amax * margin / FP8_E4M3_MAX, torch.ones_like(amax)).contiguous()


def reshape_and_cache(
    key: Tensor,
    value: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    slot_mapping: Tensor,
    *,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
    validate: bool = True,
) -> None:
    """Write ``key/value (T, nheads_k, d)`` into ``key_cache/value_cache`` at ``slot_mapping``, in place.

    Args:
        key, value: ``(T, nheads_k, d)``, last dim contiguous, fp16/bf16/fp32.
        key_cache, value_cache: ``(num_blocks, block_size, nheads_k, d)``, last dim contiguous; the
            compute dtype of ``key`` or ``torch.float8_e4m3fn`` (quantised with the scales).
            Any ``block_size`` works here (a contiguous cache ``(batch, seqlen, nheads_k, d)`` is the
            same thing with ``block_size = seqlen``); the paged kernels need a power of two.
        slot_mapping: ``(T,)`` int64 flat slots; negative entries are skipped.
        k_scale, v_scale: ``(nheads_k,)`` float32 per-head scales, fp8 caches only (default 1).
        validate: also check on the host that every slot is inside the cache (one device sync);
            the engine's step passes ``False``.
    """
    _check_args(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)
    t, hk, d = key.shape
    if validate and t:
        hi = int(slot_mapping.max())
        if hi >= key_cache.shape[0] * key_cache.shape[1]:
            raise ValueError(
                f"slot_mapping holds slot {hi}, outside the cache's "
                f"{key_cache.shape[0]} x {key_cache.shape[1]} = {key_cache.shape[0] * key_cache.shape[1]} slots"
            )
    if t == 0:
        return
    fp8 = is_fp8_dtype(key_cache.dtype)
    if fp8 and k_scale is None:
        k_scale = torch.ones(hk, dtype=torch.float32, device=key.device)
    if fp8 and v_scale is None:
        v_scale = torch.ones(hk, dtype=torch.float32, device=key.device)
    _reshape_and_cache_kernel[(t,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        k_scale if fp8 else key,  # unused pointer when not fp8
        v_scale if fp8 else value,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        key_cache.shape[1],
        HK=hk,
        D=d,
        BLOCK_H=next_pow2(hk),
        BLOCK_D=next_pow2(d),
        FP8=fp8,
        num_warps=4,
        **KERNEL_OPTIONS,
    )


def _check_args(
    key: Tensor,
    value: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    slot_mapping: Tensor,
    k_scale: Tensor | None,
    v_scale: Tensor | None,
) -> None:
    """Shape/dtype/device checks of :func:`reshape_and_cache` (host metadata only, no device sync)."""
    for name, x, nd in (
        ("key", key, 3),
        ("value", value, 3),
        ("key_cache", key_cache, 4),
        ("value_cache", value_cache, 4),
    ):
        if not isinstance(x, Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(x).__name__}")
        if x.dim() != nd:
            raise ValueError(f"{name} must be {nd}-D, got shape {tuple(x.shape)}")
        if x.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension (stride {x.stride(-1)})")
        if x.device != key.device:
            raise ValueError(f"{name} is on {x.device}, expected {key.device} (key's device)")
    if key.shape != value.shape:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} must have the same shape")
    if key_cache.shape != value_cache.shape:
        raise ValueError(
            f"key_cache {tuple(key_cache.shape)} and value_cache {tuple(value_cache.shape)} must have the same shape"
        )
    if key.dtype not in _COMPUTE_DTYPES or value.dtype != key.dtype:
        raise TypeError(f"key/value must be fp16, bf16 or fp32 of one dtype, got {key.dtype}/{value.dtype}")
    if key_cache.dtype != value_cache.dtype:
        raise TypeError(
            f"key_cache ({key_cache.dtype}) and value_cache ({value_cache.dtype}) must share a dtype"
        )
    if key_cache.dtype != key.dtype and not is_fp8_dtype(key_cache.dtype):
        raise TypeError(
            f"key_cache dtype {key_cache.dtype} must be key's dtype {key.dtype} or torch.float8_e4m3fn"
        )
    if tuple(key.shape[1:]) != tuple(key_cache.shape[2:]):
        raise ValueError(
            f"key (T, nheads_k, d) = {tuple(key.shape)} does not match key_cache (num_blocks, block_size, "
            f"nheads_k, d) = {tuple(key_cache.shape)}"
        )
    if not isinstance(slot_mapping, Tensor) or slot_mapping.dtype != torch.int64:
        got = slot_mapping.dtype if isinstance(slot_mapping, Tensor) else type(slot_mapping).__name__
        raise TypeError(f"slot_mapping must be an int64 tensor, got {got}")
    if tuple(slot_mapping.shape) != (key.shape[0],):
        raise ValueError(f"slot_mapping must have shape ({key.shape[0]},), got {tuple(slot_mapping.shape)}")
    if slot_mapping.device != key.device or (slot_mapping.stride(0) != 1 and slot_mapping.numel() > 1):
        raise ValueError("slot_mapping must be a contiguous tensor on key's device")
    if (k_scale is not None or v_scale is not None) and not is_fp8_dtype(key_cache.dtype):
        raise ValueError("k_scale/v_scale apply to fp8 caches only")
    validate_scale("k_scale", k_scale, key.shape[1], key.device)
    validate_scale("v_scale", v_scale, key.shape[1], key.device)
