"""Per-block attention math of sequence-parallel attention: masks from global positions, one block's
forward / backward on flashpage's kernels, and the fp32 log-sum-exp merge of partial outputs.

A ring step attends a run of local queries at global positions ``[q0, q0 + n_q)`` to a run of keys
at ``[k0, k0 + n_k)``. The attention mask is defined on global positions: key ``pk`` is visible to
query ``pq`` iff ``pq - left <= pk <= pq + right`` (``-1`` = unbounded; causal is ``right = 0``).
flashpage's kernels (like flash-attn's) only know a mask aligned to the bottom-right corner of the
block, so :func:`plan_block` rewrites the global band as an exact local call: it drops query rows
that see no key and keys no query sees, which makes the remaining rows and keys end so close to each
other that the band becomes a non-negative local window ``(left - e, right + e)``, where
``e = (last query position) - (last key position)``. Full blocks get ``(-1, -1)``, blocks entirely
above the diagonal or outside the window are skipped. The same rewrite serves the Triton kernels (on
GPU) and the PyTorch reference path (on CPU): no masked fallback is needed.

Partial outputs are kept and merged in float32 (ring-flash-attention's users saw backward errors
grow with the world size when partials were kept in bf16); the backward of every block uses the
final merged ``out`` and ``lse``, so ``P = exp(S - lse)`` is the global softmax and the per-block
gradients add up exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from flashpage.ops.backend import resolve_backend
from flashpage.ops.flash_bwd import flash_bwd
from flashpage.ops.flash_fwd import flash_fwd
from flashpage.ops.reference import attention_ref, visible_mask

__all__ = ["Block", "block_backward", "block_forward", "merge_partial", "plan_block"]


@dataclass(frozen=True)
class Block:
    """One exact local attention call: query rows ``[q_lo, q_hi)`` and keys ``[k_lo, k_hi)`` of the
    local/received tensors (offsets within their sequence dim) with a bottom-right aligned window."""

    q_lo: int
    q_hi: int
    k_lo: int
    k_hi: int
    window: tuple[int, int]


def plan_block(
    q_pos: int, n_q: int, k_pos: int, n_k: int, causal: bool, window_size: tuple[int, int]
) -> Block | None:
    """The local call that attends queries at global ``[q_pos, q_pos + n_q)`` to keys at
    ``[k_pos, k_pos + n_k)`` under the global ``causal`` / ``window_size`` mask, or None when no query
    sees any key. Offsets in the returned :class:`Block` are relative to the two runs' starts."""
    left, right = int(window_size[0]), int(window_size[1])
    if causal:
        right = 0
    if n_q <= 0 or n_k <= 0:
        return None
    k_end = k_pos + n_k - 1  # last key position
    # Row pq sees [max(k_pos, pq - left), min(k_end, pq + right)]; both ends grow with pq, so the
    # rows that see something are one contiguous run.
    lo_row = q_pos if right < 0 else max(q_pos, k_pos - right)
    hi_row = q_pos + n_q - 1 if left < 0 else min(q_pos + n_q - 1, k_end + left)
    if lo_row > hi_row:
        return None
    first_key = k_pos if left < 0 else max(k_pos, lo_row - left)
    last_key = k_end if right < 0 else min(k_end, hi_row + right)
    if first_key > last_key:
        return None
    sq, sk = hi_row - lo_row + 1, last_key - first_key + 1
    e = hi_row - last_key
    wl = -1 if left < 0 else left - e
    wr = -1 if right < 0 else right + e
    if wl >= sk - 1:  # the last row's left edge still reaches key 0, so every row's does
        wl = -1
    if wr >= sq - 1:  # the first row's right edge reaches the last key, so every row's does
        wr = -1
    return Block(lo_row - q_pos, hi_row - q_pos + 1, first_key - k_pos, last_key - k_pos + 1, (wl, wr))


def merge_partial(out: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor) -> None:
    """Merge a block's partial result into the running one, in place, in float32.

    Args:
        out: float32 ``(batch, n, nheads, d)`` running output (zeros where ``lse`` is ``-inf``).
        lse: float32 ``(batch, nheads, n)`` running log-sum-exp.
        block_out: ``(batch, n, nheads, d)`` (any float dtype; upcast here).
        block_lse: float32 ``(batch, nheads, n)``.
    """
    m = torch.maximum(lse, block_lse)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    wa, wb = torch.exp(lse - m), torch.exp(block_lse - m)
    total = wa + wb
    denom = torch.where(total > 0, total, torch.ones_like(total))
    fa = (wa / denom).transpose(1, 2).unsqueeze(-1)
    fb = (wb / denom).transpose(1, 2).unsqueeze(-1)
    out.mul_(fa).add_(block_out.float() * fb)
    lse.copy_(m + torch.log(total))


def _keep_mask(seed: int, shape: tuple[int, ...], p: float, device: torch.device) -> Tensor:
    """The torch path's dropout keep-mask of one block, a pure function of ``seed`` (forward and
    backward draw the same one)."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return torch.rand(shape, generator=gen, device=device) >= p


def block_forward(
    q: Tensor, k: Tensor, v: Tensor, scale: float, window: tuple[int, int], dropout_p: float, seed: int
) -> tuple[Tensor, Tensor]:
    """One block's ``(out, lse)``: ``out`` like q (float32 on the torch path), ``lse`` float32
    ``(batch, nheads, n_q)``; the mask is ``window`` bottom-right aligned (see :func:`plan_block`)."""
    if resolve_backend(q.device) == "triton":
        return flash_fwd(q, k, v, softmax_scale=scale, window_size=window, dropout_p=dropout_p, seed=seed)
    b, sq, h, _ = q.shape
    keep = _keep_mask(seed, (b, h, sq, k.shape[1]), dropout_p, q.device) if dropout_p > 0 else None
    out, lse = attention_ref(
        q, k, v, softmax_scale=scale, window_size=window, dropout_p=dropout_p, dropout_mask=keep
    )[:2]
    return out, lse


def block_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    scale: float,
    window: tuple[int, int],
    dropout_p: float,
    seed: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of one block given the *final* ``out`` / ``lse`` of its query rows.

    Returns ``dq`` (like q), ``dk``, ``dv`` (like k/v, GQA summed over each KV head's query heads);
    float32 on the torch path, q's dtype on the Triton path.
    """
    if resolve_backend(q.device) == "triton":
        return flash_bwd(
            dout, q, k, v, out.to(q.dtype), lse.contiguous(), softmax_scale=scale, window_size=window,
            dropout_p=dropout_p, seed=seed,
        )  # fmt: skip
    b, sq, h, _ = q.shape
    sk, hk = k.shape[1], k.shape[2]
    g = h // hk
    qf, kf, vf = q.float(), k.float().repeat_interleave(g, dim=2), v.float().repeat_interleave(g, dim=2)
    do, of = dout.float(), out.float()
    mask = visible_mask(sq, sk, False, window, device=q.device)
    scores = torch.einsum("bqhd,bkhd->bhqk", qf, kf) * scale
    live = mask & torch.isfinite(lse).unsqueeze(-1)
    p = torch.where(live, torch.exp(scores - lse.unsqueeze(-1)), torch.zeros_like(scores))
    dp = torch.einsum("bqhd,bkhd->bhqk", do, vf)
    if dropout_p > 0:
        keep = _keep_mask(seed, (b, h, sq, sk), dropout_p, q.device)
        z = keep.float() / (1.0 - dropout_p)
        dv = torch.einsum("bhqk,bqhd->bkhd", p * z, do)
        dp = dp * z
    else:
        dv = torch.einsum("bhqk,bqhd->bkhd", p, do)
    delta = (do * of).sum(-1).transpose(1, 2).unsqueeze(-1)  # (b, h, sq, 1)
    ds = p * (dp - delta)
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, kf) * scale
    dk = torch.einsum("bhqk,bqhd->bkhd", ds, qf) * scale
    if g > 1:
        dk = dk.view(b, sk, hk, g, -1).sum(3)
        dv = dv.view(b, sk, hk, g, -1).sum(3)
    return dq, dk, dv


def default_scale(q: Tensor, softmax_scale: float | None) -> float:
    """``softmax_scale`` or ``d ** -0.5`` (flash-attn's default)."""
    return float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
