"""FlashAttention backward kernels (flashpage.ops.flash_bwd) vs autograd through the fp32 reference."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import Tensor

from flashpage.ops import flash_bwd as flash_bwd_module
from flashpage.ops.flash_bwd import flash_bwd
from flashpage.ops.flash_configs import BwdConfig
from flashpage.ops.flash_fwd import attention_probs, check_attention_inputs, flash_fwd, plan_tail_split
from flashpage.ops.reference import attention_ref, varlen_attention_ref
from tests.ops.test_flash_fwd import _alibi, make_qkv, make_varlen, on_device  # noqa: F401 (fixture)
from tests.tolerance import assert_close_to_ref

SEPARATE = BwdConfig(16, 16, 16, 16, 4, 1, 4, 1, "separate")
ATOMIC = BwdConfig(16, 16, 16, 16, 4, 1, 4, 1, "atomic")
SEPARATE_TMA = BwdConfig(16, 16, 16, 16, 4, 1, 4, 1, "separate", use_tma=True)
ATOMIC_TMA = BwdConfig(16, 32, 16, 16, 4, 1, 4, 1, "atomic", use_tma=True)
# TMA bulk reduce-adds of dQ on a GPU; the scalar-atomic fallback under the interpreter.
ATOMIC_BULK = BwdConfig(16, 32, 16, 16, 4, 1, 4, 1, "atomic_tma", use_tma=True)
FUSED = BwdConfig(16, 16, 16, 16, 4, 1, 4, 1, "fused")
FUSED_TMA = BwdConfig(16, 32, 16, 16, 4, 1, 4, 1, "fused", use_tma=True)


def ref_grads(
    q: Tensor, k: Tensor, v: Tensor, do: Tensor, upcast: bool = True, **kw: object
) -> tuple[Tensor, Tensor, Tensor]:
    """Autograd gradients of the reference (fp32 with ``upcast``, else in the inputs' dtype)."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = attention_ref(q, k, v, upcast=upcast, **kw)[0]  # type: ignore[arg-type]
    return torch.autograd.grad(out, (q, k, v), do.to(out.dtype))  # type: ignore[return-value]


def check_grads(
    q: Tensor, k: Tensor, v: Tensor, cfg: BwdConfig | None = None, dtype_ref: bool = False, **kw: object
) -> None:
    do = torch.randn_like(q)
    out, lse = flash_fwd(q, k, v, **kw)  # type: ignore[arg-type]
    dq, dk, dv = flash_bwd(do, q, k, v, out, lse, config=cfg, **kw)  # type: ignore[arg-type]
    refs = ref_grads(q, k, v, do, **kw)
    same = ref_grads(q, k, v, do, upcast=False, **kw)
    for name, g, r, s in zip(("dq", "dk", "dv"), (dq, dk, dv), refs, same):
        assert g.shape == r.shape and g.dtype == q.dtype
        assert_close_to_ref(g, r, s, name=name)


BWD_CASES = [
    (2, 33, 33, 2, 2, 32, {}),
    (1, 40, 17, 4, 2, 64, {"causal": True}),
    (1, 17, 40, 2, 1, 96, {"causal": True}),
    (1, 1, 37, 2, 2, 128, {"causal": True}),
    (1, 20, 1, 2, 1, 32, {"causal": True}),
    (1, 9, 23, 1, 1, 256, {"window_size": (4, 2)}),
    (1, 37, 29, 2, 2, 32, {"window_size": (5, -1)}),
    (1, 29, 37, 2, 1, 64, {"window_size": (-1, 3)}),
    (1, 29, 37, 2, 1, 32, {"softcap": 2.5, "alibi": "heads"}),
    (2, 20, 31, 2, 1, 32, {"causal": True, "alibi": "batch", "softmax_scale": 0.3}),
    (1, 31, 20, 8, 1, 32, {"window_size": (7, 7), "softcap": 4.0}),  # GQA ratio 8
]


@pytest.mark.parametrize(("b", "sq", "sk", "h", "hk", "d", "opts"), BWD_CASES)
def test_backward_matches_reference(b: int, sq: int, sk: int, h: int, hk: int, d: int, opts: dict) -> None:
    opts = dict(opts)
    alibi = _alibi(opts.pop("alibi", None), b, h)
    q, k, v = make_qkv(b, sq, sk, h, hk, d)
    check_grads(q, k, v, alibi_slopes=alibi, **opts)


@pytest.mark.parametrize(
    "cfg", [ATOMIC, SEPARATE_TMA, ATOMIC_TMA, ATOMIC_BULK], ids=["atomic", "tma", "atomic-tma", "atomic-bulk"]
)
def test_backward_dq_modes_and_tma(cfg: BwdConfig) -> None:
    q, k, v = make_qkv(1, 35, 27, 4, 2, 64)
    check_grads(q, k, v, cfg=cfg, causal=True)


@pytest.mark.parametrize(
    "opts",
    [
        {"causal": True},
        {"window_size": (5, 3), "softcap": 3.0},
        {"causal": True, "dropout_p": 0.2, "seed": 5},
    ],
    ids=["causal", "window-softcap", "dropout"],
)
@pytest.mark.parametrize("mode", ["separate", "atomic"])
def test_split_dkdv_equals_fused(opts: dict, mode: str) -> None:
    """Split mode (dV and dK in two launches) computes the same dots in the same order: identical
    gradients to the fused dK/dV kernel (dQ too, except the order of atomic adds)."""
    q, k, v = make_qkv(1, 35, 29, 4, 2, 64)
    do = torch.randn_like(q)
    out, lse = flash_fwd(q, k, v, **opts)
    fused = BwdConfig(16, 16, 16, 16, 4, 1, 4, 1, mode)
    split = BwdConfig(16, 16, 16, 16, 4, 1, 4, 1, mode, split_dkdv=True)
    a = flash_bwd(do, q, k, v, out, lse, config=fused, **opts)
    b = flash_bwd(do, q, k, v, out, lse, config=split, **opts)
    assert torch.equal(a[1], b[1]) and torch.equal(a[2], b[2])
    torch.testing.assert_close(a[0], b[0], atol=1e-5, rtol=1e-5)
    check_grads(q, k, v, cfg=split, causal=True)


@pytest.mark.parametrize(
    "opts",
    [
        {"causal": True},
        {"window_size": (5, 3), "softcap": 3.0},
        {"causal": True, "dropout_p": 0.2, "seed": 5, "alibi": "heads"},
    ],
    ids=["causal", "window-softcap", "dropout-alibi"],
)
@pytest.mark.parametrize(
    "cfg", [FUSED, FUSED_TMA, replace(FUSED, split_dkdv=True)], ids=["fused", "fused-tma", "fused-split"]
)
def test_fused_dq_equals_separate(opts: dict, cfg: BwdConfig, monkeypatch: pytest.MonkeyPatch) -> None:
    """dq_mode="fused" runs the dQ kernel's programs inside the dK/dV launch: the same dots in the
    same order, so bit-identical gradients to "separate", from one launch (the standalone kernels are
    removed for the fused call; split mode still has its dV-only launch)."""
    opts = dict(opts)
    alibi = _alibi(opts.pop("alibi", None), 1, 8)
    q, k, v = make_qkv(1, 37, 30, 8, 2, 64)  # GQA 4: dQ programs of 4 query heads per KV head
    do = torch.randn_like(q)
    out, lse = flash_fwd(q, k, v, alibi_slopes=alibi, **opts)
    want = flash_bwd(
        do, q, k, v, out, lse, alibi_slopes=alibi, config=replace(cfg, dq_mode="separate"), **opts
    )
    monkeypatch.setattr(flash_bwd_module, "_bwd_dq_kernel", None)
    if not cfg.split_dkdv:
        monkeypatch.setattr(flash_bwd_module, "_bwd_dkdv_kernel", None)
    got = flash_bwd(do, q, k, v, out, lse, alibi_slopes=alibi, config=cfg, **opts)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert torch.equal(a, b), name


def test_fused_config_needs_one_launch_shape() -> None:
    with pytest.raises(ValueError, match="num_warps2 / num_stages2"):
        BwdConfig(64, 128, 128, 64, 8, 3, 4, 3, "fused")


def test_backward_half_precision() -> None:
    q, k, v = make_qkv(1, 24, 30, 2, 1, 64, dtype=torch.float16)
    check_grads(q, k, v, causal=True)


def test_backward_varlen_uneven() -> None:
    lens_q, lens_k = [7, 1, 0, 22, 3], [9, 12, 5, 22, 0]
    q, k, v, cq, ck = make_varlen(lens_q, lens_k, 4, 2, 32, pad=2)
    kw = {"cu_seqlens_q": cq, "cu_seqlens_k": ck, "max_seqlen_q": 22, "max_seqlen_k": 22, "causal": True}
    do = torch.randn_like(q)
    for cfg in (SEPARATE, ATOMIC, ATOMIC_BULK, FUSED):
        out, lse = flash_fwd(q, k, v, **kw)  # type: ignore[arg-type]
        dq, dk, dv = flash_bwd(do, q, k, v, out, lse, config=cfg, **kw)  # type: ignore[arg-type]
        qr, kr, vr = (t.detach().requires_grad_() for t in (q, k, v))
        ref = varlen_attention_ref(qr, kr, vr, cq, ck, causal=True)[0]
        rdq, rdk, rdv = torch.autograd.grad(ref, (qr, kr, vr), do)
        for g, r in ((dq, rdq), (dk, rdk), (dv, rdv)):
            assert_close_to_ref(g, r, r)
        assert torch.all(dq[int(cq[-1]) :] == 0) and torch.all(dk[int(ck[-1]) :] == 0)


def test_backward_dropout_matches_reference_with_kernel_mask() -> None:
    q, k, v = make_qkv(1, 21, 27, 4, 2, 32)
    p, seed = 0.3, 99
    do = torch.randn_like(q)
    out, lse = flash_fwd(q, k, v, causal=True, dropout_p=p, seed=seed)
    dq, dk, dv = flash_bwd(do, q, k, v, out, lse, causal=True, dropout_p=p, seed=seed)
    keep = ~torch.signbit(
        attention_probs(q, k, lse, check_attention_inputs(q, k, v, causal=True, dropout_p=p), seed=seed)
    )
    kw = {"causal": True, "dropout_p": p, "dropout_mask": keep}
    refs = ref_grads(q, k, v, do, **kw)
    for g, r in zip((dq, dk, dv), refs):
        assert_close_to_ref(g, r, r)


@pytest.mark.parametrize("cfg", [SEPARATE, SEPARATE_TMA, FUSED], ids=["ptr", "tma", "fused"])
def test_deterministic_bit_identical(cfg: BwdConfig) -> None:
    q, k, v = make_qkv(1, 33, 33, 4, 1, 32)
    do = torch.randn_like(q)
    out, lse = flash_fwd(q, k, v, causal=True)
    first = flash_bwd(do, q, k, v, out, lse, causal=True, deterministic=True, config=cfg)
    second = flash_bwd(do, q, k, v, out, lse, causal=True, deterministic=True, config=cfg)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


SPLIT_DKDV = BwdConfig(16, 16, 16, 16, 4, 1, 4, 1, "separate", split_dkdv=True)


@pytest.mark.parametrize(
    ("cfg", "opts"),
    [
        (SEPARATE, {}),
        (ATOMIC, {"softcap": 3.0}),
        (SPLIT_DKDV, {"alibi": "batch"}),
        (SEPARATE_TMA, {"dropout_p": 0.2, "seed": 5}),
    ],
    ids=["separate", "atomic-softcap", "split-dkdv-alibi", "tma-dropout"],
)
def test_tail_split_backward_matches_whole_tiles(cfg: BwdConfig, opts: dict) -> None:
    """dK/dV tiles split over (query head, query tile) steps and dQ tiles over key tiles give the
    whole-tile gradients (and the reference's); separate dQ stays bit-identical run to run."""
    b, sq, sk, h, hk, d, resident = 2, 40, 70, 4, 2, 32, 16
    assert plan_tail_split(-(-sk // 16) * b * hk, (h // hk) * -(-sq // 16), resident) is not None  # dK/dV
    assert plan_tail_split(-(-sq // 16) * b * h, -(-sk // 16), resident) is not None  # dQ
    opts = dict(opts)
    alibi = _alibi(opts.pop("alibi", None), b, h)
    q, k, v = make_qkv(b, sq, sk, h, hk, d)
    do = torch.randn_like(q)
    out, lse = flash_fwd(q, k, v, alibi_slopes=alibi, **opts)
    split = flash_bwd(
        do, q, k, v, out, lse, config=cfg, alibi_slopes=alibi, resident_programs=resident, **opts
    )
    whole = flash_bwd(do, q, k, v, out, lse, config=cfg, alibi_slopes=alibi, **opts)
    for name, a, w in zip(("dq", "dk", "dv"), split, whole):
        torch.testing.assert_close(a, w, atol=1e-5, rtol=1e-5, msg=name)
    if "dropout_p" not in opts:
        refs = ref_grads(q, k, v, do, alibi_slopes=alibi, **opts)
        for name, a, r in zip(("dq", "dk", "dv"), split, refs):
            assert_close_to_ref(a, r, r, name=name)
    if cfg.dq_mode == "separate":
        again = flash_bwd(
            do, q, k, v, out, lse, config=cfg, alibi_slopes=alibi, resident_programs=resident, **opts
        )
        assert all(torch.equal(a, c) for a, c in zip(split, again))


def test_backward_validation() -> None:
    q, k, v = make_qkv(1, 8, 8, 2, 2, 32)
    out, lse = flash_fwd(q, k, v)
    with pytest.raises(ValueError, match="dout must match q"):
        flash_bwd(out[:, :4], q, k, v, out, lse)
    with pytest.raises(ValueError, match="lse must be a float32"):
        flash_bwd(out, q, k, v, out, lse[:, :1])
    with pytest.raises(ValueError, match="nheads"):
        flash_bwd(out[:, :, :1], q[:, :, :1], k[:, :, :1].repeat(1, 1, 2, 1), v[:, :, :1].repeat(1, 1, 2, 1),
                  out[:, :, :1], lse[:, :1])  # fmt: skip
