"""transformers attention implementation ``"flashpage"``: flashpage's kernels inside HF models.

``import flashpage.integrations.transformers`` registers the name with transformers'
``AttentionInterface`` (the attention function) and ``AttentionMaskInterface`` (the mask: the 2-D
padding mask or ``None``, as flash-attn 2's, since the kernels mask causally themselves); then::

    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="flashpage")

trains (forward and backward kernels) and generates with them. Needs transformers >= 4.56 (the
mask interface). Padding, left padding in generation included, goes through the attention mask:
padded batches are packed with :mod:`flashpage.bert_padding` and run by the varlen kernel; packed
sequences (``cu_seq_lens_q/k`` keyword arguments, or ``position_ids`` restarting in a batch of one,
as transformers' flash-attn path) run varlen too. The backend follows ``FLASHPAGE_BACKEND`` (Triton
kernels on CUDA, the PyTorch path on CPU).
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

import torch
from torch import Tensor

from flashpage.bert_padding import index_first_axis, pad_input, unpad_input
from flashpage.ops.flash_attn import flash_attn_func, flash_attn_varlen_func
from flashpage.ops.kvcache import flash_attn_with_kvcache

__all__ = ["ATTN_IMPLEMENTATION", "flashpage_attention_forward", "register"]

ATTN_IMPLEMENTATION = "flashpage"


def _packed_lengths(kwargs: dict[str, Any], batch: int) -> tuple[Tensor, Tensor, int, int] | None:
    """``(cu_seqlens_q, cu_seqlens_k, max_q, max_k)`` of packed sequences in a batch of one, from
    the flash kwargs or restarting ``position_ids``; ``None`` when the batch is not packed."""
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is not None and cu_k is not None:
        max_q, max_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")
        max_q = int(max_q) if max_q is not None else int((cu_q[1:] - cu_q[:-1]).max())
        max_k = int(max_k) if max_k is not None else int((cu_k[1:] - cu_k[:-1]).max())
        return cu_q.to(torch.int32), cu_k.to(torch.int32), max_q, max_k
    pos = kwargs.get("position_ids")
    if batch != 1 or not isinstance(pos, Tensor) or pos.shape[-1] < 2:
        return None
    pos = pos.reshape(-1)
    starts = torch.nonzero(pos == pos.min()).flatten()
    if starts.numel() < 2:  # one sequence (positions need not start at 0: a cached prefix)
        return None
    cu = torch.cat((starts, torch.tensor([pos.numel()], device=pos.device))).to(torch.int32)
    max_len = int((cu[1:] - cu[:-1]).max())
    return cu, cu, max_len, max_len


def flashpage_attention_forward(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    is_causal: bool | None = None,
    s_aux: Tensor | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers' attention-function contract over flashpage's kernels.

    Args:
        module: the attention layer (its ``is_causal`` is the default for ``is_causal``).
        query: ``(batch, nheads, seqlen_q, d)``; key, value: ``(batch, nheads_k, seqlen_k, d)``.
        attention_mask: ``None`` or the 2-D ``(batch, >= seqlen_k)`` padding mask (True/1 = token)
            from the registered mask function; the last ``seqlen_k`` columns are the keys', and the
            queries are the last ``seqlen_q`` keys (bottom-right alignment, as a KV cache needs).
        scaling: softmax scale (default ``d ** -0.5``); dropout: attention dropout probability.
        sliding_window: a key is visible to the ``sliding_window - 1`` queries after it (as
            transformers' flash-attn path and its sliding-window masks).
        softcap: logit soft-capping.

    Returns:
        ``(out (batch, seqlen_q, nheads, d), None)`` (no attention weights).

    Raises:
        ValueError: ``s_aux`` (attention sinks) or a mask that is not 2-D.
    """
    if s_aux is not None:
        raise ValueError("s_aux: attention sinks are not supported by the flashpage attention")
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError(
            f"attention_mask: the flashpage attention takes a 2-D padding mask, got shape {tuple(attention_mask.shape)}"
        )
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    window = (sliding_window - 1, sliding_window - 1) if sliding_window is not None else (-1, -1)
    opts = {"dropout_p": float(dropout), "softmax_scale": scaling, "causal": causal, "window_size": window,
            "softcap": float(softcap or 0.0)}  # fmt: skip
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # (batch, seqlen, heads, d) views
    batch, seqlen_q = q.shape[:2]
    packed = _packed_lengths(kwargs, batch) if attention_mask is None else None
    if packed is not None:
        cu_q, cu_k, max_q, max_k = packed
        out = flash_attn_varlen_func(q[0], k[0], v[0], cu_q, cu_k, max_q, max_k, **opts)
        return out.unsqueeze(0), None  # type: ignore[union-attr]
    if attention_mask is None:
        return flash_attn_func(q, k, v, **opts), None  # type: ignore[return-value]
    mask_k = attention_mask.bool()
    if mask_k.shape[1] >= k.shape[1]:
        mask_k = mask_k[:, -k.shape[1] :]
    else:  # a static cache longer than the mask: its tail slots are unused
        k, v = k[:, : mask_k.shape[1]], v[:, : mask_k.shape[1]]
    seqlen_k = k.shape[1]
    k_u, idx_k, cu_k, max_k, _ = unpad_input(k, mask_k)
    v_u = index_first_axis(v.reshape(batch * seqlen_k, *v.shape[2:]), idx_k)
    q_u, idx_q, cu_q, max_q, _ = unpad_input(q, mask_k[:, -seqlen_q:])
    out_u = flash_attn_varlen_func(q_u, k_u, v_u, cu_q, cu_k, max_q, max_k, **opts)
    return pad_input(out_u, idx_q, batch, seqlen_q), None  # type: ignore[arg-type]


def _answer_flash_imports(name: str) -> None:
    """transformers takes every implementation whose name contains "flash" for a flash-attn build
    and, when a model is created, imports its functions through
    ``modeling_flash_attention_utils._lazy_imports``, which knows only the flash-attn packages and
    hub kernels. Wrap that loader so it answers ``name`` with flashpage's flash-attn compatible
    functions (and defers every other name to the original)."""
    try:
        fa_utils = importlib.import_module("transformers.modeling_flash_attention_utils")
    except ImportError:  # pragma: no cover - depends on the installed transformers
        return
    original = getattr(fa_utils, "_lazy_imports", None)
    if original is None or name in getattr(original, "flashpage_names", ()):
        return

    @functools.wraps(original)
    def lazy_imports(implementation: str | None, *args: Any, **kwargs: Any) -> tuple:
        if implementation == name:
            return flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache, pad_input, unpad_input
        return original(implementation, *args, **kwargs)

    lazy_imports.flashpage_names = (*getattr(original, "flashpage_names", ()), name)  # type: ignore[attr-defined]
    fa_utils._lazy_imports = lazy_imports


def register(name: str = ATTN_IMPLEMENTATION) -> None:
    """Register ``name`` with transformers' attention and mask interfaces (idempotent; done on import)."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask
    except ImportError as e:  # pragma: no cover - depends on the installed transformers
        raise ImportError(
            "flashpage.integrations.transformers needs transformers >= 4.56 (AttentionInterface and "
            "AttentionMaskInterface): pip install 'flashpage[models]'"
        ) from e
    AttentionInterface.register(name, flashpage_attention_forward)
    AttentionMaskInterface.register(name, flash_attention_mask)
    if "flash" in name:
        _answer_flash_imports(name)


register()
