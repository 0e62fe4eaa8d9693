"""Workload bound: a hand-computed tiny case and the engine workload against the measured H200 bound."""

from __future__ import annotations

import pytest
import torch

from flashpage.roofline.hardware import HardwareProfile, load_profile
from flashpage.roofline.intensity import workload_bound
from flashpage.roofline.model_shapes import ModelShape, get_model_shape

# hidden 4, intermediate 8, 1 layer, 2 heads / 1 kv head, head_dim 2, vocab 16
TINY = ModelShape("tiny", hidden=4, intermediate=8, layers=1, heads=2, kv_heads=1, head_dim=2, vocab=16)


def _prof(peak: float, bw: float) -> HardwareProfile:
    return HardwareProfile("unit", {"bf16": peak}, bw, num_sms=1, l2_bytes=0, memory_bytes=0)


def test_tiny_workload_by_hand() -> None:
    # Weights per layer: qkv 4*(4+2*2)=32, o 4*4=16, gate_up 4*16=64, down 8*4=32 -> 144; lm_head 16*4=64.
    # Prefill (2 tokens, one request): FLOPs 2*2*144 + lm 2*4*16 + attn 4*h*d*s^2/2 = 4*2*2*2 -> 576+128+32 = 736.
    #   bytes (x2 bf16): weights 144 + activations 2 tokens * 52 + attention (2*2*2*2 + 2*2*1*2 = 24)
    #   + lm weights 64 + lm activations (4+16) -> 2*(144+104+24+64+20) = 712.  -> max(736, 712) / 1000
    # Decode s=0 (ctx 2): FLOPs 288+128+4*2*2*2 = 448; bytes 2*(144+64 + 52+20 + KV 2*2*2 + q/o 2*2*2) = 592
    # Decode s=1 (ctx 3): FLOPs 288+128+48 = 464; bytes 592 + 2*(2*1*2) = 600
    b = workload_bound(TINY, _prof(1000.0, 1000.0), [(2, 2)])
    assert b.prefill_s == pytest.approx(0.736)
    assert b.decode_s == pytest.approx(0.592 + 0.600)
    assert b.total_s == pytest.approx(0.736 + 1.192)
    assert b.useful_tokens_per_s == pytest.approx(2 / 1.928)
    assert (b.prompt_tokens, b.output_tokens, b.prefill_steps, b.decode_steps) == (2, 2, 1, 2)
    assert b.fraction_of_bound(b.useful_tokens_per_s / 2) == pytest.approx(0.5)


def test_prompts_are_chunked_across_steps() -> None:
    # max 3 tokens per step: step 1 = request 0 (2 tokens) + 1 token of request 1, step 2 = its 2nd token
    # over a 1-token prefix. Compute-only profile (huge bandwidth): FLOPs are
    # GEMMs 288*4 + lm 128*2 + attention 32 + (4*2*2*(0+0.5) = 8) + (16*(1+0.5) = 24) = 1472.
    b = workload_bound(TINY, _prof(1000.0, 1e15), [(2, 0), (2, 0)], max_batch_tokens=3)
    assert b.prefill_steps == 2
    assert b.prefill_s == pytest.approx(1.472)
    assert b.decode_s == 0.0 and b.decode_steps == 0
    # Memory-only profile: weights (144 layer + 64 lm_head elements) are read once per step, and the
    # split request's second piece re-reads its 1-token prefix K and V (2*1*2 elements) and writes
    # an extra q/o pair of one token less... net +4 elements of attention traffic; all x2 bytes.
    one = workload_bound(TINY, _prof(1e15, 1000.0), [(2, 0), (2, 0)], max_batch_tokens=8)
    two = workload_bound(TINY, _prof(1e15, 1000.0), [(2, 0), (2, 0)], max_batch_tokens=3)
    assert two.prefill_s == pytest.approx(one.prefill_s + 2 * (144 + 64 + 4) / 1000.0)


def test_decode_batches_split_at_max_batch_tokens() -> None:
    b = workload_bound(TINY, _prof(1e15, 1000.0), [(1, 1)] * 5, max_batch_tokens=2)
    assert b.decode_steps == 3  # 5 requests, at most 2 per step


def test_engine_workload_is_near_the_measured_bound() -> None:
    # The workload of shared/bench/engine_bound.py: measured bound ~6.9 s on the H200 (cuBLAS GEMMs,
    # cuDNN attention rates). The roofline is a lower bound of the same order.
    g = torch.Generator().manual_seed(0)
    inp = torch.randint(64, 1025, (256,), generator=g).tolist()
    out = torch.randint(32, 513, (256,), generator=g).tolist()
    assert (sum(inp), sum(out)) == (133527, 67769)  # as recorded in the anchors
    shape = get_model_shape("llama-3-8b")
    for hw in ("h200", "h200-measured"):
        b = workload_bound(
            shape, load_profile(hw), list(zip(inp, out)), dtype="bfloat16", max_batch_tokens=8192
        )
        assert 3.0 < b.total_s < 6.914, (hw, b)
        assert b.decode_s < 4.303  # decode at 4.27-4.8 TB/s beats the measured decode part
        assert b.prefill_steps == -(-133527 // 8192)
        assert b.decode_steps == max(out)
        if hw == "h200":  # datasheet peaks bound every measured part from below
            assert b.prefill_s < 2.611


def test_bad_requests() -> None:
    p = _prof(1.0, 1.0)
    with pytest.raises(ValueError, match="requests"):
        workload_bound(TINY, p, [])
    with pytest.raises(ValueError, match=r"requests\[1\]"):
        workload_bound(TINY, p, [(1, 1), (0, 3)])
    with pytest.raises(ValueError, match="max_batch_tokens"):
        workload_bound(TINY, p, [(1, 1)], max_batch_tokens=0)
