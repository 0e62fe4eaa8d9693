"""Pure-PyTorch reference attention: the definition every flashpage kernel is tested against.

Everything here is computed in float32 (``upcast=True``, the default) or in the inputs' own dtype
(``upcast=False``, used by tests as the "same-precision PyTorch" error baseline of flash-attn's
tolerance rule). Nothing here is fast; everything here is obviously right.

Semantics (flash-attn 2.x, see DESIGN.md "Attention functions"):

* Layout ``q (batch, seqlen_q, nheads, d)``, ``k/v (batch, seqlen_k, nheads_k, d)``; query head ``h``
  reads kv head ``h // (nheads // nheads_k)`` (GQA / MQA).
* ``scores = softmax_scale * q @ k^T`` (scale defaults to ``d ** -0.5``).
* softcap ``c > 0``: ``scores = c * tanh(scores / c)``, applied before ALiBi and the mask.
* ALiBi: ``scores += -slope[h] * |i + seqlen_k - seqlen_q - j|``; slopes ``(nheads,)`` or
  ``(batch, nheads)`` float32.
* Masks are aligned to the bottom-right corner: query ``i`` sits at key position
  ``i + seqlen_k - seqlen_q``. Causal: key ``j`` visible iff ``j <= i + seqlen_k - seqlen_q``.
  Sliding window ``(left, right)`` (``-1`` = unbounded): visible iff
  ``i + sk - sq - left <= j <= i + sk - sq + right``. Causal is window ``(left, 0)``.
* A query row with no visible key outputs zeros and has ``lse = -inf``.
* Dropout: ``P' = P * keep / (1 - p)`` with a given boolean ``keep`` mask ``(batch, nheads, sq, sk)``;
  ``lse`` is the log-sum-exp of the (capped, biased, masked) scores, before dropout, natural log.
* Varlen: packed ``(total, nheads, d)`` tensors with ``cu_seqlens`` int32 ``(batch + 1,)``; each
  sequence is an independent attention problem with its own bottom-right alignment.
* Paged KV: cache ``(num_blocks, block_size, nheads_k, d)``, ``block_table (batch, max_blocks)``
  int32, ``cache_seqlens (batch,)``; token ``t`` of sequence ``b`` lives at
  ``cache[block_table[b, t // block_size], t % block_size]``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = [
    "attention_ref",
    "gather_paged_kv",
    "paged_attention_ref",
    "varlen_attention_ref",
    "visible_mask",
]


def visible_mask(
    seqlen_q: int,
    seqlen_k: int,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    device: torch.device | str | None = None,
) -> Tensor:
    """Boolean ``(seqlen_q, seqlen_k)`` mask, True where query ``i`` may attend key ``j``.

    Bottom-right aligned: query ``i`` is at key position ``i + seqlen_k - seqlen_q``.
    """
    left, right = window_size
    if causal:
        right = 0
    i = torch.arange(seqlen_q, device=device).unsqueeze(1) + (seqlen_k - seqlen_q)
    j = torch.arange(seqlen_k, device=device).unsqueeze(0)
    mask = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if right >= 0:
        mask &= j <= i + right
    if left >= 0:
        mask &= j >= i - left
    return mask


def attention_ref(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
    dropout_p: float = 0.0,
    dropout_mask: Tensor | None = None,
    upcast: bool = True,
    return_probs: bool = False,
) -> tuple[Tensor, Tensor] | tuple[Tensor, Tensor, Tensor]:
    """Reference attention on padded batches.

    Args:
        q: ``(batch, seqlen_q, nheads, d)``.
        k, v: ``(batch, seqlen_k, nheads_k, d)``; ``nheads % nheads_k == 0``.
        dropout_mask: boolean keep-mask ``(batch, nheads, seqlen_q, seqlen_k)``, used when
            ``dropout_p > 0``.
        upcast: compute in float32 (True) or in the inputs' dtype (False).
        return_probs: also return the attention probabilities (after dropout, before scaling
            by ``1/(1-p)``), ``(batch, nheads, seqlen_q, seqlen_k)``.

    Returns:
        ``out (batch, seqlen_q, nheads, d)`` in q's dtype (float32 if ``upcast``),
        ``lse (batch, nheads, seqlen_q)`` float32 (natural log, ``-inf`` for empty rows)
        [, ``probs``].
    """
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("attention_ref expects 4-D q, k, v (batch, seqlen, nheads, d)")
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    if h % hk != 0:
        raise ValueError(f"nheads ({h}) must be divisible by nheads_k ({hk})")
    dtype_out = torch.float32 if upcast else q.dtype
    if upcast:
        q, k, v = q.float(), k.float(), v.float()
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    g = h // hk
    k = k.repeat_interleave(g, dim=2)
    v = v.repeat_interleave(g, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    if alibi_slopes is not None:
        slopes = alibi_slopes.float().to(scores.device)
        slopes = slopes.view(1, h, 1, 1) if slopes.dim() == 1 else slopes.view(b, h, 1, 1)
        i = torch.arange(sq, device=q.device).view(sq, 1) + (sk - sq)
        j = torch.arange(sk, device=q.device).view(1, sk)
        scores = scores + (-slopes * (i - j).abs().float()).to(scores.dtype)
    mask = visible_mask(sq, sk, causal, window_size, device=q.device)
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores.float(), dim=-1)  # (b, h, sq)
    empty = ~mask.any(dim=-1)  # (sq,)
    probs = torch.softmax(scores, dim=-1)
    probs = probs.masked_fill(empty.view(1, 1, sq, 1), 0.0)
    if dropout_p > 0.0:
        if dropout_mask is None:
            raise ValueError("attention_ref with dropout_p > 0 needs dropout_mask")
        probs_kept = probs.masked_fill(~dropout_mask, 0.0)
        out = torch.einsum("bhqk,bkhd->bqhd", probs_kept / (1.0 - dropout_p), v)
    else:
        probs_kept = probs
        out = torch.einsum("bhqk,bkhd->bqhd", probs, v)
    out = out.to(dtype_out)
    if return_probs:
        return out, lse, probs_kept
    return out, lse


def varlen_attention_ref(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    **kwargs: object,
) -> tuple[Tensor, Tensor]:
    """Reference attention on packed variable-length batches.

    Args:
        q: ``(total_q, nheads, d)``; k, v: ``(total_k, nheads_k, d)``.
        cu_seqlens_q, cu_seqlens_k: ``(batch + 1,)`` int32 prefix sums of the sequence lengths.
        kwargs: as :func:`attention_ref`; a ``(batch, nheads)`` ``alibi_slopes`` is indexed per
            sequence; a ``dropout_mask`` must be a list of per-sequence ``(nheads, sq, sk)`` masks.

    Returns:
        ``out (total_q, nheads, d)`` and ``lse (nheads, total_q)`` float32 (flash-attn varlen layout).
    """
    cq = cu_seqlens_q.tolist()
    ck = cu_seqlens_k.tolist()
    h = q.shape[1]
    upcast = bool(kwargs.get("upcast", True))
    out = torch.zeros(q.shape, dtype=torch.float32 if upcast else q.dtype, device=q.device)
    lse = torch.full((h, q.shape[0]), float("-inf"), dtype=torch.float32, device=q.device)
    alibi = kwargs.pop("alibi_slopes", None)
    masks = kwargs.pop("dropout_mask", None)
    for i in range(len(cq) - 1):
        qs, ks = slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])
        if cq[i + 1] == cq[i]:
            continue
        a = alibi
        if isinstance(alibi, Tensor) and alibi.dim() == 2:
            a = alibi[i]
        m = masks[i].unsqueeze(0) if masks is not None else None  # type: ignore[index]
        o_i, l_i = attention_ref(
            q[qs].unsqueeze(0),
            k[ks].unsqueeze(0),
            v[ks].unsqueeze(0),
            alibi_slopes=a,
            dropout_mask=m,
            **kwargs,  # type: ignore[arg-type]
        )[:2]
        out[qs] = o_i[0]
        lse[:, qs] = l_i[0]
    return out, lse


def gather_paged_kv(cache: Tensor, block_table: Tensor, seqlen: int, batch_index: int) -> Tensor:
    """Contiguous ``(seqlen, nheads_k, d)`` view of one sequence's tokens in a paged cache.

    Args:
        cache: ``(num_blocks, block_size, nheads_k, d)``.
        block_table: ``(batch, max_blocks_per_seq)`` int32.
    """
    bs = cache.shape[1]
    nblk = (seqlen + bs - 1) // bs
    blocks = block_table[batch_index, :nblk].long()
    return cache[blocks].reshape(nblk * bs, *cache.shape[2:])[:seqlen]


def paged_attention_ref(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_table: Tensor,
    cache_seqlens: Tensor,
    **kwargs: object,
) -> tuple[Tensor, Tensor]:
    """Reference attention of ``q (batch, seqlen_q, nheads, d)`` over a paged KV cache.

    Sequence ``b`` attends to its first ``cache_seqlens[b]`` cached tokens (which already include
    the new tokens, as in flash-attn's ``flash_attn_with_kvcache`` after appending), bottom-right
    aligned. Returns ``out (batch, seqlen_q, nheads, d)`` and ``lse (batch, nheads, seqlen_q)``.
    """
    b, sq, h, _ = q.shape
    upcast = bool(kwargs.get("upcast", True))
    out = torch.zeros(q.shape, dtype=torch.float32 if upcast else q.dtype, device=q.device)
    lse = torch.full((b, h, sq), float("-inf"), dtype=torch.float32, device=q.device)
    alibi = kwargs.pop("alibi_slopes", None)
    for i, n in enumerate(cache_seqlens.tolist()):
        kk = gather_paged_kv(k_cache, block_table, n, i).unsqueeze(0)
        vv = gather_paged_kv(v_cache, block_table, n, i).unsqueeze(0)
        a = alibi[i] if isinstance(alibi, Tensor) and alibi.dim() == 2 else alibi
        o_i, l_i = attention_ref(q[i : i + 1], kk, vv, alibi_slopes=a, **kwargs)[:2]  # type: ignore[arg-type]
        out[i] = o_i[0]
        lse[i] = l_i[0]
    return out, lse
