"""reshape_and_cache: scatter new K/V into paged-cache slots (Triton interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch

from flashpage.ops.cache_write import FP8_E4M3_MAX, fp8_kv_scales, reshape_and_cache
from tests.ops.test_paged_decode import on_device  # noqa: F401 (autouse fixture)


@pytest.mark.parametrize("block_size", [8, 16, 256])
def test_round_trip_and_skips(block_size: int) -> None:
    nb, hk, d, t = 6, 2, 32, 40
    kc = torch.zeros(nb, block_size, hk, d)
    vc = torch.zeros_like(kc)
    # k/v as strided views of a packed qkv projection, like a model produces them.
    qkv = torch.randn(t, (4 + 2 * hk) * d)
    k = qkv[:, 4 * d : (4 + hk) * d].view(t, hk, d)
    v = qkv[:, (4 + hk) * d :].view(t, hk, d)
    slots = torch.randperm(nb * block_size)[:t]
    slots[[3, 17]] = -1  # skipped
    reshape_and_cache(k, v, kc, vc, slots)
    keep = slots >= 0
    flat_k, flat_v = kc.view(-1, hk, d), vc.view(-1, hk, d)
    assert torch.equal(flat_k[slots[keep]], k[keep]) and torch.equal(flat_v[slots[keep]], v[keep])
    untouched = torch.ones(nb * block_size, dtype=torch.bool)
    untouched[slots[keep]] = False
    assert bool((flat_k[untouched] == 0).all()) and bool((flat_v[untouched] == 0).all())


def test_bf16_cache() -> None:
    kc = torch.zeros(4, 16, 2, 64, dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    k, v = torch.randn(2, 5, 2, 64).to(torch.bfloat16).unbind(0)
    slots = torch.tensor([0, 17, 63, 5, 40])
    reshape_and_cache(k, v, kc, vc, slots)
    assert torch.equal(kc.view(-1, 2, 64)[slots], k) and torch.equal(vc.view(-1, 2, 64)[slots], v)


def test_fp8_quantisation_exact_and_within_bound() -> None:
    nb, bs, hk, d, t = 4, 16, 4, 32, 64
    k = torch.randn(t, hk, d) * torch.tensor([0.01, 1.0, 30.0, 500.0]).view(1, hk, 1)
    v = torch.randn(t, hk, d)
    k[0, 0, :4] = torch.tensor([0.0, 1e-9, -1e-9, 3e-7])  # zeros and e4m3 subnormals
    ks, vs = fp8_kv_scales(k), fp8_kv_scales(v)
    assert ks.shape == (hk,) and ks.dtype == torch.float32
    kc = torch.zeros(nb, bs, hk, d, dtype=torch.float8_e4m3fn)
    vc = torch.zeros_like(kc)
    slots = torch.randperm(nb * bs)[:t]
    reshape_and_cache(k, v, kc, vc, slots, k_scale=ks, v_scale=vs)
    got_k = kc.view(-1, hk, d)[slots]
    want_k = (k / ks.view(1, hk, 1)).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    # Bit-exact RNE rounding; the GPU's native cast keeps the sign of values that round to zero
    # (-0.0) while ours writes +0.0, so compare zeros by value and everything else by bits.
    nonzero = want_k.float() != 0
    assert torch.equal(got_k.float() == 0, ~nonzero)
    assert torch.equal(got_k.view(torch.uint8)[nonzero], want_k.view(torch.uint8)[nonzero])
    for x, got, s in ((k, got_k, ks), (v, vc.view(-1, hk, d)[slots], vs)):
        deq = got.float() * s.view(1, hk, 1)
        # Documented: relative 2**-4 for normal values, absolute 2**-10 * scale for subnormals.
        bound = torch.maximum(x.abs() * 2**-4, 2**-10 * s.view(1, hk, 1).expand_as(x))
        assert bool(((deq - x).abs() <= bound * (1 + 1e-6)).all())


def test_fp8_saturates_and_unit_scale_default() -> None:
    kc = torch.zeros(1, 8, 1, 16, dtype=torch.float8_e4m3fn)
    vc = torch.zeros_like(kc)
    k = torch.full((2, 1, 16), 1000.0)
    k[1] = -1000.0
    reshape_and_cache(k, k.clone(), kc, vc, torch.tensor([0, 1]))
    assert bool((kc[0, 0].float() == 448.0).all()) and bool((kc[0, 1].float() == -448.0).all())


def test_errors() -> None:
    kc = torch.zeros(4, 16, 2, 32)
    vc = torch.zeros_like(kc)
    k = torch.randn(3, 2, 32)
    with pytest.raises(ValueError, match="slot_mapping"):
        reshape_and_cache(k, k, kc, vc, torch.tensor([0, 1, 64]))
    with pytest.raises(TypeError, match="slot_mapping"):
        reshape_and_cache(k, k, kc, vc, torch.tensor([0, 1, 2], dtype=torch.int32))
    with pytest.raises(ValueError, match="slot_mapping"):
        reshape_and_cache(k, k, kc, vc, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="key"):
        reshape_and_cache(torch.randn(3, 4, 32), torch.randn(3, 4, 32), kc, vc, torch.tensor([0, 1, 2]))
    with pytest.raises(TypeError, match="key_cache"):
        reshape_and_cache(k, k, kc.half(), vc.half(), torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="k_scale"):
        reshape_and_cache(k, k, kc, vc, torch.tensor([0, 1, 2]), k_scale=torch.ones(2))
    kc8 = torch.zeros(4, 16, 2, 32, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="k_scale"):
        reshape_and_cache(k, k, kc8, kc8.clone(), torch.tensor([0, 1, 2]), k_scale=torch.ones(3))


def test_fp8_rounding_matches_torch_on_every_tie() -> None:
    """All e4m3 values, the midpoints between neighbours (ties: round half to even) and values just
    either side of them, through the kernel with unit scale: bit-identical to torch's conversion."""
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[torch.isfinite(grid)].unique()  # sorted, -448 .. 448
    mids = (grid[1:] + grid[:-1]) / 2
    x = torch.cat(
        [grid, mids, mids.nextafter(torch.tensor(float("inf"))), mids.nextafter(torch.tensor(float("-inf")))]
    )
    n = x.numel()
    d = 16
    x = torch.cat([x, torch.zeros((-n) % d)]).view(-1, 1, d)
    kc = torch.zeros(x.shape[0], 1, 1, d, dtype=torch.float8_e4m3fn)
    reshape_and_cache(x, x, kc, kc.clone(), torch.arange(x.shape[0]))
    want = x.to(torch.float8_e4m3fn)
    assert torch.equal(kc.view(-1, 1, d).view(torch.uint8), want.view(torch.uint8))
