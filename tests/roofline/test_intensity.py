"""FLOP / byte formulas against hand-computed cases, intensity, ridge and bound."""

from __future__ import annotations

import pytest

from flashpage.roofline.hardware import load_profile
from flashpage.roofline.intensity import (
    attention_chunked_prefill_cost,
    attention_cost,
    attention_decode_cost,
    attention_prefill_cost,
    bound,
    layer_gemm_costs,
    linear_cost,
    lm_head_cost,
    model_op_costs,
    ridge,
)
from flashpage.roofline.model_shapes import get_model_shape


def test_decode_attention_hand_case() -> None:
    # b=2, ctx=10, h=4, hk=2, d=8, bf16
    c = attention_decode_cost(batch=2, ctx=10, nheads=4, nheads_k=2, head_dim=8, dtype="bf16")
    assert c.flops == 4 * 2 * 4 * 8 * 10 == 2560
    # read K and V: 2 * 10 * 2 * 8 elements; read q + write o: 2 * 4 * 8; per sequence, x2 bytes
    assert c.bytes == 2 * 2 * (2 * 10 * 2 * 8 + 2 * 4 * 8) == 1536
    assert c.intensity == pytest.approx(2560 / 1536)


@pytest.mark.parametrize("group", [1, 4, 8])
def test_decode_attention_intensity_is_group_size_in_bf16(group: int) -> None:
    c = attention_decode_cost(
        batch=4, ctx=8192, nheads=32, nheads_k=32 // group, head_dim=128, dtype="bfloat16"
    )
    assert c.intensity == pytest.approx(group, rel=1e-2)
    assert c.intensity < group  # the q/o traffic only lowers it
    c32 = attention_decode_cost(
        batch=4, ctx=8192, nheads=32, nheads_k=32 // group, head_dim=128, dtype="float32"
    )
    assert c32.intensity == pytest.approx(group / 2, rel=1e-2)


def test_prefill_attention_hand_case() -> None:
    # b=1, s=4, h=2, hk=1, d=4, bf16, causal: 2*2*h*d*s^2/2
    c = attention_prefill_cost(batch=1, seqlen=4, nheads=2, nheads_k=1, head_dim=4, dtype="bf16")
    assert c.flops == 2 * 2 * 2 * 4 * 4**2 / 2 == 256
    assert c.bytes == 2 * (2 * 4 * 2 * 4 + 2 * 4 * 1 * 4) == 192
    nc = attention_prefill_cost(
        batch=1, seqlen=4, nheads=2, nheads_k=1, head_dim=4, dtype="bf16", causal=False
    )
    assert nc.flops == 512 and nc.bytes == 192


def test_prefill_attention_4k_is_far_above_h200_ridge() -> None:
    s = get_model_shape("llama-3-8b")
    c = attention_prefill_cost(batch=1, seqlen=4096, nheads=s.heads, nheads_k=s.kv_heads, head_dim=s.head_dim)
    # s * h / (B * (h + hk)) = 4096 * 32 / (2 * 40)
    assert c.intensity == pytest.approx(4096 * 32 / 80)
    h200 = load_profile("h200")
    assert ridge(h200, "bf16") == pytest.approx(206.1, abs=0.1)
    assert c.intensity > 5 * ridge(h200)
    assert bound(c.intensity, ridge(h200)) == "compute"
    d = attention_decode_cost(batch=64, ctx=4096, nheads=s.heads, nheads_k=s.kv_heads, head_dim=s.head_dim)
    assert bound(d.intensity, ridge(h200)) == "memory"


def test_chunked_prefill_hand_case_and_consistency() -> None:
    # c=2 new tokens after p=6 cached, h=hk=d=1, bf16: pairs c*p + c^2/2 = 14
    c = attention_chunked_prefill_cost(
        batch=1, chunk=2, prefix=6, nheads=1, nheads_k=1, head_dim=1, dtype="bf16"
    )
    assert c.flops == 4 * 14 == 56
    assert c.bytes == 2 * (2 * 2 + 2 * 8) == 40
    # prefix 0 is plain prefill
    a = attention_chunked_prefill_cost(batch=3, chunk=64, prefix=0, nheads=8, nheads_k=2, head_dim=16)
    b = attention_prefill_cost(batch=3, seqlen=64, nheads=8, nheads_k=2, head_dim=16)
    assert (a.flops, a.bytes) == (b.flops, b.bytes)
    # splitting a prompt into chunks keeps the total FLOPs (the s^2/2 convention is additive)
    whole = attention_prefill_cost(batch=1, seqlen=1024, nheads=8, nheads_k=2, head_dim=16).flops
    parts = sum(
        attention_chunked_prefill_cost(batch=1, chunk=256, prefix=p, nheads=8, nheads_k=2, head_dim=16).flops
        for p in range(0, 1024, 256)
    )
    assert parts == pytest.approx(whole)


def test_linear_hand_case() -> None:
    c = linear_cost("decode", "x", tokens=3, in_features=4, out_features=5, dtype="bf16")
    assert c.flops == 2 * 3 * 4 * 5 == 120
    assert c.bytes == 2 * (3 * 4 + 4 * 5 + 3 * 5) == 94
    # decode GEMM at batch m has intensity ~ m in bf16 (weights dominate)
    d = linear_cost("decode", "x", tokens=16, in_features=4096, out_features=4096, dtype="bf16")
    assert d.intensity == pytest.approx(16, rel=1e-2)


def test_model_gemms_add_up_to_parameter_flops() -> None:
    s = get_model_shape("llama-3-8b")
    gemms = layer_gemm_costs(s, "prefill", tokens=10)
    assert [g.op for g in gemms] == ["qkv", "o", "gate_up", "down"]
    assert sum(g.flops * g.count for g in gemms) == 2 * 10 * s.layers * s.layer_params
    lm = lm_head_cost(s, "prefill", tokens=2)
    assert lm.flops == 2 * 2 * 4096 * 128256
    ops = model_op_costs(s, "decode", batch=8, seqlen_q=1, seqlen_k=4096)
    assert [o.op for o in ops] == ["attention", "qkv", "o", "gate_up", "down", "lm_head"]
    assert ops[0].count == 32 and ops[-1].count == 1


def test_bad_inputs_name_the_argument() -> None:
    with pytest.raises(ValueError, match="nheads_k"):
        attention_cost("prefill", batch=1, seqlen_q=4, seqlen_k=4, nheads=6, nheads_k=4, head_dim=8)
    with pytest.raises(ValueError, match="seqlen_k"):
        attention_cost("prefill", batch=1, seqlen_q=8, seqlen_k=4, nheads=4, nheads_k=4, head_dim=8)
    with pytest.raises(ValueError, match="batch"):
        attention_decode_cost(batch=0, ctx=4, nheads=4, nheads_k=4, head_dim=8)
    with pytest.raises(ValueError, match="prefix"):
        attention_chunked_prefill_cost(batch=1, chunk=4, prefix=-1, nheads=4, nheads_k=4, head_dim=8)
    with pytest.raises(ValueError, match="dtype"):
        linear_cost("p", "x", tokens=1, in_features=1, out_features=1, dtype="int8")
