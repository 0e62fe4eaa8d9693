"""``flashpage.flash_attn_with_kvcache``: flash-attn 2.x's KV-cache attention on the Triton kernels.

Backends (``FLASHPAGE_BACKEND``): ``triton`` runs the cache-write and paged-attention kernels;
``torch`` (``auto``'s choice for CPU tensors) writes the cache with indexing and attends through the
float32 reference one sequence at a time (host reads of the lengths; meant for CPU and tests). Both
take the same inputs and give the same cache, ``out`` and ``lse``. Like flash-attn's, the function
is forward only (no autograd graph).

Same signature, layouts and semantics as ``flash_attn.flash_attn_with_kvcache`` (DESIGN.md), with
paged caches of any power-of-two block size from 8 to 256:

* contiguous cache ``(batch_cache, seqlen_cache, nheads_k, d)`` (rows picked by ``cache_batch_idx``),
  or paged cache ``(num_blocks, block_size, nheads_k, d)`` with ``block_table (batch, max_blocks)``;
* new ``k``/``v`` ``(batch, seqlen_new, nheads_k, d)`` are written in place at positions
  ``cache_seqlens[b] ..`` (the cache-write kernel), then ``q`` attends to the first
  ``cache_seqlens[b] + seqlen_new`` keys, bottom-right aligned;
* rotary (``rotary_cos/sin (seqlen_ro, rotary_dim / 2)``) rotates ``k`` at positions
  ``cache_seqlens + arange(seqlen_new)`` and ``q`` at ``cache_seqlens + arange(seqlen_q)`` when causal
  or local, else all of ``q`` at ``cache_seqlens``; interleaved (GPT-J) or not (GPT-NeoX);
* ``num_splits=0`` lets the roofline planner choose the split-KV count (from the cache capacity, so
  no device sync); ``return_softmax_lse`` adds ``lse (batch, nheads, seqlen_q)``.

Extensions (keyword-only): ``cache_leftpad (batch,)`` int32, flash-attn >= 2.6's first valid cache
slot of each sequence (keys before it are hidden; positions, for the masks, ALiBi and rotary, stay
cache slots), on paged caches too, where flash-attn takes it only with contiguous ones; an fp8 e4m3
cache is read with unit scales, or ``k_scale/v_scale (nheads_k,)`` when given (new k/v are quantised
with them); ``validate=False`` skips the host-side value checks (block ids, lengths), which need a
device sync.

Under ``torch.compile`` the call traces whole (``fullgraph=True``): the cache write and the attention
run as the custom ops ``flashpage::reshape_and_cache`` (mutates ``k_cache``/``v_cache``) and
``flashpage::kvcache_attention``, the rotary embedding and slot arithmetic as plain torch ops, and the
value checks are skipped (as ``validate=False``), since they read the device.
"""

from __future__ import annotations

import torch
from torch import Tensor

from flashpage.ops.backend import resolve_backend
from flashpage.ops.cache_write import FP8_E4M3_MAX, is_fp8_dtype, reshape_and_cache
from flashpage.ops.flash_args import flash_attn_errors, window_pair
from flashpage.ops.paged_launch import PagedProblem, check_paged_cache, check_paged_values, eager_launcher
from flashpage.ops.paged_plan import choose_launch
from flashpage.ops.paged_prefill import kv_attention_config
from flashpage.ops.reference import attention_ref, gather_paged_kv
from flashpage.ops.utils import default_num_sms

__all__ = ["apply_rotary", "flash_attn_with_kvcache"]


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor, positions: Tensor, interleaved: bool) -> Tensor:
    """Rotary embedding of ``x (batch, seqlen, nheads, d)`` at ``positions (batch, seqlen)``.

    ``cos/sin (seqlen_ro, rotary_dim / 2)``; only the first ``rotary_dim`` features rotate. Computed
    in float32, returned in ``x``'s dtype. Interleaved pairs features ``(2i, 2i+1)``; otherwise
    ``(i, i + rotary_dim / 2)``.
    """
    half = cos.shape[1]
    rd = 2 * half
    c = cos.float()[positions].unsqueeze(2)  # (b, s, 1, half)
    s = sin.float()[positions].unsqueeze(2)
    xr = x[..., :rd].float()
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        rot = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)
    else:
        x1, x2 = xr[..., :half], xr[..., half:]
        rot = torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)
    return torch.cat((rot.to(x.dtype), x[..., rd:]), dim=-1)


def _check_per_sequence(name: str, x: object, batch: int, device: torch.device) -> None:
    """``x`` must be a contiguous ``(batch,)`` int32 tensor on ``device`` (the kernel reads
    element ``b`` at offset ``b``, as it does ``cache_seqlens``)."""
    if not isinstance(x, Tensor) or x.dtype != torch.int32:
        raise TypeError(f"{name} must be an int32 tensor")
    if tuple(x.shape) != (batch,) or x.device != device:
        raise ValueError(f"{name} must be ({batch},) on q's device, got {tuple(x.shape)} on {x.device}")
    if batch > 1 and x.stride(0) != 1:
        raise ValueError(f"{name} must be contiguous, got stride {x.stride(0)}")


@flash_attn_errors
def flash_attn_with_kvcache(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    k: Tensor | None = None,
    v: Tensor | None = None,
    rotary_cos: Tensor | None = None,
    rotary_sin: Tensor | None = None,
    cache_seqlens: Tensor | int | None = None,
    cache_batch_idx: Tensor | None = None,
    block_table: Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes: Tensor | None = None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
    *,
    cache_leftpad: Tensor | None = None,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
    validate: bool = True,
) -> Tensor | tuple[Tensor, Tensor]:
    """Attention of ``q`` over a KV cache, appending new ``k``/``v`` first (flash-attn 2.x contract).

    Args:
        q: ``(batch, seqlen_q, nheads, d)``.
        k_cache, v_cache: ``(batch_cache, seqlen_cache, nheads_k, d)`` or, with ``block_table``,
            ``(num_blocks, block_size, nheads_k, d)``; updated in place when ``k``/``v`` are given.
        k, v: optional ``(batch, seqlen_new, nheads_k, d)`` new tokens.
        rotary_cos, rotary_sin: optional ``(seqlen_ro, rotary_dim / 2)``; needs ``k``/``v``.
        cache_seqlens: ``(batch,)`` int32 or an int: tokens already in the cache (default: full).
        cache_batch_idx: ``(batch,)`` int32 cache rows of a contiguous cache.
        block_table: ``(batch, max_blocks_per_seq)`` int32 for a paged cache.
        window_size: ``(left, right)``, ``-1`` unbounded; causal is ``right = 0``.
        alibi_slopes: ``(nheads,)`` or ``(batch, nheads)`` float32.
        num_splits: split-KV count, ``0`` = roofline planner.
        cache_leftpad: optional ``(batch,)`` int32, keyword-only: sequence ``b``'s keys are cache
            slots ``[cache_leftpad[b], cache_seqlens[b] + seqlen_new)`` (left padding skipped); the
            causal/window alignment, ALiBi distances and rotary positions are unchanged (they count
            cache slots), as in flash-attn.
    Returns:
        ``out (batch, seqlen_q, nheads, d)``; with ``return_softmax_lse`` also
        ``softmax_lse (batch, nheads, seqlen_q)`` float32 (natural log).

    Raises:
        FlashAttnError: a bad argument (a ``RuntimeError`` and a ``ValueError``, naming it).
    """
    window_size = window_pair(window_size)
    if not isinstance(q, Tensor) or q.dim() != 4:
        raise ValueError(f"q must be (batch, seqlen_q, nheads, d), got {getattr(q, 'shape', q)}")
    on_torch = resolve_backend(q.device) == "torch"
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 0:
        raise ValueError(f"num_splits must be an int >= 0 (0 = planner), got {num_splits!r}")
    batch, seqlen_q, _, d = q.shape
    paged = block_table is not None
    if not isinstance(k_cache, Tensor) or k_cache.dim() != 4:
        raise ValueError(f"k_cache must be a 4-D tensor, got {getattr(k_cache, 'shape', k_cache)}")
    capacity = (
        block_table.shape[1] * k_cache.shape[1]
        if paged and isinstance(block_table, Tensor)
        else k_cache.shape[1]
    )
    if cache_seqlens is None:  # flash-attn: the whole cache is valid
        cache_seqlens = capacity
    if isinstance(cache_seqlens, int):
        cache_seqlens = torch.full((batch,), cache_seqlens, dtype=torch.int32, device=q.device)
    if paged and cache_batch_idx is not None:
        raise ValueError("cache_batch_idx is not supported with a paged cache (block_table)")
    if cache_batch_idx is not None:
        _check_per_sequence("cache_batch_idx", cache_batch_idx, batch, q.device)
    elif not paged and k_cache.shape[0] < batch:
        raise ValueError(f"k_cache holds {k_cache.shape[0]} sequences, fewer than q's batch {batch}")
    if cache_leftpad is not None:
        _check_per_sequence("cache_leftpad", cache_leftpad, batch, q.device)
    check_paged_cache(
        q, k_cache, v_cache, block_table, cache_seqlens, batch=batch, alibi_slopes=alibi_slopes,
        k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip
    seqlen_new = 0
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together")
    if k is not None:
        assert v is not None
        nheads_k = k_cache.shape[2]
        for name, x in (("k", k), ("v", v)):
            if (
                not isinstance(x, Tensor)
                or x.dim() != 4
                or x.shape[0] != batch
                or tuple(x.shape[2:]) != (nheads_k, d)
            ):
                raise ValueError(
                    f"{name} must be (batch={batch}, seqlen_new, {nheads_k}, {d}), got {getattr(x, 'shape', x)}"
                )
            if x.dtype != q.dtype or x.device != q.device:
                raise TypeError(
                    f"{name} must have q's dtype {q.dtype} and device, got {x.dtype} on {x.device}"
                )
        if k.shape != v.shape:
            raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
        seqlen_new = k.shape[1]
    if rotary_cos is not None or rotary_sin is not None:
        if rotary_cos is None or rotary_sin is None or k is None:
            raise ValueError("rotary_cos and rotary_sin go together and need k/v (flash-attn semantics)")
        if rotary_cos.shape != rotary_sin.shape or rotary_cos.dim() != 2 or 2 * rotary_cos.shape[1] > d:
            raise ValueError(
                f"rotary_cos/sin must both be (seqlen_ro, rotary_dim / 2) with rotary_dim <= {d}, "
                f"got {tuple(rotary_cos.shape)} / {tuple(rotary_sin.shape)}"
            )
    compiling = torch.compiler.is_compiling()
    if validate and not compiling:  # value checks read the device (a sync, a graph break): eager only
        check_paged_values(
            block_table, cache_seqlens + seqlen_new, k_cache.shape[0], k_cache.shape[1] if paged else capacity,
            seqlens_name="cache_seqlens + seqlen_new",
        )  # fmt: skip
        if cache_batch_idx is not None and batch:
            lo, hi = int(cache_batch_idx.min()), int(cache_batch_idx.max())
            if lo < 0 or hi >= k_cache.shape[0]:
                raise ValueError(f"cache_batch_idx values must be in [0, {k_cache.shape[0]}), got {lo}..{hi}")
        if cache_leftpad is not None and batch:
            bad = (cache_leftpad < 0) | (cache_leftpad > cache_seqlens)
            if bool(bad.any()):
                i = int(bad.nonzero()[0, 0])
                raise ValueError(
                    f"cache_leftpad must be in [0, cache_seqlens]: sequence {i} has cache_leftpad="
                    f"{int(cache_leftpad[i])}, cache_seqlens={int(cache_seqlens[i])}"
                )
        if rotary_cos is not None and batch:
            need = int(cache_seqlens.max()) + max(seqlen_new, seqlen_q)
            if need > rotary_cos.shape[0]:
                raise ValueError(f"rotary_cos has {rotary_cos.shape[0]} positions, {need} are needed")

    # Positions of the new tokens (only when there are some: the cast is a kernel launch on a GPU).
    start = cache_seqlens.long() if k is not None else cache_seqlens
    if rotary_cos is not None:
        assert rotary_sin is not None and k is not None
        ro_max = rotary_cos.shape[0] - 1
        pos_k = (start[:, None] + torch.arange(seqlen_new, device=q.device)).clamp_max(ro_max)
        k = apply_rotary(k, rotary_cos, rotary_sin, pos_k, rotary_interleaved)
        if causal or tuple(window_size) != (-1, -1):
            pos_q = start[:, None] + torch.arange(seqlen_q, device=q.device)
        else:
            pos_q = start[:, None].expand(batch, seqlen_q)
        q = apply_rotary(q, rotary_cos, rotary_sin, pos_q.clamp_max(ro_max), rotary_interleaved)
    if k is not None and seqlen_new:
        assert v is not None
        pos = start[:, None] + torch.arange(seqlen_new, device=q.device)  # (batch, seqlen_new)
        if paged:
            bs = k_cache.shape[1]
            col = (pos // bs).clamp_max(block_table.shape[1] - 1)
            slots = block_table.long().gather(1, col) * bs + pos % bs
        else:
            rows = (
                cache_batch_idx.long()
                if cache_batch_idx is not None
                else torch.arange(batch, device=q.device)
            )
            slots = rows[:, None] * k_cache.shape[1] + pos
        # Tokens past the cache's capacity are dropped (validate=True has already rejected them).
        slots = torch.where(pos < capacity, slots, -1)
        append = _torch_cache_append if on_torch else _cache_append_op if compiling else _cache_append
        append(
            k.reshape(batch * seqlen_new, *k.shape[2:]), v.reshape(batch * seqlen_new, *v.shape[2:]),
            k_cache, v_cache, slots.reshape(-1), k_scale, v_scale,
        )  # fmt: skip
    seqlens_k = (cache_seqlens + seqlen_new).to(torch.int32) if seqlen_new else cache_seqlens
    attend = _torch_cache_attention if on_torch else _cache_attention_op if compiling else _cache_attention
    out, lse = attend(
        q, k_cache, v_cache, seqlens_k, cache_batch_idx, cache_leftpad, block_table,
        float(softmax_scale) if softmax_scale is not None else d**-0.5, bool(causal), int(window_size[0]),
        int(window_size[1]), float(softcap), alibi_slopes, int(num_splits), bool(return_softmax_lse), k_scale, v_scale,
    )  # fmt: skip
    return (out, lse) if return_softmax_lse else out


# ----------------------------------------------------------------------------------------------
# The two steps as custom ops, for torch.compile: the cache write mutates the caches, the attention
# reads them. Eager calls run the functions directly (a custom op's dispatch costs host time).
# ----------------------------------------------------------------------------------------------
def _cache_append(
    k: Tensor,
    v: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slots: Tensor,
    k_scale: Tensor | None,
    v_scale: Tensor | None,
) -> None:
    """Write ``k/v (tokens, nheads_k, d)`` into the caches at the flat ``slots (tokens,)`` (int64,
    ``-1`` = drop), in place."""
    reshape_and_cache(k, v, k_cache, v_cache, slots, k_scale=k_scale, v_scale=v_scale, validate=False)


def _cache_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    seqlens_k: Tensor,
    cache_batch_idx: Tensor | None,
    cache_leftpad: Tensor | None,
    block_table: Tensor | None,
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    alibi_slopes: Tensor | None,
    num_splits: int,
    return_softmax_lse: bool,
    k_scale: Tensor | None,
    v_scale: Tensor | None,
) -> tuple[Tensor, Tensor]:
    """``(out (batch, seqlen_q, nheads, d), lse (batch, nheads, seqlen_q) float32)`` of ``q`` over
    the first ``seqlens_k (batch,)`` keys of the cache; ``lse`` is empty ``(0,)`` unless
    ``return_softmax_lse``. Arguments as validated by :func:`flash_attn_with_kvcache`."""
    batch, seqlen_q, nheads, d = q.shape
    nheads_k = k_cache.shape[2]
    paged = block_table is not None
    capacity = block_table.shape[1] * k_cache.shape[1] if block_table is not None else k_cache.shape[1]
    choice = choose_launch(
        kv_attention_config(q, k_cache, seqlen_q, paged), num_splits, batch, seqlen_q, nheads, nheads_k,
        k_cache.dtype, capacity, default_num_sms(q.device),
    )  # fmt: skip
    qp = q.reshape(batch * seqlen_q, nheads, d)
    out = torch.empty((batch * seqlen_q, nheads, d), dtype=q.dtype, device=q.device)
    lse = (
        torch.empty(batch, seqlen_q, nheads, dtype=torch.float32, device=q.device)
        if return_softmax_lse
        else None
    )
    if out.numel():
        problem = PagedProblem(
            qp, k_cache, v_cache, out, seqlens_k, seqlen_q, softmax_scale, block_table=block_table,
            cache_batch_idx=cache_batch_idx, kv_start=cache_leftpad, lse=lse.view(batch * seqlen_q, nheads).t() if lse is not None else None,
            causal=causal, window_size=(window_left, window_right), softcap=softcap,
            alibi_slopes=alibi_slopes, k_scale=k_scale, v_scale=v_scale,
        )  # fmt: skip
        eager_launcher().launch(problem, choice.config, choice.num_splits)
    out = out.view(batch, seqlen_q, nheads, d)
    if lse is None:
        return out, q.new_empty((0,), dtype=torch.float32)
    return out, lse.permute(0, 2, 1).contiguous()


# ----------------------------------------------------------------------------------------------
# The torch backend: the same two steps in plain PyTorch (the reference attention, per sequence).
# ----------------------------------------------------------------------------------------------
def _torch_cache_append(
    k: Tensor,
    v: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slots: Tensor,
    k_scale: Tensor | None,
    v_scale: Tensor | None,
) -> None:
    """:func:`_cache_append` in PyTorch: an fp8 cache stores ``clamp(x / scale, +-448)`` rounded to
    nearest even (``reshape_and_cache``'s quantisation)."""
    keep = slots >= 0
    idx = slots[keep]
    with torch.no_grad():  # as the kernel: the cache is state, not part of a graph
        for x, cache, scale in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
            new = x[keep]
            if is_fp8_dtype(cache.dtype):
                new = new.float() / scale[:, None] if scale is not None else new.float()
                new = new.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
            cache.view(-1, *cache.shape[2:])[idx] = new.to(cache.dtype)


@torch.no_grad()  # forward only, as flash-attn's and the kernel's
def _torch_cache_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    seqlens_k: Tensor,
    cache_batch_idx: Tensor | None,
    cache_leftpad: Tensor | None,
    block_table: Tensor | None,
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    alibi_slopes: Tensor | None,
    num_splits: int,
    return_softmax_lse: bool,
    k_scale: Tensor | None,
    v_scale: Tensor | None,
) -> tuple[Tensor, Tensor]:
    """:func:`_cache_attention` through the float32 reference, one sequence at a time (host reads
    of the lengths). Dropping the ``cache_leftpad`` keys keeps the bottom-right alignment and ALiBi
    distances, which only depend on a key's distance from the last key."""
    batch, seqlen_q, nheads, _ = q.shape
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full((batch, nheads, seqlen_q), float("-inf"), dtype=torch.float32, device=q.device)
    lens = seqlens_k.tolist()
    starts = cache_leftpad.tolist() if cache_leftpad is not None else [0] * batch
    rows = cache_batch_idx.tolist() if cache_batch_idx is not None else list(range(batch))

    def keys(cache: Tensor, scale: Tensor | None, b: int) -> Tensor:
        if block_table is not None:
            x = gather_paged_kv(cache, block_table, lens[b], b)[starts[b] :]
        else:
            x = cache[rows[b], starts[b] : lens[b]]
        x = x.float()
        return (x * scale[:, None] if scale is not None else x).unsqueeze(0)

    for b in range(batch):
        alibi = alibi_slopes[b] if alibi_slopes is not None and alibi_slopes.dim() == 2 else alibi_slopes
        o, l_b = attention_ref(
            q[b : b + 1], keys(k_cache, k_scale, b), keys(v_cache, v_scale, b), softmax_scale=softmax_scale,
            causal=causal, window_size=(window_left, window_right), softcap=softcap, alibi_slopes=alibi,
        )[:2]  # fmt: skip
        out[b], lse[b] = o[0], l_b[0]
    if not return_softmax_lse:
        lse = q.new_empty((0,), dtype=torch.float32)
    return out.to(q.dtype), lse


_cache_append_op = torch.library.custom_op(
    "flashpage::reshape_and_cache", _cache_append, mutates_args=("k_cache", "v_cache")
)
_cache_attention_op = torch.library.custom_op(
    "flashpage::kvcache_attention", _cache_attention, mutates_args=()
)


@_cache_attention_op.register_fake
def _cache_attention_fake(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    seqlens_k: Tensor,
    cache_batch_idx: Tensor | None,
    cache_leftpad: Tensor | None,
    block_table: Tensor | None,
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    alibi_slopes: Tensor | None,
    num_splits: int,
    return_softmax_lse: bool,
    k_scale: Tensor | None,
    v_scale: Tensor | None,
) -> tuple[Tensor, Tensor]:
    batch, seqlen_q, nheads, d = q.shape
    lse_shape = (batch, nheads, seqlen_q) if return_softmax_lse else (0,)
    return q.new_empty((batch, seqlen_q, nheads, d)), q.new_empty(lse_shape, dtype=torch.float32)
