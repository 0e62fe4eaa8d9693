"""Paged split-KV decode vs the contiguous reference (Triton interpreter on CPU, tiny shapes)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import pytest
import torch
from torch import Tensor

from flashpage.ops.cache_write import fp8_kv_scales, reshape_and_cache
from flashpage.ops.paged_decode import paged_decode
from flashpage.ops.paged_launch import (
    PagedAttnConfig,
    check_paged_values,
    default_decode_config,
    kv_heads_per_program,
    paged_grid,
    paged_tiles,
    v_pairs_apply,
    wide_offsets,
)
from flashpage.ops.paged_plan import plan_decode, run_decode
from flashpage.ops.reference import paged_attention_ref
from flashpage.ops.utils import cdiv, default_num_sms
from flashpage.roofline.planner import choose_heads_per_program, choose_num_splits
from tests.tolerance import assert_close_to_ref


@pytest.fixture(autouse=True)
def on_device(device: str) -> Iterator[None]:
    """Create every test tensor on the test device (CUDA when present, else CPU + interpreter).

    Imported by the other paged-attention test modules, so the same tests run on a GPU machine.
    """
    with torch.device(device):
        yield


def make_paged_cache(
    lens: list[int],
    block_size: int,
    nheads_k: int,
    d: int,
    dtype: torch.dtype = torch.float32,
    spare_blocks: int = 3,
    extra_cols: int = 1,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Random K/V caches whose sequences own a random permutation of the blocks.

    Returns ``k_cache, v_cache (num_blocks, block_size, nheads_k, d)``, ``block_table (batch, width)``
    int32 (rows padded with valid spare ids) and ``seqlens (batch,)`` int32.
    """
    need = [(n + block_size - 1) // block_size for n in lens]
    width = max(need) + extra_cols
    num_blocks = sum(need) + spare_blocks
    perm = torch.randperm(num_blocks)
    rows, at = [], 0
    for n in need:
        own = perm[at : at + n].tolist()
        at += n
        rows.append(own + perm[-1:].tolist() * (width - n))
    k_cache = torch.randn(num_blocks, block_size, nheads_k, d).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, nheads_k, d).to(dtype)
    return k_cache, v_cache, torch.tensor(rows, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32)


def _refs(
    q: Tensor, kc: Tensor, vc: Tensor, bt: Tensor, sl: Tensor, **kw: object
) -> tuple[Tensor, Tensor, Tensor]:
    """fp32 reference (out, lse) and same-precision out for ``q (batch, sq, nheads, d)``."""
    ref, lse = paged_attention_ref(q, kc, vc, bt, sl, **kw)
    same, _ = paged_attention_ref(q, kc, vc, bt, sl, upcast=False, **kw)
    return ref, lse, same


@pytest.mark.parametrize(
    ("block_size", "nheads", "nheads_k", "lens", "num_splits"),
    [
        (16, 8, 2, [1, 37, 64], 1),  # GQA 4, ragged incl. 1 and an exact block multiple
        (16, 8, 2, [1, 37, 64], 3),  # uneven split count
        (8, 8, 1, [8, 29, 70], 8),  # MQA (group 8), tiny pages: tiles span many blocks
        (32, 4, 4, [96, 5], 2),  # MHA
        (256, 8, 2, [300, 1, 256], 0),  # big pages: several tiles per block; planner's split count
    ],
)
def test_decode_matches_reference(
    block_size: int, nheads: int, nheads_k: int, lens: list[int], num_splits: int
) -> None:
    d = 32
    kc, vc, bt, sl = make_paged_cache(lens, block_size, nheads_k, d)
    q = torch.randn(len(lens), nheads, d)
    out, lse = paged_decode(q, kc, vc, bt, sl, num_splits=num_splits, return_lse=True)
    ref, ref_lse, same = _refs(q.unsqueeze(1), kc, vc, bt, sl, causal=True)
    assert out.shape == q.shape and lse.shape == (len(lens), nheads)
    assert_close_to_ref(out, ref[:, 0], same[:, 0])
    torch.testing.assert_close(lse, ref_lse[..., 0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "opts",
    [
        {"window_size": (20, 0)},
        {"softcap": 3.0},
        {"alibi": "1d", "num_splits": 2},
        {"alibi": "2d", "softcap": 2.0, "window_size": (40, -1), "num_splits": 4},
    ],
)
def test_decode_options(opts: dict[str, object]) -> None:
    lens, nheads, nheads_k, d = [3, 77, 48], 8, 2, 32
    kc, vc, bt, sl = make_paged_cache(lens, 16, nheads_k, d)
    q = torch.randn(len(lens), nheads, d)
    kw: dict[str, object] = {k: v for k, v in opts.items() if k in ("window_size", "softcap")}
    if opts.get("alibi") == "1d":
        kw["alibi_slopes"] = torch.rand(nheads)
    elif opts.get("alibi") == "2d":
        kw["alibi_slopes"] = torch.rand(len(lens), nheads)
    out, lse = paged_decode(
        q, kc, vc, bt, sl, num_splits=int(opts.get("num_splits", 1)), return_lse=True, **kw
    )  # type: ignore[arg-type]
    ref, ref_lse, same = _refs(q.unsqueeze(1), kc, vc, bt, sl, causal=True, **kw)
    assert_close_to_ref(out, ref[:, 0], same[:, 0])
    torch.testing.assert_close(lse, ref_lse[..., 0], atol=1e-5, rtol=1e-5)


def test_multi_query_decode_and_empty_rows() -> None:
    """seqlen_q > 1 (speculative tokens), bottom-right causal; a 2-key sequence with 3 queries has a
    query that sees nothing: zeros and lse = -inf."""
    lens, nheads, nheads_k, d = [2, 50, 33], 8, 2, 32
    kc, vc, bt, sl = make_paged_cache(lens, 16, nheads_k, d)
    q = torch.randn(len(lens), 3, nheads, d)
    for splits in (1, 3):
        out, lse = paged_decode(q, kc, vc, bt, sl, num_splits=splits, return_lse=True)
        ref, ref_lse, same = _refs(q, kc, vc, bt, sl, causal=True)
        assert_close_to_ref(out, ref, same)
        assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)) and bool(torch.isinf(lse[0, :, 0]).all())
        fin = torch.isfinite(ref_lse)
        torch.testing.assert_close(lse[fin], ref_lse[fin], atol=1e-5, rtol=1e-5)
        assert bool((out[0, 0] == 0).all())


def test_bf16_and_odd_head_dim() -> None:
    """bf16 caches (the interpreter computes them in fp32) and d=40 (padded to 64 in the kernel)."""
    lens = [19, 64]
    for dtype, d in ((torch.bfloat16, 64), (torch.float32, 40)):
        kc, vc, bt, sl = make_paged_cache(lens, 16, 2, d, dtype=dtype)
        q = torch.randn(2, 8, d).to(dtype)
        out = paged_decode(q, kc, vc, bt, sl, num_splits=2)
        ref, _, same = _refs(q.unsqueeze(1), kc, vc, bt, sl, causal=True)
        assert out.dtype == dtype
        assert_close_to_ref(out, ref[:, 0], same[:, 0])


def test_kernel_configs_agree() -> None:
    """Every tile configuration the benchmark sweeps computes the same thing."""
    lens = [100, 17]
    kc, vc, bt, sl = make_paged_cache(lens, 16, 2, 32)
    q = torch.randn(2, 8, 32)
    ref, _, same = _refs(q.unsqueeze(1), kc, vc, bt, sl, causal=True)
    for cfg in (
        PagedAttnConfig(block_n=16),
        PagedAttnConfig(block_n=128, num_warps=8),
        PagedAttnConfig(block_m=32, block_n=32),
        PagedAttnConfig(block_n=32, num_stages=3, prefetch_table=True),  # 2 pages per tile
        PagedAttnConfig(block_n=128, num_warps=8, prefetch_table=True),
        PagedAttnConfig(heads_first=True, pdl=True, combine_block_d=16, combine_warps=1),  # 2 column blocks
    ):
        for splits in (1, 2, 3):
            out = paged_decode(q, kc, vc, bt, sl, num_splits=splits, config=cfg)
            assert_close_to_ref(out, ref[:, 0], same[:, 0])


def test_narrow_offsets_equal_wide() -> None:
    """32-bit KV-row offsets (the default where the caches allow) give bit-identical results to
    64-bit ones, gathered pages and block-sized tiles, split or not."""
    lens = [100, 17, 64]
    kc, vc, bt, sl = make_paged_cache(lens, 16, 2, 32)
    q = torch.randn(3, 8, 32)
    for cfg in (
        PagedAttnConfig(),
        PagedAttnConfig(block_n=16),
        PagedAttnConfig(block_n=32, prefetch_table=True),
    ):
        assert cfg.narrow_offsets and not wide_offsets(cfg, kc, vc, paged=True)
        wide = replace(cfg, narrow_offsets=False)
        assert wide_offsets(wide, kc, vc, paged=True)
        for splits in (1, 3):
            narrow_out = paged_decode(q, kc, vc, bt, sl, num_splits=splits, config=cfg)
            wide_out = paged_decode(q, kc, vc, bt, sl, num_splits=splits, config=wide)
            assert torch.equal(narrow_out, wide_out)


def test_wide_offsets_rule() -> None:
    """64-bit offsets exactly when an element lies 2**31 or more past the cache's base (shapes and
    strides only: meta tensors stand in for caches too large to allocate here)."""
    cfg = PagedAttnConfig()

    def cache(num_blocks: int, strides: tuple[int, ...] | None = None) -> Tensor:
        t = torch.empty(num_blocks, 16, 8, 128, device="meta")
        return t if strides is None else t.as_strided(t.shape, strides)

    # 16 * 8 * 128 = 2**14 elements per block: block 2**17 starts at 2**31.
    small, edge, big = cache(2**17), cache(2**17 + 1), cache(2**20)
    assert not wide_offsets(cfg, small, small, paged=True)  # last element 2**31 - 1
    assert wide_offsets(cfg, edge, small, paged=True)
    assert wide_offsets(cfg, small, big, paged=True)  # either cache decides
    assert wide_offsets(cfg, small, small, paged=False)  # contiguous caches stay 64-bit
    assert wide_offsets(PagedAttnConfig(narrow_offsets=False), small, small, paged=True)
    # Strides, not the element count: a head-major view of a too-large storage.
    spread = cache(4, strides=(16 * 128, 128, 2**29, 1))
    assert wide_offsets(cfg, spread, spread, paged=True)


def test_grid_order_and_decode_defaults() -> None:
    """The KV-head-first grid is the decode default and falls back to split-first when the
    programs per (sequence, KV head) exceed CUDA's grid y limit; contiguous caches get the deeper
    pipeline their unindirected loads want."""
    cfg = default_decode_config(torch.bfloat16, 128)
    assert cfg.heads_first and cfg.pdl and cfg.num_stages == 2
    assert paged_grid(cfg, 1, 64, 8, 1) == (8, 64, 1)
    assert paged_grid(cfg, 1024, 64, 8, 2) == (1024 * 64, 8, 2)  # y would be > 65535
    assert paged_grid(PagedAttnConfig(), 3, 2, 8, 4) == (6, 8, 4)
    assert default_decode_config(torch.bfloat16, 128, paged=False).num_stages == 4
    assert default_decode_config(torch.float8_e4m3fn, 128, paged=False).num_stages == 3
    # fp8: byte pairs under the 128-register cap where the head dim allows the pairs; otherwise
    # neither (the byte path spills at 128 registers).
    f8 = default_decode_config(torch.float8_e4m3fn, 128)
    assert f8.v_pairs and f8.maxnreg == 128
    f8_96 = default_decode_config(torch.float8_e4m3fn, 96)
    assert not f8_96.v_pairs and f8_96.maxnreg == 0
    plan = plan_decode(
        2, 8, 2, 32, block_size=16, max_seqlen_k=256, q_dtype=torch.float32, device="cpu", num_splits=3
    )
    assert plan.grid == (1, 3, 2)  # both KV heads (group 4: 8 rows) in one program
    one = replace(cfg, heads_per_program=1)
    plan = plan_decode(
        2, 8, 2, 32, block_size=16, max_seqlen_k=256, q_dtype=torch.float32, device="cpu", num_splits=3,
        config=one,
    )  # fmt: skip
    assert plan.grid == (2, 3, 2)


def test_heads_per_program_rule() -> None:
    """Auto (0) fills 16 query rows, lowered to a power of two dividing nheads_k and block_n; fp8
    caches and TMA tiles keep one head; the planner counts head-group programs and tile tokens."""
    auto = default_decode_config(torch.bfloat16, 128)
    assert auto.heads_per_program == 0
    assert default_decode_config(torch.float8_e4m3fn, 128).heads_per_program == 1
    bf16, fp8 = torch.bfloat16, torch.float8_e4m3fn
    assert kv_heads_per_program(auto, 1, 4, 8, bf16) == 4  # Llama-3 GQA 32/8
    assert kv_heads_per_program(auto, 1, 8, 8, bf16) == 2
    assert kv_heads_per_program(auto, 1, 1, 32, bf16) == 16  # MHA
    assert kv_heads_per_program(auto, 1, 1, 6, bf16) == 2  # 6 KV heads: largest power-of-two divisor
    assert kv_heads_per_program(auto, 4, 4, 8, bf16) == 1  # 16 rows already
    assert kv_heads_per_program(auto, 2, 3, 8, bf16) == 2  # 6 rows -> 8: 2 heads
    assert kv_heads_per_program(auto, 1, 4, 8, fp8) == 1
    assert kv_heads_per_program(replace(auto, use_tma=True), 1, 4, 8, bf16) == 1
    assert kv_heads_per_program(replace(auto, block_n=16, heads_per_program=32), 1, 1, 64, bf16) == 16
    t = paged_tiles(auto, 1, 32, 8, bf16)
    assert (t.block_m, t.q_tiles, t.heads, t.head_programs, t.tile_tokens) == (16, 1, 4, 2, 16)
    t = paged_tiles(auto, 3, 32, 8, bf16)  # 12 rows per head: one head, one 16-row tile
    assert (t.block_m, t.q_tiles, t.heads, t.head_programs, t.tile_tokens) == (16, 1, 1, 8, 64)
    t = paged_tiles(replace(auto, block_m=16), 6, 32, 8, bf16)  # 24 rows: 2 tiles of 4 tokens
    assert (t.block_m, t.q_tiles, t.heads, t.head_programs, t.tile_tokens) == (16, 2, 1, 8, 64)
    with pytest.raises(ValueError, match="heads_per_program"):
        PagedAttnConfig(heads_per_program=3)


def test_head_major_cache_storage() -> None:
    """The kernels take the caches' strides: a head-major physical storage of the same logical
    ``(num_blocks, block_size, nheads_k, d)`` view (each head's page rows contiguous) decodes alike."""
    lens = [70, 5, 33]
    kc, vc, bt, sl = make_paged_cache(lens, 16, 2, 32)
    kh, vh = (c.permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3) for c in (kc, vc))
    assert not kh.is_contiguous() and torch.equal(kh, kc)
    q = torch.randn(3, 8, 32)
    ref, _, same = _refs(q.unsqueeze(1), kc, vc, bt, sl)
    for splits in (1, 2):
        out = paged_decode(q, kh, vh, bt, sl, num_splits=splits)
        assert_close_to_ref(out, ref[:, 0], same[:, 0])


@pytest.mark.parametrize("cfg", [PagedAttnConfig(block_n=32, early_v=True, combine_warps=1),
                                 PagedAttnConfig(heads_first=True, combine_block_d=16)],
                         ids=["early-v", "heads-first"])  # fmt: skip
def test_split_combine_variants(cfg: PagedAttnConfig, device: str) -> None:
    """The combine kernel over column blocks equals the reference, multi-query rows with nothing
    visible included (outputs and LSE), twice on a plan's one workspace (reused by every layer and
    every CUDA-graph replay)."""
    lens, nheads, nheads_k, d = [2, 150, 33], 8, 2, 32
    kc, vc, bt, sl = make_paged_cache(lens, 16, nheads_k, d)
    q = torch.randn(len(lens), 3, nheads, d)
    plan = plan_decode(
        3, nheads, nheads_k, d, block_size=16, max_seqlen_k=150, seqlen_q=3, q_dtype=torch.float32,
        device=device, num_splits=3, config=cfg,
    )  # fmt: skip
    assert plan.workspace is not None
    ref, ref_lse, same = _refs(q, kc, vc, bt, sl, causal=True)
    lse = torch.empty(3 * 3, nheads)
    for _ in range(2):
        out = run_decode(plan, q, kc, vc, bt, sl, lse=lse)
        assert_close_to_ref(out, ref, same)
    lse_bqh = lse.view(3, 3, nheads)
    assert bool(torch.isinf(lse_bqh[0, 0]).all())
    fin = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse_bqh.permute(0, 2, 1)[fin], ref_lse[fin], atol=1e-5, rtol=1e-5)
    out2, lse2 = paged_decode(q, kc, vc, bt, sl, num_splits=4, config=cfg, return_lse=True)
    assert_close_to_ref(out2, ref, same)
    torch.testing.assert_close(lse2[fin], ref_lse[fin], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn])
def test_tma_kv_tiles(dtype: torch.dtype) -> None:
    """TMA descriptor loads of mask-free tiles inside a page (block_size >= block_n) agree with the
    reference, for decode with splits and for multi-query rows; fp8 caches dequantised in-kernel."""
    lens = [100, 17, 64]
    kc, vc, bt, sl = make_paged_cache(lens, 32, 2, 32)
    q = torch.randn(3, 2, 8, 32)
    kw: dict[str, object] = {}
    if dtype != torch.float32:
        kc, vc = kc.to(dtype), vc.to(dtype)
        kw = {"k_scale": torch.ones(2), "v_scale": torch.ones(2)}
    ref, _, same = _refs(q, kc.float(), vc.float(), bt, sl, causal=True)
    for cfg in (
        PagedAttnConfig(block_n=16, use_tma=True),
        PagedAttnConfig(block_n=32, use_tma=True, early_v=True),
    ):
        out = paged_decode(q, kc, vc, bt, sl, num_splits=2, config=cfg, **kw)  # type: ignore[arg-type]
        assert_close_to_ref(out, ref, same)


def test_fp8_kv_within_documented_error() -> None:
    """fp8 e4m3 cache with per-head scales: exact w.r.t. the dequantised cache; vs the unquantised
    cache the error stays within the documented e4m3 bound."""
    lens, nheads, nheads_k, d, bs = [40, 9], 8, 2, 32, 16
    kc, vc, bt, sl = make_paged_cache(lens, bs, nheads_k, d)
    kc[:, :, 1] *= 4.0  # heads with different ranges: per-head scales matter
    ks, vs = fp8_kv_scales(kc), fp8_kv_scales(vc)
    kc8 = torch.zeros(kc.shape, dtype=torch.float8_e4m3fn)
    vc8 = torch.zeros_like(kc8)
    slots = torch.arange(kc.shape[0] * bs)
    reshape_and_cache(
        kc.view(-1, nheads_k, d), vc.view(-1, nheads_k, d), kc8, vc8, slots, k_scale=ks, v_scale=vs
    )
    q = torch.randn(2, nheads, d)
    out = paged_decode(q, kc8, vc8, bt, sl, k_scale=ks, v_scale=vs, num_splits=2)
    kd, vd = kc8.float() * ks.view(1, 1, -1, 1), vc8.float() * vs.view(1, 1, -1, 1)
    ref_dq, _, same_dq = _refs(q.unsqueeze(1), kd, vd, bt, sl, causal=True)
    assert_close_to_ref(out, ref_dq[:, 0], same_dq[:, 0])
    ref, _ = paged_attention_ref(q.unsqueeze(1), kc, vc, bt, sl, causal=True)
    err = (out - ref[:, 0]).abs().max().item()
    # Documented bound (paged_decode): about 2**-4 * max|v| (v's rounding; k's moves p a little).
    assert 0 < err < 2**-4 * vc.abs().max().item(), err


def test_plan_run_matches_and_never_syncs(monkeypatch: pytest.MonkeyPatch, device: str) -> None:
    lens, nheads, nheads_k, d = [70, 5, 33], 8, 2, 32
    kc, vc, bt, sl = make_paged_cache(lens, 16, nheads_k, d)
    q = torch.randn(3, nheads, d)
    plan = plan_decode(
        3,
        nheads,
        nheads_k,
        d,
        block_size=16,
        max_seqlen_k=70,
        q_dtype=torch.float32,
        device=device,
        num_splits=0,
    )
    sms = default_num_sms(torch.device(device))
    heads = choose_heads_per_program(3, nheads_k, 2, 70, sms)  # up to 2: group 4 fills 8 rows
    tiles = paged_tiles(plan.config, 1, nheads, nheads_k, torch.float32)
    assert plan.config.heads_per_program == tiles.heads == heads
    assert plan.num_splits == min(
        choose_num_splits(3, nheads_k // heads, 70, sms), cdiv(70, tiles.tile_tokens)
    ) and plan.grid == (nheads_k // heads, plan.num_splits, 3)
    plan3 = plan_decode(
        3, nheads, nheads_k, d, block_size=16, max_seqlen_k=70, q_dtype=torch.float32, device=device,
        num_splits=3, config=PagedAttnConfig(block_n=16),
    )  # fmt: skip
    clamped = plan_decode(
        3,
        nheads,
        nheads_k,
        d,
        block_size=16,
        max_seqlen_k=70,
        q_dtype=torch.float32,
        device=device,
        num_splits=3,
        config=replace(plan.config, heads_per_program=1),
    )
    assert clamped.num_splits == 2  # 70 keys are only two 64-key tiles (one head per program)
    assert plan3.workspace is not None and plan3.workspace[0].shape == (3, nheads, 3, d)

    def no_sync(*args: object, **kwargs: object) -> None:
        raise AssertionError("run_decode read a device value on the host")

    ref, _, same = _refs(q.unsqueeze(1), kc, vc, bt, sl, causal=True)
    with monkeypatch.context() as m:
        for name in ("item", "tolist", "__bool__", "__int__", "__float__", "cpu", "numpy"):
            m.setattr(torch.Tensor, name, no_sync)
        # The Triton interpreter itself reads tensors through data_ptr, not through these methods.
        outs = [run_decode(p, q, kc, vc, bt, sl) for p in (plan, plan3, plan3)]
    for out in outs:
        assert_close_to_ref(out, ref[:, 0], same[:, 0])
    with pytest.raises(ValueError, match="plan"):
        run_decode(plan, torch.randn(4, nheads, d), kc, vc, bt, sl)
    with pytest.raises(ValueError, match="lse must be"):  # (nheads, batch) instead of (batch, nheads)
        run_decode(plan, q, kc, vc, bt, sl, lse=torch.empty(nheads, q.shape[0]))


@pytest.mark.parametrize("kv", ["fp32", "fp8"])
@pytest.mark.parametrize("splits", [1, 2])
def test_run_decode_binds_and_relaunches(
    monkeypatch: pytest.MonkeyPatch, device: str, kv: str, splits: int
) -> None:
    """``run_decode`` binds the plan's launch on its first call; later calls with new tensors laid
    out alike (new values, block tables, lengths, output buffers, a ``(batch, 1, nheads, d)`` q of
    the same rows) only relaunch it (no ``PagedLauncher.bind``) and match the reference on their own
    data; an LSE buffer or a larger cache is a new layout and rebinds. fp8: V read as byte pairs,
    no scales (ones)."""
    from flashpage.ops.paged_launch import PagedLauncher

    binds = []
    real_bind = PagedLauncher.bind

    def counting_bind(self: PagedLauncher, *args: object, **kwargs: object) -> object:
        binds.append(1)
        return real_bind(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(PagedLauncher, "bind", counting_bind)

    nheads, nheads_k, d, fp8 = 8, 2, 32, kv == "fp8"
    sets = []
    for lens in ([70, 5, 33], [66, 12, 40]):  # the same block counts: caches and tables alike
        kc, vc, bt, sl = make_paged_cache(lens, 16, nheads_k, d)
        if fp8:
            kc, vc = kc.to(torch.float8_e4m3fn), vc.to(torch.float8_e4m3fn)
        sets.append((kc, vc, bt, sl))
    plan = plan_decode(
        3, nheads, nheads_k, d, block_size=16, max_seqlen_k=80, q_dtype=torch.float32,
        kv_dtype=sets[0][0].dtype, device=device, num_splits=splits,
        config=replace(default_decode_config(sets[0][0].dtype, d), block_n=32),  # fp8: 128 by default
    )  # fmt: skip
    assert plan.num_splits == splits and plan.config.v_pairs == fp8

    def check(out: Tensor, q: Tensor, kc: Tensor, vc: Tensor, bt: Tensor, sl: Tensor) -> Tensor:
        ref, lse, same = _refs(q.unsqueeze(1), kc.float(), vc.float(), bt, sl, causal=True)
        assert_close_to_ref(out, ref[:, 0], same[:, 0])
        return lse

    q = torch.randn(3, nheads, d)
    check(run_decode(plan, q, *sets[0]), q, *sets[0])
    q4 = torch.randn(3, 1, nheads, d)  # (batch, 1, nheads, d): the same rows, so the same launch
    check(run_decode(plan, q4, *sets[1])[:, 0], q4[:, 0], *sets[1])
    assert len(binds) == 1

    def unbound(*args: object, **kwargs: object) -> None:
        raise AssertionError("a bound layout went through PagedLauncher.bind")

    with monkeypatch.context() as m:
        m.setattr(PagedLauncher, "bind", unbound)
        for kc, vc, bt, sl in (sets[1], sets[0]):
            for shape in ((3, nheads, d), (3, 1, nheads, d)):
                q = torch.randn(shape)
                out = torch.full_like(q, float("nan"))
                assert run_decode(plan, q, kc, vc, bt, sl, out=out) is out
                check(out.view(3, nheads, d), q.view(3, nheads, d), kc, vc, bt, sl)
    assert len(binds) == 1
    for i, caches in enumerate((sets[1], sets[0])):  # binds, then relaunches with an LSE buffer
        lse = torch.full((3, nheads), float("nan"))
        q = torch.randn(3, nheads, d)
        with monkeypatch.context() as m:
            if i:
                m.setattr(PagedLauncher, "bind", unbound)
            want = check(run_decode(plan, q, *caches, lse=lse), q, *caches)
        torch.testing.assert_close(lse, want[:, :, 0], atol=1e-5, rtol=1e-5)
    kc, vc, bt, sl = sets[1]
    big = [torch.cat([c, c[:2]]) for c in (kc, vc)]  # two more blocks: a new cache shape
    check(run_decode(plan, q, *big, bt, sl), q, *big, bt, sl)
    assert len(binds) == 3
    assert replace(plan, causal=False).bound.launch is None  # another plan binds its own launch


@pytest.mark.parametrize(("kv", "splits"), [("fp32", 1), ("fp32", 2), ("fp8", 2)])
def test_eager_entry_points_relaunch_bound_launches(
    monkeypatch: pytest.MonkeyPatch, device: str, kv: str, splits: int
) -> None:
    """``paged_decode`` and ``flash_attn_with_kvcache`` bind their first launch per layout and
    argument set (the eager :class:`PagedLauncher`); later calls with new values, tables and lengths
    relaunch it (no ``PagedLauncher.bind``), each with its own split workspace, and match the
    reference. Another softmax scale, an LSE output or another entry point's arguments is another
    key and binds anew."""
    from flashpage.ops import kvcache
    from flashpage.ops.paged_launch import PagedLauncher, eager_launcher

    memo = eager_launcher()
    memo.clear()
    nheads, nheads_k, d, fp8 = 8, 2, 32, kv == "fp8"
    sets = []
    for lens in ([70, 5, 33], [66, 12, 40]):
        kc, vc, bt, sl = make_paged_cache(lens, 16, nheads_k, d)
        if fp8:
            kc, vc = kc.to(torch.float8_e4m3fn), vc.to(torch.float8_e4m3fn)
        sets.append((kc, vc, bt, sl))
    config = replace(default_decode_config(sets[0][0].dtype, d), block_n=32)

    def decode(
        q: Tensor, kc: Tensor, vc: Tensor, bt: Tensor, sl: Tensor, **kw: object
    ) -> tuple[Tensor, Tensor]:
        return paged_decode(q, kc, vc, bt, sl, num_splits=splits, config=config, return_lse=True, **kw)  # type: ignore[return-value]

    def check(
        got: tuple[Tensor, Tensor], q: Tensor, kc: Tensor, vc: Tensor, bt: Tensor, sl: Tensor, **kw: object
    ) -> None:
        ref, lse, same = _refs(q.unsqueeze(1), kc.float(), vc.float(), bt, sl, causal=True, **kw)
        assert_close_to_ref(got[0], ref[:, 0], same[:, 0])
        torch.testing.assert_close(got[1], lse[:, :, 0], atol=1e-5, rtol=1e-5)

    q = torch.randn(3, nheads, d)
    check(decode(q, *sets[0]), q, *sets[0])
    fa_q = torch.randn(3, 1, nheads, d)
    fa = kvcache.flash_attn_with_kvcache(
        fa_q, sets[0][0], sets[0][1], cache_seqlens=sets[0][3], block_table=sets[0][2], causal=True,
        num_splits=splits, return_softmax_lse=True,
    )  # fmt: skip
    check((fa[0][:, 0], fa[1][:, :, 0]), fa_q[:, 0], *sets[0])
    bound = len(memo)  # one key per entry point, or one shared where their configs agree
    assert bound in (1, 2)

    def unbound(*args: object, **kwargs: object) -> None:
        raise AssertionError("a bound layout went through PagedLauncher.bind")

    with monkeypatch.context() as m:
        m.setattr(PagedLauncher, "bind", unbound)
        for caches in (sets[1], sets[0], sets[1]):
            q = torch.randn(3, nheads, d)
            check(decode(q, *caches), q, *caches)
            fa = kvcache.flash_attn_with_kvcache(
                q[:, None], caches[0], caches[1], cache_seqlens=caches[3], block_table=caches[2],
                causal=True, num_splits=splits, return_softmax_lse=True,
            )  # fmt: skip
            check((fa[0][:, 0], fa[1][:, :, 0]), q, *caches)
    assert len(memo) == bound
    check(decode(q, *sets[1], softmax_scale=0.3), q, *sets[1], softmax_scale=0.3)
    out = paged_decode(q, *sets[1], num_splits=splits, config=config)
    ref, _, same = _refs(
        q.unsqueeze(1), sets[1][0].float(), sets[1][1].float(), sets[1][2], sets[1][3], causal=True
    )
    assert_close_to_ref(out, ref[:, 0], same[:, 0])
    assert len(memo) == bound + 2


def test_num_splits_planner_rule() -> None:
    # H200 (132 SMs), GQA 8 kv heads: batch 1 at 128k needs 64 splits; big batches need none.
    assert choose_num_splits(1, 8, 131072, 132) == 64
    assert choose_num_splits(32, 8, 32768, 132) == 2
    assert choose_num_splits(256, 8, 4096, 132) == 1
    assert choose_num_splits(1, 8, 1024, 132) == 4  # capped: >= 256 keys per split
    assert choose_num_splits(1, 1, 10**7, 132, max_splits=128) == 128
    # One wave of 2 programs per SM (the wide several-head tiles): never a partial second wave.
    assert choose_num_splits(32, 2, 32768, 132, one_wave_of=2) == 4  # 256 of 264 slots (not 8)
    assert choose_num_splits(16, 2, 32768, 132, one_wave_of=2) == 8
    assert choose_num_splits(4, 2, 131072, 132, one_wave_of=2) == 32
    assert choose_num_splits(33, 8, 4096, 132, one_wave_of=2) == 1  # more than a wave already
    assert choose_num_splits(1, 2, 1024, 132, one_wave_of=2) == 4  # still >= 256 keys per split
    assert choose_num_splits(1, 1, 10**7, 132, max_splits=64, one_wave_of=2) == 64
    with pytest.raises(ValueError, match="one_wave_of"):
        choose_num_splits(1, 1, 1024, 132, one_wave_of=-1)


def test_wide_tiles_for_several_head_programs(device: str) -> None:
    """Where the planner gives a program several KV heads, the default decode config takes
    ``wide_block_n`` columns per tile and one wave of two programs per SM; the result still equals
    the reference (16-token pages, so a 128-column tile of 2 heads gathers 4 pages)."""
    from flashpage.ops.paged_plan import choose_launch

    def resolve_launch(*args: object) -> tuple[PagedAttnConfig, object, int]:
        c = choose_launch(*args[:-1], default_num_sms(args[-1]))  # type: ignore[arg-type]
        return c.config, c.tiles, c.num_splits

    bf16, cpu = torch.bfloat16, torch.device("cpu")  # 4 "SMs" off CUDA
    auto = default_decode_config(bf16, 32)
    assert auto.wide_block_n == 128 and default_decode_config(bf16, 32, paged=False).wide_block_n == 0
    assert default_decode_config(torch.float8_e4m3fn, 32).wide_block_n == 0
    # batch 3, GQA 8/2: 3 x 2 one-head programs < 2 x 4 SMs, so 2 heads; 3 programs per split.
    cfg, tiles, splits = resolve_launch(auto, 0, 3, 1, 8, 2, bf16, 4096, cpu)
    assert (cfg.heads_per_program, cfg.block_n, tiles.tile_tokens, splits) == (2, 128, 64, 2)
    narrow = replace(auto, wide_block_n=0)
    cfg_n, tiles_n, splits_n = resolve_launch(narrow, 0, 3, 1, 8, 2, bf16, 4096, cpu)
    assert (cfg_n.heads_per_program, cfg_n.block_n, tiles_n.tile_tokens, splits_n) == (2, 64, 32, 4)
    # One head per program (enough programs), an explicit head count, or a given split count for
    # the splits: block_n and the split rule stay.
    cfg1, _, splits1 = resolve_launch(auto, 0, 8, 1, 8, 2, bf16, 4096, cpu)
    assert (cfg1.heads_per_program, cfg1.block_n, splits1) == (1, 64, 1)
    cfg2, _, _ = resolve_launch(replace(auto, heads_per_program=2), 0, 3, 1, 8, 2, bf16, 4096, cpu)
    assert cfg2.block_n == 64
    assert resolve_launch(auto, 3, 3, 1, 8, 2, bf16, 4096, cpu)[2] == 3
    with pytest.raises(ValueError, match="wide_block_n"):
        PagedAttnConfig(wide_block_n=96)

    lens, nheads, nheads_k, d = [300, 17, 256], 8, 2, 32
    kc, vc, bt, sl = make_paged_cache(lens, 16, nheads_k, d)
    q = torch.randn(3, nheads, d)
    plan = plan_decode(3, nheads, nheads_k, d, block_size=16, max_seqlen_k=1024, q_dtype=torch.float32,
                       device=device)  # fmt: skip
    if torch.device(device).type == "cpu":
        assert (plan.config.heads_per_program, plan.config.block_n, plan.num_splits) == (2, 128, 2)
    ref, _, same = _refs(q.unsqueeze(1), kc, vc, bt, sl, causal=True)
    assert_close_to_ref(run_decode(plan, q, kc, vc, bt, sl), ref[:, 0], same[:, 0])


def test_choose_launch_is_remembered_and_still_refuses() -> None:
    """choose_launch computes an answer once per argument tuple and then returns it from its cache;
    its split count is the planner's for the chosen heads, and a bad split count raises on every
    call (nothing is remembered for it)."""
    from flashpage.ops.paged_plan import choose_launch

    for cfg, splits, batch, sq, h, hk, n in [
        (PagedAttnConfig(), 0, 1, 1, 32, 8, 131072),
        (PagedAttnConfig(), 0, 32, 1, 32, 32, 32768),
        (PagedAttnConfig(block_m=128), 3, 4, 200, 16, 4, 4096),
    ]:
        args = (cfg, splits, batch, sq, h, hk, torch.bfloat16, n, 4)
        want = choose_launch(*args)
        assert choose_launch(*args) is want  # remembered
        t = want.tiles
        expect = splits or choose_num_splits(batch * t.q_tiles, t.head_programs, n, 4)
        assert want.num_splits == min(expect, cdiv(n, t.tile_tokens))
    for _ in range(2):
        with pytest.raises(ValueError, match="num_splits"):
            choose_launch(PagedAttnConfig(), 999, 1, 1, 32, 8, torch.bfloat16, 4096, 4)


def test_check_paged_values_messages() -> None:
    """Each value check names its argument and the offending value; table entries past a sequence's
    used blocks are not checked (engines leave them as -1)."""
    bt = torch.tensor([[0, 1, -1], [2, -1, -1]], dtype=torch.int32)
    sl = torch.tensor([20, 16], dtype=torch.int32)
    check_paged_values(bt, sl, 3, 16)
    check_paged_values(bt, sl, 3, 16, min_seqlens=torch.tensor([1, 16]))
    with pytest.raises(
        ValueError, match=r"block_table\[1, 0\] = 2 points outside the cache \(num_blocks=2\)"
    ):
        check_paged_values(bt, sl, 2, 16)
    with pytest.raises(ValueError, match=r"block_table\[0, 1\] = -1"):  # a hole in a used range
        check_paged_values(
            torch.tensor([[0, -1, 1]], dtype=torch.int32), torch.tensor([40], dtype=torch.int32), 3, 16
        )
    with pytest.raises(ValueError, match="must be non-negative, got min -1"):
        check_paged_values(bt, torch.tensor([-1, 3], dtype=torch.int32), 3, 16)
    with pytest.raises(ValueError, match="max 49 is longer than the block table covers"):
        check_paged_values(bt, torch.tensor([49, 3], dtype=torch.int32), 3, 16)
    with pytest.raises(ValueError, match="cache_seqlens must be at least"):
        check_paged_values(bt, sl, 3, 16, min_seqlens=torch.tensor([1, 17]))
    with pytest.raises(ValueError, match="holds"):  # contiguous: block_size is the cache length
        check_paged_values(None, sl, 2, 18)


def test_decode_errors() -> None:
    lens, d = [20, 40], 32
    kc, vc, bt, sl = make_paged_cache(lens, 16, 2, d)
    q = torch.randn(2, 8, d)
    bad = bt.clone()
    bad[1, 2] = kc.shape[0]  # third block of the 40-token sequence
    with pytest.raises(ValueError, match="block_table"):
        paged_decode(q, kc, vc, bad, sl)
    with pytest.raises(ValueError, match="cache_seqlens"):
        paged_decode(q, kc, vc, bt, torch.tensor([20, bt.shape[1] * 16 + 1], dtype=torch.int32))
    with pytest.raises(TypeError, match="block_table"):
        paged_decode(q, kc, vc, bt.long(), sl)
    with pytest.raises(TypeError, match="cache_seqlens"):
        paged_decode(q, kc, vc, bt, sl.long())
    with pytest.raises(ValueError, match="block_size"):
        paged_decode(q, kc[:, :12], vc[:, :12], bt, sl)
    with pytest.raises(ValueError, match="nheads"):
        paged_decode(torch.randn(2, 7, d), kc, vc, bt, sl)
    with pytest.raises(TypeError, match="k_cache"):
        paged_decode(q, kc.double(), vc.double(), bt, sl)
    with pytest.raises(ValueError, match="num_splits"):
        paged_decode(q, kc, vc, bt, sl, num_splits=-1)
    with pytest.raises(ValueError, match="k_scale"):
        paged_decode(q, kc, vc, bt, sl, k_scale=torch.ones(2))


@pytest.mark.parametrize(
    ("block_size", "nheads", "nheads_k", "lens", "heads", "block_n"),
    [
        (16, 8, 4, [1, 37, 64], 2, 64),  # 2 KV heads: 32-token tiles over 16-token pages (gathered)
        (16, 16, 4, [3, 70, 48], 4, 64),  # 4 KV heads: one page per tile
        (8, 16, 4, [8, 29, 70], 4, 16),  # 4-token tiles inside 8-token pages
        (32, 4, 4, [96, 5], 0, 64),  # MHA, auto: all 4 heads (16-token tiles in 32-token pages)
        (16, 12, 4, [50, 17], 0, 32),  # group 3, auto: 4 heads, 12 real rows of 16
        (32, 16, 4, [50, 17, 64], 4, 32),  # page >= block_n: one scalar block id per 8-token tile
    ],
)
def test_multi_head_programs(
    block_size: int, nheads: int, nheads_k: int, lens: list[int], heads: int, block_n: int
) -> None:
    """Programs owning several KV heads (each token's heads read as one run, ``Q K^T`` masked to
    pairs of the same head) equal the reference for decode and multi-query rows, split or not, with
    the options that mask per row or column (window, ALiBi, softcap)."""
    d = 32
    kc, vc, bt, sl = make_paged_cache(lens, block_size, nheads_k, d)
    base = PagedAttnConfig(block_n=block_n, heads_per_program=heads)
    for sq, kw, cfg in (
        (1, {}, base),
        (1, {"window_size": (20, 0), "softcap": 2.0}, replace(base, heads_first=True, combine_block_d=16)),
        (2, {"alibi_slopes": torch.rand(len(lens), nheads)}, replace(base, early_v=True)),
        (1, {}, replace(base, prefetch_table=True, early_v=True)),
    ):
        q = torch.randn(len(lens), sq, nheads, d)
        ref, ref_lse, same = _refs(q, kc, vc, bt, sl, causal=True, **kw)
        for splits in (1, 3):
            out, lse = paged_decode(q, kc, vc, bt, sl, num_splits=splits, config=cfg, return_lse=True, **kw)  # type: ignore[arg-type]
            assert_close_to_ref(out, ref, same)
            fin = torch.isfinite(ref_lse)
            torch.testing.assert_close(lse[fin], ref_lse[fin], atol=1e-5, rtol=1e-5)


def _fp8_caches(kc: Tensor, vc: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """e4m3 copies of ``kc``/``vc`` with per-head scales, and their dequantised values."""
    ks, vs = fp8_kv_scales(kc), fp8_kv_scales(vc)
    kc8 = (kc / ks.view(1, 1, -1, 1)).to(torch.float8_e4m3fn)
    vc8 = (vc / vs.view(1, 1, -1, 1)).to(torch.float8_e4m3fn)
    return kc8, vc8, ks, vs, kc8.float() * ks.view(1, 1, -1, 1), vc8.float() * vs.view(1, 1, -1, 1)


def _pair_case(
    block_size: int, opts: dict[str, object]
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, dict[str, object]]:
    """Ragged paged caches (lengths 2, 77, 48, 1; GQA 8/2, d=32), queries of ``opts["q_len"]``
    tokens and the attention options ``opts`` names (window, softcap, ALiBi slopes)."""
    lens, nheads, nheads_k, d = [2, 77, 48, 1], 8, 2, 32
    kc, vc, bt, sl = make_paged_cache(lens, block_size, nheads_k, d)
    q_len = int(opts.get("q_len", 1))  # type: ignore[call-overload]
    q = torch.randn(len(lens), q_len, nheads, d)
    kw: dict[str, object] = {k: v for k, v in opts.items() if k in ("window_size", "softcap")}
    if opts.get("alibi"):
        kw["alibi_slopes"] = torch.rand(nheads)
    return kc, vc, bt, sl, q, kw


@pytest.mark.parametrize(
    ("block_size", "block_n", "warps", "opts"),
    [
        (16, 64, 4, {}),
        (8, 32, 2, {"window_size": (20, 0), "softcap": 3.0}),  # tiles over 2 pages
        (32, 32, 2, {"alibi": True, "early_v": True}),  # page >= tile
        (16, 64, 4, {"q_len": 3}),  # multi-query rows (12 of 16), one sees nothing
    ],
)
def test_byte_pairs(block_size: int, block_n: int, warps: int, opts: dict[str, object]) -> None:
    """fp8 V read as int16 byte pairs (its even / odd columns accumulated apart and interleaved at
    the end): equal to the reference over the dequantised caches and to the byte-wise kernel, with
    masks, options, multi-query rows and splits."""
    kc, vc, bt, sl, q, kw = _pair_case(block_size, opts)
    kc8, vc8, ks, vs, kd, vd = _fp8_caches(kc, vc)
    q_len, nheads, nheads_k, d = q.shape[1], q.shape[2], kc.shape[2], kc.shape[3]
    cfg = PagedAttnConfig(block_n=block_n, num_warps=warps, v_pairs=True, early_v=bool(opts.get("early_v")))
    tiles = paged_tiles(cfg, q_len, nheads, nheads_k, vc8.dtype)
    assert v_pairs_apply(cfg, tiles, vc8, d, use_tma=False)
    ref, ref_lse, same = _refs(q, kd, vd, bt, sl, causal=True, **kw)
    fin = torch.isfinite(ref_lse)
    for splits in (1, 3):
        out, lse = paged_decode(q, kc8, vc8, bt, sl, num_splits=splits, config=cfg, k_scale=ks, v_scale=vs,
                                return_lse=True, **kw)  # type: ignore[arg-type]  # fmt: skip
        assert_close_to_ref(out, ref, same)
        torch.testing.assert_close(lse[fin], ref_lse[fin], atol=1e-5, rtol=1e-5)
        plain = paged_decode(q, kc8, vc8, bt, sl, num_splits=splits,
                             config=replace(cfg, v_pairs=False),
                             k_scale=ks, v_scale=vs, **kw)  # type: ignore[arg-type]  # fmt: skip
        torch.testing.assert_close(out, plain, atol=1e-5, rtol=1e-5)


def test_v_pairs_applies_where_it_can() -> None:
    """Pairs only for fp8 decode tiles of a power-of-two head dim, pointer loads and a V cache
    viewable as int16; elsewhere the launch reads V as before (no error)."""
    cfg = PagedAttnConfig(block_n=64, v_pairs=True)
    v8 = torch.zeros(4, 16, 2, 32, dtype=torch.float8_e4m3fn)
    dec = paged_tiles(cfg, 1, 8, 2, v8.dtype)
    assert v_pairs_apply(cfg, dec, v8, 32, use_tma=False)
    assert not v_pairs_apply(replace(cfg, v_pairs=False), dec, v8, 32, use_tma=False)
    assert not v_pairs_apply(cfg, dec, v8.to(torch.bfloat16), 32, use_tma=False)
    assert not v_pairs_apply(cfg, dec, v8, 32, use_tma=True)
    assert not v_pairs_apply(cfg, paged_tiles(cfg, 5, 8, 2, v8.dtype), v8, 32, use_tma=False)  # 32 rows
    assert not v_pairs_apply(
        cfg, dec, torch.zeros(4, 16, 2, 40, dtype=torch.float8_e4m3fn), 40, use_tma=False
    )
    odd = torch.zeros(4 * 16 * 2 * 32 + 1, dtype=torch.float8_e4m3fn)[1:].view(4, 16, 2, 32)
    assert not v_pairs_apply(cfg, dec, odd, 32, use_tma=False)
    # A cache the pairs cannot view still decodes (byte-wise) and matches.
    lens, nheads_k, d = [9, 40], 2, 32
    kc, vc, bt, sl = make_paged_cache(lens, 16, nheads_k, d)
    kc8, vc8, ks, vs, kd, vd = _fp8_caches(kc, vc)
    v_odd = torch.empty(vc8.numel() + 1, dtype=vc8.dtype)[1:].view(vc8.shape)
    v_odd.copy_(vc8)
    q = torch.randn(len(lens), 1, 8, d)
    out = paged_decode(q, kc8, v_odd, bt, sl, config=cfg, k_scale=ks, v_scale=vs)
    ref, _, same = _refs(q, kd, vd, bt, sl, causal=True)
    assert_close_to_ref(out, ref, same)


def test_byte_pairs_contiguous_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """fp8 V read as byte pairs over a contiguous cache (no page table), with left padding and
    ``cache_batch_idx``: equal to the byte-wise kernel."""
    import flashpage.ops.kvcache as kvcache

    batch, s_cache, nheads, nheads_k, d = 3, 80, 8, 2, 32
    kc8, vc8, ks, vs, _, _ = _fp8_caches(
        torch.randn(4, s_cache, nheads_k, d), torch.randn(4, s_cache, nheads_k, d)
    )
    q = torch.randn(batch, 1, nheads, d)
    kw = {"cache_seqlens": torch.tensor([5, 80, 47], dtype=torch.int32),
          "cache_leftpad": torch.tensor([0, 33, 10], dtype=torch.int32), "num_splits": 2,
          "cache_batch_idx": torch.tensor([3, 0, 2], dtype=torch.int32), "k_scale": ks, "v_scale": vs}  # fmt: skip
    cfg = PagedAttnConfig(block_n=32, num_warps=2)
    monkeypatch.setattr(kvcache, "kv_attention_config", lambda *a, **k: cfg)
    plain = kvcache.flash_attn_with_kvcache(q, kc8, vc8, **kw)  # type: ignore[arg-type]
    cfg_pairs = replace(cfg, v_pairs=True)
    tiles = paged_tiles(cfg_pairs, 1, nheads, nheads_k, kc8.dtype)
    assert v_pairs_apply(cfg_pairs, tiles, vc8, d, use_tma=False)
    monkeypatch.setattr(kvcache, "kv_attention_config", lambda *a, **k: cfg_pairs)
    pairs = kvcache.flash_attn_with_kvcache(q, kc8, vc8, **kw)  # type: ignore[arg-type]
    torch.testing.assert_close(pairs, plain, atol=1e-5, rtol=1e-5)
