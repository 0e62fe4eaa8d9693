"""flash-attn's ``flash_attn.bert_padding`` helpers: between padded ``(batch, seqlen, ...)`` tensors
and the packed ``(total, ...)`` layout of the varlen functions.

Signatures and return values are flash-attn >= 2.6's, so ``from flash_attn.bert_padding import ...``
becomes ``from flashpage.bert_padding import ...``. Plain indexing ops: differentiable, and the
gradient of the padding rows is zero.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["index_first_axis", "index_put_first_axis", "pad_input", "unpad_input"]


def index_first_axis(x: Tensor, indices: Tensor) -> Tensor:
    """``x[indices]`` along the first axis: ``(n, ...)`` -> ``(len(indices), ...)``."""
    return x.index_select(0, indices)


def index_put_first_axis(values: Tensor, indices: Tensor, first_axis_dim: int) -> Tensor:
    """A zero ``(first_axis_dim, ...)`` tensor with ``values (len(indices), ...)`` put at ``indices``."""
    out = values.new_zeros((first_axis_dim, *values.shape[1:]))
    return out.index_copy(0, indices, values)


def unpad_input(
    hidden_states: Tensor, attention_mask: Tensor, unused_mask: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor, int, Tensor]:
    """Pack the tokens a mask keeps.

    Args:
        hidden_states: ``(batch, seqlen, ...)``.
        attention_mask: ``(batch, seqlen)``, nonzero/True = a token that is attended to.
        unused_mask: optional ``(batch, seqlen)``, nonzero/True = a token that is kept in the packed
            output but not attended to (flash-attn's meaning; it counts in ``cu_seqlens``).

    Returns:
        ``(hidden_states (total, ...), indices (total,) int64`` into the flattened ``batch *
        seqlen``, ``cu_seqlens (batch + 1,) int32``, ``max_seqlen_in_batch`` (a Python int: one
        host sync), ``seqused (batch,) int32`` the attended tokens per sequence).
    """
    keep = attention_mask.bool() | unused_mask.bool() if unused_mask is not None else attention_mask.bool()
    seqlens = keep.sum(dim=-1, dtype=torch.int32)
    used = attention_mask.bool().sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(keep.flatten(), as_tuple=False).flatten()
    max_seqlen = int(seqlens.max()) if seqlens.numel() else 0
    cu_seqlens = torch.nn.functional.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return index_first_axis(flat, indices), indices, cu_seqlens, max_seqlen, used


def pad_input(hidden_states: Tensor, indices: Tensor, batch: int, seqlen: int) -> Tensor:
    """Inverse of :func:`unpad_input`: ``hidden_states (total, ...)`` back to ``(batch, seqlen,
    ...)`` with zeros at the padding positions."""
    out = index_put_first_axis(hidden_states, indices, batch * seqlen)
    return out.view(batch, seqlen, *hidden_states.shape[1:])
