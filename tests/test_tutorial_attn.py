"""The benchmark's tutorial-FA2 baseline (flashpage.bench.tutorial_attn) computes attention."""

from __future__ import annotations

import pytest
import torch

from flashpage.bench.tutorial_attn import tutorial_attention
from flashpage.ops.reference import attention_ref
from tests.tolerance import assert_close_to_ref


@pytest.mark.parametrize("tma", [True, False])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("config", [(32, 16, 4, 2), (16, 16, 4, 1)])
def test_matches_reference(
    monkeypatch: pytest.MonkeyPatch, tma: bool, causal: bool, config: tuple[int, int, int, int], device: str
) -> None:
    import flashpage.bench.tutorial_attn as ta

    monkeypatch.setattr(ta, "tma_supported", lambda device: tma)
    # fp16 on a GPU (the tutorial's tl.dot runs fp32 inputs as tf32 there), fp32 under the interpreter.
    dtype = torch.float16 if device == "cuda" else torch.float32
    q, k, v = (torch.randn(2, 3, 64, 32, device=device, dtype=dtype) for _ in range(3))
    out = tutorial_attention(q, k, v, causal, config)
    qkv = [t.transpose(1, 2) for t in (q, k, v)]
    ref = attention_ref(*qkv, causal=causal)[0].transpose(1, 2)
    same = attention_ref(*qkv, causal=causal, upcast=False)[0].transpose(1, 2)
    assert_close_to_ref(out, ref, same)


def test_rejects_ragged_shapes() -> None:
    q = torch.randn(1, 2, 40, 32)
    with pytest.raises(ValueError, match="multiple"):
        tutorial_attention(q, q, q, False, (32, 16, 4, 2))
