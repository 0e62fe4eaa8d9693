"""FlashAttention forward kernel (flashpage.ops.flash_fwd) vs the fp32 reference.

Runs under the Triton interpreter on CPU (16 x 16 tiles, so the small problems still span several
row and key tiles, partial tiles and all three loop parts: left-window edge, mask-free, diagonal).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import Tensor

from flashpage.ops.flash_configs import FwdConfig
from flashpage.ops.flash_fwd import (
    attention_probs,
    check_attention_inputs,
    flash_fwd,
    fwd_uses_tma,
    plan_tail_split,
    tail_split_applies,
    tma_row_view_ok,
)
from flashpage.ops.reference import attention_ref, varlen_attention_ref
from tests.tolerance import assert_close_to_ref


@pytest.fixture(autouse=True)
def on_device(device: str) -> Iterator[None]:
    """Create every test tensor on the test device (CUDA when present, else CPU + interpreter)."""
    with torch.device(device):
        yield


def make_qkv(
    b: int, sq: int, sk: int, h: int, hk: int, d: int, dtype: torch.dtype = torch.float32, grad: bool = False
) -> tuple[Tensor, Tensor, Tensor]:
    q = torch.randn(b, sq, h, d, dtype=dtype, requires_grad=grad)
    k = torch.randn(b, sk, hk, d, dtype=dtype, requires_grad=grad)
    v = torch.randn(b, sk, hk, d, dtype=dtype, requires_grad=grad)
    return q, k, v


def make_varlen(
    lens_q: list[int], lens_k: list[int], h: int, hk: int, d: int, pad: int = 0
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Packed q/k/v (with ``pad`` extra unused rows at the end) and int32 cu_seqlens."""
    cq = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    ck = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(cq[-1]) + pad, h, d)
    k = torch.randn(int(ck[-1]) + pad, hk, d)
    v = torch.randn(int(ck[-1]) + pad, hk, d)
    return q, k, v, cq, ck


def assert_lse_close(lse: Tensor, ref: Tensor, atol: float = 2e-5) -> None:
    """Same -inf pattern (rows with no visible key), finite values close."""
    assert lse.shape == ref.shape and lse.dtype == torch.float32
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref)), "rows with -inf LSE differ"
    fin = torch.isfinite(ref)
    if fin.any():
        assert (lse[fin] - ref[fin]).abs().max().item() <= atol


# (batch, seqlen_q, seqlen_k, nheads, nheads_k, d, options): a covering set, not a product.
FWD_CASES = [
    (2, 33, 33, 2, 2, 32, {}),
    (1, 40, 17, 4, 2, 64, {"causal": True}),  # seqlen_q > seqlen_k: leading rows see nothing
    (1, 17, 40, 2, 1, 96, {"causal": True}),  # seqlen_q < seqlen_k, padded head dim
    (1, 1, 37, 2, 2, 128, {"causal": True}),  # one query (decode-like)
    (1, 20, 1, 2, 1, 192, {"causal": True}),  # one key
    (1, 9, 23, 1, 1, 256, {"window_size": (4, 2)}),
    (1, 37, 29, 2, 2, 32, {"window_size": (5, -1)}),  # left only
    (1, 29, 37, 2, 1, 64, {"window_size": (-1, 3)}),  # right only
    (1, 35, 35, 2, 2, 32, {"window_size": (6, 0), "causal": True}),
    (1, 29, 37, 2, 1, 32, {"softcap": 2.5}),
    (2, 20, 31, 2, 1, 32, {"causal": True, "alibi": "batch", "softmax_scale": 0.3}),
    (1, 31, 20, 8, 1, 32, {"alibi": "heads", "window_size": (7, 7)}),  # GQA ratio 8
    (1, 25, 25, 4, 2, 64, {"softcap": 5.0, "alibi": "heads", "causal": True}),
]


def _alibi(kind: str | None, b: int, h: int) -> Tensor | None:
    if kind is None:
        return None
    return torch.rand(h) * 0.5 if kind == "heads" else torch.rand(b, h) * 0.5


@pytest.mark.parametrize(("b", "sq", "sk", "h", "hk", "d", "opts"), FWD_CASES)
def test_forward_matches_reference(b: int, sq: int, sk: int, h: int, hk: int, d: int, opts: dict) -> None:
    opts = dict(opts)
    alibi = _alibi(opts.pop("alibi", None), b, h)
    q, k, v = make_qkv(b, sq, sk, h, hk, d)
    out, lse = flash_fwd(q, k, v, alibi_slopes=alibi, **opts)
    ref, ref_lse = attention_ref(q, k, v, alibi_slopes=alibi, **opts)[:2]
    same = attention_ref(q, k, v, alibi_slopes=alibi, upcast=False, **opts)[0]
    assert out.shape == q.shape and out.dtype == q.dtype
    assert_close_to_ref(out, ref, same)
    assert lse.shape == (b, h, sq)
    assert_lse_close(lse, ref_lse)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_forward_half_precision(dtype: torch.dtype) -> None:
    q, k, v = make_qkv(1, 24, 30, 2, 1, 64, dtype=dtype)
    out, lse = flash_fwd(q, k, v, causal=True)
    ref, ref_lse = attention_ref(q, k, v, causal=True)[:2]
    same = attention_ref(q, k, v, causal=True, upcast=False)[0]
    assert out.dtype == dtype
    assert_close_to_ref(out, ref, same)
    assert_lse_close(lse, ref_lse, atol=2e-2)


def test_rows_without_visible_keys_are_zero() -> None:
    """Window (0, 0) with seqlen_q > seqlen_k: the first rows see nothing -> out 0, lse -inf."""
    q, k, v = make_qkv(1, 30, 10, 2, 2, 32)
    out, lse = flash_fwd(q, k, v, window_size=(0, 0))
    assert torch.all(out[:, :20] == 0)
    assert torch.all(torch.isneginf(lse[:, :, :20]))
    ref, ref_lse = attention_ref(q, k, v, window_size=(0, 0))[:2]
    assert_close_to_ref(out, ref, ref)
    assert_lse_close(lse, ref_lse)


@pytest.mark.parametrize("use_tma", [False, True])
def test_tma_and_pointer_paths(use_tma: bool) -> None:
    cfg = FwdConfig(16, 16, 4, 1, use_tma=use_tma)
    q, k, v = make_qkv(2, 37, 29, 4, 2, 64)
    prob = check_attention_inputs(q, k, v, causal=True)
    if torch.device(q.device).type == "cpu" or torch.cuda.get_device_capability()[0] >= 9:
        assert fwd_uses_tma(cfg, prob, q, k, v) == use_tma
    out, lse = flash_fwd(q, k, v, causal=True, config=cfg)
    ref, ref_lse = attention_ref(q, k, v, causal=True)[:2]
    assert_close_to_ref(out, ref, ref)
    assert_lse_close(lse, ref_lse)
    # a packed qkv buffer (batch, seqlen, 3, nheads, d): strided rows, still descriptor-compatible
    qkv = torch.randn(2, 21, 3, 2, 32)
    qp, kp, vp = qkv.unbind(2)
    if use_tma:
        assert fwd_uses_tma(cfg, check_attention_inputs(qp, kp, vp), qp, kp, vp) == fwd_uses_tma(
            cfg, prob, q, k, v
        )
    out, _ = flash_fwd(qp, kp, vp, config=cfg)
    ref = attention_ref(qp, kp, vp)[0]
    assert_close_to_ref(out, ref, ref)
    # varlen through the same path (descriptor over packed rows; rows bleed into the neighbour)
    qv, kv, vv, cq, ck = make_varlen([5, 0, 17, 1, 33], [9, 4, 17, 0, 20], 4, 1, 32)
    out, lse = flash_fwd(qv, kv, vv, cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=33, max_seqlen_k=20,
                         window_size=(3, 2), config=cfg)  # fmt: skip
    ref, ref_lse = varlen_attention_ref(qv, kv, vv, cq, ck, window_size=(3, 2))
    assert_close_to_ref(out, ref, ref)
    assert_lse_close(lse, ref_lse)


def test_tma_falls_back_on_unaligned_or_padded() -> None:
    q = make_qkv(1, 20, 20, 2, 2, 96)[0]
    assert not tma_row_view_ok(q, False, 96)  # head dim 96 is padded to 128: pointer path
    big = torch.randn(1, 20, 2, 33)
    qs = big[..., :32]  # row stride 66 floats = 264 bytes, stride(-2) = 33 != d
    assert not tma_row_view_ok(qs, False, 32)
    cfg = FwdConfig(16, 16, 4, 1, use_tma=True)
    ks, vs = torch.randn(1, 20, 2, 33)[..., :32], torch.randn(1, 20, 2, 33)[..., :32]
    prob = check_attention_inputs(qs, ks, vs)
    assert not fwd_uses_tma(cfg, prob, qs, ks, vs)
    out, _ = flash_fwd(qs, ks, vs, config=cfg)
    ref = attention_ref(qs, ks, vs)[0]
    assert_close_to_ref(out, ref, ref)


def test_varlen_uneven_and_empty_sequences() -> None:
    lens_q, lens_k = [7, 1, 0, 26, 3], [7, 12, 5, 26, 0]
    qv, kv, vv, cq, ck = make_varlen(lens_q, lens_k, 4, 2, 32, pad=3)
    alibi = torch.rand(5, 4) * 0.3
    for opts in ({"causal": True}, {"window_size": (4, -1), "softcap": 3.0}):
        out, lse = flash_fwd(qv, kv, vv, cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=26, max_seqlen_k=26,
                             alibi_slopes=alibi, **opts)  # fmt: skip
        ref, ref_lse = varlen_attention_ref(qv, kv, vv, cq, ck, alibi_slopes=alibi, **opts)
        assert lse.shape == (4, qv.shape[0])
        valid = int(cq[-1])
        assert_close_to_ref(out[:valid], ref[:valid], ref[:valid])
        assert_lse_close(lse, ref_lse)


def test_attention_probs_and_dropout_pattern() -> None:
    q, k, v = make_qkv(1, 21, 27, 2, 1, 32)
    p = 0.25
    out, lse = flash_fwd(q, k, v, causal=True, dropout_p=p, seed=1234)
    prob = check_attention_inputs(q, k, v, causal=True, dropout_p=p)
    s = attention_probs(q, k, lse, prob, seed=1234)
    keep = ~torch.signbit(s)
    ref, _, ref_probs = attention_ref(q, k, v, causal=True, dropout_p=p, dropout_mask=keep, return_probs=True)
    assert s.shape == (1, 2, 21, 27) and s.dtype == torch.float32
    assert (s.clamp(min=0) - ref_probs).abs().max().item() < 1e-5
    same = attention_ref(q, k, v, causal=True, dropout_p=p, dropout_mask=keep, upcast=False)[0]
    assert_close_to_ref(out, ref, same)
    # without dropout the probabilities are the softmax: rows with keys sum to 1
    s0 = attention_probs(q, k, lse, check_attention_inputs(q, k, v, causal=True))
    assert torch.allclose(s0.sum(-1), torch.ones(1, 2, 21), atol=1e-5)


def test_dropout_same_seed_same_mask_other_seed_differs() -> None:
    q, k, v = make_qkv(1, 16, 16, 2, 2, 32)
    a = flash_fwd(q, k, v, dropout_p=0.5, seed=7)[0]
    b = flash_fwd(q, k, v, dropout_p=0.5, seed=7)[0]
    c = flash_fwd(q, k, v, dropout_p=0.5, seed=8)[0]
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


# ------------------------------------------------------------------------------------------------
# Tail split (stream-K over the last partial wave of row tiles)
# ------------------------------------------------------------------------------------------------
def test_plan_tail_split_deals_the_tail_once() -> None:
    """Every (tail tile, key tile) step lies in exactly one piece; pieces stay within the slots a
    tile has; the split exists exactly when the last wave is partial and pieces are short enough."""
    for n_tiles in range(1, 41):
        for kv in (1, 2, 3, 5, 8, 16, 33):
            for resident in (1, 2, 3, 5, 7, 12, 13, 64):
                split = plan_tail_split(n_tiles, kv, resident)
                if n_tiles % resident == 0:
                    assert split is None
                if split is None:
                    continue
                assert split.n_main % resident == 0 and split.n_main + split.tail_tiles == n_tiles
                assert 0 < split.tail_tiles < resident and split.n_tail <= resident
                assert 4 * split.piece_len <= 3 * kv and split.piece_len >= min(2, kv)
                covered = []
                for j in range(split.n_tail):
                    lo, hi = j * split.piece_len, min((j + 1) * split.piece_len, split.tail_work)
                    assert lo < hi  # no empty piece
                    covered.extend(range(lo, hi))
                    for t in range(lo // kv, (hi - 1) // kv + 1):
                        assert 0 <= j - (t * kv) // split.piece_len < split.max_pieces
                assert covered == list(range(split.tail_work))
    assert plan_tail_split(2048, 128, 132) is not None and plan_tail_split(1980, 128, 132) is None
    # d=256 at 16k: 1024 tiles, the last wave 76% full, pieces would be as long: no split
    assert plan_tail_split(1024, 256, 132) is None


# (batch, seqlen_q, seqlen_k, nheads, nheads_k, d, options, resident): partial tiles both ways, GQA,
# padded head dim, softcap, ALiBi; resident programs chosen so the tail is split.
TAIL_CASES = [
    (2, 40, 70, 3, 1, 32, {}, 5),
    (1, 33, 100, 4, 2, 96, {"softcap": 3.0}, 7),
    (2, 17, 64, 2, 2, 64, {"alibi": "batch", "softmax_scale": 0.2}, 3),
    (1, 48, 200, 2, 1, 32, {}, 64),  # fewer tiles than resident programs: every tile split
]


@pytest.mark.parametrize(("b", "sq", "sk", "h", "hk", "d", "opts", "resident"), TAIL_CASES)
def test_tail_split_matches_reference(
    b: int, sq: int, sk: int, h: int, hk: int, d: int, opts: dict, resident: int
) -> None:
    cfg = FwdConfig(16, 16, 4, 1)
    assert plan_tail_split(-(-sq // 16) * b * h, -(-sk // 16), resident) is not None  # the split runs
    opts = dict(opts)
    alibi = _alibi(opts.pop("alibi", None), b, h)
    q, k, v = make_qkv(b, sq, sk, h, hk, d)
    out, lse = flash_fwd(q, k, v, alibi_slopes=alibi, config=cfg, resident_programs=resident, **opts)
    ref, ref_lse = attention_ref(q, k, v, alibi_slopes=alibi, **opts)[:2]
    same = attention_ref(q, k, v, alibi_slopes=alibi, upcast=False, **opts)[0]
    assert_close_to_ref(out, ref, same)
    assert_lse_close(lse, ref_lse)
    again = flash_fwd(q, k, v, alibi_slopes=alibi, config=cfg, resident_programs=resident, **opts)
    assert torch.equal(again[0], out) and torch.equal(again[1], lse)  # fixed merge order


def test_tail_split_dropout_matches_whole_tiles() -> None:
    """The dropout mask is a function of the element: split and whole-tile runs keep the same ones."""
    q, k, v = make_qkv(1, 40, 50, 3, 3, 32)
    cfg = FwdConfig(16, 16, 4, 1)
    split = flash_fwd(q, k, v, dropout_p=0.3, seed=11, config=cfg, resident_programs=4)
    whole = flash_fwd(q, k, v, dropout_p=0.3, seed=11, config=cfg)
    torch.testing.assert_close(split[0], whole[0], atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(split[1], whole[1], atol=2e-6, rtol=1e-6)


def test_tail_split_only_for_uniform_row_tiles() -> None:
    q, k, v = make_qkv(1, 8, 8, 2, 2, 32)
    cfg = FwdConfig(16, 16, 4, 1)
    assert tail_split_applies(cfg, check_attention_inputs(q, k, v, softcap=1.0))
    assert not tail_split_applies(FwdConfig(16, 16, 4, 1, split_tail=False), check_attention_inputs(q, k, v))
    for opts in ({"causal": True}, {"window_size": (3, -1)}, {"window_size": (-1, 2)}):
        assert not tail_split_applies(cfg, check_attention_inputs(q, k, v, **opts))
    qv, kv, vv, cq, ck = make_varlen([3, 5], [4, 4], 2, 1, 32)
    prob = check_attention_inputs(
        qv, kv, vv, cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=5, max_seqlen_k=4
    )
    assert not tail_split_applies(cfg, prob)
    # causal with resident programs given: whole tiles, still exact
    q, k, v = make_qkv(1, 40, 40, 2, 1, 32)
    out = flash_fwd(q, k, v, causal=True, config=cfg, resident_programs=5)[0]
    assert_close_to_ref(out, attention_ref(q, k, v, causal=True)[0], attention_ref(q, k, v, causal=True)[0])


# ------------------------------------------------------------------------------------------------
# Validation (no kernel launches)
# ------------------------------------------------------------------------------------------------
def _good() -> tuple[Tensor, Tensor, Tensor]:
    return make_qkv(1, 8, 8, 4, 2, 32)


@pytest.mark.parametrize(
    ("mutate", "exc", "match"),
    [
        (lambda q, k, v: (q[0], k, v), ValueError, "q must be 4-D"),
        (lambda q, k, v: (q, k.repeat(2, 1, 1, 1), v.repeat(2, 1, 1, 1)), ValueError, "batch mismatch"),
        (lambda q, k, v: (q, k[..., :16].contiguous(), v), ValueError, "head dim mismatch"),
        (lambda q, k, v: (q, k, v[:, :4]), ValueError, "k and v must have one shape"),
        (lambda q, k, v: (q[:, :, :3], k, v), ValueError, "divisible by nheads_k"),
        (lambda q, k, v: (q.double(), k.double(), v.double()), TypeError, "unsupported dtype"),
        (lambda q, k, v: (q, k.half(), v), TypeError, "share one dtype"),
        (
            lambda q, k, v: (q[..., :4].contiguous(), k[..., :4].contiguous(), v[..., :4].contiguous()),
            ValueError,
            "head dim 4 is unsupported",
        ),
        (lambda q, k, v: (q.transpose(-1, -2), k, v), ValueError, "contiguous last dimension"),
        (lambda q, k, v: ("q", k, v), TypeError, "q must be a torch.Tensor"),
    ],
)
def test_validation_errors(mutate, exc: type, match: str) -> None:  # type: ignore[no-untyped-def]
    q, k, v = mutate(*_good())
    with pytest.raises(exc, match=match):
        flash_fwd(q, k, v)


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"dropout_p": 1.0}, ValueError, "dropout_p"),
        ({"dropout_p": -0.1}, ValueError, "dropout_p"),
        ({"softcap": -1.0}, ValueError, "softcap"),
        ({"alibi_slopes": "x"}, TypeError, "alibi_slopes"),
        ({"alibi_slopes": torch.ones(3)}, ValueError, "alibi_slopes"),
        ({"alibi_slopes": torch.ones(4, dtype=torch.float64)}, TypeError, "alibi_slopes must be float32"),
        ({"window_size": (1,)}, ValueError, "window_size"),
    ],
)
def test_option_validation(kwargs: dict, exc: type, match: str) -> None:
    q, k, v = _good()
    with pytest.raises(exc, match=match):
        flash_fwd(q, k, v, **kwargs)


def test_varlen_validation() -> None:
    qv, kv, vv, cq, ck = make_varlen([3, 5], [4, 4], 2, 1, 32)
    base = {"max_seqlen_q": 5, "max_seqlen_k": 4}
    with pytest.raises(TypeError, match="cu_seqlens_q must be int32"):
        flash_fwd(qv, kv, vv, cu_seqlens_q=cq.long(), cu_seqlens_k=ck, **base)
    bad = torch.tensor([0, 5, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match="monotone"):
        flash_fwd(qv, kv, vv, cu_seqlens_q=bad, cu_seqlens_k=ck, **base)
    with pytest.raises(ValueError, match="max_seqlen"):
        flash_fwd(qv, kv, vv, cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=2, max_seqlen_k=4)
    with pytest.raises(ValueError, match="3-D"):
        flash_fwd(qv.unsqueeze(0), kv, vv, cu_seqlens_q=cq, cu_seqlens_k=ck, **base)
    with pytest.raises(ValueError, match="sequences"):
        flash_fwd(qv, kv, vv, cu_seqlens_q=cq, cu_seqlens_k=ck[:2], **base)
    with pytest.raises(ValueError, match="needs both"):
        flash_fwd(qv, kv, vv, cu_seqlens_q=cq, **base)


def test_padded_checks_are_remembered(monkeypatch: pytest.MonkeyPatch) -> None:
    """A repeated padded call reuses its validated problem (the checks read only metadata); new
    metadata, option values or types are checked again, and invalid calls still raise."""
    from flashpage.ops import flash_fwd as ff

    ff._PADDED_PROBLEMS.clear()
    calls: list[int] = []
    full_check = ff._check_inputs
    monkeypatch.setattr(ff, "_check_inputs", lambda *a: calls.append(1) or full_check(*a))
    q, k, v = _good()
    p1 = check_attention_inputs(q, k, v, causal=True)
    p2 = check_attention_inputs(q.clone(), k.clone(), v, causal=True)  # same metadata, new tensors
    assert p1 is p2 and len(calls) == 1
    assert check_attention_inputs(q, k, v, causal=False).causal is False and len(calls) == 2
    assert check_attention_inputs(q, k, v, causal=1).causal is True and len(calls) == 3  # another type
    p_scale = check_attention_inputs(q, k, v, softmax_scale=0.5)
    assert p_scale.softmax_scale == 0.5 and len(calls) == 4
    scale = torch.tensor(0.25)  # read by value: never remembered
    assert check_attention_inputs(q, k, v, softmax_scale=scale).softmax_scale == 0.25
    scale.fill_(0.125)
    assert check_attention_inputs(q, k, v, softmax_scale=scale).softmax_scale == 0.125 and len(calls) == 6
    with pytest.raises(ValueError, match="contiguous last dimension"):
        check_attention_inputs(q.transpose(-1, -2), k, v, causal=True)
    with pytest.raises(TypeError, match="share one dtype"):
        check_attention_inputs(q, k.half(), v, causal=True)
    with pytest.raises(ValueError, match="dropout_p"):
        check_attention_inputs(q, k, v, causal=True, dropout_p=1.0)
    assert check_attention_inputs(q, k, v, causal=True) is p1 and len(calls) == 9  # failures not stored


def test_cpu_without_interpreter_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, k, v = (t.cpu() for t in _good())
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        flash_fwd(q, k, v)
