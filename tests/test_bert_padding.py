"""flashpage.bert_padding: flash-attn's unpad_input / pad_input signatures, return values and gradients."""

from __future__ import annotations

import torch

from flashpage.bert_padding import index_first_axis, pad_input, unpad_input


def test_unpad_pad_roundtrip_left_and_right_padding() -> None:
    x = torch.randn(3, 5, 2, 4, requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], dtype=torch.bool)
    packed, indices, cu, max_len, used = unpad_input(x, mask)
    assert packed.shape == (11, 2, 4) and indices.dtype == torch.int64
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 3, 6, 11]
    assert (
        max_len == 5 and isinstance(max_len, int) and used.dtype == torch.int32 and used.tolist() == [3, 3, 5]
    )
    assert torch.equal(packed, x.detach()[mask])  # row-major order of the kept tokens
    back = pad_input(packed, indices, 3, 5)
    assert torch.equal(back, x.detach() * mask[..., None, None])
    (g,) = torch.autograd.grad(back.sum(), x)
    assert torch.equal(g, mask[..., None, None].expand_as(x).float())  # padding rows get no gradient


def test_unused_mask_is_packed_but_not_counted_as_used() -> None:
    x = torch.arange(8.0).view(2, 4, 1)
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0]])
    unused = torch.tensor([[0, 0, 1, 0], [0, 1, 1, 0]])
    packed, indices, cu, max_len, used = unpad_input(x, mask, unused)
    assert indices.tolist() == [0, 1, 2, 4, 5, 6] and cu.tolist() == [0, 3, 6] and max_len == 3
    assert used.tolist() == [2, 1] and packed.flatten().tolist() == [0, 1, 2, 4, 5, 6]
    assert torch.equal(index_first_axis(x.view(8, 1), indices), packed)
