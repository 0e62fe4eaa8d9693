"""Fused RMSNorm / RoPE / SiLU-and-mul kernels against the model's PyTorch formulation."""

from __future__ import annotations

import pytest
import torch

from flashpage.models.llama import RMSNorm, apply_rope
from flashpage.ops.fused_ops import rms_norm, rope_qk, silu_and_mul

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _tol(dtype: torch.dtype) -> dict[str, float]:
    # One rounding of the activation dtype (the kernels compute in float32 where PyTorch may round
    # intermediate products to the activation dtype).
    return {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.float16: {"atol": 2e-3, "rtol": 2e-3},
            torch.bfloat16: {"atol": 1.6e-2, "rtol": 1.6e-2}}[dtype]  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [64, 96, 576])
def test_rms_norm_matches_module(dtype: torch.dtype, n: int, device: str) -> None:
    norm = RMSNorm(n, 1e-5, dtype, device)
    norm.weight.data.copy_(torch.randn(n) * 0.5 + 1)
    x = torch.randn(7, n, device=device).to(dtype)
    r = torch.randn(7, n, device=device).to(dtype)
    torch.testing.assert_close(rms_norm(x, norm.weight, 1e-5), norm(x), **_tol(dtype))
    out, h = rms_norm(x, norm.weight, 1e-5, residual=r)
    ref_out, ref_h = norm(x, r)
    # The residual sum is rounded exactly like x + r (the interpreter does not round bfloat16 like a GPU).
    exact = dtype != torch.bfloat16 or device == "cuda"
    torch.testing.assert_close(h, ref_h, **({"atol": 0, "rtol": 0} if exact else _tol(dtype)))
    torch.testing.assert_close(out, ref_out, **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("h", "hk", "d"), [(4, 2, 16), (9, 3, 64), (2, 2, 32)])
def test_rope_qk_matches_apply_rope_on_strided_views(
    dtype: torch.dtype, h: int, hk: int, d: int, device: str
) -> None:
    t = 5
    qkv = torch.randn(t, (h + 2 * hk) * d, device=device).to(dtype)  # fused QKV output: strided views
    q = qkv[:, : h * d].view(t, h, d)
    k = qkv[:, h * d : (h + hk) * d].view(t, hk, d)
    ang = torch.rand(t, d // 2, device=device) * 6.0
    for cos, sin in ((ang.cos(), ang.sin()), (ang.cos().to(dtype), ang.sin().to(dtype))):
        qo, ko = rope_qk(q, k, cos, sin)
        assert qo.is_contiguous() and ko.is_contiguous()
        torch.testing.assert_close(qo, apply_rope(q, cos, sin), **_tol(dtype))
        torch.testing.assert_close(ko, apply_rope(k, cos, sin), **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [48, 128, 2500])
def test_silu_and_mul(dtype: torch.dtype, inter: int, device: str) -> None:
    gu = torch.randn(3, 2 * inter, device=device).to(dtype) * 3
    gate, up = gu.split(inter, dim=-1)
    torch.testing.assert_close(silu_and_mul(gu), torch.nn.functional.silu(gate) * up, **_tol(dtype))


def test_launchers_name_bad_arguments(device: str) -> None:
    x = torch.randn(4, 8, device=device)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, torch.ones(7, device=device), 1e-5)
    with pytest.raises(ValueError, match="residual"):
        rms_norm(x, torch.ones(8, device=device), 1e-5, residual=torch.randn(3, 8, device=device))
    with pytest.raises(ValueError, match="x must be"):
        rms_norm(x[:, ::2], torch.ones(4, device=device), 1e-5)
    with pytest.raises(ValueError, match="int64"):
        rms_norm(x.long(), torch.ones(8, device=device), 1e-5)
    q = torch.randn(2, 4, 8, device=device)
    with pytest.raises(ValueError, match="cos"):
        rope_qk(q, q, torch.randn(2, 3, device=device), torch.randn(2, 4, device=device))
    with pytest.raises(ValueError, match="gate_up"):
        silu_and_mul(torch.randn(2, 7, device=device))


def test_model_forward_fused_equals_torch_path(device: str) -> None:
    """A whole decoder step: fused kernels vs the PyTorch ops give the same hidden states."""
    from flashpage.models.config import ModelConfig
    from flashpage.models.llama import LlamaForCausalLM
    from flashpage.ops.metadata import AttentionMetadata

    cfg = ModelConfig(
        architecture="llama", vocab_size=64, hidden_size=128, intermediate_size=96, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=32, max_position_embeddings=64, tie_word_embeddings=True,
    )  # fmt: skip
    model = LlamaForCausalLM(cfg, torch.float32, device, seed=0)
    t, bs = 6, 8
    ids = torch.randint(0, 64, (t,), device=device)
    pos = torch.arange(t, device=device)
    outs = []
    for fused in (False, True):
        caches = [
            (torch.zeros(4, bs, 2, 32, device=device), torch.zeros(4, bs, 2, 32, device=device))
            for _ in range(2)
        ]
        meta = AttentionMetadata(
            slot_mapping=torch.arange(t, device=device), block_table=torch.tensor([[0]], dtype=torch.int32, device=device),
            seqlens_k=torch.tensor([t], dtype=torch.int32, device=device),
            cu_seqlens_q=torch.tensor([0, t], dtype=torch.int32, device=device), max_seqlen_q=t, max_seqlen_k=t,
            prefix_free=True,
        )  # fmt: skip
        model.fused_ops = fused
        outs.append(model(ids, pos, caches, meta))
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)
