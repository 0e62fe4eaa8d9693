"""flash-attn's tolerance rule, shared by every kernel test.

A kernel's error against the float32 reference must be at most ``mult`` (2) times the error of the
same computation done by PyTorch in the kernel's own precision, plus a small absolute slack that
covers reductions done in a different order (the interpreter, split-KV combines).
"""

from __future__ import annotations

import torch
from torch import Tensor

# Absolute slack per dtype: float32 covers summation-order differences only.
_SLACK = {torch.float32: 2e-5, torch.float16: 1e-3, torch.bfloat16: 4e-3}


def max_abs_err(a: Tensor, b: Tensor) -> float:
    """Largest absolute difference, NaN-aware (a NaN anywhere counts as infinite error)."""
    diff = (a.float() - b.float()).abs()
    if torch.isnan(diff).any():
        return float("inf")
    return float(diff.max()) if diff.numel() else 0.0


def assert_close_to_ref(
    out: Tensor,
    ref_fp32: Tensor,
    same_precision_torch: Tensor,
    *,
    mult: float = 2.0,
    atol: float | None = None,
    name: str = "out",
) -> None:
    """Assert ``|out - ref| <= mult * |torch_same_precision - ref| + atol`` (max norms).

    Args:
        out: the kernel's result.
        ref_fp32: the float32 reference (``flashpage.ops.reference`` with ``upcast=True``).
        same_precision_torch: the reference computed in the kernel's dtype (``upcast=False``).
        atol: absolute slack; defaults by ``out.dtype``.
    """
    assert out.shape == ref_fp32.shape, f"{name}: shape {tuple(out.shape)} != {tuple(ref_fp32.shape)}"
    slack = _SLACK.get(out.dtype, 1e-3) if atol is None else atol
    err = max_abs_err(out, ref_fp32)
    base = max_abs_err(same_precision_torch, ref_fp32)
    bound = mult * base + slack
    assert err <= bound, f"{name}: max error {err:.3e} > {mult} x torch error {base:.3e} + {slack:.1e}"
