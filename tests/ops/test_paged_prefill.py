"""Paged (chunked) prefill vs the contiguous reference (Triton interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from flashpage.ops.cache_write import fp8_kv_scales, reshape_and_cache
from flashpage.ops.paged_decode import PagedAttnConfig
from flashpage.ops.paged_prefill import paged_prefill
from flashpage.ops.reference import attention_ref, gather_paged_kv
from tests.ops.test_paged_decode import make_paged_cache, on_device  # noqa: F401 (autouse fixture)
from tests.tolerance import assert_close_to_ref


def _varlen_paged_ref(
    q: Tensor,
    kc: Tensor,
    vc: Tensor,
    bt: Tensor,
    cu: Tensor,
    seqlens_k: Tensor,
    upcast: bool = True,
    **kw: object,
) -> tuple[Tensor, Tensor]:
    """Per-sequence reference: sequence b's packed queries over its first seqlens_k[b] cached keys."""
    out = torch.zeros(q.shape, dtype=torch.float32 if upcast else q.dtype)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"))
    alibi = kw.pop("alibi_slopes", None)
    for b in range(len(seqlens_k)):
        s, e, n = int(cu[b]), int(cu[b + 1]), int(seqlens_k[b])
        kk = gather_paged_kv(kc, bt, n, b).unsqueeze(0)
        vv = gather_paged_kv(vc, bt, n, b).unsqueeze(0)
        a = alibi[b] if isinstance(alibi, Tensor) and alibi.dim() == 2 else alibi
        o, lb = attention_ref(q[s:e].unsqueeze(0), kk, vv, upcast=upcast, alibi_slopes=a, **kw)[:2]  # type: ignore[arg-type]
        out[s:e], lse[:, s:e] = o[0], lb[0]
    return out, lse


def _setup(
    q_lens: list[int], prefix: list[int], block_size: int, nheads: int, nheads_k: int, d: int = 32
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    lens = [p + n for p, n in zip(prefix, q_lens)]
    kc, vc, bt, sl = make_paged_cache(lens, block_size, nheads_k, d)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(cu[-1]), nheads, d)
    return q, kc, vc, bt, sl, cu


@pytest.mark.parametrize(
    ("block_size", "nheads", "nheads_k", "q_lens", "prefix", "num_splits"),
    [
        (
            16,
            8,
            2,
            [5, 1, 40],
            [0, 17, 48],
            1,
        ),  # prefix-free, decode-like, chunk after an exact block multiple
        (8, 4, 4, [33, 7], [9, 60], 1),  # MHA, tiny pages
        (32, 8, 1, [20, 3], [70, 0], 2),  # MQA (group 8): 16 rows = 2 queries per tile; split prefix
        (256, 8, 2, [30, 20], [270, 1], 3),  # big pages
    ],
)
def test_chunked_prefill_matches_reference(
    block_size: int, nheads: int, nheads_k: int, q_lens: list[int], prefix: list[int], num_splits: int
) -> None:
    q, kc, vc, bt, sl, cu = _setup(q_lens, prefix, block_size, nheads, nheads_k)
    # Small tiles so the tiny shapes still have several query and key tiles per sequence.
    cfg = PagedAttnConfig(block_m=16, block_n=16)
    out, lse = paged_prefill(
        q, kc, vc, cu, sl, bt, max(q_lens), num_splits=num_splits, config=cfg, return_lse=True
    )
    ref, ref_lse = _varlen_paged_ref(q, kc, vc, bt, cu, sl, causal=True)
    same, _ = _varlen_paged_ref(q, kc, vc, bt, cu, sl, upcast=False, causal=True)
    assert_close_to_ref(out, ref, same)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)


def test_prefill_relaunches_its_bound_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """``paged_prefill`` binds its first launch per layout (the eager launcher); the next layers'
    calls (new queries and caches, other key lengths, same layout) relaunch it, each with its own
    split workspace, and match the reference."""
    from flashpage.ops import paged_launch as pl
    from flashpage.ops.paged_kernel import paged_attn_kernel

    memo = pl.PagedLauncher()
    monkeypatch.setattr(paged_attn_kernel, "_flashpage_eager", memo, raising=False)
    q, kc, vc, bt, sl, cu = _setup([20, 3], [70, 0], 32, 8, 1)
    cfg = PagedAttnConfig(block_m=16, block_n=16)

    def check(q: Tensor, kc: Tensor, vc: Tensor, sl: Tensor) -> None:
        out, lse = paged_prefill(q, kc, vc, cu, sl, bt, 20, num_splits=2, config=cfg, return_lse=True)
        ref, ref_lse = _varlen_paged_ref(q, kc, vc, bt, cu, sl, causal=True)
        same, _ = _varlen_paged_ref(q, kc, vc, bt, cu, sl, upcast=False, causal=True)
        assert_close_to_ref(out, ref, same)
        torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)

    check(q, kc, vc, sl)
    assert len(memo) == 1

    def unbound(*args: object, **kwargs: object) -> None:
        raise AssertionError("a bound layout went through PagedLauncher.bind")

    monkeypatch.setattr(pl.PagedLauncher, "bind", unbound)
    check(torch.randn_like(q), torch.randn_like(kc), torch.randn_like(vc), sl)
    check(torch.randn_like(q), kc, vc, sl - torch.tensor([9, 0], dtype=torch.int32))
    assert len(memo) == 1


@pytest.mark.parametrize(
    "opts",
    [
        {"window_size": (10, 0)},
        {"softcap": 4.0, "alibi": "2d"},
        {"window_size": (25, -1), "alibi": "1d", "num_splits": 2},
        {"window_size": (25, -1), "num_splits": 3, "prefetch": True},
        {"prefetch": True},
    ],
)
def test_prefill_options(opts: dict[str, object]) -> None:
    q_lens, prefix, nheads, nheads_k = [24, 9], [30, 50], 8, 2
    q, kc, vc, bt, sl, cu = _setup(q_lens, prefix, 16, nheads, nheads_k)
    kw: dict[str, object] = {k: v for k, v in opts.items() if k in ("window_size", "softcap")}
    if opts.get("alibi") == "1d":
        kw["alibi_slopes"] = torch.rand(nheads)
    elif opts.get("alibi") == "2d":
        kw["alibi_slopes"] = torch.rand(len(q_lens), nheads)
    # prefetch_table: 32-key tiles over 16-token pages, the next tile's block ids loaded ahead.
    cfg = PagedAttnConfig(block_m=32, block_n=32, prefetch_table=True) if opts.get("prefetch") else PagedAttnConfig(block_m=32, block_n=16)  # fmt: skip
    splits = int(opts.get("num_splits", 1))  # type: ignore[call-overload]
    out = paged_prefill(q, kc, vc, cu, sl, bt, max(q_lens), num_splits=splits, config=cfg, **kw)  # type: ignore[arg-type]
    ref, _ = _varlen_paged_ref(q, kc, vc, bt, cu, sl, causal=True, **dict(kw))
    same, _ = _varlen_paged_ref(q, kc, vc, bt, cu, sl, upcast=False, causal=True, **dict(kw))
    assert_close_to_ref(out, ref, same)


def test_default_prefill_tiles_and_fp8() -> None:
    """The default 128-row tiles, and an fp8 cache (dequantised reference)."""
    q_lens, prefix = [40, 6], [20, 3]
    q, kc, vc, bt, sl, cu = _setup(q_lens, prefix, 16, 8, 2)
    out = paged_prefill(q, kc, vc, cu, sl, bt, max(q_lens))
    ref, _ = _varlen_paged_ref(q, kc, vc, bt, cu, sl, causal=True)
    same, _ = _varlen_paged_ref(q, kc, vc, bt, cu, sl, upcast=False, causal=True)
    assert_close_to_ref(out, ref, same)
    ks, vs = fp8_kv_scales(kc), fp8_kv_scales(vc)
    kc8 = torch.zeros(kc.shape, dtype=torch.float8_e4m3fn)
    vc8 = torch.zeros_like(kc8)
    slots = torch.arange(kc.shape[0] * kc.shape[1])
    reshape_and_cache(kc.flatten(0, 1), vc.flatten(0, 1), kc8, vc8, slots, k_scale=ks, v_scale=vs)
    out8 = paged_prefill(q, kc8, vc8, cu, sl, bt, max(q_lens), k_scale=ks, v_scale=vs)
    kd, vd = kc8.float() * ks.view(1, 1, -1, 1), vc8.float() * vs.view(1, 1, -1, 1)
    ref8, _ = _varlen_paged_ref(q, kd, vd, bt, cu, sl, causal=True)
    same8, _ = _varlen_paged_ref(q, kd, vd, bt, cu, sl, upcast=False, causal=True)
    assert_close_to_ref(out8, ref8, same8)


def test_prefill_errors() -> None:
    q, kc, vc, bt, sl, cu = _setup([5, 3], [10, 0], 16, 8, 2)
    with pytest.raises(TypeError, match="cu_seqlens_q"):
        paged_prefill(q, kc, vc, cu.long(), sl, bt, 5)
    with pytest.raises(ValueError, match="max_seqlen_q"):
        paged_prefill(q, kc, vc, cu, sl, bt, 4)
    with pytest.raises(ValueError, match="seqlens_k"):
        paged_prefill(q, kc, vc, cu, torch.tensor([15, 2], dtype=torch.int32), bt, 5)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        paged_prefill(q, kc, vc, torch.tensor([0, 5, 7], dtype=torch.int32), sl, bt, 5)
    bad = bt.clone()
    bad[0, 0] = -1
    with pytest.raises(ValueError, match="block_table"):
        paged_prefill(q, kc, vc, cu, sl, bad, 5)
    with pytest.raises(ValueError, match="q"):
        paged_prefill(q.unsqueeze(0), kc, vc, cu, sl, bt, 5)


def test_default_prefill_config_by_head_dim_and_device() -> None:
    from flashpage.ops.paged_prefill import default_prefill_config

    cpu = torch.device("cpu")
    assert (
        default_prefill_config(128, cpu, torch.bfloat16).block_m,
        default_prefill_config(128).block_n,
    ) == (128, 64)
    assert default_prefill_config(256, cpu, torch.bfloat16).block_m == 64


def test_hopper_prefill_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    """Hopper: gathered small pages prefetch the block table, whole-tile pages take TMA under triton
    >= 3.9 (pointer loads before), and every default gives each warp 16 query rows (fewer make
    Triton repeat the score MMAs per warpgroup)."""
    import flashpage.ops.paged_prefill as pp

    monkeypatch.setattr(pp, "gpu_family", lambda device: "hopper")
    dev = torch.device("cpu")
    for version, tma in (((3, 6), False), ((3, 9), True), ((4, 0), True)):
        monkeypatch.setattr(pp, "triton_version", lambda version=version: version)
        small, big = (pp.default_prefill_config(128, dev, torch.bfloat16, bs) for bs in (16, 128))
        assert small.prefetch_table and not small.use_tma
        assert big.use_tma == tma and big.block_n <= 128
        assert pp.default_prefill_config(256, dev, torch.bfloat16, 64).use_tma == tma
        assert pp.default_prefill_config(256, dev, torch.bfloat16, 32).use_tma is False
        assert pp.default_prefill_config(128, dev, torch.bfloat16, 128, tma=not tma).use_tma == (not tma)
    for d in (64, 128, 256):
        for bs in (8, 16, 64, 256):
            c = pp.default_prefill_config(d, dev, torch.float16, bs)
            assert c.block_m >= 16 * c.num_warps, c
            assert c.block_n <= bs or not c.use_tma, c  # TMA tiles lie inside one page


def _varlen_paged_case() -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Three sequences (no prefix; one query after 17 cached; 40 after 48) over 16-token pages, GQA 8/2:
    ``q, k_cache, v_cache, block_table, seqlens_k, cu_seqlens_q, cu_seqlens_k``."""
    q, kc, vc, bt, sl, cu = _setup([5, 1, 40], [0, 17, 48], 16, 8, 2)
    cu_k = torch.cat((sl.new_zeros(1), sl.cumsum(0))).to(torch.int32)
    return q, kc, vc, bt, sl, cu, cu_k


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_flash_attn_varlen_func_over_a_paged_cache(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """flash-attn >= 2.6's paged varlen call: k/v are the caches, cu_seqlens_k sums each sequence's
    cached keys, queries are the last positions (the paged prefill kernel on Triton)."""
    from flashpage.ops.flash_attn import flash_attn_varlen_func

    monkeypatch.setenv("FLASHPAGE_BACKEND", backend)
    q, kc, vc, bt, sl, cu, cu_k = _varlen_paged_case()
    out, lse, probs = flash_attn_varlen_func(
        q, kc, vc, cu, cu_k, 40, int(sl.max()), causal=True, return_attn_probs=True, block_table=bt
    )  # type: ignore[misc]
    ref, ref_lse = _varlen_paged_ref(q, kc, vc, bt, cu, sl, causal=True)
    same, _ = _varlen_paged_ref(q, kc, vc, bt, cu, sl, upcast=False, causal=True)
    assert_close_to_ref(out, ref, same)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)
    assert probs.shape == (3, 8, 40, int(sl.max()))
    # S_dmask rows are softmax rows: those of sequence 1's single query sum to 1 over its 18 keys.
    torch.testing.assert_close(probs[1, :, 0].sum(-1), torch.ones(8), atol=1e-5, rtol=0)
    plain = flash_attn_varlen_func(q, kc, vc, cu, cu_k, 40, int(sl.max()), causal=True, block_table=bt)
    assert torch.equal(plain, out)  # type: ignore[arg-type]


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_paged_varlen_errors(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from flashpage.ops.flash_attn import flash_attn_varlen_func

    monkeypatch.setenv("FLASHPAGE_BACKEND", backend)
    q, kc, vc, bt, sl, cu, cu_k = _varlen_paged_case()
    args = (q, kc, vc, cu, cu_k, 40, int(sl.max()))
    with pytest.raises(ValueError, match="dropout"):
        flash_attn_varlen_func(*args, dropout_p=0.1, block_table=bt)
    out = flash_attn_varlen_func(q.clone().requires_grad_(), *args[1:], block_table=bt)  # forward runs
    with pytest.raises(RuntimeError, match="no backward"):
        out.sum().backward()  # type: ignore[union-attr]
    with pytest.raises(TypeError, match="cu_seqlens_k must be int32"):
        flash_attn_varlen_func(q, kc, vc, cu, cu_k.long(), 40, 64, block_table=bt)
    with pytest.raises(ValueError, match="block_table must be"):
        flash_attn_varlen_func(*args, block_table=bt[0])
    with pytest.raises(ValueError, match="seqlens_k"):  # more keys than the table covers
        flash_attn_varlen_func(q, kc, vc, cu, cu_k * 4, 40, 500, block_table=bt)


def test_paged_varlen_traces_whole_under_torch_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch._dynamo.backends.debugging import aot_eager

    from flashpage.ops.flash_attn import flash_attn_varlen_func

    monkeypatch.setenv("FLASHPAGE_BACKEND", "triton")
    q, kc, vc, bt, _, cu, cu_k = _varlen_paged_case()

    def attend(q: Tensor, kc: Tensor, vc: Tensor) -> Tensor:
        return flash_attn_varlen_func(  # type: ignore[return-value]
            q, kc, vc, cu, cu_k, 40, 64, causal=True, window_size=(8, 0), block_table=bt
        )

    targets: set[str] = set()

    def backend(gm: torch.fx.GraphModule, inputs: list[Tensor]) -> object:
        targets.update(str(node.target) for node in gm.graph.nodes)
        return aot_eager(gm, inputs)

    torch._dynamo.reset()
    got = torch.compile(attend, fullgraph=True, backend=backend)(q, kc, vc)
    assert "flashpage.paged_varlen_attention.default" in targets, targets
    assert torch.equal(got, attend(q, kc, vc))


def test_paged_varlen_decode_batch_uses_decode_tiles() -> None:
    """A decode batch through the varlen API (one query per sequence) runs the decode tiles and
    returns what flash_attn_with_kvcache returns for the same cache."""
    from flashpage.ops.flash_attn import flash_attn_varlen_func
    from flashpage.ops.kvcache import flash_attn_with_kvcache
    from flashpage.ops.paged_decode import default_decode_config
    from flashpage.ops.paged_prefill import DECODE_ROWS, default_prefill_config, kv_attention_config

    q, kc, vc, bt, sl, cu = _setup([1, 1, 1], [0, 17, 48], 16, 8, 2)
    assert kv_attention_config(q, kc, 1) == default_decode_config(kc.dtype, 32, paged=True)
    rows_max = DECODE_ROWS // 4  # GQA group 4
    assert kv_attention_config(q, kc, rows_max + 1) == default_prefill_config(32, q.device, kc.dtype, 16)
    cu_k = torch.cat((sl.new_zeros(1), sl.cumsum(0))).to(torch.int32)
    out = flash_attn_varlen_func(q, kc, vc, cu, cu_k, 1, int(sl.max()), causal=True, block_table=bt)
    want = flash_attn_with_kvcache(q.unsqueeze(1), kc, vc, cache_seqlens=sl, block_table=bt, causal=True)
    torch.testing.assert_close(out, want[:, 0], atol=2e-6, rtol=2e-6)  # type: ignore[index]
    ref, _ = _varlen_paged_ref(q, kc, vc, bt, cu, sl, causal=True)
    same, _ = _varlen_paged_ref(q, kc, vc, bt, cu, sl, upcast=False, causal=True)
    assert_close_to_ref(out, ref, same)
