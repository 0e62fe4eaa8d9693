"""The one dispatch point between models and attention kernels.

A model's attention layer calls :func:`attention` with its projected q/k/v for the step's flattened
token batch, its layer's paged cache and the step's :class:`AttentionMetadata`. This module writes
the new K/V into the cache and runs the attention implementation chosen by ``FLASHPAGE_BACKEND``
(see :mod:`flashpage.ops.backend`) and by the roofline plan carried in the metadata.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from flashpage.ops.backend import resolve_backend
from flashpage.ops.cache_write import reshape_and_cache
from flashpage.ops.metadata import AttentionMetadata
from flashpage.ops.paged_plan import plan_decode, run_decode
from flashpage.ops.paged_prefill import paged_prefill

__all__ = ["attention", "store_kv", "torch_paged_attention"]


def store_kv(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """Write new tokens' K/V into the paged cache (pure PyTorch).

    Args:
        k, v: ``(T, nheads_k, d)``.
        k_cache, v_cache: ``(num_blocks, block_size, nheads_k, d)``.
        slot_mapping: ``(T,)`` int64 flat slots; negative entries are skipped.
    """
    hk, d = k_cache.shape[2], k_cache.shape[3]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_cache.view(-1, hk, d).index_copy_(0, slots, k[keep].to(k_cache.dtype))
    v_cache.view(-1, hk, d).index_copy_(0, slots, v[keep].to(v_cache.dtype))


def torch_paged_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    meta: AttentionMetadata,
    softmax_scale: float,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
) -> Tensor:
    """Batched PyTorch attention of the step's queries over the paged cache.

    Gathers every sequence's context into a padded ``(B, max_seqlen_k)`` tensor through the block
    table and runs one SDPA call with a mask that combines the bottom-right causal alignment, the
    sliding window and the per-sequence lengths.

    Args:
        q: ``(T, nheads, d)`` packed queries.
    Returns:
        ``(T, nheads, d)`` in q's dtype.
    """
    b = meta.num_seqs
    hk, d = k_cache.shape[2], k_cache.shape[3]
    h = q.shape[1]
    bs = k_cache.shape[1]
    max_q, max_k = meta.max_seqlen_q, meta.max_seqlen_k
    nblk = (max_k + bs - 1) // bs
    table = meta.block_table[:, :nblk].long()
    # .to(q.dtype): an fp8 cache (unit scales) is read back in the compute dtype.
    kk = k_cache[table].reshape(b, nblk * bs, hk, d)[:, :max_k].to(q.dtype)
    vv = v_cache[table].reshape(b, nblk * bs, hk, d)[:, :max_k].to(q.dtype)
    cu = meta.cu_seqlens_q.long()
    qlen = cu[1:] - cu[:-1]  # (B,)
    klen = meta.seqlens_k.long()
    # Scatter packed queries into a padded (B, max_q) layout: token t of sequence b sits at row
    # max_q - qlen[b] + t, so every sequence's last query is the last row (bottom-right alignment).
    tok = torch.arange(q.shape[0], device=q.device)
    seq_of_tok = torch.repeat_interleave(torch.arange(b, device=q.device), qlen)
    row = max_q - qlen[seq_of_tok] + (tok - cu[seq_of_tok])
    qp = q.new_zeros(b, max_q, h, d)
    qp[seq_of_tok, row] = q
    # Query row r of sequence b sits at key position klen[b] - max_q + r.
    pos_q = klen.view(b, 1, 1) - max_q + torch.arange(max_q, device=q.device).view(1, max_q, 1)
    j = torch.arange(max_k, device=q.device).view(1, 1, max_k)
    mask = (j < klen.view(b, 1, 1)) & (j <= pos_q + (window_size[1] if window_size[1] >= 0 else max_k))
    mask &= j <= pos_q  # causal: engine attention is always causal
    if window_size[0] >= 0:
        mask &= j >= pos_q - window_size[0]
    g = h // hk
    qt = qp.transpose(1, 2)  # (B, h, max_q, d)
    kt = kk.transpose(1, 2).repeat_interleave(g, dim=1)
    vt = vv.transpose(1, 2).repeat_interleave(g, dim=1)
    if softcap > 0:
        scores = torch.matmul(qt.float(), kt.float().transpose(-1, -2)) * softmax_scale
        scores = softcap * torch.tanh(scores / softcap)
        scores = scores.masked_fill(~mask.unsqueeze(1), float("-inf"))
        out = torch.matmul(torch.softmax(scores, dim=-1).nan_to_num(0.0), vt.float()).to(q.dtype)
    else:
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask.unsqueeze(1), scale=softmax_scale)
    out = out.transpose(1, 2)  # (B, max_q, h, d)
    return out[seq_of_tok, row]


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    meta: AttentionMetadata,
    softmax_scale: float,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
) -> Tensor:
    """Append the step's K/V to the paged cache, then attend.

    Args:
        q: ``(T, nheads, d)``; k, v: ``(T, nheads_k, d)`` for the step's new tokens.
        k_cache, v_cache: ``(num_blocks, block_size, nheads_k, d)``, written in place.
        meta: the step's metadata (same object for every layer).
    Returns:
        ``(T, nheads, d)`` attention output in q's dtype.
    """
    backend = resolve_backend(q.device)
    if backend == "torch":
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        return torch_paged_attention(q, k_cache, v_cache, meta, softmax_scale, window_size, softcap)
    return _triton_attention(q, k, v, k_cache, v_cache, meta, softmax_scale, window_size, softcap)


def _triton_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    meta: AttentionMetadata,
    softmax_scale: float,
    window_size: tuple[int, int],
    softcap: float,
) -> Tensor:
    """The Triton path: cache write, then decode / flash varlen / paged prefill. No device syncs.

    An fp8 e4m3 cache is written and read with unit per-head scales (the metadata carries none).
    """
    reshape_and_cache(k, v, k_cache, v_cache, meta.slot_mapping, validate=False)
    b, (h, d) = meta.num_seqs, q.shape[1:]
    if meta.decode_only:
        plan = plan_decode(
            b, h, k_cache.shape[2], d, block_size=k_cache.shape[1], max_seqlen_k=meta.max_seqlen_k,
            q_dtype=q.dtype, kv_dtype=k_cache.dtype, device=q.device, num_splits=meta.num_splits,
            softmax_scale=softmax_scale, causal=True, window_size=window_size, softcap=softcap,
        )  # fmt: skip
        return run_decode(plan, q, k_cache, v_cache, meta.block_table, meta.seqlens_k)
    if meta.prefix_free:
        flash_varlen = _flash_varlen_fwd()
        if flash_varlen is not None:
            out, _ = flash_varlen(
                q, k, v, meta.cu_seqlens_q, meta.cu_seqlens_q, meta.max_seqlen_q, meta.max_seqlen_q,
                softmax_scale, True, window_size, softcap, None, validate=False,
            )  # fmt: skip
            return out
    out = paged_prefill(
        q, k_cache, v_cache, meta.cu_seqlens_q, meta.seqlens_k, meta.block_table, meta.max_seqlen_q,
        softmax_scale=softmax_scale, causal=True, window_size=window_size, softcap=softcap,
        max_seqlen_k=meta.max_seqlen_k, validate=False,
    )  # fmt: skip
    assert isinstance(out, Tensor)
    return out


def _flash_varlen_fwd() -> Callable[..., tuple[Tensor, Tensor]] | None:
    """The FlashAttention varlen forward (``flashpage.ops.flash_attn``), or ``None`` if not there yet."""
    try:
        from flashpage.ops.flash_attn import flash_attn_varlen_fwd
    except ImportError:
        return None
    return flash_attn_varlen_fwd
