"""flash_attn_with_kvcache (flash-attn 2.x contract) vs the reference (Triton interpreter on CPU)."""

from __future__ import annotations

import re
import shutil

import pytest
import torch
from torch import Tensor
from torch._dynamo.backends.debugging import aot_eager

from flashpage.ops.kvcache import flash_attn_with_kvcache
from flashpage.ops.reference import attention_ref, paged_attention_ref
from tests.ops.test_paged_decode import make_paged_cache, on_device  # noqa: F401 (autouse fixture)
from tests.tolerance import assert_close_to_ref


def _rotary_tables(seqlen_ro: int, rotary_dim: int) -> tuple[Tensor, Tensor, Tensor]:
    half = rotary_dim // 2
    theta = torch.arange(seqlen_ro).float()[:, None] * 10000.0 ** (-torch.arange(half).float() / half)
    return theta, torch.cos(theta), torch.sin(theta)


def _rotary_ref(x: Tensor, theta: Tensor, pos: Tensor, interleaved: bool) -> Tensor:
    """Rotation as complex multiplication (independent of the implementation's cos/sin formulas)."""
    half = theta.shape[1]
    xr = x[..., : 2 * half].float()
    if interleaved:
        z = torch.view_as_complex(xr.reshape(*xr.shape[:-1], half, 2).contiguous())
    else:
        z = torch.complex(xr[..., :half], xr[..., half:])
    z = z * torch.polar(torch.ones_like(theta[pos]), theta[pos]).unsqueeze(2)
    rot = torch.view_as_real(z).flatten(-2) if interleaved else torch.cat((z.real, z.imag), dim=-1)
    return torch.cat((rot.to(x.dtype), x[..., 2 * half :]), dim=-1)


def _contig_ref(
    q: Tensor, kc: Tensor, vc: Tensor, rows: list[int], lens: list[int], upcast: bool = True, **kw: object
) -> Tensor:
    out = []
    for b, (r, n) in enumerate(zip(rows, lens)):
        o = attention_ref(q[b : b + 1], kc[r : r + 1, :n], vc[r : r + 1, :n], upcast=upcast, **kw)[0]  # type: ignore[arg-type]
        out.append(o)
    return torch.cat(out)


@pytest.mark.parametrize(("seqlen_q", "interleaved"), [(1, True), (3, False)])
def test_contiguous_append_rotary(seqlen_q: int, interleaved: bool) -> None:
    batch, s_cache, nheads, nheads_k, d, sn = 3, 40, 8, 2, 32, 3
    kc = torch.randn(batch, s_cache, nheads_k, d)
    vc = torch.randn_like(kc)
    k, v = torch.randn(2, batch, sn, nheads_k, d).unbind(0)
    q = torch.randn(batch, seqlen_q, nheads, d)
    seqlens = torch.tensor([0, 17, 37], dtype=torch.int32)  # 37 + 3 fills the cache exactly
    theta, cos, sin = _rotary_tables(64, 16)  # partial rotary: 16 of 32 features
    exp_k, exp_v = kc.clone(), vc.clone()
    pos_k = seqlens.long()[:, None] + torch.arange(sn)
    k_rot = _rotary_ref(k, theta, pos_k, interleaved)
    for b in range(batch):
        s = int(seqlens[b])
        exp_k[b, s : s + sn], exp_v[b, s : s + sn] = k_rot[b], v[b]
    out, lse = flash_attn_with_kvcache(
        q, kc, vc, k, v, rotary_cos=cos, rotary_sin=sin, cache_seqlens=seqlens, causal=True,
        rotary_interleaved=interleaved, return_softmax_lse=True,
    )  # fmt: skip
    torch.testing.assert_close(kc, exp_k, atol=1e-6, rtol=1e-6)
    assert torch.equal(vc, exp_v)
    q_rot = _rotary_ref(q, theta, seqlens.long()[:, None] + torch.arange(seqlen_q), interleaved)
    lens = (seqlens + sn).tolist()
    ref = _contig_ref(q_rot, exp_k, exp_v, list(range(batch)), lens, causal=True)
    same = _contig_ref(q_rot, exp_k, exp_v, list(range(batch)), lens, upcast=False, causal=True)
    assert_close_to_ref(out, ref, same)
    ref_lse = torch.cat(
        [
            attention_ref(q_rot[b : b + 1], exp_k[b : b + 1, :n], exp_v[b : b + 1, :n], causal=True)[1]
            for b, n in enumerate(lens)
        ]
    )
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
    assert lse.shape == (batch, nheads, seqlen_q) and lse.is_contiguous()


@pytest.mark.parametrize("num_splits", [0, 4])
def test_paged_append_rotary_splits(num_splits: int) -> None:
    nheads, nheads_k, d, bs, sn = 8, 2, 32, 16, 2
    old = [14, 31, 64]
    kc, vc, bt, _ = make_paged_cache([n + sn for n in old], bs, nheads_k, d)
    seqlens = torch.tensor(old, dtype=torch.int32)
    k, v = torch.randn(2, 3, sn, nheads_k, d).unbind(0)
    q = torch.randn(3, 1, nheads, d)
    theta, cos, sin = _rotary_tables(80, 32)
    exp_k, exp_v = kc.clone(), vc.clone()
    k_rot = _rotary_ref(k, theta, seqlens.long()[:, None] + torch.arange(sn), False)
    for b, s in enumerate(old):
        for i in range(sn):
            p = s + i
            exp_k[bt[b, p // bs], p % bs], exp_v[bt[b, p // bs], p % bs] = k_rot[b, i], v[b, i]
    out = flash_attn_with_kvcache(
        q, kc, vc, k, v, rotary_cos=cos, rotary_sin=sin, cache_seqlens=seqlens, block_table=bt,
        causal=True, rotary_interleaved=False, num_splits=num_splits,
    )  # fmt: skip
    torch.testing.assert_close(kc, exp_k, atol=1e-6, rtol=1e-6)
    assert torch.equal(vc, exp_v)
    q_rot = _rotary_ref(q, theta, seqlens.long()[:, None], False)
    total = seqlens + sn
    ref, _ = paged_attention_ref(q_rot, exp_k, exp_v, bt, total, causal=True)
    same, _ = paged_attention_ref(q_rot, exp_k, exp_v, bt, total, causal=True, upcast=False)
    assert_close_to_ref(out, ref, same)


def test_cache_batch_idx_noncausal_window() -> None:
    """cache_batch_idx picks cache rows; non-causal with a window; int cache_seqlens."""
    nheads, nheads_k, d = 4, 4, 32
    kc = torch.randn(5, 48, nheads_k, d)
    vc = torch.randn_like(kc)
    k, v = torch.randn(2, 2, 1, nheads_k, d).unbind(0)
    q = torch.randn(2, 2, nheads, d)
    idx = torch.tensor([3, 1], dtype=torch.int32)
    exp_k, exp_v = kc.clone(), vc.clone()
    exp_k[idx.long(), 20], exp_v[idx.long(), 20] = k[:, 0], v[:, 0]
    out = flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=20, cache_batch_idx=idx, window_size=(8, 2))
    assert torch.equal(kc, exp_k) and torch.equal(vc, exp_v)
    ref = _contig_ref(q, exp_k, exp_v, [3, 1], [21, 21], window_size=(8, 2))
    same = _contig_ref(q, exp_k, exp_v, [3, 1], [21, 21], upcast=False, window_size=(8, 2))
    assert_close_to_ref(out, ref, same)


def test_read_only_full_cache_alibi_softcap_and_prefill_tiles() -> None:
    """No new k/v, cache_seqlens=None (whole cache), ALiBi + softcap; seqlen_q * group > 64 takes the
    prefill tiles."""
    nheads, nheads_k, d = 8, 2, 32
    kc, vc, bt, _ = make_paged_cache([32, 32], 16, nheads_k, d, extra_cols=0)
    full = torch.full((2,), bt.shape[1] * 16, dtype=torch.int32)
    alibi = torch.rand(2, nheads)
    for seqlen_q in (1, 20):
        q = torch.randn(2, seqlen_q, nheads, d)
        out = flash_attn_with_kvcache(q, kc, vc, block_table=bt, causal=True, alibi_slopes=alibi, softcap=5.0)
        kw = {"causal": True, "alibi_slopes": alibi, "softcap": 5.0}
        ref, _ = paged_attention_ref(q, kc, vc, bt, full, **kw)  # type: ignore[arg-type]
        same, _ = paged_attention_ref(q, kc, vc, bt, full, upcast=False, **kw)  # type: ignore[arg-type]
        assert_close_to_ref(out, ref, same)


def test_kvcache_errors() -> None:
    kc, vc, bt, sl = make_paged_cache([20, 9], 16, 2, 32)
    q = torch.randn(2, 1, 8, 32)
    k = torch.randn(2, 1, 2, 32)
    with pytest.raises(ValueError, match="cache_batch_idx"):
        flash_attn_with_kvcache(
            q, kc, vc, block_table=bt, cache_seqlens=sl, cache_batch_idx=torch.zeros(2, dtype=torch.int32)
        )
    with pytest.raises(ValueError, match="rotary"):
        flash_attn_with_kvcache(
            q,
            kc,
            vc,
            block_table=bt,
            cache_seqlens=sl,
            rotary_cos=torch.ones(8, 8),
            rotary_sin=torch.ones(8, 8),
        )
    with pytest.raises(ValueError, match="cache_seqlens"):  # appending past the table's capacity
        flash_attn_with_kvcache(
            q,
            kc,
            vc,
            k,
            k.clone(),
            block_table=bt,
            cache_seqlens=torch.tensor([20, bt.shape[1] * 16], dtype=torch.int32),
        )
    with pytest.raises(ValueError, match="k and v"):
        flash_attn_with_kvcache(q, kc, vc, k, None, block_table=bt, cache_seqlens=sl)
    with pytest.raises(TypeError, match="block_table"):
        flash_attn_with_kvcache(q, kc, vc, block_table=bt.long(), cache_seqlens=sl)
    contig = torch.randn(2, 24, 2, 32)
    with pytest.raises(ValueError, match="cache_batch_idx"):
        flash_attn_with_kvcache(
            q,
            contig,
            contig.clone(),
            cache_seqlens=sl,
            cache_batch_idx=torch.tensor([0, 2], dtype=torch.int32),
        )


def test_noncausal_rotary_rotates_all_queries_at_cache_seqlens() -> None:
    """flash-attn: not causal and not local -> every query is rotated at position cache_seqlens."""
    kc = torch.randn(2, 16, 1, 32)
    vc = torch.randn_like(kc)
    k, v = torch.randn(2, 2, 1, 1, 32).unbind(0)
    q = torch.randn(2, 2, 4, 32)
    seqlens = torch.tensor([3, 9], dtype=torch.int32)
    theta, cos, sin = _rotary_tables(16, 32)
    out = flash_attn_with_kvcache(q, kc, vc, k, v, rotary_cos=cos, rotary_sin=sin, cache_seqlens=seqlens)
    q_rot = _rotary_ref(q, theta, seqlens.long()[:, None].expand(2, 2), True)
    ref = _contig_ref(q_rot, kc, vc, [0, 1], [4, 10])
    same = _contig_ref(q_rot, kc, vc, [0, 1], [4, 10], upcast=False)
    assert_close_to_ref(out, ref, same)


def _compile_case(paged: bool) -> tuple[dict[str, object], Tensor, Tensor]:
    """Arguments of one append + attend call (new k/v, rotary, LSE) and its two caches."""
    nheads, nheads_k, d, sn = 4, 2, 32, 2
    old = [5, 20]
    if paged:
        kc, vc, bt, _ = make_paged_cache([n + sn for n in old], 8, nheads_k, d)
        extra: dict[str, object] = {
            "block_table": bt, "cache_seqlens": torch.tensor(old, dtype=torch.int32),
            "cache_leftpad": torch.tensor([0, 9], dtype=torch.int32),
        }  # fmt: skip
    else:
        kc, vc = torch.randn(2, 3, 32, nheads_k, d).unbind(0)
        extra = {"cache_batch_idx": torch.tensor([2, 0], dtype=torch.int32), "cache_seqlens": 20}
    _, cos, sin = _rotary_tables(48, 16)
    k, v = torch.randn(2, 2, sn, nheads_k, d).unbind(0)
    args = {
        "q": torch.randn(2, sn, nheads, d), "k": k, "v": v, "rotary_cos": cos, "rotary_sin": sin, "causal": True,
        "window_size": [6, 0], "return_softmax_lse": True, **extra,
    }  # fmt: skip
    return args, kc, vc


@pytest.mark.parametrize("paged", [True, False])
def test_torch_compile_fullgraph_matches_eager(paged: bool) -> None:
    """flash_attn_with_kvcache traces whole under torch.compile (the cache write and the attention
    are custom ops; flash-attn 2.x graph-breaks here) and writes and returns what eager does."""
    args, kc, vc = _compile_case(paged)
    kc2, vc2 = kc.clone(), vc.clone()
    out, lse = flash_attn_with_kvcache(k_cache=kc, v_cache=vc, **args)  # type: ignore[arg-type,misc]

    def step(k_cache: Tensor, v_cache: Tensor) -> tuple[Tensor, Tensor]:
        return flash_attn_with_kvcache(k_cache=k_cache, v_cache=v_cache, **args)  # type: ignore[arg-type,misc,return-value]

    targets: set[str] = set()

    def backend(gm: torch.fx.GraphModule, inputs: list[Tensor]) -> object:
        targets.update(str(node.target) for node in gm.graph.nodes)
        return aot_eager(gm, inputs)

    torch._dynamo.reset()
    out2, lse2 = torch.compile(step, fullgraph=True, backend=backend)(kc2, vc2)
    assert {"flashpage.reshape_and_cache.default", "flashpage.kvcache_attention.default"} <= targets, targets
    assert torch.equal(kc2, kc) and torch.equal(vc2, vc)  # the compiled graph wrote the caches in place
    assert torch.equal(out2, out) and torch.equal(lse2, lse)


def test_custom_ops_pass_opcheck() -> None:
    """The two ops' schemas, fake kernels and declared mutations agree with what they do."""
    from flashpage.ops.kvcache import _cache_append_op, _cache_attention_op

    args, kc, vc = _compile_case(paged=True)
    q, k, v, bt = args["q"], args["k"], args["v"], args["block_table"]
    assert (
        isinstance(q, Tensor) and isinstance(k, Tensor) and isinstance(v, Tensor) and isinstance(bt, Tensor)
    )
    slots = (bt.long()[:, :1] * kc.shape[1] + torch.arange(2)).reshape(-1)  # 2 tokens into each first block
    torch.library.opcheck(_cache_append_op, (k.flatten(0, 1), v.flatten(0, 1), kc, vc, slots, None, None))
    seqlens = torch.tensor([7, 22], dtype=torch.int32)
    for lse, leftpad in ((True, None), (False, torch.tensor([3, 8], dtype=torch.int32))):
        attn_args = (q, kc, vc, seqlens, None, leftpad, bt, 0.2, True, -1, 0, 0.0, None, 0, lse, None, None)
        torch.library.opcheck(_cache_attention_op, attn_args)


def test_window_size_as_a_list() -> None:
    """``window_size=[-1, -1]`` (a list, as configs often hold it) is the unbounded window: with
    rotary and no causal mask every query rotates at ``cache_seqlens``, as with the tuple."""
    args, kc, vc = _compile_case(paged=True)
    args.update(causal=False)
    outs = []
    for window in ([-1, -1], (-1, -1)):
        args["window_size"] = window
        outs.append(flash_attn_with_kvcache(k_cache=kc.clone(), v_cache=vc.clone(), **args))  # type: ignore[arg-type,misc]
    assert torch.equal(outs[0][0], outs[1][0])


@pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="inductor needs a C compiler"
)
def test_inductor_writes_the_cache_in_place() -> None:
    """Under inductor (torch.compile's default backend) the mutating cache-write op is re-inplaced:
    the generated code writes the caller's cache and copies no cache (a functionalised copy would
    cost a whole cache per call)."""
    from torch._inductor.utils import run_and_get_code

    args, kc, vc = _compile_case(paged=True)
    args.update(rotary_cos=None, rotary_sin=None, return_softmax_lse=False)
    kc2, vc2 = kc.clone(), vc.clone()
    want = flash_attn_with_kvcache(k_cache=kc2, v_cache=vc2, **args)  # type: ignore[arg-type,misc]

    def step(k_cache: Tensor, v_cache: Tensor) -> Tensor:
        return flash_attn_with_kvcache(k_cache=k_cache, v_cache=v_cache, **args)  # type: ignore[arg-type,misc,return-value]

    torch._dynamo.reset()
    got, codes = run_and_get_code(torch.compile(step, fullgraph=True), kc, vc)
    assert torch.equal(got, want) and torch.equal(kc, kc2) and torch.equal(vc, vc2)
    code = "\n".join(codes)
    assert "flashpage.reshape_and_cache.default(" in code and "flashpage.kvcache_attention.default(" in code
    assert not re.search(r"\.copy_\(|clone\(", code), code


def _leftpad_ref(
    q: Tensor, kc: Tensor, vc: Tensor, rows: list[int], starts: list[int], ends: list[int], **kw: object
) -> tuple[Tensor, Tensor, Tensor]:
    """Reference and same-precision outputs, and the reference LSE, over keys ``[start, end)`` of
    each sequence's cache row: flash-attn's left padding hides the first slots and keeps the
    bottom-right alignment and ALiBi distances of the remaining keys (a slice of the cache is the
    same attention)."""
    outs: list[list[Tensor]] = [[], [], []]
    for b, (r, lo, hi) in enumerate(zip(rows, starts, ends, strict=True)):
        alibi = kw.get("alibi_slopes")
        kwb = {**kw, "alibi_slopes": alibi[b : b + 1]} if isinstance(alibi, Tensor) else kw
        for upcast in (True, False):
            o, lse = attention_ref(
                q[b : b + 1], kc[r : r + 1, lo:hi], vc[r : r + 1, lo:hi], upcast=upcast, **kwb
            )  # type: ignore[arg-type]
            outs[0 if upcast else 1].append(o)
            if upcast:
                outs[2].append(lse)
    ref, same, ref_lse = (torch.cat(x) for x in outs)
    return ref, same, ref_lse


def test_cache_leftpad_contiguous_append_rotary_window() -> None:
    """cache_leftpad (flash-attn >= 2.6, keyword-only here) hides each sequence's first slots; new
    k/v still land at cache_seqlens and rotate at absolute positions, as flash-attn does."""
    nheads, nheads_k, d, sn, seqlen_q = 4, 2, 32, 2, 2
    kc = torch.randn(4, 40, nheads_k, d)
    vc = torch.randn_like(kc)
    idx = torch.tensor([3, 0, 2], dtype=torch.int32)
    seqlens = torch.tensor([9, 30, 17], dtype=torch.int32)
    leftpad = torch.tensor([0, 13, 17], dtype=torch.int32)  # none, mid-cache, every old slot
    k, v = torch.randn(2, 3, sn, nheads_k, d).unbind(0)
    q = torch.randn(3, seqlen_q, nheads, d)
    theta, cos, sin = _rotary_tables(64, 16)
    k_rot = _rotary_ref(k, theta, seqlens.long()[:, None] + torch.arange(sn), True)
    exp_k, exp_v = kc.clone(), vc.clone()
    for b, r in enumerate(idx.tolist()):
        s0 = int(seqlens[b])
        exp_k[r, s0 : s0 + sn], exp_v[r, s0 : s0 + sn] = k_rot[b], v[b]
    for window in ((-1, -1), (6, 0)):
        kc2, vc2 = kc.clone(), vc.clone()
        out, lse = flash_attn_with_kvcache(
            q, kc2, vc2, k, v, rotary_cos=cos, rotary_sin=sin, cache_seqlens=seqlens, cache_batch_idx=idx,
            causal=True, window_size=window, cache_leftpad=leftpad, return_softmax_lse=True,
        )  # fmt: skip
        torch.testing.assert_close(kc2, exp_k, atol=1e-6, rtol=1e-6)
        assert torch.equal(vc2, exp_v)
        q_rot = _rotary_ref(q, theta, seqlens.long()[:, None] + torch.arange(seqlen_q), True)
        ref, same, ref_lse = _leftpad_ref(
            q_rot, exp_k, exp_v, idx.tolist(), leftpad.tolist(), (seqlens + sn).tolist(), causal=True,
            window_size=window,
        )  # fmt: skip
        assert_close_to_ref(out, ref, same)
        torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_cache_leftpad_paged_alibi_softcap_splits(num_splits: int) -> None:
    """Left padding over a paged cache (flash-attn takes it on contiguous caches only): starts inside
    a page, at a page boundary and at the sequence end (no visible key: zeros), with ALiBi and
    softcap, over one and several splits."""
    nheads, nheads_k, d, bs = 8, 2, 32, 8
    lens = [21, 40, 16, 5]
    kc, vc, bt, sl = make_paged_cache(lens, bs, nheads_k, d)
    leftpad = torch.tensor([3, 16, 0, 5], dtype=torch.int32)
    alibi = torch.rand(4, nheads)
    for b, lo in enumerate(leftpad.tolist()):  # padding may be never-written memory: never read
        for p in range(lo):
            kc[bt[b, p // bs], p % bs] = float("nan")
            vc[bt[b, p // bs], p % bs] = float("nan")
    # the block table's logical caches as contiguous rows, for the reference
    rows = torch.stack([kc[bt[b].long()].flatten(0, 1) for b in range(4)])
    vrows = torch.stack([vc[bt[b].long()].flatten(0, 1) for b in range(4)])
    for seqlen_q in (1, 2):
        q = torch.randn(4, seqlen_q, nheads, d)
        kw = {"causal": True, "alibi_slopes": alibi, "softcap": 4.0}
        out = flash_attn_with_kvcache(
            q, kc, vc, cache_seqlens=sl, block_table=bt, cache_leftpad=leftpad, num_splits=num_splits, **kw
        )  # type: ignore[arg-type]
        ref, same, _ = _leftpad_ref(q, rows, vrows, [0, 1, 2, 3], leftpad.tolist(), lens, **kw)
        assert torch.equal(out[3], torch.zeros_like(out[3]))  # leftpad == cache_seqlens: nothing visible
        assert_close_to_ref(out[:3], ref[:3], same[:3])


def test_cache_leftpad_errors() -> None:
    kc = torch.randn(2, 16, 1, 32)
    q = torch.randn(2, 1, 4, 32)
    sl = torch.tensor([3, 9], dtype=torch.int32)
    with pytest.raises(TypeError, match="cache_leftpad must be an int32 tensor"):
        flash_attn_with_kvcache(q, kc, kc.clone(), cache_seqlens=sl, cache_leftpad=torch.tensor([0, 1]))
    with pytest.raises(ValueError, match=r"cache_leftpad must be \(2,\)"):
        flash_attn_with_kvcache(
            q, kc, kc.clone(), cache_seqlens=sl, cache_leftpad=torch.zeros(3, dtype=torch.int32)
        )
    # The kernel reads element b at offset b: a strided view would be read wrong, so it is refused
    # (cache_batch_idx likewise; a strided one used to pick the wrong cache rows silently).
    strided = torch.zeros(4, dtype=torch.int32)[::2]
    with pytest.raises(ValueError, match="cache_leftpad must be contiguous, got stride 2"):
        flash_attn_with_kvcache(q, kc, kc.clone(), cache_seqlens=sl, cache_leftpad=strided)
    with pytest.raises(ValueError, match="cache_batch_idx must be contiguous, got stride 2"):
        flash_attn_with_kvcache(q, kc, kc.clone(), cache_seqlens=sl, cache_batch_idx=strided)
    with pytest.raises(ValueError, match="sequence 0 has cache_leftpad=4, cache_seqlens=3"):
        flash_attn_with_kvcache(
            q, kc, kc.clone(), cache_seqlens=sl, cache_leftpad=torch.tensor([4, 0], dtype=torch.int32)
        )


_AGREE_CASES = {
    # id: (paged, d, seqlen_q, seqlen_new, options); cache lengths are [5, 0, 13].
    "contig-decode": (False, 32, 1, 0, {}),
    "contig-append-idx-rotary-causal-window-softcap-alibi-d24": (
        False, 24, 2, 2, {"idx": True, "rotary": True, "causal": True, "window_size": (3, -1),
                          "softcap": 2.0, "alibi": True},
    ),
    "contig-q-longer-than-keys-d16": (False, 16, 6, 0, {"causal": True}),
    "paged-append-causal-d16": (True, 16, 3, 2, {"causal": True}),
    "paged-q-longer-than-keys-noncausal-d16": (True, 16, 6, 0, {}),
    "paged-fp8-append-rotary-window-alibi-d8": (
        True, 8, 1, 1, {"fp8": True, "rotary": True, "window_size": (4, 0), "alibi": True},
    ),
    "paged-leftpad-append-causal-splits": (True, 32, 2, 1, {"leftpad": True, "causal": True, "num_splits": 2}),
}  # fmt: skip


@pytest.mark.parametrize("case", list(_AGREE_CASES), ids=list(_AGREE_CASES))
def test_torch_and_triton_backends_agree(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both backends take the same inputs and give the same cache, out and lse (fp32, so the
    tolerance rule's same-precision baseline is the reference itself)."""
    paged, d, seqlen_q, seqlen_new, opt = _AGREE_CASES[case]
    batch, nheads, nheads_k = 3, 4, 2
    dtype = torch.float8_e4m3fn if opt.get("fp8") else torch.float32
    if paged:
        kc, vc, bt, lens = make_paged_cache([7, 3, 15], 8, nheads_k, d, dtype=dtype)
        lens = torch.tensor([5, 0, 13], dtype=torch.int32)
    else:
        kc, vc = (torch.randn(4, 24, nheads_k, d).to(dtype) for _ in range(2))
        bt, lens = None, torch.tensor([5, 0, 13], dtype=torch.int32)
    kw: dict[str, object] = {"cache_seqlens": lens, "block_table": bt, "return_softmax_lse": True}
    kw |= {key: opt[key] for key in ("causal", "window_size", "softcap", "num_splits") if key in opt}
    if opt.get("alibi"):
        kw["alibi_slopes"] = torch.rand(nheads) * 0.5
    if opt.get("idx"):
        kw["cache_batch_idx"] = torch.tensor([2, 0, 3], dtype=torch.int32)
    if opt.get("leftpad"):
        kw["cache_leftpad"] = torch.tensor([2, 0, 4], dtype=torch.int32)
    if opt.get("rotary"):
        _theta, kw["rotary_cos"], kw["rotary_sin"] = _rotary_tables(40, d // 2)
    q = torch.randn(batch, seqlen_q, nheads, d)
    k, v = (torch.randn(batch, seqlen_new, nheads_k, d) for _ in range(2)) if seqlen_new else (None, None)
    res = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("FLASHPAGE_BACKEND", backend)
        caches = kc.clone(), vc.clone()
        out, lse = flash_attn_with_kvcache(q, *caches, k, v, **kw)  # type: ignore[arg-type,misc]
        res[backend] = (out, lse, *caches)
    out_t, lse_t, kc_t, vc_t = res["torch"]
    out_k, lse_k, kc_k, vc_k = res["triton"]
    assert torch.equal(kc_t.float(), kc_k.float()) and torch.equal(vc_t.float(), vc_k.float())
    assert_close_to_ref(out_k, out_t, out_t)
    assert torch.equal(torch.isneginf(lse_t), torch.isneginf(lse_k))
    seen = torch.isfinite(lse_t)
    torch.testing.assert_close(lse_k[seen], lse_t[seen], atol=1e-5, rtol=1e-5)
    # causal, more queries than keys: sequence 1 has no key at all, sequence 0 none in its first row
    if seqlen_q > 5 and opt.get("causal"):
        assert not out_t[1].any() and not out_t[0, 0].any()


def test_torch_backend_on_cpu_without_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default backend on CPU is the torch path: no Triton, even with the interpreter off."""
    monkeypatch.setenv("FLASHPAGE_BACKEND", "auto")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    kc, vc, bt, lens = make_paged_cache([9, 4], 8, 1, 16)
    q, k = torch.randn(2, 1, 2, 16), torch.randn(2, 1, 1, 16)
    out = flash_attn_with_kvcache(q, kc, vc, k, k, cache_seqlens=lens, block_table=bt, causal=True)
    ref = paged_attention_ref(q, kc, vc, bt, lens + 1, causal=True)[0]
    assert_close_to_ref(out, ref, ref)  # type: ignore[arg-type]
