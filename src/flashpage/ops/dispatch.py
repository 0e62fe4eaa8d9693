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
from flashpage.ops.metadata import AttentionMetadata, TorchStepIndices
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


def _torch_step_indices(
    meta: AttentionMetadata, num_tokens: int, block_size: int, window_left: int
) -> TorchStepIndices:
    """Index tensors of the torch path that depend only on the step (kept on ``meta.torch_indices``
    for the other layers of the forward)."""
    hit = meta.torch_indices
    if hit is not None and hit.block_size == block_size and hit.window_left == window_left:
        return hit
    b, dev = meta.num_seqs, meta.seqlens_k.device
    max_q, max_k = meta.max_seqlen_q, meta.max_seqlen_k
    nblk = (max_k + block_size - 1) // block_size
    cu = meta.cu_seqlens_q.long()
    qlen = cu[1:] - cu[:-1]  # (B,)
    klen = meta.seqlens_k.long()
    # Token t of sequence b sits at padded row max_q - qlen[b] + t, so every sequence's last query is
    # the last row (bottom-right alignment); query row r sits at key position klen[b] - max_q + r.
    tok = torch.arange(num_tokens, device=dev)
    if max_q == 1:
        seq, row = tok, torch.zeros_like(tok)
    else:
        seq = torch.repeat_interleave(torch.arange(b, device=dev), qlen)
        row = max_q - qlen[seq] + (tok - cu[seq])
    pos_q = klen.view(b, 1, 1) - max_q + torch.arange(max_q, device=dev).view(1, max_q, 1)
    j = torch.arange(max_k, device=dev).view(1, 1, max_k)
    mask = (j < klen.view(b, 1, 1)) & (j <= pos_q)  # engine attention is always causal
    if window_left >= 0:
        mask &= j >= pos_q - window_left
    out = TorchStepIndices(block_size, window_left, meta.block_table[:, :nblk].long(), seq, row, mask)
    meta.torch_indices = out
    return out


def torch_paged_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    meta: AttentionMetadata,
    softmax_scale: float,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
) -> Tensor:
    """Batched PyTorch attention of the step's queries over the paged cache (causal).

    Gathers every sequence's context into a padded ``(B, max_seqlen_k)`` tensor through the block
    table and runs one SDPA call with a mask that combines the bottom-right causal alignment, the
    left window and the per-sequence lengths. GQA folds the ``nheads / nheads_k`` query heads of a
    group into the query rows, so K/V are never repeated per query head.

    Args:
        q: ``(T, nheads, d)`` packed queries.
    Returns:
        ``(T, nheads, d)`` in q's dtype.
    """
    b = meta.num_seqs
    hk, d = k_cache.shape[2], k_cache.shape[3]
    h = q.shape[1]
    g = h // hk
    max_q, max_k = meta.max_seqlen_q, meta.max_seqlen_k
    ix = _torch_step_indices(meta, q.shape[0], k_cache.shape[1], window_size[0])
    table, seq, row, mask = ix.table, ix.seq, ix.row, ix.mask
    nblk = table.shape[1]
    # .to(q.dtype): an fp8 cache (unit scales) is read back in the compute dtype.
    kk = k_cache[table].view(b, nblk * k_cache.shape[1], hk, d)[:, :max_k].to(q.dtype).transpose(1, 2)
    vv = v_cache[table].view(b, nblk * v_cache.shape[1], hk, d)[:, :max_k].to(q.dtype).transpose(1, 2)
    if max_q == 1:
        qp = q.view(b, 1, h, d)
    else:
        qp = q.new_zeros(b, max_q, h, d)
        qp[seq, row] = q
    # (B, max_q, hk, g, d) -> (B, hk, g * max_q, d): query rows of a group share their KV head.
    qt = qp.view(b, max_q, hk, g, d).permute(0, 2, 3, 1, 4).reshape(b, hk, g * max_q, d)
    m = mask.unsqueeze(1).expand(b, g, max_q, max_k).reshape(b, 1, g * max_q, max_k)
    if softcap > 0:
        scores = torch.matmul(qt.float(), kk.float().transpose(-1, -2)) * softmax_scale
        scores = softcap * torch.tanh(scores / softcap)
        scores = scores.masked_fill(~m, float("-inf"))
        out = torch.matmul(torch.softmax(scores, dim=-1).nan_to_num(0.0), vv.float()).to(q.dtype)
    else:
        out = F.scaled_dot_product_attention(qt, kk, vv, attn_mask=m, scale=softmax_scale)
    out = out.view(b, hk, g, max_q, d).permute(0, 3, 1, 2, 4).reshape(b, max_q, h, d)
    return out[seq, row]


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
        # One plan per step, shared by the layers: the split workspace is allocated once, and the
        # layers after the first relaunch the launch the first one bound.
        plan = meta.decode_plan
        if plan is None:
            plan = meta.decode_plan = plan_decode(
                b, h, k_cache.shape[2], d, block_size=k_cache.shape[1], max_seqlen_k=meta.max_seqlen_k,
                q_dtype=q.dtype, kv_dtype=k_cache.dtype, device=q.device, num_splits=meta.num_splits,
                softmax_scale=softmax_scale, causal=True, window_size=window_size, softcap=softcap,
            )  # fmt: skip
        return run_decode(
            plan, q, k_cache, v_cache, meta.block_table, meta.seqlens_k,
            softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
        )  # fmt: skip
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
