"""The Gluon warp-specialized forward (flashpage.ops.flash_fwd_ws).

On an sm_90 GPU: results against the float32 reference with the tolerance rule (whole row tiles,
forced tail splits, causal with seqlen_k >= seqlen_q, GQA, d 64 / 128, fp16 / bf16), run-to-run
determinism, and the scope check (``ws_applies``) that sends everything else to the Triton kernel.
On any machine: the kernel compiles for sm_90 with its schedule intact (PTX in a subprocess without
TRITON_INTERPRET: Gluon does not run under the interpreter, and under it triton's jit helpers do
not compile).
"""

from __future__ import annotations

import re

import pytest
import torch

from flashpage.ops.flash_configs import FwdConfig
from flashpage.ops.flash_fwd import check_attention_inputs, flash_fwd, plan_tail_split, ws_applies
from flashpage.ops.reference import attention_ref
from flashpage.ops.utils import ws_supported
from tests.sm90_ptx import sm90_ptx
from tests.tolerance import assert_close_to_ref

WS = FwdConfig(128, 64, 4, 2, True, ws_stages=2)  # Triton fallback: 128 x 64 tiles
on_hopper = pytest.mark.skipif(
    not (torch.cuda.is_available() and ws_supported(torch.device("cuda"))),
    reason="needs an sm_90 GPU and a triton with Gluon",
)


def _qkv(b: int, sq: int, sk: int, h: int, hk: int, d: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    return tuple(
        torch.randn(b, n, heads, d, device="cuda", dtype=dtype) for n, heads in ((sq, h), (sk, hk), (sk, hk))
    )


CASES = [
    # b, sq, sk, h, hk, d, causal, dtype, resident (None: the SM count, no split at these sizes)
    (2, 256, 256, 4, 4, 128, False, torch.bfloat16, None),
    (1, 128, 512, 8, 2, 128, False, torch.bfloat16, None),
    (1, 512, 128, 4, 1, 128, False, torch.float16, None),
    (2, 384, 384, 4, 2, 128, True, torch.bfloat16, None),
    (1, 256, 640, 4, 4, 128, True, torch.float16, None),  # bottom-right causal, offset 384
    (1, 1024, 1024, 2, 2, 64, True, torch.bfloat16, None),
    (2, 256, 512, 4, 4, 64, False, torch.bfloat16, None),
    # forced tail splits: pieces spanning two tiles' key ranges, and tiles split among many pieces
    (1, 512, 1024, 3, 3, 128, False, torch.bfloat16, 5),
    (2, 256, 2048, 2, 1, 128, False, torch.bfloat16, 3),
    (1, 384, 768, 5, 5, 64, False, torch.float16, 7),
]


@on_hopper
@pytest.mark.parametrize(("b", "sq", "sk", "h", "hk", "d", "causal", "dtype", "resident"), CASES)
def test_ws_forward_matches_reference(
    b: int, sq: int, sk: int, h: int, hk: int, d: int, causal: bool, dtype: torch.dtype, resident: int | None
) -> None:
    q, k, v = _qkv(b, sq, sk, h, hk, d, dtype)
    prob = check_attention_inputs(q, k, v, causal=causal)
    out = torch.empty_like(q)
    assert ws_applies(WS, prob, q, k, v, out, None)
    if resident is not None:
        assert plan_tail_split(b * h * (sq // 128), sk // 128, resident) is not None
    out, lse = flash_fwd(q, k, v, causal=causal, config=WS, resident_programs=resident, out=out)
    ref, ref_lse = attention_ref(q, k, v, causal=causal)[:2]
    same = attention_ref(q, k, v, causal=causal, upcast=False)[0]
    assert_close_to_ref(out, ref, same)
    torch.testing.assert_close(lse, ref_lse.float(), atol=2e-3, rtol=0)
    again = flash_fwd(q, k, v, causal=causal, config=WS, resident_programs=resident)
    assert torch.equal(again[0], out) and torch.equal(again[1], lse)


@on_hopper
def test_ws_strided_views_and_backward() -> None:
    """q, k, v sliced out of one packed qkv tensor (row stride 3 * h * d), and gradients through
    the autograd path with the warp-specialized forward's LSE."""
    from flashpage.ops.flash_bwd import flash_bwd

    qkv = torch.randn(2, 256, 3, 4, 128, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv.unbind(2)
    prob = check_attention_inputs(q, k, v, causal=True)
    assert ws_applies(WS, prob, q, k, v, torch.empty_like(q), None)
    out, lse = flash_fwd(q, k, v, causal=True, config=WS)
    ref_out, ref_lse = flash_fwd(q, k, v, causal=True, config=FwdConfig(128, 64, 4, 2, True))
    torch.testing.assert_close(out, ref_out, atol=1e-2, rtol=0)
    torch.testing.assert_close(lse, ref_lse, atol=1e-3, rtol=0)
    do = torch.randn_like(out)
    grads = flash_bwd(do, q, k, v, out, lse, causal=True)
    ref_grads = flash_bwd(do, q, k, v, ref_out, ref_lse, causal=True)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, atol=3e-2, rtol=0)


@on_hopper
@pytest.mark.parametrize(
    ("shape", "opts"),
    [
        ((1, 200, 200, 2, 2, 128), {}),  # not a multiple of 128
        ((1, 256, 256, 2, 2, 96), {}),  # head dim
        ((1, 256, 128, 2, 2, 128), {"causal": True}),  # causal with seqlen_k < seqlen_q
        ((1, 256, 256, 2, 2, 128), {"window_size": (64, 0)}),
        ((1, 256, 256, 2, 2, 128), {"softcap": 5.0}),
    ],
)
def test_ws_scope_falls_back_to_triton(shape: tuple[int, ...], opts: dict) -> None:
    q, k, v = _qkv(*shape, torch.bfloat16)
    prob = check_attention_inputs(q, k, v, **opts)
    assert not ws_applies(WS, prob, q, k, v, torch.empty_like(q), None)
    out = flash_fwd(q, k, v, config=WS, **opts)[0]
    assert_close_to_ref(
        out, attention_ref(q, k, v, **opts)[0], attention_ref(q, k, v, upcast=False, **opts)[0]
    )


@pytest.mark.parametrize(
    ("d", "causal", "tail"), [(128, False, False), (128, True, False), (128, False, True)]
)
def test_ws_kernel_compiles_for_sm90_with_its_schedule(d: int, causal: bool, tail: bool) -> None:
    pytest.importorskip("triton.experimental.gluon")
    code = (
        "from flashpage.ops.flash_fwd_ws import compile_ptx; "
        f"print(compile_ptx({d}, causal={causal}, tail={tail}))"
    )
    ptx = sm90_ptx(["-c", code])
    # Three partitions in 12 warps; registers moved from the producer (24) to the consumers (240).
    assert ".reqntid 384" in ptx
    assert re.search(r"setmaxnreg.dec.sync.aligned.u32\s+24;", ptx)
    assert re.search(r"setmaxnreg.inc.sync.aligned.u32\s+240;", ptx)
    # Per consumer: the QK^T waited alone, then per step a wait for the QK^T with the PV in
    # flight (wait_group 1) and one for the PV, then the last PV.
    waits = re.findall(r"wgmma.wait_group.sync.aligned (\d+)", ptx)
    assert waits.count("1") == (4 if causal else 2), waits
    # The ping-pong: consumers arrive on each other's turn barrier after issuing their wgmmas.
    assert ptx.count("mbarrier.arrive") >= 6
