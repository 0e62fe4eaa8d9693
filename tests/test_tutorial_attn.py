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
    monkeypatch: pytest.MonkeyPatch, tma: bool, causal: bool, config: tuple[int, int, int, int]
) -> None:
    import flashpage.bench.tutorial_attn as ta

    monkeypatch.setattr(ta, "tma_supported", lambda device: tma)
    q, k, v = (torch.randn(2, 3, 64, 32) for _ in range(3))
    out = tutorial_attention(q, k, v, causal, config)
    ref = attention_ref(*(t.transpose(1, 2) for t in (q, k, v)), causal=causal)[0].transpose(1, 2)
    assert_close_to_ref(out, ref, ref)


def test_rejects_ragged_shapes() -> None:
    q = torch.randn(1, 2, 40, 32)
    with pytest.raises(ValueError, match="multiple"):
        tutorial_attention(q, q, q, False, (32, 16, 4, 2))
