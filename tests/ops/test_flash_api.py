"""Public API (flashpage.ops.flash_attn): flash-attn 2.x signatures, backends, autograd, dropout,
determinism, varlen, torch.compile."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

import flashpage
from flashpage.ops.flash_args import FlashAttnError
from flashpage.ops.flash_attn import flash_attn_func, flash_attn_varlen_func, flash_attn_varlen_fwd
from flashpage.ops.kvcache import flash_attn_with_kvcache
from flashpage.ops.reference import attention_ref, varlen_attention_ref, visible_mask
from tests.ops.test_flash_fwd import make_qkv, make_varlen, on_device  # noqa: F401 (fixture)
from tests.tolerance import assert_close_to_ref


@pytest.fixture
def triton_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLASHPAGE_BACKEND", "triton")


def close(out: Tensor, ref: Tensor, atol: float | None = None) -> None:
    """Tolerance rule with the fp32 reference as its own same-precision baseline (fp32 inputs)."""
    assert_close_to_ref(out.detach(), ref.detach(), ref.detach(), atol=atol)


def _grads(out: Tensor, do: Tensor, *ts: Tensor) -> tuple[Tensor, ...]:
    return torch.autograd.grad(out, ts, do)


@pytest.mark.usefixtures("triton_backend")
def test_func_forward_backward_gqa_alibi_softcap() -> None:
    q, k, v = make_qkv(2, 19, 26, 4, 2, 32, grad=True)
    alibi = torch.rand(2, 4) * 0.4
    kw = {"causal": True, "softcap": 3.0, "alibi_slopes": alibi, "softmax_scale": 0.2}
    out = flash_attn_func(q, k, v, **kw)
    assert isinstance(out, Tensor) and out.shape == q.shape
    do = torch.randn_like(out)
    g = _grads(out, do, q, k, v)
    ref = attention_ref(q, k, v, **kw)[0]  # type: ignore[arg-type]
    rg = _grads(ref, do, q, k, v)
    close(out, ref)
    for a, r in zip(g, rg):
        close(a, r)


@pytest.mark.usefixtures("triton_backend")
@pytest.mark.parametrize("grad", [True, False])
@pytest.mark.parametrize("varlen", [False, True])
def test_eager_call_validates_inputs_once(monkeypatch: pytest.MonkeyPatch, grad: bool, varlen: bool) -> None:
    """Host time of short eager calls: the API validates once and hands the problem on (neither
    launcher checks again, forward or backward)."""
    import flashpage.ops.flash_attn as fa
    import flashpage.ops.flash_bwd as fb
    import flashpage.ops.flash_fwd as ff

    calls = {"api": 0, "launcher": 0, "bwd": 0}

    def counting(name: str, fn):  # type: ignore[no-untyped-def]
        def wrapped(*a, **kw):  # type: ignore[no-untyped-def]
            calls[name] += 1
            return fn(*a, **kw)

        return wrapped

    monkeypatch.setattr(fa, "check_attention_inputs", counting("api", ff.check_attention_inputs))
    monkeypatch.setattr(ff, "check_attention_inputs", counting("launcher", ff.check_attention_inputs))
    monkeypatch.setattr(fb, "check_attention_inputs", counting("bwd", ff.check_attention_inputs))
    if varlen:
        q, k, v, cu_q, cu_k = (t.requires_grad_(grad) if t.is_floating_point() else t
                               for t in make_varlen([5, 17], [9, 17], 4, 2, 32))  # fmt: skip
        out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 17, 17, causal=True)
    else:
        q, k, v = make_qkv(2, 19, 26, 4, 2, 32, grad=grad)
        out = flash_attn_func(q, k, v, causal=True)
    assert isinstance(out, Tensor) and out.requires_grad == grad
    if grad:
        out.sum().backward()
        assert q.grad is not None and q.grad.shape == q.shape
    assert calls == {"api": 1, "launcher": 0, "bwd": 0}


@pytest.mark.usefixtures("triton_backend")
def test_return_attn_probs_shapes_and_lse() -> None:
    q, k, v = make_qkv(1, 13, 21, 2, 1, 32)
    out, lse, s = flash_attn_func(q, k, v, window_size=(3, 5), return_attn_probs=True)
    ref, ref_lse, ref_p = attention_ref(q, k, v, window_size=(3, 5), return_probs=True)
    assert lse.shape == (1, 2, 13) and lse.dtype == torch.float32
    assert s.shape == (1, 2, 13, 21) and s.dtype == torch.float32
    assert torch.allclose(lse, ref_lse, atol=2e-5)
    assert torch.allclose(s, ref_p, atol=1e-5)
    close(out, ref)


@pytest.mark.usefixtures("triton_backend")
def test_dropout_statistics_scaling_and_reproducibility() -> None:
    q, k, v = make_qkv(1, 40, 40, 4, 4, 32, grad=True)
    p = 0.3
    torch.manual_seed(123)
    out, _, s = flash_attn_func(q, k, v, dropout_p=p, causal=True, return_attn_probs=True)
    keep = ~torch.signbit(s)
    vis = visible_mask(40, 40, causal=True)
    frac = keep[..., vis].float().mean().item()  # 4 heads x 820 visible entries
    assert abs(frac - (1 - p)) < 0.04, frac
    # the output is the reference with exactly this mask, scaled by 1/(1-p)
    ref = attention_ref(q, k, v, causal=True, dropout_p=p, dropout_mask=keep)[0]
    close(out, ref)
    do = torch.randn_like(out)
    g = _grads(out, do, q, k, v)
    for a, r in zip(g, _grads(ref, do, q, k, v)):
        close(a, r)
    torch.manual_seed(123)
    again = flash_attn_func(q, k, v, dropout_p=p, causal=True)
    assert torch.equal(out, again)
    other = flash_attn_func(q, k, v, dropout_p=p, causal=True)  # generator moved on: new mask
    assert not torch.equal(out, other)


@pytest.mark.usefixtures("triton_backend")
def test_deterministic_gradients_bit_identical() -> None:
    q, k, v = make_qkv(1, 30, 30, 8, 1, 32, grad=True)
    do = torch.randn(1, 30, 8, 32)
    g1 = _grads(flash_attn_func(q, k, v, causal=True, deterministic=True), do, q, k, v)  # type: ignore[arg-type]
    g2 = _grads(flash_attn_func(q, k, v, causal=True, deterministic=True), do, q, k, v)  # type: ignore[arg-type]
    assert all(torch.equal(a, b) for a, b in zip(g1, g2))


@pytest.mark.usefixtures("triton_backend")
def test_varlen_func_forward_backward_and_probs() -> None:
    q, k, v, cq, ck = make_varlen([6, 1, 0, 17], [6, 9, 3, 17], 4, 2, 32)
    for t in (q, k, v):
        t.requires_grad_()
    out, lse, s = flash_attn_varlen_func(q, k, v, cq, ck, 17, 17, causal=True, return_attn_probs=True)
    ref, ref_lse = varlen_attention_ref(q, k, v, cq, ck, causal=True)
    assert lse.shape == (4, q.shape[0]) and s.shape == (4, 4, 17, 17)
    close(out, ref)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    do = torch.randn_like(out)
    for a, r in zip(_grads(out, do, q, k, v), _grads(ref, do, q, k, v)):
        close(a, r)
    kc = torch.randn(4, 32, 2, 32, requires_grad=True)  # one 32-token block per sequence
    table = torch.arange(4, dtype=torch.int32).view(4, 1)
    paged = flash_attn_varlen_func(q, kc, kc, cq, ck, 17, 17, causal=True, block_table=table)
    close(
        paged,
        varlen_attention_ref(
            q, *[torch.cat([kc[i, :n] for i, n in enumerate([6, 9, 3, 17])])] * 2, cq, ck, causal=True
        )[0],
    )
    with pytest.raises(RuntimeError, match=r"block_table: .* has no backward"):  # paged varlen: forward only
        paged.sum().backward()


def test_torch_backend_matches_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    q, k, v = make_qkv(1, 18, 23, 4, 2, 32, grad=True)
    do = torch.randn(1, 18, 4, 32)
    res = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("FLASHPAGE_BACKEND", backend)
        out = flash_attn_func(q, k, v, causal=True, window_size=(6, -1))
        res[backend] = (out, *_grads(out, do, q, k, v))  # type: ignore[arg-type]
    for a, b in zip(res["triton"], res["torch"]):
        close(a, b)
    # the torch backend's varlen path and dropout encoding
    monkeypatch.setenv("FLASHPAGE_BACKEND", "torch")
    qv, kv, vv, cq, ck = make_varlen([5, 0, 9], [7, 2, 9], 2, 1, 32, pad=1)
    out, _lse, s = flash_attn_varlen_func(qv, kv, vv, cq, ck, 9, 9, dropout_p=0.5, return_attn_probs=True)
    keep = [~torch.signbit(s[i, :, :n_q, :n_k]) for i, (n_q, n_k) in enumerate([(5, 7), (0, 2), (9, 9)])]
    ref, _ = varlen_attention_ref(qv, kv, vv, cq, ck, dropout_p=0.5, dropout_mask=keep)
    assert torch.allclose(out, ref, atol=1e-5) and out.shape == qv.shape


def test_auto_backend_and_cpu_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    q, k, v = (t.cpu() for t in make_qkv(1, 8, 8, 2, 2, 32))
    monkeypatch.setenv("FLASHPAGE_BACKEND", "auto")  # CPU tensors -> torch reference path
    out = flash_attn_func(q, k, v)
    assert torch.allclose(out, attention_ref(q, k, v)[0], atol=1e-6)  # type: ignore[arg-type]
    monkeypatch.setenv("FLASHPAGE_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        flash_attn_func(q, k, v)


@pytest.mark.usefixtures("triton_backend")
def test_api_validation_errors() -> None:
    q, k, v = make_qkv(1, 8, 8, 4, 2, 32)
    with pytest.raises(ValueError, match="dropout_p"):
        flash_attn_func(q, k, v, dropout_p=1.5)
    with pytest.raises(ValueError, match="divisible"):
        flash_attn_func(q[:, :, :3], k, v)
    with pytest.raises(TypeError, match="int32"):
        flash_attn_varlen_func(q[0], k[0], v[0], torch.tensor([0, 8]), torch.tensor([0, 8]), 8, 8)


@pytest.mark.usefixtures("triton_backend")
def test_varlen_fwd_engine_entry() -> None:
    q, k, v, cq, ck = make_varlen([4, 11, 1], [4, 11, 1], 4, 2, 32)
    out, lse = flash_attn_varlen_fwd(q, k, v, cq, ck, 11, 11, None, True, (-1, -1), 0.0, None, validate=False)
    ref, ref_lse = varlen_attention_ref(q, k, v, cq, ck, causal=True)
    close(out, ref)
    assert torch.allclose(lse, ref_lse, atol=2e-5)


@pytest.mark.usefixtures("triton_backend")
def test_torch_compile_fullgraph_with_autograd() -> None:
    q, k, v = make_qkv(1, 16, 16, 2, 1, 32, grad=True)

    def loss_fn(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return flash_attn_func(q, k, v, causal=True).square().sum()  # type: ignore[union-attr]

    compiled = torch.compile(loss_fn, backend="aot_eager", fullgraph=True)
    g = torch.autograd.grad(compiled(q, k, v), (q, k, v))
    rg = torch.autograd.grad(attention_ref(q, k, v, causal=True)[0].square().sum(), (q, k, v))
    for a, r in zip(g, rg):
        close(a, r, atol=1e-4)


@pytest.mark.usefixtures("triton_backend")
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compile"])
def test_expanded_output_gradient(compiled: bool) -> None:
    """``out.sum()`` hands the backward an expanded (stride-0) gradient: eager and compiled paths
    must give the reference gradients."""
    q, k, v = make_qkv(1, 16, 16, 2, 1, 32, grad=True)

    def loss_fn(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return flash_attn_func(q, k, v, causal=True).sum()  # type: ignore[union-attr]

    fn = torch.compile(loss_fn, backend="aot_eager", fullgraph=True) if compiled else loss_fn
    g = torch.autograd.grad(fn(q, k, v), (q, k, v))
    rg = torch.autograd.grad(attention_ref(q, k, v, causal=True)[0].sum(), (q, k, v))
    for a, r in zip(g, rg):
        close(a, r, atol=1e-4)


@pytest.mark.usefixtures("triton_backend")
def test_custom_op_opcheck() -> None:
    q, k, v = make_qkv(1, 16, 16, 2, 1, 32, grad=True)
    args = (q, k, v, None, None, 0, 0, 0.0, 0.25, True, -1, -1, 0.0, None, False, False)
    torch.library.opcheck(
        torch.ops.flashpage.flash_attn_forward.default, args,
        test_utils=("test_schema", "test_faketensor", "test_autograd_registration"),
    )  # fmt: skip


@pytest.mark.usefixtures("triton_backend")
@pytest.mark.parametrize("d", [8, 16, 24])
def test_small_head_dims_forward_backward(d: int) -> None:
    """flash-attn 2 takes every multiple of 8: padded and varlen, forward and backward, and paged."""
    q, k, v = make_qkv(1, 9, 12, 4, 2, d, grad=True)
    out = flash_attn_func(q, k, v, causal=True)
    ref = attention_ref(q, k, v, causal=True)[0]
    close(out, ref)  # type: ignore[arg-type]
    do = torch.randn_like(ref)
    for a, r in zip(_grads(out, do, q, k, v), _grads(ref, do, q, k, v)):  # type: ignore[arg-type]
        close(a, r)
    qv, kv, vv, cq, ck = make_varlen([3, 5], [4, 8], 2, 1, d)
    out_v = flash_attn_varlen_func(qv, kv, vv, cq, ck, 5, 8, causal=True)
    close(out_v, varlen_attention_ref(qv, kv, vv, cq, ck, causal=True)[0])  # type: ignore[arg-type]
    kc, vc = torch.randn(2, 2, 8, 1, d).unbind(0)
    table = torch.tensor([[1], [0]], dtype=torch.int32)
    paged = flash_attn_varlen_func(qv, kc, vc, cq, ck, 5, 8, causal=True, block_table=table)
    kp, vp = torch.cat([kc[1, :4], kc[0]]), torch.cat([vc[1, :4], vc[0]])  # the table's blocks, gathered
    close(paged, varlen_attention_ref(qv, kp, vp, cq, ck, causal=True)[0])  # type: ignore[arg-type]


@pytest.mark.usefixtures("triton_backend")
def test_window_size_any_int_pair_or_tensor() -> None:
    """flash-attn's tests pass window_size as a 2-element tensor; lists and tuples work too."""
    q, k, v = make_qkv(1, 10, 10, 2, 1, 16)
    ref = attention_ref(q, k, v, window_size=(3, 1))[0]
    for w in ((3, 1), [3, 1], torch.tensor([3, 1]), (torch.tensor(3), 1)):
        close(flash_attn_func(q, k, v, window_size=w), ref)  # type: ignore[arg-type]
    cu = torch.tensor([0, 10], dtype=torch.int32)
    close(flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 10, 10, window_size=torch.tensor([3, 1])), ref[0])  # type: ignore[arg-type]
    out = flash_attn_with_kvcache(q, k, v, window_size=torch.tensor([3, 1], dtype=torch.int32))
    close(out, ref)  # type: ignore[arg-type]
    for bad in ((1, 2, 3), (1.5, 0), torch.tensor([1.0, 2.0]), 4):
        with pytest.raises(FlashAttnError, match="window_size"):
            flash_attn_func(q, k, v, window_size=bad)  # type: ignore[arg-type]


@pytest.mark.usefixtures("triton_backend")
def test_argument_errors_are_runtime_and_value_errors_naming_the_argument() -> None:
    q, k, v = make_qkv(1, 8, 8, 4, 2, 16)
    qv, kv, vv, cq, ck = make_varlen([8], [8], 4, 2, 16)
    kc = torch.randn(2, 8, 2, 16)
    table = torch.zeros(1, 1, dtype=torch.int32)
    calls = {
        "dropout_p": lambda: flash_attn_func(q, k, v, dropout_p=1.5),
        "alibi_slopes": lambda: flash_attn_func(q, k, v, alibi_slopes=torch.ones(3)),
        "cu_seqlens_q": lambda: flash_attn_varlen_func(qv, kv, vv, cq.long(), ck, 8, 8),
        "block_table": lambda: flash_attn_varlen_func(qv, kc, kc, cq, ck, 8, 8, block_table=table.long()),
        "cu_seqlens_k": lambda: flash_attn_varlen_func(qv, kc, kc, cq, ck * 2, 8, 16, block_table=table),
        "cache_batch_idx": lambda: flash_attn_with_kvcache(
            q, kc, kc, cache_batch_idx=torch.tensor([5]).int()
        ),
        "num_splits": lambda: flash_attn_with_kvcache(q, kc, kc, num_splits=-1),
        "qkv": lambda: flashpage.flash_attn_qkvpacked_func(q),
    }
    for name, call in calls.items():
        with pytest.raises(FlashAttnError, match=rf"^{name}: ") as info:
            call()
        assert isinstance(info.value, RuntimeError) and isinstance(info.value, ValueError), name
    with pytest.raises(TypeError, match=r"^cu_seqlens_q: "):  # type errors stay TypeErrors too
        flash_attn_varlen_func(qv, kv, vv, cq.long(), ck, 8, 8)
    assert flashpage.FlashAttnError is FlashAttnError


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_packed_variants_match_unpacked_and_grad_into_the_pack(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FLASHPAGE_BACKEND", backend)
    qkv = torch.randn(2, 7, 3, 2, 16, requires_grad=True)
    q, k, v = (t.detach().requires_grad_() for t in qkv.unbind(2))
    out = flashpage.flash_attn_qkvpacked_func(qkv, causal=True)
    ref = flash_attn_func(q, k, v, causal=True)
    do = torch.randn_like(out)
    assert torch.equal(out, ref)
    (dqkv,) = torch.autograd.grad(out, qkv, do)
    assert torch.equal(dqkv, torch.stack(_grads(ref, do, q, k, v), dim=2))
    kv = torch.randn(2, 9, 2, 1, 16, requires_grad=True)
    k1, v1 = (t.detach().requires_grad_() for t in kv.unbind(2))
    out = flashpage.flash_attn_kvpacked_func(q, kv, window_size=(2, 2))
    ref = flash_attn_func(q, k1, v1, window_size=(2, 2))
    assert torch.equal(out, ref)
    dkv_ref = torch.stack(_grads(ref, do, k1, v1), dim=2)
    assert torch.equal(torch.autograd.grad(out, kv, do)[0], dkv_ref)
    # varlen: the batch above packed (total, 3, nheads, d) / (total, 2, nheads_k, d)
    cu = torch.tensor([0, 7, 14], dtype=torch.int32)
    cu_k = torch.tensor([0, 9, 18], dtype=torch.int32)
    qkv_p = qkv.detach().reshape(14, 3, 2, 16).requires_grad_()
    out = flashpage.flash_attn_varlen_qkvpacked_func(qkv_p, cu, 7, causal=True)
    close(out, flashpage.flash_attn_qkvpacked_func(qkv, causal=True).reshape(14, 2, 16))  # type: ignore[union-attr]
    (g,) = torch.autograd.grad(out, qkv_p, do.reshape(14, 2, 16))
    close(g, dqkv.reshape(14, 3, 2, 16))
    kv_p = kv.detach().reshape(18, 2, 1, 16).requires_grad_()
    out = flashpage.flash_attn_varlen_kvpacked_func(
        q.reshape(14, 2, 16), kv_p, cu, cu_k, 7, 9, window_size=(2, 2)
    )
    close(out, ref.reshape(14, 2, 16))  # type: ignore[union-attr]
    dkv = torch.autograd.grad(out, kv_p, do.reshape(14, 2, 16))[0]
    close(dkv, dkv_ref.reshape(18, 2, 1, 16))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_paged_varlen_forward_on_grad_inputs_backward_raises(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As flash-attn: the forward runs on inputs that require grad; only a backward raises."""
    monkeypatch.setenv("FLASHPAGE_BACKEND", backend)
    qv, _, _, cq, ck = make_varlen([2, 6], [5, 3], 2, 1, 16)  # sequence 1: more queries than keys
    qv.requires_grad_()
    kc = torch.randn(3, 8, 1, 16, requires_grad=True)
    table = torch.tensor([[2], [0]], dtype=torch.int32)
    out, lse, _ = flash_attn_varlen_func(
        qv, kc, kc, cq, ck, 6, 5, causal=True, block_table=table, return_attn_probs=True
    )
    ref, ref_lse = varlen_attention_ref(
        qv, torch.cat([kc[2, :5], kc[0, :3]]), torch.cat([kc[2, :5], kc[0, :3]]), cq, ck, causal=True
    )
    close(out, ref)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)) and bool(torch.isneginf(lse).any())
    with pytest.raises(FlashAttnError, match=r"^block_table: .*no backward"):
        out.sum().backward()
