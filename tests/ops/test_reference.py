"""The reference attention against PyTorch SDPA (where they overlap) and hand-built masks."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from flashpage.ops.reference import (
    attention_ref,
    gather_paged_kv,
    paged_attention_ref,
    varlen_attention_ref,
    visible_mask,
)


def _sdpa(q, k, v, **kw):
    # SDPA layout is (b, h, s, d)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), **kw)
    return out.transpose(1, 2)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("hk", [4, 2, 1])
def test_matches_sdpa_square(causal: bool, hk: int) -> None:
    q = torch.randn(2, 7, 4, 16, dtype=torch.float64)
    k = torch.randn(2, 7, hk, 16, dtype=torch.float64)
    v = torch.randn(2, 7, hk, 16, dtype=torch.float64)
    out, lse = attention_ref(q, k, v, causal=causal, upcast=False)
    ref = _sdpa(q, k, v, is_causal=causal, enable_gqa=True)
    torch.testing.assert_close(out, ref)
    # lse by hand for one row
    s = (q[0, 3, 1] @ k[0, : (4 if causal else 7), 1 // (4 // hk)].T) / math.sqrt(16)
    torch.testing.assert_close(lse[0, 1, 3].double(), torch.logsumexp(s, 0), rtol=1e-5, atol=1e-5)


def test_bottom_right_alignment_matches_hand_mask() -> None:
    # seqlen_q < seqlen_k: query i sees keys up to i + sk - sq (flash-attn 2.1+ convention).
    m = visible_mask(2, 5, causal=True)
    assert m.tolist() == [[True, True, True, True, False], [True, True, True, True, True]]
    # seqlen_q > seqlen_k: the first rows see nothing.
    m = visible_mask(4, 2, causal=True)
    assert m.tolist() == [[False, False], [False, False], [True, False], [True, True]]
    # window (1, 1) on a square problem: a band.
    m = visible_mask(4, 4, window_size=(1, 1))
    assert m.int().tolist() == [[1, 1, 0, 0], [1, 1, 1, 0], [0, 1, 1, 1], [0, 0, 1, 1]]
    # left-only and right-only windows
    assert visible_mask(3, 3, window_size=(0, -1)).int().tolist() == [[1, 1, 1], [0, 1, 1], [0, 0, 1]]
    assert visible_mask(3, 3, window_size=(-1, 0)).int().tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]


def test_masked_rows_are_zero_and_lse_neg_inf() -> None:
    q, k, v = torch.randn(1, 4, 2, 8), torch.randn(1, 2, 2, 8), torch.randn(1, 2, 2, 8)
    out, lse = attention_ref(q, k, v, causal=True)
    assert torch.all(out[0, :2] == 0)
    assert torch.all(torch.isinf(lse[0, :, :2])) and torch.all(lse[0, :, :2] < 0)
    ref = _sdpa(q[:, 2:], k, v, attn_mask=visible_mask(4, 2, causal=True)[2:])
    torch.testing.assert_close(out[:, 2:], ref)


def test_window_matches_sdpa_with_hand_mask() -> None:
    q, k, v = torch.randn(1, 5, 2, 8), torch.randn(1, 9, 2, 8), torch.randn(1, 9, 2, 8)
    out, _ = attention_ref(q, k, v, window_size=(2, 1))
    i = torch.arange(5).view(5, 1) + 4
    j = torch.arange(9).view(1, 9)
    mask = (j >= i - 2) & (j <= i + 1)
    torch.testing.assert_close(out, _sdpa(q, k, v, attn_mask=mask))


def test_softcap_and_alibi_match_explicit_bias() -> None:
    q, k, v = torch.randn(2, 3, 2, 8), torch.randn(2, 6, 2, 8), torch.randn(2, 6, 2, 8)
    slopes = torch.tensor([[0.5, 0.25], [0.125, 1.0]])
    out, _ = attention_ref(q, k, v, softcap=2.0, alibi_slopes=slopes, causal=True)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(8)
    s = 2.0 * torch.tanh(s / 2.0)
    dist = (torch.arange(3).view(3, 1) + 3 - torch.arange(6).view(1, 6)).abs()
    s = s - slopes.view(2, 2, 1, 1) * dist
    s = s.masked_fill(~visible_mask(3, 6, causal=True), float("-inf"))
    ref = torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v)
    torch.testing.assert_close(out, ref)


def test_dropout_uses_mask_and_rescales() -> None:
    q, k, v = torch.randn(1, 4, 1, 8), torch.randn(1, 4, 1, 8), torch.randn(1, 4, 1, 8)
    keep = torch.rand(1, 1, 4, 4) > 0.3
    out, _lse, probs = attention_ref(q, k, v, dropout_p=0.3, dropout_mask=keep, return_probs=True)
    p = torch.softmax(torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(8), -1)
    torch.testing.assert_close(probs, p * keep)
    torch.testing.assert_close(out, torch.einsum("bhqk,bkhd->bqhd", p * keep / 0.7, v))
    with pytest.raises(ValueError, match="dropout_mask"):
        attention_ref(q, k, v, dropout_p=0.3)


def test_varlen_equals_per_sequence() -> None:
    lens_q, lens_k = [3, 1, 0, 5], [4, 6, 2, 5]
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32)
    q, k, v = torch.randn(9, 4, 8), torch.randn(17, 2, 8), torch.randn(17, 2, 8)
    out, lse = varlen_attention_ref(q, k, v, cu_q, cu_k, causal=True)
    assert lse.shape == (4, 9)
    for b in range(4):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if lens_q[b] == 0:
            continue
        o, _ = attention_ref(q[qs][None], k[ks][None], v[ks][None], causal=True)
        torch.testing.assert_close(out[qs], o[0])


def test_paged_equals_contiguous() -> None:
    bs, nb, hk, d = 4, 16, 2, 8
    lens = [5, 12, 1]
    kc, vc = torch.randn(nb, bs, hk, d), torch.randn(nb, bs, hk, d)
    table = torch.randperm(nb)[:12].view(3, 4).to(torch.int32)
    q = torch.randn(3, 1, 4, d)
    out, lse = paged_attention_ref(q, kc, vc, table, torch.tensor(lens, dtype=torch.int32))
    for b, n in enumerate(lens):
        kk = torch.stack([kc[table[b, t // bs], t % bs] for t in range(n)])
        vv = torch.stack([vc[table[b, t // bs], t % bs] for t in range(n)])
        torch.testing.assert_close(gather_paged_kv(kc, table, n, b), kk)
        o, l_ = attention_ref(q[b : b + 1], kk[None], vv[None])
        torch.testing.assert_close(out[b], o[0])
        torch.testing.assert_close(lse[b], l_[0])


def test_same_precision_path_is_less_accurate_in_half() -> None:
    q, k, v = (torch.randn(1, 16, 2, 32) for _ in range(3))
    ref, _ = attention_ref(q, k, v)
    low, _ = attention_ref(q.bfloat16(), k.bfloat16(), v.bfloat16(), upcast=False)
    assert low.dtype == torch.bfloat16
    err = (low.float() - ref).abs().max()
    assert 0 < err < 0.1


def test_rejects_bad_heads() -> None:
    with pytest.raises(ValueError, match="divisible"):
        attention_ref(torch.randn(1, 2, 3, 8), torch.randn(1, 2, 2, 8), torch.randn(1, 2, 2, 8))
