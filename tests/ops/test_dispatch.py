"""ops.dispatch.attention: triton path == torch path == reference on engine-style step metadata."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from flashpage.ops.dispatch import attention
from flashpage.ops.metadata import AttentionMetadata
from flashpage.ops.reference import attention_ref, gather_paged_kv
from tests.ops.test_paged_decode import make_paged_cache, on_device  # noqa: F401 (autouse fixture)
from tests.tolerance import assert_close_to_ref

NHEADS, NHEADS_K, D = 8, 2, 32


def _build_step(
    specs: list[tuple[int, int]], block_size: int, share_prefix: tuple[int, int] | None, num_splits: int = 0
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, AttentionMetadata]:
    """A step over sequences ``(cached_prefix_len, new_len)``; ``share_prefix=(a, b)`` makes sequence b
    reuse sequence a's full prefix blocks (prefix caching). Returns q, k, v, k_cache, v_cache, meta."""
    lens = [p + n for p, n in specs]
    kc, vc, bt, sl = make_paged_cache(lens, block_size, NHEADS_K, D, spare_blocks=2)
    if share_prefix is not None:
        a, b = share_prefix
        shared = min(specs[a][0], specs[b][0]) // block_size
        bt[b, :shared] = bt[a, :shared]
    slots = []
    for row, (p, n) in zip(bt.tolist(), specs):
        slots += [row[t // block_size] * block_size + t % block_size for t in range(p, p + n)]
    q_lens = [n for _, n in specs]
    t = sum(q_lens)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_table=bt,
        seqlens_k=sl,
        cu_seqlens_q=torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32),
        max_seqlen_q=max(q_lens),
        max_seqlen_k=max(lens),
        decode_only=all(n == 1 for n in q_lens),
        prefix_free=all(p == 0 for p, _ in specs),
        num_splits=num_splits,
    )
    q, k, v = torch.randn(t, NHEADS, D), torch.randn(t, NHEADS_K, D), torch.randn(t, NHEADS_K, D)
    return q, k, v, kc, vc, meta


def _reference(
    q: Tensor, kc: Tensor, vc: Tensor, meta: AttentionMetadata, upcast: bool, **kw: object
) -> Tensor:
    out = torch.zeros(q.shape, dtype=torch.float32 if upcast else q.dtype)
    cu = meta.cu_seqlens_q.tolist()
    for b, n in enumerate(meta.seqlens_k.tolist()):
        kk = gather_paged_kv(kc, meta.block_table, n, b).unsqueeze(0)
        vv = gather_paged_kv(vc, meta.block_table, n, b).unsqueeze(0)
        qb = q[cu[b] : cu[b + 1]].unsqueeze(0)
        out[cu[b] : cu[b + 1]] = attention_ref(qb, kk, vv, causal=True, upcast=upcast, **kw)[0][0]  # type: ignore[arg-type]
    return out


CASES = [
    # mixed prefill / chunked prefill / decode, seqs 2 and 3 share a cached prefix
    ([(0, 7), (20, 1), (35, 12), (16, 1)], (2, 3), 0, {}),
    ([(0, 7), (20, 1), (35, 12), (16, 1)], (2, 3), 0, {"window_size": (9, 0), "softcap": 6.0}),
    ([(30, 1), (0, 1), (64, 1)], None, 0, {}),  # decode only, planner's split count
    ([(30, 1), (0, 1), (64, 1)], None, 3, {"window_size": (12, 0)}),  # decode only, 3 splits
    ([(0, 9), (0, 20)], None, 0, {}),  # prefix free: flash varlen kernel (or the paged fallback)
]


@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize(("specs", "share", "num_splits", "opts"), CASES)
def test_triton_equals_torch_equals_reference(
    monkeypatch: pytest.MonkeyPatch,
    block_size: int,
    specs: list[tuple[int, int]],
    share: tuple[int, int] | None,
    num_splits: int,
    opts: dict[str, object],
) -> None:
    q, k, v, kc, vc, meta = _build_step(specs, block_size, share, num_splits)
    expected_k, expected_v = kc.clone(), vc.clone()
    expected_k.view(-1, NHEADS_K, D)[meta.slot_mapping] = k
    expected_v.view(-1, NHEADS_K, D)[meta.slot_mapping] = v
    ref = _reference(q, expected_k, expected_v, meta, True, **opts)
    same = _reference(q, expected_k, expected_v, meta, False, **opts)
    outs = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("FLASHPAGE_BACKEND", backend)
        kc_b, vc_b = kc.clone(), vc.clone()
        outs[backend] = attention(q, k, v, kc_b, vc_b, meta, D**-0.5, **opts)  # type: ignore[arg-type]
        assert torch.equal(kc_b, expected_k) and torch.equal(vc_b, expected_v), backend
        assert_close_to_ref(outs[backend], ref, same, name=backend)
    torch.testing.assert_close(outs["triton"], outs["torch"], atol=1e-5, rtol=1e-5)


def test_skipped_slots_and_strided_inputs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative slots leave the cache alone; q/k/v may be strided views of one qkv projection."""
    monkeypatch.setenv("FLASHPAGE_BACKEND", "triton")
    _, _, _, kc, vc, meta = _build_step([(10, 1), (5, 1)], 16, None)
    qkv = torch.randn(2, (NHEADS + 2 * NHEADS_K) * D)
    q = qkv[:, : NHEADS * D].view(2, NHEADS, D)
    k = qkv[:, NHEADS * D : (NHEADS + NHEADS_K) * D].view(2, NHEADS_K, D)
    v = qkv[:, (NHEADS + NHEADS_K) * D :].view(2, NHEADS_K, D)
    meta.slot_mapping[1] = -1  # sequence 1's token is already cached (its slot keeps the old value)
    before = kc.clone()
    out = attention(q, k, v, kc, vc, meta, D**-0.5)
    slot0 = int(meta.slot_mapping[0])
    changed = (kc != before).flatten(0, 1).any(-1).any(-1).nonzero().flatten().tolist()
    assert changed == [slot0]
    ref = _reference(q, kc, vc, meta, True)
    same = _reference(q, kc, vc, meta, False)
    assert_close_to_ref(out, ref, same)


def test_decode_layers_of_one_step_share_a_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode step plans once (``meta.decode_plan``, set by the first layer when the engine gave
    none): the next layer's call relaunches the launch the first layer bound, on its own cache, and
    matches the reference; a forward's reset keeps the plan (it depends on shapes only), a plan given
    with the metadata is used as is, and the torch path's indices are rebuilt per forward."""
    from flashpage.ops import paged_plan
    from flashpage.ops.paged_launch import PagedLauncher

    monkeypatch.setenv("FLASHPAGE_BACKEND", "triton")
    q, k, v, kc, vc, meta = _build_step([(30, 1), (0, 1), (64, 1)], 16, None, num_splits=2)
    assert meta.decode_plan is None
    layers = [(kc, vc), (torch.randn_like(kc), torch.randn_like(vc))]
    outs = []
    for i, (kc_l, vc_l) in enumerate(layers):
        with monkeypatch.context() as m:
            if i:
                m.setattr(PagedLauncher, "bind", _unbound)
            outs.append(attention(q, k, v, kc_l, vc_l, meta, D**-0.5))
    plan = meta.decode_plan
    assert isinstance(plan, paged_plan.DecodePlan) and plan.num_splits == 2 and plan.bound.launch is not None
    for out, (kc_l, vc_l) in zip(outs, layers, strict=True):
        assert_close_to_ref(
            out, _reference(q, kc_l, vc_l, meta, True), _reference(q, kc_l, vc_l, meta, False)
        )
    meta.begin_forward()
    assert meta.decode_plan is plan and meta.torch_indices is None
    given = paged_plan.plan_decode(
        3, q.shape[1], kc.shape[2], D, block_size=16, max_seqlen_k=meta.max_seqlen_k, q_dtype=q.dtype,
        device=q.device, num_splits=3,
    )  # fmt: skip
    meta.decode_plan = given
    out = attention(q, k, v, *layers[0], meta, D**-0.5)
    assert meta.decode_plan is given and given.bound.launch is not None
    assert_close_to_ref(out, _reference(q, *layers[0], meta, True), _reference(q, *layers[0], meta, False))


def _unbound(*args: object, **kwargs: object) -> None:
    raise AssertionError("a later layer went through PagedLauncher.bind")
