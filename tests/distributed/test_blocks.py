"""plan_block's local calls reproduce the global causal / sliding-window mask exactly; the fp32
LSE merge equals attention over the union of keys."""

from __future__ import annotations

import itertools

import pytest
import torch

from flashpage.distributed.blocks import block_backward, block_forward, merge_partial, plan_block
from flashpage.ops.reference import attention_ref, visible_mask


def _global_mask(q0: int, nq: int, k0: int, nk: int, causal: bool, window: tuple[int, int]) -> torch.Tensor:
    left, right = window
    if causal:
        right = 0
    pq = torch.arange(q0, q0 + nq).view(-1, 1)
    pk = torch.arange(k0, k0 + nk).view(1, -1)
    m = torch.ones(nq, nk, dtype=torch.bool)
    if left >= 0:
        m &= pk >= pq - left
    if right >= 0:
        m &= pk <= pq + right
    return m


WINDOWS = [(-1, -1), (0, 0), (2, 1), (3, -1), (-1, 2), (7, 5), (20, 20)]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", WINDOWS)
def test_plan_block_matches_global_mask(causal: bool, window: tuple[int, int]) -> None:
    for q0, nq, k0, nk in itertools.product([0, 3, 8, 16], [1, 4, 8], [0, 2, 8, 12], [1, 4, 8]):
        want = _global_mask(q0, nq, k0, nk, causal, window)
        got = torch.zeros_like(want)
        blk = plan_block(q0, nq, k0, nk, causal, window)
        if blk is not None:
            sq, sk = blk.q_hi - blk.q_lo, blk.k_hi - blk.k_lo
            got[blk.q_lo : blk.q_hi, blk.k_lo : blk.k_hi] = visible_mask(sq, sk, False, blk.window)
            assert min(blk.window) >= -1
        assert torch.equal(got, want), (q0, nq, k0, nk, causal, window, blk)


def test_plan_block_full_and_skipped() -> None:
    assert plan_block(8, 4, 0, 4, True, (-1, -1)).window == (-1, -1)  # type: ignore[union-attr]
    assert plan_block(0, 4, 8, 4, True, (-1, -1)) is None
    assert plan_block(4, 4, 4, 4, True, (-1, -1)).window == (-1, 0)  # type: ignore[union-attr]


def test_merge_and_block_backward_match_reference() -> None:
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 6, 4, 32, generator=g)
    k = torch.randn(1, 10, 2, 32, generator=g)
    v = torch.randn(1, 10, 2, 32, generator=g)
    out = torch.zeros(1, 6, 4, 32)
    lse = torch.full((1, 4, 6), float("-inf"))
    for sl in (slice(0, 3), slice(3, 10)):
        o, ls = block_forward(q, k[:, sl], v[:, sl], 0.2, (-1, -1), 0.0, 0)
        merge_partial(out, lse, o, ls)
    ref_q, ref_k, ref_v = (t.clone().requires_grad_() for t in (q, k, v))
    ref, ref_lse = attention_ref(ref_q, ref_k, ref_v, softmax_scale=0.2)[:2]
    torch.testing.assert_close(out, ref.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse.detach(), atol=1e-5, rtol=1e-5)
    dout = torch.randn_like(ref)
    ref.backward(dout)
    dq = torch.zeros_like(q)
    for sl in (slice(0, 3), slice(3, 10)):
        bq, bk, bv = block_backward(dout, q, k[:, sl], v[:, sl], out, lse, 0.2, (-1, -1), 0.0, 0)
        dq += bq
        torch.testing.assert_close(bk, ref_k.grad[:, sl], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(bv, ref_v.grad[:, sl], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dq, ref_q.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [(2, 1), (-1, 0)])
def test_triton_blocks_match_torch_blocks(monkeypatch: pytest.MonkeyPatch, window: tuple[int, int]) -> None:
    """The GPU path (Triton kernels, here under the interpreter) takes the same local windows, on
    strided slices of the sequence dim as the ring passes them."""
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, 8, 2, 32, generator=g)[:, 1:6]
    k, v = (torch.randn(1, 9, 1, 32, generator=g)[:, 2:9] for _ in range(2))
    dout = torch.randn(1, 5, 2, 32, generator=g)
    want_o, want_l = block_forward(q, k, v, 0.3, window, 0.0, 0)
    want_g = block_backward(dout, q, k, v, want_o, want_l, 0.3, window, 0.0, 0)
    monkeypatch.setenv("FLASHPAGE_BACKEND", "triton")
    got_o, got_l = block_forward(q, k, v, 0.3, window, 0.0, 0)
    torch.testing.assert_close(got_o.float(), want_o, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got_l, want_l, atol=1e-4, rtol=1e-4)
    got_g = block_backward(dout, q, k, v, want_o, want_l, 0.3, window, 0.0, 0)
    for name, a, b in zip(("dq", "dk", "dv"), got_g, want_g, strict=True):
        torch.testing.assert_close(a.float(), b, atol=1e-4, rtol=1e-4, msg=name)
