"""Planner decisions: split-KV counts against the H200 measurements, kernel choice per phase."""

from __future__ import annotations

import pytest
import torch

from flashpage.roofline.hardware import load_profile
from flashpage.roofline.model_shapes import get_model_shape
from flashpage.roofline.planner import (
    KernelChoice,
    choose_heads_per_program,
    choose_num_splits,
    plan,
    plan_attention,
    pow2_divisor_at_most,
)

# shared/anchors/triton-paged-decode-h200-2026-12-02.json: Triton paged split-KV decode, GQA 32q/8kv
# heads, d=128, bf16, on the H200 (132 SMs). TB/s per split count; the best is the split to pick.
H200_DECODE_SWEEP = {
    (1, 131072): {1: 0.16, 2: 0.29, 4: 0.6, 8: 1.17, 16: 2.13, 32: 3.44, 64: 3.84, 128: 3.81},
    (32, 32768): {1: 3.96, 2: 4.48, 4: 4.47, 8: 4.46, 16: 4.41, 32: 4.32},
    (64, 4096): {1: 4.18, 2: 4.15, 4: 4.02, 8: 3.9, 16: 3.78},
    (256, 4096): {1: 4.43, 2: 4.38, 4: 4.22},
}


@pytest.mark.parametrize(("batch", "ctx"), list(H200_DECODE_SWEEP))
def test_num_splits_reproduces_h200_measurements(batch: int, ctx: int) -> None:
    sweep = H200_DECODE_SWEEP[(batch, ctx)]
    best = max(sweep, key=lambda s: sweep[s])
    assert choose_num_splits(batch, 8, ctx, 132) == best
    assert choose_num_splits(batch, 8, ctx, load_profile("h200").num_sms) == best


def test_num_splits_caps() -> None:
    # wants 64 splits to fill 132 SMs, but 1024 keys / 256 per split allows only 4
    assert choose_num_splits(1, 8, 1024, 132) == 4
    assert choose_num_splits(1, 8, 1000, 132) == 2  # 1000 // 256 = 3 -> power of two below: 2
    assert choose_num_splits(1, 8, 100, 132) == 1
    assert choose_num_splits(1, 1, 10**7, 1000) == 128  # max_splits
    assert choose_num_splits(1, 1, 10**7, 1000, max_splits=32) == 32
    assert choose_num_splits(1, 8, 8192, 132, min_tokens_per_split=1024) == 8
    # a smaller GPU needs fewer splits for the same work
    assert choose_num_splits(32, 8, 32768, 108) == 1
    with pytest.raises(ValueError, match="batch"):
        choose_num_splits(0, 8, 1024, 132)


@pytest.mark.parametrize(
    ("batch", "ctx", "nheads_k", "most", "want"),
    [
        (256, 4096, 8, 4, 1),  # one head fills the GPU without a split
        (64, 4096, 8, 4, 1),
        (32, 32768, 8, 4, 4),  # one head needs splits anyway: 4 heads, 8 splits
        (1, 131072, 8, 4, 1),  # 2 heads would need 128 splits (more than 32)
        (64, 4096, 32, 16, 1),  # MHA
        (8, 32768, 32, 16, 16),  # MHA: 16 heads, 32 splits
        (1, 1024, 8, 4, 1),  # too short to fill the GPU with any: one head (most programs)
        (16, 32768, 6, 4, 2),  # 6 KV heads: powers of two dividing it
    ],
)
def test_heads_per_program_rule(batch: int, ctx: int, nheads_k: int, most: int, want: int) -> None:
    assert choose_heads_per_program(batch, nheads_k, most, ctx, 132) == want
    assert choose_heads_per_program(1, 8, 4, 131072, 132, max_splits=128) == 2  # 4 programs x 128 splits


def test_pow2_divisor_at_most() -> None:
    assert [pow2_divisor_at_most(n, 16) for n in (1, 6, 8, 12, 32, 48)] == [1, 2, 8, 4, 16, 16]
    assert (
        pow2_divisor_at_most(32, 5) == 4
        and pow2_divisor_at_most(7, 8) == 1
        and pow2_divisor_at_most(8, 0) == 1
    )


GQA = {"nheads": 32, "nheads_k": 8, "head_dim": 128}


def test_decode_kernel_choice() -> None:
    h200 = load_profile("h200")
    c = plan_attention("decode", batch=1, seqlen_q=1, seqlen_k=131072, profile=h200, **GQA)
    assert isinstance(c, KernelChoice)
    assert (c.phase, c.op, c.kernel, c.num_splits, c.bound) == (
        "decode",
        "attention",
        "paged_decode_splitkv",
        64,
        "memory",
    )
    assert c.intensity == pytest.approx(4.0, rel=1e-2)
    assert c.ridge == pytest.approx(206.1, abs=0.1)
    c = plan_attention("decode", batch=256, seqlen_q=1, seqlen_k=4096, profile=h200, **GQA)
    assert (c.kernel, c.num_splits) == ("paged_decode", 1)
    # several query tokens per sequence (speculative verification) go to the general paged kernel
    c = plan_attention("decode", batch=4, seqlen_q=8, seqlen_k=4096, profile=h200, **GQA)
    assert (c.kernel, c.num_splits) == ("paged_prefill", 1)


def test_prefill_kernel_choice() -> None:
    h200 = load_profile("h200")
    c = plan_attention(
        "prefill", batch=1, seqlen_q=4096, seqlen_k=4096, profile=h200, dtype=torch.bfloat16, **GQA
    )
    assert (c.kernel, c.num_splits, c.bound) == ("flash_fwd", 1, "compute")
    assert c.intensity > 5 * c.ridge
    c = plan_attention("prefill", batch=1, seqlen_q=4096, seqlen_k=4096, profile=h200, has_prefix=True, **GQA)
    assert c.kernel == "paged_prefill"
    c = plan_attention("prefill", batch=1, seqlen_q=512, seqlen_k=4096, profile=h200, **GQA)  # implied prefix
    assert c.kernel == "paged_prefill"
    c = plan_attention("chunked_prefill", batch=2, seqlen_q=512, seqlen_k=2048, profile=h200, **GQA)
    assert (c.kernel, c.bound) == ("paged_prefill", "compute")
    # short prefill is memory-bound on the H200 but still uses the flash kernel
    c = plan_attention("prefill", batch=1, seqlen_q=64, seqlen_k=64, profile=h200, **GQA)
    assert (c.kernel, c.bound) == ("flash_fwd", "memory")


def test_default_profile_and_dtype_handling() -> None:
    a = plan_attention("decode", batch=1, seqlen_q=1, seqlen_k=131072, **GQA)
    assert a.num_splits == 64 and a.ridge == pytest.approx(206.1, abs=0.1)  # H200 datasheet default
    b = plan_attention("decode", batch=1, seqlen_q=1, seqlen_k=131072, dtype="float32", **GQA)
    assert b.intensity == pytest.approx(a.intensity / 2, rel=1e-3)
    assert b.ridge == pytest.approx(67e12 / 4.8e12)
    # A100: 108 SMs, ridge 312 / 2.039
    c = plan_attention("decode", batch=32, seqlen_q=1, seqlen_k=32768, profile=load_profile("a100"), **GQA)
    assert c.num_splits == 1 and c.ridge == pytest.approx(312 / 2.039, rel=1e-3)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="phase"):
        plan_attention("training", batch=1, seqlen_q=1, seqlen_k=1, **GQA)
    with pytest.raises(ValueError, match="nheads_k"):
        plan_attention("decode", batch=1, seqlen_q=1, seqlen_k=16, nheads=32, nheads_k=6, head_dim=128)
    with pytest.raises(ValueError, match="dtype"):
        plan_attention("decode", batch=1, seqlen_q=1, seqlen_k=16, dtype="int8", **GQA)
    with pytest.raises(ValueError, match="fp8"):
        plan_attention(
            "decode", batch=1, seqlen_q=1, seqlen_k=16, dtype="fp8", profile=load_profile("a100"), **GQA
        )


def test_plan_for_a_model() -> None:
    p = plan(get_model_shape("llama-3-8b"), load_profile("h200"), batch=8, seq=4096)
    assert list(p) == ["prefill", "decode", "chunked_prefill"]
    for phase, choices in p.items():
        assert [c.op for c in choices] == ["attention", "qkv", "o", "gate_up", "down", "lm_head"]
        assert all(c.phase == phase for c in choices)
    assert p["prefill"][0].kernel == "flash_fwd" and p["prefill"][0].bound == "compute"
    assert p["decode"][0].kernel == "paged_decode_splitkv" and p["decode"][0].num_splits == 8
    assert all(c.bound == "memory" for c in p["decode"])  # batch 8 decode: every op bandwidth-bound
    assert all(c.bound == "compute" for c in p["prefill"][:5])
    assert p["chunked_prefill"][0].kernel == "paged_prefill"
